"""Reused memory for the cpu backend's large outputs.

Why: a large output allocated fresh on every call is fresh memory on every call. glibc serves
blocks above its mmap threshold (at most 32 MiB, dynamic below) with a new mmap and unmaps
them on free, so each call page-faults its whole output again: measured here, 100 MB of
moe_permute output costs 60-110 ms in faults against 3-6 ms of copying (docs/performance.md,
"Steady state"). tcmalloc/jemalloc preloaded, or mallopt(M_MMAP_THRESHOLD), would change that
for the whole process; a library must not, so the backend keeps its own large outputs instead.

How: outputs of at least `min_bytes` come from blocks (torch storages) that this cache keeps.
A block is lent by building a new tensor on its storage (Tensor.set_: not a view, no autograd
link to anything) and is idle again only when nothing but the cache references its storage:
its C++ use count is 1 (every tensor, view, saved autograd tensor, numpy array or DLPack
capsule holds one) and no Python object other than the cache holds the storage object
(`t.untyped_storage()` returns that same object, so a caller keeping only the storage keeps
the block lent too). Memory a live tensor uses is therefore never lent twice; the tests pin
each of those holders.

Bounds: the blocks the cache tracks (lent or idle) total at most `capacity` bytes
(GLM5_HAL_CPU_OUTPUT_CACHE_MB, default min(1 GiB, RAM/8); 0 turns the cache off). To make
room it frees idle blocks, least recently lent first, then stops tracking lent ones (their
memory stays with the caller's tensors and is freed by torch as usual). `release()` frees
every idle block at once (glm5_hal.backends.cpu.release_cached_outputs). Memory pressure: the
cache grows only while the machine (and a cgroup v2 limit, if any) keeps `reserve` bytes
available after the new block, and it frees its idle blocks and retries once when an
allocation fails.
"""
from __future__ import annotations

import math
import mmap
import os
import sys
import threading

import torch

from glm5_hal.errors import PluginError

_MIB = 1 << 20
# Blocks come in size classes (a 2 MiB multiple, at most 1/16 above the request), so outputs
# whose row count varies a little between calls share blocks.
_GRANULE = 2 * _MIB
# Below this an output is left to torch: glibc keeps blocks under its dynamic mmap threshold
# in the heap, and the cache's own work per call (a few us) would cost more than it saves.
DEFAULT_MIN_BYTES = 1 * _MIB
# Whether blocks ask for transparent huge pages (GLM5_HAL_CPU_HUGE_PAGES=0/1 overrides). On by
# measurement (docs/performance.md, "Steady state"): the request costs once per block, at its
# first touch, and steady-state calls on huge pages were faster.
HUGE_PAGES_DEFAULT = True
# glibc's largest mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX in glibc's malloc/malloc.c, 64-bit):
# blocks at least this large are fresh mappings under glibc whatever the process did before.
FRESH_MAP_BYTES = 32 * _MIB
_use_count = torch._C._storage_Use_Count
_CPU = torch.device("cpu")


