"""Comparison rules: how one output of a backend is judged against the reference.

A case maps each checked target to one rule:

- `Close`: floating outputs, `|out - ref| <= atol + rtol * |ref|` with the dtype's base
  tolerance (optionally widened, with a reason); non-finite values must match exactly.
- `Exact`: bit-exact outputs (permutation maps, counts, packed INT4, cache contents).
- `TopKSet`: top-k index outputs, judged as sets against the reference scores.

`Close` and `Exact` take an optional transform (`Fp8Dequant`, `Int4Dequant`) applied to
both sides first. Every rule returns a `Verdict` with the numbers a report shows.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .tolerance import Tolerance, check_widening, tolerance
from .transforms import Resolve, Transform

#: dtypes the reference sees upcast (float64 on the CPU, float32 on CUDA)
UPCAST_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


@dataclasses.dataclass
class Verdict:
    """The result of one rule on one output."""
    ok: bool
    message: str = ""
    max_abs: float | None = None
    max_rel: float | None = None
    atol: float | None = None
    rtol: float | None = None
    margin: float | None = None   # max over elements of |err| / bound; <= 1 passes
    swaps: int | None = None      # TopKSet: selected keys ranked below the reference k-th
    worst: dict | None = None     # the element that set the margin (or the first mismatch)
    tolerance: str = ""


@dataclasses.dataclass(frozen=True)
class Context:
    """What a rule may look at besides the two values."""
    got: Resolve              # target -> the backend's CPU tensor
    want: Resolve             # target -> the reference's CPU tensor
    reference_args: tuple     # the inputs the reference ran on (upcast)


@dataclasses.dataclass(frozen=True)
class Close:
    """Floating output within the (widened) base tolerance of its dtype.

    widen/why: a factor >= 1 on rtol and atol, with a one-line justification.
    dtype: the dtype the output must have (default: the case's dtype, or the argument's
        own dtype for an in-place destination).
    transform: compare transformed values (e.g. `Fp8Dequant("out[1]")`); the tolerance is
        then the one of the transform's tolerance dtype.
    expect: `expect(ctx) -> tensor` replaces the reference's output as the value to compare
        against, for an output that depends on a choice the contract leaves to the backend:
        moe_route's weights are those of the ids the backend chose (within-tau swaps are
        legal), recomputed from the reference inputs. Shape and dtype rules are unchanged.
    slack: `slack(*reference_args) -> tensor` (broadcast to the output) added to each
        element's bound: error the contract's arithmetic permits that scales with an input
        rather than with the result (rope's float32 angle grows with the position), where a
        uniform widening would loosen every element. Needs `why`, like a widening.
    """
    widen: float = 1.0
    why: str = ""
    dtype: torch.dtype | None = None
    transform: Transform | None = None
    expect: Callable[[Context], torch.Tensor] | None = None
    slack: Callable[..., torch.Tensor] | None = None

    def __post_init__(self) -> None:
        check_widening(self.widen, self.why)
        if self.slack is not None and (not self.why.strip() or "\n" in self.why.strip()):
            raise ValueError(f"a per-element slack needs a one-line justification (why=...), "
                             f"got {self.why!r}")

    def judge(self, got: torch.Tensor, want: torch.Tensor, expected: torch.dtype,
              ctx: Context) -> Verdict:
        if self.expect is not None:
            try:
                want = self.expect(ctx).to("cpu", torch.float64)
            except (ValueError, RuntimeError, IndexError, TypeError) as exc:
                return Verdict(False, f"cannot compute the expected value from the backend's "
                                      f"outputs: {type(exc).__name__}: {exc}")
        bad = _metadata_mismatch(got, want, expected)
        if bad:
            return Verdict(False, bad)
        if self.transform is not None:
            try:
                g, _ = self.transform(got, ctx.got)
                w, unit = self.transform(want, ctx.want)
            except (ValueError, RuntimeError, IndexError) as exc:
                return Verdict(False, f"cannot apply {self.transform}: {exc}")
            tol = tolerance(self.transform.tolerance_dtype, self.widen, self.why)
        else:
            g, w, unit = got.to(torch.float64), want.to(torch.float64), None
            tol = tolerance(expected, self.widen, self.why)
        extra = None
        if self.slack is not None:
            try:
                extra = self.slack(*ctx.reference_args).to("cpu", torch.float64).broadcast_to(w.shape)
            except (ValueError, RuntimeError, IndexError) as exc:
                return Verdict(False, f"cannot compute the slack ({self.why}): {exc} "
                                      "(case definition error)")
        return close(g, w, tol, unit, extra, self.why.strip())


@dataclasses.dataclass(frozen=True)
class Exact:
    """Bit-exact output (values equal; NaN matches NaN). Floating outputs are compared by
    value against the upcast reference, which represents every value of the output dtype."""
    dtype: torch.dtype | None = None
    transform: Transform | None = None

    def judge(self, got: torch.Tensor, want: torch.Tensor, expected: torch.dtype,
              ctx: Context) -> Verdict:
        bad = _metadata_mismatch(got, want, expected)
        if bad:
            return Verdict(False, bad)
        if self.transform is not None:
            try:
                got, _ = self.transform(got, ctx.got)
                want, _ = self.transform(want, ctx.want)
            except (ValueError, RuntimeError, IndexError) as exc:
                return Verdict(False, f"cannot apply {self.transform}: {exc}")
        return exact(got, want)


@dataclasses.dataclass(frozen=True)
class TopKSet:
    """Top-k indices judged as a set, row by row (CONFORMANCE.md rule 2).

    scores: `scores(*reference_args) -> [..., S]` the reference scores of every key for
        each row (leading dims as the index output); `-inf` marks a key outside the row's
        range. Typically the reference of the corresponding logits op.
    tau: the score tolerance of that logits op (`tolerance(dtype, widen, why)`); a row's
        slack is `tau.atol + tau.rtol * |k-th largest reference score|`.
    """
    scores: Callable[..., torch.Tensor]
    tau: Tolerance
    dtype: torch.dtype | None = torch.int32

    def judge(self, got: torch.Tensor, want: torch.Tensor, expected: torch.dtype,
              ctx: Context) -> Verdict:
        bad = _metadata_mismatch(got, want, expected)
        if bad:
            return Verdict(False, bad)
        scores = self.scores(*ctx.reference_args).to("cpu", torch.float64)
        if scores.shape[:-1] != got.shape[:-1]:
            return Verdict(False, f"reference scores {list(scores.shape)} do not match index "
                                  f"rows {list(got.shape)} (case definition error)")
        return topk_set(got, scores, self.tau)


Rule = Close | Exact | TopKSet


# -- the rules' arithmetic ---------------------------------------------------------------
def close(got: torch.Tensor, want: torch.Tensor, tol: Tolerance,
          unit: torch.Tensor | None = None, slack: torch.Tensor | None = None,
          slack_why: str = "") -> Verdict:
    """Elementwise bound on float64 tensors of one shape; non-finite values must match.
    `slack` (float64, the output's shape) is added to each element's bound."""
    described = tol.describe() + (f" + per-element slack ({slack_why})" if slack is not None else "")
    verdict = Verdict(True, atol=tol.atol, rtol=tol.rtol, tolerance=described,
                      max_abs=0.0, max_rel=0.0, margin=0.0)
    if got.numel() == 0:
        return verdict
    finite = torch.isfinite(got) & torch.isfinite(want)
    same_special = (got == want) | (torch.isnan(got) & torch.isnan(want))
    special_bad = ~finite & ~same_special
    err = torch.where(finite, (got - want).abs(), torch.zeros_like(got))
    bound = tol.bound(want.abs(), unit)
    if slack is not None:
        bound = bound + slack
    ratio = torch.where(finite, err / bound, torch.zeros_like(got))
    rel = torch.where(finite & (want != 0), err / want.abs(), torch.zeros_like(got))
    verdict.max_abs, verdict.max_rel = err.max().item(), rel.max().item()
    verdict.margin = ratio.max().item()
    at = int(ratio.flatten().argmax())
    verdict.worst = _element(got, want, at, err=err, bound=bound)
    if special_bad.any():
        first = int(special_bad.flatten().nonzero()[0])
        verdict.ok = False
        verdict.worst = _element(got, want, first)
        verdict.message = (f"non-finite values differ at {int(special_bad.sum())} of {got.numel()} "
                           f"elements; first at {verdict.worst['index']}: out={_num(got.flatten()[first])}, "
                           f"ref={_num(want.flatten()[first])}")
    elif verdict.margin > 1.0:
        outside = int((ratio > 1.0).sum())
        w = verdict.worst
        verdict.ok = False
        verdict.message = (f"{outside} of {got.numel()} elements outside |out - ref| <= atol + "
                           f"rtol*|ref| ({described}); worst at {w['index']}: out={w['out']}, "
                           f"ref={w['ref']}, |err|={w['abs_err']:.3g} > bound {w['bound']:.3g} "
                           f"(margin {verdict.margin:.3g})")
    return verdict


def exact(got: torch.Tensor, want: torch.Tensor) -> Verdict:
    """Equal values (NaN == NaN; FP8 and integers compared bit for bit)."""
    if got.numel() == 0:
        return Verdict(True, max_abs=0.0)
    if got.dtype == want.dtype and got.shape == want.shape and torch.equal(_bits(got), _bits(want)):
        # the common case (e.g. every input's read-only check) without float64 copies
        counted = got.dtype in UPCAST_DTYPES or not (got.is_floating_point() or got.dtype == torch.bool)
        return Verdict(True, max_abs=0.0 if counted else None)
    if got.dtype in UPCAST_DTYPES or want.dtype in UPCAST_DTYPES:
        g, w = got.to(torch.float64), want.to(torch.float64)
        equal = (g == w) | (torch.isnan(g) & torch.isnan(w))
        diff = torch.where(equal, torch.zeros_like(g), (g - w).abs())
        max_abs = diff.nan_to_num(nan=float("inf")).max().item()
    else:
        g, w = _bits(got), _bits(want)
        equal = g == w
        max_abs = None
        if not got.is_floating_point() and got.dtype != torch.bool:
            max_abs = float((got.to(torch.int64) - want.to(torch.int64)).abs().max())
    if bool(equal.all()):
        return Verdict(True, max_abs=max_abs)
    first = int((~equal).flatten().nonzero()[0])
    worst = _element(got, want, first)
    return Verdict(False, f"{int((~equal).sum())} of {got.numel()} elements differ (bit-exact "
                          f"rule); first at {worst['index']}: out={worst['out']}, ref={worst['ref']}",
                   max_abs=max_abs, worst=worst)


def topk_set(idx: torch.Tensor, scores: torch.Tensor, tau: Tolerance) -> Verdict:
    """Per row: distinct, in-range, left-packed entries with -1 fill; count ==
    min(k, keys in range); every selected key's score >= k-th largest - tau."""
    k, n_keys = idx.shape[-1], scores.shape[-1]
    idx = idx.reshape(-1, k).to(torch.int64)
    scores = scores.reshape(idx.shape[0], n_keys)   # explicit rows: n_keys may be 0
    verdict = Verdict(True, atol=tau.atol, rtol=tau.rtol, margin=0.0, swaps=0,
                      tolerance="score " + tau.describe())
    if idx.shape[0] == 0 or k == 0:
        return verdict
    valid = idx >= 0
    in_range = torch.isfinite(scores) | (scores == float("inf"))
    keys = in_range.sum(-1)
    want_count = keys.clamp(max=k)
    selected = torch.where(valid, idx, torch.zeros_like(idx)).clamp(max=max(n_keys - 1, 0))
    picked = scores.gather(1, selected) if n_keys else torch.full_like(idx, float("nan"), dtype=torch.float64)
    ordered = torch.sort(torch.where(valid, idx, -1 - torch.arange(k).expand_as(idx)), dim=1).values
    problems = [
        ((idx < -1).any(1), "entries below -1"),
        ((valid[:, 1:] & ~valid[:, :-1]).any(1), "a valid entry after a -1 (not left-packed)"),
        ((valid & (idx >= n_keys)).any(1), f"an index >= {n_keys} keys"),
        ((ordered[:, 1:] == ordered[:, :-1]).any(1), "duplicate indices"),
        (valid.sum(1) != want_count, "wrong count of valid entries"),
        ((valid & (idx < n_keys) & ~(torch.isfinite(picked) | (picked == float("inf")))).any(1),
         "a selected key outside the row's range"),
    ]
    for bad_rows, what in problems:
        if bad_rows.any():
            row = int(bad_rows.nonzero()[0])
            verdict.ok = False
            verdict.worst = {"row": row, "indices": idx[row].tolist(),
                             "keys_in_range": int(keys[row]), "expected_count": int(want_count[row])}
            verdict.message = (f"top-k set rule: {int(bad_rows.sum())} of {idx.shape[0]} rows have "
                               f"{what}; first row {row}: {_short(idx[row].tolist())} "
                               f"({int(keys[row])} keys in range, expected "
                               f"{int(want_count[row])} valid entries)")
            return verdict
    top = torch.topk(scores, k, dim=-1).values if n_keys >= k else torch.nn.functional.pad(
        torch.sort(scores, dim=-1, descending=True).values, (0, k - n_keys), value=float("-inf"))
    kth = top.gather(1, (want_count - 1).clamp(min=0).unsqueeze(1))
    slack = tau.atol + tau.rtol * kth.abs()
    deficit = torch.where(valid, kth - picked, torch.zeros_like(picked)).clamp(min=0)
    deficit = torch.where(torch.isfinite(deficit), deficit, torch.zeros_like(deficit))
    ratio = deficit / slack
    verdict.swaps = int((deficit > 0).sum())
    verdict.margin = float(ratio.max())
    verdict.max_abs = float(deficit.max())
    at = int(ratio.flatten().argmax())
    row, col = divmod(at, k)
    verdict.worst = {"row": row, "key": int(idx[row, col]), "score": _num(picked[row, col]),
                     "kth_score": _num(kth[row, 0]), "tau": float(slack[row, 0])}
    if verdict.margin > 1.0:
        verdict.ok = False
        below = int((ratio > 1.0).sum())
        verdict.message = (f"top-k set rule: {below} selected keys score more than tau below the "
                           f"reference k-th largest; worst row {row}: key {int(idx[row, col])} "
                           f"score {_num(picked[row, col])} < k-th {_num(kth[row, 0])} - tau "
                           f"{float(slack[row, 0]):.3g} (margin {verdict.margin:.3g})")
    return verdict


# -- helpers -----------------------------------------------------------------------------
def _metadata_mismatch(got: object, want: torch.Tensor, expected: torch.dtype) -> str:
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor, got {type(got).__name__}"
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    if got.dtype != expected:
        return f"dtype {_dtype(got.dtype)}, expected {_dtype(expected)}"
    return ""


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        return t.contiguous().view(ints[t.element_size()])
    return t


def _element(got: torch.Tensor, want: torch.Tensor, flat: int, *, err=None, bound=None) -> dict:
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), got.shape)] if got.dim() else []
    row = {"index": index, "out": _num(got.flatten()[flat]), "ref": _num(want.flatten()[flat])}
    if err is not None:
        row["abs_err"] = float(err.flatten()[flat])
        row["bound"] = float(bound.flatten()[flat])
    return row


def _num(v: torch.Tensor) -> float | int:
    v = v.item() if v.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) else v.float().item()
    return v


def _short(values: list, limit: int = 12) -> str:
    return str(values) if len(values) <= limit else str(values[:limit])[:-1] + ", ...]"


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")
