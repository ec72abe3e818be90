"""The Python client's argument handling, without a server (end-to-end use is in test_balancer.py)."""

import grpc
import pytest

from fastgen.proto import fastgen_pb2 as pb
from fastgen.server import Client, GenerationError
from fastgen.server.client import build_request, check_kwargs, is_single_prompt, to_chunk, to_result


def test_unknown_kwargs_name_the_valid_ones():
    with pytest.raises(TypeError) as err:
        check_kwargs({"max_tokens": 5, "temperature": 0.5})
    assert "'max_tokens'" in str(err.value) and "max_new_tokens" in str(err.value) and "timeout" in str(err.value)


def test_generate_refuses_unknown_kwargs_before_calling():
    with Client("127.0.0.1:1") as client:  # nothing listens: a call would fail differently
        with pytest.raises(TypeError, match="temprature"):
            client.generate("hi", temprature=0.1)


def test_prompt_kinds():
    assert build_request("hello", None, {}).text == "hello"
    assert list(build_request([5, 6, 7], None, {}).token_ids.ids) == [5, 6, 7]
    chat = build_request([{"role": "user", "content": "hi"}], "id-1", {}).messages.messages
    assert (chat[0].role, chat[0].content) == ("user", "hi")
    assert build_request([], None, {}).WhichOneof("prompt") == "token_ids"  # the server says it is empty


def test_single_or_batch():
    assert is_single_prompt("a")
    assert is_single_prompt([1, 2])
    assert is_single_prompt([{"role": "user", "content": "x"}])
    assert not is_single_prompt(["a", "b"])
    assert not is_single_prompt([[1, 2], [3]])
    assert not is_single_prompt([[{"role": "user", "content": "x"}]])
    assert not is_single_prompt([])
    with pytest.raises(TypeError):
        is_single_prompt(42)


def test_sampling_params_and_stop():
    req = build_request(
        "x",
        "rid",
        dict(
            max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=4, seed=0, stop="END", ignore_eos=True, min_new_tokens=2
        ),
    )
    p = req.params
    assert (p.max_new_tokens, p.min_new_tokens, p.top_k, p.ignore_eos) == (7, 2, 4, True)
    assert p.HasField("seed") and p.seed == 0  # seed 0 is a seed, not "unset"
    assert list(p.stop) == ["END"]
    assert req.request_id == "rid"
    assert not build_request("x", None, {}).params.HasField("seed")
    assert list(build_request("x", None, {"stop": ["a", "b"]}).params.stop) == ["a", "b"]


def test_mixed_prompt_list_is_refused():
    with pytest.raises(TypeError, match="only token ids"):
        build_request([1, {"role": "user"}], None, {})


def test_results_and_chunks_carry_finish_reasons_as_strings():
    r = to_result(pb.GenerateResponse(text="t", token_ids=[1], finish_reason=pb.FINISH_REASON_EOS, replica="r1"))
    assert (r.text, r.token_ids, r.finish_reason, r.replica) == ("t", [1], "eos", "r1")
    assert to_chunk(pb.GenerateChunk(text="a")).finish_reason is None
    assert to_chunk(pb.GenerateChunk(finish_reason=pb.FINISH_REASON_STOP)).finish_reason == "stop"


def test_connection_refused_is_a_generation_error():
    with Client("127.0.0.1:1", timeout=5) as client:
        with pytest.raises(GenerationError) as err:
            client.generate("hi")
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert isinstance(err.value.details, str)


def test_stream_checks_arguments_when_called():
    with Client("127.0.0.1:1") as client:
        with pytest.raises(TypeError, match="temprature"):
            client.stream("hi", temprature=0.1)
        with pytest.raises(TypeError, match="one prompt"):
            client.stream_chunks(["a", "b"])
