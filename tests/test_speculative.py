"""Speculative decoding (n-gram proposals verified in the SplitFuse pass): the same tokens as without it, greedy or
seeded, through split prompts, preemption, the prefix cache, n > 1, stop strings, max_tokens and resumed streams; the
same distribution over unseeded draws (a chi-square test at a fixed seed set); and its settings checked.

The model is a tiny random Llama with a 64-token vocabulary: its outputs repeat themselves, so proposals are made,
some accepted and some rejected, in every test."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from fastgen.launch.config import DeployConfig, replica_group, validate
from fastgen.replica import pipeline
from fastgen.replica.__main__ import engine_config, parse_args
from fastgen.replica.batch import Batch, ScheduledSeq
from fastgen.replica.batch_broadcast import decode_batch, encode_batch
from fastgen.replica.config import SpeculativeConfig, parse_speculative_config
from fastgen.replica.ngram import propose
from fastgen.replica.outputs import StepStats
from fastgen.replica.request import Constraint, FinishReason, Resume, SamplingParams
from fastgen.replica.slo_scheduler import PROBE_EVERY
from fastgen.replica.speculative import AcceptanceRate
from fastgen.replica.step_model import StepModel
from fastgen.server.metrics import ReplicaMetrics
from fastgen.testing import make_tiny_model

from .tp_ranks import init, run_ranks

VOCAB = 64
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# Prompts that quote themselves (proposals from the start) and one that does not (proposals once the output loops).
PROMPTS = [list(range(5, 25)) * 2, [7, 8, 9, 10] * 6 + [11], [3, 40, 50, 3, 41, 17, 33]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("spec") / "llama", vocab=VOCAB)


def make_engine(model_dir, spec=SPEC, **kw):
    kw = {"block_size": 4, "num_blocks": 256, "max_batch_tokens": 64, **kw}
    return pipeline(str(model_dir), dtype="float32", progress=False, speculative_config=spec, **kw).engine


def run(engine, requests: dict) -> tuple[dict, list]:
    """Adds {request_id: (prompt, params)} and steps to the end: the final output per (request_id, index), and the
    steps' stats. Every KV block is free again at the end."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final, stats = {}, []
    while engine.has_unfinished():
        result = engine.step()
        stats.append(result.stats)
        final.update({(o.request_id, o.index): o for o in result.outputs if o.finished})
    assert engine.scheduler.allocator.num_used == 0
    return final, stats


def tokens(final: dict) -> dict:
    return {k: (o.token_ids, o.text, o.finish_reason) for k, o in final.items()}


def speculated(stats) -> tuple[int, int]:
    """(tokens proposed, tokens accepted) over the steps, checking the per-position counts add up."""
    proposed = sum(s.spec_draft_tokens for s in stats)
    accepted = sum(s.spec_accepted_tokens for s in stats)
    for s in stats:
        assert sum(s.spec_accepted_per_pos) == s.spec_accepted_tokens
        assert list(s.spec_accepted_per_pos) == sorted(s.spec_accepted_per_pos, reverse=True)
    return proposed, accepted


def same_logprobs(a, b) -> bool:
    """The same tokens and alternatives, logprobs equal but for rounding (a verify's pass adds in another order)."""
    pairs = [(x, y) for x, y in zip(a, b)] + [(t, u) for x, y in zip(a, b) for t, u in zip(x.top, y.top)]
    return len(a) == len(b) and all(x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4 for x, y in pairs)


def compare(model_dir, requests: dict, spec=SPEC, both_ways=True, **kw) -> tuple[dict, list]:
    """Runs requests with and without speculation, asserts the same outputs (logprobs and prompt logprobs too);
    returns the speculative run's."""
    plain, _ = run(make_engine(model_dir, spec=None, **kw), requests)
    final, stats = run(make_engine(model_dir, spec=spec, **kw), requests)
    assert tokens(final) == tokens(plain)
    for key, out in final.items():
        assert same_logprobs(out.logprobs, plain[key].logprobs), key
        assert same_logprobs(out.prompt_logprobs, plain[key].prompt_logprobs), key
    proposed, accepted = speculated(stats)
    assert proposed > 0 and (0 < accepted < proposed or not both_ways)  # proposals were verified both ways
    return final, stats


