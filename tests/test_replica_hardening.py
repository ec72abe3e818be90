"""A replica against clients that misbehave and an engine that breaks: sizes counted before anything is copied, ids
that clients choose reaching nobody else's request, a reader that stops reading, an engine that stalls or keeps
failing, a step trace on a full disk."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import grpc
import pytest

from fastgen.proto import fastgen_pb2 as pb
from fastgen.replica.outputs import EngineLoad, RequestOutput, RequestTimings, StepResult
from fastgen.replica.request import FinishReason, SamplingParams


async def settle(condition, what: str = "condition", seconds: float = 30.0):
    for _ in range(int(seconds / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what} not reached")


def tiny_engine(model_dir):
    from fastgen.replica.builder import build_engine
    from fastgen.replica.config import CacheConfig, EngineConfig

    return build_engine(
        EngineConfig(model=str(model_dir), dtype="float32", cache=CacheConfig(block_size=4, num_blocks=256))
    )


def engine_loop(build, **kw):
    from prometheus_client import CollectorRegistry

    from fastgen.replica.engine_loop import EngineLoop, QueueLimits
    from fastgen.server.metrics import ReplicaMetrics

    limits = kw.pop("limits", QueueLimits())
    return EngineLoop(
        build, ReplicaMetrics(CollectorRegistry(), "r0", "tiny"), limits, asyncio.get_running_loop(), **kw
    )


# ---- 3b: limits before work --------------------------------------------------------------------------------------
class Huge:
    """A repeated field that is long, and must not be walked."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        raise AssertionError("copied before its length was checked")

    __getitem__ = __iter__


def test_token_ids_and_messages_are_counted_before_they_are_copied():
    from fastgen.replica.service import prompt_from_proto

    ids = SimpleNamespace(WhichOneof=lambda _: "token_ids", token_ids=SimpleNamespace(ids=Huge(10**7)))
    with pytest.raises(ValueError, match="10000000 tokens but the context holds 2048 tokens: shorten it"):
        prompt_from_proto(ids, 2048)
    chat = SimpleNamespace(WhichOneof=lambda _: "messages", messages=SimpleNamespace(messages=Huge(10**6)))
    with pytest.raises(ValueError, match="1000000 chat messages but the context holds 2048 tokens: send fewer"):
        prompt_from_proto(chat, 2048)
    # Within the context they are copied as before.
    assert prompt_from_proto(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3])), 3) == [1, 2, 3]
    with pytest.raises(ValueError, match="4 tokens"):
        prompt_from_proto(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3, 4])), 3)


# ---- 8: the engine's ids are the server's ------------------------------------------------------------------------
def test_a_reused_request_id_neither_collides_nor_cancels_the_other_request(tiny_model_dir):
    """Two clients that send the same request_id both run; one cancelling ends only its own stream; each sees its
    own id echoed; the engine never keys a request by the client's id."""
    from prometheus_client import CollectorRegistry

    from fastgen.replica.service import ReplicaService
    from fastgen.server import AsyncClient
    from fastgen.server.grpc_server import create_server
    from fastgen.server.metrics import ReplicaMetrics
    from fastgen.testing import free_port

    async def main():
        service = ReplicaService("r0", "tiny", ReplicaMetrics(CollectorRegistry(), "r0", "tiny"))
        port = free_port()
        server, _ = create_server(service, "127.0.0.1", port)
        await server.start()
        loop = engine_loop(lambda: tiny_engine(tiny_model_dir))
        await loop.start()
        service.engine_loop = loop
        try:
            async with AsyncClient(f"127.0.0.1:{port}", timeout=120) as client:
                first = client.stream_chunks("the first client", request_id="dup", max_new_tokens=40, ignore_eos=True)
                other = client.stream_chunks("the other client", request_id="dup", max_new_tokens=300, ignore_eos=True)
                head = await anext(first)
                assert (await anext(other)).request_id == "dup"
                assert "dup" not in loop._streams and len(loop._streams) == 2
                await other.aclose()  # the second client goes away: its request is cancelled, and only its own
                rest = [c async for c in first]
                unary = await client.generate("a third", request_id="dup", max_new_tokens=3)
            chunks = [head, *rest]
            assert {c.request_id for c in chunks} == {"dup"} and unary.request_id == "dup"
            assert chunks[-1].finish_reason == "length" and chunks[-1].generated_tokens == 40
            await settle(lambda: loop.in_flight == 0 and not loop._streams, "every request ended")
        finally:
            await server.stop(None)
            loop.stop()

    asyncio.run(main())


