"""Fuzzed GenerateRequests against a live replica and the balancer in front of it, and JSON bodies against the
balancer's HTTP API (benchmarks/fuzz.py's strategies, sizes and counts past every limit included): only OK,
INVALID_ARGUMENT or RESOURCE_EXHAUSTED (over HTTP 200 or a 4xx), no process death, and a greedy request answered as
before after. The full count is `python -m fastgen.benchmarks.fuzz --examples 10000`."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastgen.benchmarks import fuzz
from fastgen.proto import fastgen_pb2 as pb

from .helpers import free_port, start_balancer, start_replica, wait_serving

EXAMPLES = 300


@pytest.fixture(scope="module")
def deployment(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz-logs")
    replica = start_replica(tiny_model_dir, "r0", logs)
    balancer = None
    try:
        wait_serving(replica)
        http_port = free_port()
        balancer = start_balancer({"r0": replica.address}, logs, extra_args=["--http-port", str(http_port)])
        wait_serving(balancer)
        endpoints = {
            "replica": fuzz.Endpoint(replica.address),
            "balancer": fuzz.Endpoint(balancer.address),
            "http": fuzz.HttpEndpoint(f"127.0.0.1:{http_port}"),
        }
        yield replica, balancer, endpoints
        for e in endpoints.values():
            e.close()
    finally:
        if balancer is not None:
            balancer.kill()
        replica.kill()


@pytest.mark.slow
def test_fuzzed_requests_are_answered_ok_or_invalid_and_nothing_breaks(deployment):
    replica, balancer, endpoints = deployment
    before = fuzz.references(endpoints)
    tally = fuzz.Tally()

    # derandomize: the same examples on every run, so a failure here is never a flake.
    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(fuzz.cases)
    def one(case):
        code, problem = fuzz.call(endpoints[case.target], case, timeout=60)
        assert not tally.add(case, code, problem), tally.failures[-1]
        assert replica.alive() and balancer.alive(), replica.log_tail() + balancer.log_tail()

    one()
    assert replica.alive() and balancer.alive()
    assert fuzz.references(endpoints) == before
    counts = tally.by_code()
    assert counts.get("OK", 0) > EXAMPLES // 20 and counts.get("INVALID_ARGUMENT", 0) > EXAMPLES // 4, counts


# ---- the HTTP API's JSON bodies (parsing only: every answer that is not a request comes from here) ---------------
FIELDS = (
    "model messages prompt max_tokens max_completion_tokens temperature top_p n stop seed presence_penalty "
    "frequency_penalty logit_bias logprobs top_logprobs echo stream stream_options user top_k min_p repetition_penalty "
    "min_tokens ignore_eos stop_token_ids skip_special_tokens include_stop_str_in_output suffix best_of tools "
    "tool_choice response_format cache_salt"
).split()
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from((2**32, 2**64, -(2**63), 10**400, 1e308)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=8,
)
BASES = ({"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "hi"})


@settings(max_examples=500, deadline=None, database=None, derandomize=True)
@given(
    st.sampled_from(("chat", "completion")),
    st.one_of(json_values, st.tuples(st.sampled_from(BASES), st.dictionaries(st.sampled_from(FIELDS), json_values))),
)
def test_http_bodies_are_parsed_or_refused_with_a_4xx(kind, body):
    from fastgen.balancer.openai_protocol import ApiError, parse_chat, parse_completion

    if isinstance(body, tuple):
        body = {**body[0], **body[1]}
    try:
        api = (parse_chat if kind == "chat" else parse_completion)(body, "id")
    except ApiError as e:
        assert 400 <= e.status < 500, e.body()
        return
    for request in api.prompts:
        pb.GenerateRequest.FromString(request.SerializeToString())  # a message the replicas can take
