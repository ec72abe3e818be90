"""Prefix caching that knows the sliding window (issue 45): where every layer attends within kv_window tokens, a
request can start after a cached prefix whose early blocks were evicted, so long as the blocks its next query can
still see are cached; its table's head entries alias its first shared block and hold nothing, as blocks released
outside the window do. Reference counts, preemption, forks and publishing keep working, and without a window nothing
changes. The last test runs a tiny Mistral against transformers."""

from __future__ import annotations

import random

import pytest

from fastgen.prefix_hash import prefix_hashes
from fastgen.replica.block_allocator import BlockAllocator
from fastgen.replica.config import SchedulerConfig
from fastgen.replica.request import Sequence
from fastgen.replica.scheduler import Scheduler
from fastgen.replica.slo_scheduler import SloScheduler

WINDOW = 8
BS = 4


def cache_blocks(alloc: BlockAllocator, token_ids: list[int], keep: list[int]) -> dict[int, int]:
    """Caches the blocks `keep` (indexes) of a request with these tokens, held by no one, as if the rest had been
    evicted; returns index -> block."""
    hashes = prefix_hashes(token_ids, alloc.block_size)
    table: list[int] = []
    alloc.allocate(table, len(keep) * alloc.block_size)
    blocks = dict(zip(keep, table))
    for i, block in blocks.items():
        alloc.publish(block, hashes[i])
    alloc.free(table)
    return blocks


def first_seen_block(start: int, window: int, block_size: int = BS) -> int:
    """The block holding the earliest key a query at position `start` reads: key max(0, start - window + 1)."""
    return max(0, start - window + 1) // block_size


def check_pool(sched: Scheduler) -> None:
    """Every running table: released entries alias its first held block, every key its next query reads lies in a
    held block, and the reference counts are exactly the tables' holds (nothing leaked, nothing dropped twice)."""
    alloc = sched.allocator
    holds = [0] * alloc.num_blocks
    for seq in sched.running:
        table, released = seq.block_table, seq.num_released
        assert all(b == table[released] for b in table[:released])
        if sched.config.kv_window is not None and seq.num_computed:
            assert first_seen_block(seq.num_computed, sched.config.kv_window, alloc.block_size) >= released
        for b in table[released:]:
            holds[b] += 1
    assert [alloc.refs(b) for b in range(alloc.num_blocks)] == holds
    assert alloc.num_free == sum(1 for h in holds if h == 0)


def fake_token(seq: Sequence) -> int:
    return (sum(seq.token_ids) * 31 + len(seq.token_ids)) % 1000


def step(sched: Scheduler, by_id: dict[int, Sequence]):
    batch = sched.schedule()
    check_pool(sched)
    for scheduled in batch.seqs:
        seq = by_id[scheduled.seq_id]
        if scheduled.sample:
            seq.token_ids.append(fake_token(seq))
            if seq.num_generated >= seq.max_new_tokens:
                sched.finish(seq)
    sched.observe(batch)
    return batch


def drain(sched: Scheduler, by_id: dict[int, Sequence], max_steps: int = 5000) -> None:
    for _ in range(max_steps):
        if not sched.has_work():
            return
        step(sched, by_id)
    raise AssertionError("no progress")


def assert_pool_is_back(alloc: BlockAllocator) -> None:
    assert alloc.num_free == alloc.num_blocks and all(alloc.refs(b) == 0 for b in range(alloc.num_blocks))


def make(policy: str, window: int | None, num_blocks: int = 40, budget: int = 64, max_seqs: int = 4):
    config = SchedulerConfig(budget, max_seqs, policy, max_model_len=10**4, kv_window=window)
    alloc = BlockAllocator(num_blocks, BS)
    return (SloScheduler if policy == "slo" else Scheduler)(config, alloc), alloc


PROMPT = list(range(100, 141))  # 41 tokens: blocks 0 .. 9 may be cached, the last token is always computed


