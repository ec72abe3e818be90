"""Greedy output of the engine equals Hugging Face transformers `generate` in float32, token for token,
whatever the token budget, the batch mix or preemption."""

import random

import pytest

from fastgen.replica import pipeline
from fastgen.replica.request import FinishReason
from fastgen.testing import make_tiny_model

from .helpers import assert_matches, hf_greedy, random_prompts

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CONFIGS = {
    "llama-gqa-tied": dict(arch="llama", heads=4, kv_heads=2, tie=True),
    "llama-mha-untied": dict(arch="llama", heads=4, kv_heads=4, tie=False),
    "qwen2-bias": dict(arch="qwen2", heads=4, kv_heads=1, tie=False),
    "llama3-rope": dict(arch="llama", heads=4, kv_heads=2, rope_scaling=LLAMA3_SCALING),
    "mistral": dict(arch="mistral", heads=8, kv_heads=2, hidden=64),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: make_tiny_model(root / name, **kw, seed=i) for i, (name, kw) in enumerate(CONFIGS.items())}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_tiny_models_match_transformers(models, name):
    rng = random.Random(1)
    prompts = random_prompts(6, rng)
    refs = hf_greedy(models[name], prompts, 12)
    for budget in (8, 32, 256):
        pipe = pipeline(str(models[name]), dtype="float32", max_batch_tokens=budget, progress=False)
        assert_matches(pipe(prompts, max_new_tokens=12, min_new_tokens=12), refs)


@pytest.mark.slow
@pytest.mark.parametrize("num_prompts", [1, 5, 32])
def test_concurrency_and_budgets(models, num_prompts):
    rng = random.Random(num_prompts)
    prompts = random_prompts(num_prompts, rng, 1, 120)
    model = models["llama-gqa-tied"]
    refs = hf_greedy(model, prompts, 10)
    for budget in (8, 32, 256):
        pipe = pipeline(str(model), dtype="float32", max_batch_tokens=budget, progress=False)
        assert_matches(pipe(prompts, max_new_tokens=10, min_new_tokens=10), refs)


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["splitfuse", "prefill_first", "static"])
def test_preemption_with_a_tiny_kv_pool(models, scheduler):
    rng = random.Random(7)
    prompts = random_prompts(12, rng, 20, 60)
    model = models["llama-gqa-tied"]
    refs = hf_greedy(model, prompts, 16)
    # 20 blocks of 4 tokens: one sequence fits (at most 76 tokens), several do not.
    pipe = pipeline(
        str(model),
        dtype="float32",
        max_batch_tokens=32,
        block_size=4,
        num_blocks=20,
        scheduler=scheduler,
        progress=False,
    )
    outs = pipe(prompts, max_new_tokens=16, min_new_tokens=16)
    assert_matches(outs, refs)
    # static reserves each request's lifetime of blocks at admission, so it never preempts; the others must here
    assert (pipe.engine.scheduler.num_preemptions > 0) == (scheduler != "static")
    assert pipe.engine.scheduler.allocator.num_free == 20


def test_bad_input_raises_and_engine_keeps_serving(models):
    pipe = pipeline(str(models["llama-gqa-tied"]), dtype="float32", max_model_len=128, progress=False)
    engine = pipe.engine
    engine.add_request(
        "good", [5, 6, 7], __import__("fastgen.replica.request", fromlist=["x"]).SamplingParams(max_new_tokens=4)
    )
    cases = [
        ("", {}, "prompt is empty"),
        ([], {}, "prompt is empty"),
        ("\x04", {}, "encodes to no tokens"),  # found by the fuzzer: it once failed an engine step
        ([1] * 200, {}, "shorten the prompt"),
        ([1] * 100, {"max_new_tokens": 50}, "exceeds the context of 128 tokens"),
        ([1, 49152], {}, "outside the vocabulary"),
        ([1, -3], {}, "outside the vocabulary"),
        ("hi", {"temperature": -1.0}, "temperature must be"),
        ("hi", {"top_p": 0.0}, "top_p must be in"),
        ("hi", {"top_p": 1.5}, "top_p must be in"),
        ("hi", {"top_k": -1}, "top_k must be"),
        ("hi", {"min_new_tokens": 9, "max_new_tokens": 3}, "min_new_tokens"),
        ([{"role": "wizard", "content": "x"}], {}, "unknown role 'wizard'"),
        ("hi", {"stop": ("",)}, "stop strings must not be empty"),
    ]
    from fastgen.replica.request import SamplingParams

    for i, (prompt, kw, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            engine.add_request(f"bad-{i}", prompt, SamplingParams(**kw))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", [1], SamplingParams())
    outs = []
    while engine.has_unfinished():
        outs += engine.step().outputs
    assert [o.request_id for o in outs if o.finished] == ["good"]
    assert outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].generated_tokens == 4
    assert engine.scheduler.allocator.num_used == 0


