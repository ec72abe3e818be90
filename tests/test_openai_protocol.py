"""The OpenAI protocol of the HTTP API as pure functions: bodies parsed into GenerateRequests, validation naming the
field, replies and stream chunks in OpenAI's shapes, gRPC failures as HTTP errors."""

from __future__ import annotations

import json
import math

import grpc
import pytest

from fastgen.balancer import openai_protocol as op
from fastgen.proto import fastgen_pb2 as pb

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
META = op.Meta("cmpl-1", 1700000000, "m")


def chat(**fields) -> op.ApiRequest:
    return op.parse_chat({**CHAT, **fields}, "chatcmpl-1")


def completion(**fields) -> op.ApiRequest:
    return op.parse_completion({"model": "m", "prompt": "hi", **fields}, "cmpl-1")


def params(api: op.ApiRequest) -> pb.SamplingParams:
    return api.prompts[0].params


def error_of(parse, **fields) -> op.ApiError:
    with pytest.raises(op.ApiError) as e:
        parse(**fields)
    assert e.value.status == 400
    return e.value


# ---- parsing ------------------------------------------------------------------------------------------------------
def test_defaults_are_openais():
    api = chat()
    p = params(api)
    assert (api.kind, api.n, api.stream, api.include_usage, api.logprobs) == (op.CHAT, 1, False, False, False)
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.max_new_tokens == 0  # 0: the server's default
    assert not p.HasField("seed") and not p.keep_special_tokens and p.repetition_penalty == 1.0
    request = api.prompts[0]
    assert request.request_id == "chatcmpl-1"
    assert [(m.role, m.content) for m in request.messages.messages] == [("user", "hi")]


def test_every_sampling_field_reaches_the_proto():
    api = chat(
        max_tokens=5,
        temperature=0,
        top_p=0.5,
        n=3,
        stop="\n",
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-1,
        logprobs=True,
        top_logprobs=4,
        logit_bias={"11": -100, "12": 2.5},
        user="someone",
        top_k=-1,
        min_p=0.1,
        repetition_penalty=1.2,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[2, 3],
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        some_future_field={"ignored": True},
    )
    p = params(api)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.n, list(p.stop), p.seed) == (5, 0, 0.5, 3, ["\n"], 7)
    assert (p.presence_penalty, p.frequency_penalty, p.top_k, p.min_new_tokens, p.ignore_eos) == (0.5, -1, 0, 2, True)
    assert p.min_p == pytest.approx(0.1) and p.repetition_penalty == pytest.approx(1.2)
    assert (p.logprobs, p.top_logprobs, dict(p.logit_bias)) == (True, 4, {11: -100.0, 12: 2.5})
    assert (list(p.stop_token_ids), p.keep_special_tokens, p.include_stop_str_in_output) == ([2, 3], True, True)
    assert (api.n, api.logprobs, api.top_logprobs) == (3, True, 4)


def test_max_completion_tokens_wins_over_max_tokens():
    assert params(chat(max_tokens=5, max_completion_tokens=9)).max_new_tokens == 9
    assert params(completion(max_tokens=16.0)).max_new_tokens == 16  # an integral float is an integer


@pytest.mark.parametrize(
    "fields, param",
    [
        (dict(temperature="hot"), "temperature"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=0), "n"),
        (dict(n=True), "n"),
        (dict(n=1.5), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_completion_tokens=-1), "max_completion_tokens"),
        (dict(stop=["ok", 3]), "stop"),
        (dict(stop=""), "stop"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**63), "seed"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(min_p=2), "min_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(logit_bias={"5": 101}), "logit_bias"),
        (dict(logit_bias=[1]), "logit_bias"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(skip_special_tokens=1), "skip_special_tokens"),
        (dict(logprobs=1), "logprobs"),
        (dict(top_logprobs=21, logprobs=True), "top_logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),  # without logprobs
        (dict(stream="yes"), "stream"),
        (dict(stream_options={"include_usage": True}), "stream_options"),  # without stream
        (dict(stream=True, stream_options={"include_usage": "y"}), "stream_options"),
        (dict(model=3), "model"),
        (dict(messages=[]), "messages"),
        (dict(messages="hi"), "messages"),
        (dict(messages=[{"content": "no role"}]), "messages[0].role"),
        (dict(messages=[{"role": "user", "content": None}]), "messages[0].content"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), "messages[0].content"),
        (dict(tools=[{"type": "function", "function": {}}]), "tools[0]"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(response_format={"type": "xml"}), "response_format"),
        (dict(response_format={"type": "json_schema"}), "response_format"),
        (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
        (dict(guided_choice=[]), "guided_choice"),
        (dict(guided_regex="a", response_format={"type": "json_object"}), "guided_regex"),
    ],
)
def test_wrong_chat_fields_are_400s_naming_the_field(fields, param):
    e = error_of(chat, **fields)
    assert e.param == param and param.split("[")[0] in e.message
    assert e.body() == {"error": {"message": e.message, "type": "invalid_request_error", "param": param, "code": None}}


