"""The glm5-hal command line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import write_dist


def glm5_hal(*args, env=None):
    full = {k: v for k, v in os.environ.items() if not k.startswith("GLM5_HAL_")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "glm5_hal.cli", *args], capture_output=True,
                          text=True, env=full, timeout=300)


def test_backends_table_and_json():
    table = glm5_hal("backends")
    assert table.returncode == 0, table.stderr
    assert "reference" in table.stdout and "cpu" in table.stdout
    rows = json.loads(glm5_hal("backends", "--json").stdout)
    cpu = next(r for r in rows if r["name"] == "cpu")
    assert cpu["available"] and "rms_norm" in cpu["ops"] and cpu["capabilities"]["dist_backend"] == "gloo"


def test_backends_reports_settings_errors_cleanly():
    proc = glm5_hal("backends", env={"GLM5_HAL_DISABLE": "nosuch"})
    assert proc.returncode == 2
    assert "glm5-hal: error:" in proc.stderr and "nosuch" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_doctor_on_a_healthy_machine():
    proc = glm5_hal("doctor")
    assert proc.returncode == 0, proc.stderr
    assert "torch       2." in proc.stdout and "findings: none" in proc.stdout
    report = json.loads(glm5_hal("doctor", "--json").stdout)
    assert report["native_extension"]["openmp"] in (True, False)
    assert report["native_extension"]["tensor_reading"] == "getters"   # else a finding
    assert "tensors read through the getters" in proc.stdout
    assert {r["name"] for r in report["backends"]} >= {"reference", "cpu"}


BRIDGE = '''
raise RuntimeError("Failed to load the backend extension: fakebridge. You can disable "
                   "extension auto-loading with TORCH_DEVICE_BACKEND_AUTOLOAD=0.")
'''


def test_doctor_explains_a_bridge_that_breaks_import_torch(tmp_path):
    """Simulates torch_npu without CANN: a `torch.backends` autoload entry point whose
    import fails makes `import torch` raise; doctor must still run and explain it."""
    site = tmp_path / "site"
    write_dist(site, "fakebridge", "fakebridge", "def _autoload():\n" + "\n".join(
        "    " + ln for ln in BRIDGE.strip().splitlines()) + "\n", {})
    info = next(site.glob("*.dist-info"))
    (info / "entry_points.txt").write_text("[torch.backends]\nfakebridge = fakebridge:_autoload\n")
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    broken = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True,
                            env={**os.environ, **env})
    assert broken.returncode != 0 and "Failed to load the backend extension" in broken.stderr
    proc = glm5_hal("doctor", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "imports only with TORCH_DEVICE_BACKEND_AUTOLOAD=0" in proc.stdout
    assert "fakebridge = fakebridge:_autoload" in proc.stdout
    assert "torch_npu installed without the CANN toolkit" in proc.stdout
    assert "cpu    available" in proc.stdout  # backends still listed, with autoload off
