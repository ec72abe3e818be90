"""Pure-Python block allocator for the paged KV cache: one pool of fixed-size blocks, a reference count per block,
and per-sequence block tables (lists of block ids the sequence holds).

With prefix caching a block no sequence holds keeps its KV and its hash (prefix_cache.PrefixCache) until the pool
needs it: blocks never cached are handed out first, then cached ones, least recently freed first."""

from __future__ import annotations

from collections.abc import Sequence

from .prefix_cache import PrefixCache


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popped from the end: freshly freed blocks are reused first, which keeps the working set warm.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self.cache = PrefixCache() if prefix_caching else None
        self.num_evictions = 0  # cached blocks handed out again, since start

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: never cached, or cached and held by no sequence."""
        return len(self._free) + (self.cache.num_evictable if self.cache else 0)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return self.cache.num_cached if self.cache else 0

    def refs(self, block: int) -> int:
        return self._refs[block]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks a table must gain to hold num_tokens."""
        return max(0, self.blocks_for(num_tokens) - len(block_table))

    def allocate(self, block_table: list[int], num_tokens: int) -> list[int] | None:
        """Appends blocks so the table holds num_tokens and returns them (empty when it already does); None, with
        the table unchanged, when the pool is short."""
        need = self.extra_blocks(block_table, num_tokens)
        if need > self.num_free:
            return None
        blocks = [self._take() for _ in range(need)]
        block_table.extend(blocks)
        return blocks

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            assert self.cache is not None, "num_free counts blocks beyond the free list only in the cache"
            block = self.cache.evict()
            self.num_evictions += 1
        self._refs[block] = 1
        return block

    def tokens_fitting(self, block_table: list[int], start: int) -> int:
        """How many tokens past position `start` the table can hold after taking every free block."""
        blocks = len(block_table) + self.num_free
        return max(0, blocks * self.block_size - start)

    def free(self, block_table: list[int], held_from: int = 0) -> None:
        """Drops the table's hold on its blocks: those from `held_from` on (the entries before it were given back by
        release_head and alias a held block). Tail first: of one sequence's cached blocks the head, which more
        requests share, is evicted last."""
        for block in reversed(block_table[held_from:]):
            self._drop(block)
        block_table.clear()

    def release_head(self, block_table: list[int], held_from: int, upto: int) -> None:
        """Gives back the table's blocks held_from .. upto - 1, whose KV no query will read again (they lie outside
        every layer's attention window), while the table keeps its length so that a position still finds its block
        by index: entries 0 .. upto - 1 then alias block `upto`, one the table holds, so a kernel that reads them
        before masking reads this sequence's own finite KV, never a block another sequence is writing."""
        assert held_from <= upto < len(block_table), "a table keeps at least one block past those it gives back"
        for block in reversed(block_table[held_from:upto]):
            self._drop(block)
        block_table[:upto] = [block_table[upto]] * upto

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] < 0:
            raise RuntimeError(f"KV block {block} freed more often than it was taken")
        if self._refs[block] == 0 and not (self.cache and self.cache.park(block)):
            self._free.append(block)

    def shrink(self, block_table: list[int], num_tokens: int) -> None:
        """Frees the table's blocks past those holding num_tokens (a speculative decode's rejected proposals)."""
        tail = block_table[self.blocks_for(num_tokens) :]
        del block_table[len(block_table) - len(tail) :]
        self.free(tail)

    # ---- sharing ---------------------------------------------------------------------------------------
    def share(self, block_table: list[int], blocks: Sequence[int]) -> None:
        """Appends blocks that other tables hold or the cache keeps, taking a reference on each."""
        for block in blocks:
            if self._refs[block] == 0:
                assert self.cache is not None, "a block no table holds can be shared only from the cache"
                self.cache.unpark(block)
            self._refs[block] += 1
        block_table.extend(blocks)

    def reclaimed(self, blocks: Sequence[int]) -> int:
        """How many of blocks sharing them would take out of the free pool (cached, held by no one)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest chain of hashes (none without prefix caching)."""
        return self.cache.lookup(hashes) if self.cache else []

    def lookup_window(self, hashes: Sequence[bytes], window: int) -> tuple[int, list[int]]:
        """(skipped, blocks): the longest prefix of `hashes` (k blocks) that a sequence can start after when a query
        at position p reads only keys p - window + 1 .. p: the blocks that the query at k * block_size can still
        read, those from the one holding key k * block_size - window + 1 to block k - 1 (at least block k - 1), are
        all cached. `blocks` are those, `skipped` the k - len(blocks) before them, which need not be cached: a later
        block's hash chains over their tokens, not over their blocks. (0, []) when no k qualifies, or without prefix
        caching. Each hash is probed at most once, from the last: a miss bounds the next k to try."""
        if self.cache is None:
            return 0, []
        k = len(hashes)
        while k > 0:  # from the longest: a miss at block j rules out every k past j, whose window reaches it
            first = min(max(0, k * self.block_size - window + 1) // self.block_size, k - 1)
            blocks: list[int] = []
            for j in range(k - 1, first - 1, -1):
                block = self.cache.find(hashes[j])
                if block is None:
                    k = j
                    break
                blocks.append(block)
            else:
                return first, blocks[::-1]
        return 0, []

    def publish(self, block: int, block_hash: bytes) -> None:
        """Registers a block whose KV is complete, for later requests to share."""
        if self.cache:
            self.cache.register(block, block_hash)
