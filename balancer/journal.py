"""What the balancer remembers of a stream so that another replica can continue it: the request as first sent (its
seed assigned) and the output already delivered to the client. Plain data; the balancer's service drives it.

A resumed call sends the prompt again with the delivered tokens (fastgen.v1 Resume): the replica recomputes their KV
cache, rebuilds their text token by token and continues at the next position with the same seed, so the client's
stream goes on with no token twice and none missing. A request for n > 1 completions moves whole: each unfinished
completion continues from its own last delivered token with its own seed, and the finished ones are not run again.
Past `max_len` delivered tokens (over all completions), or `max_bytes` of them with their logprobs (a token with 20
alternatives weighs a hundred times a bare one), the journal lets go of them and the stream can no longer move (the
re-prefill would cost more than it saves, and the memory is bounded).
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass, field

from ..proto import fastgen_pb2
from .limits import MAX_N

DEFAULT_MIGRATION_LIMIT = 3
DEFAULT_MIGRATION_MAX_LEN = 8192
# Serialized bytes of delivered output kept per stream: 8192 tokens with 20 alternatives each are about 3 MiB.
DEFAULT_MIGRATION_MAX_BYTES = 4 << 20


@dataclass(frozen=True)
class MigrationSettings:
    limit: int = DEFAULT_MIGRATION_LIMIT  # moves per request; 0 turns migration off
    max_len: int = DEFAULT_MIGRATION_MAX_LEN  # delivered tokens past which a stream is no longer resumable
    max_bytes: int = DEFAULT_MIGRATION_MAX_BYTES  # the same in bytes kept, logprobs included


DEFAULT_MIGRATION = MigrationSettings()


@dataclass
class Delivered:
    """What the client has of one completion."""

    token_ids: list[int] = field(default_factory=list)  # in order: token i is output position i
    logprobs: list[fastgen_pb2.TokenLogprob] = field(default_factory=list)  # one per token when asked for
    text_chars: int = 0  # characters of text delivered
    finished: bool = False  # its last chunk was delivered


@dataclass
class Journal:
    request: fastgen_pb2.GenerateRequest  # as first sent upstream, seed included
    max_len: int
    max_bytes: int = DEFAULT_MIGRATION_MAX_BYTES
    request_id: str = ""  # the id the client saw on the first chunk; later replicas' chunks are relabelled with it
    completions: list[Delivered] = field(default_factory=list)  # by index, one per completion (n of them)
    chunks: int = 0  # chunks delivered
    kept_bytes: int = 0  # serialized size of the chunks whose output is kept
    migrations: int = 0
    untracked: bool = False  # output not kept: more than max_len tokens delivered, or migration off

    def __post_init__(self) -> None:
        # n is checked where the request enters (limits.py); the cap keeps a journal bounded whatever reaches it.
        n = min(max(1, self.request.params.n), MAX_N)
        self.completions = self.completions or [Delivered() for _ in range(n)]

    @property
    def delivered(self) -> bool:
        return self.chunks > 0

    @property
    def tokens(self) -> int:
        """Tokens delivered, over every completion."""
        return sum(len(c.token_ids) for c in self.completions)

    def record(self, chunk: fastgen_pb2.GenerateChunk) -> fastgen_pb2.GenerateChunk:
        """Notes a chunk about to be delivered; returns it under the request's first id."""
        if not self.request_id:
            self.request_id = chunk.request_id
        elif chunk.request_id != self.request_id:
            chunk.request_id = self.request_id
        self.chunks += 1
        if self.untracked:
            return chunk
        if chunk.index >= len(self.completions):  # not a completion of this request: nothing to resume it from
            self._let_go()
            return chunk
        c = self.completions[chunk.index]
        c.token_ids.extend(chunk.token_ids)
        c.logprobs.extend(chunk.logprobs)
        c.text_chars += len(chunk.text)
        c.finished = c.finished or chunk.finish_reason != fastgen_pb2.FINISH_REASON_UNSPECIFIED
        self.kept_bytes += chunk.ByteSize()
        if self.tokens > self.max_len or self.kept_bytes > self.max_bytes:
            self._let_go()
        return chunk

    def _let_go(self) -> None:
        self.untracked = True
        self.kept_bytes = 0
        self.completions = [Delivered() for _ in self.completions]

    def resumed_request(self) -> fastgen_pb2.GenerateRequest:
        """The request that continues the stream on another replica. Its own id fences it from the attempts before
        it (a replica may still hold one that is being cancelled); echo is off, as the prompt was sent already."""
        resumed = fastgen_pb2.GenerateRequest()
        resumed.CopyFrom(self.request)
        # Unique (a replica refuses an id in use) and within the replicas' length limit.
        resumed.request_id = f"{self.request_id[:160]}/resume-{self.migrations}-{uuid.uuid4().hex[:8]}"
        resumed.params.echo = False
        resumed.params.ClearField("prompt_logprobs")  # delivered with the first chunk, like the echoed prompt
        if len(self.completions) == 1:
            [c] = self.completions
            resumed.resume.token_ids.extend(c.token_ids)
            resumed.resume.text_chars = c.text_chars
            return resumed
        for c in self.completions:  # each continues with its own seed, derived from the request's and its index
            resumed.resume.completions.add(token_ids=c.token_ids, text_chars=c.text_chars, finished=c.finished)
        return resumed


def unresumable_reason(journal: Journal, settings: MigrationSettings) -> str | None:
    """Why the stream cannot move (a MIGRATION_REFUSALS label), or None when it can."""
    if journal.migrations >= settings.limit:
        return "limit"
    if journal.untracked:
        return "length"
    return None


def journal_for(request: fastgen_pb2.GenerateRequest, settings: MigrationSettings) -> Journal:
    """The journal of a stream. One that can never move keeps no output: --migration-limit 0 turns migration off."""
    return Journal(request, settings.max_len, settings.max_bytes, untracked=settings.limit <= 0)


def with_seed(request: fastgen_pb2.GenerateRequest) -> fastgen_pb2.GenerateRequest:
    """The request with a seed of its own when it samples without one, so that any replica continues (or redoes)
    it with the same draws. Greedy requests need none. The caller's message is left as it is."""
    params = request.params
    if params.temperature <= 0 or params.HasField("seed"):
        return request
    seeded = fastgen_pb2.GenerateRequest()
    seeded.CopyFrom(request)
    # From the OS: balancers started alike must not draw alike.
    seeded.params.seed = secrets.randbits(63)
    return seeded
