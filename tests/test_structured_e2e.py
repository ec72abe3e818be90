"""Structured output and tool calls end to end: a deployment of the embedded SmolLM2 (`fastgen-deploy start` with the
HTTP API), driven by the real openai SDK as users do: chat.completions.parse with a pydantic model, json_object,
tool_choice "required" and a named function (streamed and not), choice constraints, and a bad schema's 400."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from .helpers import Deploy, alive, free_port, require_tool

pytestmark = pytest.mark.slow

NAME = "structured"
KEY = "sk-structured"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 24}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    role: Literal["engineer", "doctor", "artist"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    deploy = Deploy(tmp_path_factory.mktemp("structured") / "home")
    deploy.env["FASTGEN_API_KEY"] = KEY
    port = free_port(2)
    metrics = free_port(2)
    http = free_port(1)
    args = ["start", "--name", NAME, "--replicas", "1", "--port", str(port), "--metrics-port", str(metrics)]
    args += ["--http-port", str(http), "--dtype", "float32", "--threads", "1", "--timeout", "180"]
    done = deploy(*args, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    try:
        deploy.status(NAME)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key=KEY, max_retries=0, timeout=120)
        c.model_name = c.models.list().data[0].id
        c.http_base = f"http://127.0.0.1:{http}/v1"
        yield c
    finally:
        deploy("stop", "--name", NAME, "--timeout", "10")
        for pid in deploy.seen_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


MESSAGES = [{"role": "user", "content": "Describe a person as JSON: their name, age and job."}]


def test_parse_with_a_pydantic_model_sampled(client):
    for seed in range(3):
        done = client.chat.completions.parse(
            model=client.model_name,
            messages=MESSAGES,
            response_format=Person,
            temperature=0.8,
            seed=seed,
            max_tokens=120,
        )
        person = done.choices[0].message.parsed
        assert isinstance(person, Person), done.choices[0].message.content
        assert Person.model_validate_json(done.choices[0].message.content) == person


def test_json_object(client):
    done = client.chat.completions.create(
        model=client.model_name,
        messages=[{"role": "user", "content": "Give me a JSON object with a colour."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(done.choices[0].message.content), dict)


def _check_call(call, name: str, keys: set[str]):
    assert call.type == "function" and call.function.name == name and call.id
    args = json.loads(call.function.arguments)
    assert keys <= args.keys(), args


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choice(client, stream):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, name, keys in (("required", None, None), (named, "get_time", {"timezone"})):
        kwargs = dict(
            model=client.model_name, messages=ask, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=120, seed=1
        )
        if not stream:
            done = client.chat.completions.create(**kwargs, temperature=0)
            message, reason = done.choices[0].message, done.choices[0].finish_reason
            calls = message.tool_calls
        else:
            calls_by_index: dict[int, dict] = {}
            reason = None
            for chunk in client.chat.completions.create(**kwargs, temperature=0, stream=True):
                for c in chunk.choices:
                    reason = c.finish_reason or reason
                    for tc in c.delta.tool_calls or []:
                        entry = calls_by_index.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                        entry["id"] += tc.id or ""
                        entry["name"] += (tc.function and tc.function.name) or ""
                        entry["arguments"] += (tc.function and tc.function.arguments) or ""
            calls = [
                openai.types.chat.ChatCompletionMessageToolCall(
                    id=e["id"], type="function", function={"name": e["name"], "arguments": e["arguments"]}
                )
                for e in calls_by_index.values()
            ]
        assert reason == "tool_calls" and calls
        for call in calls:
            if name is None:
                want = {"get_weather": {"city", "unit"}, "get_time": {"timezone"}}[call.function.name]
                _check_call(call, call.function.name, want)
            else:
                _check_call(call, name, keys)


def test_choice_constraints_on_chat_and_completions(client):
    choices = ["positive", "negative", "neutral"]
    done = client.chat.completions.create(
        model=client.model_name,
        messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}],
        extra_body={"structured_outputs": {"choice": choices}},
        temperature=1.0,
        max_tokens=10,
    )
    assert done.choices[0].message.content in choices
    done = client.completions.create(
        model=client.model_name,
        prompt="The sky is",
        extra_body={"guided_regex": "(blue|grey)[.]"},
        max_tokens=10,
        temperature=0,
    )
    assert done.choices[0].text in ("blue.", "grey.")


def test_a_bad_schema_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="does not compile"):
        client.chat.completions.create(
            model=client.model_name, messages=MESSAGES, extra_body={"guided_regex": "(unclosed"}, max_tokens=5
        )


def test_prompt_logprobs_match_transformers_float32(client):
    """echo + logprobs with max_tokens 0 (what lm-eval's loglikelihood sends) scores the prompt's tokens as
    transformers' float32 log-softmax does, within 1e-3."""
    import torch
    from transformers import AutoModelForCausalLM

    from fastgen.replica.weights import resolve_model

    ids = [504, 3658, 282, 4649, 314, 7042, 30, 378, 3658, 282, 253, 1345]
    done = client.completions.create(
        model=client.model_name, prompt=ids, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    lps = done.choices[0].logprobs.token_logprobs
    assert lps[0] is None and len(lps) == len(ids)
    model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m"), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(lps[1:], expected)) < 1e-3
    done = client.completions.create(
        model=client.model_name, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 2}, temperature=0
    )
    scored = done.model_extra["choices"][0]["prompt_logprobs"] if done.model_extra.get("choices") else None
    scored = scored or done.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and abs(scored[1][str(ids[1])]["logprob"] - expected[0]) < 1e-3


def test_chat_prompt_logprobs_score_the_rendered_conversation(client):
    """vLLM's prompt_logprobs on chat: every token of the conversation as the chat template renders it (the
    generation prompt included) scored as transformers' float32 log-softmax does, within 1e-3; streamed, on the
    first chunk."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastgen.replica.weights import resolve_model

    messages = [{"role": "user", "content": "Name a colour."}]
    done = client.chat.completions.create(
        model=client.model_name, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 0}, temperature=0
    )
    scored = done.model_extra["prompt_logprobs"]
    folder = resolve_model("smollm2-135m")
    ids = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, add_generation_prompt=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    assert scored[0] is None and [int(next(iter(e))) for e in scored[1:]] == ids[1:]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    got = [e[str(t)]["logprob"] for e, t in zip(scored[1:], ids[1:])]
    assert max(abs(a - ref[p, t].item()) for p, (a, t) in enumerate(zip(got, ids[1:]))) < 1e-3
    stream = client.chat.completions.create(
        model=client.model_name,
        messages=messages,
        max_tokens=2,
        stream=True,
        extra_body={"prompt_logprobs": 0},
        temperature=0,
    )
    chunks = list(stream)
    assert chunks[0].model_extra["prompt_logprobs"] == scored
    assert all("prompt_logprobs" not in c.model_extra for c in chunks[1:])


# ---- frameworks (the test extra installs both; without them these skip, and fail in CI) ------------------------------
def test_langchain_bind_tools_and_structured_output(client):
    require_tool(
        importlib.util.find_spec("langchain_openai"), 'langchain-openai not installed: pip install -e ".[test]"'
    )
    import langchain_openai

    llm = langchain_openai.ChatOpenAI(
        model=client.model_name, base_url=client.http_base, api_key=KEY, temperature=0, max_tokens=120, max_retries=0
    )
    message = llm.bind_tools([WEATHER, TIME], tool_choice="get_weather").invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and {"city", "unit"} <= call["args"].keys()
    message = llm.bind_tools([WEATHER, TIME], tool_choice="any").invoke("What time is it in Tokyo?")
    assert message.tool_calls and all(c["name"] in ("get_weather", "get_time") for c in message.tool_calls)
    person = llm.with_structured_output(Person).invoke(MESSAGES[0]["content"])
    assert isinstance(person, Person)


LL_DOCS = [
    ("The capital of France is", [" Paris", " London", " Berlin"], 0),
    ("Two plus two equals", [" five", " four", " seven"], 1),
    ("The colour of the sky on a clear day is", [" green", " red", " blue"], 2),
    ("Water freezes at zero degrees", [" Celsius", " Kelvin", " Newton"], 0),
    ("The opposite of hot is", [" cold", " warm", " loud"], 0),
    ("A week has seven", [" months", " days", " years"], 1),
]


def test_lm_eval_local_completions_scores_as_its_hf_model(client, tmp_path, monkeypatch):
    """A loglikelihood task made here (no download): lm-eval's local-completions model against the deployment gives
    the scores of lm-eval's own hf model on the same checkpoint."""
    require_tool(importlib.util.find_spec("lm_eval"), 'lm-eval not installed: pip install -e ".[test]"')
    import lm_eval
    from lm_eval.tasks import TaskManager

    from fastgen.replica.weights import resolve_model

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"q": q, "choices": c, "answer": a}) + "\n" for q, c, a in LL_DOCS))
    (tmp_path / "task.yaml").write_text(
        "task: fastgen_local_ll\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    path = resolve_model("smollm2-135m")
    tasks = TaskManager(include_path=str(tmp_path))
    scores = {}
    for name, args in (
        (
            "local-completions",
            f"model={client.model_name},base_url={client.http_base}/completions,tokenizer={path},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1",
        ),
        ("hf", f"pretrained={path},dtype=float32"),
    ):
        out = lm_eval.simple_evaluate(
            model=name, model_args=args, tasks=["fastgen_local_ll"], task_manager=tasks, log_samples=True, device="cpu"
        )
        samples = out["samples"]["fastgen_local_ll"]
        scores[name] = (
            out["results"]["fastgen_local_ll"]["acc,none"],
            [[r[0] for r in s["filtered_resps"]] for s in samples],
        )
    (acc_api, ll_api), (acc_hf, ll_hf) = scores["local-completions"], scores["hf"]
    assert acc_api == acc_hf
    flat_api = [x for row in ll_api for x in row]
    flat_hf = [x for row in ll_hf for x in row]
    assert max(abs(a - b) for a, b in zip(flat_api, flat_hf)) < 1e-3