GREEDY = SamplingParams(max_new_tokens=30, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=30, temperature=0.4, seed=4, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("budget", [64, 6])  # prompts in one pass, and split across passes with verifies budgeted
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_same_tokens_with_and_without_speculation(model_dir, budget, params):
    final, stats = compare(model_dir, {str(i): (p, params) for i, p in enumerate(PROMPTS)}, max_batch_tokens=budget)
    assert all(s.num_tokens <= budget for s in stats)
    assert any(s.spec_drafts > 1 for s in stats)  # several verifies in one pass


def test_penalties_bias_and_min_tokens_apply_at_every_verified_position(model_dir):
    params = SamplingParams(
        max_new_tokens=24,
        min_new_tokens=12,
        temperature=0.5,
        seed=9,
        repetition_penalty=1.3,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        logit_bias=((7, 2.0),),
        min_p=0.05,
        top_k=20,
    )
    greedy = SamplingParams(max_new_tokens=24, repetition_penalty=1.2, ignore_eos=True, logprobs=3)
    scored = SamplingParams(max_new_tokens=16, prompt_logprobs=2, ignore_eos=True)  # its prefill beside verifies
    requests = {"a": (PROMPTS[0], params), "b": (PROMPTS[1], greedy), "c": (PROMPTS[2], params)}
    final, _ = compare(model_dir, requests | {"d": (PROMPTS[0] * 2, scored)}, max_batch_tokens=16)
    assert len(final["d", 0].prompt_logprobs) == 2 * len(PROMPTS[0]) - 1
    assert len(final["b", 0].logprobs) == 24


def test_preemption_and_n_completions(model_dir):
    """A pool too small for every sequence: sequences are preempted and recomputed, speculating before and after;
    n = 3 completions fork from one prefill and speculate each on its own."""
    n3 = SamplingParams(max_new_tokens=24, temperature=0.4, seed=2, n=3, ignore_eos=True)
    requests = {"a": (PROMPTS[0], GREEDY), "b": (PROMPTS[1], n3), "c": (PROMPTS[2], GREEDY)}
    final, _ = compare(model_dir, requests, num_blocks=28)
    assert any(o.num_preemptions for o in final.values())


def test_accepted_tokens_fill_prefix_cache_blocks(model_dir):
    """Blocks filled by accepted proposals are published once accepted, with the tokens accepted: a request whose
    prompt is an earlier one's prompt and output reuses them and continues as an engine without a cache does."""
    engine = make_engine(model_dir)
    first, _ = run(engine, {"a": (PROMPTS[0], GREEDY)})
    follow = PROMPTS[0] + first["a", 0].token_ids + [5, 6]
    again, stats = run(engine, {"b": (follow, GREEDY)})
    assert again["b", 0].cached_prompt_tokens >= len(follow) - 8  # all but the partly filled tail, and one block
    plain, _ = run(make_engine(model_dir, spec=None, prefix_caching=False), {"b": (follow, GREEDY)})
    assert tokens(again) == tokens(plain)


def test_stop_strings_and_max_tokens(model_dir):
    """A stop string inside an accepted run ends the output there; no output passes max_new_tokens, however many
    proposals were accepted."""
    reference, _ = run(make_engine(model_dir, spec=None), {"r": (PROMPTS[1], GREEDY)})
    text = reference["r", 0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    requests = {"stop": (PROMPTS[1], SamplingParams(max_new_tokens=30, stop=(stop,), ignore_eos=True))}
    for i, m in enumerate((1, 2, 3, 5, 9)):
        requests[f"max{m}"] = (PROMPTS[i % 3], SamplingParams(max_new_tokens=m, ignore_eos=True))
    final, _ = compare(model_dir, requests)
    assert final["stop", 0].finish_reason is FinishReason.STOP and stop not in final["stop", 0].text
    for m in (1, 2, 3, 5, 9):
        assert len(final[f"max{m}", 0].token_ids) == m and final[f"max{m}", 0].finish_reason is FinishReason.LENGTH


def test_slo_scheduler_counts_verify_tokens(model_dir):
    final, stats = compare(model_dir, {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)}, scheduler="slo")
    verified = [s for s in stats if s.spec_drafts]
    # The plan's shape counts a verify's tokens as a chunk continuing its sequence (as batch_shape does).
    assert all(s.plan.shape.prompt_tokens >= s.spec_draft_tokens + s.spec_drafts for s in verified)


@pytest.mark.parametrize("verify_cost", [1e-5, 0.1])  # seconds per verify token: cheap, and dearer than a step
def test_slo_scheduler_verifies_when_its_step_model_says_it_pays(model_dir, verify_cost):
    """The slo scheduler asks its step-time model whether verifying raises tokens per second; when the model says
    verify tokens cost far more than the tokens they may save, it verifies only every PROBE_EVERY-th time."""
    requests = {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)}
    plain, _ = run(make_engine(model_dir, spec=None, scheduler="slo"), requests)
    engine = make_engine(model_dir, scheduler="slo")
    engine.scheduler.model = StepModel((0.01, verify_cost, 1e-4, 0.0, 0.0), learn=False)
    final, stats = run(engine, requests)
    assert tokens(final) == tokens(plain)
    verified = sum(1 for s in stats if s.spec_drafts)
    if verify_cost < 1e-3:
        assert verified > len(stats) // 2
    else:
        assert 0 < verified <= len(stats) // PROBE_EVERY + 1
    assert engine.scheduler.acceptance.rate != AcceptanceRate().rate  # the settled verifies were counted


