"""Structured output in the engine (replica/constraints.py): a grammar mask per sequence in the batched sampler. A
random tiny model's output is valid under its constraint whatever it would say; constrained rows keep the sampler's
guarantees (seeded replay, n > 1, preemption, resume), and unconstrained rows beside them are untouched."""

import json
import re

import pytest
import torch

from fastgen.replica import pipeline
from fastgen.replica.request import Constraint, FinishReason, Resume, SamplingParams
from fastgen.replica.sampler import SamplingRow, sample, unpack_bitmask

SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["colour", "ok"],
    "additionalProperties": False,
}
JSON = Constraint("json_schema", json.dumps(SCHEMA))


def drain(engine, ids):
    outs = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.finished:
                outs[(out.request_id, out.index)] = out
    return outs


def valid(text: str) -> bool:
    value = json.loads(text)
    return (
        value.keys() == {"colour", "ok"}
        and value["colour"] in ("red", "green", "blue")
        and isinstance(value["ok"], bool)
    )


@pytest.fixture(scope="module")
def pipe(tiny_model_dir):
    return pipeline(str(tiny_model_dir), dtype="float32", max_batch_tokens=64, progress=False)


def test_unpack_bitmask_layout():
    bits = torch.tensor([[0b101, -(2**31)]], dtype=torch.int32)  # tokens 0, 2 and 63
    assert unpack_bitmask(bits, 64)[0].nonzero().flatten().tolist() == [0, 2, 63]


def test_mask_comes_before_top_k():
    """top_k=1 among the allowed tokens, not among all: the mask is applied first (vLLM's order)."""
    from fastgen.kernels import TORCH_KERNELS

    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    allowed = torch.tensor([0b1100], dtype=torch.int32)  # tokens 2 and 3
    for temperature in (0.0, 1.0):
        row = SamplingRow(temperature, 1.0, 1, seed=7, position=0, banned=[], allowed=allowed)
        assert sample(logits.clone(), [row], TORCH_KERNELS.argmax).tokens == [2]


@pytest.mark.slow
@pytest.mark.parametrize(
    "constraint, check",
    [
        (JSON, valid),
        (Constraint("json_object"), lambda t: isinstance(json.loads(t), dict)),
        (Constraint("regex", "[ab]{3}-[0-9]"), lambda t: re.fullmatch("[ab]{3}-[0-9]", t) is not None),
        (Constraint("choice", ("yes", "no", "maybe so")), lambda t: t in ("yes", "no", "maybe so")),
        (Constraint("grammar", 'root ::= "x" ("y" | "z")'), lambda t: t in ("xy", "xz")),
    ],
)
def test_constrained_output_is_valid(pipe, constraint, check):
    max_new = 60 if constraint.kind != "json_object" else 30
    for temperature in (0.0, 1.0):
        (out,) = pipe(["Answer:"], max_new_tokens=max_new, temperature=temperature, seed=3, constraint=constraint)
        if constraint.kind == "json_object" and out.finish_reason == FinishReason.LENGTH:
            assert out.text.startswith("{")  # a random model may keep an object open to the end
            continue
        assert out.finish_reason == FinishReason.EOS, out
        assert check(out.text), out.text


@pytest.mark.slow
def test_seeded_n_and_preemption_replay(tiny_model_dir):
    """n = 4 seeded completions: each valid, the same on a second run, and the same when a tiny KV pool preempts."""
    params = SamplingParams(max_new_tokens=60, temperature=1.0, seed=11, n=4, constraint=JSON)
    runs = []
    for num_blocks in (None, 12):
        p = pipeline(str(tiny_model_dir), dtype="float32", max_batch_tokens=32, num_blocks=num_blocks, progress=False)
        e = p.engine
        for i in range(6):
            e.add_request(f"r{i}", f"Prompt number {i} " * (i + 1), params)
        outs = drain(e, None)
        runs.append({k: (o.token_ids, o.text) for k, o in outs.items()})
        if num_blocks:
            assert e.scheduler.num_preemptions > 0
        for o in outs.values():
            assert o.finish_reason == FinishReason.EOS and valid(o.text), o.text
    assert runs[0] == runs[1]
    texts = {t for _, t in runs[0].values()}
    assert len(texts) > 1  # the completions are drawn, not one repeated


