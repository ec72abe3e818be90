"""The engine thread as an actor (replica/engine_loop.py), on the session's tiny random model: requests submitted
from asyncio come back as deltas and match the engine stepped directly, aborts cancel, the watchdog tells a stall from
idleness, a failed step fails only its requests, stop ends the thread. And what the service asks the engine about its
KV pool (Engine.cache_info, Engine.cache_events), on the engine and through gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from fastgen.prefix_hash import extend_hashes
from fastgen.replica import prefix_cache
from fastgen.replica.engine import CacheChanges, CacheInfo
from fastgen.replica.engine_loop import EngineDown, EngineLoop, Outputs, QueueLimits, Watchdog, _put_all
from fastgen.replica.outputs import RequestOutput, RequestTimings
from fastgen.replica.request import FinishReason, SamplingParams
from fastgen.server.errors import QueueFullError

BLOCK = 4
PROMPT = list(range(5, 14))  # 9 tokens: two full blocks and one token of a third


def build(model_dir, num_blocks: int = 256, prefix_caching: bool = True):
    from fastgen.replica.builder import build_engine
    from fastgen.replica.config import CacheConfig, EngineConfig

    cache = CacheConfig(block_size=BLOCK, num_blocks=num_blocks, prefix_caching=prefix_caching)
    return build_engine(EngineConfig(model=str(model_dir), dtype="float32", cache=cache))


@contextlib.asynccontextmanager
async def running(make, **kw):
    from prometheus_client import CollectorRegistry

    from fastgen.server.metrics import ReplicaMetrics

    limits = kw.pop("limits", QueueLimits())
    loop = EngineLoop(make, ReplicaMetrics(CollectorRegistry(), "r0", "tiny"), limits, asyncio.get_running_loop(), **kw)
    await loop.start()
    try:
        yield loop
    finally:
        loop.stop()


async def drain(outputs) -> list:
    """One completion's outputs up to its last (or the exception that ended it)."""
    outs = []
    while True:
        out = await asyncio.wait_for(outputs.get(), 30)
        outs.append(out)
        if isinstance(out, Exception) or out.finished:
            return outs


async def settle(condition, what: str, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} not reached")


def run_directly(engine, prompt, params):
    engine.add_request("direct", prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step().outputs
    return outs[-1]


def cached_hashes(token_ids, blocks: int, salt: str = "") -> list[bytes]:
    hashes: list[bytes] = []
    extend_hashes(hashes, token_ids, BLOCK, salt, blocks)
    return hashes


# ---- the actor -----------------------------------------------------------------------------------------------------
def test_a_request_streams_deltas_that_match_the_engine_stepped_directly(tiny_model_dir):
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)

    async def main():
        async with running(lambda: build(tiny_model_dir)) as loop:
            outs = await drain(loop.submit("a", PROMPT, params))
            loop.done()
            return outs, loop.tokens_generated, loop.in_flight, dict(loop._streams), loop.engine

    outs, generated, in_flight, streams, engine = asyncio.run(main())
    assert [len(o.new_token_ids) for o in outs] == [1] * 6
    assert all(o.token_ids == [] and o.text == "" for o in outs[:-1])  # deltas only, until the last
    last = outs[-1]
    assert last.finish_reason is FinishReason.LENGTH and last.generated_tokens == 6
    assert last.token_ids == [t for o in outs for t in o.new_token_ids]
    assert (generated, in_flight, streams) == (6, 0, {})
    # The thread has ended: the engine it built answers the same prompt alike when stepped here.
    assert run_directly(engine, PROMPT, params).token_ids == last.token_ids


def test_abort_cancels_a_running_request_and_frees_its_blocks(tiny_model_dir):
    async def main():
        async with running(lambda: build(tiny_model_dir)) as loop:
            outputs = loop.submit("long", PROMPT, SamplingParams(max_new_tokens=900, ignore_eos=True))
            first = await asyncio.wait_for(outputs.get(), 30)
            loop.abort("nobody")  # an id the engine does not run: ignored
            loop.abort("long")
            rest = await drain(outputs)
            loop.done()
            await settle(lambda: loop.load.kv_blocks_used == 0 and loop.load.running == 0, "the blocks freed")
            after = await drain(loop.submit("next", PROMPT, SamplingParams(max_new_tokens=2)))
            loop.done()
            return first, rest, after, dict(loop._streams)

    first, rest, after, streams = asyncio.run(main())
    assert not first.finished
    assert rest[-1].finish_reason is FinishReason.CANCELLED and rest[-1].generated_tokens < 900
    assert after[-1].finish_reason is FinishReason.LENGTH and after[-1].generated_tokens == 2
    assert streams == {}


