"""Per-call dispatch overhead: `glm5_hal.ops.<op>` against calling the implementation that
dispatch chooses directly, on the `tiny` bench inputs (small enough that the kernel itself
is cheap). The overhead is what the HAL adds: the metadata checks (a call-key lookup once the
same metadata has passed them), the decision lookup and, where the chosen implementation does
not validate indices itself, the op's data-dependent value checks, which are also timed on
their own ("value checks us": what a caller of the bare implementation would have to run for
the op's guarantees). Measured on the default path and pinned (`hal.use(<the chosen
backend>)`), in interleaved batches with the direct call; each overhead is the median over the
rounds of the per-round difference. A difference of two calls of tens to hundreds of
microseconds still moves by a few on a loaded machine, so the HAL's own cost is also measured
without a kernel: pinned to a stub backend whose implementations return at once and leave the
value checks to dispatch ("stub us", the most a pinned call can add: every check, no kernel).
The same stub shaped as a vendor backend (each implementation a `vendor_backend.Adapter` bound
to the backend, with a predicate of the kind vendor adapters declare: a `first_reason` chain over
the call's dtypes and shapes) is timed twice: with the predicate as `supports_metadata`
("vendor us": evaluated once per call key and remembered with the implementation) and as a
per-call `supports` ("per-call supports us": run on every call). `torch.ops` is the same call
through the torch custom op, for comparison."""
from __future__ import annotations

import inspect
import statistics
import types

import torch

import glm5_hal as hal
import glm5_hal.ops  # noqa: F401  (defines the ops this measures)
from glm5_hal.backend import Backend, Capabilities

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
        inputs = {op: by_op[op].make() for op in wanted}
        rows = [_measure_op(op, inputs[op], backend, repeats, min_time) for op in wanted]
        stub = _stub_overheads(inputs, repeats, min_time)
        vendor = _stub_overheads(inputs, repeats, min_time, predicate="metadata")
        per_call = _stub_overheads(inputs, repeats, min_time, predicate="per_call")
        for row in rows:
            row["stub_overhead_us"] = stub[row["op"]]
            row["vendor_stub_overhead_us"] = vendor[row["op"]]
            row["per_call_supports_overhead_us"] = per_call[row["op"]]
        return rows
    finally:
        torch.set_num_threads(threads)


STUB = "dispatch_stub"


def _stub_overheads(inputs: dict[str, tuple], repeats: int, min_time: float,
                    predicate: str | None = None) -> dict[str, float]:
    """Per op, microseconds a call through glm5_hal.ops pinned to a stub backend adds over a
    direct call of the stub (which returns None at once): the call key, the decision lookup
    and the value checks (the stub does not validate values), with no kernel time to blur it;
    the fastest of the interleaved rounds of each, since load on the machine only adds.
    predicate: None (plain implementations), or the stub as a vendor backend, its adapters
    declaring `_vendor_like_predicate` as "metadata" (`supports_metadata`) or "per_call"
    (`supports`)."""
    from ..opdef import lookup
    from ..vendor_backend import Adapter

    class DispatchStub(Backend):
        name, device_type, priority = STUB, "cpu", -10**6

        def capabilities(self) -> Capabilities:   # every dtype: the stub serves every key
            return Capabilities(dtypes=frozenset(v for v in vars(torch).values() if isinstance(v, torch.dtype)))

    stub = DispatchStub()
    for op in inputs:
        signature = lookup(op).signature
        if predicate is None:
            def returns(*args):
                return None
            returns.__signature__ = signature
            stub.impl(op)(returns)
            continue

        def adapted(backend, *args):
            return None
        adapted.__signature__ = signature.replace(parameters=[
            inspect.Parameter("backend", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            *signature.parameters.values()])
        key = "supports_metadata" if predicate == "metadata" else "supports"
        Adapter(op, adapted, **{key: _vendor_like_predicate}).bind(stub)
    plugin = types.ModuleType(STUB)
    plugin.glm5_hal_register_backends = hal.hookimpl(lambda register: register(stub))
    hal.load_plugin(plugin, STUB)
    try:
        out = {op: float("inf") for op in inputs}
        with hal.use(STUB):
            for op, args in inputs.items():
                explained = hal.explain(op, *args)
                if explained.chosen != f"{STUB}.{op}":
                    raise AssertionError(f"the dispatch stub is not chosen:\n{explained}")
            # pure CPU work, whose noise only ever adds: the fastest round of each, over three
            # passes through the ops, so that a burst of load on the machine hits one pass only
            for _ in range(3):
                for op, args in inputs.items():
                    public, direct = lookup(op).public, stub.impls[op].fn
                    samples = paired_samples([lambda: direct(*args), lambda: public(*args)],
                                             repeats=repeats, min_time=min_time / 12)
                    out[op] = min(out[op], (min(samples[1]) - min(samples[0])) * 1e6)
        return out
    finally:
        hal.unload_plugin(STUB)


def _vendor_like_predicate(backend: Backend, *args) -> "bool | str":
    """What a vendor adapter's predicate typically reads: the first tensor's dtype, rank and
    last dim, the tensors' devices, through a chain of checks."""
    from ..vendor_backend import first_reason
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    first = tensors[0]
    return first_reason(
        lambda: None if first.dtype in _STUB_DTYPES else f"dtype {first.dtype}",
        lambda: None if first.dim() >= 1 and first.shape[-1] < 2**20 else "a last dim beyond the kernel's",
        lambda: None if all(t.device == first.device for t in tensors) else "tensors on several devices")


_STUB_DTYPES = frozenset(v for v in vars(torch).values() if isinstance(v, torch.dtype))


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
             f"{'overhead us':>12} {'pinned us':>10} {'value checks us':>16} {'stub us':>8} "
             f"{'vendor us':>10} {'per-call supports us':>21} {'torch.ops us':>13}"]
    for r in rows:
        lines.append(f"{r['op']:<24} {r['chosen']:<32} {r['direct_us']:>10.2f} {r['hal_us']:>11.2f} "
                     f"{r['overhead_us']:>12.2f} {r['pinned_overhead_us']:>10.2f} "
                     f"{r['value_checks_us']:>16.2f} {r['stub_overhead_us']:>8.2f} "
                     f"{r['vendor_stub_overhead_us']:>10.2f} {r['per_call_supports_overhead_us']:>21.2f} "
                     f"{r['torch_ops_us']:>13.2f}")
    return "\n".join(lines)
