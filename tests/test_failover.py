"""Stream migration: a request whose replica fails after output was sent resumes on another replica, every token
delivered once. First against scripted in-process fake replicas that honour `resume` (fast, deterministic), then end
to end with real replica processes on the tiny model (slow): kill -9 and SIGSTOP under load."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
import uuid
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fastgen.balancer.journal import Journal, MigrationSettings, journal_for, with_seed
from fastgen.proto import fastgen_pb2 as pb
from fastgen.proto import fastgen_pb2_grpc
from fastgen.server import AsyncClient, Client, GenerationError
from fastgen.server.grpc_server import set_serving

from .helpers import start_balancer, start_replica, wait_balancer_sees, wait_serving
from .test_balancer_http import events_of, http_over
from .test_balancer_service import balancer_over, run

LENGTH = 12  # tokens of a fake stream (of its first completion; completion j has LENGTH - j)


def token_at(i: int, j: int = 0) -> int:
    """Token i of completion j."""
    return 100 + i + 1000 * j


def full_text(n: int, j: int = 0) -> str:
    """The text of completion j's first n tokens."""
    return "".join(f"w{i} " if j == 0 else f"c{j}w{i} " for i in range(n))


@dataclass
class Break:
    """Send this many chunks, then fail with `code` as a dying replica would."""

    chunks: int
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE


@dataclass
class Hang:
    """Send this many chunks, then hang as a SIGSTOPped replica would (the test takes it out of health)."""

    chunks: int


@dataclass
class ResumingReplica(fastgen_pb2_grpc.GenerationServicer):
    """Streams token i = token_at(i) with text "w{i} ", text lagging one token behind (as a stop-string hold-back
    does), and with n > 1 the tokens of every completion in turn; a request with `resume` continues after each
    completion's tokens and text, as a real replica does. Each call follows the next entry of `script` (then runs to
    the end)."""

    id: str
    script: list = field(default_factory=list)
    requests: list = field(default_factory=list)
    hung: int = 0

    async def GenerateStream(self, request, context):
        self.requests.append(request)
        action = self.script.pop(0) if self.script else None
        n, length = request.params.n or 1, request.params.max_new_tokens or LENGTH
        r = request.resume  # empty for a new request: every completion from its start
        resumes = list(r.completions) or [pb.ResumedCompletion(token_ids=r.token_ids, text_chars=r.text_chars)]
        resumes += [pb.ResumedCompletion()] * (n - len(resumes))
        starts = [len(r.token_ids) for r in resumes]
        for j, resumed in enumerate(resumes):
            assert list(resumed.token_ids) == [token_at(i, j) for i in range(starts[j])]
        emitted, finished = [r.text_chars for r in resumes], [r.finished for r in resumes]
        rid = request.request_id or uuid.uuid4().hex
        sent = 0
        for i in range(length):  # one step: the next token of every completion still running
            for j in range(n):
                end = length - j  # completions end apart
                if finished[j] or i < starts[j] or i >= end:
                    continue
                if isinstance(action, (Break, Hang)) and sent == action.chunks:
                    if isinstance(action, Hang):
                        self.hung += 1
                        await asyncio.sleep(60)
                    await context.abort(action.code, f"{self.id} died")
                last = i == end - 1
                text = full_text(end, j)
                visible = len(text) if last else len(full_text(i, j))  # token i's text is held back until i + 1
                chunk = pb.GenerateChunk(
                    request_id=rid,
                    token_ids=[token_at(i, j)],
                    text=text[emitted[j] : visible],
                    replica=self.id,
                    index=j,
                )
                emitted[j] = visible
                if last:
                    chunk.finish_reason, chunk.generated_tokens = pb.FINISH_REASON_LENGTH, end
                yield chunk
                sent += 1
            await asyncio.sleep(0.005)

    async def Generate(self, request, context):
        self.requests.append(request)
        action = self.script.pop(0) if self.script else None
        if isinstance(action, Hang):
            self.hung += 1
            await asyncio.sleep(60)
        n = request.params.max_new_tokens or LENGTH
        return pb.GenerateResponse(
            request_id=request.request_id,
            text=full_text(n),
            token_ids=[token_at(i) for i in range(n)],
            finish_reason=pb.FINISH_REASON_LENGTH,
            generated_tokens=n,
            replica=self.id,
        )

    async def GetStatus(self, request, context):
        return pb.StatusResponse(model="fake", role="replica", replicas=[pb.ReplicaStatus(replica=self.id)])


