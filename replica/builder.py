"""Building an engine: the model's weights (this rank's shards), its tokenizer, the KV pool sized from the memory
budget and the scheduler, wired together. Rank 0 of a tensor-parallel group builds the whole engine; the other
ranks build only the model runner."""

from __future__ import annotations

import dataclasses

import torch

from ..kernels import select_kernels
from . import weights
from .batch_broadcast import BatchBroadcast
from .block_allocator import BlockAllocator
from .config import EngineConfig
from .engine import Engine
from .kv_cache import allocate_kv_cache, bytes_per_block
from .model_runner import ModelRunner
from .models.llama import LlamaModel, ModelConfig
from .parallel import TPGroup
from .scheduler import Scheduler


def build_engine(config: EngineConfig, tp: TPGroup = TPGroup(), broadcast: BatchBroadcast | None = None) -> Engine:
    """Loads the model and tokenizer, sizes the KV pool and wires up the engine. With tensor parallelism this is
    rank 0's part: it sends every batch through `broadcast` to the other ranks (which run `build_runner` only)."""
    folder = weights.resolve_model(config.model)
    hf_config = weights.load_hf_config(folder)
    model_config = ModelConfig.from_hf(hf_config)
    tokenizer = weights.load_tokenizer(folder)

    max_len = config.max_model_len or model_config.max_position_embeddings
    if model_config.sliding_window:
        max_len = min(max_len, model_config.sliding_window)  # attention here is full, so stay inside the window
    if max_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_len} exceeds the model's {model_config.max_position_embeddings} positions"
        )
    sched_config = dataclasses.replace(config.scheduler, max_model_len=max_len)

    runner, num_blocks = build_runner(config, tp, broadcast)
    scheduler = Scheduler(sched_config, BlockAllocator(num_blocks, config.cache.block_size))
    eos = weights.eos_token_ids(folder, hf_config, tokenizer)
    return Engine(runner, scheduler, tokenizer, model_config, eos, config.default_max_new_tokens)


def build_runner(config: EngineConfig, tp: TPGroup = TPGroup(), broadcast: BatchBroadcast | None = None):
    """This rank's shards of the weights and its KV cache (for its KV heads), in a model runner; returns the runner
    and the number of KV blocks, the same on every rank."""
    device = torch.device(config.device)
    dtype = weights.parse_dtype(config.dtype, device)
    folder = weights.resolve_model(config.model)
    model_config = ModelConfig.from_hf(weights.load_hf_config(folder))
    kernels = select_kernels(config.kernels, device)

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaModel(model_config, tp, kernels)
    finally:
        torch.set_default_dtype(previous)
    # Tensors are memory-mapped: each rank reads only the pages of its own shards.
    model.load_weights(weights.iter_safetensors(folder, progress=config.progress and tp.rank == 0))
    model.eval()
    model.pack_weights()

    attn = model.layers[0].self_attn
    block_size = config.cache.block_size
    # The memory budget is per rank; each block holds only this rank's KV heads.
    per_block = bytes_per_block(model_config.num_layers, block_size, attn.kv_heads, attn.head_dim, dtype)
    num_blocks = tp.agree_min(config.cache.num_blocks or max(1, config.cache.memory_bytes // per_block), device)
    kv = allocate_kv_cache(model_config.num_layers, num_blocks, block_size, attn.kv_heads, attn.head_dim, dtype, device)
    return ModelRunner(model, kv, block_size, device, broadcast), num_blocks