# ---- 5: a reader that stops reading ------------------------------------------------------------------------------
def test_a_stalled_reader_is_cancelled_and_streams_queue_deltas_only(tiny_model_dir):
    from fastgen.replica.engine_loop import QueueLimits, ReaderTooSlow
    from fastgen.server.errors import status_for

    async def main():
        loop = engine_loop(lambda: tiny_engine(tiny_model_dir), limits=QueueLimits(max_unsent_outputs=8))
        await loop.start()
        try:
            # A reader that reads nothing: past 8 unsent outputs its request ends, and its blocks are free.
            stalled = loop.submit("stalled", [5, 6, 7], SamplingParams(max_new_tokens=200, ignore_eos=True))
            await settle(lambda: stalled.overflowed and not loop._streams, "the stalled stream cancelled")
            await settle(lambda: loop.load.kv_blocks_used == 0 and loop.load.running == 0, "its blocks freed")
            assert len(stalled) == 1  # what it had queued is dropped for the error
            error = await stalled.get()
            assert isinstance(error, ReaderTooSlow) and status_for(error) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "reader too slow" in str(error)
            loop.done()

            # A reader that keeps up but reads late: each unsent output holds its step's tokens only, and the last
            # one holds the whole completion (for Generate's answer).
            late = loop.submit("late", [5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))
            await settle(lambda: len(late) == 6, "the second request's six outputs")
            outs = [await late.get() for _ in range(len(late))]
            loop.done()
            assert [len(o.new_token_ids) for o in outs] == [1] * 6
            assert all(o.token_ids == [] and o.text == "" for o in outs[:-1])
            assert outs[-1].token_ids == [t for o in outs for t in o.new_token_ids]
        finally:
            loop.stop()

    asyncio.run(main())


# ---- 6: a watchdog on the engine ---------------------------------------------------------------------------------
class FakeEngine:
    """Admits anything; its steps do what `step_does` says (raise, block, or finish every request)."""

    max_model_len = 64

    def __init__(self, step_does):
        self.prompts = SimpleNamespace(max_token_bytes=None)
        self.scheduler = SimpleNamespace(allocator=SimpleNamespace(cache=None))
        self.requests: list[str] = []
        self.step_does = step_does
        self.steps = 0

    def load(self):
        return EngineLoad()

    def has_unfinished(self):
        return bool(self.requests)

    def add_request(self, request_id, prompt, params, **kw):
        self.requests.append(request_id)

    def abort(self, request_id):
        if request_id in self.requests:
            self.requests.remove(request_id)
        return []

    def step(self):
        self.steps += 1
        self.step_does(self)
        done = [
            RequestOutput(rid, "x", [1], "x", [1], 1, FinishReason.LENGTH, RequestTimings(0.0), 0.0)
            for rid in self.requests
        ]
        self.requests = []
        return StepResult(done)

    def cache_events(self):
        # Engine's own, on the scheduler above: no changes, or an error once break_after has taken the scheduler.
        from fastgen.replica.engine import Engine

        return Engine.cache_events(self)


def fail(exc):
    def step(engine):
        raise exc

    return step


@pytest.mark.parametrize(
    "error, failures",
    [
        (RuntimeError("a bug in one step"), 2),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), 1),
        # Triton's launcher, the first to see a context an earlier kernel poisoned; torch's driver-API check.
        (RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"), 1),
        (RuntimeError("CUDA driver error: device-side assert triggered"), 1),
    ],
)
def test_steps_that_keep_failing_or_a_cuda_error_end_the_engine(error, failures):
    """After max_failed_steps failed steps in a row, or at once on a CUDA error (every later step would fail too),
    on_fatal runs (the replica process exits for its supervisor to restart it), the watchdog reports it unhealthy,
    and a request submitted afterwards is refused UNAVAILABLE-style (EngineDown) instead of waiting forever."""
    from fastgen.replica.engine_loop import EngineDown, Watchdog

    async def main():
        fatal = []
        engine = FakeEngine(fail(error))
        loop = engine_loop(lambda: engine, watchdog=Watchdog(max_failed_steps=2), on_fatal=fatal.append)
        await loop.start()
        try:
            assert loop.healthy()
            answers = []
            for i in range(failures):
                answers.append(await asyncio.wait_for(loop.submit(f"r{i}", "hi", SamplingParams()).get(), 10))
                loop.done()
            await settle(lambda: fatal, "on_fatal called")
            late = await asyncio.wait_for(loop.submit("late", "hi", SamplingParams()).get(), 10)
            return answers, fatal, late, loop.healthy(), engine.steps
        finally:
            loop.stop()

    answers, fatal, late, healthy, steps = asyncio.run(main())
    assert steps == failures and len(fatal) == 1 and not healthy
    assert all(isinstance(a, Exception) for a in answers)
    assert isinstance(late, EngineDown)


