"""A backend's own compiled kernels: a shared library that CMake builds into the backend's
package only where the vendor toolchain exists, loaded lazily with ctypes.

Every vendor backend with kernels of its own (backends/<vendor>/kernels.py) subclasses
`KernelLibrary`, declaring the C entry points' signatures and typed launchers. When the
library is absent or broken, `missing()` says why in words the adapters reuse as their
decline reason ("cambricon kernel not built (...)"), so dispatch moves on.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Iterable


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


class KernelLibrary:
    """Subclasses set `signatures` ({entry point: (restype, argtypes)}) and may override
    `validate(lib)` (e.g. an ABI check); launchers call `call(name, *args)`."""
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
        """Calls entry point `name`; KernelError if the library is not usable."""
        lib = self._lib
        if lib is None:
            raise KernelError(self.missing() or f"{self.label} library not loaded")
        return getattr(lib, name)(*args)
