"""The OpenAI-compatible HTTP API end to end: one deployment of the tiny model (`fastgen-deploy start --http-port`,
API key from FASTGEN_API_KEY) on 127.0.0.1 for the whole module, driven by the real `openai` SDK (sync and async,
streamed and not, chat and completions, n, logprobs, usage, its own exception types) and by raw HTTP for the SSE
framing; greedy text over HTTP equals greedy text over gRPC; a client that disconnects frees its request."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import psutil
import pytest

from fastgen.launch.config import API_KEY_ENV
from fastgen.server import Client
from fastgen.testing import wait_until

from .helpers import Deploy, alive, free_port, tiny_start

pytestmark = pytest.mark.slow

NAME = "oai"
KEY = "sk-fastgen-e2e"
GREEDY = {"temperature": 0}


@dataclass
class Served:
    deploy: Deploy
    base_url: str  # http://host:port/v1
    model: str
    balancer: str  # gRPC host:port
    replica: str
    balancer_metrics: int
    replica_metrics: int

    def sync(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=KEY, max_retries=0, **kw)

    def asynchronous(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=KEY, max_retries=0)

    def replica_idle(self) -> bool:
        token = (Path(self.deploy.env["FASTGEN_HOME"]) / NAME / "auth-token").read_text().strip()
        with Client(self.replica, timeout=5, api_key=token) as client:  # a replica takes only the internal token
            r = client.status().replicas[0]
        return r.running_requests == 0 and r.queued_requests == 0

    def metric(self, port: int, name: str, **labels) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name}{{{want}}} not exported")


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    home = tmp_path_factory.mktemp("openai") / "home"
    deploy = Deploy(home)
    deploy.env[API_KEY_ENV] = KEY  # the way the README recommends: not on a command line
    port = free_port(2)
    metrics = free_port(2)
    http = free_port(1)
    done = deploy(*tiny_start(NAME, tiny_model_dir, 1, port, metrics, http_port=http), timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"OpenAI-compatible API: http://127.0.0.1:{http}/v1 (API key required)" in done.stdout
    try:
        rows = deploy.status(NAME)
        yield Served(
            deploy,
            f"http://127.0.0.1:{http}/v1",
            str(tiny_model_dir),
            f"127.0.0.1:{port}",
            f"127.0.0.1:{port + 1}",
            rows[0]["metrics_port"],
            rows[1]["metrics_port"],
        )
    finally:
        deploy("stop", "--name", NAME, "--timeout", "10")
        for pid in deploy.seen_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# ---- the deployment ---------------------------------------------------------------------------------------------
def test_status_shows_the_url_and_the_key_stays_out_of_ps(served):
    rows = served.deploy.status(NAME)
    assert rows[0]["http_url"] == served.base_url and "http_url" not in rows[1]
    shown = served.deploy("status", "--name", NAME)
    assert f"OpenAI-compatible API: {served.base_url} (API key required)" in shown.stdout
    for row in rows:
        assert KEY not in " ".join(psutil.Process(row["pid"]).cmdline())
    assert psutil.Process(rows[0]["pid"]).environ().get(API_KEY_ENV) == KEY
    assert API_KEY_ENV not in psutil.Process(rows[1]["pid"]).environ()  # only the balancer holds it


def test_models_health_and_version(served):
    assert [m.id for m in served.sync().models.list()] == [served.model]
    root = served.base_url.removesuffix("/v1")
    assert json.loads(urllib.request.urlopen(root + "/health", timeout=5).read()) == {"status": "ok"}  # no key
    request = urllib.request.Request(root + "/version", headers={"Authorization": f"Bearer {KEY}"})
    assert json.loads(urllib.request.urlopen(request, timeout=5).read())["version"]


# ---- the SDK ------------------------------------------------------------------------------------------------------
def test_sync_chat_and_completion(served):
    client = served.sync()
    messages = [{"role": "user", "content": "Hello!"}]
    chat = client.chat.completions.create(model=served.model, messages=messages, max_tokens=6, **GREEDY)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-") and chat.model == served.model
    (choice,) = chat.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    assert (
        chat.usage.prompt_tokens > 4
        and chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    )
    done = client.completions.create(
        model=served.model, prompt="Once upon a time", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 5 and done.choices[0].text


def test_greedy_text_over_http_equals_grpc(served):
    prompt = "The capital of France is"
    with Client(served.balancer, timeout=60, api_key=KEY) as grpc_client:
        want = grpc_client.generate(prompt, max_new_tokens=12, temperature=0, ignore_eos=True)
        want_chat = grpc_client.generate([{"role": "user", "content": prompt}], max_new_tokens=8, temperature=0)
    client = served.sync()
    got = client.completions.create(
        model=served.model, prompt=prompt, max_tokens=12, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert got.choices[0].text == want.text
    streamed = client.completions.create(
        model=served.model, prompt=prompt, max_tokens=12, stream=True, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed) == want.text
    chat = client.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": prompt}], max_completion_tokens=8, **GREEDY
    )
    assert chat.choices[0].message.content == want_chat.text
    ids = client.completions.create(model=served.model, prompt=[1, 2, 3], max_tokens=3, **GREEDY)
    assert ids.usage.prompt_tokens == 3


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(served):
    client = served.sync()
    prompt = "A prompt seen twice: " + " ".join(f"item{i}" for i in range(60))
    first = client.completions.create(model=served.model, prompt=prompt, max_tokens=2, **GREEDY)
    again = list(
        client.completions.create(
            model=served.model,
            prompt=prompt,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )[-1]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    with Client(served.balancer, timeout=60, api_key=KEY) as grpc_client:
        result = grpc_client.generate(prompt, max_new_tokens=2, temperature=0)
    assert result.cached_prompt_tokens == again.usage.prompt_tokens_details.cached_tokens


def test_async_chat_stream_with_usage(served):
    async def main():
        client = served.asynchronous()
        try:
            stream = await client.chat.completions.create(
                model=served.model,
                messages=[{"role": "user", "content": "Count to three"}],
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
                **GREEDY,
            )
            return [c async for c in stream]
        finally:
            await client.close()

    chunks = asyncio.run(main())
    assert len({(c.id, c.created, c.model) for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    *body, last = chunks
    assert body[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in body] == [None] * (len(body) - 1) + ["length"]
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert all(c.usage is None for c in body)


def test_several_prompts_and_async_completions(served):
    async def main():
        client = served.asynchronous()
        try:
            return await client.completions.create(model=served.model, prompt=["A", "B", "C"], max_tokens=2, **GREEDY)
        finally:
            await client.close()

    done = asyncio.run(main())
    assert [c.index for c in done.choices] == [0, 1, 2]


# ---- engine features (need the engine's n, logprobs and penalties) -------------------------------------------------
def test_n_choices_streamed_and_not(served):
    client = served.sync()
    body = {"ignore_eos": True}
    done = client.completions.create(
        model=served.model, prompt="Hi", n=3, max_tokens=4, temperature=1.0, seed=1, extra_body=body
    )
    assert [c.index for c in done.choices] == [0, 1, 2] and done.usage.completion_tokens == 12
    stream = client.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": "Hi"}],
        n=2,
        max_tokens=3,
        seed=2,
        stream=True,
        extra_body=body,
    )
    finished = [c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]


def test_logprobs_of_chat_and_completions(served):
    client = served.sync()
    chat = client.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0 and t.bytes == list(t.token.encode())
        assert abs(t.logprob - t.top_logprobs[0].logprob) < 1e-5  # greedy picks the most likely
    done = client.completions.create(
        model=served.model, prompt="Hi", max_tokens=3, logprobs=2, extra_body={"ignore_eos": True}, **GREEDY
    )
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs) and lp.text_offset[0] == 0


def test_penalties_and_vllm_extras_are_accepted(served):
    client = served.sync()
    done = client.completions.create(
        model=served.model,
        prompt="Hi",
        max_tokens=4,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"42": 100},
        stop=["\n\n"],
        seed=3,
        user="ignored",
        logprobs=0,
        extra_body={
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 1,
            "ignore_eos": True,
            "skip_special_tokens": True,
            "include_stop_str_in_output": False,
            "stop_token_ids": [0],
        },
    )
    assert len(set(done.choices[0].logprobs.tokens)) == 1  # a +100 bias makes token 42 every pick


# ---- errors -------------------------------------------------------------------------------------------------------
def test_errors_are_the_sdks_own_exceptions(served):
    client = served.sync()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=served.model, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:  # the replica's own refusal, passed through
        client.completions.create(model=served.model, prompt=[5] * 1100, max_tokens=2)
    assert "context" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # max_tokens 0 scores a prompt (echo), else it is a mistake
        client.completions.create(model=served.model, prompt="x", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.base_url, api_key="wrong", max_retries=0).models.list()


# ---- raw HTTP -----------------------------------------------------------------------------------------------------
def test_raw_sse_framing(served):
    async def main():
        headers = {"Authorization": f"Bearer {KEY}"}
        body = {"model": served.model, "prompt": "Hi", "max_tokens": 3, "stream": True, "ignore_eos": True}
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.post(served.base_url + "/completions", json=body) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                return await r.text()

    raw = asyncio.run(main())
    blocks = raw.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    events = [json.loads(b.removeprefix("data: ")) for b in blocks[:-2]]
    assert all(b.startswith("data: {") for b in blocks[:-2])
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])


def test_client_disconnect_frees_the_request(served):
    cancelled_before = served.metric(served.replica_metrics, "fastgen_requests_finished_total", reason="cancelled")

    async def main():
        headers = {"Authorization": f"Bearer {KEY}"}
        body = {"model": served.model, "prompt": "Hi", "max_tokens": 900, "stream": True, "ignore_eos": True}
        async with aiohttp.ClientSession(headers=headers) as session:
            r = await session.post(served.base_url + "/completions", json=body)
            assert (await r.content.readuntil(b"\n\n")).startswith(b"data: {")
            r.close()  # hang up mid-stream

    asyncio.run(main())
    wait_until(served.replica_idle, 30, "the replica to drop the abandoned request")
    wait_until(
        lambda: (
            served.metric(served.replica_metrics, "fastgen_requests_finished_total", reason="cancelled")
            == cancelled_before + 1
        ),
        10,
        "the replica to count the request as cancelled",
    )
    route = {"route": "/v1/completions", "status": "499"}
    wait_until(lambda: served.metric(served.balancer_metrics, "fastgen_http_requests_total", **route) >= 1, 10, "499")
