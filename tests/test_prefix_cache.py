"""Automatic prefix caching: content hashes, the allocator's reference counts and LRU, the scheduler's reuse of cached
prefixes (no torch), and the engine's outputs, which must not change whether caching is on or off."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgen.replica.block_allocator import BlockAllocator
from fastgen.replica.config import SchedulerConfig
from fastgen.replica.prefix_cache import block_hash, extend_hashes, root_hash
from fastgen.replica.request import SamplingParams, SeqStatus, Sequence
from fastgen.replica.scheduler import Scheduler


# ---- hashes ---------------------------------------------------------------------------------------------------
def test_hashes_are_stable_across_processes_and_salted():
    code = (
        "from fastgen.replica.prefix_cache import block_hash, root_hash; print(block_hash(root_hash(), [1, 2]).hex())"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code], check=True, capture_output=True, text=True, env={"PYTHONHASHSEED": seed}
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert runs == {block_hash(root_hash(), [1, 2]).hex()}
    assert block_hash(root_hash(), [1, 2]).hex() == "9ea15d2d2fa4091f5983e8fa00a75b2a"  # a new encoding must be noticed
    assert block_hash(root_hash("tenant"), [1, 2]) != block_hash(root_hash(), [1, 2])
    assert block_hash(root_hash(), [1, 2]) != block_hash(root_hash(), [2, 1])


def test_hashes_chain_over_full_blocks_only():
    hashes: list[bytes] = []
    extend_hashes(hashes, list(range(10)), 4, "", 10)
    assert len(hashes) == 2  # 10 tokens: two full blocks of 4
    assert hashes[1] == block_hash(block_hash(root_hash(), [0, 1, 2, 3]), [4, 5, 6, 7])
    other: list[bytes] = []
    extend_hashes(other, [9, 1, 2, 3, 4, 5, 6, 7], 4, "", 2)
    assert other[1] != hashes[1]  # same tokens, different parent


# ---- allocator ------------------------------------------------------------------------------------------------
def test_freed_cached_blocks_are_evicted_last_and_tail_first():
    alloc = BlockAllocator(6, 2)
    table: list[int] = []
    alloc.allocate(table, 6)  # blocks 0, 1, 2
    for i, block in enumerate(table):
        alloc.publish(block, bytes([i]))
    held = list(table)
    alloc.free(table)
    assert alloc.num_free == 6 and alloc.num_cached == 3
    fresh: list[int] = []
    assert alloc.allocate(fresh, 6) == [3, 4, 5]  # never-cached blocks first
    assert alloc.num_evictions == 0
    assert alloc.allocate(fresh, 8) == [held[2]]  # then the least recently freed cached block: the tail
    assert alloc.num_evictions == 1 and alloc.lookup([bytes([0]), bytes([1]), bytes([2])]) == held[:2]


def test_shared_blocks_are_counted_and_not_evicted():
    alloc = BlockAllocator(3, 2)
    a: list[int] = []
    alloc.allocate(a, 4)
    alloc.publish(a[0], b"x")
    b: list[int] = []
    alloc.share(b, alloc.lookup([b"x"]))
    assert alloc.refs(a[0]) == 2 and alloc.num_used == 2
    alloc.free(a)
    assert alloc.refs(b[0]) == 1 and alloc.num_free == 2
    assert alloc.allocate([], 6) is None  # the shared block stays out of reach
    alloc.free(b)
    assert alloc.num_free == 3 and alloc.lookup([b"x"]) == b[:0] + [0]


def test_disabled_cache_publishes_and_finds_nothing():
    alloc = BlockAllocator(2, 2, prefix_caching=False)
    table: list[int] = []
    alloc.allocate(table, 2)
    alloc.publish(table[0], b"x")
    assert alloc.lookup([b"x"]) == [] and alloc.num_cached == 0


# ---- scheduler ------------------------------------------------------------------------------------------------
def scheduler(num_blocks=64, block_size=4, budget=64, policy="splitfuse", caching=True):
    config = SchedulerConfig(budget, 8, policy, 10**6, watermark=0.0)
    return Scheduler(config, BlockAllocator(num_blocks, block_size, caching))


def run_to_end(sched: Scheduler, seqs: list[Sequence]) -> None:
    while sched.has_work():
        for s in sched.schedule().seqs:
            seq = next(q for q in seqs if q.seq_id == s.seq_id)
            if s.sample:
                seq.token_ids.append(7)
                if seq.num_generated >= seq.max_new_tokens:
                    sched.finish(seq)


@pytest.mark.parametrize(
    "prompt_len, cached",
    [(10, 8), (12, 8), (13, 12), (3, 0)],  # mid-block; ends on a block: its last block is recomputed; too short
)
def test_a_repeated_prompt_starts_after_its_cached_full_blocks(prompt_len, cached):
    sched = scheduler()
    first = Sequence(0, list(range(prompt_len)), prompt_len, 2)
    sched.add(first)
    run_to_end(sched, [first])
    sched.prefix_stats()
    again = Sequence(1, list(range(prompt_len)), prompt_len, 2)
    sched.add(again)
    (s,) = sched.schedule().seqs
    assert s.start == cached and s.token_ids == again.token_ids[cached:] and s.sample
    stats = sched.prefix_stats()
    assert (stats.queries, stats.hits) == (prompt_len, cached)
    assert (first.num_cached_prompt_tokens, again.num_cached_prompt_tokens) == (0, cached)


@pytest.mark.parametrize("policy", ["splitfuse", "prefill_first", "static"])
def test_shared_prefixes_arriving_together_share_within_one_batch(policy):
    sched = scheduler(policy=policy)
    a, b = Sequence(0, list(range(20)), 20, 2), Sequence(1, [*range(16), 90, 91], 18, 2)
    sched.add(a)
    sched.add(b)
    sa, sb = sched.schedule().seqs
    assert (sa.start, sb.start) == (0, 16)  # a's 4 full blocks were published when its chunk was scheduled
    assert sb.block_table[:4] == sa.block_table[:4]
    assert all(sched.allocator.refs(blk) == 2 for blk in sa.block_table[:4])


def test_a_cached_prefix_costs_no_token_budget():
    sched = scheduler(budget=8)
    first = Sequence(0, list(range(32)), 32, 1)
    sched.add(first)
    run_to_end(sched, [first])
    again = Sequence(1, [*range(32), 5], 33, 1)
    sched.add(again)
    (s,) = sched.schedule().seqs
    assert s.start == 32 and len(s.token_ids) == 1


def test_salts_and_disabled_caching_find_nothing():
    for caching, salt in ((True, "other"), (False, "")):
        sched = scheduler(caching=caching)
        first = Sequence(0, list(range(12)), 12, 1)
        sched.add(first)
        run_to_end(sched, [first])
        again = Sequence(1, list(range(12)), 12, 1, cache_salt=salt)
        sched.add(again)
        assert sched.schedule().seqs[0].start == 0
        assert sched.prefix_stats().hits == 0


def test_a_preempted_sequence_re_hits_its_own_blocks():
    sched = scheduler(num_blocks=8, budget=64)
    old, new = Sequence(0, list(range(16)), 16, 12), Sequence(1, list(range(50, 62)), 12, 12)
    sched.add(old)
    sched.add(new)
    seqs = [old, new]
    while new.num_preemptions == 0:
        for s in sched.schedule().seqs:
            if s.sample:
                next(q for q in seqs if q.seq_id == s.seq_id).token_ids.append(3)
    assert new.block_hashes and new.status is SeqStatus.WAITING
    sched.finish(old)
    (s,) = sched.schedule().seqs
    assert s.seq_id == 1 and s.start == (new.num_tokens - 1) // 4 * 4
    assert new.num_cached_prompt_tokens == 0  # its own blocks, found again after a preemption, are no cache hit


# ---- invariants under random workloads ------------------------------------------------------------------------
PREFIXES = ([], list(range(100, 113)), list(range(200, 232)))


def check_allocator(sched: Scheduler) -> None:
    alloc, cache = sched.allocator, sched.allocator.cache
    held: dict[int, int] = {}
    for seq in sched.running:
        for block in seq.block_table:
            held[block] = held.get(block, 0) + 1
    assert all(not seq.block_table for seq in sched.waiting)
    assert [alloc.refs(b) for b in range(alloc.num_blocks)] == [held.get(b, 0) for b in range(alloc.num_blocks)]
    free, evictable = alloc._free, list(cache._lru) if cache else []
    assert len(set(free)) == len(free) and not set(free) & set(evictable)
    assert not (set(free) | set(evictable)) & held.keys()  # a block in use is never free nor evictable
    assert len(free) + len(evictable) + len(held) == alloc.num_blocks  # nothing leaks
    if cache:
        assert len(cache._block) == len(cache._hash)  # one block per hash, one hash per block
        assert all(cache._hash[b] == h for h, b in cache._block.items())
        assert set(evictable) <= cache._hash.keys()


def step_kv(kv: dict[int, int], batch, seqs: dict[int, Sequence], block_size: int) -> None:
    """Plays the model's part on a fake cache of token ids: copies, then every new token's KV written, then every
    sequence's context read back. A cached block reused wrongly reads another sequence's tokens."""
    snapshot = {(d, o): kv.get(s * block_size + o) for s, d in batch.copies for o in range(block_size)}
    for (d, o), token in snapshot.items():
        kv[d * block_size + o] = token
    for s in batch.seqs:
        for i, token in enumerate(s.token_ids):
            pos = s.start + i
            kv[s.block_table[pos // block_size] * block_size + pos % block_size] = token
    for s in batch.seqs:
        context = [kv.get(s.block_table[p // block_size] * block_size + p % block_size) for p in range(s.start)]
        assert context == seqs[s.seq_id].token_ids[: s.start], f"sequence {s.seq_id} reads a wrong KV block"


def simulate(requests, policy, budget, num_blocks, block_size, caching):
    """Runs [(prefix, suffix_len, max_new, n, arrival_step, salt)] to the end on a fake KV cache, checking the
    allocator at every step. Returns every sequence's tokens and the prefix-cache hits."""
    sched = Scheduler(SchedulerConfig(budget, 4, policy, 10**6), BlockAllocator(num_blocks, block_size, caching))
    seqs: dict[int, Sequence] = {}
    names: dict[int, tuple[int, int]] = {}  # seq id -> (request, completion): fork order differs between runs
    kv: dict[int, int] = {}
    hits, step, next_id = 0, 0, len(requests)
    while step < 20000 and (step <= max(r[4] for r in requests) or sched.has_work()):
        for i, (prefix, suffix, max_new, _, arrival, salt) in enumerate(requests):
            if arrival == step:
                tokens = PREFIXES[prefix] + [(i * 7 + j) % 97 for j in range(suffix or not prefix)]
                seqs[i] = Sequence(i, tokens, len(tokens), max_new, cache_salt=salt)
                names[i] = (i, 0)
                sched.add(seqs[i])
        step += 1
        batch = sched.schedule()
        step_kv(kv, batch, seqs, block_size)
        for s in batch.seqs:
            seq = seqs[s.seq_id]
            if s.sample and seq.seq_id < len(requests) and seq.num_generated == 0 and requests[seq.seq_id][3] > 1:
                kids = [
                    Sequence(
                        next_id + k, list(seq.token_ids), seq.num_prompt_tokens, seq.max_new_tokens, cache_salt=salt
                    )
                    for k in range(requests[seq.seq_id][3] - 1)
                ]
                next_id += len(kids)
                seqs.update({k.seq_id: k for k in kids})
                names.update({kid.seq_id: (seq.seq_id, k + 1) for k, kid in enumerate(kids)})
                sched.fork(seq, kids)
                for k, kid in enumerate(kids):
                    kid.token_ids.append((sum(kid.token_ids) + k + 1) % 97)
            if s.sample:
                seq.token_ids.append(sum(seq.token_ids) % 97)
        for seq in list(seqs.values()):
            if seq.status is not SeqStatus.FINISHED and seq.num_generated >= seq.max_new_tokens:
                sched.finish(seq)
        check_allocator(sched)
        hits += sched.prefix_stats().hits
    assert not sched.has_work() and sched.allocator.num_free == num_blocks
    return {names[i]: s.token_ids for i, s in seqs.items()}, hits


