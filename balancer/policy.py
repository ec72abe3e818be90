"""Routing policies: pure functions from the replicas' load to the replica that takes the next request.

A policy sees only the replicas it may pick (healthy, not yet tried for this request), keyed by their position in
the pool. Positions, not ids, carry the rotation order so round robin stays fair while replicas come and go.

`prefix_aware` also sees, per replica, how much of this request's prompt it is believed to hold in its prefix cache,
and picks the smallest predicted time to first token: the work queued ahead of the request plus the part of its
prompt still to prefill, at that replica's measured speed. A replica holding the prefix wins until its queue costs
more than the prefill it would save; no threshold decides when load beats affinity.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

# Rough characters per token for text we have not tokenized (only prefix_aware loads the replicas' tokenizer).
CHARS_PER_TOKEN = 4
CHAT_TOKENS_PER_MESSAGE = 4  # role markers added by chat templates
# Tokens per second assumed for a replica that has not reported its prefill speed, when no other replica has either;
# with equal speeds only the ratio of token counts matters, so its value rarely decides a pick.
DEFAULT_PREFILL_TOKENS_PER_SECOND = 1000.0


@dataclass(frozen=True)
class ReplicaLoad:
    # The balancer's own accounting: exact for its requests, blind to traffic sent to the replica directly.
    in_flight: int = 0
    unreported_prompt_tokens: int = 0  # estimated prompt tokens of live requests sent since the last report
    # The replica's last GetStatus report: covers all traffic, but is up to one poll interval old.
    pending_prompt_tokens: int = 0
    running_requests: int = 0
    queued_requests: int = 0
    in_flight_at_report: int = 0  # how many of the reported requests may be the balancer's own
    prefill_tokens_per_second: float = 0.0  # the replica's measured speed (0: not measured yet)
    # The request being routed, as this replica would see it (prefix_aware only; 0 when unknown).
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of those, how many the replica is believed to hold in its prefix cache
    lora_resident: bool = False  # the request's LoRA adapter is in one of the replica's weight slots already


def outstanding_work(load: ReplicaLoad) -> int:
    """Tokens the replica still has to process before a new request gets going: prompt tokens not prefilled yet
    plus one per live sequence (each costs a token of every forward pass while it decodes).

    The balancer's own requests count from its live accounting; the report adds only the others' ("foreign")
    requests, so a request that finished since the report no longer weighs on the replica."""
    foreign = max(0, load.running_requests + load.queued_requests - load.in_flight_at_report)
    sequences = load.in_flight + foreign
    if not sequences:
        return 0  # prompt tokens left can only belong to live requests: the report predates their end
    return load.pending_prompt_tokens + load.unreported_prompt_tokens + sequences


def _rotation_distance(position: int, cursor: int, num_replicas: int) -> int:
    return (position - cursor) % num_replicas


def round_robin(loads: Mapping[int, ReplicaLoad], cursor: int, num_replicas: int) -> int:
    """The first candidate at or after `cursor` in pool order, wrapping around."""
    return min(loads, key=lambda p: _rotation_distance(p, cursor, num_replicas))


def least_loaded(loads: Mapping[int, ReplicaLoad], cursor: int, num_replicas: int) -> int:
    """The candidate with the least outstanding work; among equals one holding the request's LoRA adapter, then
    round robin so idle replicas share evenly."""
    return min(
        loads,
        key=lambda p: (
            outstanding_work(loads[p]),
            not loads[p].lora_resident,
            _rotation_distance(p, cursor, num_replicas),
        ),
    )


def predicted_ttft(load: ReplicaLoad, tokens_per_second: float) -> float:
    """Seconds until the request's first token on this replica: its outstanding work, then the uncached part of the
    prompt."""
    uncached = max(0, load.prompt_tokens - load.cached_tokens)
    return (outstanding_work(load) + uncached) / tokens_per_second


def prefix_aware(loads: Mapping[int, ReplicaLoad], cursor: int, num_replicas: int) -> int:
    """The candidate with the smallest predicted time to first token; among equals, the one holding more of the
    prompt, then one holding the request's LoRA adapter, then round robin. A replica that has not measured its speed
    is assumed as fast as the others' mean. (An adapter's prefixes are cached under a salt of its own, so the prompt
    a replica holds counts only what it computed under that adapter.)"""
    measured = [load.prefill_tokens_per_second for load in loads.values() if load.prefill_tokens_per_second > 0]
    assumed = sum(measured) / len(measured) if measured else DEFAULT_PREFILL_TOKENS_PER_SECOND

    def rank(p: int):
        load = loads[p]
        ttft = predicted_ttft(load, load.prefill_tokens_per_second or assumed)
        return ttft, -load.cached_tokens, not load.lora_resident, _rotation_distance(p, cursor, num_replicas)

    return min(loads, key=rank)


PickFn = Callable[[Mapping[int, ReplicaLoad], int, int], int]
POLICIES: dict[str, PickFn] = {"round_robin": round_robin, "least_loaded": least_loaded, "prefix_aware": prefix_aware}


@dataclass
class Router:
    """A policy and its rotation cursor.

    Positions only grow as replicas come and go (a pool never reuses one), so the rotation spans every position up to
    the largest seen rather than a fixed count: the order is the same, positions at or after the cursor first."""

    policy: str
    num_replicas: int  # positions known at start; later ones widen the span
    cursor: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        self._pick = POLICIES[self.policy]

    def pick(self, loads: Mapping[int, ReplicaLoad]) -> int | None:
        """Position of the chosen replica, or None when there is no candidate."""
        if not loads:
            return None
        span = max(self.num_replicas, max(loads) + 1, self.cursor)
        chosen = self._pick(loads, self.cursor % span, span)
        self.cursor = chosen + 1
        return chosen


def estimate_prompt_tokens(request) -> int:
    """Prompt length of a fastgen.v1.GenerateRequest without a tokenizer: exact for token ids, estimated from
    characters for text and chat."""
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        return len(request.token_ids.ids)
    if kind == "text":
        return len(request.text) // CHARS_PER_TOKEN + 1
    if kind == "messages":
        messages = request.messages.messages
        chars = sum(len(m.content) for m in messages)
        return chars // CHARS_PER_TOKEN + CHAT_TOKENS_PER_MESSAGE * len(messages)
    return 0