# ---- the lookup ------------------------------------------------------------------------------------------------
def test_the_lookup_needs_exactly_the_blocks_the_next_query_sees():
    """Block k - 1 alone serves a start at 4k when a window of 5 reaches back to key 4k - 4; a window of 6 reaches
    key 4k - 5, in block k - 2, which then must be cached too. A window of 1 still shares block k - 1 (the table's
    aliases need a block to name)."""
    alloc = BlockAllocator(20, BS)
    blocks = cache_blocks(alloc, PROMPT, [9])
    hashes = prefix_hashes(PROMPT, BS)
    assert alloc.lookup_window(hashes, 5) == (9, [blocks[9]])
    assert alloc.lookup_window(hashes, 1) == (9, [blocks[9]])
    assert alloc.lookup_window(hashes, 6) == (0, [])
    assert alloc.lookup(hashes) == []
    blocks |= cache_blocks(alloc, PROMPT, [8])
    assert alloc.lookup_window(hashes, 6) == (8, [blocks[8], blocks[9]])
    assert alloc.lookup_window(hashes, 9) == (8, [blocks[8], blocks[9]])  # key 40 - 8 = 32: block 8 still
    assert alloc.lookup_window(hashes, 10) == (0, [])  # key 31: block 7, evicted; no shorter start works either


