"""Per-call dispatch overhead: `glm5_hal.ops.<op>` against calling the chosen
implementation directly, on inputs small enough that the kernel itself is cheap."""
from __future__ import annotations

import torch

import glm5_hal as hal

from .timing import median_time


def measure(repeats: int = 9) -> list[dict]:
    x, w = torch.randn(4, 64), torch.randn(64)
    rows = []
    cases = [("rms_norm", "cpu", (x, w, 1e-5)), ("rms_norm", "reference", (x, w, 1e-5))]
    for op_name, backend, args in cases:
        with hal.use(backend):
            chosen = hal.explain(op_name, *args).chosen
            impl = hal.get_backend(chosen.split(".")[0]).impls[op_name].fn
            public = getattr(hal.ops, op_name)
            direct_s = median_time(lambda: impl(*args), repeats=repeats)
            hal_s = median_time(lambda: public(*args), repeats=repeats)
        torch_op = getattr(torch.ops.glm5_hal, op_name).default
        torch_ops_s = median_time(lambda: torch_op(*args), repeats=repeats)
        rows.append({"op": op_name, "chosen": chosen, "direct_us": direct_s * 1e6,
                     "hal_us": hal_s * 1e6, "overhead_us": (hal_s - direct_s) * 1e6,
                     "torch_ops_us": torch_ops_s * 1e6})
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'op':<10} {'implementation':<20} {'direct us':>10} {'hal.ops us':>11} "
             f"{'overhead us':>12} {'torch.ops us':>13}"]
    for r in rows:
        lines.append(f"{r['op']:<10} {r['chosen']:<20} {r['direct_us']:>10.2f} {r['hal_us']:>11.2f} "
                     f"{r['overhead_us']:>12.2f} {r['torch_ops_us']:>13.2f}")
    return "\n".join(lines)
