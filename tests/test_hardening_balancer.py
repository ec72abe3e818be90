"""Limits before work at the balancer: every count and size of a request is checked where it enters (gRPC and HTTP),
before anything proportional to it is allocated or computed, and odd input is a 4xx / INVALID_ARGUMENT, never a 500,
a stalled event loop or memory spent. In process against scripted fake replicas (test_balancer_service's harness),
then end to end against a real deployment of the tiny model behind an API key."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import grpc
import psutil
import pytest

from fastgen.balancer.journal import Journal
from fastgen.balancer.openai_protocol import ApiError, parse_chat, parse_completion
from fastgen.proto import fastgen_pb2 as pb

from .test_balancer_http import http_over
from .test_balancer_service import FakeReplica, balancer_over

MAX_UINT32 = 2**32 - 1
HUGE_IDS = 3_000_000  # past any prompt length the balancer accepts without knowing the model
HUGE_CHARS = 40_000_000  # characters: past the balancer's generous cap on text


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def _request(**params) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hi", params=pb.SamplingParams(**params))


def _ids(count: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * count))


def _messages(count: int) -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    request.messages.messages.extend([pb.ChatMessage(role="user", content="x")] * count)
    return request


def _resumed() -> pb.GenerateRequest:
    request = _request()
    request.resume.token_ids.extend([1, 2, 3])
    return request


# (what it is, the request, a word the refusal's message must hold)
OVERSIZED = [
    ("n 2**32-1", lambda: _request(n=MAX_UINT32), "n"),
    ("n 129", lambda: _request(n=129), "n"),
    ("top_logprobs", lambda: _request(logprobs=True, top_logprobs=MAX_UINT32), "top_logprobs"),
    ("stop count", lambda: _request(stop=["x"] * 10_000), "stop"),
    ("stop size", lambda: _request(stop=["x" * 100_000]), "stop"),
    ("stop_token_ids", lambda: _request(stop_token_ids=[1] * 100_000), "stop_token_ids"),
    ("logit_bias", lambda: _request(logit_bias=dict.fromkeys(range(100_000), 1.0)), "logit_bias"),
    ("cache_salt", lambda: _request(cache_salt="s" * 100_000), "cache_salt"),
    ("request_id", lambda: pb.GenerateRequest(request_id="r" * 100_000, text="hi"), "request_id"),
    ("token ids", lambda: _ids(HUGE_IDS), "prompt"),
    ("text", lambda: pb.GenerateRequest(text="x" * HUGE_CHARS), "prompt"),
    ("chat messages", lambda: _messages(100_000), "messages"),
    ("resume from a client", _resumed, "resume"),
]


@pytest.mark.parametrize("method", ["unary", "stream"])
@pytest.mark.parametrize("what, make, word", OVERSIZED, ids=[o[0] for o in OVERSIZED])
def test_grpc_counts_and_sizes_are_refused_at_the_balancer_before_any_replica_call(method, what, make, word):
    fake = FakeReplica("a")

    async def main():
        async with balancer_over([fake]) as h:
            stub = h.client._stub  # the typed stub, so the request goes as built
            request = make()
            try:
                if method == "unary":
                    await stub.Generate(request, timeout=30)
                else:
                    async for _ in stub.GenerateStream(request, timeout=30):
                        pass
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()
            return grpc.StatusCode.OK, ""

    code, details = run(main())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details[:300])
    assert word in details and len(details) < 1000, details
    assert fake.calls == 0  # refused where it entered


def test_a_stream_with_n_past_the_limit_builds_no_journal():
    from fastgen.balancer.journal import DEFAULT_MIGRATION, journal_for
    from fastgen.balancer.limits import RequestRefused, check_request

    request = _request(n=MAX_UINT32)
    with pytest.raises(RequestRefused, match="n must be"):
        check_request(request)
    # The journal itself never trusts n either: a request that reached it unchecked cannot make it allocate n entries.
    assert len(journal_for(_request(n=MAX_UINT32), DEFAULT_MIGRATION).completions) <= 128


# ---- prefix-aware routing: the size checked first, big prompts tokenized off the event loop -----------------------
class RecordingTokenizer:
    """Encodes one id per character and notes which thread did it."""

    def __init__(self):
        self.threads: list[int] = []

    def encode_text(self, text: str) -> list[int]:
        self.threads.append(threading.get_ident())
        return [1] * len(text)

    def encode_chat(self, messages) -> list[int]:
        self.threads.append(threading.get_ident())
        return [1] * sum(len(m["content"]) for m in messages)


def test_prefix_routing_checks_the_size_first_and_tokenizes_big_prompts_off_the_event_loop():
    from fastgen.balancer.prefix_index import PromptHasher

    fake = FakeReplica("a")
    tokenizer = RecordingTokenizer()

    async def main():
        async with balancer_over([fake], policy="prefix_aware") as h:
            h.pool.hasher = PromptHasher(tokenizer)
            loop_thread = threading.get_ident()
            stub = h.client._stub
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(pb.GenerateRequest(text="x" * HUGE_CHARS), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert tokenizer.threads == []  # refused before it was tokenized
            await stub.Generate(pb.GenerateRequest(text="short"), timeout=30)
            await stub.Generate(pb.GenerateRequest(text="y" * 1_000_000), timeout=30)
            return loop_thread

    loop_thread = run(main())
    assert len(tokenizer.threads) == 2 and tokenizer.threads[1] != loop_thread
    assert fake.calls == 2


# ---- the HTTP API ---------------------------------------------------------------------------------------------------
def test_a_completion_with_too_many_prompts_is_refused_before_anything_is_built():
    with pytest.raises(ApiError) as refused:
        parse_completion({"prompt": ["a"] * 200_000}, "id")
    assert refused.value.status == 400 and refused.value.param == "prompt" and "prompts" in refused.value.message
    with pytest.raises(ApiError) as refused:
        parse_completion({"prompt": [[1, 2]] * 200_000}, "id")
    assert refused.value.status == 400 and refused.value.param == "prompt"


def test_n_times_prompts_is_capped():
    from fastgen.balancer.limits import MAX_CHOICES_PER_CALL, MAX_N, MAX_PROMPTS_PER_CALL

    prompts = min(MAX_PROMPTS_PER_CALL, MAX_CHOICES_PER_CALL // MAX_N + 1)
    assert prompts * MAX_N > MAX_CHOICES_PER_CALL
    with pytest.raises(ApiError) as refused:
        parse_completion({"prompt": ["a"] * prompts, "n": MAX_N}, "id")
    assert refused.value.status == 400 and refused.value.param == "n"
    parse_completion({"prompt": ["a"] * MAX_PROMPTS_PER_CALL}, "id")  # at the limit: fine


def test_long_http_prompts_are_refused_before_they_are_copied():
    with pytest.raises(ApiError) as refused:
        parse_completion({"prompt": [7] * HUGE_IDS}, "id")
    assert refused.value.status == 400 and refused.value.param == "prompt"
    with pytest.raises(ApiError) as refused:
        parse_chat({"messages": [{"role": "user", "content": "x"}] * 100_000}, "id")
    assert refused.value.status == 400 and refused.value.param == "messages"


@pytest.mark.parametrize("key", ["²", "١", "𝟙", " 5", "1" * 40, "-1", "0x10"])
def test_odd_logit_bias_keys_are_400s(key):
    with pytest.raises(ApiError) as refused:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {key: 1}}, "id")
    assert refused.value.status == 400 and refused.value.param == "logit_bias"


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "a\ud800b"},
        {"prompt": ["ok", "\udfff"]},
        {"prompt": "hi", "stop": ["\ud800"]},
        {"prompt": "hi", "cache_salt": "\ud800"},
        {"messages": [{"role": "user", "content": "\ud800"}]},
        {"messages": [{"role": "\ud800", "content": "hi"}]},
    ],
)
def test_lone_surrogates_are_400s(body):
    parse = parse_chat if "messages" in body else parse_completion
    with pytest.raises(ApiError) as refused:
        parse(body, "id")
    assert refused.value.status == 400 and "UTF-8" in refused.value.message


def test_odd_bodies_over_http_are_4xx_with_a_message():
    async def main():
        async with http_over([FakeReplica("a")]) as http:
            answers = []
            for raw in (
                "[" * 100_000 + "]" * 100_000,  # nested past any parser's recursion
                '{"prompt": "a\\ud800"}',  # a lone surrogate, escaped as JSON allows
                '{"prompt": "hi", "logit_bias": {"\\u00b2": 1}}',  # "²": str.isdigit() but not a number
                json.dumps({"prompt": [[1]] * 100_000}),  # a hundred thousand prompts, each an upstream call
                '{"prompt": ' + "[]," * 1_500_000 + "[]}",  # 4.5 MB that would be 1.5 million Python lists
            ):
                r = await http.post("/v1/completions", raw)
                answers.append((r.status, (await r.json())["error"]["message"]))
            return answers

    for status, message in run(main()):
        assert 400 <= status < 500 and message, (status, message)


# ---- smaller things -------------------------------------------------------------------------------------------------
def _chunk(index: int, tokens: int, alternatives: int) -> pb.GenerateChunk:
    top = [pb.TopLogprob(token_id=1, token="x" * 100, logprob=-1.0)] * alternatives
    logprobs = [pb.TokenLogprob(token_id=1, token="x" * 100, logprob=-1.0, top=top)] * tokens
    return pb.GenerateChunk(request_id="r", index=index, token_ids=[1] * tokens, logprobs=logprobs)


def test_the_journal_counts_bytes_so_logprobs_cannot_outgrow_it():
    from fastgen.balancer.journal import DEFAULT_MIGRATION_MAX_BYTES

    journal = Journal(_request(logprobs=True, top_logprobs=20), max_len=1_000_000)
    chunk = _chunk(0, 100, 20)
    while not journal.untracked:
        journal.record(chunk)
        assert journal.tokens <= 1_000_000
    assert journal.chunks * chunk.ByteSize() > DEFAULT_MIGRATION_MAX_BYTES  # it let go because of bytes
    plain = Journal(_request(), max_len=1_000)
    plain.record(_chunk(0, 100, 0))
    assert not plain.untracked and plain.tokens == 100


def test_serving_without_a_key_beyond_loopback_is_warned_about(caplog):
    from fastgen.balancer.__main__ import parse_args, warn_if_exposed

    with caplog.at_level(logging.WARNING, logger="fastgen.balancer"):
        for host, key in (("127.0.0.1", None), ("::1", None), ("localhost", None), ("0.0.0.0", "k"), ("10.0.0.5", "k")):
            warn_if_exposed(parse_args(["--host", host, "--replica", "r0=a:1"] + (["--api-key", key] if key else [])))
        assert not caplog.records
        warn_if_exposed(parse_args(["--host", "0.0.0.0", "--replica", "r0=a:1", "--api-key", ""]))
    assert len(caplog.records) == 1 and "API key" in caplog.records[0].getMessage()
    assert "0.0.0.0" in caplog.records[0].getMessage()


def test_client_facing_errors_do_not_name_replica_addresses():
    fakes = [FakeReplica("a"), FakeReplica("b")]

    async def main():
        async with http_over(fakes, healthy=False) as http:
            r = await http.post("/v1/completions", {"prompt": "hi"})
            message = (await r.json())["error"]["message"]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await http.harness.client._stub.Generate(pb.GenerateRequest(text="hi"), timeout=10)
            return r.status, message, err.value.details()

    status, message, details = run(main())
    assert status == 503 and "no healthy replica" in message and "a" in message
    for text in (message, details):
        assert "127.0.0.1" not in text and "NOT_SERVING" in text


def test_status_shows_addresses_and_paths_to_operators_only():
    from fastgen.balancer.service import status_for_caller

    status = pb.StatusResponse(
        role="balancer",
        replicas=[pb.ReplicaStatus(replica="a", address="10.0.0.1:50051", tokenizer_path="/models/secret")],
    )
    operator = status_for_caller(status, operator=True)
    tenant = status_for_caller(status, operator=False)
    assert operator.replicas[0].address == "10.0.0.1:50051" and operator.replicas[0].tokenizer_path
    assert (
        tenant.replicas[0].replica == "a" and not tenant.replicas[0].address and not tenant.replicas[0].tokenizer_path
    )
    assert status.replicas[0].address  # the balancer's own copy is left as it is


def test_get_status_over_grpc_hides_addresses_from_api_key_callers():
    from prometheus_client import CollectorRegistry

    from fastgen.balancer.policy import Router
    from fastgen.balancer.pool import ReplicaPool, ReplicaSpec
    from fastgen.balancer.service import BalancerService
    from fastgen.server import AsyncClient
    from fastgen.server.grpc_server import ServerSecurity, create_server
    from fastgen.server.metrics import BalancerMetrics
    from fastgen.testing import free_port

    async def main():
        metrics = BalancerMetrics(CollectorRegistry())
        pool = ReplicaPool([ReplicaSpec("a", "10.0.0.1:50051")], 60.0, 1.0, metrics)
        service = BalancerService(pool, Router("round_robin", 1), metrics, 0, operator_tokens=("internal",))
        port = free_port()
        server, _ = create_server(service, "127.0.0.1", port, ServerSecurity(("key", "internal"), "send a key"))
        await server.start()
        seen = {}
        try:
            for key in ("key", "internal"):
                async with AsyncClient(f"127.0.0.1:{port}", timeout=10, api_key=key) as client:
                    seen[key] = [r.address for r in (await client.status()).replicas]
        finally:
            await server.stop(None)
            await pool.close()
        return seen

    assert run(main()) == {"key": [""], "internal": ["10.0.0.1:50051"]}


def test_one_failed_dns_answer_does_not_empty_the_pool():
    from fastgen.balancer.discovery import MISSES_BEFORE_REMOVAL, Discovery
    from fastgen.balancer.pool import ReplicaPool, ReplicaSpec

    spec = ReplicaSpec("10.0.0.1:50051", "10.0.0.1:50051")

    class ScriptedDns:
        kind = "dns"
        misses_before_removal = MISSES_BEFORE_REMOVAL

        def __init__(self, answers):
            self.answers = answers

        def describe(self) -> str:
            return "scripted DNS"

        async def lookup(self):
            return self.answers.pop(0)

    async def main():
        misses = MISSES_BEFORE_REMOVAL
        answers = [[spec], [], [spec]] + [[]] * misses
        pool = ReplicaPool([], 0.05, 1.0)
        discovery = Discovery(pool, [ScriptedDns(answers)])
        members = []
        try:
            for _ in range(3 + misses):
                await discovery.refresh(0)
                members.append([r.id for r in pool.replicas])
        finally:
            await pool.close()
        return members

    members = run(main())
    assert members[:-1] == [[spec.id]] * (len(members) - 1)  # one NXDOMAIN (an empty answer) is not enough
    assert members[-1] == []  # several in a row are


# ---- tenants: the prefix cache is shared only within a tenant -----------------------------------------------------
def test_cache_salt_is_derived_from_the_callers_key_when_keys_are_per_tenant():
    from fastgen.balancer.tenants import salted_for

    a, b = _request(), _request()
    a_salted, b_salted = salted_for(a, "key-a", per_tenant=True), salted_for(b, "key-b", per_tenant=True)
    assert a_salted.params.cache_salt and a_salted.params.cache_salt != b_salted.params.cache_salt
    assert "key-a" not in a_salted.params.cache_salt  # a hash, never the key
    assert salted_for(a, "key-a", per_tenant=True).params.cache_salt == a_salted.params.cache_salt  # stable
    own = salted_for(_request(cache_salt="mine"), "key-a", per_tenant=True).params.cache_salt
    assert own not in ("mine", a_salted.params.cache_salt)  # a tenant's own salt partitions within its tenant
    assert salted_for(a, "key-a", per_tenant=False) is a  # one key: the shared cache, as before
    assert not a.params.cache_salt  # the caller's message is left as it is


def test_each_tenant_key_reaches_the_replicas_with_its_own_salt():
    @dataclass
    class SaltRecordingReplica(FakeReplica):
        salts: list = field(default_factory=list)

        async def Generate(self, request, context):
            self.salts.append(request.params.cache_salt)
            return await super().Generate(request, context)

    fake = SaltRecordingReplica("a")

    async def main():
        async with balancer_over([fake]) as h:
            for per_tenant in (False, True):
                h.balancer.per_tenant_salt = per_tenant
                for caller in ("key-a", "key-b", "key-a"):
                    await h.balancer.generate(_request(), caller=caller)

    run(main())
    shared, tenants = fake.salts[:3], fake.salts[3:]
    assert shared == ["", "", ""]  # one tenant: the cache stays shared, as before
    assert tenants[0] == tenants[2] != tenants[1] and all(tenants)


def test_several_api_keys_make_tenants_and_the_internal_token_an_operator(tmp_path):
    from fastgen.balancer.__main__ import parse_args, security_from_args

    keys = tmp_path / "keys"
    keys.write_text("# tenants\nkey-a\nkey-b  # the second\n\n")
    token = tmp_path / "token"
    token.write_text("internal\n")
    one = security_from_args(parse_args(["--replica", "r0=a:1", "--api-key", "key-a"]))
    assert not one.per_tenant and one.operator_tokens == ()
    several = security_from_args(
        parse_args(["--replica", "r0=a:1", "--api-keys-file", str(keys), "--auth-token-file", str(token)])
    )
    assert several.api_keys == ("key-a", "key-b") and several.per_tenant
    assert set(several.server.tokens) == {"key-a", "key-b", "internal"} and several.operator_tokens == ("internal",)
    assert security_from_args(parse_args(["--replica", "r0=a:1"])).operator_tokens is None  # open: as before


def test_the_balancers_limits_are_the_replicas():
    from fastgen.balancer import limits
    from fastgen.replica import request

    for name in (
        "MAX_N",
        "MAX_TOP_LOGPROBS",
        "MAX_STOP_STRINGS",
        "MAX_STOP_CHARS",
        "MAX_STOP_TOKEN_IDS",
        "MAX_LOGIT_BIAS",
        "MAX_CACHE_SALT_CHARS",
        "MAX_REQUEST_ID_CHARS",
    ):
        assert getattr(limits, name) == getattr(request, name), name


def test_max_model_len_tightens_the_prompt_limits():
    from fastgen.balancer.limits import DEFAULT_PROMPT_LIMITS, PromptLimits, RequestRefused, check_request

    limits = PromptLimits.for_model_len(100)
    assert PromptLimits.for_model_len(None) == DEFAULT_PROMPT_LIMITS
    check_request(_ids(100), limits)
    with pytest.raises(RequestRefused, match="101 token ids"):
        check_request(_ids(101), limits)
    with pytest.raises(RequestRefused, match="characters"):
        check_request(pb.GenerateRequest(text="x" * (limits.max_chars + 1)), limits)


# ---- end to end -----------------------------------------------------------------------------------------------------
KEY = "sk-hardening"
RSS_GROWTH_LIMIT = 300 << 20


@pytest.fixture(scope="module")
def deployment(tiny_model_dir, tmp_path_factory):
    from fastgen.testing import free_port

    from .helpers import start_balancer, start_replica, wait_serving

    logs = tmp_path_factory.mktemp("hardening-logs")
    replica = start_replica(tiny_model_dir, "r0", logs)
    balancer, http_port = None, free_port()
    try:
        wait_serving(replica)
        balancer = start_balancer(
            {"r0": replica.address},
            logs,
            policy="prefix_aware",
            extra_args=["--api-key", KEY, "--http-port", str(http_port)],
        )
        wait_serving(balancer)
        yield replica, balancer, http_port
    finally:
        if balancer is not None:
            balancer.kill()
        replica.kill()


def _post(port: int, path: str, body: bytes) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=body,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.slow
def test_huge_counts_are_refused_and_the_balancer_stays_small_and_serving(deployment):
    from fastgen.server.client import channel_security
    from fastgen.server.grpc_server import CHANNEL_OPTIONS
    from fastgen.server.tls import open_channel

    replica, balancer, http_port = deployment
    process = psutil.Process(balancer.pid)
    metadata = channel_security(KEY).metadata
    with contextlib.closing(open_channel(balancer.address, CHANNEL_OPTIONS, None, None)) as channel:
        from fastgen.proto import fastgen_pb2_grpc

        stub = fastgen_pb2_grpc.GenerationStub(channel)
        stub.Generate(_request(max_new_tokens=2), metadata=metadata, timeout=120)  # warm: the baseline is steady
        rss_before = process.memory_info().rss
        codes = []
        for call, request in (
            (stub.GenerateStream, _request(n=MAX_UINT32, max_new_tokens=1)),
            (stub.Generate, _request(n=MAX_UINT32, max_new_tokens=1)),
            (stub.GenerateStream, _ids(HUGE_IDS)),
            (stub.Generate, _ids(HUGE_IDS)),
        ):
            try:
                result = call(request, metadata=metadata, timeout=120)
                list(result) if call is stub.GenerateStream else result
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
        body = json.dumps({"prompt": ["a"] * 200_000, "max_tokens": 1}).encode()
        status, text = _post(http_port, "/v1/completions", body)
        rss_after = process.memory_info().rss
        answer = stub.Generate(_request(max_new_tokens=3, ignore_eos=True), metadata=metadata, timeout=120)
    refused = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert all(c in refused for c in codes), codes
    assert 400 <= status < 500 and "prompt" in text, (status, text[:500])
    assert rss_after - rss_before < RSS_GROWTH_LIMIT, (rss_before, rss_after)
    assert answer.generated_tokens == 3
    assert replica.alive() and balancer.alive()
