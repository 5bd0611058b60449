"""A conformance case: one op call with deterministic inputs, and how to judge it.

    Case(op="rms_norm", preset="tiny", name="rows3_dim17", dtype=torch.bfloat16,
         inputs=lambda g: (randn(g, (3, 17), torch.bfloat16), randn(g, (17,), torch.bfloat16), 1e-5),
         checks={"out": Close()})

- `id` is `op/preset/name/dtype`, stable across runs, so reports diff.
- `inputs(g)` builds the op's canonical positional arguments on the CPU, in the dtype under
  test, from a `torch.Generator` seeded with a hash of the id. A `View` stands for an input
  that must reach the op as a view of a larger tensor (non-contiguous, offset): moving a
  strided tensor to another device would make it contiguous, so the base moves and the view
  is taken on the device.
- `checks` maps each target to a rule (`Close`, `Exact`, `TopKSet`). A target is `out` (the
  result), `out[i]` (element i of a tuple result) or an argument name (the whole destination
  of an in-place op, after the call).
- `outcome`: `RESULT` (the call must return and every check pass), `ERROR` (the contract
  demands `InvalidInputError`, naming `error_arg` when given; in-place destinations must be
  left untouched) or
  `RESULT_OR_ERROR` (e.g. non-contiguous inputs: handled correctly or rejected with
  `InvalidInputError`, never miscomputed).
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Mapping

import torch

from .compare import Rule

RESULT, ERROR, RESULT_OR_ERROR = "result", "error", "result_or_error"
OUTCOMES = (RESULT, ERROR, RESULT_OR_ERROR)
PRESETS = ("tiny", "glm5")   # `long` is for benchmarks only


@dataclasses.dataclass(frozen=True)
class View:
    """An input that reaches the op as `view(base)`, with `base` moved to the device first."""
    base: torch.Tensor
    view: Callable[[torch.Tensor], torch.Tensor]

    def on(self, base: torch.Tensor) -> torch.Tensor:
        return self.view(base)


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    preset: str
    name: str
    dtype: torch.dtype   # the dtype under test: that of the op's dispatch argument
    inputs: Callable[[torch.Generator], tuple]
    checks: Mapping[str, Rule] = dataclasses.field(default_factory=dict)
    outcome: str = RESULT
    note: str = ""       # what the case is about, shown with failures
    error_arg: str = ""  # ERROR cases: the argument the InvalidInputError must name ("": any)

    def __post_init__(self) -> None:
        where = f"conformance case {self.op}/{self.preset}/{self.name}"
        if self.outcome not in OUTCOMES:
            raise ValueError(f"{where}: outcome must be one of {OUTCOMES}, got {self.outcome!r}")
        if self.preset not in PRESETS:
            raise ValueError(f"{where}: preset must be one of {PRESETS}, got {self.preset!r}")
        if not self.name or any(c in self.name for c in "/[] "):
            raise ValueError(f"{where}: a case name is non-empty without '/', '[', ']' or spaces")
        if self.outcome != ERROR and not self.checks:
            raise ValueError(f"{where}: a case expecting a result needs at least one check")
        if self.error_arg and self.outcome != ERROR:
            raise ValueError(f"{where}: error_arg is for cases whose outcome is ERROR")

    @property
    def id(self) -> str:
        return f"{self.op}/{self.preset}/{self.name}/{dtype_name(self.dtype)}"

    @property
    def seed(self) -> int:
        """Stable across processes and runs (unlike hash())."""
        return int.from_bytes(hashlib.sha256(self.id.encode()).digest()[:8], "little") >> 1

    def make_inputs(self) -> tuple:
        return tuple(self.inputs(torch.Generator().manual_seed(self.seed)))


def expected_errors(op: str, preset: str, dtype: torch.dtype, table) -> list[Case]:
    """Expected-error cases from a table of `(name, inputs(g, dtype), argument, note)`: the
    InvalidInputError must name `argument`."""
    return [Case(op, preset, name, dtype, lambda g, make=make: make(g, dtype), outcome=ERROR,
                 error_arg=arg, note=note)
            for name, make, arg, note in table]


# -- input helpers for case modules ---------------------------------------------------------
def randn(g: torch.Generator, shape, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Normal values drawn in float32 on the CPU, then rounded to `dtype`."""
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def uniform(g: torch.Generator, shape, dtype: torch.dtype, low: float, high: float) -> torch.Tensor:
    return (torch.rand(shape, generator=g) * (high - low) + low).to(dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
