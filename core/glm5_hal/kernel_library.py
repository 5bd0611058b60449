"""A backend's own compiled kernels: a shared library that CMake builds into the backend's
package only where the vendor toolchain exists, loaded lazily with ctypes.

Every vendor backend with kernels of its own (backends/<vendor>/kernels.py) subclasses
`KernelLibrary`, declaring the C entry points' signatures and typed launchers. When the
library is absent or broken, `missing()` says why in words the adapters reuse as their
decline reason ("cambricon kernel not built (...)"), so dispatch moves on.

What the libraries share is declared once in include/glm5_hal_kernel_abi.h and mirrored
here: the dtype and status codes, and the paged sparse MLA decode kernel, which the
CUDA-dialect, cambricon and kunlun libraries implement behind one entry point. Its launcher
(`SparseMlaDecodeLibrary.sparse_mla_decode_paged`) and its adapter
(`SPARSE_MLA_DECODE_PAGED`) serve all three; each library states its size limits
(`DecodeLimits`).
"""
from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import Tensor

from .vendor_backend import INT32_MAX, Adapter, Verdict

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


# -- the paged sparse MLA decode kernel ----------------------------------------------------------
SPARSE_MLA_DECODE = "glm5_hal_sparse_mla_decode_paged"


class SparseMlaDecodeArgs(ctypes.Structure):
    """glm5_hal_sparse_mla_decode_args of glm5_hal_kernel_abi.h, field for field."""
    _fields_ = [("q", ctypes.c_void_p), ("kv_cache", ctypes.c_void_p), ("block_table", ctypes.c_void_p),
                ("context_lens", ctypes.c_void_p), ("indices", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("lse", ctypes.c_void_p),
                ("batch", ctypes.c_int64), ("queries_per_seq", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("dqk", ctypes.c_int64), ("d_v", ctypes.c_int64), ("topk", ctypes.c_int64),
                ("num_blocks", ctypes.c_int64), ("block_size", ctypes.c_int64), ("max_blocks", ctypes.c_int64),
                ("sm_scale", ctypes.c_float), ("dtype", ctypes.c_int32)]


@dataclasses.dataclass(frozen=True)
class DecodeLimits:
    """The sizes one implementation of the decode kernel takes (its host code refuses others
    with EINVAL; the adapter declines them first, with this reason)."""
    kernel: str                   # names it in reasons: "the BANG C sparse decode kernel"
    max_dqk: int
    max_heads: int
    max_d_v: int | None = None    # None: any d_v <= Dqk (the contract's bound)
    int32_rows: bool = False      # addresses cache rows with int32

    def declined(self, heads: int, dqk: int, d_v: int, cache_rows: int) -> str | None:
        if dqk > self.max_dqk:
            return f"{self.kernel} takes Dqk <= {self.max_dqk}, got {dqk}"
        if self.max_d_v is not None and d_v > self.max_d_v:
            return f"{self.kernel} takes d_v <= {self.max_d_v}, got {d_v}"
        if heads > self.max_heads:
            return f"{self.kernel} takes H <= {self.max_heads}, got {heads}"
        if self.int32_rows and cache_rows > INT32_MAX:
            return f"{self.kernel} addresses cache rows with int32"
        return None


class SparseMlaDecodeLibrary(KernelLibrary):
    """A kernel library exporting glm5_hal_sparse_mla_decode_paged; subclasses state the
    implementation's `decode_limits` (and add their other entry points to `signatures`)."""
    signatures = {SPARSE_MLA_DECODE: (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p])}
    decode_limits: DecodeLimits

    def sparse_mla_decode_paged(self, q: Tensor, kv_cache: Tensor, block_table: Tensor, context_lens: Tensor,
                                indices: Tensor, sm_scale: float, d_v: int, stream: int) -> tuple[Tensor, Tensor]:
        """q [B, N, H, Dqk], kv_cache [num_blocks, block_size, Dqk], block_table [B, max_blocks],
        context_lens [B], indices [B, N, topk] logical positions, all on the device, validated
        by glm5_hal.ops -> (out [B, N, H, d_v] in q's dtype, lse float32 [B, N, H]), enqueued on
        `stream`."""
        batch, queries, heads, dqk = q.shape
        out = q.new_empty((batch, queries, heads, d_v))
        lse = q.new_empty((batch, queries, heads), dtype=torch.float32)
        if lse.numel() == 0:
            return out, lse
        q, kv_cache = q.contiguous(), kv_cache.contiguous()
        table, lens, idx = (t.to(torch.int32).contiguous() for t in (block_table, context_lens, indices))
        args = SparseMlaDecodeArgs(
            pointer(q), pointer(kv_cache), pointer(table), pointer(lens), pointer(idx), pointer(out), pointer(lse),
            batch, queries, heads, dqk, d_v, idx.shape[-1], kv_cache.shape[0], kv_cache.shape[1], table.shape[1],
            float(sm_scale), DTYPE_CODE[q.dtype])
        self.launch(SPARSE_MLA_DECODE, ctypes.byref(args), stream)
        return out, lse


def sparse_mla_decode_declined(backend: Any, heads: int, dqk: int, d_v: int, cache_rows: int) -> str | None:
    """Why `backend`'s decode kernel cannot take a call of these sizes (None: it can)."""
    kernels = backend.kernels
    return kernels.missing() or kernels.decode_limits.declined(heads, dqk, d_v, cache_rows)


# The adapter of every backend that serves sparse_mla_decode_paged with its own decode
# kernel: the backend has `kernels` (a SparseMlaDecodeLibrary) and `stream(device)` (the raw
# handle of its framework's current stream).
def sparse_mla_decode_paged_supported(backend: Any, q: Tensor, kv_cache: Tensor, block_table: Tensor,
                                      context_lens: Tensor, indices: Tensor, sm_scale: float, d_v: int) -> Verdict:
    return sparse_mla_decode_declined(backend, q.shape[2], q.shape[3], d_v,
                                      kv_cache.shape[0] * kv_cache.shape[1]) or True


def sparse_mla_decode_paged(backend: Any, q: Tensor, kv_cache: Tensor, block_table: Tensor, context_lens: Tensor,
                            indices: Tensor, sm_scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    return backend.kernels.sparse_mla_decode_paged(q, kv_cache, block_table, context_lens, indices, sm_scale, d_v,
                                                   backend.stream(q.device))


SPARSE_MLA_DECODE_PAGED = Adapter("sparse_mla_decode_paged", sparse_mla_decode_paged,
                                  dtypes=(torch.float32, torch.float16, torch.bfloat16),
                                  supports=sparse_mla_decode_paged_supported)
