"""The KV pool sized from device memory: the arithmetic with injected figures (CPU), the flags that choose between
it and a fixed budget, the profiling step, and on CUDA the whole path."""

import dataclasses
import logging

import pytest
import torch

from fastgen.replica.__main__ import engine_config, parse_args
from fastgen.replica.builder import build_runner, profile_batch, profile_step
from fastgen.replica.config import CacheConfig, EngineConfig, SchedulerConfig
from fastgen.replica.kv_cache import DeviceMemory, bytes_per_block, kv_blocks_for_device

GIB, MIB = 1 << 30, 1 << 20


def memory(total, weights, peak, free=None, untracked=0, graphs=0):
    return DeviceMemory(total, total if free is None else free, weights, peak, untracked, graphs)


def test_blocks_are_the_utilised_share_less_weights_and_peak():
    # 0.9 of 80 GiB is 72 GiB; less 16 GiB of weights and a 2 GiB peak leaves 54 GiB: 27648 blocks of 2 MiB.
    assert kv_blocks_for_device(memory(80 * GIB, 16 * GIB, 2 * GIB), 0.9, 2 * MIB) == 27648
    assert kv_blocks_for_device(memory(80 * GIB, 16 * GIB, 2 * GIB), 1.0, 2 * MIB) == 31744
    # Partial blocks do not count; exactly one block is enough.
    assert kv_blocks_for_device(memory(1000, 300, 100), 1.0, 250) == 2
    assert kv_blocks_for_device(memory(1000, 300, 100), 0.5, 100) == 1


def test_untracked_memory_and_the_graphs_room_are_left_out_of_the_pool():
    """vLLM's accounting: what appeared outside torch's allocator while profiling (cuBLAS, NCCL, kernel modules) and
    the CUDA graphs' pool, captured after the KV pool, come out of the utilised share too."""
    # 72 GiB usable, less 16 GiB weights, 2 GiB peak, 1.5 GiB untracked, 0.5 GiB of graphs: 52 GiB, 26624 blocks.
    m = memory(80 * GIB, 16 * GIB, 2 * GIB, untracked=3 * GIB // 2, graphs=GIB // 2)
    assert kv_blocks_for_device(m, 0.9, 2 * MIB) == 26624


def test_memory_another_process_holds_is_not_counted_as_ours():
    """Sized from free memory, not the total: with 30 GiB of an 80 GiB device held elsewhere, 0.9 of the total
    (72 GiB) is more than the 50 GiB free, and the pool is what is left of the 50."""
    m = memory(80 * GIB, 16 * GIB, 2 * GIB, free=50 * GIB)
    assert kv_blocks_for_device(m, 0.9, 2 * MIB) == (50 - 18) * 512
    # Where the share is the smaller, the share holds.
    assert kv_blocks_for_device(memory(80 * GIB, 16 * GIB, 2 * GIB, free=79 * GIB), 0.5, 2 * MIB) == 22 * 512


@pytest.mark.parametrize(
    "total,weights,peak,utilization,per_block,free,graphs",
    [
        (80 * GIB, 70 * GIB, 3 * GIB, 0.9, 2 * MIB, None, 0),
        (1000, 300, 100, 0.5, 101, None, 0),
        (80 * GIB, 90 * GIB, 0, 1.0, 1, None, 0),
        (80 * GIB, 16 * GIB, 2 * GIB, 0.9, 2 * MIB, 18 * GIB, 0),  # fits the share, not what is free
        (80 * GIB, 16 * GIB, 2 * GIB, 0.25, 2 * MIB, None, 2 * GIB),  # fits only without the graphs
    ],
)
def test_nothing_left_for_the_cache_is_refused_with_the_figures(
    total, weights, peak, utilization, per_block, free, graphs
):
    with pytest.raises(ValueError, match="no device memory left for the KV cache") as info:
        kv_blocks_for_device(memory(total, weights, peak, free=free, graphs=graphs), utilization, per_block)
    message = str(info.value)
    assert f"{weights / GIB:.2f} GiB" in message and f"{peak / GIB:.2f} GiB" in message
    assert f"graphs need {graphs / GIB:.2f} GiB" in message and "free at start" in message
    assert "--gpu-memory-utilization" in message and "--max-batch-tokens" in message and "--enforce-eager" in message


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5])
def test_utilization_must_be_a_share(bad):
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        CacheConfig(gpu_memory_utilization=bad)
    with pytest.raises(SystemExit):
        parse_args(["--port", "1", "--gpu-memory-utilization", str(bad)])