def test_device_errors_are_told_from_out_of_memory_through_their_causes():
    import torch

    from fastgen.replica.engine_loop import is_device_error

    class AcceleratorError(RuntimeError):  # torch.AcceleratorError's name, on a torch that may not have it
        pass

    wrapped = RuntimeError("sampling failed")
    wrapped.__cause__ = AcceleratorError("an illegal instruction was encountered")
    assert is_device_error(wrapped)
    assert not is_device_error(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_device_error(ValueError("prompt too long"))


def test_an_exception_outside_a_step_ends_the_engine_and_fails_its_requests():

    def break_after(engine):
        engine.scheduler = None  # publishing the cache's events after the step fails

    async def main():
        fatal = []
        loop = engine_loop(lambda: FakeEngine(break_after), on_fatal=fatal.append)
        await loop.start()
        try:
            first = await asyncio.wait_for(loop.submit("a", "hi", SamplingParams()).get(), 10)
            await settle(lambda: fatal, "on_fatal called")
            return first, fatal, loop.healthy()
        finally:
            loop.stop()

    first, fatal, healthy = asyncio.run(main())
    assert first.finished  # its output was delivered before the failure
    assert isinstance(fatal[0], AttributeError) and not healthy


def test_a_stalled_engine_is_not_serving_until_it_completes_steps_again():
    """grpc health (what the balancer and Kubernetes watch) says NOT_SERVING while requests wait on a step that does
    not end, and SERVING again once it does."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from prometheus_client import CollectorRegistry

    from fastgen.replica.engine_loop import Watchdog
    from fastgen.replica.service import ReplicaService, watch_engine
    from fastgen.server.grpc_server import create_server, set_serving
    from fastgen.server.metrics import ReplicaMetrics
    from fastgen.testing import free_port

    release = threading.Event()

    async def main():
        service = ReplicaService("r0", "fake", ReplicaMetrics(CollectorRegistry(), "r0", "fake"))
        port = free_port()
        server, health = create_server(service, "127.0.0.1", port)
        await server.start()
        loop = engine_loop(lambda: FakeEngine(lambda e: release.wait(60)), watchdog=Watchdog(stall_s=0.2))
        await loop.start()
        service.engine_loop = loop
        await set_serving(health, True)
        watchdog = asyncio.create_task(watch_engine(service, health, interval_s=0.05))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)

                async def status():
                    return (await stub.Check(health_pb2.HealthCheckRequest(service=""))).status

                assert await status() == health_pb2.HealthCheckResponse.SERVING
                outputs = loop.submit("stuck", "hi", SamplingParams())
                seen = []
                for _ in range(1500):  # the step hangs: NOT_SERVING soon after stall_s
                    seen.append(await status())
                    if seen[-1] == health_pb2.HealthCheckResponse.NOT_SERVING:
                        break
                    await asyncio.sleep(0.02)
                assert seen[-1] == health_pb2.HealthCheckResponse.NOT_SERVING and not service.serving
                release.set()
                assert (await asyncio.wait_for(outputs.get(), 10)).finished
                loop.done()
                for _ in range(1500):
                    if await status() == health_pb2.HealthCheckResponse.SERVING:
                        break
                    await asyncio.sleep(0.02)
                assert await status() == health_pb2.HealthCheckResponse.SERVING and service.serving
        finally:
            release.set()
            watchdog.cancel()
            await server.stop(None)
            loop.stop()

    asyncio.run(main())


# ---- 7: the step trace is a diagnostic ---------------------------------------------------------------------------
def step_stats():
    from fastgen.replica.outputs import StepStats

    return StepStats(1, 1, 0, 512, 0, 0.01, 0.01, 0, 1, 1, 10)


def test_a_step_trace_on_a_full_disk_stops_and_the_caller_goes_on():
    from fastgen.replica.step_model import StepTrace

    trace = StepTrace("/dev/full")  # every write fails with ENOSPC
    for i in range(3):
        trace.write(float(i), step_stats())
    trace.flush()
    trace.close()
    assert "writing failed" in trace.stopped


def test_a_step_trace_stops_at_its_size_bound(tmp_path):
    from fastgen.replica.step_model import StepTrace

    path = tmp_path / "trace.csv"
    trace = StepTrace(path, max_bytes=1000)
    for i in range(200):
        trace.write(float(i), step_stats())
    trace.close()
    rows = path.read_text().splitlines()
    assert "bytes" in trace.stopped and 5 < len(rows) < 200
    assert path.stat().st_size < 1000 + len(rows[-1]) + 2  # at most the row that crossed the bound


# ---- 6: a hung tensor-parallel peer ------------------------------------------------------------------------------
HUNG_PEER = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from fastgen.replica.tp_worker import RankEnv, init_process_group

env = RankEnv.from_env(os.environ, 2)
init_process_group(env, torch.device("cpu"), timedelta(seconds=3))
if env.rank == 1:
    time.sleep(300)  # hung, its sockets open: no error reaches rank 0 but the timeout
try:
    dist.all_reduce(torch.ones(4))
except RuntimeError as exc:
    print("collective failed:", type(exc).__name__, flush=True)
    os._exit(0)
os._exit(1)
"""


@pytest.mark.slow
def test_a_hung_tensor_parallel_peer_fails_rank_0s_collective(tmp_path):
    """The group's collectives carry --tp-timeout: rank 0 waiting on a peer that hangs (a stopped process, a wedged
    GPU) gets an error, which ends the replica for its supervisor to restart, instead of waiting 365 days."""
    import os
    import sys

    from fastgen.launch.processes import start
    from fastgen.testing import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    ranks = [
        start(
            f"rank {r}",
            [sys.executable, "-c", HUNG_PEER],
            tmp_path / f"rank-{r}.log",
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(2)
    ]
    try:
        assert ranks[0].popen.wait(120) == 0, ranks[0].log_tail()
        assert "collective failed: " in ranks[0].log_tail()
    finally:
        for p in ranks:
            p.kill()


# The replica's own entry point with one fault injected: once serving, the engine's second step raises what Triton's
# launcher raises after a kernel has poisoned the CUDA context.
POISONED_REPLICA = """
import sys
from fastgen.replica import __main__ as replica
from fastgen.replica.engine import Engine

step, served = Engine.step, []

def poisoned_step(self):
    if "warm-up" not in self._requests:
        served.append(1)
    if len(served) >= 2:
        raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")
    return step(self)

Engine.step = poisoned_step
sys.exit(replica.main(sys.argv[1:]))
"""


@pytest.mark.slow  # a replica process: loads the tiny model and serves (about 10 s)
def test_a_replica_whose_device_fails_exits_non_zero(tiny_model_dir, tmp_path):
    """The whole path on a real replica process: the request in flight fails UNAVAILABLE (which the balancer retries
    or migrates), and the process exits with EXIT_ENGINE_FAILED for its supervisor or Kubernetes to restart it,
    rather than staying SERVING and failing every later request fast."""
    import grpc

    from fastgen.replica.__main__ import EXIT_ENGINE_FAILED
    from fastgen.server.client import Client, GenerationError
    from fastgen.testing import free_port

    from .helpers import REPLICA_DEFAULTS, spawn, wait_serving

    port, metrics_port = free_port(), free_port()
    args = ["-c", POISONED_REPLICA, "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port)]
    args += ["--replica-id", "poisoned", "--model", str(tiny_model_dir), *REPLICA_DEFAULTS]
    proc = spawn("poisoned", args, port, metrics_port, tmp_path)
    try:
        wait_serving(proc)
        with pytest.raises(GenerationError) as info:
            Client(proc.address, timeout=30).generate("hello there", max_new_tokens=8, min_new_tokens=8)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
        assert proc.popen.wait(30) == EXIT_ENGINE_FAILED, proc.log_tail()
    finally:
        proc.kill()
    assert "the engine is beyond repair" in proc.log_tail(20000)
