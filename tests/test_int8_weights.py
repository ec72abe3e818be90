"""`--quantization int8`: a float checkpoint's linear weights quantized at load to int8 with one scale per output
channel (kernels/quant.py's quantize_per_channel) and served by the Q8_0 kernels, a mixture's experts too (on the
CPU). The reference is transformers in float32 on the same checkpoint with those weights replaced by their int8
values, computed here independently."""

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fastgen.kernels import quant
from fastgen.replica import pipeline
from fastgen.replica.builder import quantized_source
from fastgen.replica.config import EngineConfig
from fastgen.testing import make_tiny_model

from .helpers import assert_matches, hf_greedy, random_prompts
from .test_model_families import make_family_model, prompts_for
from .test_moe_models import MOE_FAMILIES
from .tp_ranks import engine_rank, engine_tokens, run_ranks

# Mixtral's experts: w1 (gate), w3 (up), w2 (down); its router (`gate`) stays float32, as FastGen keeps it.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def int8_values(w: np.ndarray) -> np.ndarray:
    """Per-channel int8 as the flag defines it: scale = max|row| / 127 in float16, q = round half to even, clamped."""
    w = w.astype(np.float32)
    scale = np.maximum(np.abs(w).max(axis=1) / np.float32(127), np.float32(2**-24)).astype(np.float16)
    scale = scale.astype(np.float32)[:, None]
    return np.clip(np.rint(w / scale), -127, 127) * scale


def int8_checkpoint(source: Path, target: Path) -> Path:
    """A copy of a model folder whose decoder-layer projections hold their int8 values (the LM head and the embedding
    stay as they are, as the flag leaves them)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(str(source / "model.safetensors"))
    for name, value in tensors.items():
        if name.startswith("model.layers.") and name.rsplit(".", 2)[-2] in PROJECTIONS and name.endswith(".weight"):
            tensors[name] = int8_values(value)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8")
    source = make_tiny_model(root / "llama", heads=4, kv_heads=2, tie=True, seed=7)
    return source, int8_checkpoint(source, root / "llama-int8")


def test_quantize_per_channel_is_int8_with_one_scale_per_row():
    torch.manual_seed(0)
    w = torch.randn(6, 96) * torch.tensor([1e-3, 0.1, 1, 10, 0, 1e-9])[:, None]
    packed = quant.quantize_per_channel(w)
    assert packed.name == "Q8_0" and packed.shape == (6, 96) and packed.nbytes == 6 * 3 * 34
    blocks = packed.data.view(6, 3, 34)
    scales = blocks[:, :, :2].contiguous().view(torch.float16).squeeze(-1)  # (rows, blocks)
    assert torch.equal(scales, scales[:, :1].expand(6, 3))  # every block of a row carries the row's scale
    quants = blocks[:, :, 2:].contiguous().view(torch.int8)
    assert int(quants.abs().max()) == 127 and not quants[4].any()  # the all-zero row stays zero
    assert np.array_equal(packed.dequantize().numpy(), int8_values(w.numpy()))
    assert float((packed.dequantize() - w).abs().max(dim=1).values[3]) <= float(scales[3, 0]) / 2
    assert quant.quantize_per_channel(torch.ones(2, 40)) is None  # not a whole number of 32-weight blocks


def test_a_rows_scale_may_come_from_the_whole_row():
    """A row-parallel shard quantizes with its whole row's max |w|: its half of each row is that half of the whole."""
    w = torch.randn(4, 128)
    whole = quant.quantize_per_channel(w).dequantize()
    half = quant.quantize_per_channel(w[:, 64:], w.abs().amax(dim=1)).dequantize()
    assert torch.equal(half, whole[:, 64:])


def test_int8_is_refused_off_the_cpu():
    config = EngineConfig(model="smollm2-135m", quantization="int8")
    with pytest.raises(ValueError, match="int8 .* runs on the CPU"):
        quantized_source(config, torch.device("cuda"))
    assert quantized_source(config, torch.device("cpu")) is None  # the float checkpoint, quantized after loading


