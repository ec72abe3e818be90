"""Phi-3, Phi-3.5, Phi-4 and Phi-4-mini (Phi3ForCausalLM): the Llama skeleton, with q, k, v and gate, up fused in the
checkpoint (qkv_proj, gate_up_proj: split into our fused layers by part, so tensor parallelism shards each part),
partial rotary (Phi-4-mini), LongRoPE ("longrope", formerly "su") scaling and a sliding window on every layer where
config.json sets one (Phi-3-mini-4k)."""

from __future__ import annotations

import math
from typing import Any

from .decoder import ModelConfig, hf_common
from .llama import window_of

ARCHITECTURES = {"Phi3ForCausalLM": "phi3"}


def longrope(hf: dict[str, Any], rope: dict[str, Any]):
    """(short factors, long factors, original context, attention factor), as transformers computes them."""
    original = int(rope.get("original_max_position_embeddings") or hf["original_max_position_embeddings"])
    factor = rope.get("factor") or hf["max_position_embeddings"] / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return tuple(map(float, rope["short_factor"])), tuple(map(float, rope["long_factor"])), original, float(attention)


def config_from_hf(hf: dict[str, Any], architecture: str) -> ModelConfig:
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "longrope", "su", None):
        raise ValueError(f"unsupported Phi-3 rope scaling {rope_type!r}: FastGen supports default and longrope")
    common = hf_common(hf, "phi3")
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    window, slides = window_of(hf, "mistral")  # transformers' Phi-3 slides on every layer when a window is set
    return ModelConfig(
        **common,
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_llama3=None,
        qkv_bias=False,
        sliding_window=window,
        sliding_layers=slides,
        rotary_dim=int(common["head_dim"] * partial) if partial != 1.0 else 0,
        rope_longrope=longrope(hf, rope) if rope_type in ("longrope", "su") else None,
    )
