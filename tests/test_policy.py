"""Routing policies: pure functions, no processes."""

import pytest

from fastgen.balancer.policy import (
    ReplicaLoad,
    Router,
    estimate_prompt_tokens,
    least_loaded,
    outstanding_work,
    predicted_ttft,
    prefix_aware,
    round_robin,
)
from fastgen.proto import fastgen_pb2

IDLE = ReplicaLoad()


def test_round_robin_walks_positions_from_the_cursor():
    loads = {0: IDLE, 1: IDLE, 2: IDLE}
    assert [round_robin(loads, c, 3) for c in range(4)] == [0, 1, 2, 0]


def test_round_robin_skips_missing_candidates():
    loads = {0: IDLE, 2: IDLE}  # replica 1 unhealthy or already tried
    assert round_robin(loads, 1, 3) == 2
    assert round_robin(loads, 3 % 3, 3) == 0


def test_router_round_robin_alternates_exactly():
    router = Router("round_robin", 2)
    picks = [router.pick({0: IDLE, 1: IDLE}) for _ in range(20)]
    assert picks == [0, 1] * 10


def test_router_round_robin_keeps_rotating_when_a_replica_leaves_and_returns():
    router = Router("round_robin", 3)
    assert [router.pick({0: IDLE, 1: IDLE, 2: IDLE}) for _ in range(2)] == [0, 1]
    assert [router.pick({0: IDLE, 1: IDLE}) for _ in range(2)] == [0, 1]  # 2 is out
    assert [router.pick({0: IDLE, 1: IDLE, 2: IDLE}) for _ in range(3)] == [2, 0, 1]


def test_router_without_candidates_picks_none():
    assert Router("least_loaded", 2).pick({}) is None


def test_unknown_policy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="round_robin"):
        Router("random", 2)


def test_outstanding_work_counts_unprefilled_prompt_tokens_and_sequences():
    load = ReplicaLoad(
        in_flight=2,
        unreported_prompt_tokens=30,
        pending_prompt_tokens=100,
        running_requests=3,
        queued_requests=1,
        in_flight_at_report=2,
    )
    assert outstanding_work(load) == 100 + 30 + 2 + 2  # 2 of ours live now, 2 others' in the report


def test_outstanding_work_counts_requests_sent_since_the_last_report():
    assert outstanding_work(ReplicaLoad(in_flight=3, unreported_prompt_tokens=12)) == 15


def test_outstanding_work_counts_traffic_sent_to_the_replica_directly():
    assert outstanding_work(ReplicaLoad(running_requests=5, pending_prompt_tokens=40)) == 45


def test_outstanding_work_forgets_reported_requests_that_have_finished():
    # The report saw our one request prefilling; it has finished since.
    stale = ReplicaLoad(in_flight=0, pending_prompt_tokens=7, running_requests=1, in_flight_at_report=1)
    assert outstanding_work(stale) == 0


def test_least_loaded_picks_the_replica_with_less_work():
    busy = ReplicaLoad(in_flight=1, running_requests=1)
    assert least_loaded({0: busy, 1: IDLE}, 0, 2) == 1
    assert least_loaded({0: IDLE, 1: busy}, 1, 2) == 0


def test_least_loaded_weighs_long_prompts_over_sequence_counts():
    long_prefill = ReplicaLoad(in_flight=1, pending_prompt_tokens=900)
    many_decodes = ReplicaLoad(in_flight=8, running_requests=8)
    assert least_loaded({0: long_prefill, 1: many_decodes}, 0, 2) == 1


def test_least_loaded_breaks_ties_round_robin():
    router = Router("least_loaded", 3)
    loads = {0: IDLE, 1: IDLE, 2: IDLE}
    assert [router.pick(loads) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_least_loaded_ignores_excluded_replicas():
    assert least_loaded({1: ReplicaLoad(in_flight=50)}, 0, 2) == 1


def test_prompt_token_estimates():
    ids = fastgen_pb2.GenerateRequest(token_ids=fastgen_pb2.TokenIds(ids=list(range(37))))
    assert estimate_prompt_tokens(ids) == 37
    text = fastgen_pb2.GenerateRequest(text="x" * 400)
    assert 80 <= estimate_prompt_tokens(text) <= 120
    chat = fastgen_pb2.GenerateRequest(
        messages=fastgen_pb2.ChatMessages(messages=[fastgen_pb2.ChatMessage(role="user", content="y" * 40)])
    )
    assert estimate_prompt_tokens(chat) > 10
    assert estimate_prompt_tokens(fastgen_pb2.GenerateRequest()) == 0


# ---- prefix_aware ----
def _request(prompt: int, cached: int = 0, **load) -> ReplicaLoad:
    return ReplicaLoad(prompt_tokens=prompt, cached_tokens=cached, **load)


def test_prefix_aware_goes_where_the_prefix_is():
    assert prefix_aware({0: _request(1000), 1: _request(1000, cached=960)}, 0, 2) == 1
    assert prefix_aware({0: _request(1000, cached=960), 1: _request(1000)}, 1, 2) == 0


def test_prefix_aware_without_any_cache_is_least_loaded():
    busy = _request(500, in_flight=2, pending_prompt_tokens=800)
    assert prefix_aware({0: busy, 1: _request(500)}, 0, 2) == 1
    router = Router("prefix_aware", 3)
    loads = {0: _request(100), 1: _request(100), 2: _request(100)}
    assert [router.pick(loads) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_prefix_aware_load_beats_affinity_once_the_queue_costs_more_than_the_prefill_saved():
    holder = lambda queued: _request(1000, cached=900, in_flight=2, pending_prompt_tokens=queued)  # noqa: E731
    idle = _request(1000)
    assert prefix_aware({0: holder(800), 1: idle}, 1, 2) == 0  # 800 + 100 + 2 < 1000: wait at the holder
    assert prefix_aware({0: holder(1000), 1: idle}, 0, 2) == 1  # 1000 + 100 + 2 > 1000: prefill elsewhere


def test_prefix_aware_weighs_work_by_each_replicas_speed():
    slow = _request(1000, cached=500, prefill_tokens_per_second=100.0)  # 5 s to prefill the rest
    fast = _request(1000, prefill_tokens_per_second=1000.0)  # 1 s for all of it
    assert prefix_aware({0: slow, 1: fast}, 0, 2) == 1
    assert predicted_ttft(slow, 100.0) == pytest.approx(5.0)


def test_prefix_aware_assumes_an_unmeasured_replica_as_fast_as_the_others():
    measured = _request(1000, in_flight=1, pending_prompt_tokens=400, prefill_tokens_per_second=2000.0)
    unmeasured = _request(1000, cached=600)
    # 1401 tokens at 2000/s against 400 tokens at the same assumed speed: the unmeasured holder wins.
    assert prefix_aware({0: measured, 1: unmeasured}, 0, 2) == 1


def test_prefix_aware_prefers_the_holder_among_equals():
    # The same predicted time (50 queued + 50 to prefill against 100 to prefill): the holder keeps its prefix warm.
    holder = _request(100, cached=50, in_flight=1, pending_prompt_tokens=49)
    assert outstanding_work(holder) == 50
    assert prefix_aware({0: holder, 1: _request(100)}, 1, 2) == 0
