"""Falcon (FalconForCausalLM, rotary variants): Falcon-7B's parallel attention and MLP on one LayerNorm with
multi-query attention, the new decoder architecture's (40B, 180B) grouped KV heads with a LayerNorm for each branch,
or sequential blocks; query_key_value fused in the checkpoint in the layout each variant uses; exact GELU MLP."""

from __future__ import annotations

from typing import Any

from .decoder import ModelConfig, gpt_style, hf_rope

ARCHITECTURES = {"FalconForCausalLM": "falcon"}
# transformers' Falcon names -> the skeleton's
RENAMES = (
    ("transformer.word_embeddings.", "embed_tokens."),
    ("transformer.ln_f.", "norm."),
    ("transformer.h.", "layers."),
    ("self_attention.dense.", "self_attn.o_proj."),
    ("self_attention.query_key_value.", "self_attn.qkv_proj."),
    ("ln_attn.", "input_layernorm."),
    ("mlp.dense_h_to_4h.", "mlp.fc1."),
    ("mlp.dense_4h_to_h.", "mlp.fc2."),
)


def config_from_hf(hf: dict[str, Any], architecture: str) -> ModelConfig:
    if hf.get("alibi"):
        raise ValueError("unsupported Falcon variant alibi (Falcon-RW): FastGen serves Falcon with rotary embeddings")
    hidden = hf.get("hidden_size") or hf["n_embed"]
    heads = hf.get("num_attention_heads") or hf["n_head"]
    new_arch, multi_query = bool(hf.get("new_decoder_architecture")), bool(hf.get("multi_query", True))
    kv_heads = (hf.get("num_kv_heads") or heads) if new_arch or not multi_query else 1
    parallel = bool(hf.get("parallel_attn", True))
    norms = hf.get("num_ln_in_parallel_attn") or (2 if new_arch else 1)
    theta, _ = hf_rope(hf)
    return ModelConfig(
        architecture="falcon",
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf.get("ffn_hidden_size") or 4 * hidden,
        num_layers=hf.get("num_hidden_layers") or hf["n_layer"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        rope_theta=theta,
        rope_llama3=None,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        sliding_window=None,
        **gpt_style(bool(hf.get("bias", False)), hf.get("activation", "gelu")),
        parallel_block=parallel or new_arch,
        ln_mlp=new_arch and norms == 2,
        qkv_layout="grouped" if new_arch else "concat" if multi_query else "interleaved",
        renames=RENAMES,
    )