async def collect(client, **params):
    return [c async for c in client.stream_chunks("hi", **params)]


def assert_whole(chunks, n: int = LENGTH) -> None:
    """Every position once, in order, and the text of exactly those tokens."""
    assert [t for c in chunks for t in c.token_ids] == [token_at(i) for i in range(n)]
    assert "".join(c.text for c in chunks) == full_text(n)
    assert len({c.request_id for c in chunks}) == 1
    assert chunks[-1].finish_reason == "length" and chunks[-1].generated_tokens == n


def metric(h, name: str, **labels) -> float:
    return h.registry.get_sample_value(name, labels) or 0.0


def test_a_stream_broken_mid_way_resumes_on_the_other_replica():
    a, b = ResumingReplica("a", [Break(5)]), ResumingReplica("b")

    async def main():
        async with balancer_over([a, b]) as h:
            chunks = await collect(h.client, temperature=0.7)
            assert_whole(chunks)
            assert [c.replica for c in chunks] == ["a"] * 5 + ["b"] * (LENGTH - 5)
            assert metric(h, "fastgen_balancer_migrations_total", replica="a", cause="unavailable") == 1
            assert metric(h, "fastgen_balancer_resumed_tokens_total") == 5
            assert metric(h, "fastgen_balancer_migration_seconds_count") == 1
            assert metric(h, "fastgen_balancer_retries_total", replica="a", code="UNAVAILABLE") == 0

    run(main())
    [first], [resumed] = a.requests, b.requests
    # The same seed (assigned by the balancer), the delivered tokens and text, a fenced id, no second echo.
    assert first.params.HasField("seed") and resumed.params.seed == first.params.seed
    assert list(resumed.resume.token_ids) == [token_at(i) for i in range(5)]
    assert resumed.resume.text_chars == len(full_text(4))  # the fifth token's text was still held back
    assert "/resume-1-" in resumed.request_id and not resumed.params.echo


def test_a_hung_replica_found_by_health_checks_hands_its_stream_over():
    a, b = ResumingReplica("a", [Hang(4)]), ResumingReplica("b")

    async def main():
        async with balancer_over([a, b]) as h:
            task = asyncio.ensure_future(collect(h.client))
            while not a.hung:
                await asyncio.sleep(0.01)
            await set_serving(h.replica_health["a"], False)  # what health checks find on a stopped process
            chunks = await task
            assert_whole(chunks)
            assert {c.replica for c in chunks[4:]} == {"b"}
            assert metric(h, "fastgen_balancer_migrations_total", replica="a", cause="unhealthy") == 1

    run(main())


def test_a_stream_moves_again_up_to_the_migration_limit():
    a, b = ResumingReplica("a", [Break(2), Break(2)]), ResumingReplica("b", [Break(2)])

    async def main():
        async with balancer_over([a, b], migration=MigrationSettings(limit=3)) as h:
            # a breaks, b resumes and breaks, a resumes again and breaks, b finishes: three moves.
            h.pool.mark_failed = _keep_healthy  # so the replica that broke can take the stream back
            chunks = await collect(h.client)
            assert_whole(chunks)
            assert [c.replica for c in chunks[:6]] == ["a", "a", "b", "b", "a", "a"]

    run(main())


async def _keep_healthy(replica, reason):
    return None


@pytest.mark.parametrize(
    "settings, breaks, mentions, reason",
    [
        (MigrationSettings(limit=1), 2, "--migration-limit", "limit"),
        (MigrationSettings(limit=0), 1, "migration is off", "limit"),
        (MigrationSettings(max_len=3), 1, "--migration-max-len", "length"),
    ],
)
def test_a_stream_that_cannot_move_fails_as_before(settings, breaks, mentions, reason):
    a, b = ResumingReplica("a", [Break(5)]), ResumingReplica("b", [Break(2)] if breaks > 1 else [])

    async def main():
        async with balancer_over([a, b], migration=settings) as h:
            got = []
            with pytest.raises(GenerationError) as err:
                async for chunk in h.client.stream_chunks("hi"):
                    got.append(chunk)
            assert [t for c in got for t in c.token_ids] == [token_at(i) for i in range(len(got))]  # none twice
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert "after part of the output was sent" in err.value.details and mentions in err.value.details
            assert metric(h, "fastgen_balancer_migrations_refused_total", reason=reason) == 1

    run(main())


