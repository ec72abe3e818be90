"""Tiny random GGUF files of several architectures (benchmarks/random_gguf.py writes them with gguf's writer, nothing
downloaded), carrying the embedded SmolLM2 file's tokenizer so that transformers converts them (the reference) as it
converts a real one; and a Mixtral written from a transformers model, as llama.cpp's converter writes one."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fastgen.benchmarks.random_gguf import GgufShape, copy_tokenizer, write_random_gguf

# A head of 128: transformers' GGUF config mapping has no head size and Qwen3's default is 128.
SIZES = dict(hidden=256, layers=2, heads=2, kv_heads=1, head_dim=128, intermediate=512)
# Mixtures of experts (qwen2moe, qwen3moe): transformers' GGUF config mapping reads neither expert size (it keeps its
# config class's defaults: 768 per expert for Qwen3-MoE, 1408 and a shared expert of 5632 for Qwen2-MoE), so the
# files use those sizes for its conversion, the reference, to load them.
MOE_SIZES = {
    "qwen3moe": dict(experts=8, used=2, expert=768, shared=0),
    "qwen2moe": dict(experts=4, used=2, expert=1408, shared=5632),
}


def tiny_gguf(
    path: Path, architecture: str, qtype: str = "Q8_0", seed: int = 0, std: float = 0.15, moe: dict | None = None
) -> Path:
    """A random two-layer model of `architecture` (benchmarks/random_gguf.py), MOE_SIZES' experts for qwen2moe and
    qwen3moe; moe: other expert sizes (which transformers' conversion cannot load)."""
    experts = moe or MOE_SIZES.get(architecture) or {}
    shape = GgufShape(**SIZES, **experts)
    return write_random_gguf(path, architecture, shape, qtype, seed, std)


def mixtral_gguf(root: Path, qtype: str = "Q8_0", seed: int = 0, std: float = 0.15) -> tuple[Path, Path]:
    """A tiny random Mixtral written as llama.cpp's converter writes one (a "llama" file with experts: q and k rows
    permuted for its rotary, each projection's experts stacked in one 3-d tensor, the router float32), its projections
    in `qtype` blocks, with the embedded file's tokenizer. Returns (the .gguf, a Hugging Face folder of the same model
    holding those blocks' values): transformers cannot convert such a file, so that folder is the reference."""
    import torch
    import transformers
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    writer = GGUFWriter(str(root / "mixtral.gguf"), arch="llama")
    config = transformers.MixtralConfig(
        vocab_size=copy_tokenizer(writer),
        hidden_size=256,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        initializer_range=std,
    )
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(config).float().eval()
    block = GGMLQuantizationType[qtype]
    writer.add_name("tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)

    def permute(w: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def blocks(name: str, w: torch.Tensor, heads: int = 0) -> torch.Tensor:
        """Writes w in blocks (its rows permuted as llama.cpp permutes q and k where heads); returns w's values
        rounded through the blocks (rounding is per row, so the same in either order)."""
        values = w.detach().numpy()
        writer.add_tensor(name, quantize(permute(values, heads) if heads else values, block), raw_dtype=block)
        return torch.from_numpy(dequantize(quantize(values, block), block).reshape(values.shape))

    state = model.state_dict()
    with torch.no_grad():
        for key, w in state.items():
            if "norm" in key:
                w.add_(torch.randn_like(w) * std)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        state["model.embed_tokens.weight"].copy_(blocks("token_embd.weight", state["model.embed_tokens.weight"]))
        state["lm_head.weight"].copy_(blocks("output.weight", state["lm_head.weight"]))
        writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
        for i in range(config.num_hidden_layers):
            p, b = f"model.layers.{i}.", f"blk.{i}."
            writer.add_tensor(b + "attn_norm.weight", state[p + "input_layernorm.weight"].numpy())
            writer.add_tensor(b + "ffn_norm.weight", state[p + "post_attention_layernorm.weight"].numpy())
            for ours, theirs, n in (
                ("attn_q", "q", heads),
                ("attn_k", "k", kv_heads),
                ("attn_v", "v", 0),
                ("attn_output", "o", 0),
            ):
                w = state[p + f"self_attn.{theirs}_proj.weight"]
                w.copy_(blocks(f"{b}{ours}.weight", w, n))
            writer.add_tensor(b + "ffn_gate_inp.weight", state[p + "mlp.gate.weight"].numpy())
            gate_up, down = state[p + "mlp.experts.gate_up_proj"], state[p + "mlp.experts.down_proj"]
            gate, up = gate_up.chunk(2, dim=1)  # (experts, intermediate, hidden) each
            gate_up.copy_(
                torch.cat([blocks(b + "ffn_gate_exps.weight", gate), blocks(b + "ffn_up_exps.weight", up)], 1)
            )
            down.copy_(blocks(b + "ffn_down_exps.weight", down))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.save_pretrained(root / "reference", safe_serialization=True)
    return root / "mixtral.gguf", root / "reference"
