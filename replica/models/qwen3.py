"""Qwen3: the Llama skeleton with an RMSNorm over each head of q and k before rotary, and a head_dim of its own
(not hidden / heads); no qkv bias unless attention_bias; sliding window as Qwen2's."""

from __future__ import annotations

from typing import Any

from .decoder import ModelConfig, hf_common, hf_rope
from .llama import window_of

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3"}


def config_from_hf(hf: dict[str, Any], architecture: str) -> ModelConfig:
    theta, llama3 = hf_rope(hf)
    window, slides = window_of(hf, "qwen3")
    return ModelConfig(
        **hf_common(hf, "qwen3"),
        rope_theta=theta,
        rope_llama3=llama3,
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)),
        sliding_window=window,
        sliding_layers=slides,
        qk_norm=True,
    )
