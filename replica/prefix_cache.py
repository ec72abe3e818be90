"""Automatic prefix caching (vLLM's design): full KV blocks addressed by their content, and the index of the ones
whose KV is complete (no torch).

A full block's hash chains its parent's hash with its token ids, so equal hashes mean equal prefixes up to and
including that block. A request's `cache_salt` seeds the chain, so requests with different salts never share a block
nor can tell, by timing, whether another tenant's prefix is cached. The hash is blake2b over a fixed little-endian
encoding: the same on every replica, run and platform, so that a balancer can compute it too.

Blocks no sequence holds stay in the index, on an LRU list, until the pool needs them back.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

HASH_BYTES = 16
_VERSION = b"fastgen-prefix-v1"  # changing the encoding must change every hash


def root_hash(salt: str = "") -> bytes:
    """The parent hash of a sequence's first block."""
    data = salt.encode("utf-8")
    return hashlib.blake2b(_VERSION + struct.pack("<Q", len(data)) + data, digest_size=HASH_BYTES).digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + struct.pack(f"<{len(token_ids)}Q", *token_ids), digest_size=HASH_BYTES).digest()


def extend_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, salt: str, num_blocks: int) -> None:
    """Appends to `hashes` those of token_ids' full blocks up to block num_blocks - 1 it lacks. Token ids only grow
    at the end, so hashes computed once stay valid for the sequence's life (preemptions included)."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    parent = hashes[-1] if hashes else root_hash(salt)
    for i in range(len(hashes), num_blocks):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)


class PrefixCache:
    """hash <-> block for every block whose KV is complete, and the least recently used order of those no sequence
    holds (the evictable ones). The allocator owns reference counts; this only indexes."""

    def __init__(self) -> None:
        self._block: dict[bytes, int] = {}
        self._hash: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable blocks, least recently freed first

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

    def register(self, block: int, h: bytes) -> None:
        """Publishes a block whose KV is now complete. A hash already cached in another block keeps that block:
        this one stays private and is freed as uncached."""
        if h not in self._block and block not in self._hash:
            self._block[h] = block
            self._hash[block] = h

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
        del self._block[self._hash.pop(block)]
        return block

    def hash_of(self, block: int) -> bytes | None:
        return self._hash.get(block)
