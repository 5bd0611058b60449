"""Times one op three ways in the same run -- the reference (eager), `torch.compile` of the
reference, and every available backend's own implementation (plus any baselines a case names,
e.g. torch's own path for the same result) -- and relates each to the machine's limits and to
torch's peers measured in the same run (glm5_hal.bench.roofline). Ratios are the result;
absolute times vary from machine to machine. Inputs are built on the CPU and moved to the
device under test (`device`); on an accelerator every timed batch ends with a device
synchronisation."""
from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import statistics
import warnings
from typing import Callable, Iterable

import torch

import glm5_hal as hal

from .. import memory_env
from .roofline import Roofline, synchronizer
from .timing import batch_times


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One op at one shape. `make()` returns the op's positional arguments.
    flops / nbytes: the work and the bytes that must move at least once (read + written);
    the roofline percentage is taken against whichever bound is slower.
    compute: the arithmetic of the flops ("fp32", "bf16" -- FP8 included, converted exactly --
    or "int8"), which picks the machine's rate they are held to.
    compile_reference: False where torch.compile of the reference is impractical (minutes,
    gigabytes); the table then says so.
    baselines: (label, fn) pairs timed on the same arguments, `fn(*args)` -- another way to the
    same result (e.g. torch: dequantize, then a bf16 matmul).
    rotate: calls cycle through this many independently made argument sets, so that inputs
    larger together than the last-level cache come from memory (decode reads its weights
    once per step, never from cache)."""
    label: str
    make: Callable[[], tuple]
    flops: float = 0.0
    nbytes: float = 0.0
    compute: str = "fp32"
    compile_reference: bool = True
    baselines: tuple[tuple[str, Callable[..., object]], ...] = ()
    rotate: int = 1
    op: str = ""   # set by the case registry (glm5_hal.bench.cases)


@dataclasses.dataclass
class Timing:
    who: str               # "reference", "compiled", a backend's implementation or a baseline
    ms: float | None
    vs_reference: float | None = None   # reference time / this time (higher is faster)
    roofline_pct: float | None = None   # of the machine's binding limit
    bound: str = ""                     # "flops" or "bytes"
    torch_pct: float | None = None      # of torch's peer (its GEMM / copy_)
    note: str = ""
    peak_flops_pct: float | None = None  # % of the datasheet's compute peak (where known)
    peak_bytes_pct: float | None = None  # % of the datasheet's memory bandwidth (where known)
    min_ms: float | None = None          # the fastest and slowest of the repeats (ms: their median)
    max_ms: float | None = None


def candidate_backends(only: Iterable[str] | None = None, device_type: str = "cpu") -> list[str]:
    """Available non-reference backends whose kernels take `device_type` tensors, or the
    `only` ones (an unknown or unavailable name is an error)."""
    if only:
        names = list(only)
        for name in names:
            backend = hal.get_backend(name)   # raises for an unknown name
            avail = backend.availability()
            if not avail.available:
                from ..errors import BackendUnavailableError
                raise BackendUnavailableError(f"bench --backend {name}: not available: {avail.reason}")
        return [n for n in names if n != "reference"]
    return [r.name for r in hal.backends()
            if r.available and r.name != "reference" and r.device_type in (device_type, "*")]


def to_device(a, device: torch.device):
    if isinstance(a, torch.Tensor):
        return a.to(device)
    if isinstance(a, (tuple, list)):
        return type(a)(to_device(x, device) for x in a)
    return a


def run_case(case: BenchCase, roofline: Roofline, backends: list[str], *,
             compile_reference: bool = True, repeats: int = 5, min_time: float = 0.2,
             device: str = "cpu") -> list[Timing]:
    dev = torch.device(device)
    arg_sets = [to_device(case.make(), dev) for _ in range(max(1, case.rotate))]
    try:
        return _run(case, arg_sets, roofline, backends, compile_reference, repeats, min_time, synchronizer(dev))
    finally:
        del arg_sets
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _cycling(fn: Callable[..., object], arg_sets: list[tuple]) -> Callable[[], object]:
    """fn called on the argument sets in turn."""
    if len(arg_sets) == 1:
        args = arg_sets[0]
        return lambda: fn(*args)
    it = itertools.cycle(arg_sets)
    return lambda: fn(*next(it))


def _run(case, arg_sets, roofline, backends, compile_reference, repeats, min_time, sync) -> list[Timing]:
    reference = getattr(hal.reference, case.op)
    public = getattr(hal.ops, case.op)
    args = arg_sets[0]
    rows = [_timed("reference", _cycling(reference, arg_sets), case, roofline, repeats, min_time, sync)]
    if compile_reference and case.compile_reference:
        torch._dynamo.reset()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compiled = torch.compile(reference, dynamic=False)
                compiled(*args)
            rows.append(_timed("compiled", _cycling(compiled, arg_sets), case, roofline, repeats, min_time, sync))
        except Exception as exc:  # a reference torch.compile cannot handle is reported, not fatal
            rows.append(Timing("compiled", None, note=f"torch.compile failed: {type(exc).__name__}"))
        finally:
            torch._dynamo.reset()
    elif compile_reference:
        rows.append(Timing("compiled", None, note="skipped: compiling this reference takes minutes at this size"))
    for name in backends:
        with hal.use(name):
            chosen = hal.explain(case.op, *args).chosen
            if not chosen or not chosen.startswith(name + "."):
                rows.append(Timing(name, None, note=f"not implemented here (runs {chosen})"))
                continue
            rows.append(_timed(chosen, _cycling(public, arg_sets), case, roofline, repeats, min_time, sync))
    for label, fn in case.baselines:
        rows.append(_timed(label, _cycling(fn, arg_sets), case, roofline, repeats, min_time, sync))
    ref_ms = rows[0].ms
    for r in rows:
        if r.ms and ref_ms:
            r.vs_reference = ref_ms / r.ms
    return rows


def _timed(who: str, fn: Callable[[], object], case: BenchCase, roofline: Roofline,
           repeats: int, min_time: float, sync: Callable[[], None] | None = None) -> Timing:
    try:
        samples = batch_times(fn, repeats=repeats, min_time=min_time, sync=sync)
    except Exception as exc:  # noqa: BLE001  (one failing implementation must not end the run)
        return Timing(who, None, note=f"failed: {type(exc).__name__}: {str(exc)[:120]}")
    seconds = statistics.median(samples)
    spread = dict(min_ms=min(samples) * 1e3, max_ms=max(samples) * 1e3)
    if not (case.flops or case.nbytes):
        return Timing(who, seconds * 1e3, **spread)
    pct, bound = roofline.percent(seconds, case.flops, case.nbytes, case.compute)
    peak_flops, peak_bytes = roofline.peak_percents(seconds, case.flops, case.nbytes)
    return Timing(who, seconds * 1e3, roofline_pct=pct, bound=bound,
                  torch_pct=roofline.torch_percent(seconds, case.flops, case.nbytes, case.compute),
                  peak_flops_pct=peak_flops, peak_bytes_pct=peak_bytes, **spread)


def run_cases(cases: list[BenchCase], roofline: Roofline, backends: list[str], *, compile_reference: bool = True,
              repeats: int = 5, min_time: float = 0.2,
              on_case: Callable[[BenchCase, list[Timing]], None] | None = None, device: str = "cpu"
              ) -> list[tuple[BenchCase, list[Timing]]]:
    # the references' data-dependent sizes (.tolist(), .item()) make dynamo log graph breaks
    torch._logging.set_logs(dynamo=logging.ERROR)
    results = []
    for case in cases:
        rows = run_case(case, roofline, backends, compile_reference=compile_reference, repeats=repeats,
                        min_time=min_time, device=device)
        results.append((case, rows))
        if on_case:
            on_case(case, rows)
    return results


def to_json(results: list[tuple[BenchCase, list[Timing]]]) -> list[dict]:
    return [{"op": case.op, "shape": case.label, "flops": case.flops, "bytes": case.nbytes, "compute": case.compute,
             "timings": [dataclasses.asdict(t) for t in rows]} for case, rows in results]


def format_header(roofline: Roofline, memory: dict | None = None) -> str:
    """The limits, the process's memory setup (`memory`: glm5_hal.memory_env.describe()) and
    the column names. ms is the median of the repeats; min and max show their spread."""
    peaks = ""
    if roofline.peak_gflops or roofline.peak_gbps:
        peaks = (f"datasheet: bf16 {(roofline.peak_gflops or 0) / 1e3:.1f} TFLOP/s, memory "
                 f"{(roofline.peak_gbps or 0) / 1e3:.2f} TB/s (% peak: flops/bytes)\n")
    mem = f"memory: {memory_env.summary(memory)}\n" if memory else ""
    return (roofline.describe() + "\n" + mem + peaks +
            f"{'op':<24} {'shape':<40} {'implementation':<30} {'ms':>10} {'min':>9} {'max':>9} {'x ref':>7} "
            f"{'% roof':>9} {'% torch':>8}" + (f" {'% peak f/b':>13}" if peaks else ""))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _limit_name(case: BenchCase, roofline: Roofline, bound: str) -> str:
    return "triad" if bound == "bytes" else roofline.compute_limit(case.compute)[1]


def format_rows(case: BenchCase, rows: list[Timing], roofline: Roofline | None = None) -> str:
    lines = []
    for r in rows:
        ms = f"{r.ms:10.3f}" if r.ms else f"{'-':>10}"
        spread = " ".join(f"{v:9.3f}" if v is not None else f"{'-':>9}" for v in (r.min_ms, r.max_ms))
        ratio = f"{r.vs_reference:7.2f}" if r.vs_reference else f"{'-':>7}"
        roof = f"{r.roofline_pct:7.1f}%{r.bound[0]}" if r.roofline_pct is not None else f"{'-':>9}"
        peer = f"{r.torch_pct:7.1f}%" if r.torch_pct is not None else f"{'-':>8}"
        peak = (f" {_pct(r.peak_flops_pct) + '/' + _pct(r.peak_bytes_pct):>13}"
                if r.peak_flops_pct is not None or r.peak_bytes_pct is not None else "")
        limit = f"  [{_limit_name(case, roofline, r.bound)}]" if roofline and r.roofline_pct is not None else ""
        lines.append(f"{case.op:<24} {case.label[:40]:<40} {r.who[:30]:<30} {ms} {spread} {ratio} {roof} {peer}{peak}"
                     + limit + (f"  {r.note}" if r.note else ""))
    return "\n".join(lines)


def format_table(results: list[tuple[BenchCase, list[Timing]]], roofline: Roofline, memory: dict | None = None) -> str:
    return "\n".join([format_header(roofline, memory)] + [format_rows(c, rows, roofline) for c, rows in results])