def test_the_lookup_takes_the_longest_start_the_cache_serves():
    """Against the definition, on random cached subsets, windows and block sizes: the largest k such that every
    block holding a key in [max(0, k * bs - window + 1), k * bs), and block k - 1, is cached."""
    rng = random.Random(0)
    for _ in range(400):
        bs, window = rng.choice([1, 2, 4, 5]), rng.randint(1, 20)
        tokens = [rng.randrange(1000) for _ in range(rng.randint(1, 60))]
        alloc = BlockAllocator(64, bs)
        hashes = prefix_hashes(tokens, bs)
        keep = [i for i in range(len(hashes)) if rng.random() < 0.7]
        blocks = cache_blocks(alloc, tokens, keep)
        expected = (0, [])
        for k in range(len(hashes), 0, -1):
            first = min(max(0, k * bs - window + 1) // bs, k - 1)
            if all(i in blocks for i in range(first, k)):
                expected = (first, [blocks[i] for i in range(first, k)])
                break
        assert alloc.lookup_window(hashes, window) == expected
        assert alloc.lookup_window(hashes, 10**6)[0] == 0  # a window longer than the prompt: the plain chain
        assert alloc.lookup_window(hashes, 10**6)[1] == alloc.lookup(hashes)


# ---- admission -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["splitfuse", "prefill_first", "static", "slo"])
def test_evicted_early_blocks_still_hit_with_a_window_and_miss_without(policy):
    for window in (WINDOW, None):
        sched, alloc = make(policy, window)
        blocks = cache_blocks(alloc, PROMPT, [5, 6, 7, 8, 9])  # blocks 0 .. 4 evicted
        seq = Sequence(0, list(PROMPT), len(PROMPT), 4)
        sched.add(seq)
        batch = sched.schedule()
        check_pool(sched)
        stats = sched.prefix_stats()
        (scheduled,) = batch.seqs
        if window is None:
            assert (scheduled.start, seq.num_released, stats.hits, seq.num_cached_prompt_tokens) == (0, 0, 0, 0)
            assert len(scheduled.token_ids) == len(PROMPT)
            sched.finish(seq)
            assert_pool_is_back(alloc)
            continue
        # The query at 40 reads keys 33 .. 40: blocks 8 and 9 are shared, 0 .. 7 alias block 8.
        assert first_seen_block(40, WINDOW) == 8
        assert (scheduled.start, scheduled.token_ids) == (40, [PROMPT[40]])
        assert seq.num_released == 8 and seq.num_computed == 41
        assert seq.block_table[:10] == [blocks[8]] * 9 + [blocks[9]] and len(seq.block_table) == 11
        assert scheduled.block_table == seq.block_table
        assert [alloc.refs(blocks[i]) for i in (5, 6, 7, 8, 9)] == [0, 0, 0, 1, 1]
        assert alloc.cache is not None and all(alloc.cache.is_evictable(blocks[i]) for i in (5, 6, 7))
        assert (stats.queries, stats.hits, seq.num_cached_prompt_tokens) == (41, 40, 40)
        sched.finish(seq)
        assert_pool_is_back(alloc)


def test_without_a_window_the_lookup_is_the_chain_from_block_0():
    """kv_window None: the blocks of the longest cached chain from block 0, whatever is cached after a gap."""
    for window, start, shared in ((None, 12, [0, 1, 2]), (WINDOW, 40, [8, 9])):
        sched, alloc = make("splitfuse", window)
        blocks = cache_blocks(alloc, PROMPT, [0, 1, 2, 5, 6, 7, 8, 9])
        seq = Sequence(0, list(PROMPT), len(PROMPT), 4)
        sched.add(seq)
        hits = sched._cached_prefix(seq)
        assert hits.blocks == [blocks[i] for i in shared] and hits.num_blocks * BS == start
        if window is None:
            assert hits.skipped == 0 and hits.blocks == alloc.lookup(seq.block_hashes)
        (scheduled,) = sched.schedule().seqs
        assert scheduled.start == start and sched.prefix_stats().hits == start
        assert seq.num_released == (0 if window is None else 8)
        sched.finish(seq)
        assert_pool_is_back(alloc)


def test_blocks_computed_after_a_window_hit_publish_under_their_chained_hashes():
    """The blocks a sequence computes after skipping some are cached under the hashes of its whole token prefix:
    another request with those tokens finds them (here from block 0, without a window)."""
    sched, alloc = make("splitfuse", WINDOW)
    cache_blocks(alloc, PROMPT, [8, 9])
    seq = Sequence(0, list(PROMPT), len(PROMPT), 20)
    sched.add(seq)
    by_id = {0: seq}
    while seq.num_computed < 52:
        step(sched, by_id)
    hashes = prefix_hashes(seq.token_ids[:53], BS)  # 13 full blocks, from the tokens alone
    assert alloc.cache is not None
    for i in (10, 11, 12):
        assert alloc.cache.hash_of(seq.block_table[i]) == hashes[i]
    step(sched, by_id)
    assert seq.num_released == 11  # the window moved on; the blocks it left stay cached
    assert [alloc.cache.find(hashes[i]) is not None for i in range(13)] == [False] * 8 + [True] * 5
    sched.finish(seq)
    assert_pool_is_back(alloc)
    again = Sequence(1, seq.token_ids[:53], 53, 2)
    assert alloc.lookup_window(prefix_hashes(again.token_ids, BS), WINDOW)[0] == 11


def test_a_request_finds_another_ones_window_after_its_head_was_evicted():
    """The scenario of the issue, through the scheduler alone: request 1 runs and finishes (its head blocks, given
    back outside the window, are the least recently used), other traffic evicts them, and request 2, which shares
    request 1's first 36 tokens, still starts at token 36. Nothing leaks."""
    sched, alloc = make("splitfuse", WINDOW, num_blocks=12, budget=8)
    first = Sequence(0, [(7 * j + 3) % 1000 for j in range(40)], 40, 4)
    other = Sequence(1, [(11 * j + 5) % 1000 for j in range(20)], 20, 4)
    second = Sequence(2, first.token_ids[:36] + [999, 998, 997, 996, 995, 994], 42, 4)
    by_id = {s.seq_id: s for s in (first, other, second)}
    for seq in (first, other):
        sched.add(seq)
        drain(sched, by_id)
    hashes = prefix_hashes(second.token_ids, BS)
    assert alloc.cache is not None
    assert alloc.cache.find(hashes[0]) is None and alloc.lookup(hashes) == []  # the head is gone
    sched.prefix_stats()
    sched.add(second)
    batch = step(sched, by_id)
    assert batch.seqs[0].start == 36 and second.num_released == first_seen_block(36, WINDOW) == 7
    assert sched.prefix_stats().hits == 36 and second.num_cached_prompt_tokens == 36
    drain(sched, by_id)
    assert_pool_is_back(alloc)


# ---- preemption and forks --------------------------------------------------------------------------------------
class Recording:
    """Counts the window-aware hits a scheduler admits on (a mixin over Scheduler or SloScheduler)."""

    def _reuse(self, seq, hits):
        self.window_hits = getattr(self, "window_hits", 0) + (hits.skipped > 0)
        self.resumed_on_window = getattr(self, "resumed_on_window", 0) + (hits.skipped > 0 and seq.num_preemptions > 0)
        super()._reuse(seq, hits)  # type: ignore[misc]


@pytest.mark.parametrize("policy", ["splitfuse", "slo"])
def test_window_hits_under_preemption_leak_nothing(policy):
    """Requests sharing long prefixes arrive while others run in a pool that preempts; window-aware hits, some by
    sequences readmitted after a preemption, keep every table's invariants and the pool comes back whole."""
    cls = type("Recorded", (Recording, SloScheduler if policy == "slo" else Scheduler), {})
    totals = dict(window_hits=0, resumed_on_window=0, preemptions=0)
    for seed in range(30):
        rng = random.Random(seed)
        config = SchedulerConfig(8, 4, policy, max_model_len=10**4, kv_window=WINDOW)
        alloc = BlockAllocator(8, BS)
        sched = cls(config, alloc)
        base = [rng.randrange(1000) for _ in range(60)]
        arrivals = {}
        for i in range(12):
            prompt = base[: rng.randint(20, 48)] + [rng.randrange(1000) for _ in range(rng.randint(1, 6))]
            arrivals.setdefault(rng.randrange(0, 20), []).append(Sequence(i, prompt, len(prompt), rng.randint(3, 24)))
        by_id = {s.seq_id: s for group in arrivals.values() for s in group}
        for t in range(5000):
            for seq in arrivals.pop(t, []):
                sched.add(seq)
            if not sched.has_work() and not arrivals:
                break
            step(sched, by_id)
        assert not arrivals and not sched.has_work()
        assert_pool_is_back(alloc)
        assert all(s.num_generated == s.max_new_tokens for s in by_id.values())
        totals["window_hits"] += getattr(sched, "window_hits", 0)
        totals["resumed_on_window"] += getattr(sched, "resumed_on_window", 0)
        totals["preemptions"] += sched.num_preemptions
    assert all(v > 0 for v in totals.values()), totals


def test_a_preempted_window_hit_releases_only_what_it_holds_and_restarts():
    sched, alloc = make("splitfuse", WINDOW)
    blocks = cache_blocks(alloc, PROMPT, [8, 9])
    seq = Sequence(0, list(PROMPT), len(PROMPT), 20)
    sched.add(seq)
    by_id = {0: seq}
    step(sched, by_id)
    assert seq.num_released == 8
    while seq.num_computed < 48:
        step(sched, by_id)
    sched.schedule()  # releases blocks 8 and 9 (parked: still cached), and computes token 48
    assert seq.num_released == 10 and seq.num_computed == 49
    sched._preempt(seq, [])
    assert seq.num_released == 0 and not seq.block_table and seq.num_computed == 0
    assert_pool_is_back(alloc)
    assert alloc.cache is not None and all(alloc.cache.is_evictable(blocks[i]) for i in (8, 9))
    batch = step(sched, by_id)  # readmitted on blocks 10 and 11, which it published after its window hit
    assert batch.seqs[0].start == 48 and seq.num_released == first_seen_block(48, WINDOW) == 10
    assert seq.num_cached_prompt_tokens == 40  # its first admission's: a recompute finding its blocks is no hit
    drain(sched, by_id)
    assert_pool_is_back(alloc)


@pytest.mark.parametrize("policy", ["splitfuse", "slo"])
def test_children_forked_from_a_window_hit_share_its_held_blocks(policy):
    sched, alloc = make(policy, WINDOW)
    blocks = cache_blocks(alloc, PROMPT, [8, 9])
    parent = Sequence(0, list(PROMPT), len(PROMPT), 20)
    sched.add(parent)
    sched.schedule()
    assert parent.num_computed == 41 and parent.num_released == 8
    children = [Sequence(i, list(parent.token_ids), 41, 20) for i in (1, 2)]
    for i, seq in enumerate([parent, *children]):
        seq.token_ids.append(100 + i)
    assert sched.fork(parent, children) == 2
    for child in children:
        assert child.num_released == 8 and child.block_table[:10] == parent.block_table[:10]
        assert child.block_table[10] != parent.block_table[10]  # its copy of the partial block
    assert alloc.refs(blocks[8]) == alloc.refs(blocks[9]) == 3
    check_pool(sched)
    drain(sched, {s.seq_id: s for s in (parent, *children)})
    assert_pool_is_back(alloc)


# ---- end to end --------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_mistral_starts_after_an_evicted_head_and_equals_transformers(tmp_path, kernels):
    """A tiny float32 Mistral, a 16-token window on every layer, blocks of 4 in a pool of 24: request 1 (60 prompt
    tokens) runs, then another request evicts its head blocks, then request 2, whose first 48 tokens are request 1's,
    starts at token 48 on the 4 blocks its window still sees (blocks 8 .. 11; block 0 is gone, so a chain from it
    misses). Its greedy tokens, like every request's, are transformers' eager ones."""
    from fastgen.replica import pipeline
    from fastgen.replica.request import SamplingParams

    from .test_model_families import COMMON, hf_greedy_eager, make_family_model

    window, new = 16, 12
    families = {
        "mistral-16": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=window, tie_word_embeddings=False))
    }
    folder = make_family_model(tmp_path / "mistral", "mistral-16", seed=3, families=families)
    rng = random.Random(7)
    vocab = COMMON["vocab_size"]
    first = [rng.randrange(3, vocab) for _ in range(60)]
    others = [[rng.randrange(3, vocab) for _ in range(40)]]
    second = first[:48] + [rng.randrange(3, vocab) for _ in range(9)]
    prompts = [first, *others, second]
    refs = hf_greedy_eager(folder, prompts, new)

    pipe = pipeline(
        str(folder), dtype="float32", kernels=kernels, progress=False, max_batch_tokens=16, block_size=BS, num_blocks=24
    )
    engine = pipe.engine
    assert engine.scheduler.config.kv_window == window
    alloc = engine.scheduler.allocator

    def generate(rid: str, prompt: list[int]) -> tuple[list[int], int, int]:
        engine.add_request(rid, prompt, SamplingParams(max_new_tokens=new, min_new_tokens=new))
        hits = 0
        while True:
            result = engine.step()
            hits += result.stats.prefix_cache_hits if result.stats else 0
            for out in result.outputs:
                if out.request_id == rid and out.finish_reason is not None:
                    return out.token_ids, out.cached_prompt_tokens, hits

    outs = [generate("first", first)]
    outs += [generate(f"other{i}", p) for i, p in enumerate(others)]
    hashes = prefix_hashes(second, BS)
    assert alloc.cache is not None and alloc.cache.find(hashes[0]) is None, "request 1's head must be evicted"
    assert alloc.lookup(hashes) == [], "a chain from block 0 misses"
    outs.append(generate("second", second))
    assert outs[-1][1:] == (48, 48), "the window-aware hit: 48 prompt tokens not computed"
    for (tokens, _, _), ref in zip(outs, refs, strict=True):
        n = len(ref) - 1 if len(ref) < len(tokens) else len(ref)
        assert tokens[:n] == ref[:n]
    assert alloc.num_free == 24