@pytest.mark.slow
def test_resume_rebuilds_grammar_state(pipe):
    """A stream resumed after k delivered tokens continues as the whole run did: the matcher accepted them again."""
    e = pipe.engine
    params = SamplingParams(max_new_tokens=60, temperature=1.0, seed=5, constraint=JSON)
    e.add_request("full", "Hello", params)
    full = drain(e, None)[("full", 0)]
    k = len(full.token_ids) // 2
    e.add_request("resumed", "Hello", params, resume=(Resume(tuple(full.token_ids[:k])),))
    resumed = drain(e, None)[("resumed", 0)]
    assert resumed.token_ids == full.token_ids and resumed.text == full.text
    with pytest.raises(ValueError, match="does not match"):
        e.add_request("bad", "Hello", params, resume=(Resume((full.token_ids[1],) * 3),))
    assert not e.has_unfinished()  # refused before anything was registered


@pytest.mark.slow
def test_unconstrained_rows_are_untouched(pipe):
    prompts = ["The cat", "One two three", "Why"]
    alone = pipe(prompts, max_new_tokens=12, min_new_tokens=12)
    e = pipe.engine
    for i, p in enumerate(prompts):
        e.add_request(f"plain{i}", p, SamplingParams(max_new_tokens=12, min_new_tokens=12))
        e.add_request(f"json{i}", p, SamplingParams(max_new_tokens=60, constraint=JSON))
    outs = drain(e, None)
    assert [outs[(f"plain{i}", 0)].token_ids for i in range(3)] == [o.token_ids for o in alone]
    assert all(valid(outs[(f"json{i}", 0)].text) for i in range(3))


def test_bad_constraints_are_refused():
    with pytest.raises(ValueError, match="at least one choice"):
        Constraint("choice", ()).validate()
    with pytest.raises(ValueError, match="kind"):
        Constraint("xml", "x").validate()
    with pytest.raises(ValueError, match="at most"):
        Constraint("regex", "a" * (1 << 16 + 1)).validate()


@pytest.mark.slow
def test_a_bad_schema_fails_its_compile_not_the_engine(pipe):
    from fastgen.replica.constraints import ConstraintError

    future = pipe.engine.constraints.compile(Constraint("json_schema", "{not json"))
    with pytest.raises(ConstraintError, match="does not compile"):
        future.result()
    assert pipe.engine.constraints.compile(JSON) is pipe.engine.constraints.compile(JSON)  # cached


def test_proto_constraint_maps_to_the_engine_and_limits_match():
    from fastgen.balancer import limits
    from fastgen.proto import fastgen_pb2 as pb
    from fastgen.replica import request
    from fastgen.replica.service import params_from_proto

    for name in ("MAX_CONSTRAINT_CHARS", "MAX_CONSTRAINT_CHOICES"):
        assert getattr(limits, name) == getattr(request, name), name
    p = pb.SamplingParams(constraint=pb.Constraint(json_schema=JSON.value))
    assert params_from_proto(p).constraint == JSON
    p = pb.SamplingParams(constraint=pb.Constraint(choice=pb.ChoiceList(choices=["a", "b"])))
    assert params_from_proto(p).constraint == Constraint("choice", ("a", "b"))
    assert params_from_proto(pb.SamplingParams(constraint=pb.Constraint(json_object=True))).constraint.kind == (
        "json_object"
    )
    assert params_from_proto(pb.SamplingParams()).constraint is None
    with pytest.raises(ValueError, match="no kind"):
        params_from_proto(pb.SamplingParams(constraint=pb.Constraint()))
    huge = pb.GenerateRequest(text="x", params=pb.SamplingParams(constraint=pb.Constraint(regex="a" * (1 << 17))))
    with pytest.raises(limits.RequestRefused, match="at most"):
        limits.check_request(huge)
    many = pb.Constraint(choice=pb.ChoiceList(choices=["a"] * (limits.MAX_CONSTRAINT_CHOICES + 1)))
    with pytest.raises(limits.RequestRefused, match="choices"):
        limits.check_request(pb.GenerateRequest(text="x", params=pb.SamplingParams(constraint=many)))


