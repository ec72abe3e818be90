"""What a replica tells a cache-aware balancer besides its load (no torch): the changes of its prefix cache, fanned
out to WatchCache streams, and how fast it prefills.

The engine thread drains the prefix cache's record after each step and hands the batch to the event loop
(`CacheFeed.publish`, through call_soon_threadsafe); it never waits for a watcher. The feed keeps a copy of the
cached hashes on the event loop, so a new watcher gets a snapshot consistent with the batches that follow it without
asking the engine thread. A watcher that falls too far behind is dropped and must watch anew (and gets a snapshot).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

SNAPSHOT_PART = 8192  # hashes per message of a snapshot: 128 KiB, far below gRPC's message limit
MAX_QUEUED = 1024  # batches a watcher may lag behind before it is dropped


@dataclass
class CacheBatch:
    """One message of a WatchCache stream (fastgen.v1.CacheEvents) before it is put on the wire."""

    seq: int
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    reset: bool = False
    snapshot: bool = False


class FellBehind(Exception):
    """The watcher's queue overflowed: its view would have a gap."""


class CacheFeed:
    """The event loop's copy of the cache's hashes and the watchers' queues. Methods run on the event loop."""

    def __init__(self, max_queued: int = MAX_QUEUED) -> None:
        self.seq = 0
        self.hashes: set[bytes] = set()
        self._max_queued = max_queued
        self._watchers: set[asyncio.Queue] = set()

    @property
    def watchers(self) -> int:
        return len(self._watchers)

    def publish(self, events: list[tuple[bool, bytes]], snapshot: list[bytes] | None = None) -> None:
        """Applies one drained batch: `events` in order, or (when the record was dropped) `snapshot`, the whole set."""
        self.seq += 1
        if snapshot is not None:
            self.hashes = set(snapshot)
            batches = self._snapshot()
        else:
            stored, removed = [], []
            for is_stored, h in events:
                if is_stored:
                    self.hashes.add(h)
                    stored.append(h)
                else:
                    self.hashes.discard(h)
                    removed.append(h)
            batches = [CacheBatch(self.seq, stored, removed)]
        for queue in list(self._watchers):
            if queue.qsize() + len(batches) > self._max_queued:
                self._watchers.discard(queue)
                queue.put_nowait(FellBehind())
                continue
            for batch in batches:
                queue.put_nowait(batch)

    def _snapshot(self) -> list[CacheBatch]:
        hashes = list(self.hashes)
        parts = [hashes[i : i + SNAPSHOT_PART] for i in range(0, len(hashes), SNAPSHOT_PART)] or [[]]
        return [CacheBatch(self.seq, part, reset=i == 0, snapshot=True) for i, part in enumerate(parts)]

    async def watch(self) -> AsyncIterator[CacheBatch]:
        """A snapshot, then every batch; raises FellBehind when the caller could not keep up."""
        queue: asyncio.Queue = asyncio.Queue()
        for batch in self._snapshot():
            queue.put_nowait(batch)
        self._watchers.add(queue)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, FellBehind):
                    raise item
                yield item
        finally:
            self._watchers.discard(queue)


class PrefillRate:
    """Tokens processed per second of step time over the steps that prefill: what a balancer divides queued prompt
    tokens by to predict time to first token. A ratio of moving sums, so long steps weigh as much as they last."""

    def __init__(self, alpha: float = 0.05) -> None:
        self.alpha = alpha
        self._tokens = 0.0
        self._seconds = 0.0

    def observe(self, prefill_tokens: int, decode_tokens: int, step_s: float) -> None:
        if prefill_tokens <= 0 or step_s <= 0:
            return
        a = self.alpha if self._seconds else 1.0
        self._tokens += a * (prefill_tokens + decode_tokens - self._tokens)
        self._seconds += a * (step_s - self._seconds)

    @property
    def tokens_per_second(self) -> float:
        return self._tokens / self._seconds if self._seconds else 0.0
