"""Pure-Python block allocator for the paged KV cache: one pool of fixed-size blocks, a free list, and
per-sequence block tables (lists of block ids owned by the sequence)."""

from __future__ import annotations


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popped from the end: freshly freed blocks are reused first, which keeps the working set warm.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks a table must gain to hold num_tokens."""
        return max(0, self.blocks_for(num_tokens) - len(block_table))

    def allocate(self, block_table: list[int], num_tokens: int) -> list[int] | None:
        """Appends blocks so the table holds num_tokens and returns them (empty when it already does); None, with
        the table unchanged, when the pool is short."""
        need = self.extra_blocks(block_table, num_tokens)
        if need > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(need)]
        block_table.extend(blocks)
        return blocks

    def tokens_fitting(self, block_table: list[int], start: int) -> int:
        """How many tokens past position `start` the table can hold after taking every free block."""
        blocks = len(block_table) + len(self._free)
        return max(0, blocks * self.block_size - start)

    def free(self, block_table: list[int]) -> None:
        self._free.extend(reversed(block_table))
        block_table.clear()