@pytest.mark.parametrize(
    "fields, expected",
    [
        (dict(response_format={"type": "text"}), None),
        (dict(response_format={"type": "json_object"}), dict(json_object=True)),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": 1}}),
            dict(json_schema=json.dumps(SCHEMA, separators=(",", ":"))),
        ),
        (
            dict(structured_outputs={"json": json.dumps(SCHEMA)}),
            dict(json_schema=json.dumps(SCHEMA, separators=(",", ":"))),
        ),
        (dict(structured_outputs={"regex": "[0-9]+"}), dict(regex="[0-9]+")),
        (dict(structured_outputs={"choice": ["a", "b"]}), dict(choice={"choices": ["a", "b"]})),
        (dict(structured_outputs={"grammar": 'root ::= "a"'}), dict(grammar='root ::= "a"')),
        (dict(guided_json=SCHEMA), dict(json_schema=json.dumps(SCHEMA, separators=(",", ":")))),
        (dict(guided_regex="a+"), dict(regex="a+")),
        (dict(guided_choice=["x"]), dict(choice={"choices": ["x"]})),
        (dict(guided_grammar='root ::= "a"'), dict(grammar='root ::= "a"')),
    ],
)
def test_http_fields_map_to_the_constraint(fields, expected):
    from google.protobuf.json_format import MessageToDict

    from fastgen.balancer.openai_protocol import parse_chat, parse_completion

    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], **fields}, "id").prompts[0].params
    completion = parse_completion({"prompt": "hi", **fields}, "id").prompts[0].params
    for params in (chat, completion):
        if expected is None:
            assert not params.HasField("constraint")
        else:
            assert MessageToDict(params.constraint, preserving_proto_field_name=True) == expected


def test_http_refuses_a_huge_schema():
    from fastgen.balancer.openai_protocol import ApiError, parse_chat

    schema = {"type": "object", "description": "x" * (1 << 16)}
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "guided_json": schema}, "id")
    assert e.value.status == 400 and e.value.param == "guided_json"


