"""The stable hash of a KV block's content (no torch): the contract between the replicas' prefix caches
(replica/prefix_cache.py) and the balancer's prefix-aware routing (balancer/prefix_index.py), which both import it
from here, so neither imports the other.

A full block's hash chains its parent's hash with its token ids, so equal hashes mean equal prefixes up to and
including that block; a request's `cache_salt` seeds the chain. blake2b over a fixed little-endian encoding: the same
on every replica, run and platform.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 16
_VERSION = b"fastgen-prefix-v1"  # changing the encoding must change every hash


def adapter_salt(salt: str, adapter: str) -> str:
    """The salt of a request that runs under LoRA adapter `adapter` ("": the base model, whose salt is unchanged):
    KV computed under one adapter differs from the base model's and every other adapter's, so their blocks never
    meet. NUL cannot occur in an adapter's name, so no salt of one adapter equals another's."""
    return f"{salt}\0lora\0{adapter}" if adapter else salt


def root_hash(salt: str = "") -> bytes:
    """The parent hash of a sequence's first block."""
    data = salt.encode("utf-8")
    return hashlib.blake2b(_VERSION + struct.pack("<Q", len(data)) + data, digest_size=HASH_BYTES).digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + struct.pack(f"<{len(token_ids)}Q", *token_ids), digest_size=HASH_BYTES).digest()


def prefix_hashes(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[bytes]:
    """Hashes of the blocks a new request with these prompt tokens could take from the cache: every full block but
    one that holds the last token, which is always computed (the scheduler's rule, Scheduler._cached_prefix)."""
    hashes: list[bytes] = []
    extend_hashes(hashes, token_ids, block_size, salt, (len(token_ids) - 1) // block_size)
    return hashes


def extend_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, salt: str, num_blocks: int) -> None:
    """Appends to `hashes` those of token_ids' full blocks up to block num_blocks - 1 it lacks. Token ids only grow
    at the end, so hashes computed once stay valid for the sequence's life (preemptions included)."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    parent = hashes[-1] if hashes else root_hash(salt)
    for i in range(len(hashes), num_blocks):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
