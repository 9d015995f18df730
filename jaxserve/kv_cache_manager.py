"""KV-cache block accounting: a pool of fixed-size blocks with reference counts (host side).

Block 0 is the null block: padding tokens write into it, so it is never handed out.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from jaxserve.request import Request


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.ref_counts = np.zeros(num_blocks, np.int32)
        self.ref_counts[0] = 1  # the null block is never freed
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(count)]
        self.ref_counts[blocks] = 1
        return blocks

    def release(self, block_ids: list[int]) -> None:
        for block in block_ids:
            if block == 0 or self.ref_counts[block] <= 0:
                raise RuntimeError(f"block {block} released more often than it was allocated")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free.append(block)


class KVCacheManager:
    """Gives each request the blocks its computed tokens need, and takes them back."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (0 when idle)."""
        usable = self.pool.num_blocks - 1
        return (usable - self.pool.num_free) / usable

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more computed tokens; False (nothing changed) if the
        pool cannot."""
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        missing = needed - len(request.block_ids)
        if missing <= 0:
            return True
        blocks = self.pool.allocate(missing)
        if blocks is None:
            return False
        request.block_ids.extend(blocks)
        return True

    def free(self, request: Request) -> None:
        self.pool.release(request.block_ids)
        request.block_ids = []