@pytest.mark.parametrize(
    "fields, param",
    [
        (dict(prompt=[]), "prompt"),
        (dict(prompt=[[]]), "prompt"),
        (dict(prompt=["a", 1]), "prompt"),
        (dict(prompt=[1, -2]), "prompt"),
        (dict(prompt=None), "prompt"),
        (dict(logprobs=True), "logprobs"),
        (dict(logprobs=21), "logprobs"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(suffix="!"), "suffix"),
        (dict(best_of=3), "best_of"),
    ],
)
def test_wrong_completion_fields_are_400s_naming_the_field(fields, param):
    assert error_of(completion, **fields).param == param


def test_echo_with_logprobs_asks_for_prompt_logprobs():
    assert params(completion(echo=True, logprobs=2)).prompt_logprobs == 2
    assert not params(completion(logprobs=2)).HasField("prompt_logprobs")
    api = completion(echo=True, logprobs=0, max_tokens=0)
    assert api.prompt_only and params(api).max_new_tokens == 1
    prompt = [pb.TokenLogprob(token_id=9, token=" b", logprob=-1.5), pb.TokenLogprob(token_id=8, token="c", logprob=-2)]
    generated = pb.TokenLogprob(token_id=7, token="!", logprob=-0.5)
    r = pb.GenerateResponse(text="!", prompt_text="a bc", prompt_logprobs=prompt, logprobs=[generated])
    (choice,) = op.completion_response(META, api, [r])["choices"]
    assert choice["text"] == "a bc" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["a", " b", "c"] and choice["logprobs"]["text_offset"] == [0, 1, 3]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.5, -2.0]
    (choice,) = op.completion_response(META, completion(echo=True, logprobs=0), [r])["choices"]
    assert choice["text"] == "a bc!" and choice["logprobs"]["token_logprobs"] == [None, -1.5, -2.0, -0.5]
    (choice,) = op.completion_response(META, completion(prompt_logprobs=0), [r])["choices"]
    assert choice["prompt_logprobs"] == [
        None,
        {"9": {"logprob": -1.5, "decoded_token": " b"}},
        {"8": {"logprob": -2.0, "decoded_token": "c"}},
    ]


def test_the_body_must_be_an_object():
    with pytest.raises(op.ApiError) as e:
        op.parse_chat([1], "x")
    assert e.value.status == 400 and "JSON object" in e.value.message


@pytest.mark.parametrize(
    "prompt, expected",
    [("hello", ["hello"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1, 2], [3]], [[1, 2], [3]])],
)
def test_completion_prompts_in_every_form(prompt, expected):
    api = completion(prompt=prompt)
    got = [r.text if r.WhichOneof("prompt") == "text" else list(r.token_ids.ids) for r in api.prompts]
    assert got == expected
    ids = [r.request_id for r in api.prompts]
    assert ids == (["cmpl-1"] if len(expected) == 1 else [f"cmpl-1-{i}" for i in range(len(expected))])


def test_completion_logprobs_and_echo():
    api = completion(logprobs=3)
    assert (api.logprobs, api.top_logprobs, params(api).logprobs, params(api).top_logprobs) == (True, 3, True, 3)
    api = completion(logprobs=0)
    assert (params(api).logprobs, params(api).top_logprobs) == (True, 0)
    api = completion(echo=True)
    assert api.echo and params(api).echo and not params(api).logprobs


def test_chat_content_parts_are_joined_and_assistant_content_may_be_null():
    api = chat(
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "be brief"}, {"type": "text", "text": "ok"}]},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "hi", "name": "ignored"},
        ]
    )
    assert [m.content for m in api.prompts[0].messages.messages] == ["be brief\nok", "", "hi"]


def test_stream_options():
    api = chat(stream=True, stream_options={"include_usage": True})
    assert (api.stream, api.include_usage) == (True, True)
    assert chat(stream=True, stream_options={}).include_usage is False
    assert op.requested_model({"prompt": "x"}) is None


# ---- replies ------------------------------------------------------------------------------------------------------
def token(tid: int, text: str, lp: float, *top: tuple[int, str, float]) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=tid, token=text, logprob=lp, top=[pb.TopLogprob(token_id=i, token=t, logprob=v) for i, t, v in top]
    )


