"""Running one case for one backend, and many items in parallel.

`run_case` is the core both entry points share: it builds the inputs, asks dispatch (pinned
to the backend) which implementation it would choose, runs the op, runs the reference on
the upcast inputs and applies the case's rules. Only the backend's *own* implementation can
pass: when dispatch would choose anything else the status is `fallback`.
"""
from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
import os
import re
import time
from typing import Any, Callable, Sequence

import torch

from ..backend import ANY_DEVICE
from ..errors import HalError, InvalidInputError
from ..opdef import lookup
from ..registry import static_rejection
from .case import ERROR as EXPECT_ERROR, RESULT, RESULT_OR_ERROR, Case, View, dtype_name
from .compare import UPCAST_DTYPES, Context, Verdict, exact
from .record import ERROR, FAIL, FALLBACK, PASS, SKIP, Record
from .suite import Item

#: where the reference runs and the dtype floating inputs are upcast to: float64 on the CPU, or
#: float64 on an NVIDIA GPU (--ref cuda: the same numbers, faster for big cases, and the way to
#: judge a vendor backend against the CUDA reference on a machine that has both)
REFERENCE_MODES = {"cpu": ("cpu", torch.float64), "cuda": ("cuda", torch.float64)}
_TARGET = re.compile(r"([A-Za-z_]\w*)(?:\[(\d+)\])?")


def check_reference_mode(ref: str) -> None:
    if ref not in REFERENCE_MODES:
        raise HalError(f"conformance: reference mode must be one of {sorted(REFERENCE_MODES)}, got {ref!r}")
    if ref == "cuda":
        reason = _no_nvidia_gpu()
        if reason:
            raise HalError(f"conformance: --ref cuda needs a CUDA device (an NVIDIA GPU), but {reason}; use "
                           "--ref cpu (float64 on the CPU)")


def _no_nvidia_gpu() -> str | None:
    """Why torch's `cuda` device cannot hold the CUDA reference here (None: it can). ROCm, DCU
    and Kunlun builds also present `cuda` devices; the CUDA reference is NVIDIA's."""
    from ..vendors import cuda_flavor
    flavor = cuda_flavor(torch)
    if flavor == "none":
        return f"torch {torch.__version__} is a CPU build"
    if flavor != "cuda":
        return f"torch's `cuda` device here is a {flavor} device ({torch.__version__})"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False here"
    return None


def run_item(item: Item, ref: str = "cpu") -> Record:
    if item.case is None:
        status, reason = item.blocked
        return Record(item.backend, "", item.op, item.id, "", "", status, reason)
    return run_case(item.backend, item.case, ref)


def run_case(backend: str, case: Case, ref: str = "cpu") -> Record:
    """Runs `case` on `backend`'s own implementation and judges it against the reference."""
    import glm5_hal as hal

    start = time.perf_counter()
    record = Record(backend, "", case.op, case.id, case.preset, dtype_name(case.dtype), ERROR,
                    note=case.note)
    try:
        b = hal.get_backend(backend)
        avail = b.availability()
        if not avail.available:
            record.status, record.reason = SKIP, f"backend unavailable: {avail.reason}"
            return record
        caps = b.cached_capabilities()
        if case.dtype.is_floating_point and caps.dtypes and case.dtype not in caps.dtypes:
            record.status = SKIP
            record.reason = (f"device {caps.device_name or b.device_type} does not support "
                             f"{dtype_name(case.dtype)}")
            return record
        # The decision's static part, as dispatch words it. Expected-error cases are rejected
        # by the op's checks before any backend runs; without this, a backend lacking the op
        # would collect passes for them.
        declined = static_rejection(b, case.op, b.device_type, case.dtype)
        if declined is not None:
            record.status, record.reason = FALLBACK, declined
            return record
        device = _device(b.device_type)
        record.device = _device_label(device)
        op = lookup(case.op)
        cpu_args = case.make_inputs()
        record.inputs = describe_inputs(list(op.signature.parameters), cpu_args)
        args = _to_device(cpu_args, device)
        _judge(record, case, op, cpu_args, args, device, ref)
    except Exception as exc:  # a case must never take the run down
        record.status, record.reason = ERROR, f"{type(exc).__name__}: {exc}"
    finally:
        record.duration_ms = round((time.perf_counter() - start) * 1e3, 3)
    return record