def test_resumed_stream_continues_as_uninterrupted(model_dir):
    """A stream resumed on a speculating replica from another's tokens sends what the uninterrupted one did."""
    params = SamplingParams(max_new_tokens=20, temperature=0.4, seed=7, ignore_eos=True)
    reference, _ = run(make_engine(model_dir, spec=None), {"r": (PROMPTS[2], params)})
    ref = reference["r", 0]
    engine = make_engine(model_dir)
    engine.add_request("x", PROMPTS[2], params, resume=(Resume(tuple(ref.token_ids[:7])),))
    final, _ = run(engine, {})
    assert final["x", 0].token_ids == ref.token_ids


def test_constrained_requests_do_not_speculate(tiny_model_dir):
    """A grammar must accept each proposal before the next mask exists: a constrained request decodes token by token
    while one beside it, with the same prompt, speculates."""
    regex = SamplingParams(max_new_tokens=12, constraint=Constraint("regex", "(ab ){6}"))
    prompt = [100, 200, 300, 400] * 5
    final, stats = run(make_engine(tiny_model_dir), {"c": (prompt, regex)})
    assert final["c", 0].text.startswith("ab ab") and speculated(stats)[0] == 0
    assert speculated(run(make_engine(tiny_model_dir), {"free": (prompt, GREEDY)})[1])[0] > 0


def test_disable_by_batch_size(model_dir):
    spec = {**SPEC, "disable_by_batch_size": 2}
    engine = make_engine(model_dir, spec=spec)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    while engine.has_unfinished():
        running = len(engine.scheduler.running)
        stats = engine.step().stats
        assert stats.spec_drafts == 0 or running < 2
    final, stats = run(engine, {"alone": (PROMPTS[0], GREEDY)})
    assert speculated(stats)[0] > 0  # alone it speculates again


