"""torch_npu's own op schemas, registered with torch.library so that every call an adapter
makes into the Ascend emulator is parsed by torch's schema parser exactly as the real
`torch.ops.npu.<op>` parses it: argument names, positional vs keyword-only, defaults, arity,
types (a torch.dtype passed to an `int?` argument arrives as its ScalarType number, as it does
on the device). An argument or op the wheel does not declare raises, as it would there.

The schemas come from the torch-npu wheel itself, file
`torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml` (the codegen input of torch_npu's
`npu` op namespace), unpacked by scripts/fetch_torch_npu.sh under
build/torch_npu/torch_npu-<version>/ (CI fetches PINNED before the tests; no network here).
Each wheel version gets its own test-only namespace (`npu_emu_2_13_0`) mirroring `torch.ops.npu`.
"""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / "build" / "torch_npu"
#: The wheel CI unpacks (scripts/fetch_torch_npu.sh's default): torch-npu 2.13.0 requires
#: torch==2.13.0.* (its METADATA), the torch requirements/cpu.txt pins, and it is in the newest
#: release cohort (2026-10-15), whose schemas every adapter call is written against.
PINNED = "2.13.0"
SCHEMA_FILE = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
_FUNC = re.compile(r"^\s*(?:-\s+)?func:\s*(?P<schema>(?P<name>[A-Za-z0-9_]+)(?:\.(?P<overload>\w+))?\(.*)$")


def wheel_root(version: str) -> Path:
    return WHEELS / f"torch_npu-{version}"


def available(version: str) -> bool:
    return (wheel_root(version) / ".complete").exists() and (wheel_root(version) / SCHEMA_FILE).exists()


def available_versions() -> list[str]:
    """The torch-npu versions unpacked under build/torch_npu (fetch more with
    TORCH_NPU_VERSION=<v> scripts/fetch_torch_npu.sh)."""
    if not WHEELS.is_dir():
        return []
    return sorted((p.name.removeprefix("torch_npu-") for p in WHEELS.glob("torch_npu-*")
                   if available(p.name.removeprefix("torch_npu-"))), key=_release)


def missing_reason(version: str) -> str:
    return (f"torch-npu {version} is not unpacked under {wheel_root(version).relative_to(REPO)} "
            f"(run `TORCH_NPU_VERSION={version} scripts/fetch_torch_npu.sh`; CI does this before the tests)")


def required() -> bool:
    """CI sets GLM5_CI_REQUIRE_TORCH_NPU_WHEEL=1: a missing pinned wheel is a failure there."""
    return os.environ.get("GLM5_CI_REQUIRE_TORCH_NPU_WHEEL", "") not in ("", "0")


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version))


@functools.lru_cache(maxsize=None)
def read_schemas(version: str) -> dict[str, tuple[str, ...]]:
    """op name -> its schema strings (one per overload), as the wheel declares them. Some
    wheels list an overload twice (npu_quant_matmul in 2.6.0-2.9.0, identical lines): the
    first declaration counts."""
    schemas: dict[str, dict[str, str]] = {}
    for line in (wheel_root(version) / SCHEMA_FILE).read_text(encoding="utf-8").splitlines():
        match = _FUNC.match(line)
        if match:
            schemas.setdefault(match["name"], {}).setdefault(match["overload"] or "", match["schema"].strip())
    return {name: tuple(s.values()) for name, s in schemas.items()}


def namespace(version: str) -> str:
    return "npu_emu_" + re.sub(r"\W", "_", version)


class Schemas:
    """The registered ops of one wheel version: `op(name)` is the torch op (its overload
    packet) whose CPU kernel calls `kernel(name, bound_arguments)`."""

    def __init__(self, version: str, kernel: Callable[[str, dict], Any], ops: tuple[str, ...]) -> None:
        self.version = version
        self.source = f"torch-npu {version} wheel, {SCHEMA_FILE}"
        self.declared = read_schemas(version)
        self.namespace = namespace(version)
        self._library = torch.library.Library(self.namespace, "DEF")
        for name in ops:
            for schema in self.declared.get(name, ()):
                self._library.define(schema)
                overload = schema.split("(", 1)[0]
                self._library.impl(overload, functools.partial(_call_kernel, kernel, self.namespace, overload),
                                   "CPU")

    def op(self, name: str) -> Any | None:
        """torch.ops.<namespace>.<name>, or None when the wheel does not declare it."""
        if name not in self.declared:
            return None
        return getattr(getattr(torch.ops, self.namespace), name)

    def schema(self, name: str) -> str:
        return str(self.op(name).default._schema)


def _call_kernel(kernel: Callable[[str, dict], Any], ns: str, overload: str, *args: Any, **kwargs: Any) -> Any:
    """The registered CPU kernel: binds what torch passed (positional arguments by position,
    keyword-only ones by name; defaults omitted) to every argument name of the schema."""
    name, _, variant = overload.partition(".")
    packet = getattr(getattr(torch.ops, ns), name)
    schema = getattr(packet, variant or "default")._schema
    bound: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return kernel(overload, bound)


@functools.lru_cache(maxsize=None)
def schemas(version: str, kernel: Callable[[str, dict], Any], ops: tuple[str, ...]) -> Schemas:
    """One registration per (version, kernel, ops) per process (torch.library namespaces are
    global): `kernel` must dispatch to the calling emulator itself."""
    return Schemas(version, kernel, ops)
