"""One replica process on its own: cancellation frees KV blocks at once, a full queue answers
RESOURCE_EXHAUSTED, and neither disturbs the other requests."""

import threading

import grpc
import pytest

from fastgen.server import Client, GenerationError
from fastgen.testing import wait_until

from .helpers import start_replica, wait_serving

LONG = dict(max_new_tokens=600, ignore_eos=True)


@pytest.fixture(scope="module")
def replica(tiny_model_dir, tmp_path_factory):
    # One sequence at a time and one waiting request: the third concurrent request finds the queue full.
    proc = start_replica(
        tiny_model_dir,
        "solo",
        tmp_path_factory.mktemp("logs"),
        extra_args=["--max-seqs", "2", "--max-queue-requests", "1"],
    )
    try:
        wait_serving(proc)
        yield proc
    finally:
        proc.kill()


def kv_used(client: Client) -> int:
    return client.status().replicas[0].kv_blocks_used


@pytest.mark.slow
def test_cancelled_stream_frees_its_blocks_and_others_go_on(replica):
    with Client(replica.address, timeout=120) as client:
        assert kv_used(client) == 0
        keep = client.stream_chunks("the stream that stays", max_new_tokens=60, ignore_eos=True)
        drop = client.stream_chunks("the stream that leaves " * 10, **LONG)
        next(keep), next(drop)
        both = kv_used(client)
        drop.close()  # the client goes away mid-stream
        wait_until(lambda: kv_used(client) < both, 5, what="the cancelled stream's blocks back in the pool")
        rest = list(keep)
        assert rest[-1].finish_reason == "length" and rest[-1].generated_tokens == 60
        wait_until(lambda: kv_used(client) == 0, 5, what="every block free")


@pytest.mark.slow
def test_full_queue_is_resource_exhausted_and_the_rest_is_served(replica):
    results, errors = [], []

    def run(prompt):
        try:
            with Client(replica.address, timeout=120) as c:
                results.append(c.generate(prompt, max_new_tokens=40, ignore_eos=True))
        except GenerationError as e:
            errors.append(e)

    with Client(replica.address, timeout=120) as client:
        # Two long requests occupy both sequence slots, so later ones wait in the queue.
        busy = [client.stream_chunks(f"busy {i}", **LONG) for i in range(2)]
        for stream in busy:
            next(stream)
        threads = [threading.Thread(target=run, args=(f"queued {i}",)) for i in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: errors, 30, what="a request refused for a full queue")
        assert errors[0].code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "back off" in errors[0].details
        for stream in busy:
            stream.close()
        for t in threads:
            t.join(60)
    assert len(results) + len(errors) == 3 and len(results) >= 1
    assert all(r.generated_tokens == 40 for r in results)


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests(tiny_model_dir, tmp_path):
    proc = start_replica(tiny_model_dir, "drained", tmp_path)
    try:
        wait_serving(proc)
        with Client(proc.address, timeout=120) as client:
            stream = client.stream_chunks("finish me", max_new_tokens=80, ignore_eos=True)
            next(stream)
            proc.popen.terminate()
            chunks = list(stream)
        assert chunks[-1].finish_reason == "length" and chunks[-1].generated_tokens == 80
        assert proc.popen.wait(30) == 0
    finally:
        proc.kill()


def test_engine_loop_builds_and_steps_the_engine_on_one_thread(tiny_model_dir):
    """The engine is built, warmed and stepped on the engine loop's own thread (one OpenMP pool: see EngineLoop), a
    request submitted from asyncio is served there, and a model that fails to build fails start() with its error."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from fastgen.replica.builder import build_engine
    from fastgen.replica.config import CacheConfig, EngineConfig
    from fastgen.replica.parallel import TPGroup
    from fastgen.replica.request import SamplingParams
    from fastgen.replica.service import EngineLoop, QueueLimits
    from fastgen.server.metrics import ReplicaMetrics

    threads = {}

    def build(model):
        threads["build"] = threading.current_thread()
        config = EngineConfig(model=model, dtype="float32", cache=CacheConfig(block_size=16, num_blocks=64))
        engine = build_engine(config, TPGroup(), None)
        step = engine.step

        def step_here():
            threads["step"] = threading.current_thread()
            return step()

        engine.step = step_here
        return engine

    async def serve_one():
        loop = EngineLoop(
            lambda: build(str(tiny_model_dir)),
            ReplicaMetrics(CollectorRegistry(), "r0", "tiny"),
            QueueLimits(),
            asyncio.get_running_loop(),
        )
        await loop.start()
        try:
            assert loop.load.kv_blocks_total == 64  # published once built
            outputs = loop.submit("one", [5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True))
            while not (out := await asyncio.wait_for(outputs.get(), 60)).finished:
                pass
            return out
        finally:
            loop.stop()

    out = asyncio.run(serve_one())
    assert len(out.token_ids) == 3
    assert threads["build"] is threads["step"] and threads["build"].name == "engine"

    async def fail_to_build():
        loop = EngineLoop(
            lambda: build("/nonexistent/model"),
            ReplicaMetrics(CollectorRegistry(), "r1", "none"),
            QueueLimits(),
            asyncio.get_running_loop(),
        )
        await loop.start()

    with pytest.raises(ValueError, match="nonexistent"):
        asyncio.run(fail_to_build())