def test_chat_reply_with_n_choices_logprobs_and_usage():
    api = chat(n=2, logprobs=True, top_logprobs=1)
    choices = [
        pb.Choice(
            index=0,
            text="Hé",
            finish_reason=pb.FINISH_REASON_EOS,
            generated_tokens=1,
            logprobs=[token(5, "Hé", -0.5, (5, "Hé", -0.5))],
        ),
        pb.Choice(index=1, text="Yo", finish_reason=pb.FINISH_REASON_LENGTH, generated_tokens=3),
    ]
    response = pb.GenerateResponse(text="Hé", prompt_tokens=7, generated_tokens=1, choices=choices)
    reply = op.chat_response(META, api, [response])
    assert (reply["id"], reply["object"], reply["created"], reply["model"]) == (
        "cmpl-1",
        "chat.completion",
        1700000000,
        "m",
    )
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert [c["finish_reason"] for c in reply["choices"]] == ["stop", "length"]
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "Hé"}
    assert reply["choices"][0]["logprobs"] == {
        "content": [
            {
                "token": "Hé",
                "logprob": -0.5,
                "bytes": [72, 195, 169],
                "top_logprobs": [{"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169]}],
            }
        ]
    }
    assert reply["choices"][1]["logprobs"] == {"content": []}
    assert reply["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 4,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_completion_reply_with_logprobs_echo_and_several_prompts():
    api = completion(prompt=["a", "b"], logprobs=1)
    lps = [token(1, " x", -0.25, (2, " y", -0.1)), token(3, "z", -float("inf"))]
    first = pb.GenerateResponse(
        text=" xz", prompt_tokens=2, generated_tokens=2, finish_reason=pb.FINISH_REASON_STOP, logprobs=lps
    )
    second = pb.GenerateResponse(
        text="", prompt_tokens=3, cached_prompt_tokens=2, generated_tokens=0, finish_reason=pb.FINISH_REASON_LENGTH
    )
    reply = op.completion_response(META, api, [first, second])
    assert reply["object"] == "text_completion" and [c["index"] for c in reply["choices"]] == [0, 1]
    assert reply["choices"][0]["logprobs"] == {
        "tokens": [" x", "z"],
        "token_logprobs": [-0.25, op.MIN_LOGPROB],  # JSON has no -Infinity
        "top_logprobs": [{" y": pytest.approx(-0.1), " x": -0.25}, {"z": op.MIN_LOGPROB}],
        "text_offset": [0, 2],
    }
    assert reply["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 2},  # the prompts' sum
    }
    json.dumps(reply, allow_nan=False)
    echoed = op.completion_response(META, completion(echo=True), [pb.GenerateResponse(text=" there", prompt_text="Hi")])
    assert echoed["choices"][0]["text"] == "Hi there" and echoed["choices"][0]["logprobs"] is None


def test_finish_reasons():
    assert [op.finish_reason(r) for r in (0, 1, 2, 3, 4)] == [None, "length", "stop", "stop", "abort"]


def test_model_list():
    assert op.model_list(["a"], 5) == {
        "object": "list",
        "data": [{"id": "a", "object": "model", "created": 5, "owned_by": "fastgen", "root": "a"}],
    }


# ---- streams ------------------------------------------------------------------------------------------------------
def chunk(index=0, text="", finish=0, **kw) -> pb.GenerateChunk:
    return pb.GenerateChunk(index=index, text=text, finish_reason=finish, **kw)


def test_chat_stream_with_two_interleaved_choices_and_usage():
    api = chat(n=2, stream=True, stream_options={"include_usage": True})
    s = op.STREAMS[op.CHAT](META, api)
    events = s.events(0, chunk(1, "B"))
    events += s.events(0, chunk(0, "A"))
    ends = dict(prompt_tokens=4, cached_prompt_tokens=3)  # each choice's last chunk repeats its prompt's counts
    events += s.events(0, chunk(0, "", pb.FINISH_REASON_EOS, generated_tokens=2, **ends))
    events += s.events(0, chunk(1, "!", pb.FINISH_REASON_LENGTH, generated_tokens=3, **ends))
    events += s.events(0, chunk(1))  # nothing new: no event
    assert {(e["id"], e["created"], e["model"], e["object"]) for e in events} == {
        ("cmpl-1", 1700000000, "m", "chat.completion.chunk")
    }
    got = [(e["choices"][0]["index"], e["choices"][0]["delta"], e["choices"][0]["finish_reason"]) for e in events]
    assert got == [
        (0, {"role": "assistant", "content": ""}, None),
        (1, {"role": "assistant", "content": ""}, None),
        (1, {"content": "B"}, None),
        (0, {"content": "A"}, None),
        (0, {}, "stop"),
        (1, {"content": "!"}, "length"),
    ]
    assert all(e["usage"] is None for e in events)
    assert s.usage_event() == {
        "id": "cmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "m",
        "choices": [],
        "usage": {
            "prompt_tokens": 4,
            "completion_tokens": 5,
            "total_tokens": 9,
            "prompt_tokens_details": {"cached_tokens": 3},
        },
    }


def test_chat_stream_logprobs_ride_on_their_chunk():
    s = op.STREAMS[op.CHAT](META, chat(stream=True, logprobs=True))
    events = s.events(0, chunk(0, "", logprobs=[token(9, "\ufffd", -1.0)]))  # a token whose text is held back
    assert events[-1]["choices"][0]["delta"] == {"content": ""}
    assert events[-1]["choices"][0]["logprobs"]["content"][0]["token"] == "\ufffd"
    assert "usage" not in events[-1]


def test_chat_prompt_logprobs_as_vllm_returns_them():
    """vLLM's extra field on chat: the rendered conversation's tokens scored, at the reply's top level (null for the
    first token), and on a stream's first chunk; absent unless asked for."""
    assert not params(chat()).HasField("prompt_logprobs") and "prompt_logprobs" not in op.chat_response(
        META, chat(), [pb.GenerateResponse(text="!")]
    )
    api = chat(prompt_logprobs=1)
    assert params(api).prompt_logprobs == 1 and api.prompt_logprobs
    assert error_of(chat, prompt_logprobs=-1).param == "prompt_logprobs"
    scored = [token(9, " b", -1.5)]
    reply = op.chat_response(META, api, [pb.GenerateResponse(text="!", prompt_logprobs=scored)])
    assert reply["prompt_logprobs"] == [None, {"9": {"logprob": -1.5, "decoded_token": " b"}}]
    s = op.STREAMS[op.CHAT](META, chat(prompt_logprobs=0, stream=True, n=2))
    first = s.events(0, chunk(1, "A", prompt_logprobs=scored))
    assert first[0]["prompt_logprobs"] == reply["prompt_logprobs"]
    assert all("prompt_logprobs" not in e for e in first[1:] + s.events(0, chunk(0, "B")))


def test_completion_stream_echo_offsets_and_several_prompts():
    api = completion(prompt=["a", "b"], n=2, stream=True, echo=True)
    s = op.STREAMS[op.COMPLETION](META, api)
    e = s.events(1, chunk(0, " x", prompt_text="PROMPT"))
    e += s.events(1, chunk(1, " y"))  # its first chunk: the prompt echoed too
    e += s.events(1, chunk(0, " z", pb.FINISH_REASON_STOP, prompt_tokens=1, generated_tokens=2))
    assert [(x["choices"][0]["index"], x["choices"][0]["text"]) for x in e] == [
        (2, "PROMPT x"),
        (3, "PROMPT y"),
        (2, " z"),
    ]
    assert e[-1]["choices"][0]["finish_reason"] == "stop" and e[0]["object"] == "text_completion"

    s = op.STREAMS[op.COMPLETION](META, completion(stream=True, logprobs=0))
    e = s.events(0, chunk(0, "ab", logprobs=[token(1, "a", -1.0), token(2, "b", -2.0)]))
    e += s.events(0, chunk(0, "c", logprobs=[token(3, "c", -3.0)]))
    assert [x["choices"][0]["logprobs"]["text_offset"] for x in e] == [[0, 1], [2]]


# ---- errors and framing ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "code, status",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.CANCELLED, 500),
    ],
)
def test_grpc_codes_map_to_http_statuses(code, status):
    e = op.error_from_failure(code, "why")
    assert (e.status, e.message, e.code) == (status, "why", code.name.lower())
    assert e.headers == ({"Retry-After": "1"} if status == 429 else {})
    assert op.error_from_failure(code, "why", 2001).headers == ({"Retry-After": "3"} if status == 429 else {})
    assert e.body()["error"]["type"] == {400: "invalid_request_error", 429: "rate_limit_error"}.get(
        status, "server_error"
    )


def test_unknown_model_is_a_404_naming_the_served_ones():
    e = op.unknown_model("gpt-4", ["tiny", "alias"])
    assert (e.status, e.code, e.param) == (404, "model_not_found", "model")
    assert "`gpt-4`" in e.message and "`tiny`, `alias`" in e.message


def test_sse_frames_compact_utf8_json():
    assert op.sse({"a": "é", "b": [1]}) == 'data: {"a":"é","b":[1]}\n\n'.encode()
    assert op.DONE == b"data: [DONE]\n\n"
    assert math.isfinite(op._logprob(float("nan")))