def test_the_watchdog_tells_a_stall_from_idleness_and_a_stopped_loop_is_unhealthy(tiny_model_dir):
    async def main():
        async with running(lambda: build(tiny_model_dir), watchdog=Watchdog(stall_s=5.0)) as loop:
            idle = loop.healthy(), loop.healthy(now=time.monotonic() + 60)
            outputs = loop.submit("a", PROMPT, SamplingParams(max_new_tokens=3))
            # A request waits, and (by the clock passed) no step has ended for over stall_s: stalled.
            waiting = loop.healthy(), loop.healthy(now=time.monotonic() + 60)
            await drain(outputs)
            loop.done()
            done = loop.healthy(now=time.monotonic() + 60)
        late = await asyncio.wait_for(loop.submit("late", PROMPT, SamplingParams()).get(), 10)
        return idle, waiting, done, loop.healthy(), loop._thread.is_alive(), late

    idle, waiting, done, stopped, alive, late = asyncio.run(main())
    assert idle == (True, True)  # nothing waits: an idle engine is not a stalled one
    assert waiting == (True, False)
    assert done is True
    assert not stopped and not alive
    assert isinstance(late, EngineDown)  # nothing would ever answer it


def test_stop_ends_the_thread_while_a_request_runs(tiny_model_dir):
    async def main():
        async with running(lambda: build(tiny_model_dir)) as loop:
            outputs = loop.submit("long", PROMPT, SamplingParams(max_new_tokens=900, ignore_eos=True))
            await asyncio.wait_for(outputs.get(), 30)
            loop.stop()
            return loop._thread.is_alive(), loop.engine.has_unfinished()

    alive, unfinished = asyncio.run(main())
    assert not alive and unfinished  # it stopped at its next look, not when the request ended


def test_a_failed_step_fails_its_requests_and_a_device_error_ends_the_engine(tiny_model_dir):
    # What each step does, in turn: raise, or (None) step the engine; once the script ends, step it.
    script = [RuntimeError("a bug in one step"), None, RuntimeError("CUDA error: an illegal memory access")]

    def make():
        engine = build(tiny_model_dir)
        step = engine.step

        def scripted():
            error = script.pop(0) if script else None
            if error is not None:
                raise error
            return step()

        engine.step = scripted
        return engine

    async def main():
        fatal = []
        async with running(make, on_fatal=fatal.append) as loop:
            failed = await drain(loop.submit("a", PROMPT, SamplingParams(max_new_tokens=1)))
            loop.done()
            healthy_after_a_bug = loop.healthy()
            down = await drain(loop.submit("b", PROMPT, SamplingParams(max_new_tokens=5)))
            loop.done()
            await settle(lambda: fatal, "on_fatal called")
            with pytest.raises(EngineDown, match="another replica"):  # at once: nothing would answer the command
                await asyncio.wait_for(loop.change_lora("tuned", "/no/such/adapter"), 10)
            return failed, healthy_after_a_bug, down, fatal, loop.fatal, loop.healthy()

    failed, healthy_after_a_bug, down, fatal, why, healthy = asyncio.run(main())
    assert isinstance(failed[-1], RuntimeError) and "engine step failed: a bug in one step" in str(failed[-1])
    assert healthy_after_a_bug
    assert isinstance(down[-1], EngineDown) and "CUDA error" in str(down[-1])
    assert fatal == [why] and "illegal memory access" in str(why) and not healthy


def test_admission_limits_and_lora_changes_are_answered_on_the_callers_loop(tiny_model_dir):
    async def main():
        async with running(lambda: build(tiny_model_dir), limits=QueueLimits(max_prompt_tokens=0)) as loop:
            refused = await asyncio.wait_for(loop.submit("a", PROMPT, SamplingParams()).get(), 10)
            loop.done()
            with pytest.raises(ValueError, match="LoRA is off"):
                await asyncio.wait_for(loop.change_lora("tuned", "/no/such/adapter"), 10)
            return refused, loop.healthy(), loop.load.queued

    refused, healthy, queued = asyncio.run(main())
    assert isinstance(refused, QueueFullError) and "prompt tokens waiting" in str(refused)
    assert healthy and queued == 0


