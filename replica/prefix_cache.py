"""Automatic prefix caching (vLLM's design): full KV blocks addressed by their content, and the index of the ones
whose KV is complete (no torch).

A full block's hash chains its parent's hash with its token ids, so equal hashes mean equal prefixes up to and
including that block. A request's `cache_salt` seeds the chain, so requests with different salts never share a block
nor can tell, by timing, whether another tenant's prefix is cached. The hash (fastgen/prefix_hash.py) is the same on
every replica, run and platform, so that a balancer computes it too.

Blocks no sequence holds stay in the index, on an LRU list, until the pool needs them back.

The index also records what it stores and evicts, for the replica to stream to a cache-aware balancer (WatchCache):
the engine thread drains the record after each step. Nobody may drain it (the offline pipeline), so it is bounded;
past the bound it is dropped and the drain says so, and the reader starts again from a snapshot (`hashes()`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ..prefix_hash import HASH_BYTES, block_hash, extend_hashes, prefix_hashes, root_hash  # noqa: F401 (re-exported)

MAX_EVENTS = 1 << 16  # undrained changes kept before the record is dropped for a snapshot


class PrefixCache:
    """hash <-> block for every block whose KV is complete, and the least recently used order of those no sequence
    holds (the evictable ones). The allocator owns reference counts; this only indexes."""

    def __init__(self) -> None:
        self._block: dict[bytes, int] = {}
        self._hash: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable blocks, least recently freed first
        self._events: list[tuple[bool, bytes]] = []  # (stored?, hash) since the last drain
        self._events_dropped = False

    def drain_events(self) -> tuple[list[tuple[bool, bytes]], bool]:
        """The (stored, hash) changes since the last drain, oldest first (stored False: evicted), and whether some
        were dropped (then the caller resends `hashes()` whole instead)."""
        events, dropped = self._events, self._events_dropped
        self._events, self._events_dropped = [], False
        return events, dropped

    def hashes(self) -> list[bytes]:
        """Every cached block's hash: a snapshot for a reader of the events."""
        return list(self._block)

    def _record(self, stored: bool, h: bytes) -> None:
        if self._events_dropped:
            return
        if len(self._events) >= MAX_EVENTS:
            self._events, self._events_dropped = [], True
            return
        self._events.append((stored, h))

    @property
    def num_cached(self) -> int:
        """Blocks with a registered hash, held or evictable."""
        return len(self._hash)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks of the longest cached chain of `hashes`."""
        blocks = []
        for h in hashes:
            block = self._block.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def find(self, h: bytes) -> int | None:
        """The block cached under hash h, whatever is cached before it in its chain; None if none is."""
        return self._block.get(h)

    def register(self, block: int, h: bytes) -> None:
        """Publishes a block whose KV is now complete. A hash already cached in another block keeps that block:
        this one stays private and is freed as uncached."""
        if h not in self._block and block not in self._hash:
            self._block[h] = block
            self._hash[block] = h
            self._record(True, h)

    def park(self, block: int) -> bool:
        """A block no sequence holds any more: evictable if cached (True), else the caller frees it (False)."""
        if block not in self._hash:
            return False
        self._lru[block] = None
        return True

    def unpark(self, block: int) -> None:
        """A cached block that a sequence takes back: no longer evictable."""
        self._lru.pop(block, None)

    def is_evictable(self, block: int) -> bool:
        return block in self._lru

    def evict(self) -> int:
        """Forgets the least recently used evictable block and returns it for reuse."""
        block, _ = self._lru.popitem(last=False)
        h = self._hash.pop(block)
        del self._block[h]
        self._record(False, h)
        return block

    def hash_of(self, block: int) -> bytes | None:
        return self._hash.get(block)