# ---- tools (balancer/tools.py) --------------------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_forced_tool_choices_become_schemas():
    from fastgen.balancer.tools import parse_tools

    plan, tools_json, c = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert plan.forced and json.loads(tools_json)[0]["function"]["name"] == "get_weather"
    schema = json.loads(c.json_schema)
    assert schema["type"] == "array" and len(schema["items"]["anyOf"]) == 2 and "maxItems" not in schema
    plan, _, c = parse_tools({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    assert json.loads(c.json_schema)["maxItems"] == 1
    choice = {"type": "function", "function": {"name": "get_weather"}}
    plan, _, c = parse_tools({"tools": [WEATHER, TIME], "tool_choice": choice})
    assert plan.named == "get_weather" and json.loads(c.json_schema)["required"] == ["city"]
    plan, _, c = parse_tools({"tools": [WEATHER]})
    assert plan.choice == "auto" and c is None


@pytest.mark.parametrize(
    "parser, text, content, calls",
    [
        (
            "hermes",
            'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "Sure.",
            1,
        ),
        (
            "qwen3",
            '<tool_call>{"name":"get_weather","arguments":{"city":"A"}}</tool_call><tool_call>'
            '{"name":"get_time","arguments":{}}</tool_call>',
            None,
            2,
        ),
        ("hermes", "just text", "just text", 0),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}', None, 1),
        ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', None, 1),
        ("hermes", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', None, 0),
    ],
)
def test_auto_tool_calls_are_parsed_per_family(parser, text, content, calls):
    from fastgen.balancer.tools import extract, parse_tools

    plan, _, _ = parse_tools({"tools": [WEATHER, TIME]}, parser)
    got_content, got = extract(plan, text)
    assert len(got) == calls
    if calls:
        assert got_content == content
        assert all(json.loads(c["function"]["arguments"]) is not None for c in got)
    else:
        assert got_content == text


@pytest.mark.parametrize("choice", ["auto", "required", "named"])
def test_streamed_tool_calls_accumulate_to_the_whole(choice):
    """The deltas of a stream, accumulated as the openai SDK does, give the calls of the whole output."""
    from fastgen.balancer.tools import ToolStream, parse_tools

    body = {"tools": [WEATHER, TIME], "tool_choice": choice}
    if choice == "named":
        body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    plan, _, _ = parse_tools(body)
    text = {
        "auto": 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
        "required": '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
        "named": '{"city": "Oslo"}',
    }[choice]
    stream, content, calls = ToolStream(plan), "", {}
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    for k, piece in enumerate(pieces):
        for delta in stream.feed(piece, k == len(pieces) - 1):
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls", []):
                entry = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                entry["name"] += tc.get("function", {}).get("name") or ""
                entry["arguments"] += tc.get("function", {}).get("arguments") or ""
    assert content == ("Let me check. " if choice == "auto" else "")
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"}


# ---- prompt logprobs ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_prompt_logprobs_match_transformers_float32(tiny_model_dir):
    """Every prompt token's logprob and top alternatives, with the prompt split over chunks and a preemption or not,
    within 1e-4 of transformers' float32 log-softmax."""
    from transformers import AutoModelForCausalLM

    prompts = [list(range(5, 45)), [7, 100, 2000, 31, 9, 8, 1234, 77, 5, 6, 90, 91, 92]]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for ids in prompts:
            refs.append(torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1))
    for budget, num_blocks in ((8, None), (256, None), (16, 6)):
        p = pipeline(
            str(tiny_model_dir), dtype="float32", max_batch_tokens=budget, num_blocks=num_blocks, progress=False
        )
        e = p.engine
        for i, ids in enumerate(prompts):
            e.add_request(f"p{i}", ids, SamplingParams(max_new_tokens=4, prompt_logprobs=3))
            e.add_request(f"q{i}", ids, SamplingParams(max_new_tokens=4))  # shares no cached blocks with p
        outs = drain(e, None)
        for i, ids in enumerate(prompts):
            lps = outs[(f"p{i}", 0)].prompt_logprobs
            assert [lp.token_id for lp in lps] == ids[1:]
            for pos, lp in enumerate(lps, start=1):
                ref = refs[i][pos - 1]
                assert abs(lp.logprob - ref[ids[pos]].item()) < 1e-4
                top = ref.topk(3)
                assert [t.token_id for t in lp.top] == top.indices.tolist()
                assert max(abs(t.logprob - v) for t, v in zip(lp.top, top.values.tolist())) < 1e-4
            assert outs[(f"q{i}", 0)].prompt_logprobs == []
            assert outs[(f"p{i}", 0)].token_ids == outs[(f"q{i}", 0)].token_ids


# ---- reasoning (balancer/reasoning.py) ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "parser, text, thoughts, content",
    [
        ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
        ("qwen3", "Paris.", None, "Paris."),
        ("deepseek_r1", "Hmm, France.</think>Paris.", "Hmm, France.", "Paris."),
        ("deepseek_r1", "<think>a</think>b", "a", "b"),
        ("deepseek_r1", "still thinking", "still thinking", None),
    ],
)
def test_reasoning_is_split_whole_and_streamed(parser, text, thoughts, content):
    from fastgen.balancer.openai_protocol import ChatStream, Meta, chat_response, parse_chat
    from fastgen.proto import fastgen_pb2 as pb

    api = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, "id", reasoning_parser=parser)
    reply = chat_response(Meta("x", 0, "m"), api, [pb.GenerateResponse(text=text, finish_reason=pb.FINISH_REASON_EOS)])
    message = reply["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (thoughts, content)
    stream, got = ChatStream(Meta("x", 0, "m"), api), {"reasoning_content": "", "content": ""}
    pieces = [text[i : i + 2] for i in range(0, len(text), 2)]
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        chunk = pb.GenerateChunk(text=piece, finish_reason=pb.FINISH_REASON_EOS if last else 0)
        for event in stream.events(0, chunk):
            for key in got:
                got[key] += event["choices"][0]["delta"].get(key) or ""
    assert got["reasoning_content"].strip("\n") == (thoughts or "")
    assert got["content"].lstrip("\n") == (content or "")


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_a_reasoning_models_tool_calls_stream_as_the_whole_reply_splits_them(piece):
    """Qwen3's shape: thoughts, then a hermes call. Streamed in pieces of any size, the deltas accumulate to the whole
    reply's reasoning_content, content and tool_calls, and the stream finishes with tool_calls."""
    from fastgen.balancer.openai_protocol import ChatStream, Meta, chat_response, parse_chat
    from fastgen.proto import fastgen_pb2 as pb

    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER, TIME]}
    api = parse_chat(body, "id", tool_call_parser="hermes", reasoning_parser="qwen3")
    text = '<think>\nThe user wants Oslo.\n</think>\n\nOne moment. <tool_call>{"name": "get_weather", '
    text += '"arguments": {"city": "Oslo", "unit": "celsius"}}</tool_call>'
    reply = chat_response(Meta("x", 0, "m"), api, [pb.GenerateResponse(text=text, finish_reason=pb.FINISH_REASON_EOS)])
    whole = reply["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["tool_calls"]
    stream, got, calls, reasons = ChatStream(Meta("x", 0, "m"), api), {"reasoning_content": "", "content": ""}, [], []
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    for k, part in enumerate(pieces):
        chunk = pb.GenerateChunk(text=part, finish_reason=pb.FINISH_REASON_EOS if k == len(pieces) - 1 else 0)
        for event in stream.events(0, chunk):
            choice = event["choices"][0]
            reasons.append(choice["finish_reason"])
            for key in got:
                got[key] += choice["delta"].get(key) or ""
            calls += choice["delta"].get("tool_calls", [])
    assert got["reasoning_content"].strip("\n") == whole["message"]["reasoning_content"].strip("\n")
    assert got["content"].strip() == (whole["message"]["content"] or "").strip()
    assert [c["function"] for c in calls] == [c["function"] for c in whole["message"]["tool_calls"]]
    assert [r for r in reasons if r] == ["tool_calls"]


def test_tools_and_tool_turns_reach_the_chat_template():
    """An agent's loop: tools, an assistant turn that called one, the tool's answer; the template sees all three."""
    from fastgen.balancer.openai_protocol import parse_chat
    from fastgen.replica.prompts import PromptEncoder
    from fastgen.replica.service import prompt_from_proto

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    body = {
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": [WEATHER],
    }
    request = parse_chat(body, "id").prompts[0]
    prompt = prompt_from_proto(request, 1000)
    assert prompt.tools[0]["function"]["name"] == "get_weather"
    assert prompt[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert prompt[2]["tool_call_id"] == "call_1"

    class Template:
        chat_template = "x"
        seen: dict = {}

        def apply_chat_template(self, messages, **kw):
            Template.seen = {"messages": messages, **kw}
            return "rendered"

        def encode(self, text, **kw):
            return [1, 2]

    assert PromptEncoder(Template(), 10).encode(prompt) == [1, 2]
    assert Template.seen["tools"] == prompt.tools and Template.seen["messages"][1]["tool_calls"]


def test_deploy_passes_the_parsers_to_the_balancer():
    from fastgen.balancer import reasoning, tools
    from fastgen.launch import config

    assert config.TOOL_CALL_PARSERS == tools.TOOL_CALL_PARSERS
    assert config.REASONING_PARSERS[1:] == reasoning.REASONING_PARSERS
    c = config.DeployConfig(http_port=8000, tool_call_parser="qwen3", reasoning_parser="qwen3")
    argv = config.balancer_spec(c, "python", []).argv
    assert argv[argv.index("--tool-call-parser") + 1] == "qwen3" and "--reasoning-parser" in argv
    assert config.validate(c) == []
    assert config.validate(config.DeployConfig(tool_call_parser="xml")) != []


def test_the_tool_call_parser_follows_the_chat_template():
    from fastgen.balancer.tools import parser_for_template

    assert parser_for_template("{{ '<tool_call>\\n' }}{{ tool_call | tojson }}") == "hermes"
    assert parser_for_template("<think>{{ x }}</think><tool_call>") == "qwen3"
    assert parser_for_template("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]") == "mistral"
    assert parser_for_template("<|python_tag|>{{ x }}<|eot_id|>") == "llama3_json"
    assert parser_for_template(None) == "hermes"


def test_required_calls_stream_their_arguments_as_they_come():
    from fastgen.balancer.tools import ToolStream, parse_tools

    plan, _, _ = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    text = '[{"name": "get_weather", "parameters": {"city": "O\\"slo}"}}, {"name": "get_time", "parameters": {}}]'
    stream, calls, events = ToolStream(plan), {}, 0
    for k in range(0, len(text), 4):
        for delta in stream.feed(text[k : k + 4], k + 4 >= len(text)):
            events += 1
            for tc in delta["tool_calls"]:
                entry = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                entry["name"] += tc["function"].get("name") or ""
                entry["arguments"] += tc["function"].get("arguments") or ""
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [{"city": 'O"slo}'}, {}]
    assert events > 4  # the arguments came in pieces, not whole at the end


def test_streamed_echo_carries_the_prompt_logprobs():
    from fastgen.balancer import openai_protocol as op
    from fastgen.proto import fastgen_pb2 as pb

    api = op.parse_completion({"prompt": "a bc", "echo": True, "logprobs": 0, "stream": True}, "id")
    stream = op.CompletionStream(op.Meta("x", 0, "m"), api)
    prompt = [pb.TokenLogprob(token_id=9, token=" b", logprob=-1.5), pb.TokenLogprob(token_id=8, token="c", logprob=-2)]
    first = pb.GenerateChunk(text="!", prompt_text="a bc", prompt_logprobs=prompt)
    first.logprobs.add(token_id=7, token="!", logprob=-0.5)
    (event,) = stream.events(0, first)
    lp = event["choices"][0]["logprobs"]
    assert event["choices"][0]["text"] == "a bc!" and lp["token_logprobs"] == [None, -1.5, -2.0, -0.5]
    assert lp["text_offset"] == [0, 1, 3, 4]


def test_all_logits_crosses_the_tensor_parallel_broadcast():
    from fastgen.replica.batch import Batch, ScheduledSeq
    from fastgen.replica.batch_broadcast import decode_batch, encode_batch

    seqs = [ScheduledSeq(1, [5], 9, [0, 1], True), ScheduledSeq(2, [6, 7, 8], 0, [2], True, all_logits=True)]
    seqs.append(ScheduledSeq(3, [1, 2], 4, [3, 4], False, all_logits=True))
    batch = Batch(seqs, 1, [], [(1, 2)])
    assert decode_batch(encode_batch(batch)).seqs == seqs


def test_tool_limits_are_checked_at_the_balancer():
    from fastgen.balancer.limits import MAX_TOOLS
    from fastgen.balancer.openai_protocol import ApiError, parse_chat

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ApiError) as e:
        parse_chat({**chat, "tools": [TIME] * (MAX_TOOLS + 1)}, "id")
    assert e.value.param == "tools"
    big = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "description": "x" * 70000}}}
    with pytest.raises(ApiError) as e:
        parse_chat({**chat, "tools": [big], "tool_choice": "required"}, "id")
    assert e.value.param == "tools" and e.value.status == 400


@pytest.mark.parametrize("constrained", [[0, 1, 2], [1], [0, 2]])
def test_native_and_torch_masks_agree(constrained, monkeypatch):
    from fastgen.replica import sampler

    torch.manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(3, vocab)
    rows = [SamplingRow(0.0, 1.0, 0, 0, 0, []) for _ in range(3)]
    for j in constrained:
        rows[j].allowed = torch.randint(-(2**31), 2**31 - 1, (4,), dtype=torch.int32)
    native = logits.clone()
    sampler._constrain(native, rows)
    monkeypatch.setattr(sampler, "_native_apply", lambda: None)
    portable = logits.clone()
    sampler._constrain(portable, rows)
    assert torch.equal(native, portable)
    assert (
        torch.isinf(native[constrained]).any()
        and not torch.isinf(native[[i for i in range(3) if i not in constrained]]).any()
    )
