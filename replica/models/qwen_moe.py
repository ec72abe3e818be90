"""Qwen2-MoE and Qwen3-MoE: Qwen2's and Qwen3's attention with mixtures of experts in the layers decoder_sparse_step
and mlp_only_layers pick (the rest keep a dense MLP of intermediate_size). Top-k of a softmax router, renormalised
only with norm_topk_prob (Qwen2-MoE's default is off, Qwen3-MoE's on); Qwen2-MoE adds a shared expert every token
goes through, scaled by sigmoid(shared_expert_gate(x))."""

from __future__ import annotations

from typing import Any

from .decoder import ModelConfig, hf_common, hf_rope
from .llama import window_of
from .moe import MoEConfig

ARCHITECTURES = {"Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"}


def moe_of(hf: dict[str, Any]) -> MoEConfig:
    dense, step = set(hf.get("mlp_only_layers") or ()), hf.get("decoder_sparse_step", 1)
    experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]  # Qwen's name, transformers 5's
    return MoEConfig(
        num_experts=experts,
        experts_per_token=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"],
        renormalize=bool(hf.get("norm_topk_prob", False)),
        sparse_layers=tuple(
            i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(hf["num_hidden_layers"])
        ),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) or 0,
    )


def config_from_hf(hf: dict[str, Any], architecture: str) -> ModelConfig:
    family = ARCHITECTURES[architecture]
    theta, llama3 = hf_rope(hf)
    window, slides = window_of(hf, family)
    qwen3 = family == "qwen3_moe"
    bias = bool(hf.get("attention_bias", False)) if qwen3 else bool(hf.get("qkv_bias", True))
    return ModelConfig(
        **hf_common(hf, family),
        rope_theta=theta,
        rope_llama3=llama3,
        qkv_bias=bias,
        o_bias=qwen3 and bias,
        qk_norm=qwen3,
        sliding_window=window,
        sliding_layers=slides,
        moe=moe_of(hf),
    )