def test_layers_hold_int8_rows_and_the_head_stays_float(models):
    source, _ = models
    pipe = pipeline(str(source), dtype="float32", quantization="int8", progress=False)
    model = pipe.engine.runner.model
    linears = [m for m in model.layers.modules() if hasattr(m, "quantize")]
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down in each of two layers
    if quant.quant_kernels():
        assert all(isinstance(m.packed, quant.QuantLinear) and m.weight is None for m in linears)
        held = sum(m.packed.nbytes for m in linears)
        assert held == sum(m.out_features * m.in_features for m in linears) * 34 // 32
    assert not isinstance(model.lm_head.packed, quant.QuantLinear) and model.embed_tokens.quantized is None


def test_greedy_matches_transformers_on_the_int8_values(models):
    """float32 activations: the served tokens are transformers' on the int8 weights, prompts split across passes and
    sequences preempted in a small KV pool."""
    source, reference = models
    rng = random.Random(11)
    prompts = random_prompts(8, rng, 20, 60)
    refs = hf_greedy(reference, prompts, 12)
    pipe = pipeline(str(source), dtype="float32", quantization="int8", max_batch_tokens=16, block_size=4, num_blocks=40)
    assert_matches(pipe(prompts, max_new_tokens=12, min_new_tokens=12), refs)
    assert pipe.engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_tp2_serves_the_same_int8_values(models, tmp_path):
    """Two ranks, each quantizing its shards (a row-parallel shard with its whole row's scale): transformers' tokens
    on the int8 values of the unsharded weights."""
    source, reference = models
    prompts = random_prompts(6, random.Random(12), 1, 60)
    runs = [dict(model=str(source), prompts=prompts, new=10, budget=24, quantization="int8")]
    run_ranks(engine_rank, runs, str(tmp_path / "out"), timeout=150)
    got = json.loads(Path(f"{tmp_path / 'out'}.0").read_text())[0]
    assert_matches([SimpleNamespace(token_ids=t) for t in got["tokens"]], hf_greedy(reference, prompts, 10))


# ---- a mixture of experts: the experts int8 too ----
@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8-moe")
    source = make_family_model(root / "mixtral", "mixtral", seed=31, families=MOE_FAMILIES)
    return source, int8_checkpoint(source, root / "mixtral-int8")


def test_experts_hold_int8_rows(mixtral):
    """Each expert's gate/up and down rows packed as Q8_0 blocks (the float experts dropped)."""
    from fastgen.kernels import cpu_moe
    from fastgen.replica.models.moe import FusedExperts

    pipe = pipeline(str(mixtral[0]), dtype="float32", quantization="int8", progress=False)
    experts = [m for m in pipe.engine.runner.model.modules() if isinstance(m, FusedExperts)]
    assert len(experts) == 3
    if not quant.quant_kernels():
        pytest.skip("no quantized kernels on this CPU: the experts stay float")
    for m in experts:
        assert isinstance(m.packed, cpu_moe.QuantExperts) and m.w13 is None and m.w2 is None
        assert (
            len(m.packed.w13) == 8 and sum(p.nbytes for p in m.packed.w13 + m.packed.w2) == 8 * 3 * 128 * 64 * 34 // 32
        )


def test_moe_greedy_matches_transformers_on_the_int8_values(mixtral):
    """float32 activations: the served tokens are transformers' on the int8 experts and projections, prompts split
    across passes and sequences preempted in a small KV pool."""
    source, reference = mixtral
    prompts = prompts_for(13, 6)
    refs = hf_greedy(reference, prompts, 10, attn_implementation="eager")
    pipe = pipeline(str(source), dtype="float32", quantization="int8", max_batch_tokens=16, block_size=4, num_blocks=40)
    assert_matches(pipe(prompts, max_new_tokens=10, min_new_tokens=10), refs)
    assert pipe.engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_moe_int8_under_tensor_and_expert_parallelism(mixtral, tmp_path):
    """Two ranks, each expert's intermediate split (a down row's scale its whole row's) or whole experts per rank:
    transformers' tokens on the int8 values of the unsharded weights."""
    source, reference = mixtral
    prompts = prompts_for(14)
    runs = [
        dict(model=str(source), prompts=prompts, new=8, budget=24, quantization="int8", expert_parallel=parallel)
        for parallel in (False, True)
    ]
    refs = hf_greedy(reference, prompts, 8, attn_implementation="eager")
    for tokens in engine_tokens(runs, tmp_path / "out", timeout=200):
        assert_matches([SimpleNamespace(token_ids=t) for t in tokens], refs)
