"""Metric definitions and recorders, fed with duck-typed engine stats and outputs."""

import subprocess
import sys
import urllib.request
from enum import Enum
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import CollectorRegistry

import fastgen
from fastgen.server.metrics import (
    ALL_METRICS,
    BalancerMetrics,
    BuildInfo,
    HttpMetrics,
    ReplicaMetrics,
    record_build_info,
    start_metrics_server,
)
from fastgen.server.sla import SlaConfig

LABELS = {"replica": "r0", "model": "tiny"}


class Reason(Enum):
    LENGTH = "length"
    CANCELLED = "cancelled"


def stats(**overrides):
    fields = dict(
        num_seqs=3,
        num_decode_tokens=2,
        num_prefill_tokens=14,
        token_budget=32,
        num_preempted=1,
        forward_s=0.004,
        step_s=0.005,
        num_waiting=4,
        num_running=3,
        kv_blocks_used=6,
        kv_blocks_total=24,
        prefix_cache_queries=40,
        prefix_cache_hits=32,
        prefix_cache_evictions=2,
        prefix_cache_blocks=9,
        plan=None,
        spec_drafts=0,
        spec_draft_tokens=0,
        spec_accepted_tokens=0,
        spec_accepted_per_pos=(),
    )
    fields.update(overrides)
    s = SimpleNamespace(**fields)
    s.num_tokens = s.num_decode_tokens + s.num_prefill_tokens
    return s


def output(
    request_id, new_ids, time, reason=None, arrival=0.0, first_scheduled=0.1, first_token=None, prompt=5, index=0
):
    timings = SimpleNamespace(
        arrival=arrival, first_scheduled=first_scheduled, first_token=first_token, finished=time if reason else None
    )
    return SimpleNamespace(
        request_id=request_id,
        new_token_ids=new_ids,
        finished=reason is not None,
        finish_reason=reason,
        prompt_tokens=prompt,
        generated_tokens=0,
        time=time,
        timings=timings,
        index=index,
    )


@pytest.fixture
def registry():
    return CollectorRegistry()


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels) or 0.0


def test_names_are_unique_and_prefixed():
    names = [d.name for d in ALL_METRICS]
    assert len(names) == len(set(names))
    assert all(n.startswith("fastgen_") for n in names)


def test_step_stats_become_gauges_counters_and_histograms(registry):
    m = ReplicaMetrics(registry, "r0", "tiny")
    m.on_step(stats())
    assert value(registry, "fastgen_queue_length", **LABELS) == 4
    assert value(registry, "fastgen_running_sequences", **LABELS) == 3
    assert value(registry, "fastgen_kv_cache_blocks_used", **LABELS) == 6
    assert value(registry, "fastgen_kv_cache_blocks_total", **LABELS) == 24
    assert value(registry, "fastgen_kv_cache_usage_ratio", **LABELS) == 0.25
    assert value(registry, "fastgen_preemptions_total", **LABELS) == 1
    assert value(registry, "fastgen_tokens_per_forward_sum", **LABELS) == 16
    assert value(registry, "fastgen_token_budget_fill_ratio_sum", **LABELS) == 0.5
    assert value(registry, "fastgen_forward_seconds_count", **LABELS) == 1
    assert value(registry, "fastgen_prefix_cache_queries_total", **LABELS) == 40
    assert value(registry, "fastgen_prefix_cache_hits_total", **LABELS) == 32
    assert value(registry, "fastgen_prefix_cache_evictions_total", **LABELS) == 2
    assert value(registry, "fastgen_prefix_cache_blocks", **LABELS) == 9


def test_prefix_cache_metrics_are_exported_at_zero_before_any_step(registry):
    ReplicaMetrics(registry, "r0", "tiny")
    for name in ("queries", "hits", "evictions"):
        assert registry.get_sample_value(f"fastgen_prefix_cache_{name}_total", LABELS) == 0.0


def test_request_lifecycle_observes_latencies_once_per_token(registry):
    m = ReplicaMetrics(registry, "r0", "tiny")
    m.on_output(output("a", [], 0.1))  # scheduled, prefill only: nothing yet
    m.on_output(output("a", [7], 0.5, first_token=0.5))
    m.on_output(output("a", [8], 0.7))
    m.on_output(output("a", [9, 10], 1.1, reason=Reason.LENGTH))
    assert value(registry, "fastgen_time_to_first_token_seconds_sum", **LABELS) == pytest.approx(0.5)
    assert value(registry, "fastgen_inter_token_latency_seconds_count", **LABELS) == 3
    assert value(registry, "fastgen_inter_token_latency_seconds_sum", **LABELS) == pytest.approx(0.6)
    assert value(registry, "fastgen_e2e_request_latency_seconds_sum", **LABELS) == pytest.approx(1.1)
    assert value(registry, "fastgen_request_queue_time_seconds_sum", **LABELS) == pytest.approx(0.1)
    assert value(registry, "fastgen_prompt_tokens_total", **LABELS) == 5
    assert value(registry, "fastgen_generated_tokens_total", **LABELS) == 4
    assert value(registry, "fastgen_requests_finished_total", reason="length", **LABELS) == 1
    assert value(registry, "fastgen_requests_finished_total", reason="eos", **LABELS) == 0  # present at 0
    assert m._token_times == {}  # finished requests leave no state behind