# ---- what the service asks the engine about its KV pool --------------------------------------------------------------
def test_cache_info_counts_the_pool_and_cache_events_drain_what_changed(tiny_model_dir):
    engine = build(tiny_model_dir, num_blocks=64)
    assert engine.cache_info() == CacheInfo(BLOCK, 64, 64, 0, True)
    assert engine.cache_events() == CacheChanges()

    engine.add_request("a", PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.step()
    running_info = engine.cache_info()
    outs = []
    while engine.has_unfinished():
        outs += engine.step().outputs
    tokens = PROMPT + outs[-1].token_ids  # 13: the KV of the first 12 is complete, three full blocks
    assert running_info.blocks_used == 3 and running_info.blocks_cached == 2
    assert engine.cache_info() == CacheInfo(BLOCK, 64, 64, 3, True)  # cached, and free again: held by nobody
    assert engine.cache_events() == CacheChanges([(True, h) for h in cached_hashes(tokens, 3)])
    assert engine.cache_events() == CacheChanges()  # drained


def test_cache_events_give_a_snapshot_once_the_record_overflowed_and_report_evictions(tiny_model_dir, monkeypatch):
    engine = build(tiny_model_dir, num_blocks=4)  # the next request evicts the first's blocks
    monkeypatch.setattr(prefix_cache, "MAX_EVENTS", 2)  # nobody asked for three changes: the record is dropped
    first = run_directly(engine, PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))
    first_hashes = cached_hashes(PROMPT + first.token_ids, 3)
    assert engine.cache_events() == CacheChanges(snapshot=first_hashes)
    monkeypatch.undo()

    other = [t + 100 for t in PROMPT]
    engine.add_request("other", other, SamplingParams(max_new_tokens=4, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step().outputs
    changes = engine.cache_events()
    assert changes.snapshot is None
    # Its three blocks: the one never cached, then the first's cached ones, least recently freed first (a table is
    # freed tail first, so that the head, which more requests share, goes last).
    assert [h for stored, h in changes.events if not stored] == [first_hashes[2], first_hashes[1]]
    assert [h for stored, h in changes.events if stored] == cached_hashes(other + outs[-1].token_ids, 3)
    assert engine.cache_info().blocks_cached == 4


def test_without_prefix_caching_nothing_is_cached_nor_reported(tiny_model_dir):
    engine = build(tiny_model_dir, num_blocks=64, prefix_caching=False)
    run_directly(engine, PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert engine.cache_info() == CacheInfo(BLOCK, 64, 64, 0, False)
    assert engine.cache_events() == CacheChanges()


def test_the_service_reports_the_pool_and_feeds_watch_cache_from_the_engine(tiny_model_dir):
    """GetStatus's block size and prefix caching, and WatchCache's snapshot, come from the engine's answers; a replica
    without prefix caching refuses WatchCache."""
    from prometheus_client import CollectorRegistry

    from fastgen.proto import fastgen_pb2 as pb
    from fastgen.proto import fastgen_pb2_grpc
    from fastgen.replica.service import ReplicaService
    from fastgen.server.grpc_server import create_server
    from fastgen.server.metrics import ReplicaMetrics
    from fastgen.testing import free_port

    async def serve(prefix_caching: bool):
        service = ReplicaService("r0", "tiny", ReplicaMetrics(CollectorRegistry(), "r0", "tiny"))
        port = free_port()
        server, _ = create_server(service, "127.0.0.1", port)
        await server.start()
        try:
            async with running(lambda: build(tiny_model_dir, 64, prefix_caching)) as loop:
                service.engine_loop = loop
                await drain(loop.submit("a", PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True)))
                loop.done()
                await settle(lambda: len(loop.cache_feed.hashes) == 3 or not prefix_caching, "the feed updated")
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = fastgen_pb2_grpc.GenerationStub(channel)
                    [status] = (await stub.GetStatus(pb.StatusRequest(), timeout=10)).replicas
                    watch = stub.WatchCache(pb.CacheWatchRequest(), timeout=10)
                    try:
                        first = await watch.read()
                    except grpc.aio.AioRpcError as exc:
                        first = exc.code()
                    watch.cancel()
                return status, first, set(loop.cache_feed.hashes)
        finally:
            await server.stop(None)

    status, first, hashes = asyncio.run(serve(prefix_caching=True))
    assert status.kv_block_size == BLOCK and status.prefix_caching and status.kv_blocks_total == 64
    assert first.snapshot and first.reset and set(first.stored) == hashes and len(hashes) == 3

    status, first, hashes = asyncio.run(serve(prefix_caching=False))
    assert status.kv_block_size == BLOCK and not status.prefix_caching
    assert first == grpc.StatusCode.FAILED_PRECONDITION and hashes == set()


def test_one_streams_failed_delivery_keeps_none_from_the_others(caplog):
    """A step's outputs reach their streams in one callback: a stream whose overflow callback raises is logged, and
    the streams after it in the step still get their outputs."""

    def broken() -> None:
        raise RuntimeError("cancel failed")

    async def run():
        bad, good = Outputs("bad", limit=0, on_overflow=broken), Outputs("good", limit=4)
        out = RequestOutput("r", "x", [1], "x", [1], 1, FinishReason.LENGTH, RequestTimings(0.0), 0.0)
        _put_all([(bad, out), (good, out)])
        return await asyncio.wait_for(good.get(), 1)

    with caplog.at_level("ERROR", logger="fastgen.replica"):
        assert asyncio.run(run()).request_id == "r"
    assert "request bad failed" in caplog.text
