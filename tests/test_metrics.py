"""Metric definitions and recorders, fed with duck-typed engine stats and outputs."""
import subprocess
import sys
import urllib.request
from enum import Enum
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import CollectorRegistry

from fastgen.server.metrics import ALL_METRICS, BalancerMetrics, ReplicaMetrics, start_metrics_server

LABELS = {"replica": "r0", "model": "tiny"}


class Reason(Enum):
    LENGTH = "length"
    CANCELLED = "cancelled"


def stats(**overrides):
    fields = dict(num_seqs=3, num_decode_tokens=2, num_prefill_tokens=14, token_budget=32, num_preempted=1,
                  forward_s=0.004, step_s=0.005, num_waiting=4, num_running=3, kv_blocks_used=6,
                  kv_blocks_total=24)  # fmt: skip
    fields.update(overrides)
    s = SimpleNamespace(**fields)
    s.num_tokens = s.num_decode_tokens + s.num_prefill_tokens
    return s


def output(request_id, new_ids, time, reason=None, arrival=0.0, first_scheduled=0.1, first_token=None, prompt=5):
    timings = SimpleNamespace(arrival=arrival, first_scheduled=first_scheduled, first_token=first_token,
                              finished=time if reason else None)  # fmt: skip
    return SimpleNamespace(request_id=request_id, new_token_ids=new_ids, finished=reason is not None,
                           finish_reason=reason, prompt_tokens=prompt, generated_tokens=0, time=time,
                           timings=timings)  # fmt: skip


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
    assert m._last_token_time == {}  # finished requests leave no state behind


def test_request_cancelled_before_its_first_token(registry):
    m = ReplicaMetrics(registry, "r0", "tiny")
    m.on_output(output("b", [], 2.0, reason=Reason.CANCELLED, first_scheduled=None, prompt=9))
    assert value(registry, "fastgen_time_to_first_token_seconds_count", **LABELS) == 0
    assert value(registry, "fastgen_request_queue_time_seconds_count", **LABELS) == 0
    assert value(registry, "fastgen_prompt_tokens_total", **LABELS) == 9
    assert value(registry, "fastgen_requests_finished_total", reason="cancelled", **LABELS) == 1


def test_rpc_codes_are_counted(registry):
    m = ReplicaMetrics(registry, "r0", "tiny")
    m.on_rpc("Generate", grpc.StatusCode.OK)
    m.on_rpc("Generate", grpc.StatusCode.INVALID_ARGUMENT)
    m.on_rpc("Generate", grpc.StatusCode.OK)
    assert value(registry, "fastgen_requests_total", method="Generate", code="OK", **LABELS) == 2
    assert value(registry, "fastgen_requests_total", method="Generate", code="INVALID_ARGUMENT", **LABELS) == 1


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
    code = ("import sys, fastgen.server.metrics, fastgen.server, fastgen.balancer.__main__; "
            "bad = [m for m in ('torch', 'fastgen.replica') if m in sys.modules]; assert not bad, bad")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