def _judge(record: Record, case: Case, op, cpu_args: tuple, args: tuple, device: torch.device,
           ref: str) -> None:
    import glm5_hal as hal

    names = list(op.signature.parameters)
    mutated = _mutated_args(op)
    own = f"{record.backend}.{case.op}"
    with hal.use(record.backend):
        explanation = hal.explain(case.op, *args)
        record.impl = explanation.chosen or ""
        # chosen is None when the op's own checks reject the inputs: the call raises below
        if explanation.chosen is not None and explanation.chosen != own:
            record.status = FALLBACK
            record.reason = next((why for who, why in explanation.rejected if who == own),
                                 f"dispatch chose {explanation.chosen}")
            return
        before = {n: _snapshot(args[names.index(n)]) for n in mutated}
        raised = None
        try:
            with torch.no_grad():
                result = op.public(*args)
            _sync(device)
        except InvalidInputError as exc:
            raised = exc
        except Exception as exc:
            record.status, record.reason = ERROR, f"{type(exc).__name__}: {exc}"
            return

    if raised is not None:
        if case.outcome == RESULT:
            record.status = ERROR
            record.reason = f"raised InvalidInputError on a valid input: {raised}"
            return
        changed = [n for n in mutated if not exact(_cpu(args[names.index(n)]), before[n]).ok]
        if changed:
            record.status = FAIL
            record.reason = f"raised InvalidInputError but modified {changed}: {raised}"
            return
        if case.outcome == EXPECT_ERROR and case.error_arg and raised.arg != case.error_arg:
            record.status = FAIL
            record.reason = f"raised InvalidInputError naming {raised.arg!r}, expected {case.error_arg!r}: {raised}"
            return
        record.status = PASS
        record.reason = f"rejected with InvalidInputError: {raised}"
        return
    if case.outcome == EXPECT_ERROR:
        record.status = FAIL
        record.reason = "returned, but the contract requires InvalidInputError" + (
            f" ({case.note})" if case.note else "")
        return

    missing = sorted(set(mutated) - {t.split("[")[0] for t in case.checks})
    if missing:
        raise HalError(f"case definition: in-place destination(s) {missing} are not checked")
    modified = [n for n, a, c in zip(names, args, cpu_args)
                if n not in mutated and not _unmodified(a, c)]
    ref_args = _reference_inputs(cpu_args, ref)
    with torch.no_grad():
        ref_result = op.reference(*ref_args)

    got = functools.partial(_resolve, result=result, args=args, names=names)
    want = functools.partial(_resolve, result=ref_result, args=ref_args, names=names)
    ctx = Context(got, want, ref_args)
    pristine = functools.partial(_resolve, result=None, args=tuple(_pristine(a) for a in cpu_args),
                                 names=names)
    verdicts: list[tuple[str, Verdict]] = []
    for target, rule in case.checks.items():
        w = want(target)
        expected = rule.dtype or (pristine(target).dtype if target.split("[")[0] != "out"
                                  else case.dtype if w.dtype in UPCAST_DTYPES else w.dtype)
        verdicts.append((target, rule.judge(got(target), w, expected, ctx)))
    _summarise(record, verdicts)
    if modified:
        record.status = FAIL
        record.reason = f"modified its input(s) {modified}" + (f"; {record.reason}" if record.reason else "")


