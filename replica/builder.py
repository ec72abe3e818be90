"""Building an engine: the model's weights (this rank's shards), its tokenizer, the KV pool sized from the memory
budget and the scheduler, wired together. Rank 0 of a tensor-parallel group builds the whole engine; the other
ranks build only the model runner."""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..kernels import select_kernels
from ..kernels.fp8 import fp8_supported, quantize_fp8
from ..kernels.quant import quantize_per_channel
from . import weights
from .batch import Batch, ScheduledSeq
from .batch_broadcast import BatchBroadcast
from .block_allocator import BlockAllocator
from .config import QUANTIZATIONS, EngineConfig, LoraConfig
from .cuda_graphs import DecodeGraphs
from .engine import Engine
from .host_memory import keep_freed_memory
from .int4_checkpoint import check_int4_method, int4_format, iter_int4
from .kv_cache import DeviceMemory, allocate_kv_cache, bytes_per_block, gib, kv_blocks_for_device
from .lora import LoraWeights
from .lora_pool import LoraPool
from .model_runner import ModelRunner
from .models import DecoderModel, ModelConfig
from .models.moe import FusedExperts
from .parallel import TPGroup
from .sampler import SamplingRow, sample
from .scheduler import Scheduler
from .slo_scheduler import SloScheduler

log = logging.getLogger("fastgen.replica")


def build_engine(config: EngineConfig, tp: TPGroup = TPGroup(), broadcast: BatchBroadcast | None = None) -> Engine:
    """Loads the model and tokenizer, sizes the KV pool and wires up the engine. With tensor parallelism this is
    rank 0's part: it sends every batch through `broadcast` to the other ranks (which run `build_runner` only)."""
    folder = weights.model_folder(config.model, config.load_format)
    hf_config = weights.load_hf_config(folder)
    model_config = ModelConfig.from_hf(hf_config)
    tokenizer = weights.load_tokenizer(folder)

    max_len = config.max_model_len or model_config.max_position_embeddings
    if max_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_len} exceeds the model's {model_config.max_position_embeddings} positions"
        )
    moe = model_config.moe
    routing = (moe.num_experts, moe.experts_per_token) if moe else None
    spec = config.speculative_config
    # A draft model reads the target's blocks through its own layers, which may attend to the whole sequence.
    window = None if spec and spec.method == "draft_model" else model_config.kv_window
    sched_config = dataclasses.replace(config.scheduler, max_model_len=max_len, moe_routing=routing, kv_window=window)

    runner, num_blocks = build_runner(config, tp, broadcast)
    allocator = BlockAllocator(num_blocks, config.cache.block_size, config.cache.prefix_caching)
    loras = LoraPool(config.lora.max_loras) if config.lora.enable_lora else None
    scheduler = (SloScheduler if sched_config.policy == "slo" else Scheduler)(sched_config, allocator, loras=loras)
    eos = weights.eos_token_ids(folder, hf_config, tokenizer)
    draft = build_draft_runner(config, model_config, num_blocks) if spec and spec.method == "draft_model" else None
    engine = Engine(
        runner, scheduler, tokenizer, model_config, eos, config.default_max_new_tokens, config.speculative_config, draft
    )
    for name, path in config.lora.lora_modules:
        engine.add_lora(name, path)
    return engine


def build_draft_runner(config: EngineConfig, target: ModelConfig, num_blocks: int) -> ModelRunner:
    """The draft model of speculative_config method draft_model, on rank 0 alone, with a KV cache of num_blocks
    blocks (the target's block ids index both caches), run op by op, without adapters. Refuses a draft whose
    vocabulary or context differs from what the target needs."""
    spec = config.speculative_config
    assert spec is not None, "built only for speculative_config method draft_model"
    cache = dataclasses.replace(config.cache, num_blocks=num_blocks)
    draft_config = dataclasses.replace(
        config,
        model=spec.model,
        cache=cache,
        enforce_eager=True,
        enable_expert_parallel=False,
        progress=False,
        lora=LoraConfig(),
    )
    runner, _ = build_runner(draft_config)
    draft = runner.model.config
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model {spec.model} has a vocabulary of {draft.vocab_size} tokens, the model "
            f"{target.vocab_size}: a draft must share the model's tokenizer"
        )
    max_len = config.max_model_len or target.max_position_embeddings
    if draft.max_position_embeddings < max_len:
        raise ValueError(
            f"the draft model {spec.model} has {draft.max_position_embeddings} positions, fewer than the "
            f"{max_len} of the context: lower --max-model-len or choose another draft"
        )
    return runner


