"""Llama-family decoder over ragged batches: Llama 2/3 (llama3 rope scaling), Mistral, Qwen2 (qkv bias),
SmolLM2 (tied embeddings); GQA and MHA. Every linear layer is tensor-parallel (one rank: a plain layer)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...kernels import AttentionMetadata, Kernels, rope_cos_sin, rope_inv_freq
from ..parallel import (
    GateUpParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
# Random weights of load_format "dummy": Llama's initializer_range, so activations stay in range through the layers.
DUMMY_STD = 0.02
DUMMY_SEED = 0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_llama3: tuple[float, float, float, int] | None  # (factor, low, high, original context) or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Reads a Hugging Face config.json (transformers 4.x and 5.x spellings)."""
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.get('model_type')!r}: FastGen serves "
                f"{', '.join(sorted(ARCHITECTURES))} (Llama 2/3, Mistral, Qwen2, SmolLM2)"
            )
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        llama3 = None
        if rope_type == "llama3":
            llama3 = (
                float(rope["factor"]),
                float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]),
                int(rope["original_max_position_embeddings"]),
            )
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope scaling {rope_type!r}: FastGen supports default and llama3")
        heads = hf["num_attention_heads"]
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        return cls(
            architecture=ARCHITECTURES[arch],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_llama3=llama3,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=ARCHITECTURES[arch] == "qwen2" or bool(hf.get("attention_bias", False)),
            sliding_window=window,
        )


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, kernels: Kernels) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.eps = eps
        self.kernels = kernels

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        self.weight.data.copy_(tensor)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps), x
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, kernels: Kernels) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias, tp, kernels
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, tp, kernels)
        self.heads, self.kv_heads, self.head_dim = self.qkv_proj.heads, self.qkv_proj.kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.kernels = kernels

    def forward(self, x, positions, cos_sin, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.heads * self.head_dim, *[self.kv_heads * self.head_dim] * 2], -1)
        q = q.view(-1, self.heads, self.head_dim)  # (tokens, heads, head_dim)
        k = k.view(-1, self.kv_heads, self.head_dim)  # (tokens, kv_heads, head_dim)
        v = v.view(-1, self.kv_heads, self.head_dim)
        q = self.kernels.rotary_write_kv(q, k, v, cos_sin, positions, k_cache, v_cache, meta.slot_mapping)
        o = self.kernels.paged_attention(q, k_cache, v_cache, meta, self.scale)  # (tokens, heads, head_dim)
        return self.o_proj(o.flatten(1))  # (tokens, hidden)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, kernels: Kernels) -> None:
        super().__init__()
        self.gate_up_proj = GateUpParallelLinear(cfg.hidden_size, cfg.intermediate_size, tp, kernels)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)  # (tokens, intermediate / tp): SiLU(gate) * up
        return self.down_proj(h)  # (tokens, hidden)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, kernels: Kernels) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = Attention(cfg, tp, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp = MLP(cfg, tp, kernels)

    def forward(self, x, residual, positions, cos_sin, meta, k_cache, v_cache):
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin, meta, k_cache, v_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, kernels: Kernels) -> None:
        super().__init__()
        self.config = cfg
        self.kernels = kernels
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, kernels) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = ParallelLMHead(self.embed_tokens, cfg.tie_word_embeddings, tp, kernels)
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_llama3)
        self.register_buffer("cos_sin", rope_cos_sin(inv_freq, cfg.max_position_embeddings), persistent=False)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        """input_ids, positions (tokens,) -> final hidden states (tokens, hidden)."""
        x, residual = self.embed_tokens(input_ids), None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, self.cos_sin, meta, k_cache, v_cache)
        return self.norm(x, residual)[0]

    def pack_weights(self) -> None:
        """Packs every linear layer's weight once, in the form the kernels' linear reads fastest (if any)."""
        for module in self.modules():
            if hasattr(module, "pack"):
                module.pack()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # (rows, vocab) in the model's dtype: the sampler widens only rows it samples

    @torch.no_grad()
    def init_random_weights(self, seed: int = DUMMY_SEED) -> None:
        """load_format "dummy": random weights written in place where the parameters already live (the target
        device), so nothing is read and nothing crosses from the CPU. Norm weights are ones, as a trained model's
        roughly are; every other weight is N(0, DUMMY_STD). Seeded, so every start builds the same model; each
        tensor-parallel rank draws its own shards, so the weights differ with --tp."""
        norms = {id(m.weight) for m in self.modules() if isinstance(m, RMSNorm)}
        generator = None
        for param in self.parameters():  # a tied LM head is the embedding, drawn once
            if generator is None or generator.device != param.device:
                generator = torch.Generator(param.device).manual_seed(seed)
            if id(param) in norms:
                param.fill_(1.0)
            else:
                param.normal_(0.0, DUMMY_STD, generator=generator)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads Hugging Face tensor names; each layer takes its own shard."""
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        modules = dict(self.named_modules())
        seen = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            module_name, _, param = name.rpartition(".")
            prefix, _, leaf = module_name.rpartition(".")
            part = 0
            if leaf in fused:
                leaf, part = fused[leaf]
                module_name = f"{prefix}.{leaf}"
            if module_name not in modules:
                raise ValueError(f"unexpected tensor {name!r} in the checkpoint")
            modules[module_name].load(param, tensor, part)
            seen.add((module_name, param, part))
        tied_head = self.lm_head if self.config.tie_word_embeddings else None
        expected = sum(
            len(getattr(m, "local_parts", [0])) for m in modules.values() if hasattr(m, "load") and m is not tied_head
        )
        loaded_weights = {s for s in seen if s[1] == "weight"}
        if len(loaded_weights) != expected:
            raise ValueError(f"checkpoint is incomplete: {len(loaded_weights)} of {expected} weight tensors found")
