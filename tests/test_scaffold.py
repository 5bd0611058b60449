"""`glm5-hal new-backend` writes a plugin package whose own tests pass and that the
conformance suite judges on its own op."""
from __future__ import annotations

import subprocess
import sys

import pytest

import glm5_hal as hal
from glm5_hal.scaffold import scaffold


def test_bad_names_are_refused(tmp_path):
    for bad in ("My-Vendor", "1abc", "class", ""):
        with pytest.raises(hal.InvalidInputError, match="NAME"):
            scaffold(bad, tmp_path)
    with pytest.raises(hal.InvalidInputError, match="--device-type"):
        scaffold("okname", tmp_path, device_type="NPU!")
    scaffold("okname", tmp_path)
    with pytest.raises(hal.InvalidInputError, match="exists"):
        scaffold("okname", tmp_path)


@pytest.mark.slow
def test_scaffolded_package_installs_passes_its_tests_and_conformance(tmp_path):
    made = subprocess.run([sys.executable, "-m", "glm5_hal.cli", "new-backend", "acmechip",
                           "--dest", str(tmp_path)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    root = tmp_path / "glm5-hal-acmechip"
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(target), str(root)], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    import os
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GLM5_HAL_")}, **env}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            str(root / "tests")], capture_output=True, text=True, env=env, cwd=root)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "3 passed" in tests.stdout
    conf = subprocess.run([sys.executable, "-m", "glm5_hal.cli", "conformance", "--backend", "acmechip",
                           "--preset", "tiny"], capture_output=True, text=True, env=env)
    assert conf.returncode == 0, conf.stdout + conf.stderr
    assert "rms_norm" in conf.stdout and "pass" in conf.stdout and "fail" not in conf.stdout.split("total:")[-1]
