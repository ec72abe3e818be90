"""CUDA graphs for decode steps: the bucket plan on any machine; on a GPU (`pytest -m cuda`), replayed graphs give
the tokens eager steps give, and the engine on CUDA matches transformers under every schedule and with preemption.
The padded static-buffer path itself also runs on CPU, under the Triton interpreter (tests/test_triton_engine.py)."""

import random

import pytest
import torch

from fastgen.replica import pipeline
from fastgen.replica.batch import Batch, ScheduledSeq
from fastgen.replica.cuda_graphs import DecodeGraphs, bucket_sizes
from fastgen.testing import make_tiny_model

from .helpers import assert_matches, hf_greedy, random_prompts


def test_buckets_cover_every_batch_size_with_little_padding():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    for max_seqs in (1, 3, 8, 50, 256):
        buckets = bucket_sizes(max_seqs)
        assert buckets[-1] == max_seqs
        for n in range(1, max_seqs + 1):
            assert next(b for b in buckets if b >= n) - n <= 7


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("graphs") / "llama", heads=4, kv_heads=2, tie=True)


def cuda_pipe(model, **kw):
    return pipeline(str(model), dtype="float32", device="cuda", progress=False, **kw)


@pytest.mark.cuda
@pytest.mark.parametrize("scheduler", ["splitfuse", "prefill_first", "static", "slo"])
def test_engine_on_cuda_matches_transformers(model, scheduler):
    prompts = random_prompts(12, random.Random(5), 1, 100)
    refs = hf_greedy(model, prompts, 12)
    for budget in (16, 256):
        pipe = cuda_pipe(model, max_batch_tokens=budget, scheduler=scheduler)
        assert pipe.engine.runner.graphs.captured[1].graph is not None, "graphs are on by default on CUDA"
        assert_matches(pipe(prompts, max_new_tokens=12, min_new_tokens=12), refs)


@pytest.mark.cuda
def test_engine_on_cuda_with_preemption_matches_transformers(model):
    prompts = random_prompts(12, random.Random(7), 20, 60)
    refs = hf_greedy(model, prompts, 16)
    pipe = cuda_pipe(model, max_batch_tokens=32, block_size=4, num_blocks=20)
    assert_matches(pipe(prompts, max_new_tokens=16, min_new_tokens=16), refs)
    assert pipe.engine.scheduler.num_preemptions > 0


@pytest.mark.cuda
def test_graph_replay_gives_the_logits_of_eager_steps(model):
    """Every replayed decode step, greedy and seeded sampled, batch sizes that fill a bucket and ones that pad it,
    against the eager forward pass of the same batch: equal within float32 rounding, not bit for bit (cuBLAS may
    choose other kernels for the padded bucket's row count, and a near-tie could then flip a token)."""
    prompts = random_prompts(21, random.Random(9), 1, 80)
    pipe = cuda_pipe(model, max_batch_tokens=128, max_seqs=32)
    runner = pipe.engine.runner
    graphs, replay, sizes = runner.graphs, runner.graphs.run, set()

    def replay_and_compare(batch, tables):
        logits = replay(batch, tables).clone()
        runner.graphs = None  # the same batch eagerly: it writes the same cache slots again
        try:
            eager = runner.forward(batch)
        finally:
            runner.graphs = graphs
        torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)
        sizes.add(len(batch.seqs))
        return logits

    graphs.run = replay_and_compare
    pipe(prompts, max_new_tokens=20, min_new_tokens=20)
    pipe(prompts, max_new_tokens=20, min_new_tokens=20, temperature=0.8, top_p=0.9, seed=3)
    assert sizes & set(graphs.buckets) and sizes - set(graphs.buckets), sizes


def test_every_bucket_writes_one_logits_buffer(model):
    """The buckets' graphs copy their logits into one (largest bucket, vocab) buffer rather than each holding an output
    of its own (a GiB at 256 sequences and a 128k vocabulary): each step's logits are a view of it, for any bucket,
    and equal the model's own logits for the step."""
    pipe = pipeline(str(model), dtype="float32", max_batch_tokens=64, max_seqs=8, progress=False)
    runner = pipe.engine.runner
    graphs = DecodeGraphs(
        runner.model, runner.kv_caches, runner.block_size, 8, 64, pad_block=0, device=runner.device, capture=False
    )
    for n in (8, 1, 3):  # the largest bucket first, as capture runs them; then ones that pad
        batch = Batch([ScheduledSeq(i, [5 + i], 0, [1 + i], True) for i in range(n)], n, [])
        logits = graphs.run(batch, runner.block_tables)
        assert logits.shape == (n, graphs.logits.shape[1]) and logits.data_ptr() == graphs.logits.data_ptr()
        assert graphs.logits.shape[0] == 8
        bucket = next(b for b in graphs.buckets if b >= n)  # the padded rows run too: meta spans the bucket
        meta = graphs.captured[bucket].meta
        hidden = runner.model(graphs.input_ids[:bucket], graphs.positions[:bucket], meta, runner.kv_caches)
        torch.testing.assert_close(logits, runner.model.logits(hidden)[:n])
