"""Mixtral: Mistral's attention (a sliding window on every layer when set) with a mixture of experts in place of
every MLP: top-k of the experts by a softmax router, the k weights renormalised; Mixtral's w1/w3/w2 are the experts'
gate/up/down projections."""

from __future__ import annotations

from typing import Any

from .decoder import ModelConfig, hf_common, hf_rope
from .llama import window_of
from .moe import MoEConfig

ARCHITECTURES = {"MixtralForCausalLM": "mixtral"}
RENAMES = (("block_sparse_moe.", "mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def config_from_hf(hf: dict[str, Any], architecture: str) -> ModelConfig:
    theta, llama3 = hf_rope(hf)
    window, slides = window_of(hf, "mistral")
    moe = MoEConfig(
        num_experts=hf["num_local_experts"],
        experts_per_token=hf["num_experts_per_tok"],
        intermediate_size=hf["intermediate_size"],
        renormalize=True,
        sparse_layers=(True,) * hf["num_hidden_layers"],
    )
    return ModelConfig(
        **hf_common(hf, "mixtral"),
        rope_theta=theta,
        rope_llama3=llama3,
        qkv_bias=False,
        sliding_window=window,
        sliding_layers=slides,
        renames=RENAMES,
        moe=moe,
    )
