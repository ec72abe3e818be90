"""The decoder skeleton every family shares: embedding, N x (attention + MLP) over ragged batches, final norm, LM head.
A family is a `ModelConfig` read from its checkpoint's config.json (replica/models/<family>.py) whose fields name its
differences: RMSNorm or LayerNorm, q/k norms, (1 + w) norms, sandwich norms, a gated or plain MLP and its activation,
attention and MLP in parallel, biases, the attention scale, soft-capping, sliding-window layers, rope variants, and
how its checkpoint names tensors. Every linear layer is tensor-parallel (one rank: a plain layer)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import AttentionMetadata, Kernels, rope_cos_sin, rope_inv_freq
from ...kernels.decode_layer import DecodeLayerParts
from ...kernels.int4 import Int4Tensor, random_int4
from ...kernels.quant import QuantizedTensor
from ..parallel import (
    ColumnParallelLinear,
    GateUpParallelLinear,
    ParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)
from .moe import EXPERT_TENSOR, FusedExperts, MoEConfig, SparseMoeBlock

# A checkpoint's separate projection -> (our fused layer, its part).
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Random weights of load_format "dummy": Llama's initializer_range, so activations stay in range through the layers.
DUMMY_STD = 0.02
DUMMY_SEED = 0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the family: llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, phi, opt, falcon, mixtral, ...
    # qwen2_moe, qwen3_moe
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float  # every norm's eps, LayerNorm's too
    rope_theta: float
    rope_llama3: tuple[float, float, float, int] | None  # (factor, low, high, original context) or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None  # the window of the sliding-window layers; None where every layer is global
    # Per layer: whether it attends within sliding_window only (empty: none does).
    sliding_layers: tuple[bool, ...] = ()
    o_bias: bool = False  # the attention output projection's bias (Llama, Qwen3 and Gemma with attention_bias)
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # every RMSNorm scales by (offset + w) (Gemma: 1)
    sandwich_norms: bool = False  # norms after attention and around the MLP as well (Gemma 2/3)
    # The gated MLP's: "silu" or "gelu_tanh" (GeGLU); the plain MLP's: a transformers name in ACTIVATIONS
    mlp_activation: str = "silu"
    query_scale: float | None = None  # attention's score scale; None: head_dim ** -0.5
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) before the softmax (0: off)
    final_softcap: float = 0.0  # the same on the logits
    embed_scale: float = 1.0  # embeddings are multiplied by it (Gemma: sqrt(hidden))
    local_rope_theta: float | None = None  # rope base of the sliding-window layers, where it differs (Gemma 3)
    rope_linear_factor: float = 1.0  # linear position interpolation of the global layers (Gemma 3)
    rotary_dim: int = 0  # dims of each head that rotate, the first ones (0: all; partial rotary: Phi)
    # LongRoPE (Phi-3 "longrope"/"su"): (short factors, long factors, original context, attention factor)
    rope_longrope: tuple[tuple[float, ...], tuple[float, ...], int, float] | None = None
    norm: str = "rms"  # "rms" or "layer" (LayerNorm with bias: Phi-2, Falcon, OPT)
    mlp: str = "gated"  # "gated": down(act(gate) * up); "plain": fc2(act(fc1)) (Phi-2, Falcon, OPT)
    mlp_bias: bool = False  # the plain MLP's biases
    parallel_block: bool = False  # x + attn(norm(x)) + mlp(norm(x)): one norm, both branches read it (Phi-2)
    lm_head_bias: bool = False
    ln_mlp: bool = False  # a parallel block's MLP reads a norm of its own (Falcon's new decoder architecture)
    rope: bool = True  # False: no rotary embedding (OPT's learned positions instead)
    learned_positions_offset: int | None = None  # a learned position table, read at position + offset (OPT: 2)
    scale_queries: bool = False  # q is scaled before q k^T, not the scores after it (OPT: the same bits as its)
    # How a checkpoint's fused query_key_value rows lie: "concat" (q, k, v), "grouped" (per KV head: its queries, k,
    # v; Falcon's new decoder architecture), "interleaved" (per head: q, k, v; Falcon without multi-query)
    qkv_layout: str = "concat"
    post_norm: bool = False  # norms after each residual add, none at the end (OPT-350m)
    embedding_dim: int = 0  # the embeddings' width where it is not hidden_size: projected in and out (OPT-350m)
    # (checkpoint's, ours) substrings of tensor names where a family names a module otherwise (e.g. Phi-2's dense)
    renames: tuple[tuple[str, str], ...] = ()
    moe: MoEConfig | None = None  # a mixture of experts' MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE); None: dense

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Reads a Hugging Face config.json through the family its `architectures` names."""
        from . import config_from_hf

        return config_from_hf(hf)

    def window(self, layer: int) -> int:
        """Layer's attention window in tokens (0: the whole sequence)."""
        return (self.sliding_window or 0) if self.sliding_layers and self.sliding_layers[layer] else 0

    @property
    def kv_window(self) -> int | None:
        """The longest window of any layer when every layer has one (keys further back are never read again);
        None where some layer attends to the whole sequence."""
        slides = self.sliding_layers
        return self.sliding_window if slides and len(slides) == self.num_layers and all(slides) else None