request_strategy = st.tuples(
    st.integers(0, 2),
    st.integers(0, 12),
    st.integers(1, 8),
    st.integers(1, 3),
    st.integers(0, 8),
    st.sampled_from("ab"),
)


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=10),
    policy=st.sampled_from(["splitfuse", "prefill_first", "static"]),
    budget=st.integers(4, 64),
    block_size=st.sampled_from([1, 2, 4, 8]),
    spare_blocks=st.integers(0, 24),
)
def test_random_shared_prefix_workloads_keep_the_allocator_sound(requests, policy, budget, block_size, spare_blocks):
    requests = [r if policy == "splitfuse" else (*r[:3], 1, *r[4:]) for r in requests]  # forks: the engine's path
    longest = max(len(PREFIXES[p]) + s + m for p, s, m, *_ in requests)
    num_blocks = -(-longest // block_size) + 1 + spare_blocks
    tokens, _ = simulate(requests, policy, budget, num_blocks, block_size, caching=True)
    reference, _ = simulate(requests, policy, budget, num_blocks, block_size, caching=False)
    assert tokens == reference


def test_the_simulation_does_hit():
    requests = [(2, 3, 4, 1, 0, "a"), (2, 5, 4, 2, 3, "a"), (2, 5, 4, 1, 3, "b")]
    _, hits = simulate(requests, "splitfuse", 16, 40, 4, caching=True)
    assert hits == 32  # the second request's 32-token prefix; the third has another salt
    _, hits = simulate(requests, "splitfuse", 16, 40, 4, caching=False)
    assert hits == 0


# ---- wiring ---------------------------------------------------------------------------------------------------
def test_no_prefix_caching_flags_reach_the_engine_config():
    from fastgen.launch.config import DeployConfig, replica_spec
    from fastgen.replica.__main__ import engine_config, parse_args

    assert engine_config(parse_args(["--port", "1"])).cache.prefix_caching
    assert not engine_config(parse_args(["--port", "1", "--no-prefix-caching"])).cache.prefix_caching
    assert "--no-prefix-caching" in replica_spec(DeployConfig(prefix_caching=False), "python", 0).argv
    assert "--no-prefix-caching" not in replica_spec(DeployConfig(), "python", 0).argv


def test_cache_salt_crosses_the_wire():
    from fastgen.balancer.openai_protocol import Fields, sampling_params
    from fastgen.proto import fastgen_pb2 as pb
    from fastgen.replica.service import params_from_proto

    assert params_from_proto(pb.SamplingParams(cache_salt="tenant-1")) == SamplingParams(cache_salt="tenant-1")
    assert sampling_params(Fields({"cache_salt": "t"}), 1, None).cache_salt == "t"


# ---- the engine: outputs equal with caching on and off ----------------------------------------------------------
SYSTEM = list(range(300, 340))  # 40 tokens: 10 full blocks of 4
GREEDY = SamplingParams(max_new_tokens=8, min_new_tokens=8)
SEEDED = SamplingParams(max_new_tokens=8, min_new_tokens=8, temperature=1.0, top_k=50, seed=5)


def make_engine(model_dir, caching: bool, **kw):
    from fastgen.replica import pipeline

    kw = {"block_size": 4, "num_blocks": 256, "max_batch_tokens": 256, **kw}
    return pipeline(str(model_dir), dtype="float32", progress=False, prefix_caching=caching, **kw).engine


def drive(engine, waves: list[dict]) -> tuple[dict, list[list]]:
    """Adds each wave of {request_id: (prompt, params)} and steps until it has finished. Returns every completion's
    tokens by (request_id, index) and each wave's step stats."""
    tokens, stats = {}, []
    for wave in waves:
        for rid, (prompt, params) in wave.items():
            engine.add_request(rid, prompt, params)
        stats.append([])
        while engine.has_unfinished():
            result = engine.step()
            stats[-1] += [result.stats] if result.stats else []
            tokens.update({(o.request_id, o.index): o.token_ids for o in result.outputs if o.finished})
    assert engine.scheduler.allocator.num_used == 0
    return tokens, stats


SCENARIOS = {
    "second request shares a long prefix": [{"a": (SYSTEM + [1, 2, 3], GREEDY)}, {"b": (SYSTEM + [7, 8], GREEDY)}],
    "whole prompt cached, on a block boundary": [{"a": (SYSTEM, GREEDY)}, {"b": (SYSTEM, GREEDY)}],
    "whole prompt cached, mid-block": [{"a": (SYSTEM + [9, 9], GREEDY)}, {"b": (SYSTEM + [9, 9], GREEDY)}],
    "prefix arrives twice in one step": [{"a": (SYSTEM + [1], GREEDY), "b": (SYSTEM + [2, 3, 4], GREEDY)}],
    "a generated continuation is reused": [{"a": (SYSTEM[:10], GREEDY)}, {"b": (SYSTEM[:10], GREEDY)}],
    "seeded sampling": [{"a": (SYSTEM + [5], SEEDED)}, {"b": (SYSTEM + [5], SEEDED), "c": (SYSTEM + [6], SEEDED)}],
    "n completions": [
        {"a": (SYSTEM + [5, 6], SamplingParams(max_new_tokens=6, temperature=1.0, seed=2, n=3))},
        {"b": (SYSTEM + [5, 6, 7], SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, n=2))},
    ],
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("budget", [256, 8])  # prompts in one pass, and in chunks
def test_outputs_equal_with_caching_on_and_off(tiny_model_dir, scenario, budget):
    waves = SCENARIOS[scenario]
    cached, stats = drive(make_engine(tiny_model_dir, True, max_batch_tokens=budget), waves)
    plain, plain_stats = drive(make_engine(tiny_model_dir, False, max_batch_tokens=budget), waves)
    assert cached == plain
    hits = sum(s.prefix_cache_hits for wave in stats for s in wave)
    assert hits > 0
    computed = sum(s.num_tokens for wave in stats for s in wave)  # a prompt's 1-token last chunk counts as a decode
    assert computed == sum(s.num_tokens for wave in plain_stats for s in wave) - hits
    assert all(s.prefix_cache_hits == s.prefix_cache_queries == 0 for wave in plain_stats for s in wave)


@pytest.mark.parametrize("policy", ["splitfuse", "prefill_first", "static"])
def test_outputs_equal_under_preemption(tiny_model_dir, policy):
    waves = [{f"r{i}": (SYSTEM[: 12 + 4 * (i % 3)] + [i, i + 1], GREEDY) for i in range(8)}]
    kw = {"num_blocks": 14, "max_batch_tokens": 16, "scheduler": policy}
    engine = make_engine(tiny_model_dir, True, **kw)
    cached, stats = drive(engine, waves)
    assert cached == drive(make_engine(tiny_model_dir, False, **kw), waves)[0]
    assert sum(s.prefix_cache_hits for s in stats[0]) > 0
    if policy == "splitfuse":
        assert engine.scheduler.num_preemptions > 0


def test_the_second_request_prefills_only_what_is_not_cached(tiny_model_dir):
    engine = make_engine(tiny_model_dir, True)
    b = SYSTEM + [7, 8, 9]
    _, (_, second) = drive(engine, [{"a": (SYSTEM + [1], GREEDY)}, {"b": (b, GREEDY)}])
    assert second[0].num_prefill_tokens == len(b) - len(SYSTEM)
    assert (second[0].prefix_cache_queries, second[0].prefix_cache_hits) == (len(b), len(SYSTEM))
    assert second[-1].prefix_cache_blocks > 0


def test_outputs_report_the_prompt_tokens_the_cache_held(tiny_model_dir):
    engine = make_engine(tiny_model_dir, True)
    waves = [
        {"a": (SYSTEM + [1], GREEDY)},
        {"b": (SYSTEM + [2, 3], SamplingParams(max_new_tokens=3, temperature=1.0, seed=1, n=2))},
        {"c": (SYSTEM[:3], GREEDY)},
    ]
    cached = {}
    for wave in waves:
        for rid, (prompt, params) in wave.items():
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished():
            for out in engine.step().outputs:
                if out.finished:
                    cached[out.request_id, out.index] = (out.cached_prompt_tokens, out.prompt_tokens)
    # every completion of b reports its request's count; c's prompt is shorter than a block
    assert cached == {
        ("a", 0): (0, len(SYSTEM) + 1),
        ("b", 0): (len(SYSTEM), len(SYSTEM) + 2),
        ("b", 1): (len(SYSTEM), len(SYSTEM) + 2),
        ("c", 0): (0, 3),
    }


def test_cache_salt_isolates_and_the_switch_turns_caching_off(tiny_model_dir):
    salted = SamplingParams(max_new_tokens=4, cache_salt="tenant-b")
    for caching, params, expected in ((True, salted, 0), (False, GREEDY, 0), (True, GREEDY, len(SYSTEM))):
        engine = make_engine(tiny_model_dir, caching)
        _, (_, second) = drive(engine, [{"a": (SYSTEM + [1], GREEDY)}, {"b": (SYSTEM + [2], params)}])
        assert second[0].prefix_cache_hits == expected


@pytest.mark.slow
def test_smollm2_outputs_equal_with_caching_on_and_off():
    from fastgen.replica import pipeline

    system = "You are a careful assistant. Answer briefly and precisely, citing the facts you rely on. " * 4
    prompts = [system + q for q in ("What is the capital of France?", "Name a prime number.", "What is 2+2?")]
    outs = []
    for caching in (True, False):
        pipe = pipeline("smollm2-135m", dtype="float32", max_batch_tokens=64, progress=False, prefix_caching=caching)
        outs.append([o.token_ids for o in pipe(prompts, max_new_tokens=12) + pipe(prompts[0], max_new_tokens=12)])
        assert (pipe.engine.scheduler.allocator.num_cached > 0) is caching
    assert outs[0] == outs[1]


def tp_rank(rank: int, world: int, port: int, model: str, out: str) -> None:
    """Rank 0 drives every scenario through a tp=2 engine with caching on, then off; rank 1 follows."""
    import json
    from pathlib import Path

    import torch

    from fastgen.replica.batch_broadcast import BatchBroadcast
    from fastgen.replica.builder import build_engine, build_runner
    from fastgen.replica.config import CacheConfig, EngineConfig
    from fastgen.replica.parallel import TPGroup

    from .tp_ranks import init

    init(rank, world, port)
    tp, channel = TPGroup(rank, world), BatchBroadcast(rank)
    config = EngineConfig(model=model, dtype="float32", progress=False, cache=CacheConfig(block_size=4, num_blocks=64))
    if rank == 0:
        engine = build_engine(config, tp, channel)
        waves = [{f"{name}/{rid}": r for rid, r in wave.items()} for name in SCENARIOS for wave in SCENARIOS[name]]
        cached, stats = drive(engine, waves)
        engine.scheduler.allocator = BlockAllocator(64, 4, prefix_caching=False)
        plain, _ = drive(engine, waves)
        channel.stop()
        hits = sum(s.prefix_cache_hits for wave in stats for s in wave)
        Path(out).write_text(json.dumps({"equal": cached == plain, "hits": hits}))
    else:
        runner, _ = build_runner(config, tp, channel)
        runner.follow()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_tp2_outputs_equal_with_caching_on_and_off(tiny_model_dir, tmp_path):
    import json

    from .tp_ranks import run_ranks

    out = tmp_path / "result.json"
    run_ranks(tp_rank, str(tiny_model_dir), str(out), timeout=150)
    result = json.loads(out.read_text())
    assert result["equal"] and result["hits"] > 0