# `--quantization` modes that quantize a float checkpoint's layers at load, one scale per output channel
PER_CHANNEL = {"int8": quantize_per_channel, "fp8": quantize_fp8}


def quantized_source(config: EngineConfig, device: torch.device):
    """The GGUF file to read quantized (`quantization` auto of a GGUF model on the CPU), else None: the model loads
    the dequantized folder (int8 quantizes it after loading), or an AWQ/GPTQ folder's int4 layers (auto: as
    shipped; none: dequantized). fp8 is refused where the GPU has no fp8 matrix units, int8 off the CPU."""
    if config.quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {config.quantization!r}: use one of {', '.join(QUANTIZATIONS)}")
    if config.quantization == "fp8" and (reason := fp8_supported(device)) is not None:
        raise ValueError(f"quantization fp8: {reason}; serve --quantization none or auto")
    if config.quantization == "int8" and device.type != "cpu":
        raise ValueError(
            "quantization int8 (weight-only) runs on the CPU's kernels; on CUDA serve --quantization none or auto"
        )
    if config.quantization != "auto" or config.load_format == "dummy" or device.type != "cpu":
        return None
    gguf = weights.gguf_file(config.model)
    if gguf is None:
        return None
    architecture = weights.gguf_architecture(gguf)
    if architecture not in weights.GGUF_DIRECT:
        log.info("%s is a %r GGUF: served from its conversion, dequantized to the dtype", gguf.name, architecture)
        return None
    return gguf


def float32_int8(config: EngineConfig, dtype: torch.dtype, gguf) -> bool:
    """Whether float32 decode rows over a GGUF's blocks round their activations to int8 per 32 values, as llama.cpp
    does (and as bfloat16 activations do on CPUs with bfloat16 arithmetic): where the dtype was left to auto and came
    out float32, on a CPU without bfloat16 arithmetic (AMD Zen 3, Intel before Cooper Lake). An asked-for
    --dtype float32 stays exact: the dequantized model's results."""
    return gguf is not None and dtype == torch.float32 and config.dtype in (None, "", "auto")