def test_step_stats_become_spec_decode_counters(model_dir):
    _, stats = run(make_engine(model_dir), {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)})
    registry = CollectorRegistry()
    metrics = ReplicaMetrics(registry, "r0", "tiny")
    for s in stats:
        metrics.on_step(s)
    metrics.on_step(StepStats(1, 1, 0, 64, 0, 0.01, 0.01, 0, 1, 1, 10))  # a step without verifies
    labels = {"replica": "r0", "model": "tiny"}

    def value(name, **extra):
        return registry.get_sample_value(f"fastgen_spec_decode_{name}_total", labels | extra)

    assert value("num_drafts") == sum(s.spec_drafts for s in stats)
    assert value("num_draft_tokens") == sum(s.spec_draft_tokens for s in stats)
    assert value("num_accepted_tokens") == sum(s.spec_accepted_tokens for s in stats) > 0
    first = sum(s.spec_accepted_per_pos[0] for s in stats if s.spec_accepted_per_pos)
    assert value("num_accepted_tokens_per_pos", position="0") == first > 0


def spec_rank(rank: int, world: int, port: int, model: str, out: str, spec: str) -> None:
    """Rank 0 runs PROMPTS greedy through a speculating tp=2 engine (a draft model on rank 0 alone); rank 1
    follows."""
    from fastgen.replica.batch_broadcast import BatchBroadcast
    from fastgen.replica.builder import build_engine, build_runner
    from fastgen.replica.config import CacheConfig, EngineConfig, SchedulerConfig
    from fastgen.replica.parallel import TPGroup

    init(rank, world, port)
    tp, channel = TPGroup(rank, world), BatchBroadcast(rank)
    config = EngineConfig(
        model=model,
        dtype="float32",
        progress=False,
        scheduler=SchedulerConfig(max_batch_tokens=16, max_seqs=16),
        cache=CacheConfig(block_size=4, num_blocks=128),
        speculative_config=parse_speculative_config(spec),
    )
    if rank == 0:
        final, stats = run(build_engine(config, tp, channel), {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)})
        channel.stop()
        result = {"tokens": [final[str(i), 0].token_ids for i in range(len(PROMPTS))], "spec": speculated(stats)}
        Path(out).write_text(json.dumps(result))
    else:
        runner, _ = build_runner(config, tp, channel)
        runner.follow()
    torch.distributed.destroy_process_group()


@pytest.mark.slow  # two spawned ranks load torch and the model: about 10 s
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tp2_verifies_on_every_rank(model_dir, other_dir, tmp_path, method):
    out = tmp_path / "tokens.json"
    spec = SPEC if method == "ngram" else draft(other_dir)
    run_ranks(spec_rank, str(model_dir), str(out), json.dumps(spec), timeout=150)
    result = json.loads(out.read_text())
    plain, _ = run(
        make_engine(model_dir, spec=None, max_batch_tokens=16), {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)}
    )
    assert result["tokens"] == [plain[str(i), 0].token_ids for i in range(len(PROMPTS))]
    assert result["spec"][0] > 0 and result["spec"][1] < result["spec"][0]


def test_verify_rows_cross_the_tensor_parallel_broadcast():
    seqs = [ScheduledSeq(3, [5], 9, [1, 2, 3], True), ScheduledSeq(4, [6, 7, 8], 4, [4, 5], True, num_draft=2)]
    batch = Batch(seqs, 1, [])
    assert decode_batch(encode_batch(batch)) == batch


@pytest.mark.slow  # SmolLM2-135M in float32 generating 2 x 32 tokens twice: about 15 s
def test_smollm2_copying_greedy_same_tokens():
    from fastgen.benchmarks.speculative import copying_prompts

    prompts = copying_prompts(2, words=40)
    outs = {}
    for name, spec in (("plain", None), ("ngram", SPEC)):
        pipe = pipeline("smollm2-135m", dtype="float32", max_batch_tokens=16, speculative_config=spec, progress=False)
        outs[name] = [o.token_ids for o in pipe(prompts, max_new_tokens=32)]
        stats = pipe.engine.scheduler.acceptance
    assert outs["ngram"] == outs["plain"]
    assert stats.rate > 0.3  # the passages are copied: most proposals hold


# ---- draft model -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """A draft that is not the model: one layer, other weights, the same vocabulary."""
    return make_tiny_model(tmp_path_factory.mktemp("draft") / "llama", vocab=VOCAB, layers=1, seed=1)


