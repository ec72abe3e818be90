"""Fuzzing the wire: hypothesis-generated GenerateRequests (random and extreme field values, huge and empty prompts,
odd unicode, out-of-vocabulary ids, huge stop lists, NaN and infinite floats, every prompt kind, unary and stream)
and raw bytes that do not parse, sent to a live replica and to the balancer in front of it; and JSON bodies sent to
the balancer's OpenAI-compatible HTTP API. Sizes and counts are drawn past every limit (limits.py): n up to 2**32-1,
hundreds of thousands of prompts, prompts of millions of token ids or characters, stop lists and logit_bias maps of
a hundred thousand entries, max_tokens past uint32, and JSON nested past the parser's recursion or made of millions
of tiny values.

    python -m fastgen.benchmarks.fuzz --examples 10000 --json benchmarks/results/fuzz.json

Every answer must be OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED (over HTTP: 200 or a 4xx, counted as those): never
INTERNAL, UNKNOWN, a 5xx or a missed deadline, no process may die, and a greedy request sent before the fuzzing is
answered with the same tokens after it. The command starts its own replica (the tests' tiny random model with
SmolLM2's tokenizer) and balancer, prints the answers counted by status code and writes them, with any request that
broke a rule, to --json with the command, commit, date and machine. tests/test_fuzz.py runs the same strategies and
checks with a few hundred examples.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from ..proto import fastgen_pb2 as pb
from ..proto import fastgen_pb2_grpc
from ..replica.prompts import CHAT_ROLES
from ..server.grpc_server import CHANNEL_OPTIONS

VOCAB = 49152  # the tiny model's (SmolLM2's tokenizer)
ALLOWED = frozenset({grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED})
CALL_TIMEOUT_S = 120.0  # a request that takes longer is a hang: it fails the run as DEADLINE_EXCEEDED
REFERENCE = pb.GenerateRequest(
    request_id="fuzz-reference",
    token_ids=pb.TokenIds(ids=[1, 504, 3458, 314, 253, 1167, 30]),
    params=pb.SamplingParams(max_new_tokens=12, ignore_eos=True),
)

# ---- strategies ---------------------------------------------------------------------------------------------------
FLOAT_EXTREMES = (
    math.nan,
    math.inf,
    -math.inf,
    0.0,
    -0.0,
    1e-45,
    -1e-45,
    3.4e38,
    -3.4e38,
    0.5,
    1.0,
    2.0,
    -2.0,
    100.0,
    -100.0,
    1e4,
    1e5,
)
U32_EXTREMES = (2**31 - 1, 2**31, 2**32 - 1)
I32_EXTREMES = (-(2**31), -1, VOCAB, VOCAB + 1, 2**31 - 1)
ODD_TEXT = (
    "\x00",
    "\u200b\u200d\ufeff",
    "\U0010ffff\ufffe\uffff",
    "e\u0301\u0301\u0301",
    "\u202e\u05d0\u0627",
    "🙂👩\u200d👩\u200d👧",
    "<|im_start|>",
    "<|im_end|><|endoftext|>",
    "{{ raise_exception('x') }}{% for %}",
    "\r\n\t\x0b\x0c",
    "漢字かなカナ",
    "",
)

floats = st.one_of(
    st.sampled_from(FLOAT_EXTREMES),
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.floats(-3.0, 3.0, width=32),
)
u32 = st.one_of(st.integers(0, 8), st.sampled_from(U32_EXTREMES), st.integers(0, 2**32 - 1))
in_vocab = st.integers(0, VOCAB - 1)
any_id = st.one_of(in_vocab, st.sampled_from(I32_EXTREMES), st.integers(-(2**31), 2**31 - 1))
texts = st.one_of(st.text(max_size=40), st.sampled_from(ODD_TEXT), st.lists(st.sampled_from(ODD_TEXT)).map("".join))
# Repeats rather than long draws: hypothesis draws long lists slowly, and a repeat is as big a message.
huge_texts = st.builds(lambda s, k: s * k, st.text(min_size=1, max_size=4), st.integers(2_000, 400_000))
long_strings = st.builds(lambda c, k: c * k, st.characters(), st.integers(200, 5_000))
# Past the balancer's limits on a prompt (balancer/limits.py: 2**20 token ids, 8 Mi characters).
past_limit_texts = st.builds(lambda k: "x" * k, st.integers(8 << 20, 12 << 20))


def repeated(element, lo: int, hi: int):
    return st.builds(lambda x, k: [x] * k, element, st.integers(lo, hi))


def _bias_map(count: int, bias: float) -> dict[int, float]:
    return dict.fromkeys(range(count), bias)


def _with_text(text: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text)


def _with_ids(ids: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids))


def _with_messages(messages: list[pb.ChatMessage]) -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    request.messages.messages.extend(messages)
    request.messages.SetInParent()  # an empty list is still "messages"
    return request


messages = st.builds(pb.ChatMessage, role=st.one_of(st.sampled_from(CHAT_ROLES), st.text(max_size=8)), content=texts)
prompts = st.one_of(
    st.builds(_with_text, st.one_of(texts, huge_texts)),
    st.builds(_with_ids, st.one_of(st.lists(in_vocab, max_size=24), st.lists(any_id, max_size=8))),
    st.builds(_with_ids, st.one_of(repeated(in_vocab, 1_000, 200_000), repeated(in_vocab, 1_000_000, 3_000_000))),
    st.builds(_with_text, past_limit_texts),
    st.builds(_with_messages, st.one_of(st.lists(messages, max_size=4), repeated(messages, 1_000, 100_000))),
    st.just(pb.GenerateRequest()),  # no prompt at all
)
# Valid values, so that most requests run: a handful of tokens each keeps a run quick.
VALID = {
    "max_new_tokens": st.integers(1, 4),
    "min_new_tokens": st.integers(0, 3),
    "temperature": st.floats(0.0, 2.0, width=32),
    "top_p": st.floats(0.0, 1.0, width=32),  # 0: off
    "top_k": st.integers(0, 50),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2.0, 2.0, width=32),
    "frequency_penalty": st.floats(-2.0, 2.0, width=32),
    "repetition_penalty": st.floats(0.5, 2.0, width=32),
    "min_p": st.floats(0.0, 1.0, width=32),
    "logit_bias": st.dictionaries(in_vocab, st.floats(-100.0, 100.0, width=32), max_size=4),
    "stop_token_ids": st.lists(in_vocab, max_size=3),
    "n": st.integers(0, 3),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "include_stop_str_in_output": st.booleans(),
    "keep_special_tokens": st.booleans(),
    "echo": st.booleans(),
    "cache_salt": st.text(max_size=8),
}
# Extreme values: out of range, NaN and infinities, the integer types' limits, lists far past their limits, and the
# sizes that are valid but costly (the default 256 tokens, 128 completions, a context's worth of tokens).
WILD = {
    "max_new_tokens": st.sampled_from((0, 1023, 1024, *U32_EXTREMES)),
    "min_new_tokens": st.sampled_from((5, 1023, *U32_EXTREMES)),
    "temperature": floats,
    "top_p": floats,
    "top_k": u32,
    "seed": st.one_of(st.integers(0, 2**64 - 1), st.sampled_from((0, 2**63 - 1, 2**63, 2**64 - 1))),
    "stop": st.one_of(
        st.lists(texts, max_size=3),
        repeated(st.text(min_size=1, max_size=3), 17, 100_000),
        st.lists(long_strings, max_size=2),
    ),
    "presence_penalty": floats,
    "frequency_penalty": floats,
    "repetition_penalty": floats,
    "min_p": floats,
    "logit_bias": st.one_of(
        st.dictionaries(any_id, floats, max_size=6),
        st.builds(_bias_map, st.integers(1_000, 200_000), st.floats(-100, 100, width=32)),
    ),
    "stop_token_ids": st.one_of(st.lists(any_id, max_size=6), repeated(in_vocab, 1_000, 100_000)),
    "n": st.sampled_from((128, 129, 2**32 - 1)),
    "top_logprobs": st.one_of(st.integers(0, 21), st.sampled_from(U32_EXTREMES)),
    "cache_salt": long_strings,
}


def _wild_fields(count: int):
    """`count` fields of WILD (fewer when two draws pick the same one), as a dict."""
    one = st.sampled_from(sorted(WILD)).flatmap(lambda name: WILD[name].map(lambda value: {name: value}))
    return st.lists(one, min_size=count, max_size=count).map(lambda ds: {k: v for d in ds for k, v in d.items()})


@st.composite
def sampling_params(draw) -> pb.SamplingParams:
    """Valid values for some fields, and none, one or two extreme ones."""
    fields = draw(st.fixed_dictionaries({}, optional=VALID))
    fields.update(draw(st.sampled_from((0, 0, 1, 2)).flatmap(_wild_fields)))
    return pb.SamplingParams(**fields)


request_ids = st.one_of(st.just(""), st.text(max_size=12), long_strings)


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """A GenerateRequest of any prompt kind, with parameters left unset or drawn field by field."""
    request = draw(prompts)
    request.request_id = draw(request_ids)
    params = draw(st.one_of(st.none(), sampling_params()))
    if params is not None:
        request.params.CopyFrom(params)
    if draw(st.integers(0, 19)) == 0:  # output "already delivered", which only the balancer may set
        request.resume.token_ids.extend(draw(st.one_of(st.lists(in_vocab, max_size=4), repeated(in_vocab, 1, 100_000))))
    return request


def _corrupt(data: bytes, at: int, byte: int) -> bytes:
    if not data:
        return bytes([byte])
    at %= len(data)
    return data[:at] + bytes([byte]) + data[at + 1 :]


_text_request = st.builds(lambda t: pb.GenerateRequest(text=t).SerializeToString(), st.text(min_size=1, max_size=20))
raw_messages = st.one_of(
    st.binary(max_size=64),
    # A valid message with one byte replaced: often a string field that is no longer UTF-8.
    st.builds(_corrupt, _text_request, st.integers(0, 64), st.sampled_from((0x80, 0xC0, 0xFF, 0xFE, 0xED))),
)


# ---- HTTP bodies: a small valid request with sizes and counts past the limits, and JSON that is odd in itself ------
HTTP_SMALL = {"max_tokens": st.integers(1, 4), "temperature": st.sampled_from((0, 0.7)), "seed": st.integers(0, 99)}
HTTP_SIZES = {
    "n": st.sampled_from((2, 128, 129, 2**32 - 1, 2**64, -1)),
    "max_tokens": st.sampled_from((2**31, 2**32 - 1, 2**32, 2**64, 10**400)),
    "prompt": st.one_of(
        repeated(st.just("a"), 257, 300_000),  # many prompts: each would be an upstream call
        repeated(repeated(in_vocab, 1, 2), 257, 100_000),
        repeated(in_vocab, 1_000_000, 3_000_000),  # one long token-id prompt
        repeated(st.sampled_from(("a\ud800", "\udfff", "ok")), 1, 3),  # lone surrogates
    ),
    "messages": st.one_of(
        repeated(st.just({"role": "user", "content": "x"}), 16_385, 100_000),
        st.just([{"role": "user", "content": "\ud800"}]),
    ),
    "stop": st.one_of(repeated(st.just("x"), 17, 100_000), st.builds(lambda k: ["x" * k], st.integers(257, 100_000))),
    "logit_bias": st.one_of(
        st.builds(lambda k: {str(i): 1 for i in range(k)}, st.integers(1_025, 200_000)),
        st.sampled_from(({"\u00b2": 1}, {"\u0661": 1}, {"1" * 5_000: 1}, {" 5": 1}, {"-1": 1}, {"5": 1e400})),
    ),
    "stop_token_ids": repeated(in_vocab, 1_025, 100_000),
    "top_logprobs": st.sampled_from((21, 2**32, -1)),
    "cache_salt": st.one_of(long_strings, st.just("\ud800")),
}


def _http_body(kind: str, fields: dict) -> bytes:
    base = {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "hi"}
    # ensure_ascii: a lone surrogate travels as the JSON escape a client would send.
    return json.dumps({**base, **fields}, ensure_ascii=True).encode()


@st.composite
def http_bodies(draw, kind: str) -> bytes:
    fields = draw(st.fixed_dictionaries({}, optional=HTTP_SMALL))
    other_route = "prompt" if kind == "chat" else "messages"
    sizes = sorted(set(HTTP_SIZES) - {other_route})
    for name in draw(st.lists(st.sampled_from(sizes), max_size=2, unique=True)):
        fields[name] = draw(HTTP_SIZES[name])
    return _http_body(kind, fields)


odd_json = st.one_of(
    st.builds(lambda k: b"[" * k + b"]" * k, st.integers(1_000, 200_000)),  # nested past the parser's recursion
    st.builds(lambda k: b'{"prompt": ' + b"[]," * k + b"[]}", st.integers(100_000, 3_000_000)),  # tiny values
    st.builds(lambda k: b'{"prompt": [' + b"1," * k + b"1]}", st.integers(100_000, 3_000_000)),
    st.sampled_from(
        (
            b"",
            b"null",
            b'"prompt"',
            b"1e400",
            b'{"prompt": "hi", "n": NaN}',
            b'{"prompt": "hi", "temperature": Infinity}',
            b'{"prompt": "hi", "prompt": ["a", 1]}',
            b'{"prompt": "hi\\ud800"}',  # a lone surrogate, as a JSON escape
            b'{"prompt": "\xff\xfe"}',
            b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5_000 + b"}",
        )
    ),
)


@dataclass(frozen=True)
class Case:
    """One call: what to send (a message, raw bytes, or an HTTP body), where and how."""

    target: str  # "replica" | "balancer" | "http" (the balancer's HTTP API)
    method: str  # "unary" | "stream"; over HTTP "chat" | "completion"
    request: pb.GenerateRequest | None = None
    raw: bytes | None = None
    body: bytes | None = None

    def describe(self, limit: int = 600) -> str:
        if self.body is not None:
            body = repr(self.body)
        else:
            body = repr(self.raw) if self.raw is not None else str(self.request).replace("\n", " ")
        return f"{self.target} {self.method}: {body[:limit]}{' ...' if len(body) > limit else ''}"


TARGETS = ("replica", "balancer")
METHODS = ("unary", "stream")
HTTP_ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
message_cases = st.builds(Case, st.sampled_from(TARGETS), st.sampled_from(METHODS), request=generate_requests())
raw_cases = st.builds(Case, st.sampled_from(TARGETS), st.sampled_from(METHODS), raw=raw_messages)
http_cases = st.sampled_from(sorted(HTTP_ROUTES)).flatmap(
    lambda kind: st.builds(Case, st.just("http"), st.just(kind), body=st.one_of(http_bodies(kind), odd_json))
)
grpc_cases = st.one_of(message_cases, message_cases, message_cases, raw_cases)  # one in four does not parse
cases = st.one_of(grpc_cases, grpc_cases, http_cases)  # one in three at the HTTP API


# ---- sending and checking -----------------------------------------------------------------------------------------
class HttpEndpoint:
    """The balancer's OpenAI-compatible HTTP API at http://address."""

    def __init__(self, address: str):
        self.url = f"http://{address}"

    def post(self, path: str, body: bytes, timeout: float) -> tuple[int, str]:
        request = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def close(self) -> None:
        pass


