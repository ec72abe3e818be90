"""The balancer's proxying, retries, deadlines and cancellation against scripted in-process fake replicas (no model,
no subprocesses): failures on cue, so each rule is checked deterministically and fast."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client import CollectorRegistry

from fastgen.balancer.journal import DEFAULT_MIGRATION, MigrationSettings
from fastgen.balancer.policy import Router
from fastgen.balancer.pool import ReplicaPool, ReplicaSpec
from fastgen.balancer.service import Balancer, BalancerService, RequestFailed
from fastgen.proto import fastgen_pb2 as pb
from fastgen.proto import fastgen_pb2_grpc
from fastgen.server import AsyncClient, GenerationError
from fastgen.server.errors import trailing_metadata
from fastgen.server.grpc_server import create_server, set_serving
from fastgen.server.metrics import BalancerMetrics
from fastgen.testing import free_port

OK, SLOW = "ok", "slow"
# What a client sees when gRPC's transport cancels a call its server's busy event loop did not accept in time: the
# code's name and no message (benchmarks/overload.py reproduces it on a real deployment).
TRANSPORT_CANCEL = "transport_cancel"


@dataclass
class FailAfter:
    """Stream this many chunks, then fail as a dying replica would."""

    chunks: int
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE


HINT_MS = 2500  # the retry hint a fake replica's RESOURCE_EXHAUSTED carries


@dataclass
class FakeReplica(fastgen_pb2_grpc.GenerationServicer):
    """Answers each call per the next entry of `script` (then OK): OK, SLOW (hangs), a StatusCode, or FailAfter."""

    id: str
    script: list = field(default_factory=list)
    calls: int = 0
    cancelled: int = 0
    time_remaining: list = field(default_factory=list)
    running: int = 0  # what GetStatus reports: traffic the balancer did not send

    def _next(self, context):
        self.calls += 1
        self.time_remaining.append(context.time_remaining())
        return self.script.pop(0) if self.script else OK

    async def _hang(self):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def Generate(self, request, context):
        action = self._next(context)
        if action == TRANSPORT_CANCEL:
            await context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
        if isinstance(action, grpc.StatusCode):
            await context.abort(action, f"{self.id} answers {action.name}", trailing_metadata(action, HINT_MS))
        if action == SLOW:
            await self._hang()
        return pb.GenerateResponse(
            request_id=request.request_id,
            text=f"text from {self.id}",
            token_ids=[1, 2],
            finish_reason=pb.FINISH_REASON_LENGTH,
            generated_tokens=2,
            replica=self.id,
        )

    async def GenerateStream(self, request, context):
        action = self._next(context)
        if isinstance(action, grpc.StatusCode):
            await context.abort(action, f"{self.id} answers {action.name}", trailing_metadata(action, HINT_MS))
        n = action.chunks if isinstance(action, FailAfter) else 3
        for i in range(n):
            yield pb.GenerateChunk(request_id=request.request_id, text=f"{i}", token_ids=[i], replica=self.id)
        if isinstance(action, FailAfter):
            await context.abort(action.code, f"{self.id} died")
        if action == SLOW:
            await self._hang()
        yield pb.GenerateChunk(request_id=request.request_id, finish_reason=pb.FINISH_REASON_LENGTH, replica=self.id)

    async def GetStatus(self, request, context):
        status = pb.ReplicaStatus(replica=self.id, running_requests=self.running, pending_prompt_tokens=self.running)
        return pb.StatusResponse(model="fake", role="replica", replicas=[status])


@dataclass
class Harness:
    client: AsyncClient
    pool: ReplicaPool
    registry: CollectorRegistry
    replica_health: dict
    balancer: Balancer | None = None  # the routing core, for transports other than gRPC

    def retries(self, replica: str, code: str = "UNAVAILABLE") -> float:
        value = self.registry.get_sample_value("fastgen_balancer_retries_total", {"replica": replica, "code": code})
        return value or 0.0


@contextlib.asynccontextmanager
async def balancer_over(
    fakes: list[FakeReplica],
    max_retries: int = 2,
    healthy: bool = True,
    policy: str = "round_robin",
    migration: MigrationSettings = DEFAULT_MIGRATION,
    health_interval: float = 0.05,
):
    servers, health, specs = [], {}, []
    for fake in fakes:
        port = free_port()
        server, health[fake.id] = create_server(fake, "127.0.0.1", port)
        await server.start()
        await set_serving(health[fake.id], healthy)
        servers.append(server)
        specs.append(ReplicaSpec(fake.id, f"127.0.0.1:{port}"))
    registry = CollectorRegistry()
    metrics = BalancerMetrics(registry)
    pool = ReplicaPool(specs, health_interval=health_interval, health_timeout=1.0, metrics=metrics)
    service = BalancerService(pool, Router(policy, len(fakes)), metrics, max_retries, migration)
    port = free_port()
    server, _ = create_server(service, "127.0.0.1", port)
    await server.start()
    pool.start()
    client = AsyncClient(f"127.0.0.1:{port}", timeout=10)
    try:
        for _ in range(100):  # until every replica's first check is in
            if all(r.checked for r in pool.replicas) and pool.any_healthy() == healthy:
                break
            await asyncio.sleep(0.02)
        yield Harness(client, pool, registry, health, service.balancer)
    finally:
        await client.close()
        await server.stop(None)
        await pool.close()
        for s in servers:
            await s.stop(None)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_unavailable_replica_is_retried_on_the_other():
    a, b = FakeReplica("a", [grpc.StatusCode.UNAVAILABLE]), FakeReplica("b")

    async def main():
        async with balancer_over([a, b]) as h:
            result = await h.client.generate("hi")
            assert result.replica == "b"
            assert h.retries("a") == 1

    run(main())
    assert (a.calls, b.calls) == (1, 1)


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL, grpc.StatusCode.FAILED_PRECONDITION]
)
def test_request_errors_pass_through_without_retry(code):
    a, b = FakeReplica("a", [code]), FakeReplica("b")

    async def main():
        async with balancer_over([a, b]) as h:
            with pytest.raises(GenerationError) as err:
                await h.client.generate("hi")
            assert err.value.code == code
            assert err.value.details == f"a answers {code.name}"  # the replica's own message

    run(main())
    assert b.calls == 0


def test_resource_exhausted_moves_once_then_reaches_the_client():
    full = grpc.StatusCode.RESOURCE_EXHAUSTED
    a, b = FakeReplica("a", [full, full]), FakeReplica("b", [OK, full])

    async def main():
        async with balancer_over([a, b]) as h:
            assert (await h.client.generate("moves to b")).replica == "b"
            with pytest.raises(GenerationError) as err:
                await h.client.generate("both full")  # a then b full: no third try
            assert err.value.code == full

    run(main())
    assert (a.calls, b.calls) == (2, 2)


def test_a_full_queue_with_no_other_replica_reaches_the_client_as_is():
    a = FakeReplica("a", [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2)

    async def main():
        async with balancer_over([a]) as h:
            with pytest.raises(GenerationError) as err:
                await h.client.generate("hi")
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED  # back off, not "unavailable"
            with pytest.raises(RequestFailed) as failed:
                await h.balancer.generate(pb.GenerateRequest(text="hi"))
            assert failed.value.retry_after_ms == HINT_MS  # the replica's hint, passed on

    run(main())
    assert a.calls == 2


def test_a_call_the_replica_transport_cancelled_is_an_overload_not_a_cancel():
    a, b = FakeReplica("a", [TRANSPORT_CANCEL, TRANSPORT_CANCEL]), FakeReplica("b", [OK, TRANSPORT_CANCEL])

    async def main():
        async with balancer_over([a, b]) as h:
            assert (await h.client.generate("moves to b")).replica == "b"
            assert h.retries("a", "RESOURCE_EXHAUSTED") == 1
            with pytest.raises(GenerationError) as err:
                await h.client.generate("both shed it")  # the client backs off, with a hint, as from a full queue
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "overloaded" in err.value.details

    run(main())
    assert (a.calls, b.calls) == (2, 2)


def test_the_core_answers_without_a_grpc_context():
    a = FakeReplica("a", [grpc.StatusCode.INVALID_ARGUMENT])

    async def main():
        async with balancer_over([a]) as h:
            with pytest.raises(RequestFailed) as err:
                await h.balancer.generate(pb.GenerateRequest(text="hi"))
            assert (err.value.code, err.value.details) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "a answers INVALID_ARGUMENT",
            )
            chunks = [c async for c in h.balancer.stream(pb.GenerateRequest(text="hi"), time.monotonic() + 5)]
            assert [c.text for c in chunks] == ["0", "1", "2", ""] and a.time_remaining[-1] < 5.1
            with pytest.raises(RequestFailed) as err:
                await h.balancer.generate(pb.GenerateRequest(text="hi"), deadline=time.monotonic() - 1)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            await _wait_for(lambda: h.balancer.model() == "fake")  # from the replica's GetStatus
            assert h.balancer.status().model == "fake"

    run(main())
    assert a.calls == 2  # the expired deadline never reached the replica


def test_retries_are_bounded_by_max_retries():
    down = grpc.StatusCode.UNAVAILABLE
    fakes = [FakeReplica(x, [down]) for x in "abc"]

    async def main():
        async with balancer_over(fakes, max_retries=1) as h:
            with pytest.raises(GenerationError) as err:
                await h.client.generate("hi")
            assert err.value.code == down
            assert "after 1 retries" in err.value.details

    run(main())
    assert [f.calls for f in fakes] == [1, 1, 0]


def test_stream_failing_before_output_is_retried():
    a, b = FakeReplica("a", [FailAfter(0)]), FakeReplica("b")

    async def main():
        async with balancer_over([a, b]) as h:
            chunks = [c async for c in h.client.stream_chunks("hi")]
            assert {c.replica for c in chunks} == {"b"}
            assert chunks[-1].finish_reason == "length"

    run(main())


def test_stream_failing_after_output_is_not_retried_without_migration():
    a, b = FakeReplica("a", [FailAfter(2)]), FakeReplica("b")

    async def main():
        async with balancer_over([a, b], migration=MigrationSettings(limit=0)) as h:
            got = []
            with pytest.raises(GenerationError) as err:
                async for text in h.client.stream("hi"):
                    got.append(text)
            assert got == ["0", "1"]  # what was sent stays sent; no repeat from b
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert "after part of the output was sent" in err.value.details

    run(main())
    assert b.calls == 0


def test_client_deadline_reaches_the_replica():
    a = FakeReplica("a")

    async def main():
        async with balancer_over([a]) as h:
            await h.client.generate("hi", timeout=5)
            await h.client.generate("hi", timeout=None)

    run(main())
    with_deadline, without = a.time_remaining
    assert 0 < with_deadline < 5.1  # gRPC rounds timeouts on the wire up a little
    assert without is None or without > 1e6  # gRPC's "no deadline"


def test_deadline_exceeded_is_not_retried():
    a, b = FakeReplica("a", [SLOW]), FakeReplica("b")

    async def main():
        async with balancer_over([a, b]) as h:
            with pytest.raises(GenerationError) as err:
                await h.client.generate("hi", timeout=0.3)
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            await _wait_for(lambda: a.cancelled == 1)

    run(main())
    assert b.calls == 0


@pytest.mark.parametrize("streaming", [False, True])
def test_client_cancellation_cancels_the_upstream_call(streaming):
    a = FakeReplica("a", [SLOW])

    async def main():
        async with balancer_over([a]) as h:
            if streaming:
                stream = h.client.stream("hi")
                assert await stream.__anext__() == "0"
                await stream.aclose()  # the consumer walks away mid-stream
            else:
                task = asyncio.ensure_future(h.client.generate("hi"))
                await _wait_for(lambda: a.calls == 1)
                task.cancel()
            await _wait_for(lambda: a.cancelled == 1)
            await _wait_for(lambda: h.pool.replicas[0].in_flight == 0)

    run(main())


def test_no_healthy_replica_answers_unavailable_naming_the_replicas():
    fakes = [FakeReplica("a"), FakeReplica("b")]

    async def main():
        async with balancer_over(fakes, healthy=False) as h:
            with pytest.raises(GenerationError) as err:
                await h.client.generate("hi")
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert "no healthy replica: 2 replicas configured" in err.value.details
            assert "a: NOT_SERVING" in err.value.details and "127.0.0.1" not in err.value.details  # ids, no addresses

    run(main())
    assert [f.calls for f in fakes] == [0, 0]


def test_replica_leaves_and_rejoins_rotation_with_its_health():
    a, b = FakeReplica("a"), FakeReplica("b")

    async def main():
        async with balancer_over([a, b]) as h:
            await set_serving(h.replica_health["a"], False)
            await _wait_for(lambda: not h.pool.replicas[0].healthy)
            assert {(await h.client.generate("x")).replica for _ in range(4)} == {"b"}
            status = await h.client.status()
            assert [r.health for r in status.replicas] == ["not_serving", "serving"]
            await set_serving(h.replica_health["a"], True)
            await _wait_for(lambda: h.pool.replicas[0].healthy)
            assert {(await h.client.generate("x")).replica for _ in range(4)} == {"a", "b"}

    run(main())


def test_least_loaded_follows_the_replicas_reports():
    a, b = FakeReplica("a", running=5), FakeReplica("b")

    async def main():
        async with balancer_over([a, b], policy="least_loaded") as h:
            await _wait_for(lambda: h.pool.replicas[0].status.running_requests == 5)
            assert {(await h.client.generate("x")).replica for _ in range(6)} == {"b"}
            a.running = 0
            await _wait_for(lambda: h.pool.replicas[0].status.running_requests == 0)
            assert {(await h.client.generate("x")).replica for _ in range(6)} == {"a", "b"}

    run(main())


def test_each_pick_weighs_on_its_replica_only_while_its_attempt_runs():
    """prefix_aware counts the prompt tokens a pick predicts its replica has yet to prefill as queued work there, for
    as long as that attempt runs: a failed attempt, a retry, a cancelled call and a retried stream each give theirs
    back, so an idle pool reads idle again."""
    full = grpc.StatusCode.RESOURCE_EXHAUSTED
    a, b = FakeReplica("a", [full, SLOW]), FakeReplica("b", [OK, FailAfter(0)])
    prompt = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(1, 321))))  # 20 blocks of 16

    def accounted(h: Harness) -> list[tuple[int, int]]:
        return [(r.in_flight, r.unreported_prompt_tokens) for r in h.pool.replicas]

    async def main():
        # One status report each, then none for a minute: a report would wipe the unreported tokens and hide a leak.
        async with balancer_over([a, b], policy="prefix_aware", health_interval=60) as h:
            await _wait_for(lambda: all(r.reports == 1 for r in h.pool.replicas))
            assert (await h.balancer.generate(prompt)).replica == "b"  # a was full
            assert accounted(h) == [(0, 0), (0, 0)]

            # Both were routed the prompt, so both hold it but for its last block: a's attempt counts that block.
            call = asyncio.ensure_future(h.balancer.generate(prompt))
            await _wait_for(lambda: a.calls == 2)
            assert accounted(h) == [(1, 16), (0, 0)]
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
            assert accounted(h) == [(0, 0), (0, 0)]

            chunks = [c async for c in h.balancer.stream(prompt)]  # b fails before any output: retried on a
            assert {c.replica for c in chunks} == {"a"}
            assert accounted(h) == [(0, 0), (0, 0)]
            assert [r.reports for r in h.pool.replicas] == [1, 1]

    run(main())
    assert (a.calls, b.calls) == (3, 2)


def test_a_stream_resumed_after_output_counts_its_prompt_whole_where_it_moves():
    """The pick's prediction covers the prompt as first sent; a stream resumed after output weighs on its new replica
    with the whole prompt's estimate, and gives it back when the stream ends."""
    a, b = FakeReplica("a", [grpc.StatusCode.RESOURCE_EXHAUSTED, FailAfter(2)]), FakeReplica("b", [OK, SLOW])
    prompt = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(1, 321))))

    async def main():
        async with balancer_over([a, b], policy="prefix_aware", health_interval=60) as h:
            await _wait_for(lambda: all(r.reports == 1 for r in h.pool.replicas))
            assert (await h.balancer.generate(prompt)).replica == "b"  # both now hold the prompt but its last block
            stream = h.balancer.stream(prompt)
            replicas = [(await stream.__anext__()).replica for _ in range(3)]
            assert replicas == ["a", "a", "b"]  # a died after two chunks; b continues
            assert [(r.in_flight, r.unreported_prompt_tokens) for r in h.pool.replicas] == [(0, 0), (1, 320)]
            await stream.aclose()
            assert [(r.in_flight, r.unreported_prompt_tokens) for r in h.pool.replicas] == [(0, 0), (0, 0)]

    run(main())


def test_status_lists_every_replica():
    async def main():
        async with balancer_over([FakeReplica("a"), FakeReplica("b")]) as h:
            status = await h.client.status()
            assert status.role == "balancer"
            assert status.model == "fake"
            assert [r.replica for r in status.replicas] == ["a", "b"]
            assert all(r.address.startswith("127.0.0.1:") for r in status.replicas)

    run(main())


async def _wait_for(predicate, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")