def _summarise(record: Record, verdicts: list[tuple[str, Verdict]]) -> None:
    failing = [(t, v) for t, v in verdicts if not v.ok]
    record.status = FAIL if failing else PASS
    record.reason = "; ".join(f"{t}: {v.message}" for t, v in failing)
    key = lambda tv: (not tv[1].ok, tv[1].margin if tv[1].margin is not None else -1.0)
    target, worst = max(verdicts, key=key)
    for field in ("max_abs", "max_rel", "atol", "rtol", "margin", "swaps"):
        setattr(record, field, getattr(worst, field))
    record.worst = dict(worst.worst, target=target) if worst.worst else None
    record.outputs = [{"target": t, "ok": v.ok, "tolerance": v.tolerance, "max_abs": v.max_abs,
                       "max_rel": v.max_rel, "margin": v.margin, "swaps": v.swaps,
                       "message": v.message} for t, v in verdicts]


# -- inputs, outputs and devices -------------------------------------------------------------
_SHOWN_VALUES = 8   # integer tensors up to this many elements are shown with their values


def describe_inputs(names: list[str], cpu_args: tuple) -> str:
    """The arguments as the op sees them, for a report: `x=bfloat16[3, 17] strides (34, 2)`,
    small integer tensors with their values, scalars as they are."""
    return ", ".join(f"{n}={_describe(a)}" for n, a in zip(names, _pristine(cpu_args)))


def _describe(a: Any) -> str:
    if isinstance(a, tuple):
        return "(" + ", ".join(_describe(x) for x in a) + ")"
    if not isinstance(a, torch.Tensor):
        return repr(a)
    text = f"{dtype_name(a.dtype)}{list(a.shape)}"
    if not a.is_contiguous():
        text += f" strides {tuple(a.stride())}"
    if a.storage_offset():
        text += f" offset {a.storage_offset()}"
    if not a.is_floating_point() and 0 < a.numel() <= _SHOWN_VALUES:
        text += f" = {a.tolist()}"
    return text


def _device(device_type: str) -> torch.device:
    return torch.device("cpu" if device_type in ("cpu", ANY_DEVICE) else device_type)


def _device_label(device: torch.device) -> str:
    if device.type == "cpu" or device.index is not None:
        return str(device)
    module = getattr(torch, device.type, None)
    current = getattr(module, "current_device", None)
    return f"{device.type}:{current()}" if callable(current) else str(device)


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        sync = getattr(getattr(torch, device.type, None), "synchronize", None)
        if callable(sync):
            sync()


def _to_device(a: Any, device: torch.device) -> Any:
    """Fresh copies, so that the CPU originals stay pristine for the reference and checks."""
    if isinstance(a, View):
        return a.on(a.base.to(device, copy=True))
    if isinstance(a, torch.Tensor):
        return a.to(device, copy=True)
    if isinstance(a, tuple):
        return tuple(_to_device(x, device) for x in a)
    return a


def _reference_inputs(cpu_args: tuple, ref: str) -> tuple:
    device, dtype = REFERENCE_MODES[ref]

    def up(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, dtype if t.dtype in UPCAST_DTYPES else t.dtype, copy=True)

    def convert(a: Any) -> Any:
        if isinstance(a, View):
            return a.on(up(a.base))
        if isinstance(a, torch.Tensor):
            return up(a)
        if isinstance(a, tuple):
            return tuple(convert(x) for x in a)
        return a
    return tuple(convert(a) for a in cpu_args)


def _pristine(a: Any) -> Any:
    if isinstance(a, View):
        return a.on(a.base)
    if isinstance(a, tuple):
        return tuple(_pristine(x) for x in a)
    return a


def _unmodified(arg: Any, cpu_arg: Any) -> bool:
    if isinstance(arg, torch.Tensor):
        return exact(_cpu(arg), _pristine(cpu_arg)).ok
    if isinstance(arg, tuple):
        return all(_unmodified(a, c) for a, c in zip(arg, cpu_arg))
    return True