def size_class(nbytes: int) -> int:
    step = max(_GRANULE, 1 << max(0, (nbytes - 1).bit_length() - 4))
    return -(-nbytes // step) * step


class Block:
    __slots__ = ("storage", "nbytes", "data_ptr")

    def __init__(self, storage: torch.UntypedStorage):
        self.storage = storage
        self.nbytes = storage.nbytes()
        self.data_ptr = storage.data_ptr()

    def idle(self) -> bool:
        """Nothing but the cache holds the storage (see the module docstring)."""
        s = self.storage
        return _use_count(s._cdata) == 1 and sys.getrefcount(s) == _IDLE_REFS

    def python_refs(self) -> int:
        s = self.storage   # as in idle(): the same references on the stack
        return sys.getrefcount(s)

    def intact(self) -> bool:
        """Still the memory the cache made: a caller may have moved the storage while it was
        lent (Tensor.share_memory_; growing it fails: the storage is not resizable)."""
        s = self.storage
        return s.nbytes() == self.nbytes and s.data_ptr() == self.data_ptr


# What sys.getrefcount reports in Block.idle() when only the Block holds the storage object,
# measured on this interpreter (the count includes the interpreter's own temporary references).
_IDLE_REFS = Block(torch.empty(0, dtype=torch.uint8).untyped_storage()).python_refs()


def _meminfo_available() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), tightened by
    a cgroup v2 memory.max; None where neither is readable."""
    best = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    best = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                room = int(limit) - int(f.read().strip())
            best = room if best is None else min(best, room)
    except (OSError, ValueError):
        pass
    return best


def map_block(nbytes: int, huge_pages: bool) -> torch.UntypedStorage:
    """`nbytes` of fresh anonymous memory as a storage (the storage owns the mapping: it is
    unmapped when the storage dies). huge_pages: ask Linux for transparent huge pages on it
    (madvise(MADV_HUGEPAGE)) before its first touch; see docs/performance.md for when that pays."""
    if hasattr(mmap, "MAP_ANONYMOUS"):
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:   # Windows: -1 is an anonymous mapping already
        m = mmap.mmap(-1, nbytes)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(m, dtype=torch.uint8).untyped_storage()


def _env_flag(name: str, default: bool) -> bool:
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    if text not in ("0", "1"):
        raise PluginError(f"{name}: expected 0 or 1, got {text!r}")
    return text == "1"


def _default_capacity() -> int:
    text = os.environ.get("GLM5_HAL_CPU_OUTPUT_CACHE_MB")
    if text is not None:
        try:
            mb = int(text)
        except ValueError:
            raise PluginError(f"GLM5_HAL_CPU_OUTPUT_CACHE_MB: expected a whole number of MiB (0: off), "
                              f"got {text!r}") from None
        if mb < 0:
            raise PluginError(f"GLM5_HAL_CPU_OUTPUT_CACHE_MB: expected >= 0, got {mb}")
        return mb * _MIB
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 << 30
    return min(1 << 30, ram // 8)


class OutputCache:
    """Large output buffers reused across calls; see the module docstring."""

    def __init__(self, capacity: int, min_bytes: int = DEFAULT_MIN_BYTES, reserve: int = 512 * _MIB,
                 huge_pages: bool = False, available=_meminfo_available, allocate=None):
        self._lock = threading.Lock()
        self._blocks: list[Block] = []   # least recently lent first
        self._held = 0
        self.capacity = capacity
        self.min_bytes = min_bytes
        self.reserve = reserve
        self._available = available
        self.huge_pages = huge_pages
        self._allocate = allocate or (lambda n: map_block(n, self.huge_pages))
        self.hits = self.misses = self.uncached = 0

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous, uninitialised tensor of `shape` and `dtype`, like torch.empty."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes:
            return torch.empty(shape, dtype=dtype)
        if nbytes > self.capacity:
            return self._uncached(shape, dtype, nbytes)
        with self._lock:   # held until the tensor exists: before that the block still reads idle
            storage = self._take(nbytes)
            if storage is not None:
                return torch.empty(0, dtype=dtype, device=_CPU).set_(storage, 0, shape)
        return torch.empty(shape, dtype=dtype)

    def _uncached(self, shape, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        """An output the cache cannot keep (larger than its capacity, or the cache off). glibc maps
        one of at least FRESH_MAP_BYTES fresh whatever happens, so it is mapped here instead, with
        the cache's huge-page setting, unless memory is short; smaller ones come from torch."""
        if nbytes >= FRESH_MAP_BYTES and self.huge_pages:
            available = self._available()
            if available is None or available - nbytes >= self.reserve:
                try:
                    storage = map_block(nbytes, True)
                except OSError:
                    return torch.empty(shape, dtype=dtype)
                return torch.empty(0, dtype=dtype, device=_CPU).set_(storage, 0, shape)
        return torch.empty(shape, dtype=dtype)

    def _take(self, nbytes: int) -> torch.UntypedStorage | None:
        want = size_class(nbytes)
        blocks = self._blocks
        for i, b in enumerate(blocks):
            if b.nbytes == want and b.idle():
                if not b.intact():   # resized or moved while lent: not the cache's memory any more
                    self._forget(i)
                    break
                blocks.append(blocks.pop(i))
                self.hits += 1
                return b.storage
        self.misses += 1
        self._shrink(self.capacity - want)
        available = self._available()
        if available is not None and available - want < self.reserve:
            self._drop_idle()   # memory pressure: give back what sits idle, do not grow
            self.uncached += 1
            return None
        try:
            storage = self._allocate(want)
        except (RuntimeError, OSError):   # out of memory (mmap: OSError ENOMEM): give back what sits idle; torch tries once more
            self._drop_idle()
            self.uncached += 1
            return None
        blocks.append(Block(storage))
        self._held += want
        return storage

    def _shrink(self, limit: int) -> None:
        """Frees idle blocks, then stops tracking lent ones, oldest first, until at most
        `limit` bytes are held."""
        blocks = self._blocks
        i = 0
        while self._held > limit and i < len(blocks):
            if blocks[i].idle():
                self._forget(i)
            else:
                i += 1
        while self._held > limit and blocks:
            self._forget(0)

    def _drop_idle(self) -> int:
        idle = [b for b in self._blocks if b.idle()]
        for b in idle:
            self._blocks.remove(b)
            self._held -= b.nbytes
        return sum(b.nbytes for b in idle)

    def _forget(self, i: int) -> None:
        self._held -= self._blocks.pop(i).nbytes

    def release(self) -> int:
        """Frees every idle block now and stops tracking lent ones (freed with their tensors);
        returns the bytes freed now."""
        with self._lock:
            freed = self._drop_idle()
            self._blocks.clear()
            self._held = 0
        return freed

    def set_capacity(self, capacity: int) -> None:
        """Sets the bound (bytes; 0 turns the cache off), releasing what no longer fits."""
        if capacity < 0:
            raise ValueError(f"capacity: expected >= 0 bytes, got {capacity}")
        with self._lock:
            self.capacity = capacity
            self._shrink(capacity)

    def stats(self) -> dict:
        with self._lock:
            idle = sum(b.nbytes for b in self._blocks if b.idle())
            return {"capacity": self.capacity, "min_bytes": self.min_bytes, "held_bytes": self._held,
                    "idle_bytes": idle, "lent_bytes": self._held - idle, "blocks": len(self._blocks),
                    "hits": self.hits, "misses": self.misses, "uncached": self.uncached}


outputs = OutputCache(_default_capacity(), huge_pages=_env_flag("GLM5_HAL_CPU_HUGE_PAGES", HUGE_PAGES_DEFAULT))
if hasattr(os, "register_at_fork"):   # a forked child starts with an unheld lock
    os.register_at_fork(after_in_child=lambda: setattr(outputs, "_lock", threading.Lock()))
empty = outputs.empty


def empty_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous, uninitialised tensor shaped like `x` (of `dtype`, default x's): small ones
    straight from torch.empty_like (about half the cost of torch.empty(shape, dtype=...))."""
    dtype = dtype or x.dtype
    if x.nbytes // x.dtype.itemsize * dtype.itemsize < outputs.min_bytes:
        return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    return outputs.empty(x.shape, dtype)
