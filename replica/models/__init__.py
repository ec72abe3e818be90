"""The architecture registry: a checkpoint's `architectures` (config.json) -> the family module that reads its
config. Every family runs on the shared decoder skeleton (decoder.py) with its differences named in its config."""

from __future__ import annotations

from typing import Any

from . import falcon, gemma, llama, mixtral, opt, phi, phi3, qwen3, qwen_moe
from .decoder import DecoderModel, ModelConfig

FAMILIES = (llama, qwen3, gemma, phi3, phi, opt, falcon, mixtral, qwen_moe)
ARCHITECTURES = {arch: family for family in FAMILIES for arch in family.ARCHITECTURES}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The model's config from its Hugging Face config.json; ValueError for an architecture FastGen does not serve."""
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or hf.get('model_type')!r}: FastGen serves "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[arch].config_from_hf(hf, arch)


__all__ = ["ARCHITECTURES", "DecoderModel", "ModelConfig", "config_from_hf"]