def build_runner(config: EngineConfig, tp: TPGroup = TPGroup(), broadcast: BatchBroadcast | None = None):
    """This rank's shards of the weights and its KV cache (for its KV heads), in a model runner; returns the runner
    and the number of KV blocks, the same on every rank."""
    device = torch.device(config.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # Triton launches on the current device, which must be the tensors'
    dtype = weights.parse_dtype(config.dtype, device)
    gguf = quantized_source(config, device)
    # a GGUF_DIRECT file is read tensor by tensor in every mode: its blocks kept (gguf), else dequantized one by one
    direct = weights.direct_gguf(config.model) if config.load_format != "dummy" else None
    folder = weights.model_folder(config.model, config.load_format)
    hf_config = weights.load_hf_config(folder)
    model_config = ModelConfig.from_hf(hf_config)
    kernels = select_kernels(config.kernels, device, float32_int8=float32_int8(config, dtype, gguf))
    if config.quantization == "fp8" and kernels.name == "cpu":
        raise ValueError(
            "quantization fp8 needs CUDA (float8 matrix units) or --kernels torch (torch's reference of the same op, "
            "slow: for checking); on the CPU's kernels use int8, or auto for a GGUF's own blocks"
        )
    if device.type == "cpu":
        keep_freed_memory()
    # Before anything of ours is on the device (the CUDA context is, once asked): the baseline of the KV sizing.
    at_start = _memory_at_start(device)

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DecoderModel(model_config, tp, kernels, config.enable_expert_parallel)
    finally:
        torch.set_default_dtype(previous)
    int4 = int4_format(hf_config)
    check_int4_method(config.quantization, int4, config.model)
    if config.load_format == "dummy":  # random weights made where the parameters live: no read, no CPU copy
        model.init_random_weights()
        if int4 is not None and config.quantization not in ("none", *PER_CHANNEL):  # an AWQ/GPTQ preset: int4
            model.init_random_int4(int4.group_size)
    elif direct is not None:  # auto: the file's blocks as they are, the layers keep what the kernels read quantized
        progress = config.progress and tp.rank == 0
        model.load_weights(weights.iter_gguf(direct, hf_config, progress=progress, keep_blocks=gguf is not None))
    else:  # tensors are memory-mapped: each rank reads only the pages of its own shards
        tensors = weights.iter_safetensors(folder, progress=config.progress and tp.rank == 0)
        if int4 is not None:  # AWQ/GPTQ: int4 layers as shipped (auto, awq, gptq), else their values in --dtype
            tensors = iter_int4(tensors, int4, dequantize=config.quantization in ("none", *PER_CHANNEL))
        model.load_weights(tensors)
    model.eval()
    if config.quantization in PER_CHANNEL:
        model.quantize(PER_CHANNEL[config.quantization])
    lora = None
    if config.lora.enable_lora:  # before packing: an adapted gate/up layer keeps the activation apart
        lora = LoraWeights(model, config.lora.max_loras, config.lora.max_lora_rank)
    model.pack_weights()
    unsplit = [m.dequantized_why for m in model.modules() if isinstance(m, FusedExperts) and m.dequantized_why]
    if unsplit:
        log.warning(
            "rank %d serves the file's experts dequantized to the dtype: %s; --enable-expert-parallel keeps each "
            "rank's experts whole, in their blocks",
            tp.rank,
            unsplit[0],
        )

    attn = model.layers[0].self_attn
    block_size = config.cache.block_size
    # The memory budget is per rank; each block holds only this rank's KV heads.
    per_block = bytes_per_block(model_config.num_layers, block_size, attn.kv_heads, attn.head_dim, dtype)
    # The agreement runs on the CPU over the broadcast's gloo group, never over NCCL (see agree_min).
    group = broadcast.group if broadcast is not None else None
    # LoRA steps read their segments from the host: they run eagerly.
    graphed = kernels.graph_safe and not config.enforce_eager and lora is None
    num_blocks = tp.agree_min(_kv_blocks(config, model, per_block, dtype, device, at_start, graphed), group)
    if tp.rank == 0:
        log.info(
            "KV cache: %d blocks of %d tokens = %d tokens, %s",
            num_blocks,
            block_size,
            num_blocks * block_size,
            gib(num_blocks * per_block),
        )
    # Graphed decode steps pad their batch with rows that write to one extra block, which the allocator never sees.
    kv = allocate_kv_cache(
        model_config.num_layers, num_blocks + graphed, block_size, attn.kv_heads, attn.head_dim, dtype, device
    )
    graphs = None
    if graphed:
        graphs = DecodeGraphs(
            model,
            kv,
            block_size,
            config.scheduler.max_seqs,
            config.max_model_len or model_config.max_position_embeddings,
            pad_block=num_blocks,
            device=device,
            capture=device.type == "cuda",
        )
    return ModelRunner(model, kv, block_size, device, broadcast, graphs, lora), num_blocks


def _memory_at_start(device: torch.device) -> tuple[int, int]:
    """(free bytes on the device, bytes torch's allocator reserves there) before the model loads; (0, 0) off CUDA."""
    if device.type != "cuda":
        return 0, 0
    return torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)


