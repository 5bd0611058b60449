"""Times one op three ways in the same run -- the reference (eager), `torch.compile` of the
reference, and every available backend's own implementation -- and relates each to the
machine's roofline. Ratios are the result; absolute times vary from machine to machine."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import torch

import glm5_hal as hal

from .roofline import Roofline
from .timing import median_time


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One op at one shape. `make()` returns the op's positional arguments."""
    op: str
    label: str
    make: Callable[[], tuple]
    flops: float = 0.0
    nbytes: float = 0.0


@dataclasses.dataclass
class Timing:
    who: str               # "reference", "compiled", or a backend's implementation
    ms: float | None
    vs_reference: float | None = None   # reference time / this time (higher is faster)
    roofline_pct: float | None = None
    bound: str = ""
    note: str = ""


def run_case(case: BenchCase, roofline: Roofline, backends: list[str], *,
             compile_reference: bool = True, repeats: int = 5) -> list[Timing]:
    args = case.make()
    reference = getattr(hal.reference, case.op)
    public = getattr(hal.ops, case.op)
    rows = [_timed("reference", lambda: reference(*args), case, roofline, repeats)]
    if compile_reference:
        torch._dynamo.reset()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compiled = torch.compile(reference, dynamic=False)
                compiled(*args)
            rows.append(_timed("compiled", lambda: compiled(*args), case, roofline, repeats))
        except Exception as exc:  # a reference torch.compile cannot handle is reported, not fatal
            rows.append(Timing("compiled", None, note=f"torch.compile failed: {type(exc).__name__}"))
    for name in backends:
        with hal.use(name):
            chosen = hal.explain(case.op, *args).chosen
            if not chosen or not chosen.startswith(name + "."):
                rows.append(Timing(name, None, note=f"not implemented here (runs {chosen})"))
                continue
            rows.append(_timed(chosen, lambda: public(*args), case, roofline, repeats))
    ref_ms = rows[0].ms
    for r in rows:
        if r.ms:
            r.vs_reference = ref_ms / r.ms
    return rows


def _timed(who: str, fn: Callable[[], object], case: BenchCase, roofline: Roofline,
           repeats: int) -> Timing:
    seconds = median_time(fn, repeats=repeats)
    pct, bound = roofline.percent(seconds, case.flops, case.nbytes)
    return Timing(who, seconds * 1e3, roofline_pct=pct, bound=bound)


def format_table(results: list[tuple[BenchCase, list[Timing]]], roofline: Roofline) -> str:
    lines = [f"roofline: copy {roofline.copy_gbps:.1f} GB/s, fp32 GEMM {roofline.gemm_gflops:.1f} "
             f"GFLOP/s ({roofline.threads} threads)",
             f"{'op':<24} {'shape':<28} {'implementation':<28} {'ms':>9} {'x ref':>7} {'% roof':>8}"]
    for case, rows in results:
        for r in rows:
            ms = f"{r.ms:9.3f}" if r.ms else f"{'-':>9}"
            ratio = f"{r.vs_reference:7.2f}" if r.vs_reference else f"{'-':>7}"
            roof = f"{r.roofline_pct:6.1f}%{r.bound[0]}" if r.roofline_pct is not None else f"{'-':>8}"
            lines.append(f"{case.op:<24} {case.label:<28} {r.who:<28} {ms} {ratio} {roof}"
                         + (f"  {r.note}" if r.note else ""))
    return "\n".join(lines)