def test_a_stream_with_no_healthy_replica_left_fails_unavailable():
    a = ResumingReplica("a", [Break(3)])

    async def main():
        async with balancer_over([a]) as h:
            with pytest.raises(GenerationError) as err:
                await collect(h.client)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert "not resumed" in err.value.details and "no healthy replica" in err.value.details
            assert metric(h, "fastgen_balancer_migrations_refused_total", reason="no_replica") == 1

    run(main())


def by_completion(chunks, n: int) -> list[list]:
    return [[c for c in chunks if c.index == j] for j in range(n)]


@pytest.mark.parametrize("length, breaks", [(LENGTH, 7), (4, 8)], ids=["all-running", "two-finished"])
def test_n_completions_resume_together_each_from_its_own_place(length, breaks):
    """Three completions, cut at different places (in the second case two of them had finished): every completion's
    tokens and text arrive once each, and the resumed call carries each one's own output."""
    a, b = ResumingReplica("a", [Break(breaks)]), ResumingReplica("b")

    async def main():
        async with balancer_over([a, b]) as h:
            chunks = await collect(h.client, n=3, max_new_tokens=length)
            for j, mine in enumerate(by_completion(chunks, 3)):
                assert [t for c in mine for t in c.token_ids] == [token_at(i, j) for i in range(length - j)]
                assert "".join(c.text for c in mine) == full_text(length - j, j)
                assert [c.finish_reason for c in mine].count("length") == 1 and mine[-1].finish_reason == "length"
            assert {c.replica for c in chunks} == {"a", "b"} and len({c.request_id for c in chunks}) == 1
            assert metric(h, "fastgen_balancer_migrations_total", replica="a", cause="unavailable") == 1

    run(main())
    [resumed] = b.requests
    finished = [c.finished for c in resumed.resume.completions]
    assert finished == ([False] * 3 if length == LENGTH else [False, True, True])
    assert not resumed.resume.token_ids and sum(len(c.token_ids) for c in resumed.resume.completions) == breaks


def test_a_unary_call_on_a_hung_replica_runs_again_elsewhere_with_the_same_seed():
    a, b = ResumingReplica("a", [Hang(0)]), ResumingReplica("b")

    async def main():
        async with balancer_over([a, b]) as h:
            task = asyncio.ensure_future(h.client.generate("hi", temperature=1.0))
            while not a.hung:
                await asyncio.sleep(0.01)
            await set_serving(h.replica_health["a"], False)
            result = await task
            assert result.replica == "b" and result.token_ids == [token_at(i) for i in range(LENGTH)]
            assert metric(h, "fastgen_balancer_migrations_total", replica="a", cause="unhealthy") == 1

    run(main())
    assert a.requests[0].params.seed == b.requests[0].params.seed


def test_a_long_call_stays_on_a_draining_replica_when_no_other_is_healthy():
    a, b = ResumingReplica("a", [Hang(3)]), ResumingReplica("b")

    async def main():
        async with balancer_over([a, b]) as h:
            await set_serving(h.replica_health["b"], False)
            while h.pool.replicas[1].healthy:
                await asyncio.sleep(0.01)
            task = asyncio.ensure_future(collect(h.client))
            while not a.hung:
                await asyncio.sleep(0.01)
            await set_serving(h.replica_health["a"], False)
            await asyncio.sleep(0.3)  # several health intervals: nowhere to go, so the call stays
            assert not task.done() and not b.requests
            task.cancel()

    run(main())


@pytest.mark.parametrize("n", [1, 2])
def test_the_http_api_resumes_streams_too(n):
    a, b = ResumingReplica("a", [Break(5)]), ResumingReplica("b")

    async def main():
        async with http_over([a, b]) as http:
            body = {"model": "fake", "prompt": "hi", "stream": True, "max_tokens": LENGTH, "temperature": 0.5, "n": n}
            r = await http.post("/v1/completions", body)
            assert r.status == 200
            data = events_of(await r.text())
            assert data[-1] == "[DONE]" and not any("error" in json.loads(d) for d in data[:-1])
            choices = [c for d in data[:-1] for c in json.loads(d)["choices"]]
            for j in range(n):
                assert "".join(c["text"] for c in choices if c["index"] == j) == full_text(LENGTH - j, j)

    run(main())
    assert b.requests[0].params.seed == a.requests[0].params.seed


