"""End to end: two real replica processes on the tiny random model behind a real balancer process, driven through
the Python clients. Tests run in file order and share the replicas; the crash test restarts the replica it kills
and the last test takes the whole deployment down."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fastgen.server import AsyncClient, Client, GenerationError

from .helpers import (
    Proc,
    free_port,
    start_balancer,
    start_replica,
    wait_balancer_sees,
    wait_health,
    wait_serving,
    wait_until,
)

pytestmark = pytest.mark.slow

BOTH_SERVING = {"r0": "serving", "r1": "serving"}
LONG = dict(max_new_tokens=700, ignore_eos=True)  # seconds of decoding on the tiny model on CPU
# Far more work than any deadline below: 32 completions of 1,000 tokens, more than the replicas' 8 MiB KV pools hold
# at once (a Zen 5 core decodes LONG alone in under half a second).
HUGE = dict(max_new_tokens=1000, n=32, ignore_eos=True)
SHORT = dict(max_new_tokens=4)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def replicas(tiny_model_dir, logs):
    """r0 and r1; a test that restarts one puts the new process in this dict, so teardown kills it."""
    procs = {rid: start_replica(tiny_model_dir, rid, logs) for rid in ("r0", "r1")}
    try:
        for proc in procs.values():
            wait_serving(proc)
        yield procs
    finally:
        for proc in procs.values():
            proc.kill()


def _balancer(replicas, logs, policy: str, name: str):
    proc = start_balancer({rid: p.address for rid, p in replicas.items()}, logs, policy=policy, name=name)
    try:
        wait_serving(proc, timeout=30)
        wait_balancer_sees(proc, BOTH_SERVING)
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def balancer(replicas, logs):
    yield from _balancer(replicas, logs, "round_robin", "balancer-rr")


@pytest.fixture(scope="module")
def ll_balancer(replicas, logs):
    yield from _balancer(replicas, logs, "least_loaded", "balancer-ll")


@pytest.fixture
def client(balancer):
    with Client(balancer.address, timeout=60) as c:
        yield c


def running_on(replica: Proc) -> int:
    with Client(replica.address, timeout=5) as c:
        r = c.status().replicas[0]
    return r.running_requests + r.queued_requests


def metric(proc: Proc, name: str, **labels) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5).read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


# ---- routing ----
def test_round_robin_alternates_replicas_exactly(client):
    served = [client.generate([7, 8, 9], **SHORT).replica for _ in range(20)]
    assert sorted(set(served)) == ["r0", "r1"]
    assert all(a != b for a, b in zip(served, served[1:])), served


def test_least_loaded_avoids_the_replica_busy_with_our_long_request(ll_balancer):
    # A pick counts only if the long request was still in flight after it (once ended it stays ended). When the long
    # request ends, another replaces it, so the count does not hang on how fast this host decodes LONG against how
    # fast it answers short requests (under load in CI, one long request once outlasted only three short ones).
    picks = []  # (the replica busy with the long request, the replica the short one went to)
    with Client(ll_balancer.address, timeout=60) as c:
        for _ in range(8):
            # The last long request, cancelled, must be gone from the balancer's accounting and the replicas'
            # reports, or two replicas would look equally busy.
            wait_until(
                lambda: all(r.in_flight + r.running_requests + r.queued_requests == 0 for r in c.status().replicas),
                10,
                what="both replicas idle",
            )
            long_stream = c.stream_chunks("a long story", **LONG)
            try:
                busy = next(long_stream).replica
                while len(picks) < 8:
                    picked = c.generate([5, 6, 7], **SHORT).replica
                    if not next(r for r in c.status().replicas if r.replica == busy).in_flight:
                        break
                    picks.append((busy, picked))
            finally:
                long_stream.close()  # cancels it
            if len(picks) == 8:
                break
    assert len(picks) >= 4, f"eight long requests ended after {len(picks)} short ones in all"
    assert all(picked != busy for busy, picked in picks), picks


def test_least_loaded_avoids_a_replica_busy_with_direct_traffic(ll_balancer, replicas):
    # Traffic the balancer did not route shows only in the replicas' GetStatus reports.
    with Client(replicas["r0"].address, timeout=60) as direct, Client(ll_balancer.address, timeout=60) as c:
        streams = [direct.stream_chunks([11 + i, 12, 13], **LONG) for i in range(3)]
        try:
            for s in streams:
                next(s)
            wait_until(lambda: c.status().replicas[0].running_requests >= 3, 10, what="balancer seeing r0 busy")
            served = [c.generate([5, 6, 7], **SHORT).replica for _ in range(8)]
            assert running_on(replicas["r0"]) >= 3  # still busy: the picks above were made under load
        finally:
            for s in streams:
                s.close()
    assert set(served) == {"r1"}


# ---- what the balancer returns ----
PROMPTS = {
    "text": "The quick brown fox",
    "token_ids": [1, 450, 3200, 77, 12, 9000],
    "chat": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
}


@pytest.mark.parametrize("kind", PROMPTS)
def test_stream_equals_unary_equals_a_replica_direct(kind, client, replicas):
    prompt = PROMPTS[kind]
    unary = client.generate(prompt, max_new_tokens=24)
    chunks = list(client.stream_chunks(prompt, max_new_tokens=24))
    assert "".join(c.text for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == unary.token_ids
    last = chunks[-1]
    assert (last.finish_reason, last.prompt_tokens, last.generated_tokens) == (
        unary.finish_reason,
        unary.prompt_tokens,
        unary.generated_tokens,
    )
    assert unary.generated_tokens == len(unary.token_ids) > 0
    with Client(replicas["r1"].address, timeout=60) as direct:
        alone = direct.generate(prompt, max_new_tokens=24)
    assert (alone.text, alone.token_ids) == (unary.text, unary.token_ids)
    assert alone.replica == "r1"


BAD_REQUESTS = [
    ("", {}, "empty"),
    (list(range(3, 1100)), {}, "context"),
    ("hi", {"temperature": -0.5}, "temperature"),
    ("hi", {"top_p": 1.5}, "top_p"),
    ("hi", {"min_new_tokens": 9, "max_new_tokens": 2}, "min_new_tokens"),
    ("hi", {"max_new_tokens": 5000}, "max_new_tokens"),
    ("hi", {"stop": [""]}, "stop"),
    ([{"role": "wizard", "content": "hi"}], {}, "role"),
    ([5, 60000], {}, "vocabulary"),
]


@pytest.mark.parametrize("prompt, params, mentions", BAD_REQUESTS)
@pytest.mark.parametrize("streaming", [False, True])
def test_bad_input_is_invalid_argument_saying_what_to_change(prompt, params, mentions, streaming, client):
    with pytest.raises(GenerationError) as err:
        if streaming:
            list(client.stream(prompt, **params))
        else:
            client.generate(prompt, **params)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert mentions in err.value.details


def test_deployment_keeps_serving_after_bad_input(client, balancer):
    for prompt, params, _ in BAD_REQUESTS:
        with pytest.raises(GenerationError):
            client.generate(prompt, **params)
    assert client.generate("still here", **SHORT).generated_tokens == 4
    assert {r.health for r in client.status().replicas} == {"serving"}
    assert metric(balancer, "fastgen_balancer_retries_total") == 0  # bad input is never retried


# ---- deadlines and cancellation reach the replica ----
def test_client_cancel_stops_the_replica_work(balancer, replicas):
    with Client(balancer.address, timeout=60) as c:
        stream = c.stream_chunks("abandoned", **LONG)
        replica = replicas[next(stream).replica]
        stream.close()
    wait_until(lambda: running_on(replica) == 0, 5, what="replica idle after the client left")


def test_client_deadline_stops_the_replica_work(balancer, replicas):
    with Client(balancer.address) as c:
        with pytest.raises(GenerationError) as err:
            c.generate("too slow", timeout=0.5, **HUGE)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: all(running_on(p) == 0 for p in replicas.values()), 5, what="replicas idle after deadline")


# ---- clients ----
def test_batch_generate_returns_results_in_order(client):
    prompts = [[20 + i, 30, 40] for i in range(6)]
    batch = client.generate(prompts, max_new_tokens=6, request_id="batch")
    assert [r.request_id for r in batch] == [f"batch-{i}" for i in range(6)]
    for prompt, result in zip(prompts, batch):
        assert result.token_ids == client.generate(prompt, max_new_tokens=6).token_ids
    assert client.generate([]) == []


def test_request_id_stop_and_status(client, tiny_model_dir):
    result = client.generate("hello", max_new_tokens=16, request_id="mine")
    assert result.request_id == "mine" and result.finish_reason == "length"
    stop = result.text[len(result.text) // 2 :][:3]
    stopped = client.generate("hello", max_new_tokens=16, stop=stop)
    assert stopped.finish_reason == "stop"
    assert stopped.text == result.text[: result.text.index(stop)]
    status = client.status()
    assert status.role == "balancer" and status.model == str(tiny_model_dir)
    assert [r.replica for r in status.replicas] == ["r0", "r1"]
    assert all(r.kv_blocks_total > 0 for r in status.replicas)


def test_async_client(balancer):
    async def main():
        async with AsyncClient(balancer.address, timeout=60) as c:
            unary = await c.generate("async", max_new_tokens=10)
            texts = [t async for t in c.stream("async", max_new_tokens=10)]
            batch = await c.generate(["async", "twice"], max_new_tokens=10)
            with pytest.raises(GenerationError) as err:
                await c.generate("hi", top_p=2.0)
            return unary, texts, batch, err.value

    unary, texts, batch, error = asyncio.run(main())
    assert "".join(texts) == unary.text
    assert batch[0].token_ids == unary.token_ids and len(batch) == 2
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT


def test_metrics_endpoints(balancer, replicas):
    assert metric(balancer, "fastgen_balancer_replica_healthy", replica="r0") == 1
    assert metric(balancer, "fastgen_balancer_requests_total", method="Generate", code="OK") > 0
    assert metric(balancer, "fastgen_balancer_requests_total", method="Generate", code="INVALID_ARGUMENT") > 0
    assert metric(balancer, "fastgen_balancer_routing_decisions_total", policy="round_robin", replica="r1") > 0
    assert metric(replicas["r1"], "fastgen_time_to_first_token_seconds_count") > 0
    assert metric(replicas["r1"], "fastgen_generated_tokens_total") > 0


# ---- failures ----
def test_killed_replica_requests_move_to_the_other_and_it_rejoins(balancer, replicas, tiny_model_dir, logs):
    victim = replicas["r0"]
    retries_before = metric(balancer, "fastgen_balancer_retries_total")

    async def run_40():
        killed = asyncio.Event()

        def kill_on_first_output_from_r0(chunk):
            if chunk.replica == "r0" and not killed.is_set():
                victim.popen.kill()  # kill -9 while about 20 requests run on r0
                killed.set()

        async def unary(c, i):
            return await c.generate([100 + i, 5, 6], max_new_tokens=48, ignore_eos=True)

        async def streamed(c, i):
            chunks = []
            try:
                async for chunk in c.stream_chunks([100 + i, 5, 6], max_new_tokens=48, ignore_eos=True):
                    chunks.append(chunk)
                    kill_on_first_output_from_r0(chunk)
            except GenerationError as e:
                return chunks, e
            return chunks, None

        async with AsyncClient(balancer.address, timeout=60) as c:
            calls = [streamed(c, i) if i % 4 == 0 else unary(c, i) for i in range(40)]
            results = await asyncio.gather(*calls, return_exceptions=True)
        assert killed.is_set()
        return results

    results = asyncio.run(run_40())
    for i, result in enumerate(results):
        if i % 4:
            assert not isinstance(result, BaseException), f"unary request {i} failed: {result}"
            assert result.generated_tokens == 48
            continue
        chunks, error = result
        # a stream that had output from the dead replica moves to the other one and finishes there (migration)
        assert error is None, f"stream {i}: {error}"
        assert sum(len(c.token_ids) for c in chunks) == 48
        if chunks[0].replica == "r0":
            assert chunks[-1].replica == "r1", f"stream {i} ended on {chunks[-1].replica}"
    assert metric(balancer, "fastgen_balancer_retries_total") > retries_before

    victim.popen.wait(10)
    replicas["r0"] = start_replica(tiny_model_dir, "r0", logs, port=victim.port)
    wait_serving(replicas["r0"])
    wait_balancer_sees(balancer, BOTH_SERVING)
    with Client(balancer.address, timeout=60) as c:
        assert {c.generate([1, 2, 3], **SHORT).replica for _ in range(4)} == {"r0", "r1"}


def test_balancer_drains_in_flight_calls_on_sigterm(replicas, logs):
    proc = start_balancer({rid: p.address for rid, p in replicas.items()}, logs, name="balancer-term")
    try:
        wait_serving(proc, timeout=30)
        wait_balancer_sees(proc, BOTH_SERVING)
        with Client(proc.address, timeout=60) as c:
            stream = c.stream_chunks("drain me", max_new_tokens=300, ignore_eos=True)
            chunks = [next(stream)]
            proc.popen.terminate()
            chunks += list(stream)
        assert sum(len(c.token_ids) for c in chunks) == 300
        assert proc.popen.wait(30) == 0
    finally:
        proc.kill()


def test_port_in_use_and_bad_flags_fail_clearly(balancer, logs):
    clash = start_balancer({"r0": "127.0.0.1:1"}, logs, port=balancer.port, name="balancer-clash")
    try:
        assert clash.popen.wait(30) != 0
        assert "in use" in clash.log_tail()
    finally:
        clash.kill()
    bad = subprocess.run(
        [sys.executable, "-m", "fastgen.balancer", "--replica", "r0=127.0.0.1:1", "--max-retries", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--max-retries" in bad.stderr


def test_unavailable_when_no_replica_is_up(logs):
    dead = {"a": f"127.0.0.1:{free_port()}", "b": f"127.0.0.1:{free_port()}"}
    proc = start_balancer(dead, logs, name="balancer-dead")
    try:
        wait_health(proc, "NOT_SERVING", timeout=30)
        with Client(proc.address, timeout=10) as c:
            with pytest.raises(GenerationError) as err:
                c.generate("anyone?")
            assert [r.health for r in c.status().replicas] == ["not_serving", "not_serving"]
    finally:
        proc.kill()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no healthy replica: 2 replicas configured, all failing health checks" in err.value.details


def test_unavailable_once_every_replica_died(balancer, replicas):
    """Last: takes the shared deployment down."""
    for proc in replicas.values():
        proc.kill()
    wait_health(balancer, "NOT_SERVING", timeout=10)
    with Client(balancer.address, timeout=10) as c:
        with pytest.raises(GenerationError) as err:
            c.generate("anyone?")
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no healthy replica" in err.value.details
