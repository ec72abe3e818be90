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


def test_new_sampling_fields_reach_the_request():
    p = build_request(
        "x",
        None,
        dict(
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.1,
            min_p=0.05,
            logit_bias={50: -100, "7": 2.5},
            stop_token_ids=[3, 4],
            n=4,
            logprobs=True,
            top_logprobs=5,
            include_stop_str_in_output=True,
            keep_special_tokens=True,
            echo=True,
        ),
    ).params
    assert (p.presence_penalty, p.frequency_penalty, p.min_p, p.n, p.logprobs, p.top_logprobs) == (
        0.5,
        -0.5,
        pytest.approx(0.05),
        4,
        True,
        5,
    )
    assert dict(p.logit_bias) == {50: -100.0, 7: 2.5} and list(p.stop_token_ids) == [3, 4]
    assert p.include_stop_str_in_output and p.keep_special_tokens and p.echo
    assert p.repetition_penalty == pytest.approx(1.1)
    empty = build_request("x", None, {}).params
    assert (empty.n, dict(empty.logit_bias), list(empty.stop_token_ids), empty.logprobs) == (0, {}, [], False)


def logprob(token_id, lp, *top):
    return pb.TokenLogprob(
        token_id=token_id, token=f"t{token_id}", logprob=lp, top=[pb.TopLogprob(token_id=t, logprob=-1.0) for t in top]
    )


def test_results_carry_choices_logprobs_and_prompt_text():
    choices = [
        pb.Choice(index=i, text=f"c{i}", token_ids=[i], finish_reason=pb.FINISH_REASON_LENGTH, generated_tokens=1)
        for i in range(2)
    ]
    choices[1].logprobs.append(logprob(1, -0.5, 1, 9))
    r = to_result(pb.GenerateResponse(text="c0", token_ids=[0], choices=choices, prompt_text="p"))
    assert [c.index for c in r.choices] == [0, 1] and r.prompt_text == "p"
    assert r.completions() is r.choices and r.choices[1].finish_reason == "length"
    lp = r.choices[1].logprobs[0]
    assert (lp.token_id, lp.token, lp.logprob, [t.token_id for t in lp.top]) == (1, "t1", -0.5, [1, 9])
    single = to_result(pb.GenerateResponse(text="t", token_ids=[5], logprobs=[logprob(5, -0.25)], generated_tokens=1))
    [only] = single.completions()
    assert (only.index, only.text, only.token_ids, [x.token_id for x in only.logprobs]) == (0, "t", [5], [5])
    chunk = to_chunk(pb.GenerateChunk(index=2, token_ids=[5], logprobs=[logprob(5, -0.25)], prompt_text="p"))
    assert (chunk.index, chunk.prompt_text, chunk.logprobs[0].token) == (2, "p", "t5")
    old = to_chunk(pb.GenerateChunk(text="a"))  # a server without the new fields
    assert (old.index, old.logprobs, old.prompt_text) == (0, [], "")


def test_text_stream_is_for_one_completion():
    with Client("127.0.0.1:1") as client:
        with pytest.raises(TypeError, match="stream_chunks"):
            client.stream("hi", n=2)
        client.stream_chunks("hi", n=2).close()  # fine: chunks say their index


def test_generate_flags_build_the_request(capsys):
    from fastgen.launch import cli
    from fastgen.server.client import Choice, TokenLogprob, TopLogprob

    argv = ["generate", "hi", "--n", "3", "--logprobs", "2", "--presence-penalty", "0.5", "--frequency-penalty", "1"]
    argv += ["--repetition-penalty", "1.2", "--min-p", "0.1", "--stop-token-id", "7", "--stop-token-id", "9"]
    argv += ["--logit-bias", "50=-100", "--logit-bias", "3=2.5", "--seed", "4", "--stop", "END", "--echo"]
    kwargs = cli.generate_kwargs(cli.build_parser().parse_args(argv))
    assert kwargs["logit_bias"] == {50: -100.0, 3: 2.5} and kwargs["stop_token_ids"] == [7, 9]
    assert (kwargs["logprobs"], kwargs["top_logprobs"], kwargs["n"], kwargs["echo"]) == (True, 2, 3, True)
    p = build_request("hi", None, kwargs).params
    assert (p.n, p.top_logprobs, p.seed, list(p.stop), dict(p.logit_bias)) == (3, 2, 4, ["END"], {50: -100, 3: 2.5})
    assert cli.generate_kwargs(cli.build_parser().parse_args(["generate", "hi"])) == {}
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "hi", "--logit-bias", "50"])
    assert "ID=BIAS" in capsys.readouterr().err

    choice = Choice(1, "text", [4], "stop", 1, [TokenLogprob(4, "tok", -0.5, [TopLogprob(4, "tok", -0.5)])])
    cli.print_completion(choice, many=True)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "--- completion 1 (1 tokens, stop) ---" and out[1] == "text"
    assert "-0.5000" in out[2] and "'tok'" in out[2] and "top: 'tok' -0.500" in out[2]


def test_generate_stream_prints_each_of_n_completions_as_it_ends(capsys):
    from fastgen.launch import cli
    from fastgen.server.client import GenerationChunk

    def chunk(index, text, reason=None, prompt_text=""):
        return GenerationChunk(text, [1], reason, 3, 2 if reason else 0, "r0", "id", index, [], prompt_text)

    chunks = [chunk(0, "Hel", prompt_text="P"), chunk(1, "Wor"), chunk(1, "ld", "length"), chunk(0, "lo", "eos")]

    class FakeClient:
        def stream_chunks(self, prompt, **kwargs):
            return iter(chunks)

    cli.stream_generate(FakeClient(), "P", {"n": 2})
    assert capsys.readouterr().out.splitlines() == [
        "P",
        "--- completion 1 (2 tokens, length) ---",
        "World",
        "--- completion 0 (2 tokens, eos) ---",
        "Hello",
    ]
    cli.stream_generate(FakeClient(), "P", {})  # one completion: text as it comes (here both indices' text)
    assert capsys.readouterr().out == "PHelWorldlo\n"
