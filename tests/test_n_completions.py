"""n completions of one prompt (parallel sampling): the prompt is prefilled once, the n first tokens are drawn from its
one logits row, and n - 1 sequences fork onto copies of its KV blocks. Each completion equals a request for one
completion seeded with its derived seed, whether the fork copied the KV or, short of blocks, recomputed the prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastgen.replica import pipeline
from fastgen.replica.batch import Batch, ScheduledSeq
from fastgen.replica.batch_broadcast import decode_batch, encode_batch
from fastgen.replica.engine import completion_seed
from fastgen.replica.kv_cache import copy_blocks
from fastgen.replica.request import FinishReason, Resume, SamplingParams

from .tp_ranks import init, run_ranks

PROMPT = list(range(5, 35))  # 30 tokens: 7.5 blocks of 4, so the fork copies a partly filled block too


def make_engine(model_dir, **kw):
    kw = {"block_size": 4, "num_blocks": 256, "max_batch_tokens": 256, **kw}
    return pipeline(str(model_dir), dtype="float32", progress=False, **kw).engine


def run(engine, requests: dict):
    """Adds {request_id: (prompt, SamplingParams)} and steps to the end. Returns the final output of every
    completion by (request_id, index), every output in order, and the steps' stats."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs, stats = [], []
    while engine.has_unfinished():
        result = engine.step()
        outputs += result.outputs
        stats += [result.stats] if result.stats else []
    final = {(o.request_id, o.index): o for o in outputs if o.finished}
    return final, outputs, stats


def singles(engine, prompt, params: SamplingParams) -> list[list[int]]:
    """The tokens of each of params.n completions, as n = 1 requests seeded with the derived seeds."""
    tokens = []
    for i in range(params.n):
        one = SamplingParams(**{**params.__dict__, "n": 1, "seed": completion_seed(params.seed, i)})
        final, _, _ = run(engine, {f"single-{i}": (prompt, one)})
        tokens.append(final[f"single-{i}", 0].token_ids)
    return tokens


def prefill_tokens(stats) -> int:
    return sum(s.num_prefill_tokens for s in stats)


def test_completion_seeds():
    assert completion_seed(7, 0) == 7
    seeds = {completion_seed(s, i) for s in (0, 7, 2**63 - 1) for i in range(1, 50)}
    assert len(seeds) == 3 * 49 and all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("budget", [256, 12])  # the prompt in one pass, and in chunks
def test_each_completion_equals_a_single_request_with_its_seed(tiny_model_dir, budget):
    engine = make_engine(tiny_model_dir, max_batch_tokens=budget)
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, n=4)
    other = SamplingParams(max_new_tokens=6, temperature=0.8, top_k=20, seed=11, n=2)
    plain = SamplingParams(max_new_tokens=5, temperature=1.0, seed=5)
    requests = {"a": (PROMPT, sampled), "b": (list(range(40, 61)), plain), "c": (list(range(70, 83)), other)}
    final, outputs, stats = run(engine, requests)
    assert prefill_tokens(stats) == len(PROMPT) + 21 + 13  # every prompt once
    assert engine.scheduler.allocator.num_used == 0
    for rid, (prompt, params) in requests.items():
        got = [final[rid, i].token_ids for i in range(params.n)]
        assert got == singles(engine, prompt, params), rid
    assert len({tuple(final["a", i].token_ids) for i in range(4)}) == 4  # the seeds differ
    first = [o.index for o in outputs if o.request_id == "a" and len(o.token_ids) == 1]
    assert first == [0, 1, 2, 3]  # the n first tokens come out together, in index order
    assert all(final["a", i].prompt_tokens == len(PROMPT) for i in range(4))


