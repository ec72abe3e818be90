"""Phi-2 (PhiForCausalLM): attention and a plain GELU MLP in parallel on one LayerNorm per layer, biases on every
linear layer and on the LM head, partial rotary (partial_rotary_factor of each head rotates)."""

from __future__ import annotations

from typing import Any

from .decoder import ModelConfig, gpt_style, hf_common, hf_rope

ARCHITECTURES = {"PhiForCausalLM": "phi"}
# transformers' Phi names -> the skeleton's
RENAMES = (("self_attn.dense.", "self_attn.o_proj."), ("final_layernorm.", "norm."))


def config_from_hf(hf: dict[str, Any], architecture: str) -> ModelConfig:
    if hf.get("qk_layernorm"):
        raise ValueError("unsupported Phi option qk_layernorm: FastGen serves Phi-2's layout")
    theta, _ = hf_rope(hf)
    rope = dict(hf.get("rope_parameters") or {})
    common = hf_common(hf, "phi")
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))
    return ModelConfig(
        **{**common, "rms_norm_eps": float(hf.get("layer_norm_eps", 1e-5))},
        rope_theta=theta,
        rope_llama3=None,
        sliding_window=None,
        rotary_dim=int(common["head_dim"] * partial),
        **gpt_style(True, hf.get("hidden_act", "gelu_new")),
        parallel_block=True,
        lm_head_bias=True,
        renames=RENAMES,
    )