def _kv_blocks(
    config: EngineConfig,
    model: DecoderModel,
    per_block: int,
    dtype: torch.dtype,
    device: torch.device,
    at_start: tuple[int, int],
    graphed: bool,
) -> int:
    """This rank's pool: num_blocks if given; on CUDA with a utilization, what the device has left after the
    weights, a profiling pass, what appeared outside torch's allocator meanwhile and room for the CUDA graphs
    (captured after the pool, whose addresses they hold); otherwise the memory budget."""
    cache = config.cache
    if cache.num_blocks:
        return cache.num_blocks
    if device.type != "cuda" or cache.gpu_memory_utilization is None:
        return max(1, cache.memory_bytes // per_block)
    free_at_start, reserved_at_start = at_start
    weights_bytes = torch.cuda.memory_allocated(device)  # nothing but the model is on the device yet
    sched = config.scheduler
    peak = _activation_peak(config, model, dtype, device, sched.max_batch_tokens)
    # The graphs' pool holds the largest bucket's forward pass, beside the one output buffer every bucket fills.
    graphs = _activation_peak(config, model, dtype, device, sched.max_seqs) if graphed else 0
    # As vLLM: after profiling, what the device lost since the start less what torch's allocator grew by is memory
    # torch does not track (cuBLAS workspaces, NCCL buffers, Triton's and torch's kernel modules).
    grown = free_at_start - torch.cuda.mem_get_info(device)[0]
    untracked = max(0, grown - (torch.cuda.memory_reserved(device) - reserved_at_start))
    memory = DeviceMemory(torch.cuda.mem_get_info(device)[1], free_at_start, weights_bytes, peak, untracked, graphs)
    blocks = kv_blocks_for_device(memory, cache.gpu_memory_utilization, per_block)
    log.info(
        "device memory %s x %g (%s free at start): weights %s, activation peak %s at %d tokens, %s outside torch, "
        "%s for CUDA graphs -> KV pool %d blocks (%d tokens)",
        gib(memory.total),
        cache.gpu_memory_utilization,
        gib(free_at_start),
        gib(weights_bytes),
        gib(peak),
        sched.max_batch_tokens,
        gib(untracked),
        gib(graphs),
        blocks,
        blocks * config.cache.block_size,
    )
    return blocks


def _activation_peak(
    config: EngineConfig, model: DecoderModel, dtype: torch.dtype, device: torch.device, tokens: int
) -> int:
    """Bytes the fullest step of `tokens` tokens allocates on the CUDA device above what is there before it
    (weights and the profile's own small KV cache): the peak of `profile_step`."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    profile_step(config, model, dtype, device, tokens)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    return peak


def profile_step(
    config: EngineConfig, model: DecoderModel, dtype: torch.dtype, device: torch.device, tokens: int | None = None
) -> None:
    """Runs the largest step the scheduler can build of `tokens` tokens (the token budget by default; max_seqs gives
    the largest decode step), forward pass and sampling, on a throwaway KV cache just large enough for it. Every
    rank of a tensor-parallel group runs the same step, so their collectives match."""
    block_size = config.cache.block_size
    batch, num_blocks = profile_batch(
        tokens or config.scheduler.max_batch_tokens,
        config.scheduler.max_seqs,
        block_size,
        model.config.max_position_embeddings,
    )
    attn = model.layers[0].self_attn
    kv = allocate_kv_cache(len(model.layers), num_blocks, block_size, attn.kv_heads, attn.head_dim, dtype, device)
    logits = ModelRunner(model, kv, block_size, device).forward(batch)
    # Sampled rows with top-k and top-p take the sampler's largest path.
    rows = [SamplingRow(1.0, 0.9, 50, 0, len(s.token_ids), []) for s in batch.seqs]
    sample(logits, rows, model.kernels.argmax)


def profile_batch(max_batch_tokens: int, max_seqs: int, block_size: int, max_len: int) -> tuple[Batch, int]:
    """The fullest step: max_seqs sequences (no more than there are tokens) sharing the token budget, none longer
    than max_len, each sampled; and the KV blocks it needs. Returns (batch, num_blocks)."""
    n = min(max_seqs, max_batch_tokens)
    # The remainder goes to the last sequences, so one-token sequences (decodes) come first as in a real batch.
    lengths = [min(max_len, max_batch_tokens // n + (i >= n - max_batch_tokens % n)) for i in range(n)]
    seqs, next_block = [], 0
    for i, length in enumerate(lengths):
        blocks = -(-length // block_size)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        seqs.append(ScheduledSeq(i, [1] * length, 0, table, True))
    return Batch(seqs, sum(1 for length in lengths if length == 1), []), next_block