def http_call(endpoint: HttpEndpoint, case: Case, timeout: float) -> tuple[grpc.StatusCode, str]:
    """The HTTP answer in gRPC's terms: 200 is OK, 429 RESOURCE_EXHAUSTED, another 4xx INVALID_ARGUMENT, anything
    else (a 5xx) UNKNOWN with its body; a timeout is DEADLINE_EXCEEDED."""
    try:
        status, text = endpoint.post(HTTP_ROUTES[case.method], case.body, timeout)
    except TimeoutError:
        return grpc.StatusCode.DEADLINE_EXCEEDED, "no HTTP answer in time"
    except OSError as e:  # the connection broke: the balancer may have died
        return grpc.StatusCode.UNAVAILABLE, f"HTTP connection failed: {e}"
    if status == 200:
        return grpc.StatusCode.OK, "" if text else "an empty 200"
    if status == 429:
        return grpc.StatusCode.RESOURCE_EXHAUSTED, text[:300]
    if 400 <= status < 500:
        return grpc.StatusCode.INVALID_ARGUMENT, text[:300]
    return grpc.StatusCode.UNKNOWN, f"HTTP {status}: {text[:300]}"


class Endpoint:
    """Typed and raw-bytes stubs of Generation at one address."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = fastgen_pb2_grpc.GenerationStub(self.channel)
        identity = {"request_serializer": None, "response_deserializer": None}
        self.raw_unary = self.channel.unary_unary("/fastgen.v1.Generation/Generate", **identity)
        self.raw_stream = self.channel.unary_stream("/fastgen.v1.Generation/GenerateStream", **identity)

    def close(self) -> None:
        self.channel.close()


def call(endpoint, case: Case, timeout: float = CALL_TIMEOUT_S) -> tuple[grpc.StatusCode, str]:
    """Sends the case; returns its status and the error's message, or for an OK answer what is wrong with it ("" if
    nothing)."""
    if case.target == "http":
        return http_call(endpoint, case, timeout)
    try:
        if case.raw is not None:
            if case.method == "unary":
                endpoint.raw_unary(case.raw, timeout=timeout)
            else:
                list(endpoint.raw_stream(case.raw, timeout=timeout))
            return grpc.StatusCode.OK, ""
        if case.method == "unary":
            return grpc.StatusCode.OK, check_response(
                case.request, endpoint.stub.Generate(case.request, timeout=timeout)
            )
        chunks = list(endpoint.stub.GenerateStream(case.request, timeout=timeout))
        return grpc.StatusCode.OK, check_chunks(case.request, chunks)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def _n(request: pb.GenerateRequest) -> int:
    return request.params.n or 1


def check_response(request: pb.GenerateRequest, response: pb.GenerateResponse) -> str:
    choices = list(response.choices) or [response]
    if len(choices) != _n(request):
        return f"{len(choices)} completions for n={_n(request)}"
    for c in choices:
        if c.finish_reason == pb.FINISH_REASON_UNSPECIFIED or len(c.token_ids) != c.generated_tokens:
            return (
                f"completion {c.index}: finish {c.finish_reason}, {len(c.token_ids)} ids, {c.generated_tokens} counted"
            )
        if request.params.max_new_tokens and c.generated_tokens > request.params.max_new_tokens:
            return f"completion {c.index} generated {c.generated_tokens} > max_new_tokens"
    return ""


def check_chunks(request: pb.GenerateRequest, chunks: list[pb.GenerateChunk]) -> str:
    finished = {c.index for c in chunks if c.finish_reason != pb.FINISH_REASON_UNSPECIFIED}
    if finished != set(range(_n(request))):
        return f"stream finished completions {sorted(finished)} of n={_n(request)}"
    return ""


@dataclass
class Tally:
    """Answers by (target, method, code), and the calls that broke a rule."""

    counts: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def add(self, case: Case, code: grpc.StatusCode, problem: str) -> str:
        self.counts[(case.target, case.method, code.name)] += 1
        if code not in ALLOWED or (code == grpc.StatusCode.OK and problem):
            problem = f"{code.name}: {problem}"
            self.failures.append(f"{problem[:300]} <- {case.describe()}")
            return problem
        return ""

    def by_code(self) -> dict[str, int]:
        out: Counter = Counter()
        for (_, _, code), k in self.counts.items():
            out[code] += k
        return dict(out)


def reference_tokens(endpoint: Endpoint) -> list[int]:
    return list(endpoint.stub.Generate(REFERENCE, timeout=CALL_TIMEOUT_S).token_ids)


def references(endpoints: dict) -> dict[str, list[int]]:
    """The reference request's tokens from every gRPC endpoint."""
    return {t: reference_tokens(e) for t, e in endpoints.items() if isinstance(e, Endpoint)}


