"""The balancer's OpenAI-compatible HTTP API over scripted in-process fake replicas (no model, no subprocesses):
routes, SSE framing, error statuses, mid-stream failures, client disconnects, auth and metrics, with raw HTTP and
with the openai SDK. The real deployment is tests/test_openai_e2e.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

import aiohttp
import grpc
import openai
import pytest
from prometheus_client import CollectorRegistry

from fastgen.balancer.journal import MigrationSettings
from fastgen.balancer.openai_api import ApiSettings, OpenAIApi, start_http
from fastgen.server.grpc_server import set_serving
from fastgen.server.metrics import HttpMetrics

from .test_balancer_service import OK, SLOW, FailAfter, FakeReplica, _wait_for, balancer_over

KEY = "sk-test-key"


@dataclass
class Http:
    url: str
    session: aiohttp.ClientSession
    registry: CollectorRegistry
    harness: object

    def requests(self, route: str, status: int) -> float:
        labels = {"route": route, "status": str(status)}
        return self.registry.get_sample_value("fastgen_http_requests_total", labels) or 0.0

    async def post(self, path: str, body, headers=None) -> aiohttp.ClientResponse:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return await self.session.post(self.url + path, data=data, headers=headers or {})


@contextlib.asynccontextmanager
async def http_over(fakes: list[FakeReplica], api_key: str | None = None, **kwargs):
    async with balancer_over(fakes, **kwargs) as h:
        registry = CollectorRegistry()
        api = OpenAIApi(h.balancer, ApiSettings(api_key, ("alias",)), HttpMetrics(registry))
        runner, port = await start_http(api, "127.0.0.1", 0, shutdown_timeout=1)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        session = aiohttp.ClientSession(headers=headers)
        try:
            if kwargs.get("healthy", True):
                await _wait_for(lambda: h.balancer.model() == "fake")  # the first GetStatus poll is in
            yield Http(f"http://127.0.0.1:{port}", session, registry, h)
        finally:
            await session.close()
            await runner.cleanup()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "fake", "prompt": "hi"}


def events_of(raw: str) -> list:
    """The data of every SSE event, checking the framing: `data: ...` events separated by blank lines."""
    assert raw.endswith("\n\n"), raw[-50:]
    blocks = raw[:-2].split("\n\n")
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), blocks
    return [b[len("data: ") :] for b in blocks]


def test_chat_completion_has_openais_shape():
    async def main():
        async with http_over([FakeReplica("a")]) as http:
            r = await http.post("/v1/chat/completions", CHAT)
            assert r.status == 200 and r.content_type == "application/json"
            body = await r.json()
            assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
            assert body["model"] == "fake" and isinstance(body["created"], int)
            assert body["choices"] == [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "text from a"},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ]
            assert body["usage"] == {
                "prompt_tokens": 0,
                "completion_tokens": 2,
                "total_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            assert http.requests("/v1/chat/completions", 200) == 1

    run(main())


def test_completion_stream_framing_ids_finish_reason_and_usage():
    async def main():
        async with http_over([FakeReplica("a")]) as http:
            body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
            r = await http.post("/v1/completions", body)
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            data = events_of(await r.text())
            assert data[-1] == "[DONE]"
            chunks = [json.loads(d) for d in data[:-1]]
            assert len({(c["id"], c["created"], c["model"], c["object"]) for c in chunks}) == 1
            assert chunks[0]["object"] == "text_completion"
            texts = [c["choices"][0]["text"] for c in chunks[:-1]]
            assert texts == ["0", "1", "2", ""]
            assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None, "length"]
            assert all(c["usage"] is None for c in chunks[:-1])
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 0

    run(main())


def test_chat_stream_opens_with_the_role():
    async def main():
        async with http_over([FakeReplica("a")]) as http:
            r = await http.post("/v1/chat/completions", {**CHAT, "stream": True})
            chunks = [json.loads(d) for d in events_of(await r.text())[:-1]]
            assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
            deltas = [c["choices"][0]["delta"] for c in chunks]
            assert deltas == [
                {"role": "assistant", "content": ""},
                {"content": "0"},
                {"content": "1"},
                {"content": "2"},
                {},
            ]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_replica_errors_become_http_statuses(stream):
    full = grpc.StatusCode.RESOURCE_EXHAUSTED
    a, b = FakeReplica("a", [grpc.StatusCode.INVALID_ARGUMENT, full]), FakeReplica("b", [full])

    async def main():
        async with http_over([a, b]) as http:
            r = await http.post("/v1/chat/completions", {**CHAT, "stream": stream})
            assert r.status == 400
            assert await r.json() == {
                "error": {
                    "message": "a answers INVALID_ARGUMENT",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_argument",
                }
            }
            r = await http.post("/v1/chat/completions", {**CHAT, "stream": stream})  # a full, then b full
            assert r.status == 429 and r.headers["Retry-After"] == "3"  # the replica's 2500 ms, rounded up
            assert (await r.json())["error"]["type"] == "rate_limit_error"
            route = "/v1/chat/completions"
            assert (http.requests(route, 400), http.requests(route, 429)) == (1, 1)

    run(main())


def test_no_healthy_replica_is_503_and_health_says_so():
    async def main():
        async with http_over([FakeReplica("a")], healthy=False) as http:
            r = await http.post("/v1/completions", {"prompt": "hi"})  # no replica has reported its model yet
            assert r.status == 503 and "no healthy replica" in (await r.json())["error"]["message"]
            r = await http.session.get(http.url + "/health")
            assert r.status == 503 and (await r.json())["status"] == "unavailable"

    run(main())


def test_failure_after_output_is_an_error_event_then_done():
    async def main():
        # Migration off: a stream that cannot move to another replica (test_failover shows one that does).
        fakes = [FakeReplica("a", [FailAfter(2)]), FakeReplica("b")]
        async with http_over(fakes, migration=MigrationSettings(limit=0)) as http:
            r = await http.post("/v1/completions", {**COMPLETION, "stream": True})
            assert r.status == 200
            data = events_of(await r.text())
            assert [json.loads(d)["choices"][0]["text"] for d in data[:2]] == ["0", "1"]
            error = json.loads(data[2])["error"]
            assert error["code"] == "unavailable" and "after part of the output was sent" in error["message"]
            assert data[3:] == ["[DONE]"]

    run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_the_replicas_work(stream):
    a = FakeReplica("a", [SLOW])

    async def main():
        async with http_over([a]) as http:
            task = asyncio.ensure_future(http.post("/v1/completions", {**COMPLETION, "stream": stream}))
            if stream:  # read the first events, then walk away
                response = await task
                assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")
                response.close()
            else:
                await _wait_for(lambda: a.calls == 1)
                task.cancel()
            await _wait_for(lambda: a.cancelled == 1)
            await _wait_for(lambda: http.harness.pool.replicas[0].in_flight == 0)
            await _wait_for(lambda: http.requests("/v1/completions", 499) == 1)

    run(main())


def test_unknown_model_route_method_and_bad_json_answer_in_openais_shape():
    async def main():
        async with http_over([FakeReplica("a")]) as http:
            r = await http.post("/v1/chat/completions", {**CHAT, "model": "gpt-4"})
            error = (await r.json())["error"]
            assert r.status == 404 and error["code"] == "model_not_found" and error["param"] == "model"
            assert "`fake`" in error["message"] and "`alias`" in error["message"]
            assert (await http.post("/v1/chat/completions", {**CHAT, "model": "alias"})).status == 200
            assert (await http.post("/v1/chat/completions", {"messages": CHAT["messages"]})).status == 200
            r = await http.post("/v1/chat/completions", "{not json")
            assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
            r = await http.post("/v1/chat/completions", {**CHAT, "temperature": "hot"})
            assert r.status == 400 and (await r.json())["error"]["param"] == "temperature"
            r = await http.session.get(http.url + "/v1/nothing")
            assert r.status == 404 and (await r.json())["error"]["type"] == "invalid_request_error"
            r = await http.session.get(http.url + "/v1/completions")
            assert r.status == 405 and "error" in await r.json()
            assert http.requests("other", 404) == 1

    run(main())


def test_models_version_and_health():
    async def main():
        async with http_over([FakeReplica("a")]) as http:
            models = await (await http.session.get(http.url + "/v1/models")).json()
            assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["fake", "alias"]
            assert (await (await http.session.get(http.url + "/version")).json())["version"]
            r = await http.session.get(http.url + "/health")
            assert r.status == 200 and (await r.json())["status"] == "ok"

    run(main())


def test_api_key_is_required_everywhere_but_health():
    async def main():
        async with http_over([FakeReplica("a")], api_key=KEY) as http:
            assert (await http.post("/v1/chat/completions", CHAT)).status == 200
            async with aiohttp.ClientSession() as anonymous:
                for path in ("/v1/models", "/version", "/v1/nothing"):
                    r = await anonymous.get(http.url + path)
                    assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key", path
                wrong = {"Authorization": "Bearer sk-test-kez"}
                assert (
                    await anonymous.post(http.url + "/v1/completions", json=COMPLETION, headers=wrong)
                ).status == 401
                assert (await anonymous.get(http.url + "/health")).status == 200

    run(main())


def test_several_prompts_are_generated_concurrently_with_indexed_choices():
    async def main():
        async with http_over([FakeReplica("a"), FakeReplica("b")]) as http:
            body = await (await http.post("/v1/completions", {**COMPLETION, "prompt": ["x", "y", "z"]})).json()
            assert [c["index"] for c in body["choices"]] == [0, 1, 2]
            assert body["usage"]["completion_tokens"] == 6
            r = await http.post("/v1/completions", {**COMPLETION, "prompt": [[1, 2], [3]], "stream": True})
            chunks = [json.loads(d) for d in events_of(await r.text())[:-1]]
            finished = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"])
            assert finished == [0, 1]

    run(main())


def test_openai_sdk_sees_its_own_types_and_exceptions():
    full = grpc.StatusCode.RESOURCE_EXHAUSTED
    a = FakeReplica("a", [OK, grpc.StatusCode.INVALID_ARGUMENT, full, grpc.StatusCode.INTERNAL])

    async def main():
        async with http_over([a], api_key=KEY) as http:
            client = openai.AsyncOpenAI(base_url=http.url + "/v1", api_key=KEY, max_retries=0)
            try:
                reply = await client.chat.completions.create(model="fake", messages=CHAT["messages"])
                assert reply.choices[0].message.content == "text from a" and reply.usage.completion_tokens == 2
                with pytest.raises(openai.BadRequestError):
                    await client.completions.create(model="fake", prompt="x")
                with pytest.raises(openai.RateLimitError):
                    await client.completions.create(model="fake", prompt="x")
                with pytest.raises(openai.InternalServerError):
                    await client.completions.create(model="fake", prompt="x")
                with pytest.raises(openai.NotFoundError):
                    await client.completions.create(model="nope", prompt="x")
                with pytest.raises(openai.AuthenticationError):
                    await openai.AsyncOpenAI(base_url=http.url + "/v1", api_key="wrong").models.list()
                stream = await client.chat.completions.create(model="fake", messages=CHAT["messages"], stream=True)
                assert "".join([c.choices[0].delta.content or "" async for c in stream]) == "012"
            finally:
                await client.close()

    run(main())
    assert a.calls == 5  # the 404 and the 401 never reached the replica


def test_a_replica_that_stops_serving_mid_test_is_skipped():
    a, b = FakeReplica("a"), FakeReplica("b")

    async def main():
        async with http_over([a, b]) as http:
            await set_serving(http.harness.replica_health["a"], False)
            await _wait_for(lambda: not http.harness.pool.replicas[0].healthy)
            for _ in range(3):
                body = await (await http.post("/v1/completions", COMPLETION)).json()
                assert body["choices"][0]["text"] == "text from b"

    run(main())