def test_abort_frees_blocks_at_once(models):
    from fastgen.replica.request import SamplingParams

    engine = pipeline(str(models["llama-gqa-tied"]), dtype="float32", progress=False).engine
    engine.add_request("a", [5] * 40, SamplingParams(max_new_tokens=50))
    engine.add_request("b", [6] * 40, SamplingParams(max_new_tokens=5))
    engine.step()
    assert engine.scheduler.allocator.num_used > 0
    [out] = engine.abort("a")
    assert out.finish_reason is FinishReason.CANCELLED
    assert engine.abort("a") == []
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.allocator.num_used == 0


# ---- the OpenAI API's options, on the session's tiny model ------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    return pipeline(str(tiny_model_dir), dtype="float32", progress=False).engine


def finish(engine, prompt, **params):
    """Runs one request to its end: (final output, every output)."""
    from fastgen.replica.request import SamplingParams

    rid = f"r{random.random()}"
    engine.add_request(rid, prompt, SamplingParams(**params))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step().outputs if o.request_id == rid]
    return outs[-1], outs


PROMPT = [5, 6, 7, 8, 9, 10, 11]


def test_stop_token_ids_end_with_stop_and_wait_for_min_new_tokens(tiny_engine):
    ref, _ = finish(tiny_engine, PROMPT, max_new_tokens=8)
    k = next(i for i in range(2, 8) if ref.token_ids[i] not in ref.token_ids[:i])
    stop = ref.token_ids[k]
    out, _ = finish(tiny_engine, PROMPT, max_new_tokens=8, stop_token_ids=(stop,))
    assert (out.token_ids, out.finish_reason) == (ref.token_ids[: k + 1], FinishReason.STOP)  # kept in token_ids
    before, _ = finish(tiny_engine, PROMPT, max_new_tokens=k)
    assert out.text == before.text  # its text left out
    late, _ = finish(tiny_engine, PROMPT, max_new_tokens=8, min_new_tokens=k + 2, stop_token_ids=(stop,))
    assert stop not in late.token_ids[: k + 2] and late.generated_tokens >= k + 2
    assert tiny_engine.scheduler.allocator.num_used == 0


