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
    if scheduler == "splitfuse":
        assert pipe.engine.scheduler.num_preemptions > 0
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
    out = engine.abort("a")
    assert out.finish_reason is FinishReason.CANCELLED
    assert engine.abort("a") is None
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.allocator.num_used == 0