def test_seeds_are_assigned_to_sampled_requests_only():
    greedy = pb.GenerateRequest(text="x")
    assert with_seed(greedy) is greedy
    seeded = pb.GenerateRequest(text="x", params=pb.SamplingParams(temperature=1.0, seed=5))
    assert with_seed(seeded) is seeded
    bare = pb.GenerateRequest(text="x", params=pb.SamplingParams(temperature=1.0))
    assigned = with_seed(bare)
    assert assigned.params.HasField("seed") and not bare.params.HasField("seed")  # the caller's message untouched
    assert with_seed(bare).params.seed != assigned.params.seed


def test_the_journal_is_bounded_and_relabels_later_replicas_chunks():
    journal = Journal(pb.GenerateRequest(text="x"), max_len=4)
    journal.record(pb.GenerateChunk(request_id="first", token_ids=[1, 2], text="ab"))
    relabelled = journal.record(pb.GenerateChunk(request_id="first/resume-1", token_ids=[3], text="c"))
    [c] = journal.completions
    assert relabelled.request_id == "first" and c.token_ids == [1, 2, 3] and c.text_chars == 3
    journal.record(pb.GenerateChunk(request_id="x", token_ids=[4, 5]))
    assert journal.untracked and journal.tokens == 0 and journal.delivered
    assert journal_for(pb.GenerateRequest(text="x"), MigrationSettings(limit=0)).untracked
    # n completions: the bound is on their tokens together
    several = Journal(pb.GenerateRequest(text="x", params=pb.SamplingParams(n=2)), max_len=4)
    several.record(pb.GenerateChunk(token_ids=[1, 2], index=0))
    several.record(pb.GenerateChunk(token_ids=[7], index=1, finish_reason=pb.FINISH_REASON_STOP))
    assert [(c.token_ids, c.finished) for c in several.completions] == [([1, 2], False), ([7], True)]
    several.record(pb.GenerateChunk(token_ids=[3, 4], index=0))
    assert several.untracked and several.tokens == 0


# ---- end to end: real replica processes on the tiny model ----------------------------------------------------
STREAMS, UNARY = 16, 8
LONG = 40  # tokens per request: long enough that the failure lands mid-stream


SEVERAL = 1  # the stream whose replica is hit: one of those asking for several completions
# Structured output that LONG tokens cannot finish: the resumed streams rebuild their grammar state from the tokens.
LONG_JSON = {"json_schema": '{"type":"object","properties":{"s":{"type":"string","minLength":400}},"required":["s"]}'}


def request_params(i: int) -> dict:
    """Half greedy, half seeded sampling with a penalty; one in four of those sampled asks for 3 completions; some
    with a stop string that never matches (a hold-back runs all along)."""
    params = dict(max_new_tokens=LONG, ignore_eos=True)
    if i % 2:
        params.update(temperature=0.9, seed=1000 + i, presence_penalty=0.5)
    if i % 4 == SEVERAL:
        params["n"] = 3
    if i % 3 == 0:
        params["stop"] = ["\x00never\x00"]
    if i in (SEVERAL, 3, 4):
        params["constraint"] = LONG_JSON
    return params


def prompt(i: int) -> list[int]:
    return [200 + i, 17, 99, 5 + i % 7]


@pytest.fixture(scope="module")
def e2e(tiny_model_dir, tmp_path_factory):
    """Two replicas behind a balancer, and each request's output without any failure (from r1 directly)."""
    logs = tmp_path_factory.mktemp("failover-logs")
    procs = {rid: start_replica(tiny_model_dir, rid, logs) for rid in ("r0", "r1")}
    balancer = start_balancer({rid: p.address for rid, p in procs.items()}, logs, name="balancer-failover")
    try:
        for p in (*procs.values(), balancer):
            wait_serving(p)
        wait_balancer_sees(balancer, {"r0": "serving", "r1": "serving"})
        with Client(procs["r1"].address, timeout=120) as direct:
            refs = [direct.generate(prompt(i), **request_params(i)) for i in range(STREAMS + UNARY)]
        assert all(c.text.startswith('{"s": "') for i in (SEVERAL, 3, 4) for c in refs[i].completions())
        yield procs, balancer, refs, logs
    finally:
        for p in (*procs.values(), balancer):
            p.kill()


