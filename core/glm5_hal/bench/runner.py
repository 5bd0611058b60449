"""Times one op three ways in the same run -- the reference (eager), `torch.compile` of the
reference, and every available backend's own implementation -- and relates each to the
machine's roofline. Ratios are the result; absolute times vary from machine to machine."""
from __future__ import annotations

import dataclasses
import gc
import logging
import warnings
from typing import Callable, Iterable

import torch

import glm5_hal as hal

from .roofline import Roofline
from .timing import median_time


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One op at one shape. `make()` returns the op's positional arguments.
    flops / nbytes: the work and the bytes that must move at least once (read + written);
    the roofline percentage is taken against whichever bound is slower.
    compile_reference: False where torch.compile of the reference is impractical (minutes,
    gigabytes); the table then says so."""
    label: str
    make: Callable[[], tuple]
    flops: float = 0.0
    nbytes: float = 0.0
    compile_reference: bool = True
    op: str = ""   # set by the case registry (glm5_hal.bench.cases)


@dataclasses.dataclass
class Timing:
    who: str               # "reference", "compiled", or a backend's implementation
    ms: float | None
    vs_reference: float | None = None   # reference time / this time (higher is faster)
    roofline_pct: float | None = None
    bound: str = ""
    note: str = ""


def candidate_backends(only: Iterable[str] | None = None) -> list[str]:
    """Available non-reference backends whose kernels take CPU tensors (the bench builds its
    inputs on the CPU), or the `only` ones (an unknown or unavailable name is an error)."""
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
            if r.available and r.name != "reference" and r.device_type in ("cpu", "*")]


def run_case(case: BenchCase, roofline: Roofline, backends: list[str], *,
             compile_reference: bool = True, repeats: int = 5, min_time: float = 0.2) -> list[Timing]:
    args = case.make()
    try:
        return _run(case, args, roofline, backends, compile_reference, repeats, min_time)
    finally:
        del args
        gc.collect()


def _run(case, args, roofline, backends, compile_reference, repeats, min_time) -> list[Timing]:
    reference = getattr(hal.reference, case.op)
    public = getattr(hal.ops, case.op)
    rows = [_timed("reference", lambda: reference(*args), case, roofline, repeats, min_time)]
    if compile_reference and case.compile_reference:
        torch._dynamo.reset()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compiled = torch.compile(reference, dynamic=False)
                compiled(*args)
            rows.append(_timed("compiled", lambda: compiled(*args), case, roofline, repeats, min_time))
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
            rows.append(_timed(chosen, lambda: public(*args), case, roofline, repeats, min_time))
    ref_ms = rows[0].ms
    for r in rows:
        if r.ms and ref_ms:
            r.vs_reference = ref_ms / r.ms
    return rows


def _timed(who: str, fn: Callable[[], object], case: BenchCase, roofline: Roofline,
           repeats: int, min_time: float) -> Timing:
    try:
        seconds = median_time(fn, repeats=repeats, min_time=min_time)
    except Exception as exc:  # noqa: BLE001  (one failing implementation must not end the run)
        return Timing(who, None, note=f"failed: {type(exc).__name__}: {str(exc)[:120]}")
    pct, bound = roofline.percent(seconds, case.flops, case.nbytes)
    return Timing(who, seconds * 1e3, roofline_pct=pct if (case.flops or case.nbytes) else None, bound=bound)


def run_cases(cases: list[BenchCase], roofline: Roofline, backends: list[str], *, compile_reference: bool = True,
              repeats: int = 5, min_time: float = 0.2,
              on_case: Callable[[BenchCase, list[Timing]], None] | None = None
              ) -> list[tuple[BenchCase, list[Timing]]]:
    # the references' data-dependent sizes (.tolist(), .item()) make dynamo log graph breaks
    torch._logging.set_logs(dynamo=logging.ERROR)
    results = []
    for case in cases:
        rows = run_case(case, roofline, backends, compile_reference=compile_reference, repeats=repeats,
                        min_time=min_time)
        results.append((case, rows))
        if on_case:
            on_case(case, rows)
    return results


def to_json(results: list[tuple[BenchCase, list[Timing]]]) -> list[dict]:
    return [{"op": case.op, "shape": case.label, "flops": case.flops, "bytes": case.nbytes,
             "timings": [dataclasses.asdict(t) for t in rows]} for case, rows in results]


def format_header(roofline: Roofline) -> str:
    return (f"roofline: copy {roofline.copy_gbps:.1f} GB/s, fp32 GEMM {roofline.gemm_gflops:.1f} "
            f"GFLOP/s ({roofline.threads} threads)\n"
            f"{'op':<24} {'shape':<40} {'implementation':<30} {'ms':>10} {'x ref':>7} {'% roof':>8}")


def format_rows(case: BenchCase, rows: list[Timing]) -> str:
    lines = []
    for r in rows:
        ms = f"{r.ms:10.3f}" if r.ms else f"{'-':>10}"
        ratio = f"{r.vs_reference:7.2f}" if r.vs_reference else f"{'-':>7}"
        roof = f"{r.roofline_pct:6.1f}%{r.bound[0]}" if r.roofline_pct is not None else f"{'-':>8}"
        lines.append(f"{case.op:<24} {case.label[:40]:<40} {r.who[:30]:<30} {ms} {ratio} {roof}"
                     + (f"  {r.note}" if r.note else ""))
    return "\n".join(lines)


def format_table(results: list[tuple[BenchCase, list[Timing]]], roofline: Roofline) -> str:
    return "\n".join([format_header(roofline)] + [format_rows(c, rows) for c, rows in results])
