"""Case generators, one module per op family (common, quant, dsa, moe, kv).

A family module registers one generator per op; adding an op's cases is adding (or
extending) that module, nothing else:

    from ..case import Case
    from . import generator

    @generator("rms_norm")
    def rms_norm_cases(preset: str):        # preset: "tiny" or "glm5"
        yield Case("rms_norm", preset, ...)

Every module in this package is imported on first use. Generators must be cheap (they
build Case objects; inputs are only created when a case runs) and deterministic.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Iterable

from ...errors import HalError
from ..case import PRESETS, Case

Generator = Callable[[str], Iterable[Case]]
_GENERATORS: dict[str, Generator] = {}
_loaded = False


def generator(op: str) -> Callable[[Generator], Generator]:
    """Registers `fn(preset) -> cases` as the case generator of `op`."""
    def register(fn: Generator) -> Generator:
        if op in _GENERATORS:
            raise HalError(f"conformance: op {op!r} has two case generators "
                           f"({_GENERATORS[op].__module__} and {fn.__module__})")
        _GENERATORS[op] = fn
        return fn
    return register


def _load() -> dict[str, Generator]:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{module.name}")
    return _GENERATORS


def ops_with_cases() -> list[str]:
    return sorted(_load())


def cases(op: str, preset: str) -> list[Case]:
    """The cases of `op` for `preset`, checked for consistency (ids unique, op and preset
    as asked)."""
    if preset not in PRESETS:
        raise HalError(f"conformance: unknown preset {preset!r}; presets: {list(PRESETS)}")
    gen = _load().get(op)
    if gen is None:
        return []
    result = list(gen(preset))
    seen: set[str] = set()
    for case in result:
        if case.op != op or case.preset != preset:
            raise HalError(f"conformance: the {op} generator made case {case.id} for preset {preset!r}")
        if case.id in seen:
            raise HalError(f"conformance: case id {case.id} generated twice")
        seen.add(case.id)
    return result