def _cpu(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu()
    if isinstance(v, tuple):
        return tuple(_cpu(x) for x in v)
    return v


def _snapshot(v: Any) -> Any:
    return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else _cpu(v)


def _resolve(target: str, *, result: Any, args: Sequence, names: list[str]) -> Any:
    m = _TARGET.fullmatch(target)
    if m is None:
        raise HalError(f"case definition: bad target {target!r} (use out, out[i] or an argument name)")
    base, index = m.group(1), m.group(2)
    if base == "out":
        value = result
    elif base in names:
        value = args[names.index(base)]
    else:
        raise HalError(f"case definition: target {target!r} is neither 'out' nor an argument ({names})")
    if index is not None:
        value = value[int(index)]
    return _cpu(value)


@functools.lru_cache(maxsize=None)
def _mutated_names(op_name: str) -> tuple[str, ...]:
    args = lookup(op_name).torch_op._schema.arguments
    return tuple(a.name for a in args if a.alias_info is not None and a.alias_info.is_write)


def _mutated_args(op) -> list[str]:
    """The op's in-place destinations, from the `(a!)` annotations of its torch schema."""
    names = set(op.signature.parameters)
    return [n for n in _mutated_names(op.name) if n in names]


# -- many items ----------------------------------------------------------------------------
def run_all(items: list[Item], ref: str = "cpu", *, workers: int = 1,
            choices: tuple[list[str], list[str], list[str]] | None = None,
            on_record: Callable[[int, Record], None] | None = None) -> list[Record]:
    """Records for `items`, in item order. With workers > 1, spawned worker processes rebuild
    the same plan from `choices` (backends, ops, presets) and run shares of it; the records
    are the same as with one process (durations aside)."""
    check_reference_mode(ref)
    records: list[Record | None] = [None] * len(items)
    if workers <= 1 or len(items) <= 1:
        for i, item in enumerate(items):
            records[i] = run_item(item, ref)
            if on_record:
                on_record(i, records[i])
        return records  # type: ignore[return-value]
    if choices is None:
        raise HalError("conformance: run_all with workers > 1 needs the plan's choices")
    ctx = multiprocessing.get_context("spawn")
    fingerprint = [item.test_name for item in items]
    chunk = max(1, min(16, len(items) // (workers * 8)))
    chunks = [list(range(i, min(i + chunk, len(items)))) for i in range(0, len(items), chunk)]
    counter = ctx.Value("i", 0)
    with concurrent.futures.ProcessPoolExecutor(
            max_workers=workers, mp_context=ctx, initializer=_init_worker,
            initargs=(choices, ref, fingerprint, workers, counter)) as pool:
        futures = [pool.submit(_run_chunk, c) for c in chunks]
        for future in concurrent.futures.as_completed(futures):
            for i, record in future.result():
                records[i] = record
                if on_record:
                    on_record(i, records[i])
    return records  # type: ignore[return-value]


_WORKER: dict = {}


def _init_worker(choices, ref, fingerprint, workers, counter) -> None:
    from . import suite
    with counter.get_lock():
        index = counter.value
        counter.value += 1
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    pin_worker_device(index)
    items = suite.plan(*choices)
    if [item.test_name for item in items] != fingerprint:
        _WORKER["error"] = ("conformance: a worker process planned different items than the parent "
                            "(backends loaded at run time with load_plugin are invisible to worker "
                            "processes); run with -n 1")
    _WORKER.update(items=items, ref=ref)


def _run_chunk(indices: list[int]) -> list[tuple[int, Record]]:
    if "error" in _WORKER:
        raise HalError(_WORKER["error"])
    return [(i, run_item(_WORKER["items"][i], _WORKER["ref"])) for i in indices]


def pin_worker_device(index: int) -> None:
    """Spreads workers over the accelerators when there are several (worker i -> device i % n)."""
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if accelerator is None:
        return
    count = torch.accelerator.device_count()
    if count > 1:
        torch.accelerator.set_device_index(index % count)
