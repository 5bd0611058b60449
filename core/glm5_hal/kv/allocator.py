"""A fixed pool of cache blocks with reference counts (shared prefix blocks)."""
from __future__ import annotations

import collections
from typing import Iterable

from ..errors import HalError, InvalidInputError


class OutOfBlocksError(HalError):
    """An allocation asked for more blocks than the pool has free. Nothing was allocated."""


class BlockAllocator:
    """Hands out block ids in [0, num_blocks), each held through a reference count.

    `allocate(n)` gives n free blocks with count 1; `share(blocks)` adds a reference to
    blocks already held (a forked sequence reusing a prefix); `free(blocks)` drops one
    reference per listed id and returns a block to the pool when its count reaches 0.
    Every call either succeeds completely or raises and changes nothing.
    """

    def __init__(self, num_blocks: int):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise InvalidInputError("BlockAllocator", "num_blocks", "an int >= 0", repr(num_blocks))
        self._refcounts = [0] * num_blocks
        # Popped from the end: the lowest ids go out first, recently freed blocks next.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_blocks(self) -> int:
        return len(self._refcounts)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        """References held on `block` (0: it is in the free pool)."""
        self._check_ids("refcount", "block", [block])
        return self._refcounts[block]

    def allocate(self, n: int) -> list[int]:
        """`n` free blocks, each now with one reference. OutOfBlocksError if fewer are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidInputError("BlockAllocator.allocate", "n", "an int >= 0", repr(n))
        if n > len(self._free):
            raise OutOfBlocksError(f"BlockAllocator.allocate: asked for {n} blocks, only "
                                   f"{len(self._free)} of {self.num_blocks} are free")
        blocks = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        for b in blocks:
            self._refcounts[b] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Adds one reference to each listed block (listed twice: two references).
        Every block must already be held."""
        blocks = list(blocks)
        self._check_ids("share", "blocks", blocks)
        for b in blocks:
            if self._refcounts[b] == 0:
                raise InvalidInputError("BlockAllocator.share", "blocks", "blocks that are allocated",
                                        f"block {b}, which is free")
        for b in blocks:
            self._refcounts[b] += 1

    def free(self, blocks: Iterable[int]) -> list[int]:
        """Drops one reference per listed block; returns the blocks that went back to the pool.
        Dropping more references than a block holds is an error (nothing is freed then)."""
        blocks = list(blocks)
        self._check_ids("free", "blocks", blocks)
        for b, times in collections.Counter(blocks).items():
            if times > self._refcounts[b]:
                raise InvalidInputError("BlockAllocator.free", "blocks",
                                        "blocks holding at least as many references as listed",
                                        f"block {b} listed {times}x with {self._refcounts[b]} references")
        released = []
        for b in blocks:
            self._refcounts[b] -= 1
            if self._refcounts[b] == 0:
                released.append(b)
                self._free.append(b)
        return released

    def _check_ids(self, method: str, arg: str, blocks: list) -> None:
        for b in blocks:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.num_blocks:
                raise InvalidInputError(f"BlockAllocator.{method}", arg,
                                        f"block ids (int) in [0, {self.num_blocks})", repr(b))

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, free={self.num_free})"
