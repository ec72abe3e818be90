"""Logit bias, repetition, frequency and presence penalties, min-p and logprobs in the batched sampler, each
against a plain per-row reference; and logprobs of a real engine run against transformers."""

import dataclasses
import math
from collections import Counter

import pytest
import torch

from fastgen.kernels import TORCH_KERNELS
from fastgen.replica.outputs import TokenLogprob
from fastgen.replica.sampler import SamplingRow, keep_mask, penalize, sample

VOCAB = 300


def row(temperature=0.0, top_p=1.0, top_k=0, seed=7, position=3, banned=(), **options) -> SamplingRow:
    return SamplingRow(temperature, top_p, top_k, seed, position, list(banned), **options)


def random_logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# ---- references: one row at a time, the rules in plain steps -------------------------------------------------------
def processed_reference(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """One row of logits (V,) after bans, logit_bias, then repetition, frequency and presence penalties (vLLM)."""
    x = logits.float().clone()
    for t in r.banned:
        x[t] = float("-inf")
    for t, b in r.logit_bias:
        x[t] += b
    if r.repetition_penalty != 1.0:
        for t in set(r.context_ids):
            x[t] = x[t] / r.repetition_penalty if x[t] > 0 else x[t] * r.repetition_penalty
    for t, count in Counter(r.output_ids).items():
        x[t] -= r.frequency_penalty * count
        x[t] -= r.presence_penalty
    return x


def keep_reference(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row (V,), vLLM's way: min-p masks the logits, top-k masks what is left, top-p renormalises over what is
    left. -> the tokens that may be drawn (probability > 0)."""
    x = scaled.clone()
    probs = torch.softmax(x, dim=-1)
    if min_p > 0:
        x[probs < min_p * probs.max()] = float("-inf")
    probs = torch.softmax(x, dim=-1)
    if 0 < top_k < x.numel():
        x[probs < probs.sort(descending=True).values[top_k - 1]] = float("-inf")
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True, stable=True)
        drop = sorted_p.cumsum(0) - sorted_p >= top_p
        x[order[drop]] = float("-inf")
    return torch.softmax(x, dim=-1) > 0


def token_reference(logits: torch.Tensor, r: SamplingRow) -> int:
    """The token one row should get: the argmax of its processed logits when greedy, else the plain sampler's draw
    (same seed, position, top-k, top-p, min-p) from them."""
    x = processed_reference(logits, r)
    if r.temperature <= 0:
        return int(x.argmax())
    plain = SamplingRow(r.temperature, r.top_p, r.top_k, r.seed, r.position, [], min_p=r.min_p)
    return sample(x[None].clone(), [plain], TORCH_KERNELS.argmax).tokens[0]


# ---- penalties and bias -----------------------------------------------------------------------------------------
def penalized_rows(logits: torch.Tensor) -> list[SamplingRow]:
    """Each option alone and together, and plain rows between them. The repeated tokens include positive and
    negative logits; the counted ones occur more than once."""
    pos = [int(t) for t in (logits[4] > 0).nonzero()[:6, 0]]
    neg = [int(t) for t in (logits[4] < 0).nonzero()[:6, 0]]
    return [
        row(),
        row(presence_penalty=1.5, output_ids=[5, 9, 9, 9, 200]),
        row(frequency_penalty=0.7, output_ids=[5, 9, 9, 9, 200, 5]),
        row(presence_penalty=-0.5, frequency_penalty=-1.2, output_ids=[1, 1, 2]),
        row(repetition_penalty=1.8, context_ids=pos + neg + pos[:2]),
        row(repetition_penalty=0.6, context_ids=pos + neg),
        row(logit_bias=((10, 100.0), (11, -100.0), (12, 0.25))),
        row(temperature=0.8),
        row(
            presence_penalty=0.4,
            frequency_penalty=0.3,
            repetition_penalty=1.3,
            logit_bias=((3, 2.0), (9, -1.0)),
            output_ids=[3, 3, 9, 17],
            context_ids=[40, 41, 3, 3, 9, 17],
        ),
    ]


def test_penalize_equals_the_per_row_reference():
    logits = random_logits(9, 0)
    rows = penalized_rows(logits)
    x = logits.clone()
    penalize(x, rows)
    for i, r in enumerate(rows):
        torch.testing.assert_close(x[i], processed_reference(logits[i], r), rtol=0, atol=1e-5, msg=f"row {i}")
    for i in (0, 7):  # rows without bias or penalties are untouched, bit for bit
        assert torch.equal(x[i], logits[i])
    assert (x[4] != logits[4]).sum() == 12 and (x[5] != logits[5]).sum() == 12  # every repeated token moved


def test_penalize_applies_nothing_for_rows_without_penalties():
    logits = random_logits(3, 1)
    x = logits.clone()
    penalize(x, [row(), row(temperature=1.0, output_ids=[1, 2], context_ids=[3, 4]), row(min_p=0.5)])
    assert torch.equal(x, logits)


def mixed_batch(logits: torch.Tensor) -> list[SamplingRow]:
    """Greedy and drawn rows, with and without penalties, with top-k, top-p and min-p, and bans."""
    rows = penalized_rows(logits)
    sampling = [(0.0, 1.0, 0, 0.0), (0.9, 0.9, 0, 0.0), (1.2, 1.0, 20, 0.05), (0.7, 0.8, 50, 0.1), (1.0, 1.0, 0, 0.2)]
    out = []
    for i, r in enumerate(rows):
        temperature, top_p, top_k, min_p = sampling[i % len(sampling)]
        banned = [int(logits[i].argmax())] if i % 3 == 1 else []
        out.append(dataclasses.replace(r, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=100 + i))
        out[-1].banned = banned
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_follow_the_processed_logits_in_a_mixed_batch(dtype):
    logits = random_logits(9, 2).to(dtype)
    rows = mixed_batch(logits)
    expected = [token_reference(logits[i], r) for i, r in enumerate(rows)]
    assert sample(logits.clone(), rows, TORCH_KERNELS.argmax).tokens == expected
    for i, r in enumerate(rows):  # and alone
        assert sample(logits[i : i + 1].clone(), [r], TORCH_KERNELS.argmax).tokens == [expected[i]], f"row {i}"


def test_greedy_rows_with_penalties_take_the_argmax_of_the_processed_logits():
    logits = random_logits(3, 3)
    top = [int(t) for t in logits.argmax(dim=-1)]
    rows = [
        row(presence_penalty=2.0, frequency_penalty=2.0, output_ids=[top[0]] * 3),
        row(logit_bias=((7, 100.0),)),
        row(),
    ]
    calls = []

    def argmax(x):
        calls.append(x.shape[0])
        return TORCH_KERNELS.argmax(x)

    tokens = sample(logits.clone(), rows, argmax).tokens
    assert tokens[0] != top[0] and tokens[0] == int(processed_reference(logits[0], rows[0]).argmax())
    assert tokens[1:] == [7, top[2]]
    assert calls == [1]  # only the plain greedy row goes through the kernels' argmax


def test_rows_sharing_a_source_keep_their_own_penalties():
    logits = random_logits(2, 4)
    top = int(logits[0].argmax())
    rows = [
        row(source=0, presence_penalty=2.0, frequency_penalty=2.0, output_ids=[top, top]),
        row(source=0),
        row(source=0, logit_bias=((top, -100.0), (5, 50.0))),
        row(source=1, temperature=0.9, repetition_penalty=2.0, context_ids=list(range(0, VOCAB, 2))),
        row(source=0, temperature=0.9, top_k=5, banned=[top]),
        row(source=0, temperature=0.9, top_k=5, seed=8),
        row(source=1),
    ]
    before = logits.clone()
    tokens = sample(logits, rows, TORCH_KERNELS.argmax).tokens
    assert tokens == [token_reference(logits[r.source], r) for r in rows]
    assert tokens[1] == top and tokens[2] == 5 and tokens[4] != top
    assert torch.equal(logits, before)  # each row worked on its own copy


# ---- min-p ------------------------------------------------------------------------------------------------------
def test_min_p_with_top_k_and_top_p_equals_the_vllm_reference():
    gen = torch.Generator().manual_seed(5)
    m = 24
    scaled = torch.randn(m, VOCAB, generator=gen) * 2
    scaled[4, 20:] = float("-inf")  # a banned tail
    min_p = [0.0, 0.05, 0.1, 0.3, 0.9, 1.0] * 4
    top_k = [0, 0, 5, 50, 3, 0, 10, 0] * 3
    top_p = [1.0, 0.9, 1.0, 0.7, 0.95, 0.5] * 4
    max_k = max(top_k)
    mask = keep_mask(scaled, torch.tensor(top_k), torch.tensor(top_p), max_k, True, torch.tensor(min_p))
    probs = torch.softmax(scaled, dim=-1)
    for i in range(m):
        assert torch.equal(mask[i] & (probs[i] > 0), keep_reference(scaled[i], top_k[i], top_p[i], min_p[i])), i
    assert mask.sum(dim=-1).min() >= 1  # min_p = 1 keeps the top token
    # min_p = 0 everywhere is the same mask as no min-p at all.
    same = keep_mask(scaled, torch.tensor(top_k), torch.tensor(top_p), max_k, True, torch.zeros(m))
    assert torch.equal(same, keep_mask(scaled, torch.tensor(top_k), torch.tensor(top_p), max_k, True))


def test_min_p_draws_follow_the_renormalised_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.3, 1.7, -3.0])
    draws = 20000
    probs = torch.softmax(logits / 0.8, dim=-1)
    target = probs * (probs >= 0.15 * probs.max())
    target /= target.sum()
    rows = [row(temperature=0.8, min_p=0.15, seed=11, position=p) for p in range(draws)]
    tokens = sample(logits.expand(draws, -1).clone(), rows, TORCH_KERNELS.argmax).tokens
    counts = torch.bincount(torch.tensor(tokens), minlength=10).double()
    assert counts[target == 0].sum() == 0 and (target > 0).sum() < 10  # min-p dropped tokens, none drawn
    expected = target.double() * draws
    seen = expected > 0
    # Chi-square, at most 9 degrees of freedom: beyond 45 with probability below 1e-6 (a fixed function of seeds).
    assert float(((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum()) < 45.0


# ---- logprobs ---------------------------------------------------------------------------------------------------
def assert_logprobs(got: TokenLogprob, token: int, reference: torch.Tensor, k: int) -> None:
    """got against reference (V,) = log_softmax of the raw float32 logits."""
    assert got.token_id == token and got.token == ""
    assert math.isclose(got.logprob, float(reference[token]), abs_tol=1e-5)
    assert len(got.top) == k
    assert all(t.token == "" for t in got.top) and len({t.token_id for t in got.top}) == k
    # The k largest values, most likely first, each its token's own (which of tied tokens comes first is open).
    values = reference.topk(k).values if k else torch.zeros(0)
    torch.testing.assert_close(torch.tensor([t.logprob for t in got.top]), values, rtol=0, atol=1e-5)
    assert all(math.isclose(t.logprob, float(reference[t.token_id]), abs_tol=1e-5) for t in got.top)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_the_raw_log_softmax(dtype):
    logits = random_logits(8, 6, vocab=1000).to(dtype)
    raw = torch.log_softmax(logits.float(), dim=-1)
    top30 = [r.topk(30).indices.tolist() for r in raw]
    rows = [
        row(logprobs=0),
        row(temperature=0.9, logprobs=5),
        row(),  # no logprobs
        row(logprobs=20, presence_penalty=2.0, output_ids=top30[3][:1]),
        row(temperature=1.0, top_k=3, logprobs=3, banned=top30[4][:25]),  # draws outside its top 3
        row(temperature=0.7, min_p=0.1, logprobs=1, logit_bias=((top30[5][29], 30.0),)),  # biased past the top
        row(temperature=1.2),
        row(logprobs=2, repetition_penalty=3.0, context_ids=top30[7][:2]),
    ]
    out = sample(logits.clone(), rows, TORCH_KERNELS.argmax)
    assert out.logprobs[2] is None and out.logprobs[6] is None
    for i, r in enumerate(rows):
        if r.logprobs is not None:
            assert_logprobs(out.logprobs[i], out.tokens[i], raw[i], r.logprobs)
    assert out.tokens[4] not in top30[4][:25] and out.tokens[5] == top30[5][29]
    # Asking for logprobs changes no token.
    plain = [dataclasses.replace(r, logprobs=None) for r in rows]
    assert sample(logits.clone(), plain, TORCH_KERNELS.argmax).tokens == out.tokens


def test_logprobs_of_rows_sharing_a_source():
    logits = random_logits(2, 7, vocab=1000)
    raw = torch.log_softmax(logits, dim=-1)
    rows = [row(source=1, temperature=1.0, seed=s, logprobs=4) for s in range(6)] + [row(source=0, logprobs=2)]
    out = sample(logits.clone(), rows, TORCH_KERNELS.argmax)
    assert len(set(out.tokens[:6])) > 1  # different draws from one row
    for i, r in enumerate(rows):
        assert_logprobs(out.logprobs[i], out.tokens[i], raw[r.source], r.logprobs)


def test_no_row_asking_gives_none_everywhere():
    logits = random_logits(3, 8)
    out = sample(logits, [row(), row(temperature=1.0), row(presence_penalty=1.0, output_ids=[1])], TORCH_KERNELS.argmax)
    assert out.logprobs == [None, None, None]


@pytest.mark.cuda
def test_the_options_give_the_same_tokens_and_logprobs_on_cuda_and_cpu():
    logits = random_logits(9, 2, vocab=4096)
    rows = [dataclasses.replace(r, logprobs=i % 4 * 5 if i % 3 else None) for i, r in enumerate(mixed_batch(logits))]
    rows += [dataclasses.replace(r, source=i, seed=r.seed + 1) for i, r in enumerate(rows)]  # shared sources
    on_cpu = sample(logits.clone(), rows, TORCH_KERNELS.argmax)
    on_cuda = sample(logits.cuda(), rows, TORCH_KERNELS.argmax)
    assert on_cuda.tokens == on_cpu.tokens
    for i, r in enumerate(rows):
        if r.logprobs is None:
            assert on_cuda.logprobs[i] is None
        else:
            assert_logprobs(on_cuda.logprobs[i], on_cpu.tokens[i], torch.log_softmax(logits[i % 9], -1), r.logprobs)


# ---- against transformers ---------------------------------------------------------------------------------------
def hf_log_softmax(model_dir, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """(len(generated), V): transformers' float32 log_softmax at each generated token's position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def assert_matches_hf(logprobs: list[TokenLogprob], tokens: list[int], reference: torch.Tensor, k: int) -> None:
    assert len(logprobs) == len(tokens) == reference.shape[0]
    for step, (got, token) in enumerate(zip(logprobs, tokens)):
        assert got.token_id == token
        assert math.isclose(got.logprob, float(reference[step, token]), abs_tol=1e-4), step
        values = reference[step].topk(k).values
        torch.testing.assert_close(torch.tensor([t.logprob for t in got.top]), values, rtol=0, atol=1e-4)
        for t in got.top:  # each alternative's own logprob, whatever the order of near-ties
            assert math.isclose(t.logprob, float(reference[step, t.token_id]), abs_tol=1e-4), step


PROMPT = [11, 2000, 345, 99, 7000, 12]


@pytest.mark.slow
def test_sampler_logprobs_on_the_engines_logits_match_transformers(tiny_model_dir, monkeypatch):
    """The engine's greedy run with the sampler asked for logprobs at every step (the engine's own plumbing aside):
    the raw logprobs equal transformers' float32 log_softmax at the same positions."""
    from fastgen.replica import engine as engine_module
    from fastgen.replica import pipeline

    seen = []

    def sample_with_logprobs(logits, rows, argmax):
        out = sample(logits, [dataclasses.replace(r, logprobs=5) for r in rows], argmax)
        seen.extend(out.logprobs)  # steps that only prefill sample no row
        return out

    monkeypatch.setattr(engine_module, "sample", sample_with_logprobs)
    pipe = pipeline(str(tiny_model_dir), dtype="float32", max_batch_tokens=4, progress=False)
    tokens = pipe([PROMPT], max_new_tokens=8, ignore_eos=True)[0].token_ids
    assert_matches_hf(seen, tokens, hf_log_softmax(tiny_model_dir, PROMPT, tokens), 5)


@pytest.mark.slow
def test_engine_logprobs_match_transformers(tiny_model_dir):
    """Through the engine's API: the final RequestOutput.logprobs holds every generated token's."""
    from fastgen.replica import pipeline
    from fastgen.replica.request import SamplingParams

    engine = pipeline(str(tiny_model_dir), dtype="float32", max_batch_tokens=4, progress=False).engine
    engine.add_request("r", PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=3))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step().outputs
    out = outputs[-1]
    assert out.finished and [lp for o in outputs for lp in o.new_logprobs] == out.logprobs
    assert_matches_hf(out.logprobs, out.token_ids, hf_log_softmax(tiny_model_dir, PROMPT, out.token_ids), 3)
