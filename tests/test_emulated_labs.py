"""scripts/emulated_conformance.py: each emulated vendor lab is installed through the
entry-point group and judged by the ordinary conformance command, one report per lab."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from emulators.labs import LABS

SCRIPT = REPO / "scripts" / "emulated_conformance.py"


def test_every_lab_registers_an_emulated_backend_under_its_own_name():
    names = {}
    for key, lab in LABS.items():
        backend = lab.backend()
        assert backend.name.endswith("_emu") and key.startswith(backend.name.removesuffix("_emu"))
        assert backend.availability().available, (key, backend.availability().reason)
        names.setdefault(backend.name, set()).add(backend.cached_capabilities().device_name)
    # one column per chip: chips of a vendor differ in their device names
    assert all(len(chips) == sum(lab.backend_name == name for lab in LABS.values()) for name, chips in names.items())


@pytest.mark.slow
def test_the_script_writes_one_report_per_lab(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--op", "rms_norm",
                           "--jobs", "2", "ascend-910B", "musa-S5000"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {p.name for p in tmp_path.iterdir()} == {"ascend-910B.json", "musa-S5000.json"}
    for key, backend in (("ascend-910B", "ascend_emu"), ("musa-S5000", "musa_emu")):
        report = json.loads((tmp_path / f"{key}.json").read_text())
        assert report["meta"]["command"].startswith(f"GLM5_HAL_DISABLE=cpu glm5-hal conformance --backend {backend} "
                                                    "--op rms_norm --preset tiny")
        records = report["records"]
        assert {r["backend"] for r in records} == {backend} and {r["op"] for r in records} == {"rms_norm"}
        assert {r["status"] for r in records} <= {"pass", "fallback"}   # declines: vendor constraints
        assert {r["impl"] for r in records if r["status"] == "pass"} == {f"{backend}.rms_norm", ""}  # "": expected errors
        assert report["meta"]["backends"][backend]["versions"]["runtime"].startswith("emulator")
    assert "ascend-910B" in proc.stdout and "ok" in proc.stdout


def test_the_script_refuses_unknown_labs(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "nosuch"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown lab(s) ['nosuch']" in proc.stderr