def test_flags_choose_device_sizing_unless_memory_or_blocks_are_given():
    cache = engine_config(parse_args(["--port", "1"])).cache
    assert cache.gpu_memory_utilization == 0.9 and cache.memory_bytes == CacheConfig.memory_bytes
    cache = engine_config(parse_args(["--port", "1", "--gpu-memory-utilization", "0.5"])).cache
    assert cache.gpu_memory_utilization == 0.5
    cache = engine_config(parse_args(["--port", "1", "--kv-cache-memory", "2GiB"])).cache
    assert cache.gpu_memory_utilization is None and cache.memory_bytes == 2 * GIB
    cache = engine_config(parse_args(["--port", "1", "--num-blocks", "77"])).cache
    assert cache.num_blocks == 77  # the builder takes it before anything else


@pytest.mark.parametrize(
    "budget,max_seqs,block_size,max_len,lengths,decodes",
    [
        (512, 64, 16, 2048, [8] * 64, 0),
        (100, 64, 16, 2048, [1] * 28 + [2] * 36, 28),
        (64, 64, 16, 2048, [1] * 64, 64),
        (8192, 1, 16, 2048, [2048], 0),
        (37, 4, 4, 2048, [9, 9, 9, 10], 0),
    ],
)
def test_profile_batch_is_the_fullest_step(budget, max_seqs, block_size, max_len, lengths, decodes):
    batch, num_blocks = profile_batch(budget, max_seqs, block_size, max_len)
    assert [len(s.token_ids) for s in batch.seqs] == lengths and batch.num_decodes == decodes
    assert all(s.sample and s.start == 0 for s in batch.seqs)
    blocks = [b for s in batch.seqs for b in s.block_table]
    assert sorted(blocks) == list(range(num_blocks))  # each its own, none past the throwaway cache
    assert all(len(s.block_table) * block_size >= len(s.token_ids) for s in batch.seqs)


def test_profile_step_runs_and_cpu_keeps_the_memory_budget(tiny_model_dir):
    """On CPU the utilization is ignored: the pool is memory_bytes; the profiling step itself runs anywhere."""
    config = EngineConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        scheduler=SchedulerConfig(max_batch_tokens=40, max_seqs=6),
        cache=CacheConfig(block_size=4, memory_bytes=MIB, gpu_memory_utilization=0.5),
        progress=False,
    )
    runner, num_blocks = build_runner(config)
    attn = runner.model.layers[0].self_attn
    per_block = bytes_per_block(len(runner.model.layers), 4, attn.kv_heads, attn.head_dim, torch.float32)
    assert num_blocks == MIB // per_block
    profile_step(config, runner.model, torch.float32, torch.device("cpu"))


@pytest.mark.cuda
def test_cuda_pool_is_sized_from_device_memory(tiny_model_dir, caplog):
    config = EngineConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cuda:0",
        scheduler=SchedulerConfig(max_batch_tokens=256, max_seqs=16),
        cache=CacheConfig(gpu_memory_utilization=0.2),
        progress=False,
    )
    with caplog.at_level(logging.INFO, logger="fastgen.replica"):
        runner, num_blocks = build_runner(config)
    assert torch.cuda.current_device() == 0
    total = torch.cuda.mem_get_info(0)[1]
    attn = runner.model.layers[0].self_attn
    per_block = bytes_per_block(len(runner.model.layers), 16, attn.kv_heads, attn.head_dim, torch.float32)
    assert 0.9 * 0.2 * total < num_blocks * per_block <= 0.2 * total  # a tiny model leaves nearly all of it
    assert "activation peak" in caplog.text and f"{num_blocks} blocks" in caplog.text
    assert "outside torch" in caplog.text and "for CUDA graphs" in caplog.text
    del runner
    explicit = dataclasses.replace(config, cache=CacheConfig(num_blocks=64, gpu_memory_utilization=0.2))
    assert build_runner(explicit)[1] == 64
