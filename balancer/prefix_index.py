"""Where the replicas' cached prefixes are, as the balancer knows it, and a prompt's block hashes (no torch).

Each replica streams its prefix cache's changes (WatchCache); `CacheView` rebuilds the set of block hashes it holds
and notices a gap in the sequence numbers, after which the pool watches anew and starts again from a snapshot.
While a replica's stream is down (or it predates WatchCache) the view falls back to what the balancer routed there
recently. Routed hashes also cover the moments between routing a request and the replica storing its blocks, but
only for a short while when events flow: the events are the truth, and a guess must not outlive an eviction.

A prompt is hashed as the replica hashes it (replica/prefix_cache.py, the same functions): token-id prompts as they
are, text and chat through the replicas' tokenizer and chat template (balancer/tokenizer.py). Without a tokenizer,
text and chat prompts get an inexact key: chained hashes of fixed runs of characters, which only the routed-recently
record can match, giving affinity by a prompt's leading text.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..prefix_hash import adapter_salt, prefix_hashes, root_hash
from .policy import CHARS_PER_TOKEN, estimate_prompt_tokens
from .tokenizer import PromptTokenizer

log = logging.getLogger("fastgen.balancer")

TEXT_CHUNK_CHARS = 64 * CHARS_PER_TOKEN  # a block of an inexact key: about 64 tokens of text
RECENT_TTL_S = 5.0  # how long a routed guess counts while the replica's events flow
DEFAULT_RECENT_CAPACITY = 65536  # routed hashes remembered per replica before its pool size is known


@dataclass(frozen=True)
class PromptKey:
    """A prompt's cacheable blocks: chained hashes of its full blocks except one holding its last token (a request
    always computes that one)."""

    hashes: tuple[bytes, ...]
    tokens: int  # prompt length: exact when tokenized, estimated otherwise
    block_tokens: int  # tokens each hash stands for
    exact: bool  # the replica's own block hashes (comparable with its events); False: a leading-text key

    def cached_tokens(self, blocks: int) -> int:
        """Tokens of the prompt that `blocks` leading cached blocks spare (the last token is always computed)."""
        return min(blocks * self.block_tokens, max(0, self.tokens - 1))


class PromptHasher:
    """A GenerateRequest's PromptKey for a block size. The tokenizer may be None: token-id prompts still get exact
    keys, text and chat inexact ones."""

    def __init__(self, tokenizer: PromptTokenizer | None = None) -> None:
        self.tokenizer = tokenizer

    def key(self, request, block_size: int) -> PromptKey | None:
        """None for a request without a prompt; a failing tokenizer or template gives the inexact key (the replica
        will answer the request's error itself)."""
        salt = adapter_salt(request.params.cache_salt, request.lora_name)  # as the replica keys its blocks
        kind = request.WhichOneof("prompt")
        if kind is None or block_size <= 0:
            return None
        ids = self._token_ids(request, kind)
        if ids is not None:
            return PromptKey(tuple(prefix_hashes(ids, block_size, salt)), len(ids), block_size, True)
        return text_key(_prompt_text(request, kind), estimate_prompt_tokens(request), salt)

    def _token_ids(self, request, kind: str) -> list[int] | None:
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if self.tokenizer is None:
            return None
        try:
            if kind == "text":
                return self.tokenizer.encode_text(request.text)
            messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
            return self.tokenizer.encode_chat(messages)
        except Exception as e:  # noqa: BLE001 - routing falls back; the replica reports the request's problem
            log.debug("cannot tokenize a %s prompt for routing: %s", kind, e)
            return None


def _prompt_text(request, kind: str) -> str:
    if kind == "text":
        return request.text
    # Role and content, separated by characters no message holds, so that different splits differ.
    return "".join(f"{m.role}\x00{m.content}\x01" for m in request.messages.messages)


def text_key(text: str, tokens: int, salt: str = "") -> PromptKey:
    """An inexact key: chained hashes of TEXT_CHUNK_CHARS-character runs (all but the one with the last character),
    seeded apart from token hashes so the two never meet."""
    parent = hashlib.blake2b(b"text:" + root_hash(salt), digest_size=16).digest()
    hashes = []
    for start in range(0, max(0, len(text) - 1) // TEXT_CHUNK_CHARS * TEXT_CHUNK_CHARS, TEXT_CHUNK_CHARS):
        chunk = text[start : start + TEXT_CHUNK_CHARS].encode("utf-8", "surrogatepass")
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        hashes.append(parent)
    return PromptKey(tuple(hashes), tokens, TEXT_CHUNK_CHARS // CHARS_PER_TOKEN, False)


@dataclass
class CacheView:
    """What the balancer knows of one replica's prefix cache."""

    blocks: set[bytes] = field(default_factory=set)  # from the replica's events; meaningful while `live`
    live: bool = False  # a watch is connected and has applied a snapshot with no gap since
    seq: int = -1  # the last batch applied
    recent: OrderedDict[bytes, float] = field(default_factory=OrderedDict)  # routed here: hash -> time.monotonic()
    recent_capacity: int = DEFAULT_RECENT_CAPACITY
    resyncs: int = 0  # watches restarted after a gap

    # ---- the event stream ----
    def apply(self, seq: int, stored: Iterable[bytes], removed: Iterable[bytes], reset: bool, snapshot: bool) -> bool:
        """Applies one CacheEvents message; False when it shows a gap (the caller watches anew)."""
        if reset:
            self.blocks = set(stored)
            self.seq, self.live = seq, True
            return True
        in_order = seq == self.seq if snapshot else seq == self.seq + 1
        if not self.live or not in_order:
            self.resyncs += 1
            self.drop()
            return False
        self.blocks.update(stored)
        self.blocks.difference_update(removed)
        self.seq = seq
        return True

    def drop(self) -> None:
        """The stream is gone: forget its set and fall back to what was routed here."""
        self.blocks = set()
        self.live = False
        self.seq = -1

    # ---- routing ----
    def note_routed(self, key: PromptKey, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for h in key.hashes:
            self.recent[h] = now
            self.recent.move_to_end(h)
        while len(self.recent) > self.recent_capacity:
            self.recent.popitem(last=False)

    def cached_blocks(self, key: PromptKey, now: float | None = None) -> int:
        """How many of the key's leading blocks the replica is believed to hold."""
        now = time.monotonic() if now is None else now
        # While events flow, a routed guess counts only until the events should have confirmed it.
        fresh_after = now - RECENT_TTL_S if self.live and key.exact else float("-inf")
        n = 0
        for h in key.hashes:
            if self.live and key.exact and h in self.blocks:
                n += 1
                continue
            routed = self.recent.get(h)
            if routed is None or routed < fresh_after:
                break
            n += 1
        return n

    def cached_tokens(self, key: PromptKey, now: float | None = None) -> int:
        return key.cached_tokens(self.cached_blocks(key, now))
