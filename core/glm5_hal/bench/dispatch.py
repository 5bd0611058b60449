"""Per-call dispatch overhead: `glm5_hal.ops.<op>` against calling the implementation that
dispatch chooses directly, on the `tiny` bench inputs (small enough that the kernel itself
is cheap). The overhead is what the HAL adds: metadata checks, the data-dependent value
checks of ops that have them (unless the chosen kernel validates indices itself), the
decision lookup. Measured on the default path and pinned (`hal.use(<the chosen backend>)`),
in interleaved batches with the direct call. `torch.ops` is the same call through the torch
custom op, for comparison."""
from __future__ import annotations

import torch

import glm5_hal as hal

from .timing import paired_times

def measure(ops: tuple[str, ...] | list[str] | None = None, backend: str | None = None,
            repeats: int = 9, min_time: float = 0.1) -> list[dict]:
    """One row per op: the implementation dispatch chooses (under `hal.use(backend)` if
    given), its direct call time, the time through glm5_hal.ops (default path, and pinned to
    that implementation's backend) and through torch.ops. One thread: what is measured is the
    HAL's own cost, which the kernels' threading would only blur."""
    from .cases import cases
    by_op = {case.op: case for case in cases("tiny")}
    wanted = [op for op in (ops or by_op) if op in by_op]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [_measure_op(op, by_op[op].make(), backend, repeats, min_time) for op in wanted]
    finally:
        torch.set_num_threads(threads)


def _measure_op(op_name: str, args: tuple, backend: str | None, repeats: int, min_time: float) -> dict:
    from ..opdef import lookup
    op = lookup(op_name)
    public, flat = op.public, op.to_torch(args)
    with hal.use(backend) if backend else _no_pin():
        chosen = hal.explain(op_name, *args).chosen
        who, name = chosen.split(".", 1)
        impl = hal.get_backend(who).impls[name].fn
        with hal.use(who):   # the same backend pinned: the key carries the pin
            direct_s, pinned_s = paired_times([lambda: impl(*args), lambda: public(*args)],
                                              repeats=repeats, min_time=min_time)
        direct2_s, hal_s, torch_ops_s = paired_times(
            [lambda: impl(*args), lambda: public(*args), lambda: op.torch_op(*flat)],
            repeats=repeats, min_time=min_time)
    return {"op": op_name, "chosen": chosen, "direct_us": direct2_s * 1e6, "hal_us": hal_s * 1e6,
            "overhead_us": (hal_s - direct2_s) * 1e6, "pinned_overhead_us": (pinned_s - direct_s) * 1e6,
            "torch_ops_us": torch_ops_s * 1e6}


class _no_pin:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'op':<24} {'implementation':<32} {'direct us':>10} {'hal.ops us':>11} "
             f"{'overhead us':>12} {'pinned us':>10} {'torch.ops us':>13}"]
    for r in rows:
        lines.append(f"{r['op']:<24} {r['chosen']:<32} {r['direct_us']:>10.2f} {r['hal_us']:>11.2f} "
                     f"{r['overhead_us']:>12.2f} {r['pinned_overhead_us']:>10.2f} {r['torch_ops_us']:>13.2f}")
    return "\n".join(lines)