def test_greedy_n_gives_n_identical_completions(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    final, _, _ = run(engine, {"g": (PROMPT, SamplingParams(max_new_tokens=10, n=3))})
    greedy, _, _ = run(engine, {"one": (PROMPT, SamplingParams(max_new_tokens=10))})
    assert [final["g", i].token_ids for i in range(3)] == [greedy["one", 0].token_ids] * 3
    assert len({final["g", i].text for i in range(3)}) == 1
    final, _, _ = run(engine, {"one-token": (PROMPT, SamplingParams(max_new_tokens=1, n=3))})  # done at the fork
    assert [final["one-token", i].token_ids for i in range(3)] == [greedy["one", 0].token_ids[:1]] * 3
    assert engine.scheduler.allocator.num_used == 0 and engine.scheduler._copies == []


# The parent holds 8 blocks and each child needs one for its copy of the partial block, the watermark one more: no
# child fits, or two of three do (and decodes then preempt).
@pytest.mark.parametrize("num_blocks", [9, 11])
def test_fork_short_of_blocks_recomputes_and_still_matches(tiny_model_dir, num_blocks):
    engine = make_engine(tiny_model_dir, num_blocks=num_blocks)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=21, n=4)
    final, _, stats = run(engine, {"a": (PROMPT, params)})
    assert prefill_tokens(stats) > len(PROMPT)  # some prompt was computed again
    assert engine.scheduler.allocator.num_used == 0
    roomy = make_engine(tiny_model_dir)
    assert [final["a", i].token_ids for i in range(4)] == singles(roomy, PROMPT, params)


def test_abort_cancels_every_completion_and_frees_their_blocks(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_batch_tokens=12)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=1, n=3)
    engine.add_request("early", PROMPT, params)
    engine.step()  # the first chunk of the prompt: nothing forked yet
    outs = engine.abort("early")
    assert [(o.index, o.finish_reason) for o in outs] == [(i, FinishReason.CANCELLED) for i in range(3)]
    assert not engine.has_unfinished() and engine.scheduler.allocator.num_used == 0

    engine.add_request("late", PROMPT, params)
    while not any(o.index == 2 for o in engine.step().outputs):
        pass  # until the fork
    engine.step()
    assert engine.scheduler.allocator.num_used > 0
    outs = engine.abort("late")
    assert [(o.index, o.finish_reason, o.generated_tokens) for o in outs] == [
        (i, FinishReason.CANCELLED, 2) for i in range(3)
    ]
    assert engine.abort("late") == []
    assert not engine.has_unfinished() and engine.scheduler.allocator.num_used == 0


def test_each_completion_stops_on_its_own(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, n=4)
    refs = singles(engine, PROMPT, params)
    stop = refs[1][2]
    final, outputs, _ = run(engine, {"s": (PROMPT, SamplingParams(**{**params.__dict__, "stop_token_ids": (stop,)}))})
    for i, ref in enumerate(refs):
        out = final["s", i]
        if stop in ref:
            assert (out.token_ids, out.finish_reason) == (ref[: ref.index(stop) + 1], FinishReason.STOP)
        else:
            assert (out.token_ids, out.finish_reason) == (ref, FinishReason.LENGTH)
    assert final["s", 1].generated_tokens <= 3
    assert [o.index for o in outputs if o.finished] != [0, 1, 2, 3]  # completions end at different steps
    assert not engine.has_unfinished() and engine.scheduler.allocator.num_used == 0


def test_logprobs_and_echo_for_every_completion(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=9, n=3, logprobs=2, echo=True)
    final, outputs, _ = run(engine, {"l": ("Hello there", params)})
    for i in range(3):
        out = final["l", i]
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        assert all(len(lp.top) == 2 and lp.token for lp in out.logprobs)
        assert out.prompt_text == "Hello there"
    for o in outputs:
        assert [lp.token_id for lp in o.new_logprobs] == o.new_token_ids