def hf_rope(hf: dict[str, Any]) -> tuple[float, tuple[float, float, float, int] | None]:
    """(rope base, llama3 scaling or None) from a config.json (transformers 4.x and 5.x spellings)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        factor, low, high = (float(rope[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        return theta, (factor, low, high, int(rope["original_max_position_embeddings"]))
    if rope_type not in ("default", None):
        raise ValueError(f"unsupported rope scaling {rope_type!r}: FastGen supports default and llama3")
    return theta, None


def hf_common(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The fields every family reads the same way."""
    heads = hf["num_attention_heads"]
    return dict(
        architecture=architecture,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def gpt_style(bias: bool, activation: str) -> dict[str, Any]:
    """What the GPT-style families (Phi-2, OPT, Falcon) share: LayerNorm, a plain MLP, biases on every linear layer
    of a block or on none."""
    return dict(norm="layer", mlp="plain", mlp_activation=activation, qkv_bias=bias, o_bias=bias, mlp_bias=bias)


def sliding_layers(hf: dict[str, Any], default: list[bool]) -> tuple[bool, ...]:
    """Which layers slide: config.json's layer_types where it has them, else the family's default."""
    types = hf.get("layer_types")
    return tuple(t == "sliding_attention" for t in types) if types else tuple(default)


def rope_table(cfg: ModelConfig, theta: float, local: bool = False) -> torch.Tensor:
    """The (positions, rotary_dim) cos|sin table of a rope base: llama3, linear (global layers only) or LongRoPE
    scaled. LongRoPE rotates positions before the original context by the short factors and later ones by the long,
    per position (as vLLM does; transformers switches a whole sequence to the long factors once it is longer)."""
    dim, positions = cfg.rotary_dim or cfg.head_dim, cfg.max_position_embeddings
    if not cfg.rope:  # an empty table: the kernels rotate no dim
        return torch.zeros(positions, 0, dtype=torch.float32)
    if cfg.rope_longrope is not None:
        short, long, original, attention_factor = cfg.rope_longrope
        powers = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        short_table = rope_cos_sin(1.0 / (torch.tensor(short, dtype=torch.float32) * powers), min(original, positions))
        long_table = rope_cos_sin(1.0 / (torch.tensor(long, dtype=torch.float32) * powers), positions)[original:]
        return torch.cat([short_table, long_table]) * attention_factor
    inv_freq = rope_inv_freq(dim, theta, None if local else cfg.rope_llama3)
    return rope_cos_sin(inv_freq if local else inv_freq / cfg.rope_linear_factor, positions)


class RMSNorm(nn.Module):
    """RMSNorm scaling by offset + w. The offset is added once at load (Gemma's 1 + w), so the kernels only ever
    scale by a stored weight; in float32 the result is HF's bit for bit."""

    def __init__(self, hidden: int, eps: float, kernels: Kernels, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.eps = eps
        self.offset = offset
        self.kernels = kernels

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        self.weight.data.copy_(tensor.float() + self.offset if self.offset else tensor)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps), x
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm with bias, RMSNorm's interface (the residual add fused in)."""

    def __init__(self, hidden: int, eps: float, kernels: Kernels) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden), requires_grad=False)
        self.eps = eps
        self.kernels = kernels

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        getattr(self, name).data.copy_(tensor)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.kernels.layer_norm(x, self.weight, self.bias, self.eps), x
        return self.kernels.add_layer_norm(x, residual, self.weight, self.bias, self.eps)