def test_request_cancelled_before_its_first_token(registry):
    m = ReplicaMetrics(registry, "r0", "tiny")
    m.on_output(output("b", [], 2.0, reason=Reason.CANCELLED, first_scheduled=None, prompt=9))
    assert value(registry, "fastgen_time_to_first_token_seconds_count", **LABELS) == 0
    assert value(registry, "fastgen_request_queue_time_seconds_count", **LABELS) == 0
    assert value(registry, "fastgen_prompt_tokens_total", **LABELS) == 9
    assert value(registry, "fastgen_requests_finished_total", reason="cancelled", **LABELS) == 1


def test_n_completions_count_their_shared_prompt_once(registry):
    m = ReplicaMetrics(registry, "r0", "tiny")
    m.on_output(output("c", [3], 0.5, first_token=0.5, prompt=7))
    m.on_output(output("c#1", [4], 0.5, first_token=0.5, prompt=7, index=1))
    m.on_output(output("c#2", [], 0.6, reason=Reason.CANCELLED, prompt=7, index=2))
    assert value(registry, "fastgen_prompt_tokens_total", **LABELS) == 7
    assert value(registry, "fastgen_generated_tokens_total", **LABELS) == 2


def test_rpc_codes_are_counted(registry):
    m = ReplicaMetrics(registry, "r0", "tiny")
    m.on_rpc("Generate", grpc.StatusCode.OK)
    m.on_rpc("Generate", grpc.StatusCode.INVALID_ARGUMENT)
    m.on_rpc("Generate", grpc.StatusCode.OK)
    assert value(registry, "fastgen_requests_total", method="Generate", code="OK", **LABELS) == 2
    assert value(registry, "fastgen_requests_total", method="Generate", code="INVALID_ARGUMENT", **LABELS) == 1


def test_every_series_known_at_start_is_exported_from_the_first_scrape(registry):
    ReplicaMetrics(registry, "r0", "tiny")
    balancer = CollectorRegistry()
    BalancerMetrics(balancer, ("r0", "r1"), "least_loaded", (grpc.StatusCode.UNAVAILABLE,))

    def zero(reg, name, **labels) -> bool:
        return reg.get_sample_value(name, labels) == 0  # None where the series is not exported

    for code in ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"):
        assert zero(registry, "fastgen_requests_total", method="GenerateStream", code=code, **LABELS)
        assert zero(balancer, "fastgen_balancer_requests_total", method="Generate", code=code)
        assert zero(balancer, "fastgen_balancer_replica_requests_total", replica="r1", code=code)
    for replica in ("r0", "r1"):
        assert zero(balancer, "fastgen_balancer_retries_total", replica=replica, code="UNAVAILABLE")
        assert zero(balancer, "fastgen_balancer_routing_decisions_total", policy="least_loaded", replica=replica)
        assert zero(balancer, "fastgen_balancer_in_flight_requests", replica=replica)
        assert zero(balancer, "fastgen_balancer_replica_healthy", replica=replica)


def test_balancer_metrics(registry):
    m = BalancerMetrics(registry)
    m.on_rpc("Generate", grpc.StatusCode.UNAVAILABLE)
    m.on_replica_call("r1", grpc.StatusCode.OK)
    m.set_in_flight("r1", 3)
    m.set_healthy("r0", False)
    m.set_healthy("r1", True)
    m.on_retry("r0", grpc.StatusCode.UNAVAILABLE)
    m.on_route("least_loaded", "r1")
    assert value(registry, "fastgen_balancer_requests_total", method="Generate", code="UNAVAILABLE") == 1
    assert value(registry, "fastgen_balancer_replica_requests_total", replica="r1", code="OK") == 1
    assert value(registry, "fastgen_balancer_in_flight_requests", replica="r1") == 3
    assert value(registry, "fastgen_balancer_replica_healthy", replica="r0") == 0
    assert value(registry, "fastgen_balancer_replica_healthy", replica="r1") == 1
    assert value(registry, "fastgen_balancer_retries_total", replica="r0", code="UNAVAILABLE") == 1
    assert value(registry, "fastgen_balancer_routing_decisions_total", policy="least_loaded", replica="r1") == 1


