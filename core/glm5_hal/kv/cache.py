"""Per-sequence block tables over a BlockAllocator, and the cache tensor they index."""
from __future__ import annotations

from typing import Hashable, Sequence

import torch

from ..errors import InvalidInputError
from .allocator import BlockAllocator

PAD_BLOCK = -1  # block_table entries past a sequence's blocks


class PagedKVCache:
    """A paged KV cache: `tensor` is `[num_blocks, block_size, dim]` and each sequence owns
    a list of blocks (its block table) from a shared `BlockAllocator`.

    `append(seq, n)` reserves room for n more tokens and returns their slot mapping for
    `glm5_hal.ops.kv_cache_write`; `block_table(seqs)` / `context_lens(seqs)` are the
    arguments of `kv_cache_gather` and the paged attention ops; `free(seq)` releases a
    finished sequence's blocks; `fork(parent, child)` shares the parent's *full* blocks
    with a new sequence (prefix caching: full blocks are immutable, so sharing them needs
    no copy-on-write; the tokens of a partly filled last block are not shared and the
    child must append and write them itself).

    Every tensor from `new_cache` has the same block geometry, so one set of block tables
    serves all layers (and the indexer's FP8 key cache and its scales).
    """

    def __init__(self, num_blocks: int, block_size: int, dim: int, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None):
        for arg, v, low in (("num_blocks", num_blocks, 0), ("block_size", block_size, 1), ("dim", dim, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InvalidInputError("PagedKVCache", arg, f"an int >= {low}", repr(v))
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype
        self.tensor = self.new_cache(dim)
        self._blocks: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def new_cache(self, *row_shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A zeroed tensor `[num_blocks, block_size, *row_shape]` (default dtype: the cache's)
        on this cache's device,
        addressed by the same slot mappings and block tables (another layer's cache,
        `new_cache(128, dtype=torch.float8_e4m3fn)` and `new_cache(dtype=torch.float32)`
        for the indexer's keys and scales)."""
        return torch.zeros(self.num_blocks, self.block_size, *row_shape, dtype=dtype or self.dtype,
                           device=self.device)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._lens

    def append(self, seq_id: Hashable, n: int) -> torch.Tensor:
        """Reserves slots for `n` more tokens of `seq_id` (created on first use), allocating
        blocks as needed. Returns their slot mapping, int32 [n] on the cache's device.
        OutOfBlocksError (nothing changed) when the pool cannot hold them."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidInputError("PagedKVCache.append", "n", "an int >= 0", repr(n))
        blocks = self._blocks.get(seq_id, [])
        start = self._lens.get(seq_id, 0)
        needed = -(-(start + n) // self.block_size) - len(blocks)
        blocks = blocks + self.allocator.allocate(max(needed, 0))
        self._blocks[seq_id], self._lens[seq_id] = blocks, start + n
        table = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        pos = torch.arange(start, start + n, device=self.device)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(torch.int32)

    def fork(self, parent: Hashable, child: Hashable) -> int:
        """Starts sequence `child` with the full blocks of `parent` (shared, reference
        counted). Returns the child's length: the parent's length rounded down to a
        multiple of block_size."""
        self._known("fork", "parent", parent)
        if child in self._lens:
            raise InvalidInputError("PagedKVCache.fork", "child", "a new sequence id",
                                    f"{child!r}, which already exists")
        full = self._lens[parent] // self.block_size
        shared = self._blocks[parent][:full]
        self.allocator.share(shared)
        self._blocks[child], self._lens[child] = list(shared), full * self.block_size
        return self._lens[child]

    def free(self, seq_id: Hashable) -> None:
        """Forgets `seq_id` and drops its references to its blocks."""
        self._known("free", "seq_id", seq_id)
        self.allocator.free(self._blocks.pop(seq_id))
        del self._lens[seq_id]

    def block_table(self, seq_ids: Sequence[Hashable], width: int | None = None) -> torch.Tensor:
        """int32 [B, width] on the cache's device: row b lists the blocks of seq_ids[b] in
        order, padded with -1. width defaults to the longest list (0 if all are empty)."""
        tables = [self._blocks[self._known("block_table", "seq_ids", s)] for s in seq_ids]
        longest = max((len(t) for t in tables), default=0)
        if width is None:
            width = longest
        elif isinstance(width, bool) or not isinstance(width, int) or width < longest:
            raise InvalidInputError("PagedKVCache.block_table", "width",
                                    f"an int >= {longest} (the most blocks of these sequences)", repr(width))
        rows = [t + [PAD_BLOCK] * (width - len(t)) for t in tables]
        return torch.tensor(rows, dtype=torch.int32, device=self.device).reshape(len(rows), width)

    def context_lens(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """int32 [B] on the cache's device: the tokens held by each of seq_ids."""
        lens = [self._lens[self._known("context_lens", "seq_ids", s)] for s in seq_ids]
        return torch.tensor(lens, dtype=torch.int32, device=self.device)

    def _known(self, method: str, arg: str, seq_id: Hashable) -> Hashable:
        if seq_id not in self._lens:
            raise InvalidInputError(f"PagedKVCache.{method}", arg, "a sequence id of this cache",
                                    repr(seq_id))
        return seq_id

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"sequences={len(self._lens)}, free_blocks={self.allocator.num_free})")
