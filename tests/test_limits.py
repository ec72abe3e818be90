"""The explicit limits (docs/clients.md, "Limits") and the paths by which an odd input could have been answered
INTERNAL or UNKNOWN: NaN in float fields, oversized lists and prompts, tokenizer and chat-template failures, a failure
inside the engine thread while admitting a request, and request bytes that do not parse."""

import asyncio
import math

import grpc
import pytest

from fastgen.balancer.openai_protocol import ApiError, parse_chat
from fastgen.proto import fastgen_pb2 as pb
from fastgen.replica.prompts import PromptEncoder
from fastgen.replica.request import (
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from fastgen.replica.service import params_from_proto
from fastgen.server.errors import RETRY_AFTER_KEY, add_generation_servicer, retry_after_ms, trailing_metadata

FLOAT_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


# ---- sampling parameters --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinities_are_refused_in_every_float_field(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value}).validate(100)


def test_nan_logit_bias_is_refused():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((5, math.nan),)).validate(100)


@pytest.mark.parametrize(
    "field, at_limit, over",
    [
        ("stop", ("x",) * MAX_STOP_STRINGS, ("x",) * (MAX_STOP_STRINGS + 1)),
        ("stop", ("x" * MAX_STOP_CHARS,), ("x" * (MAX_STOP_CHARS + 1),)),
        ("stop_token_ids", (1,) * MAX_STOP_TOKEN_IDS, (1,) * (MAX_STOP_TOKEN_IDS + 1)),
        (
            "logit_bias",
            tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS)),
            tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1)),
        ),
        ("cache_salt", "s" * MAX_CACHE_SALT_CHARS, "s" * (MAX_CACHE_SALT_CHARS + 1)),
    ],
)
def test_list_and_string_limits(field, at_limit, over):
    SamplingParams(**{field: at_limit}).validate(50_000)
    with pytest.raises(ValueError, match=f"{field}.*at most"):
        SamplingParams(**{field: over}).validate(50_000)


def test_seed_past_int63_is_refused():
    for seed in (2**63, 2**64 - 1):
        with pytest.raises(ValueError, match="seed"):
            params_from_proto(pb.SamplingParams(seed=seed)).validate(100)


def test_oversized_lists_are_refused_before_they_are_copied():
    with pytest.raises(ValueError, match="logit_bias may have at most"):
        params_from_proto(pb.SamplingParams(logit_bias=dict.fromkeys(range(100_000), 1.0)))
    with pytest.raises(ValueError, match="stop may have at most"):
        params_from_proto(pb.SamplingParams(stop=["a"] * 100))


# ---- prompts --------------------------------------------------------------------------------------------------------
class FakeTokenizer:
    """Four-byte tokens at most; `fail` makes encoding or the chat template raise it."""

    chat_template = "{{ messages }}"

    def __init__(self, fail: BaseException | None = None):
        self.fail = fail

    def get_vocab(self):
        return {"a": 0, "abcd": 1, "<|x|>": 2}  # "<|x|>" is the longest: 5 bytes

    def encode(self, text, add_special_tokens=True):
        if self.fail:
            raise self.fail
        return [0] * len(text)

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        if self.fail:
            raise self.fail
        return "".join(m["content"] for m in messages)


def test_prompts_that_cannot_fit_the_context_are_refused_without_tokenizing():
    enc = PromptEncoder(FakeTokenizer(RuntimeError("must not be called")), vocab_size=3)
    assert enc.max_token_bytes == 5
    enc.check_size("x" * 50, max_tokens=10)  # 50 bytes: 10 tokens of 5 bytes might hold it
    enc.check_size([1] * 10, max_tokens=10)
    with pytest.raises(ValueError, match="prompt text is longer"):
        enc.check_size("x" * 51, max_tokens=10)
    with pytest.raises(ValueError, match="prompt text is longer"):
        enc.check_size("é" * 26, max_tokens=10)  # 26 characters, 52 bytes
    with pytest.raises(ValueError, match="11 tokens"):
        enc.check_size([1] * 11, max_tokens=10)
    with pytest.raises(ValueError, match="11 chat messages"):
        enc.check_size([{"role": "user", "content": ""}] * 11, max_tokens=10)
    with pytest.raises(ValueError, match="prompt text is longer"):
        enc.check_size([{"role": "user", "content": "x" * 30}] * 2, max_tokens=10)


@pytest.mark.parametrize("error", [RuntimeError("boom"), TypeError("odd"), KeyError("k")])
def test_tokenizer_and_template_failures_are_value_errors(error):
    enc = PromptEncoder(FakeTokenizer(error), vocab_size=3)
    with pytest.raises(ValueError, match="could not tokenize"):
        enc.encode("hello")
    with pytest.raises(ValueError, match="chat template"):
        enc.encode([{"role": "user", "content": "hi"}])


def test_a_template_that_raises_is_a_value_error(tiny_model_dir):
    from jinja2.exceptions import TemplateError
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate") as refused:
        PromptEncoder(tokenizer, 49152).encode([{"role": "user", "content": "hi"}])
    assert isinstance(refused.value.__cause__, TemplateError)