def run_cases(endpoints: dict[str, Endpoint], examples: int, tally: Tally, seed: int | None = None) -> None:
    """Sends `examples` generated cases (generation only: no shrinking, every answer is counted)."""

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(cases)
    def one(case: Case) -> None:
        code, problem = call(endpoints[case.target], case)
        tally.add(case, code, problem)

    if seed is not None:
        one = hypothesis_seed(seed)(one)
    one()


# ---- the command --------------------------------------------------------------------------------------------------
def start_deployment(log_dir: Path):
    """A replica of the tiny model and a balancer in front of it (with its HTTP API); returns both and the HTTP
    address once they serve."""
    from ..testing import cached_tiny_model, free_port, start_server, wait_grpc_serving

    replica = start_server(
        "replica",
        "replica",
        ["--replica-id", "r0", "--model", str(cached_tiny_model()), "--dtype", "float32", "--threads", "1"]
        + ["--max-batch-tokens", "256", "--max-seqs", "32", "--block-size", "16", "--num-blocks", "512"],
        log_dir,
    )
    wait_grpc_serving(replica)
    http_port = free_port()
    args = ["--replica", f"r0={replica.address}", "--http-port", str(http_port)]
    balancer = start_server("balancer", "balancer", args, log_dir)
    wait_grpc_serving(balancer)
    return replica, balancer, f"127.0.0.1:{http_port}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fastgen.benchmarks.fuzz",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--examples", type=int, default=10_000, help="generated calls (default 10000)")
    p.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random, printed)")
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    p.add_argument("--logs", type=Path, default=None, help="server logs (default: a temporary folder)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import random

    from .provenance import run_info

    args = parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    log_dir = args.logs or Path(tempfile.mkdtemp(prefix="fastgen-fuzz-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    # A timeout's SIGTERM unwinds through the finally below, which stops the servers it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    replica, balancer, http_address = start_deployment(log_dir)
    endpoints = {
        "replica": Endpoint(replica.address),
        "balancer": Endpoint(balancer.address),
        "http": HttpEndpoint(http_address),
    }
    tally = Tally()
    started = time.monotonic()
    try:
        before = references(endpoints)
        run_cases(endpoints, args.examples, tally, seed)
        after = references(endpoints) if replica.alive() and balancer.alive() else {}
        alive = {"replica": replica.alive(), "balancer": balancer.alive()}
    finally:
        for e in endpoints.values():
            e.close()
        balancer.stop()
        replica.stop()
    summary = {
        "examples": sum(tally.counts.values()),
        "seed": seed,
        "by_code": tally.by_code(),
        "by_target_method_code": {"/".join(k): v for k, v in sorted(tally.counts.items())},
        "failures": tally.failures[:50],
        "failure_count": len(tally.failures),
        "alive": alive,
        "recovered": after == before,
        "wall_s": round(time.monotonic() - started, 1),
        "logs": str(log_dir),
    }
    ok = not tally.failures and all(alive.values()) and summary["recovered"]
    print(json.dumps(summary, indent=1))
    print(f"fuzz: {'PASS' if ok else 'FAIL'} ({summary['examples']} calls in {summary['wall_s']} s)", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": run_info("fuzz", argv), **summary, "pass": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