def draft(path, k=3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


@pytest.mark.parametrize("budget", [64, 6])
def test_a_draft_of_the_model_itself_has_every_greedy_proposal_accepted(model_dir, budget):
    """The model as its own draft proposes what greedy decoding picks: every proposal is accepted, through split
    prompts, preemption (a small pool) and the prefix cache (then a prompt that is an earlier one's output, in the
    same engine), which holds only when the draft's KV is kept right through all of them. A sampled request beside
    them rejects some."""
    kw = {"max_batch_tokens": budget, "num_blocks": 20}
    first = {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)}
    engine = make_engine(model_dir, spec=draft(model_dir), **kw)
    final, stats = run(engine, first)
    assert tokens(final) == tokens(run(make_engine(model_dir, spec=None, **kw), first)[0])
    assert speculated(stats)[0] == speculated(stats)[1] > 0
    assert any(o.num_preemptions for o in final.values())
    kw["num_blocks"] = 64
    engine = make_engine(model_dir, spec=draft(model_dir), **kw)
    run(engine, {"0": first["0"]})
    follow = {"f": (PROMPTS[0] + final["0", 0].token_ids + [5], GREEDY), "s": (PROMPTS[2], SEEDED)}
    again, stats = run(engine, follow)
    assert again["f", 0].cached_prompt_tokens >= len(PROMPTS[0]) + 28
    assert tokens(again) == tokens(run(make_engine(model_dir, spec=None, prefix_caching=False, **kw), follow)[0])
    proposed, accepted = speculated(stats)
    assert 0 < accepted < proposed


def test_another_draft_gives_the_same_tokens(model_dir, other_dir):
    n2 = SamplingParams(max_new_tokens=20, temperature=0.4, seed=2, n=2, ignore_eos=True, logprobs=1)
    requests = {"a": (PROMPTS[0], GREEDY), "b": (PROMPTS[1], n2), "c": (PROMPTS[2], SEEDED)}
    compare(model_dir, requests, spec=draft(other_dir, k=4), max_batch_tokens=12, num_blocks=48, both_ways=False)


def test_a_draft_must_share_the_vocabulary(model_dir, tiny_model_dir):
    with pytest.raises(ValueError, match="vocabulary of 49152 tokens, the model 64"):
        make_engine(model_dir, spec=draft(tiny_model_dir))


# ---- the distribution of sampled outputs ------------------------------------------------------------------------
def chi_square_p(a: Counter, b: Counter) -> float:
    """The p-value of Pearson's chi-square test that two samples of tokens come from one distribution (categories
    seen fewer than 10 times in both pooled into one)."""
    keys = sorted(set(a) | set(b))
    small = [k for k in keys if a[k] + b[k] < 10]
    rows = [(a[k], b[k]) for k in keys if k not in small] + [(sum(a[k] for k in small), sum(b[k] for k in small))]
    rows = [r for r in rows if sum(r)]
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for x, y in rows:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    df = len(rows) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_sampled_outputs_follow_the_same_distribution(model_dir):
    """Per-position token frequencies over 240 unseeded-alike draws (seeds 0..239 without speculation, 1000..1239
    with it: different draws, so the test compares distributions, not coupled streams) agree by a chi-square test
    at every position. Seeds are fixed, so the result is too."""
    positions, n = 6, 240
    prompt = PROMPTS[1]

    def draws(spec, seeds, temperature=0.6):
        engine = make_engine(model_dir, spec=spec, max_batch_tokens=256)
        kw = {"max_new_tokens": positions, "temperature": temperature, "ignore_eos": True}
        params = [SamplingParams(seed=s, **kw) for s in seeds]
        final, stats = run(engine, {str(i): (prompt, p) for i, p in enumerate(params)})
        counts = [Counter(final[str(i), 0].token_ids[j] for i in range(len(seeds))) for j in range(positions)]
        return counts, stats

    plain, _ = draws(None, range(n))
    spec, stats = draws(SPEC, range(1000, 1000 + n))
    proposed, accepted = speculated(stats)
    assert accepted > 0.1 * proposed and accepted < proposed
    p_values = [chi_square_p(a, b) for a, b in zip(plain, spec)]
    assert min(p_values) > 0.001, p_values
    # The test can tell distributions apart: a lower temperature's draws fail it.
    colder, _ = draws(SPEC, range(2000, 2000 + n), temperature=0.3)
    assert min(chi_square_p(a, b) for a, b in zip(plain, colder)) < 0.001