# ---- the engine thread survives a failure while admitting a request ----------------------------------------------
class BrokenEngine:
    """Admits requests whose prompt is 'ok'; raises RuntimeError (an engine bug) for any other."""

    max_model_len = 64

    def __init__(self):
        self.prompts = PromptEncoder(FakeTokenizer(), 3)
        self.admitted = []

    def load(self):
        from fastgen.replica.outputs import EngineLoad

        return EngineLoad()

    def has_unfinished(self):
        return False

    def add_request(self, request_id, prompt, params):
        if prompt != "ok":
            raise RuntimeError("engine bug")
        self.admitted.append(request_id)

    def abort(self, request_id):
        return []


def test_engine_thread_survives_an_unexpected_error_while_admitting():
    from prometheus_client import CollectorRegistry

    from fastgen.replica.engine_loop import EngineLoop, QueueLimits
    from fastgen.server.metrics import ReplicaMetrics

    async def run():
        engine = BrokenEngine()
        loop = EngineLoop(
            lambda: engine, ReplicaMetrics(CollectorRegistry(), "r0", "fake"), QueueLimits(), asyncio.get_running_loop()
        )
        await loop.start()
        try:
            failed = await asyncio.wait_for(loop.submit("bad", "boom", SamplingParams()).get(), 10)
            loop.submit("good", "ok", SamplingParams())
            await asyncio.sleep(0.5)
            return failed, engine.admitted, loop._thread.is_alive()
        finally:
            loop.stop()

    failed, admitted, alive = asyncio.run(run())
    assert isinstance(failed, RuntimeError) and admitted == ["good"] and alive


# ---- the wire -------------------------------------------------------------------------------------------------------
class EchoServicer:
    async def Generate(self, request, context):
        return pb.GenerateResponse(text=request.text)

    async def GenerateStream(self, request, context):
        for ch in request.text:
            yield pb.GenerateChunk(text=ch)

    async def GetStatus(self, request, context):
        return pb.StatusResponse(role="echo")


async def _answer(call, streamed: bool):
    try:
        return grpc.StatusCode.OK, [r async for r in call] if streamed else await call
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()


def test_request_bytes_that_do_not_parse_are_invalid_argument():
    async def run():
        server = grpc.aio.server()
        add_generation_servicer(EchoServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        answers = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                unary = channel.unary_unary("/fastgen.v1.Generation/Generate")
                stream = channel.unary_stream("/fastgen.v1.Generation/GenerateStream")
                for payload in (b"\x12\x03a\xffb", b"\xff\xff\xff", pb.GenerateRequest(text="ok").SerializeToString()):
                    answers.append(await _answer(unary(payload), False))
                    answers.append(await _answer(stream(payload), True))
        finally:
            await server.stop(None)
        return answers

    answers = asyncio.run(run())
    assert [code for code, _ in answers[:4]] == [grpc.StatusCode.INVALID_ARGUMENT] * 4
    assert "UTF-8" in answers[0][1]
    assert pb.GenerateResponse.FromString(answers[4][1]).text == "ok"
    assert [pb.GenerateChunk.FromString(c).text for c in answers[5][1]] == ["o", "k"]


def test_resource_exhausted_carries_a_retry_hint():
    metadata = trailing_metadata(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert metadata[0][0] == RETRY_AFTER_KEY and retry_after_ms(metadata) > 0
    assert trailing_metadata(grpc.StatusCode.INVALID_ARGUMENT) == () and retry_after_ms(()) is None


# ---- the HTTP API ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [
        ("stop", ["x"] * (MAX_STOP_STRINGS + 1)),
        ("stop", "x" * (MAX_STOP_CHARS + 1)),
        ("logit_bias", {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}),
        ("stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1)),
    ],
)
def test_http_limits_are_400s_naming_the_field(field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(ApiError) as refused:
        parse_chat(body, "id")
    assert refused.value.status == 400 and refused.value.param == field


def test_http_limits_are_the_replicas():
    from fastgen.balancer import openai_protocol
    from fastgen.replica import request

    for name in (
        "MAX_N",
        "MAX_TOP_LOGPROBS",
        "MAX_STOP_STRINGS",
        "MAX_STOP_CHARS",
        "MAX_STOP_TOKEN_IDS",
        "MAX_LOGIT_BIAS",
    ):
        assert getattr(openai_protocol, name) == getattr(request, name), name


def test_http_errors_do_not_echo_a_huge_value():
    with pytest.raises(ApiError) as refused:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "temperature": "x" * 100_000}, "id")
    assert len(refused.value.message) < 1000


@pytest.mark.parametrize(
    "field, value",
    [("max_tokens", 2**64), ("top_k", 2**40), ("min_tokens", 2**33), ("temperature", 10**400), ("top_p", math.inf)],
)
def test_http_numbers_past_what_the_wire_carries_are_400s(field, value):
    # These were ValueError or OverflowError while building the message: a 500.
    with pytest.raises(ApiError) as refused:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], field: value}, "id")
    assert refused.value.status == 400 and refused.value.param == field
