"""Per-call dispatch overhead: `glm5_hal.ops.<op>` against calling the implementation that
dispatch chooses directly, on the `tiny` bench inputs (small enough that the kernel itself
is cheap). The overhead is what the HAL adds: the metadata checks (a call-key lookup once the
same metadata has passed them), the decision lookup and, where the chosen implementation does
not validate indices itself, the op's data-dependent value checks, which are also timed on
their own ("value checks us": what a caller of the bare implementation would have to run for
the op's guarantees). Measured on the default path and pinned (`hal.use(<the chosen
backend>)`), in interleaved batches with the direct call; each overhead is the median over the
rounds of the per-round difference. `torch.ops` is the same call through the torch custom op,
for comparison."""
from __future__ import annotations

import statistics

import torch

import glm5_hal as hal

from .timing import paired_difference, paired_samples


def measure(ops: tuple[str, ...] | list[str] | None = None, backend: str | None = None,
            repeats: int = 21, min_time: float = 0.2) -> list[dict]:
    """One row per op: the implementation dispatch chooses (under `hal.use(backend)` if
    given), its direct call time, the time through glm5_hal.ops (default path, and pinned to
    that implementation's backend), the value checks dispatch runs before it (0 if none) and
    the time through torch.ops. One thread: what is measured is the HAL's own cost, which the
    kernels' threading would only blur."""
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
        explained = hal.explain(op_name, *args)
        who, name = explained.chosen.split(".", 1)
        impl = hal.get_backend(who).impls[name]
        checks = op.decision(explained.key).check_values
        checks = None if impl.validates_values else checks
        with hal.use(who):   # the same backend pinned: the key carries the pin
            pinned = paired_samples([lambda: impl.fn(*args), lambda: public(*args)],
                                    repeats=repeats, min_time=min_time)
        timed = paired_samples([lambda: impl.fn(*args), lambda: public(*args), lambda: op.torch_op(*flat)],
                               repeats=repeats, min_time=min_time)
        checks_s = (statistics.median(paired_samples([lambda: checks(*args)], repeats=repeats,
                                                     min_time=min_time / 3)[0]) if checks else 0.0)
    return {"op": op_name, "chosen": explained.chosen, "direct_us": statistics.median(timed[0]) * 1e6,
            "hal_us": statistics.median(timed[1]) * 1e6,
            "overhead_us": paired_difference(timed, 1, 0) * 1e6,
            "pinned_overhead_us": paired_difference(pinned, 1, 0) * 1e6,
            "value_checks_us": checks_s * 1e6,
            "torch_ops_us": statistics.median(timed[2]) * 1e6}


class _no_pin:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'op':<24} {'implementation':<32} {'direct us':>10} {'hal.ops us':>11} "
             f"{'overhead us':>12} {'pinned us':>10} {'value checks us':>16} {'torch.ops us':>13}"]
    for r in rows:
        lines.append(f"{r['op']:<24} {r['chosen']:<32} {r['direct_us']:>10.2f} {r['hal_us']:>11.2f} "
                     f"{r['overhead_us']:>12.2f} {r['pinned_overhead_us']:>10.2f} "
                     f"{r['value_checks_us']:>16.2f} {r['torch_ops_us']:>13.2f}")
    return "\n".join(lines)
