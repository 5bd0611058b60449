"""A backend's own compiled kernels: a shared library that CMake builds into the backend's
package only where the vendor toolchain exists, loaded lazily with ctypes.

Every vendor backend with kernels of its own (backends/<vendor>/kernels.py) subclasses
`KernelLibrary`, declaring the C entry points' signatures and typed launchers. When the
library is absent or broken, `missing()` says why in words the adapters reuse as their
decline reason ("cambricon kernel not built (...)"), so dispatch moves on.

What the libraries share is declared once in include/glm5_hal_kernel_abi.h and mirrored
here: the dtype and status codes. The paged sparse MLA decode kernel the CUDA-dialect,
cambricon and kunlun libraries implement behind one entry point is in glm5_hal.vendor_ops.dsa
(its ABI struct, launcher, size limits and adapter).
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import Tensor

INCLUDE_DIR = Path(__file__).resolve().parent / "include"
ABI_HEADER = INCLUDE_DIR / "glm5_hal_kernel_abi.h"

#: mirrors of include/glm5_hal_kernel_abi.h (tests/test_kernel_abi.py checks they agree)
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}
OK, EINVAL = 0, -22


class KernelError(RuntimeError):
    """A kernel entry point refused its arguments or its launch failed."""


def library_path(package_paths: Iterable[str], name: str) -> Path:
    """Where CMake installed `name` for a package: the first of the package's folders that
    holds it (an editable install's package spans the build's install folder and the source
    folder), else the first folder (so the "not built" reason names a real place)."""
    folders = [Path(p) for p in package_paths]
    for folder in folders:
        if (folder / name).exists():
            return folder / name
    return folders[0] / name


def pointer(t: Tensor | None) -> int | None:
    """The device address of a tensor for a C entry point (NULL for an absent or empty one)."""
    return None if t is None or t.numel() == 0 else t.data_ptr()


class KernelLibrary:
    """Subclasses set `signatures` ({entry point: (restype, argtypes)}) and may override
    `validate(lib)` (e.g. an ABI check); launchers call `launch(name, *args)`."""
    signatures: dict[str, tuple[Any, list]] = {}

    def __init__(self, path: Path, *, label: str, hint: str) -> None:
        self.path = Path(path)
        self.label = label   # names the kernels in reasons, e.g. "cambricon kernel"
        self.hint = hint     # how to build them
        self._lib: ctypes.CDLL | None = None
        self._error: str | None = None

    def missing(self) -> str | None:
        """None when the kernels can run, else why not (also the adapters' decline reason)."""
        if self._lib is None and self._error is None:
            self._error = self._load()
        return self._error

    def status(self) -> str:
        reason = self.missing()
        return f"built ({self.path.name})" if reason is None else reason

    def _load(self) -> str | None:
        if not self.path.exists():
            return f"{self.label} not built ({self.path.name} not found in {self.path.parent}; {self.hint})"
        try:
            lib = ctypes.CDLL(str(self.path))
        except OSError as exc:
            return f"{self.label} library does not load: {exc}"
        try:
            for name, (restype, argtypes) in self.signatures.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
        except AttributeError as exc:
            return f"{self.label} library {self.path.name} lacks an entry point: {exc}"
        reason = self.validate(lib)
        if reason is None:
            self._lib = lib
        return reason

    def validate(self, lib: ctypes.CDLL) -> str | None:
        """A reason the loaded library cannot be used, or None."""
        return None

    def call(self, name: str, *args: Any) -> Any:
        """Calls entry point `name` (loading the library on first use); KernelError if the
        library is not usable."""
        if self._lib is None:
            reason = self.missing()
            if self._lib is None:
                raise KernelError(reason or f"{self.label} library not loaded")
        return getattr(self._lib, name)(*args)

    def launch(self, name: str, *args: Any) -> None:
        """Calls entry point `name`, which returns a status of glm5_hal_kernel_abi.h: a
        refusal or a failed launch is a KernelError."""
        status = self.call(name, *args)
        if status == EINVAL:
            raise KernelError(f"{name}: arguments refused by the kernel's size checks (EINVAL)")
        if status != OK:
            raise KernelError(f"{name} failed with status {status}: the {self.label} launch failed with "
                              f"runtime error {status}")
