"""Inputs for tests generated from the op table: each op's inputs come from its own
conformance cases, so an op added to the table is covered without a hand-written list."""
from __future__ import annotations

import functools

import torch
import torch.utils._pytree as pytree

from glm5_hal.conformance.case import RESULT, View
from glm5_hal.conformance.cases import cases


def numel(args) -> int:
    return sum(t.numel() for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor))


@functools.cache
def tiny_case(name: str, max_elements: int):
    """The op's largest tiny RESULT case of at most `max_elements` input elements (float32
    where it has one; cases on page views left out), or None."""
    usable = []
    for case in cases(name, "tiny"):
        if case.outcome != RESULT:
            continue
        args = case.inputs(torch.Generator().manual_seed(case.seed))
        if any(isinstance(a, View) for a in args) or numel(args) > max_elements:
            continue
        usable.append((case.dtype == torch.float32, numel(args), case.id, case))
    return max(usable)[-1] if usable else None


def tiny_inputs(name: str, max_elements: int) -> tuple:
    """Fresh inputs of tiny_case(name, max_elements), the same on every call."""
    case = tiny_case(name, max_elements)
    return case.inputs(torch.Generator().manual_seed(case.seed))