def make_norm(cfg: ModelConfig, hidden: int, kernels: Kernels) -> RMSNorm | LayerNorm:
    if cfg.norm == "layer":
        return LayerNorm(hidden, cfg.rms_norm_eps, kernels)
    return RMSNorm(hidden, cfg.rms_norm_eps, kernels, cfg.norm_offset)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' "gelu_new" (GPT-2, Phi-2), written as it writes it so that float32 results are its bits."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


# The plain MLP's activations, by their transformers (ACT2FN) names.
ACTIVATIONS = {
    "gelu_new": gelu_new,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, kernels: Kernels) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias, tp, kernels
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp, kernels)
        self.heads, self.kv_heads, self.head_dim = self.qkv_proj.heads, self.qkv_proj.kv_heads, cfg.head_dim
        self.scale = cfg.query_scale or cfg.head_dim**-0.5
        self.window = cfg.window(layer)
        self.softcap = cfg.attn_softcap
        self.scale_queries = cfg.scale_queries
        self.local_rope = bool(self.window) and cfg.local_rope_theta is not None  # reads the model's local table
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels, cfg.norm_offset)
        self.qk_norm = cfg.qk_norm
        self.kernels = kernels

    def forward(self, x, positions, cos_sin, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.heads * self.head_dim, *[self.kv_heads * self.head_dim] * 2], -1)
        q = q.view(-1, self.heads, self.head_dim)  # (tokens, heads, head_dim)
        k = k.view(-1, self.kv_heads, self.head_dim)  # (tokens, kv_heads, head_dim)
        v = v.view(-1, self.kv_heads, self.head_dim)
        if self.qk_norm:  # each head normalised on its own: rows of head_dim
            q = self.q_norm(q.reshape(-1, self.head_dim))[0].view(-1, self.heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim))[0].view(-1, self.kv_heads, self.head_dim)
        if self.scale_queries:
            q = q * self.scale
        q = self.kernels.rotary_write_kv(q, k, v, cos_sin, positions, k_cache, v_cache, meta.slot_mapping)
        # (tokens, heads, head_dim); window and softcap are 0 (off) for most layers of most families
        scale = 1.0 if self.scale_queries else self.scale
        o = self.kernels.paged_attention(q, k_cache, v_cache, meta, scale, self.window, self.softcap)
        return self.o_proj(o.flatten(1))  # (tokens, hidden)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, kernels: Kernels) -> None:
        super().__init__()
        self.gate_up_proj = GateUpParallelLinear(
            cfg.hidden_size, cfg.intermediate_size, tp, kernels, cfg.mlp_activation
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)  # (tokens, intermediate / tp): act(gate) * up
        return self.down_proj(h)  # (tokens, hidden)