def test_include_stop_str_in_output_keeps_the_matched_stop(tiny_engine):
    ref, _ = finish(tiny_engine, PROMPT, max_new_tokens=12)
    stop = ref.text[len(ref.text) // 2 :][:3]
    at = ref.text.find(stop)
    cut, _ = finish(tiny_engine, PROMPT, max_new_tokens=12, stop=(stop,))
    kept, outs = finish(tiny_engine, PROMPT, max_new_tokens=12, stop=(stop,), include_stop_str_in_output=True)
    assert (cut.text, cut.finish_reason) == (ref.text[:at], FinishReason.STOP)
    assert (kept.text, kept.finish_reason) == (ref.text[: at + len(stop)], FinishReason.STOP)
    assert "".join(o.new_text for o in outs) == kept.text


def test_echo_returns_the_prompt_as_text(tiny_engine):
    text, _ = finish(tiny_engine, "The capital of France is", max_new_tokens=2, echo=True)
    assert text.prompt_text == "The capital of France is"
    ids, _ = finish(tiny_engine, [1, 9906, 2], max_new_tokens=2, echo=True)
    assert ids.prompt_text == tiny_engine.tokenizer.decode([1, 9906, 2], skip_special_tokens=False)
    assert ids.prompt_text.startswith("<|im_start|>")
    chat, _ = finish(tiny_engine, [{"role": "user", "content": "Hi"}], max_new_tokens=2, echo=True)
    assert "<|im_start|>user\nHi" in chat.prompt_text and chat.prompt_tokens == len(
        tiny_engine.tokenizer.encode(chat.prompt_text, add_special_tokens=False)
    )
    plain, _ = finish(tiny_engine, "The capital", max_new_tokens=2)
    assert plain.prompt_text == ""


def test_logit_bias_and_keep_special_tokens(tiny_engine):
    forced, _ = finish(tiny_engine, PROMPT, max_new_tokens=3, logit_bias=((1, 100.0),))
    assert forced.token_ids == [1, 1, 1] and forced.text == ""  # <|im_start|> is a special token
    kept, _ = finish(tiny_engine, PROMPT, max_new_tokens=3, logit_bias=((1, 100.0),), keep_special_tokens=True)
    assert kept.text == "<|im_start|>" * 3


def test_logprobs_with_token_strings(tiny_engine):
    out, outs = finish(tiny_engine, PROMPT, max_new_tokens=6, logprobs=3)
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    for lp in out.logprobs:
        assert len(lp.top) == 3 and lp.top[0].token_id == lp.token_id  # greedy takes the most likely
        assert lp.logprob == lp.top[0].logprob <= 0 and lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
        assert lp.token == tiny_engine.tokenizer.decode([lp.token_id]) and all(t.token for t in lp.top)
    assert [o.new_logprobs[0] for o in outs] == out.logprobs
    bare, _ = finish(tiny_engine, PROMPT, max_new_tokens=2, logprobs=0)
    assert [lp.top for lp in bare.logprobs] == [(), ()]
    none, _ = finish(tiny_engine, PROMPT, max_new_tokens=2)
    assert none.logprobs == [] and none.new_logprobs == []


def test_new_options_are_validated_against_the_vocabulary(tiny_engine):
    from fastgen.replica.request import SamplingParams

    for params, message in [
        (dict(logit_bias=((49152, 1.0),)), "token ids in logit_bias"),
        (dict(stop_token_ids=(-1,)), "token ids in logit_bias and stop_token_ids"),
        (dict(n=0), "n must be"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(logprobs=21), "top_logprobs"),
    ]:
        with pytest.raises(ValueError, match=message):
            tiny_engine.add_request("bad", PROMPT, SamplingParams(**params))
    assert not tiny_engine.has_unfinished()


# ---- resuming a request another replica started (stream migration) ----------------------------------------------
def run_resumed(engine, prompt, resume, **params):
    """Runs one resumed request to its end: (final output, every output)."""
    from fastgen.replica.request import SamplingParams

    rid = f"r{random.random()}"
    engine.add_request(rid, prompt, SamplingParams(**params), resume=resume)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step().outputs if o.request_id == rid]
    return outs[-1], outs


def assert_every_seam_continues_the_same(engine, prompt, **params):
    """Cut the uninterrupted request after each of its tokens and resume it from there: the resumed request sends
    exactly the tokens, text and logprobs the uninterrupted one sent from that position on."""
    from fastgen.replica.request import Resume

    ref, outs = finish(engine, prompt, **params)
    assert all(len(o.new_token_ids) == 1 for o in outs)  # one output per token: a seam after each
    for k in range(1, len(outs)):
        tokens = tuple(t for o in outs[:k] for t in o.new_token_ids)
        delivered = "".join(o.new_text for o in outs[:k])
        last, rest = run_resumed(engine, prompt, (Resume(tokens, len(delivered)),), **params)
        where = f"resumed after {k} of {len(outs)} tokens"
        assert [t for o in rest for t in o.new_token_ids] == ref.token_ids[k:], where
        assert delivered + "".join(o.new_text for o in rest) == ref.text, where
        assert (last.finish_reason, last.token_ids, last.generated_tokens) == (
            ref.finish_reason,
            ref.token_ids,
            ref.generated_tokens,
        ), where
        if params.get("logprobs") is not None:
            new = [lp for o in rest for lp in o.new_logprobs]
            assert [lp.token_id for lp in new] == ref.token_ids[k:]
            assert [lp.logprob for lp in new] == pytest.approx([lp.logprob for lp in ref.logprobs[k:]], abs=1e-4)
    assert engine.scheduler.allocator.num_used == 0
    return ref