# ---- settings ----------------------------------------------------------------------------------------------------
def test_config_parses_vllm_keys():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert config == SpeculativeConfig("ngram", 3, 5, 1)
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None
    assert parse_speculative_config(dict(SPEC, disable_by_batch_size=8)).speculates(7)
    assert not parse_speculative_config(dict(SPEC, disable_by_batch_size=8)).speculates(8)


@pytest.mark.parametrize(
    "value, message",
    [
        ("{bad", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ({"num_speculative_tokens": 2}, "needs a method"),
        ({"method": "eagle"}, "method must be one of ngram, draft_model"),
        ({"method": "ngram", "num_lookahead": 2}, "unknown speculative_config key 'num_lookahead'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens must be an integer"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "at most 16"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min (3) exceeds"),
        ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size must be an integer >= 1"),
        ({"method": "draft_model"}, "draft_model needs a model"),
        ({"method": "ngram", "model": "x"}, "ngram takes none"),
    ],
)
def test_config_errors_name_the_key(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_speculative_config(value)


def test_replica_and_deploy_flags(capsys):
    args = parse_args(["--port", "1", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert engine_config(args).speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    with pytest.raises(SystemExit):
        parse_args(["--port", "1", "--speculative-config", '{"method": "ngram", "k": 2}'])
    assert "unknown speculative_config key 'k'" in capsys.readouterr().err
    text = '{"method": "ngram", "num_speculative_tokens": 2}'
    deploy = DeployConfig(model="m", speculative_config=text)
    argv = replica_group(deploy, "python", 0)[0].argv
    assert argv[argv.index("--speculative-config") + 1] == text
    assert any("speculative_config" in p for p in validate(DeployConfig(model="m", speculative_config="{")))


def test_ngram_proposals():
    assert propose([1, 2, 3, 9, 1, 2], k=3, lookup_min=1, lookup_max=3) == [3, 9, 1]
    assert propose([1, 2, 3, 9, 1, 2], k=1, lookup_min=1, lookup_max=3) == [3]
    # The longest suffix wins over a later, shorter match; the latest occurrence of the longest one.
    assert propose([5, 1, 2, 7, 6, 2, 8, 1, 2, 4, 4, 1, 2], k=2, lookup_min=1, lookup_max=2) == [4, 4]
    assert propose([4, 2, 8, 3, 2], k=2, lookup_min=1, lookup_max=2) == [8, 3]
    assert propose([4, 2, 8, 3, 2], k=2, lookup_min=2, lookup_max=2) == []
    assert propose([1, 2, 3], k=4, lookup_min=1, lookup_max=3) == []
    assert propose([7, 7], k=4, lookup_min=1, lookup_max=3) == [7]  # what follows, up to the end
    assert propose([], k=4, lookup_min=1, lookup_max=3) == []


def test_ngram_search_equals_a_plain_scan():
    """The packed-bytes search against the obvious loop, on random sequences of small and large token ids (a match
    across token boundaries in the bytes must not count)."""

    def scan(tokens, k, lo, hi):
        for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
            for end in range(len(tokens) - 2, n - 2, -1):
                if tokens[end - n + 1 : end + 1] == tokens[len(tokens) - n :]:
                    return tokens[end + 1 : end + 1 + k]
        return []

    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 300, 70000, 2**31 - 1])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        assert propose(tokens, k, lo, hi) == scan(tokens, k, lo, hi), (tokens, k, lo, hi)
    # 256, 0 packed little-endian hold 1's bytes across their boundary, later than the real 1 at index 0.
    assert propose([1, 7, 256, 0, 9, 1], k=2, lookup_min=1, lookup_max=1) == [7, 256]
