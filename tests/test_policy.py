"""Routing policies: pure functions, no processes."""

import pytest

from fastgen.balancer.policy import (
    ReplicaLoad,
    Router,
    estimate_prompt_tokens,
    least_loaded,
    outstanding_work,
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
