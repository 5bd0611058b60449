"""Observing which hal ops a forward pass calls (for `glm5-hal demo`)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

from . import layers, quantized


@dataclasses.dataclass
class OpCalls:
    """Per op name: how often it was called and the arguments of its first call."""
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    first_args: dict[str, tuple] = dataclasses.field(default_factory=dict)


class _RecordingOps:
    def __init__(self, target: Any, calls: OpCalls):
        self._target, self._calls = target, calls

    def __getattr__(self, name: str):
        fn = getattr(self._target, name)
        calls = self._calls

        def recorded(*args):
            calls.counts[name] = calls.counts.get(name, 0) + 1
            calls.first_args.setdefault(name, args)
            return fn(*args)
        return recorded


@contextlib.contextmanager
def record_ops(*modules: Any) -> Iterator[OpCalls]:
    """Within the block, every `glm5_hal.ops` call made by the model layers (the quantized ones
    too) is counted and its first arguments kept (pass them to `glm5_hal.explain`). `modules`: other modules
    whose op calls go through a module-level `ops` name, to observe instead (the transformers
    integration passes its own). Process-wide while active: not for concurrent use, and not
    under torch.compile."""
    calls = OpCalls()
    targets = modules or (layers, quantized)
    saved = [target.ops for target in targets]
    for target, ops in zip(targets, saved):
        target.ops = _RecordingOps(ops, calls)
    try:
        yield calls
    finally:
        for target, ops in zip(targets, saved):
            target.ops = ops
