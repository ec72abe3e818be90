"""Sampling, stopping and detokenization."""

import random

import pytest

from fastgen.replica import pipeline
from fastgen.replica.detokenizer import IncrementalDetokenizer
from fastgen.replica.request import FinishReason, SamplingParams


@pytest.fixture(scope="module")
def pipe(tiny_model_dir):
    return pipeline(str(tiny_model_dir), dtype="float32", max_batch_tokens=64, progress=False)


def run(pipe, requests):
    """requests: {id: (prompt, SamplingParams)} added together; returns {id: final output}."""
    for rid, (prompt, params) in requests.items():
        pipe.engine.add_request(rid, prompt, params)
    done = {}
    while pipe.engine.has_unfinished():
        for out in pipe.engine.step().outputs:
            if out.finished:
                done[out.request_id] = out
    return done


def test_same_seed_same_tokens_whatever_the_batch(pipe):
    params = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = run(pipe, {"a": ([11, 12, 13], params)})["a"].token_ids
    rng = random.Random(0)
    crowd = {
        f"x{i}": (
            [rng.randrange(3, 49152) for _ in range(rng.randint(1, 90))],
            SamplingParams(max_new_tokens=rng.randint(1, 30), temperature=0.8, ignore_eos=True),
        )
        for i in range(6)
    }
    crowd["a"] = ([11, 12, 13], params)
    assert run(pipe, crowd)["a"].token_ids == alone
    other_seed = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    assert run(pipe, {"b": ([11, 12, 13], other_seed)})["b"].token_ids != alone


def test_top_k_one_is_greedy(pipe):
    greedy = pipe([[7, 8, 9]], max_new_tokens=12, ignore_eos=True)[0].token_ids
    sampled = pipe([[7, 8, 9]], max_new_tokens=12, ignore_eos=True, temperature=1.5, top_k=1)[0].token_ids
    assert sampled == greedy


def test_sampling_follows_the_distribution(pipe):
    """Unseeded sampling at a high temperature spreads over many tokens; a tiny top_p collapses to greedy."""
    outs = pipe([[7, 8, 9]] * 12, max_new_tokens=1, temperature=5.0, ignore_eos=True)
    assert len({o.token_ids[0] for o in outs}) > 3
    greedy = pipe([[7, 8, 9]], max_new_tokens=4, ignore_eos=True)[0].token_ids
    assert pipe([[7, 8, 9]], max_new_tokens=4, temperature=1.0, top_p=1e-6, ignore_eos=True)[0].token_ids == greedy


def test_stop_strings_end_and_are_excluded(pipe):
    full = pipe(["The weather today"], max_new_tokens=24, ignore_eos=True)[0]
    assert len(full.text) > 12
    stop = full.text[6:10]  # a piece from the middle, usually spanning tokens
    out = pipe(["The weather today"], max_new_tokens=24, ignore_eos=True, stop=[stop, "never-generated"])[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.text == full.text[: full.text.index(stop)]
    assert stop not in out.text


def test_streamed_text_equals_final_text_with_stop_holdback(pipe):
    full = pipe(["Once upon"], max_new_tokens=20, ignore_eos=True)[0]
    stop = full.text[-5:]
    pipe.engine.add_request("s", "Once upon", SamplingParams(max_new_tokens=20, ignore_eos=True, stop=(stop,)))
    pieces, last = [], None
    while pipe.engine.has_unfinished():
        for out in pipe.engine.step().outputs:
            pieces.append(out.new_text)
            last = out
    assert "".join(pieces) == last.text
    assert stop not in "".join(pieces)


def test_eos_and_min_new_tokens(pipe):
    greedy = pipe([[7, 8, 9]], max_new_tokens=10, ignore_eos=True)[0].token_ids
    engine = pipe.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = [greedy[2]]  # pretend the third greedy token ends the sequence
    try:
        out = pipe([[7, 8, 9]], max_new_tokens=10)[0]
        assert out.finish_reason is FinishReason.EOS and out.token_ids == greedy[:3]
        out = pipe([[7, 8, 9]], max_new_tokens=10, min_new_tokens=6)[0]
        assert out.generated_tokens >= 6 and greedy[2] not in out.token_ids[:6]
        out = pipe([[7, 8, 9]], max_new_tokens=10, ignore_eos=True)[0]
        assert out.token_ids == greedy and out.finish_reason is FinishReason.LENGTH
    finally:
        engine.eos_token_ids = saved


def test_chat_messages_use_the_template(pipe):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = pipe([messages], max_new_tokens=3)[0]
    expected = pipe.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt_tokens == len(pipe.tokenizer.encode(expected, add_special_tokens=False))
    assert expected.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "emoji 🎉🚀 and ünïcödé", "mixed ascii €100 ✓"])
def test_incremental_detokenization_across_multibyte_characters(pipe, text):
    tok = pipe.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("Say:", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)
    # Some character really was split across tokens, so the test exercises the hold-back.
    if any(ord(c) > 0x7FF for c in text):
        assert "" in pieces[:-1]


def test_greedy_rows_take_the_given_argmax_and_banned_tokens_lose():
    """sample() picks greedy tokens with the kernels' argmax it is handed (Kernels.argmax), after banning."""
    import torch

    from fastgen.kernels import TORCH_KERNELS
    from fastgen.replica.sampler import SamplingRow, sample

    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 2.0, 0.0]])
    rows = [SamplingRow(0.0, 1.0, 0, None, [1]), SamplingRow(0.0, 1.0, 0, None, [])]
    seen = []

    def argmax(x):
        seen.append(x.clone())
        return TORCH_KERNELS.argmax(x)

    assert sample(logits, rows, argmax) == [2, 0]
    assert seen and seen[0][0, 1] == float("-inf")