# ---- the pieces: scheduler fork, block copies, the broadcast ---------------------------------------------------
def test_block_copies_read_before_they_write():
    caches = [(torch.arange(24.0).view(4, 3, 2), -torch.arange(24.0).view(4, 3, 2)) for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    copy_blocks(caches, [(0, 1), (1, 0), (2, 3)], "cpu")  # a swap: each block is read as the last step left it
    for (k, v), (k0, v0) in zip(caches, before):
        for src, dst in [(0, 1), (1, 0), (2, 3)]:
            assert torch.equal(k[dst], k0[src]) and torch.equal(v[dst], v0[src])


def test_batch_copies_reach_the_other_ranks_encoded():
    batch = Batch([ScheduledSeq(7, [5], 40, [3, 1, 4], True)], 1, [2], [(3, 9), (1, 8)])
    assert decode_batch(encode_batch(batch)) == batch
    assert decode_batch(encode_batch(Batch([], 0, []))).copies == []


# ---- tensor parallel ---------------------------------------------------------------------------------------------
def n_rank(rank: int, world: int, port: int, model: str, out: str) -> None:
    """Rank 0 runs n = 3 seeded completions and their n = 1 twins through a tp=2 engine; rank 1 follows."""
    from fastgen.replica.batch_broadcast import BatchBroadcast
    from fastgen.replica.builder import build_engine, build_runner
    from fastgen.replica.config import CacheConfig, EngineConfig
    from fastgen.replica.parallel import TPGroup

    init(rank, world, port)
    tp, channel = TPGroup(rank, world), BatchBroadcast(rank)
    config = EngineConfig(model=model, dtype="float32", progress=False, cache=CacheConfig(block_size=4, num_blocks=128))
    if rank == 0:
        engine = build_engine(config, tp, channel)
        params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=4, n=3)
        final, _, _ = run(engine, {"n": (PROMPT, params)})
        result = {"n": [final["n", i].token_ids for i in range(3)], "singles": singles(engine, PROMPT, params)}
        channel.stop()
        Path(out).write_text(json.dumps(result))
    else:
        runner, _ = build_runner(config, tp, channel)
        runner.follow()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_tp2_forks_copy_the_kv_on_every_rank(tiny_model_dir, tmp_path):
    from fastgen.kernels import cpu

    # The completions and their twins run in different batches, and the tiny model's next-token distribution is
    # nearly flat: a last-bit difference in the logits moves a seeded draw to the neighbouring token.
    if cpu.pack_f32(torch.ones(8, 8)) is None:
        pytest.skip("no C compiler, or a CPU without the batch-invariant float32 kernel: sgemm serves float32 there")
    out = tmp_path / "tokens.json"
    run_ranks(n_rank, str(tiny_model_dir), str(out), timeout=150)
    result = json.loads(out.read_text())
    assert result["n"] == result["singles"]


# ---- resuming n completions another replica started (stream migration) ------------------------------------------
def delivered_after(outputs, index: int, k: int) -> Resume:
    """What a client has of completion `index` after its first k outputs."""
    mine = [o for o in outputs if o.index == index]
    return Resume(
        tuple(t for o in mine[:k] for t in o.new_token_ids),
        sum(len(o.new_text) for o in mine[:k]),
        finished=k == len(mine),
    )


@pytest.mark.parametrize("logprobs", [None, 2])
def test_a_resumed_request_continues_every_completion_where_it_was_cut(tiny_model_dir, logprobs):
    """Each completion cut at its own place (some before their first token, some finished) and the request resumed
    with one Resume each: every unfinished completion sends exactly what the uninterrupted one sent from its cut on,
    a finished one sends nothing, and the stream's outputs end with the last unfinished completion's."""
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(max_new_tokens=9, temperature=1.0, seed=17, n=3, stop=("\x00never",), logprobs=logprobs)
    final, outputs, _ = run(engine, {"ref": (PROMPT, params)})
    ends = [sum(o.index == i for o in outputs) for i in range(3)]
    for cuts in [(1, 1, 1), (0, ends[1] // 2, ends[2] - 1), (ends[0], 2, 0), (ends[0] - 1, ends[1], ends[2] // 2)]:
        resume = tuple(delivered_after(outputs, i, k) for i, k in enumerate(cuts))
        engine.add_request(f"resumed-{cuts}", PROMPT, params, resume=resume)
        rest = []
        while engine.has_unfinished():
            rest += engine.step().outputs
        for i, (r, k) in enumerate(zip(resume, cuts)):
            ref, sent = final["ref", i], [o for o in rest if o.index == i]
            if r.finished:
                assert sent == [], f"completion {i} finished before the cut {cuts} yet sent more"
                continue
            where = f"completion {i} resumed after {k} of {ends[i]} outputs"
            assert list(r.token_ids) + [t for o in sent for t in o.new_token_ids] == ref.token_ids, where
            assert "".join(o.new_text for o in outputs_of(outputs, i)[:k] + sent) == ref.text, where
            assert (sent[-1].finish_reason, sent[-1].token_ids) == (ref.finish_reason, ref.token_ids), where
            if logprobs is not None:
                new = [lp for o in sent for lp in o.new_logprobs]
                assert [lp.token_id for lp in new] == ref.token_ids[len(r.token_ids) :], where
                assert [lp.logprob for lp in new] == pytest.approx(
                    [lp.logprob for lp in ref.logprobs[len(r.token_ids) :]], abs=1e-4
                ), where
        assert sum(o.finished for o in rest) == sum(not r.finished for r in resume)
    assert engine.scheduler.allocator.num_used == 0


def outputs_of(outputs, index: int) -> list:
    return [o for o in outputs if o.index == index]