def failover_run(balancer, procs, refs, fail) -> None:
    """STREAMS streams and UNARY unary calls through the balancer; `fail(victim)` hits the replica of stream SEVERAL
    (3 completions) once each of them has sent output. Every request completes with the tokens and text of its
    failure-free run, every completion of it."""

    async def main():
        victims = []

        async def streamed(c, i):
            chunks = []
            async for chunk in c.stream_chunks(prompt(i), **request_params(i)):
                chunks.append(chunk)
                if i == SEVERAL and len(chunks) == 9:
                    victims.append(procs[chunk.replica])
                    fail(procs[chunk.replica])
            return chunks

        async with AsyncClient(balancer.address, timeout=120) as c:
            calls = [streamed(c, i) for i in range(STREAMS)]
            calls += [c.generate(prompt(i), **request_params(i)) for i in range(STREAMS, STREAMS + UNARY)]
            return await asyncio.gather(*calls), victims

    results, victims = asyncio.run(main())
    assert victims
    moved = 0
    for i, result in enumerate(results):
        refs_i = refs[i].completions()
        if i >= STREAMS:
            got = [(c.token_ids, c.text) for c in result.completions()]
            assert got == [(c.token_ids, c.text) for c in refs_i], f"unary request {i}"
            continue
        assert {c.index for c in result} == set(range(len(refs_i)))
        for ref in refs_i:
            mine = [c for c in result if c.index == ref.index]
            tokens = [t for c in mine for t in c.token_ids]
            where = f"stream {i}, completion {ref.index}"
            assert tokens == ref.token_ids, f"{where}: positions duplicated, missing or different"
            assert "".join(c.text for c in mine) == ref.text, f"{where}: text"
            assert mine[-1].finish_reason == ref.finish_reason and mine[-1].generated_tokens == LONG, where
        moved += len({c.replica for c in result}) > 1
    assert len({c.replica for c in results[SEVERAL]}) > 1  # the stream of several completions crossed replicas
    assert moved > 0  # some streams really did cross replicas
    count = balancer_metric(balancer, "fastgen_balancer_migration_seconds_count")
    total = balancer_metric(balancer, "fastgen_balancer_migration_seconds_sum")
    print(
        f"\n{moved} of {STREAMS} streams moved; failure to first resumed token {total / max(count, 1):.3f} s on average"
    )


def balancer_metric(proc, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(body) for s in f.samples if s.name == name)


def restart(procs, victim, tiny_model_dir, logs, balancer):
    victim.kill()
    procs[victim.name] = start_replica(tiny_model_dir, victim.name, logs, port=victim.port)
    wait_serving(procs[victim.name])
    wait_balancer_sees(balancer, {"r0": "serving", "r1": "serving"})


@pytest.mark.slow
def test_kill_9_mid_stream_every_request_completes_identically(e2e, tiny_model_dir):
    procs, balancer, refs, logs = e2e
    victims = []

    def kill(victim):
        victims.append(victim)
        victim.popen.kill()

    failover_run(balancer, procs, refs, kill)
    restart(procs, victims[0], tiny_model_dir, logs, balancer)


@pytest.mark.slow
def test_sigstop_mid_stream_the_hung_replica_is_left_behind(e2e, tiny_model_dir):
    procs, balancer, refs, logs = e2e
    victims = []

    def stop(victim):
        victims.append(victim)
        victim.popen.send_signal(signal.SIGSTOP)

    try:
        failover_run(balancer, procs, refs, stop)
    finally:
        for v in victims:
            v.popen.send_signal(signal.SIGCONT)
    restart(procs, victims[0], tiny_model_dir, logs, balancer)


@pytest.mark.slow
def test_requests_that_cannot_resume_keep_todays_errors(e2e):
    procs, balancer, _, logs = e2e
    off = start_balancer(
        {rid: p.address for rid, p in procs.items()},
        logs,
        name="balancer-no-migration",
        extra_args=["--migration-limit", "0"],
    )
    try:
        wait_serving(off)
        wait_balancer_sees(off, {"r0": "serving", "r1": "serving"})
        with Client(off.address, timeout=60) as c:
            stream = c.stream_chunks(prompt(0), max_new_tokens=300, ignore_eos=True)
            first = next(stream)
            victim = procs[first.replica]
            victim.popen.kill()
            with pytest.raises(GenerationError) as err:
                list(stream)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert "after part of the output was sent" in err.value.details
    finally:
        off.kill()