class PlainMLP(nn.Module):
    """fc2(act(fc1(x))) with biases: the MLP of Phi-2, Falcon and OPT."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, kernels: Kernels) -> None:
        super().__init__()
        if cfg.mlp_activation not in ACTIVATIONS:
            raise ValueError(
                f"unsupported activation {cfg.mlp_activation!r}: FastGen supports {', '.join(ACTIVATIONS)}"
            )
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size], cfg.mlp_bias, tp, kernels)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp, kernels)
        self.act = ACTIVATIONS[cfg.mlp_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))  # (tokens, intermediate / tp) -> (tokens, hidden)


def make_mlp(cfg: ModelConfig, layer: int, tp: TPGroup, kernels: Kernels, expert_parallel: bool) -> nn.Module:
    if cfg.moe is not None and cfg.moe.sparse_layers[layer]:
        return SparseMoeBlock(cfg.moe, cfg.hidden_size, tp, expert_parallel, kernels)
    return PlainMLP(cfg, tp, kernels) if cfg.mlp == "plain" else MLP(cfg, tp, kernels)


class DecoderLayer(nn.Module):
    """Pre-norm layer (Llama): x + attn(norm(x)), then + mlp(norm(.)). The residual add is fused into the next norm."""

    def __init__(
        self, cfg: ModelConfig, layer: int, tp: TPGroup, kernels: Kernels, expert_parallel: bool = False
    ) -> None:
        super().__init__()
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, kernels)
        self.self_attn = Attention(cfg, layer, tp, kernels)
        if not cfg.parallel_block:
            self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size, kernels)
        self.mlp = make_mlp(cfg, layer, tp, kernels, expert_parallel)

    fused = None  # the backend's whole-layer decode step (kernels/decode_layer.py), where it has one for this layer

    def forward(self, x, residual, positions, cos_sin, meta, k_cache, v_cache):
        if self.fused is not None:
            out = self.fused(x, residual, positions, cos_sin, meta, k_cache, v_cache)
            if out is not None:
                return out
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin, meta, k_cache, v_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def fuse(self) -> None:
        """Offers the backend this layer whole, once its weights are packed: where the layer is Llama's plain form
        (no bias, LoRA, window, soft-capping, q/k norms or tensor parallelism), the backend may run its decode steps
        in one call."""
        attn, mlp = self.self_attn, self.mlp
        projections = (attn.qkv_proj, attn.o_proj)
        plain = (
            type(self) is DecoderLayer  # the fused kernel is this class's forward, not a subclass's
            and isinstance(mlp, MLP)
            and mlp.gate_up_proj.activation == "silu"
            and isinstance(self.input_layernorm, RMSNorm)
            and not (attn.qk_norm or attn.scale_queries or attn.window or attn.softcap)
            and all(p.bias is None for p in projections)
            and all(p.lora is None for p in (*projections, mlp.gate_up_proj, mlp.down_proj))
            and attn.o_proj.tp.size == 1
        )
        self.fused = None
        if plain:
            assert isinstance(mlp, MLP)  # as plain says (this narrows mlp's type)
            parts = DecodeLayerParts(
                self.input_layernorm.weight,
                self.post_attention_layernorm.weight,
                self.input_layernorm.eps,
                attn.qkv_proj.packed,
                attn.o_proj.packed,
                mlp.gate_up_proj.packed,
                mlp.down_proj.packed,
                attn.heads,
                attn.kv_heads,
                attn.head_dim,
                attn.scale,
            )
            self.fused = attn.kernels.fuse_decode_layer(parts)


class ParallelDecoderLayer(DecoderLayer):
    """Attention and MLP side by side on one norm's output (Phi-2, Falcon-7B): x + attn(norm(x)) + mlp(norm(x))."""

    def __init__(
        self, cfg: ModelConfig, layer: int, tp: TPGroup, kernels: Kernels, expert_parallel: bool = False
    ) -> None:
        super().__init__(cfg, layer, tp, kernels, expert_parallel)
        if cfg.ln_mlp:
            self.ln_mlp = make_norm(cfg, cfg.hidden_size, kernels)
        self.two_norms = cfg.ln_mlp

    def forward(self, x, residual, positions, cos_sin, meta, k_cache, v_cache):
        h, residual = self.input_layernorm(x, residual)
        h_mlp = self.ln_mlp(residual)[0] if self.two_norms else h
        return self.self_attn(h, positions, cos_sin, meta, k_cache, v_cache) + self.mlp(h_mlp), residual


class PostNormDecoderLayer(DecoderLayer):
    """Norms after each residual add (OPT-350m): norm(x + attn(x)), then norm(. + mlp(.)). The layer hands on
    finished hidden states: nothing is left to add."""

    def forward(self, x, residual, positions, cos_sin, meta, k_cache, v_cache):
        x = x if residual is None else x + residual
        x = self.input_layernorm(self.self_attn(x, positions, cos_sin, meta, k_cache, v_cache), x)[0]
        return self.post_attention_layernorm(self.mlp(x), x)[0], None


class SandwichDecoderLayer(DecoderLayer):
    """Gemma's layer: attention's and the MLP's outputs are normalised too before they join the residual
    (post_attention_layernorm is the norm after attention here, pre_feedforward_layernorm the one before the MLP)."""

    def __init__(
        self, cfg: ModelConfig, layer: int, tp: TPGroup, kernels: Kernels, expert_parallel: bool = False
    ) -> None:
        super().__init__(cfg, layer, tp, kernels, expert_parallel)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels, cfg.norm_offset)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels, cfg.norm_offset)

    def forward(self, x, residual, positions, cos_sin, meta, k_cache, v_cache):
        x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, positions, cos_sin, meta, k_cache, v_cache))[0]
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x))[0], residual


if TYPE_CHECKING:

    class DecoderLayers(nn.ModuleList):
        """The model's layers as type checkers see them: torch's ModuleList does not say what it holds."""

        def __iter__(self) -> Iterator[DecoderLayer]: ...
        def __getitem__(self, idx: int) -> DecoderLayer: ...

