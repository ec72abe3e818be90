"""What the balancer remembers of a stream so that another replica can continue it: the request as first sent (its
seed assigned) and the output already delivered to the client. Plain data; the balancer's service drives it.

A resumed call sends the prompt again with the delivered tokens (fastgen.v1 Resume): the replica recomputes their KV
cache, rebuilds their text token by token and continues at the next position with the same seed, so the client's
stream goes on with no token twice and none missing. Past `max_len` delivered tokens the journal lets go of them
and the stream can no longer move (the re-prefill would cost more than it saves, and the memory is bounded).
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass, field

from ..proto import fastgen_pb2

DEFAULT_MIGRATION_LIMIT = 3
DEFAULT_MIGRATION_MAX_LEN = 8192


@dataclass(frozen=True)
class MigrationSettings:
    limit: int = DEFAULT_MIGRATION_LIMIT  # moves per request; 0 turns migration off
    max_len: int = DEFAULT_MIGRATION_MAX_LEN  # delivered tokens past which a stream is no longer resumable


DEFAULT_MIGRATION = MigrationSettings()


@dataclass
class Journal:
    request: fastgen_pb2.GenerateRequest  # as first sent upstream, seed included
    max_len: int
    request_id: str = ""  # the id the client saw on the first chunk; later replicas' chunks are relabelled with it
    token_ids: list[int] = field(default_factory=list)  # delivered, in order: token i is output position i
    logprobs: list[fastgen_pb2.TokenLogprob] = field(default_factory=list)  # one per token when asked for
    text_chars: int = 0  # characters of text delivered
    chunks: int = 0  # chunks delivered
    migrations: int = 0
    untracked: bool = False  # output not kept: more than max_len tokens delivered, or a request that cannot move

    @property
    def delivered(self) -> bool:
        return self.chunks > 0

    def record(self, chunk: fastgen_pb2.GenerateChunk) -> fastgen_pb2.GenerateChunk:
        """Notes a chunk about to be delivered; returns it under the request's first id."""
        if not self.request_id:
            self.request_id = chunk.request_id
        elif chunk.request_id != self.request_id:
            chunk.request_id = self.request_id
        self.chunks += 1
        if self.untracked:
            return chunk
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.text_chars += len(chunk.text)
        if len(self.token_ids) > self.max_len:
            self.untracked = True
            self.token_ids, self.logprobs = [], []
        return chunk

    def resumed_request(self) -> fastgen_pb2.GenerateRequest:
        """The request that continues the stream on another replica. Its own id fences it from the attempts before
        it (a replica may still hold one that is being cancelled); echo is off, as the prompt was sent already."""
        resumed = fastgen_pb2.GenerateRequest()
        resumed.CopyFrom(self.request)
        # Unique (a replica refuses an id in use) and within the replicas' length limit.
        resumed.request_id = f"{self.request_id[:160]}/resume-{self.migrations}-{uuid.uuid4().hex[:8]}"
        resumed.params.echo = False
        resumed.resume.token_ids.extend(self.token_ids)
        resumed.resume.text_chars = self.text_chars
        return resumed


def unresumable_reason(journal: Journal, settings: MigrationSettings) -> str | None:
    """Why the stream cannot move (a MIGRATION_REFUSALS label), or None when it can."""
    if journal.request.params.n > 1:
        return "n"
    if journal.migrations >= settings.limit:
        return "limit"
    if journal.untracked:
        return "length"
    return None


def journal_for(request: fastgen_pb2.GenerateRequest, settings: MigrationSettings) -> Journal:
    """The journal of a stream. One that can never move keeps no output: n > 1 completions interleave on one stream
    and resuming them is not supported, and --migration-limit 0 turns migration off."""
    return Journal(request, settings.max_len, untracked=settings.limit <= 0 or request.params.n > 1)


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
