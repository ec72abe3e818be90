"""The embedded SmolLM2-135M-Instruct: real text, exact against transformers in float32."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastgen.replica import pipeline
from fastgen.replica.request import FinishReason
from fastgen.replica.weights import resolve_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Write a haiku about the sea.\n",
    "List three colors: red,",
]


@pytest.fixture(scope="module")
def hf_reference():
    folder = resolve_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    refs = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=2)
        refs.append(out[0, ids.shape[1] :].tolist())
    return tok, refs


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(hf_reference):
    tok, refs = hf_reference
    for budget in (8, 32, 256):
        pipe = pipeline("smollm2-135m", dtype="float32", max_batch_tokens=budget, progress=False)
        outs = pipe(PROMPTS, max_new_tokens=16, min_new_tokens=16)  # as generate: EOS banned
        for out, ref in zip(outs, refs):
            assert out.token_ids == ref
            assert out.text == tok.decode(ref, skip_special_tokens=True)


@pytest.mark.slow
def test_smollm2_chat_ends_on_im_end():
    pipe = pipeline("smollm2-135m", dtype="bfloat16", progress=False)
    out = pipe([[{"role": "user", "content": "What is 2+2? Answer with one number."}]], max_new_tokens=40)[0]
    assert out.finish_reason is FinishReason.EOS
    assert "4" in out.text
    assert "<|im_end|>" not in out.text