else:
    DecoderLayers = nn.ModuleList


class DecoderModel(nn.Module):
    """expert_parallel: a mixture of experts' layers split by whole experts over the ranks, not by each expert's
    intermediate rows (replica/models/moe.py)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, kernels: Kernels, expert_parallel: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.kernels = kernels
        width = cfg.embedding_dim or cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, width, tp)
        if width != cfg.hidden_size:  # small projections, whole on every rank (a group of one)
            self.project_in = ColumnParallelLinear(width, [cfg.hidden_size], False, TPGroup(), kernels)
            self.project_out = ColumnParallelLinear(cfg.hidden_size, [width], False, TPGroup(), kernels)
        if cfg.learned_positions_offset is not None:
            positions = cfg.max_position_embeddings + cfg.learned_positions_offset
            self.embed_positions = VocabParallelEmbedding(positions, cfg.hidden_size, tp)
        layer_cls = (
            SandwichDecoderLayer
            if cfg.sandwich_norms
            else ParallelDecoderLayer
            if cfg.parallel_block
            else PostNormDecoderLayer
            if cfg.post_norm
            else DecoderLayer
        )
        self.layers = DecoderLayers(layer_cls(cfg, i, tp, kernels, expert_parallel) for i in range(cfg.num_layers))
        self.norm = None if cfg.post_norm else make_norm(cfg, cfg.hidden_size, kernels)
        self.lm_head = ParallelLMHead(self.embed_tokens, cfg.tie_word_embeddings, tp, kernels, cfg.lm_head_bias)
        self.register_buffer("cos_sin", rope_table(cfg, cfg.rope_theta), persistent=False)
        if cfg.local_rope_theta is not None:
            self.register_buffer("cos_sin_local", rope_table(cfg, cfg.local_rope_theta, local=True), persistent=False)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        """input_ids, positions (tokens,) -> final hidden states (tokens, hidden)."""
        x, residual = self.embed_tokens(input_ids), None
        if self.config.embedding_dim:
            x = self.project_in(x)
        if self.config.embed_scale != 1.0:  # Gemma: the scale rounded to the activations' dtype, as HF does
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        if self.config.learned_positions_offset is not None:  # OPT
            x = x + self.embed_positions(positions + self.config.learned_positions_offset)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            cos_sin = self.cos_sin_local if layer.self_attn.local_rope else self.cos_sin
            x, residual = layer(x, residual, positions, cos_sin, meta, k_cache, v_cache)
        if self.norm is not None:
            x = self.norm(x, residual)[0]
        return self.project_out(x) if self.config.embedding_dim else x

    def quantize(self, per_channel: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
        """`--quantization int8|fp8`: every decoder layer's linear weights quantized with per-channel scales
        (ParallelLinear.quantize), before packing, and MoE experts where the kernels have a quantized MoE for them (the
        CPU's int8; FusedExperts.quantize). The LM head (and the embedding it may share) stay in --dtype, as vLLM keeps
        them; so does the router."""
        for module in self.layers.modules():
            if isinstance(module, ParallelLinear | FusedExperts):
                module.quantize(per_channel)

    def pack_weights(self) -> None:
        """Packs every linear layer's weight once, in the form the kernels' linear reads fastest (if any), then
        offers each layer whole to the kernels (DecoderLayer.fuse)."""
        for module in self.modules():
            if (pack := getattr(module, "pack", None)) is not None:
                pack()
        for layer in self.layers:
            if isinstance(layer, DecoderLayer):
                layer.fuse()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(rows, vocab) in the model's dtype: the sampler widens only rows it samples."""
        logits = self.lm_head(hidden)
        cap = self.config.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    @torch.no_grad()
    def init_random_weights(self, seed: int = DUMMY_SEED) -> None:
        """load_format "dummy": random weights written in place where the parameters already live (the target
        device), so nothing is read and nothing crosses from the CPU. Norm weights are ones, as a trained model's
        roughly are; every other weight is N(0, DUMMY_STD). Seeded, so every start builds the same model; each
        tensor-parallel rank draws its own shards, so the weights differ with --tp."""
        norms = {id(m.weight) for m in self.modules() if isinstance(m, RMSNorm | LayerNorm)}
        generator = None
        for param in self.parameters():  # a tied LM head is the embedding, drawn once
            if generator is None or generator.device != param.device:
                generator = torch.Generator(param.device).manual_seed(seed)
            if id(param) in norms:
                param.fill_(1.0)
            else:
                param.normal_(0.0, DUMMY_STD, generator=generator)

    @torch.no_grad()
    def init_random_int4(self, group_size: int, seed: int = DUMMY_SEED) -> None:
        """load_format "dummy" of an AWQ/GPTQ config: each decoder layer's projections random int4 in place of their
        float weights (kernels/int4.py's random_int4, values spread as N(0, DUMMY_STD)), so the layers hold and read
        what the checkpoint's would. After init_random_weights, before pack_weights."""
        generator = None
        for layer in self.layers:
            for module in layer.modules():
                if not isinstance(module, ParallelLinear) or module.weight is None:
                    continue
                if module.in_features % group_size:
                    continue  # a checkpoint could not group it either: it stays float
                device = module.weight.device
                if generator is None or generator.device != device:
                    generator = torch.Generator(device).manual_seed(seed)
                rows = random_int4(module.out_features, module.in_features, group_size, DUMMY_STD, generator, device)
                module.quantized = [(0, rows)]

    def fused_parts(self, leaf: str, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """A checkpoint's fused tensor (rows first) as our parts: q, k, v or gate, up, each whole (every rank
        then takes its own shard of each part)."""
        layout, cfg = self.config.qkv_layout, self.config
        if leaf != "qkv_proj" or layout == "concat":
            return list(tensor.split(sizes))
        d = cfg.head_dim
        if layout == "grouped":  # (kv_heads, queries per group + 2, head_dim, ...)
            grouped = tensor.unflatten(0, (cfg.num_kv_heads, -1, d))
            return [grouped[:, :-2].flatten(0, 2), grouped[:, -2].flatten(0, 1), grouped[:, -1].flatten(0, 1)]
        interleaved = tensor.unflatten(0, (cfg.num_heads, 3, d))  # (heads, q k v, head_dim, ...)
        return [interleaved[:, i].flatten(0, 1) for i in range(3)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor | Int4Tensor]]) -> None:
        """Loads Hugging Face tensor names; each layer takes its own shard."""
        fused = FUSED
        modules: dict[str, Any] = dict(self.named_modules())  # called by what each one is: load, parts, ...
        seen = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            for theirs, ours in self.config.renames:
                name = name.replace(theirs, ours)
            if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            expert = EXPERT_TENSOR.match(name)
            if expert is not None:  # one expert's projection: a slice of the layer's fused experts (or none of it)
                module_name = expert["module"]
                if not isinstance(modules.get(module_name), FusedExperts):
                    raise ValueError(f"unexpected tensor {name!r} in the checkpoint")
                for part in modules[module_name].load_expert(int(expert["expert"]), expert["proj"], tensor):
                    seen.add((module_name, "weight", part))
                continue
            module_name, _, param = name.rpartition(".")
            prefix, _, leaf = module_name.rpartition(".")
            parts = [(0, tensor)]
            if leaf in fused:
                leaf, part = fused[leaf]
                module_name, parts = f"{prefix}.{leaf}", [(part, tensor)]
            elif leaf in ("qkv_proj", "gate_up_proj"):  # fused in the checkpoint too (Phi-3, Falcon): split by part
                assert isinstance(tensor, torch.Tensor), "only safetensors fuse them (iter_gguf names llama's parts)"
                parts = list(enumerate(self.fused_parts(leaf, tensor, modules[module_name].parts)))
            if module_name not in modules:
                raise ValueError(f"unexpected tensor {name!r} in the checkpoint")
            if isinstance(modules[module_name], FusedExperts):  # transformers 5's experts, fused in one tensor each
                seen.update((module_name, "weight", p) for p in modules[module_name].load(param, tensor))
                continue
            for part, piece in parts:
                modules[module_name].load(param, piece, part)
                seen.add((module_name, param, part))
        tied_head = self.lm_head if self.config.tie_word_embeddings else None
        expected = sum(
            len(getattr(m, "local_parts", [0])) for m in modules.values() if hasattr(m, "load") and m is not tied_head
        )
        loaded_weights = {s for s in seen if s[1] == "weight"}
        if len(loaded_weights) != expected:
            raise ValueError(f"checkpoint is incomplete: {len(loaded_weights)} of {expected} weight tensors found")