@pytest.mark.parametrize(
    "params",
    [
        dict(max_new_tokens=14, ignore_eos=True),
        dict(max_new_tokens=14, ignore_eos=True, temperature=1.0, seed=7, logprobs=2),
        dict(max_new_tokens=14, ignore_eos=True, temperature=0.8, top_k=50, seed=3, presence_penalty=1.5),
        dict(max_new_tokens=14, temperature=1.0, seed=11, frequency_penalty=1.0, repetition_penalty=1.3),
    ],
    ids=["greedy", "seeded-logprobs", "seeded-presence", "seeded-frequency-repetition"],
)
def test_a_resumed_request_continues_exactly_where_it_was_cut(tiny_engine, params):
    assert_every_seam_continues_the_same(tiny_engine, PROMPT, **params)


def test_stop_strings_and_held_back_text_carry_across_the_seam(tiny_engine):
    ref, _ = finish(tiny_engine, "Once upon a time", max_new_tokens=16, ignore_eos=True)
    # A stop string late in the text, longer than one token's text: the cuts fall before it, inside it while its
    # start is held back, and after it.
    stop = ref.text[len(ref.text) // 2 :][:6]
    for include in (False, True):
        out = assert_every_seam_continues_the_same(
            tiny_engine,
            "Once upon a time",
            max_new_tokens=16,
            ignore_eos=True,
            stop=(stop, "never generated"),
            include_stop_str_in_output=include,
        )
        assert out.finish_reason is FinishReason.STOP and out.text == ref.text[: ref.text.index(stop)] + (
            stop if include else ""
        )


def test_min_new_tokens_counts_the_resumed_tokens(tiny_engine):
    ref, _ = finish(tiny_engine, PROMPT, max_new_tokens=10)
    k = next(i for i in range(2, 10) if ref.token_ids[i] not in ref.token_ids[:i])
    stop = ref.token_ids[k]
    # The stop token may not end the request before min_new_tokens: resumed after fewer tokens, it stays banned.
    out = assert_every_seam_continues_the_same(
        tiny_engine, PROMPT, max_new_tokens=10, min_new_tokens=k + 2, stop_token_ids=(stop,)
    )
    assert stop not in out.token_ids[: k + 2] and out.generated_tokens >= k + 2


def test_a_resume_that_cannot_continue_is_refused(tiny_engine):
    from fastgen.replica.request import Resume, SamplingParams

    for resume, params, message in [
        ((Resume((5, 6, 7, 8)),), dict(max_new_tokens=4), "nothing is left to resume"),
        ((Resume((5, 49152)),), dict(max_new_tokens=4), "outside the vocabulary"),
        ((Resume((5,)),), dict(max_new_tokens=4, n=2), "asks for n = 2"),
        ((Resume((5,)), Resume((6,), finished=True)), dict(max_new_tokens=4, n=3), "n = 3"),
        ((Resume((5,), finished=True), Resume((6,), finished=True)), dict(max_new_tokens=4, n=2), "every completion"),
        ((Resume((5,), finished=True), Resume((6, 7, 8, 9))), dict(max_new_tokens=4, n=2), "of completion 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            tiny_engine.add_request("bad-resume", PROMPT, SamplingParams(**params), resume=resume)
    assert not tiny_engine.has_unfinished()
