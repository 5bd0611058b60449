"""Real conformance reports for the merge, diff and HTML tests: the cpu backend, and a wrong
backend on another chip that fails, errors, falls back and is skipped (test helper)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

import glm5_hal as hal
from glm5_hal.conformance import report, runner, suite

WRONG_CHIP = "WrongChip 9"


def wrong_rms_norm(x, weight, eps):
    """float16: one ulp added (fails where outputs are near zero); bfloat16: raises."""
    if x.dtype == torch.bfloat16:
        raise RuntimeError("kernel launch failed")
    xf = x.float()
    out = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return out + torch.finfo(x.dtype).eps if x.dtype == torch.float16 else out


def wrong_backend(name: str = "wrongvendor", chip: str = WRONG_CHIP) -> hal.Backend:
    class Wrong(hal.Backend):
        device_type, priority = "cpu", -1

        def capabilities(self):
            return hal.Capabilities(device_name=chip)

        def versions(self):
            return {"wrong_sdk": "9.1"}

    Wrong.name = name
    backend = Wrong()
    # declines 3-d inputs: a fallback
    backend.impl("rms_norm", supports=lambda x, w, eps: x.dim() == 2 or "2-d x only")(wrong_rms_norm)
    return backend


def offline_backend(name: str = "offvendor") -> hal.Backend:
    class Off(hal.Backend):
        device_type, priority = "cpu", -1

        def probe(self):
            return hal.Availability(False, "no WrongChip device found")

    Off.name = name
    return Off()


def plugin(*backends):
    import types
    module = types.ModuleType("plugin_" + "_".join(b.name for b in backends))
    module.glm5_hal_register_backends = hal.hookimpl(lambda register: [register(b) for b in backends])
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
