"""A deliberately wrong vendor plugin, and real conformance reports made with it (test helper
for the entry-point, merge, diff and HTML tests).

WRONG_VENDOR is the source of a plugin module: `wrongvendor` (on "WrongChip 9") fails
float16 cases where outputs are near zero (one ulp added), errors on every bfloat16 case
and declines 3-d inputs (fallback); `offvendor` is unavailable (one skip per op)."""
from __future__ import annotations

import json
import types
from pathlib import Path

from glm5_hal.conformance import report, runner, suite

WRONG_CHIP = "WrongChip 9"

WRONG_VENDOR = '''
import torch
import glm5_hal as hal

class Wrong(hal.Backend):
    name, device_type, priority = "wrongvendor", "cpu", -1
    def capabilities(self):
        return hal.Capabilities(device_name="WrongChip 9")
    def versions(self):
        return {"wrong_sdk": "9.1"}

class Off(hal.Backend):
    name, device_type, priority = "offvendor", "cpu", -1
    def probe(self):
        return hal.Availability(False, "no WrongChip device found")

wrong, off = Wrong(), Off()

@wrong.impl("rms_norm", supports=lambda x, w, eps: x.dim() == 2 or "2-d x only")
def rms_norm(x, weight, eps):
    if x.dtype == torch.bfloat16:
        raise RuntimeError("kernel launch failed")
    xf = x.float()
    out = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return out + torch.finfo(x.dtype).eps if x.dtype == torch.float16 else out

@hal.hookimpl
def glm5_hal_register_backends(register):
    register(wrong)
    register(off)
'''


def wrong_vendor_plugin() -> types.ModuleType:
    """WRONG_VENDOR as a module, for `hal.load_plugin`."""
    module = types.ModuleType("wrong_vendor_inproc")
    exec(WRONG_VENDOR, module.__dict__)
    return module


def run_report(backends: list[str], ops=("rms_norm",), presets=("tiny",)) -> dict:
    """A report as `glm5-hal conformance --json` writes it, for backends already registered."""
    items = suite.plan(list(backends), list(ops), list(presets))
    records = runner.run_all(items)
    command = "glm5-hal conformance " + " ".join(f"--backend {b}" for b in backends)
    meta = report.metadata(list(backends), list(ops), list(presets), "cpu", 1, command)
    return report.to_json(records, meta)


def write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path
