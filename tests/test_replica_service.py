"""One replica process on its own: cancellation frees KV blocks at once, a full queue answers
RESOURCE_EXHAUSTED, and neither disturbs the other requests."""

import threading

import grpc
import pytest

from fastgen.server import Client, GenerationError
from fastgen.testing import wait_until

from .helpers import in_process_replica, start_replica, wait_serving

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


@pytest.mark.slow
def test_a_model_that_will_not_load_exits_2_saying_why_with_its_server_stopped(tmp_path):
    """The gRPC server binds before the model loads; a load that fails stops it while the event loop still runs, so
    the process ends on the error alone (before, grpc's Server.__del__ printed a traceback once the loop had closed)."""
    proc = start_replica(tmp_path / "no-such-model", "unloadable", tmp_path)
    try:
        assert proc.popen.wait(120) == 2
        log = proc.log_path.read_text()
        assert "fastgen.replica: model" in log and "not found" in log
        assert "Traceback" not in log and "never awaited" not in log
    finally:
        proc.kill()


def test_engine_loop_builds_and_steps_the_engine_on_one_thread(tiny_model_dir):
    """The engine is built, warmed and stepped on the engine loop's own thread (one OpenMP pool: see EngineLoop), a
    request submitted from asyncio is served there, and a model that fails to build fails start() with its error."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from fastgen.replica.builder import build_engine
    from fastgen.replica.config import CacheConfig, EngineConfig
    from fastgen.replica.engine_loop import EngineLoop, QueueLimits
    from fastgen.replica.parallel import TPGroup
    from fastgen.replica.request import SamplingParams
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


# ---- the OpenAI API's options through the service, in process ---------------------------------------------------
def test_params_from_proto_maps_zeros_to_defaults():
    from fastgen.proto import fastgen_pb2 as pb
    from fastgen.replica.request import SamplingParams
    from fastgen.replica.service import params_from_proto

    assert params_from_proto(pb.SamplingParams()) == SamplingParams()
    p = params_from_proto(
        pb.SamplingParams(
            presence_penalty=0.5,
            frequency_penalty=-1.0,
            repetition_penalty=1.25,
            min_p=0.25,
            logit_bias={9: -5.0, 3: 2.5},
            stop_token_ids=[7, 8],
            n=3,
            logprobs=True,
            top_logprobs=4,
            include_stop_str_in_output=True,
            keep_special_tokens=True,
            echo=True,
        )
    )
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0.5, -1.0, 1.25, 0.25)
    assert p.logit_bias == ((3, 2.5), (9, -5.0)) and p.stop_token_ids == (7, 8) and p.n == 3 and p.logprobs == 4
    assert p.include_stop_str_in_output and p.keep_special_tokens and p.echo
    assert params_from_proto(pb.SamplingParams(logprobs=True)).logprobs == 0
    with pytest.raises(ValueError, match="needs logprobs"):
        params_from_proto(pb.SamplingParams(top_logprobs=2))


def test_n_completions_logprobs_and_echo_through_the_service(tiny_model_dir):
    """Generate and GenerateStream for n completions with logprobs and echo, through a real gRPC server and the
    async client; resumed from where another replica left them; bad values are INVALID_ARGUMENT; a cancelled n > 1
    stream frees every block."""
    import asyncio

    from fastgen.replica.builder import build_engine
    from fastgen.replica.config import CacheConfig, EngineConfig
    from fastgen.replica.engine import completion_seed
    from fastgen.server import AsyncClient

    prompt = "Once upon a time"
    params = dict(max_new_tokens=6, temperature=1.0, seed=17, n=3, logprobs=True, top_logprobs=2, echo=True)

    def build():
        config = EngineConfig(
            model=str(tiny_model_dir), dtype="float32", cache=CacheConfig(block_size=4, num_blocks=128)
        )
        return build_engine(config)

    async def check_generate(client):
        result = await client.generate(prompt, **params)
        assert [c.index for c in result.choices] == [0, 1, 2]
        first = result.choices[0]
        assert (result.text, result.token_ids, result.finish_reason) == (first.text, first.token_ids, "length")
        assert result.logprobs == first.logprobs and result.prompt_text == prompt
        for c in result.choices:
            assert [lp.token_id for lp in c.logprobs] == c.token_ids and c.generated_tokens == 6
            assert all(len(lp.top) == 2 and lp.token for lp in c.logprobs)
            one = await client.generate(prompt, **{**params, "n": 1, "seed": completion_seed(17, c.index)})
            assert (one.token_ids, one.text, one.choices) == (c.token_ids, c.text, [])
        return result

    async def check_stream(client, result):
        chunks = [c async for c in client.stream_chunks(prompt, **params)]
        assert chunks[0].prompt_text == prompt and all(c.prompt_text == "" for c in chunks[1:])
        for choice in result.choices:
            mine = [c for c in chunks if c.index == choice.index]
            assert "".join(c.text for c in mine) == choice.text
            assert [t for c in mine for t in c.token_ids] == choice.token_ids
            assert [lp for c in mine for lp in c.logprobs] == choice.logprobs
            assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + ["length"]
            assert mine[-1].generated_tokens == 6

    async def check_refusals(client):
        from fastgen.server import GenerationError

        for kwargs, message in [
            (dict(presence_penalty=5.0), "presence_penalty"),
            (dict(logit_bias={49152: 1.0}), "logit_bias"),
            (dict(top_logprobs=2), "needs logprobs"),
            (dict(n=500), "n must be"),
        ]:
            with pytest.raises(GenerationError) as err:
                await client.generate("hi", **kwargs)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details

    async def check_cancel(client, loop):
        stream = client.stream_chunks(prompt, n=3, max_new_tokens=300, ignore_eos=True, temperature=1.0)
        seen = set()
        async for chunk in stream:
            seen.add(chunk.index)
            if len(seen) == 3:
                break
        await settle(lambda: loop.load.kv_blocks_used > 0)  # the load is published after the step's outputs
        await stream.aclose()
        await settle(lambda: loop.load.kv_blocks_used == 0 and loop.in_flight == 0)
        assert loop._streams == {}

    async def check_resume(port, result):
        """A resumed request for 3 completions: the first cut after 2 tokens, the second finished, the third before
        its first token. Only the unfinished two stream, each to its end as it ran uncut; bad resumes are refused."""
        from fastgen.proto import fastgen_pb2 as pb
        from fastgen.proto import fastgen_pb2_grpc

        first, second, third = result.choices
        wire = pb.SamplingParams(max_new_tokens=6, temperature=1.0, seed=17, n=3, logprobs=True, top_logprobs=2)
        resume = pb.Resume(
            completions=[
                pb.ResumedCompletion(token_ids=first.token_ids[:2]),  # none of its text delivered yet
                pb.ResumedCompletion(token_ids=second.token_ids, text_chars=len(second.text), finished=True),
                pb.ResumedCompletion(),
            ]
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = fastgen_pb2_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(request_id="resumed", text=prompt, params=wire, resume=resume)
            chunks = [c async for c in stub.GenerateStream(request)]
            assert {c.index for c in chunks} == {0, 2}
            for choice, skip in ((first, 2), (third, 0)):
                mine = [c for c in chunks if c.index == choice.index]
                assert [t for c in mine for t in c.token_ids] == choice.token_ids[skip:]
                assert "".join(c.text for c in mine) == choice.text
                assert [lp.token_id for c in mine for lp in c.logprobs] == choice.token_ids[skip:]
                assert mine[-1].finish_reason == pb.FINISH_REASON_LENGTH and mine[-1].generated_tokens == 6
            both = pb.Resume(token_ids=[5], completions=[pb.ResumedCompletion()] * 3)
            done = pb.Resume(completions=[pb.ResumedCompletion(token_ids=[5], finished=True)] * 3)
            for call, bad, message in [
                (stub.Generate, resume, "streamed only"),
                (stub.GenerateStream, both, "send one of them"),
                (stub.GenerateStream, done, "nothing is left to resume"),
            ]:
                request = pb.GenerateRequest(text=prompt, params=wire, resume=bad)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    answer = call(request)
                    await (answer if call is stub.Generate else answer.read())
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()

    async def settle(condition):
        for _ in range(200):
            if condition():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("not reached in 10 s")

    async def main():
        async with in_process_replica(build) as (port, loop):
            async with AsyncClient(f"127.0.0.1:{port}", timeout=60) as client:
                result = await check_generate(client)
                await check_stream(client, result)
                await check_resume(port, result)
                await check_refusals(client)
                await check_cancel(client, loop)

    asyncio.run(main())
