"""Llama-family checkpoints: Llama 2/3 (llama3 rope scaling), Mistral (sliding window on every layer), Qwen2 (qkv
bias; sliding window on the layers from max_window_layers on), SmolLM2 (tied embeddings); GQA and MHA. All of them
are the plain decoder skeleton (replica/models/decoder.py)."""

from __future__ import annotations

from typing import Any

from .decoder import DUMMY_SEED, DUMMY_STD, DecoderModel, ModelConfig, RMSNorm, hf_common, hf_rope, sliding_layers

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
LlamaModel = DecoderModel  # the name the rest of the replica knew the model by


def window_of(hf: dict[str, Any], family: str) -> tuple[int | None, tuple[bool, ...]]:
    """(window, sliding layers) as transformers reads them: Mistral slides on every layer when sliding_window is set;
    Qwen2 and Qwen3 only with use_sliding_window, on layers from max_window_layers on."""
    window = hf.get("sliding_window")
    layers = hf["num_hidden_layers"]
    if family == "mistral":
        default = [window is not None] * layers
    else:
        window = window if hf.get("use_sliding_window", False) else None
        first = hf.get("max_window_layers", 28)
        default = [window is not None and i >= first for i in range(layers)]
    slides = sliding_layers(hf, default) if window else ()
    return (window, slides) if any(slides) else (None, ())


def config_from_hf(hf: dict[str, Any], architecture: str) -> ModelConfig:
    family = ARCHITECTURES[architecture]
    theta, llama3 = hf_rope(hf)
    window, slides = window_of(hf, family)
    return ModelConfig(
        **hf_common(hf, family),
        rope_theta=theta,
        rope_llama3=llama3,
        qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        o_bias=family != "qwen2" and bool(hf.get("attention_bias", False)),
        sliding_window=window,
        sliding_layers=slides,
    )


__all__ = ["ARCHITECTURES", "DUMMY_SEED", "DUMMY_STD", "LlamaModel", "ModelConfig", "RMSNorm", "config_from_hf"]