def test_http_metrics_by_route_and_status(registry):
    m = HttpMetrics(registry)
    for status in ("400", "429", "499", "503"):
        assert value(registry, "fastgen_http_requests_total", route="/v1/chat/completions", status=status) == 0
    assert registry.get_sample_value("fastgen_http_requests_total", {"route": "/health", "status": "200"}) == 0
    assert registry.get_sample_value("fastgen_http_request_duration_seconds_count", {"route": "/v1/models"}) == 0
    m.on_request("/v1/completions", 200, 0.3)
    m.on_request("/v1/completions", 429, 0.01)
    m.on_request("other", 404, 0.001)
    assert value(registry, "fastgen_http_requests_total", route="/v1/completions", status="200") == 1
    assert value(registry, "fastgen_http_requests_total", route="/v1/completions", status="429") == 1
    assert value(registry, "fastgen_http_requests_total", route="other", status="404") == 1
    assert value(registry, "fastgen_http_request_duration_seconds_count", route="/v1/completions") == 2
    assert value(registry, "fastgen_http_request_duration_seconds_sum", route="/v1/completions") == pytest.approx(0.31)


def test_registries_are_independent():
    ReplicaMetrics(CollectorRegistry(), "r0", "m")
    ReplicaMetrics(CollectorRegistry(), "r0", "m")  # a hidden global registry would refuse the duplicate


def test_metrics_server_picks_a_port_and_serves(registry):
    ReplicaMetrics(registry, "r0", "tiny").on_step(stats())
    port = start_metrics_server(registry, "127.0.0.1", 0)
    assert port > 0
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'fastgen_queue_length{model="tiny",replica="r0"} 4.0' in body


def test_metrics_and_balancer_do_not_import_torch():
    code = (
        "import sys, fastgen.server.metrics, fastgen.server, fastgen.balancer.__main__; "
        "bad = [m for m in ('torch', 'fastgen.replica') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- SLA scoring, build info, restarts ------------------------------------------------------------------------
def sla_value(registry, rate, result):
    return value(registry, "fastgen_sla_requests_total", prompt_rate="100", token_rate=rate, result=result, **LABELS)


def test_every_finished_request_is_scored_for_every_token_rate(registry):
    m = ReplicaMetrics(registry, "r0", "tiny", SlaConfig(prompt_rate=100, token_rates=(1.0, 2.0, 4.0)))
    assert sla_value(registry, "2", "met") == 0 and sla_value(registry, "2", "missed") == 0  # present from the start
    # 5 prompt tokens: first token due within 0.05 s; then a token every 0.4 s (meets R = 1 and 2, not 4).
    m.on_output(output("a", [1], 0.04, first_token=0.04))
    for i in range(1, 6):
        m.on_output(output("a", [1], 0.04 + 0.4 * i, reason=Reason.LENGTH if i == 5 else None))
    assert [sla_value(registry, r, "met") for r in ("1", "2", "4")] == [1, 1, 0]
    assert [sla_value(registry, r, "missed") for r in ("1", "2", "4")] == [0, 0, 1]
    # A late first token misses every rate.
    m.on_output(output("b", [1], 0.3, first_token=0.3))
    m.on_output(output("b", [2], 0.4, reason=Reason.LENGTH))
    assert [sla_value(registry, r, "missed") for r in ("1", "2", "4")] == [1, 1, 2]


def test_cancelled_requests_are_not_scored(registry):
    m = ReplicaMetrics(registry, "r0", "tiny")
    m.on_output(output("a", [1], 0.01, first_token=0.01))
    m.on_output(output("a", [], 0.02, reason=Reason.CANCELLED))
    m.on_output(output("b", [], 0.02, reason=Reason.CANCELLED, first_scheduled=None))
    assert all(sla_value(registry, r, res) == 0 for r in ("1", "2", "4") for res in ("met", "missed"))
    assert m._token_times == {}


def test_build_info(registry):
    record_build_info(registry, BuildInfo(role="replica", replica="r0", model="tiny", dtype="float32", tp=2))
    assert (
        value(
            registry,
            "fastgen_build_info",
            version=fastgen.__version__,
            role="replica",
            replica="r0",
            model="tiny",
            dtype="float32",
            tp="2",
        )
        == 1
    )


def series(registry) -> set[tuple]:
    """What identifies each exported series: its name and labels (values aside)."""
    return {
        (s.name, tuple(sorted(s.labels.items())))
        for metric in registry.collect()
        for s in metric.samples
        if not s.name.endswith("_created")
    }


def test_a_restarted_replica_continues_the_same_series():
    # A restart is a new process with the same flags: it must export exactly the same series (no pid, start time
    # or other per-start label), so Prometheus sees one series whose counters reset, which rate() and increase()
    # handle, instead of a second series that sums would count twice. (_created holds the start time as a value.)
    def replica_process():
        registry = CollectorRegistry()
        m = ReplicaMetrics(registry, "replica-0", "tiny")
        record_build_info(registry, BuildInfo(role="replica", replica="replica-0", model="tiny", dtype="float32", tp=1))
        m.on_step(stats())
        m.on_rpc("Generate", grpc.StatusCode.OK)
        m.on_output(output("a", [1], 0.1, reason=Reason.LENGTH, first_token=0.1))
        return registry

    first, second = replica_process(), replica_process()
    assert series(first) == series(second)
    assert not {k for _, labels in series(first) for k, _ in labels} & {"pid", "instance", "job", "deployment"}
