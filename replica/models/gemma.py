"""Gemma 2 and Gemma 3 (text): the decoder skeleton with embeddings scaled by sqrt(hidden), (1 + w) RMSNorms, norms
after attention and around the MLP (sandwich), GeGLU (tanh GELU), scores scaled by query_pre_attn_scalar ** -0.5,
sliding-window and global layers interleaved (layer_types), tied embeddings. Gemma 2 soft-caps the attention scores
and the final logits; Gemma 3 instead normalises q and k per head and gives its sliding-window layers their own rope
base (and its global ones linear rope scaling)."""

from __future__ import annotations

from typing import Any

from .decoder import ModelConfig, hf_common, sliding_layers

ARCHITECTURES = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}


def _gemma_common(hf: dict[str, Any], family: str, every: int) -> dict[str, Any]:
    """What Gemma 2 and 3 share; `every`: one layer in this many is global when config.json has no layer_types."""
    layers = hf["num_hidden_layers"]
    hidden = hf["hidden_size"]
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported Gemma activation {act!r}: FastGen supports gelu_pytorch_tanh")
    return dict(
        **{**hf_common(hf, family), "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True))},
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)),
        sliding_window=hf.get("sliding_window", 4096),
        sliding_layers=sliding_layers(hf, [(i + 1) % every != 0 for i in range(layers)]),
        norm_offset=1.0,
        sandwich_norms=True,
        mlp_activation="gelu_tanh",
        query_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        embed_scale=hidden**0.5,
    )


def gemma2_config(hf: dict[str, Any]) -> ModelConfig:
    rope = hf.get("rope_parameters") or {}
    return ModelConfig(
        **_gemma_common(hf, "gemma2", every=2),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_llama3=None,
        attn_softcap=float(hf.get("attn_logit_softcapping", 50.0) or 0.0),
        final_softcap=float(hf.get("final_logit_softcapping", 30.0) or 0.0),
    )


def gemma3_config(hf: dict[str, Any]) -> ModelConfig:
    """transformers 5 writes rope_parameters per layer type; 4.x rope_theta, rope_local_base_freq, rope_scaling."""
    rope = hf.get("rope_parameters") or {}
    full = dict(rope.get("full_attention") or hf.get("rope_scaling") or {})
    local = dict(rope.get("sliding_attention") or {})
    factor = 1.0
    if full.get("rope_type", full.get("type", "default")) == "linear":
        factor = float(full["factor"])
    elif full.get("rope_type", full.get("type", "default")) != "default":
        raise ValueError(f"unsupported Gemma 3 rope scaling {full.get('rope_type')!r}: FastGen supports linear")
    return ModelConfig(
        **_gemma_common(hf, "gemma3", every=hf.get("sliding_window_pattern", 6)),
        rope_theta=float(full.get("rope_theta", hf.get("rope_theta", 1_000_000.0))),
        rope_llama3=None,
        qk_norm=True,
        attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
        local_rope_theta=float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))),
        rope_linear_factor=factor,
    )


def config_from_hf(hf: dict[str, Any], architecture: str) -> ModelConfig:
    return gemma2_config(hf) if ARCHITECTURES[architecture] == "gemma2" else gemma3_config(hf)
