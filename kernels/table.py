"""The table of kernels the model and the sampler call, and its torch instance that runs anywhere.

A backend (kernels/cpu.py, kernels/triton_kernels.py) is one `Kernels` value; the layers hold it and call only its
fields, so which code runs is decided once, at start-up (`kernels.select_kernels`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .attention import paged_attention
from .dense import argmax, linear, no_packing
from .fp8 import pack_fp8
from .lora import lora_sgmv
from .moe import fused_moe, pack_experts
from .norm import add_layer_norm, add_rms_norm, gelu_tanh_mul, layer_norm, rms_norm, silu_mul
from .rotary import rotary_write_kv


class Packed(Protocol):
    """What a layer may ask of a packed weight; the rest of it is private to the backend that made it."""

    @property
    def holds_weight(self) -> bool:
        """The packed form alone computes the layer: the layer may drop its plain weight and pass None for it."""
        ...


@dataclass(frozen=True)
class Kernels:
    name: str
    # (q, k, v, cos_sin, positions, k_cache, v_cache, slot_mapping) -> rotated q; writes rotated k and v to the cache
    rotary_write_kv: Callable[..., torch.Tensor]
    # (q, k_cache, v_cache, AttentionMetadata, scale, window=0, softcap=0.0) -> (tokens, heads, head_dim); window:
    # each query attends to its last `window` positions only (0: all); softcap: scores -> softcap * tanh(scores /
    # softcap) before the softmax (0: off)
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]  # (x, weight, eps)
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (x, residual, weight, eps) -> (normed, sum)
    layer_norm: Callable[..., torch.Tensor]  # (x, weight, bias or None, eps)
    add_layer_norm: Callable[
        ..., tuple[torch.Tensor, torch.Tensor]
    ]  # (x, residual, weight, bias, eps) -> (normed, sum)
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    gelu_tanh_mul: Callable[[torch.Tensor], torch.Tensor]  # GeGLU: GELU(gate, tanh) * up, silu_mul's contract
    # A weight (out_features, in_features) in the form this backend's `linear` reads fastest, packed once at load;
    # None where the plain weight serves.
    pack_linear: Callable[[torch.Tensor], Packed | None]
    # (x, weight or None (packed.holds_weight), bias or None, packed or None) -> x W^T + bias
    linear: Callable[..., torch.Tensor]
    # The MLP's gate/up weight [Wg; Wu] (2 intermediate, hidden) packed once, in a form linear_silu_mul may read
    # fused; None where the plain weight serves.
    pack_gate_up: Callable[[torch.Tensor], Packed | None]
    # (x, weight or None (packed.holds_weight), packed or None) -> SiLU(x Wg^T) * (x Wu^T), (tokens, intermediate)
    linear_silu_mul: Callable[..., torch.Tensor]
    # A layer's quantized weight, [(first output row, QuantizedTensor | Int4Tensor | Fp8Tensor)] covering its
    # out_features rows (a GGUF block type, AWQ/GPTQ int4, fp8 made at load), packed once at load for this backend's
    # kernel of that format (kernels/quant.py, int4.py, triton_int4.py, fp8.py); None where it has none, and the
    # layer dequantizes. `linear` and `linear_silu_mul` read what this returns.
    pack_quantized: Callable[[list, int], Packed | None]
    # A mixture-of-experts layer's weights, w13 (experts, 2 intermediate, hidden) (gate rows, then up rows) and w2
    # (experts, hidden, intermediate), packed once at load for this backend's fused_moe; None where the plain ones serve
    pack_experts: Callable[[torch.Tensor, torch.Tensor], Packed | None]
    # (x, w13 or None, w2 or None (packed.holds_weight), packed or None, moe.Routing) -> (tokens, hidden): each
    # token's experts' SiLU-gated MLPs weighted and summed, in one call (kernels/moe.py holds the contract)
    fused_moe: Callable[..., torch.Tensor]
    # logits (rows, vocab) -> the index of each row's maximum, the first of equal maxima (greedy sampling)
    argmax: Callable[[torch.Tensor], list[int]]
    # (y, x, a, b, LoraSegments, ranks) -> None: adds each segment's LoRA delta to its rows of y in place
    # (kernels/lora.py holds the contract)
    lora_sgmv: Callable[..., None] = lora_sgmv
    # A mixture of experts quantized at load (--quantization int8) or shipped quantized (a GGUF's blocks): per expert
    # its gate/up rows and its down rows, each a list of parts (first row, QuantizedTensor), packed once for this
    # backend's fused_moe, or None where it has no kernel for those rows. None on a backend without quantized experts:
    # they are not quantized (or are dequantized) and stay in --dtype.
    pack_quantized_experts: Callable[[list, list], Packed | None] | None = None
    # The forward pass reads no per-step value from the host (no Python-side lengths, shapes fixed by the batch
    # size), so a CUDA graph captured once replays it correctly for any batch of that size.
    graph_safe: bool = False
    # (query_start_host, max_query_len, heads, kv_heads, head_dim, dtype) -> (AttentionMetadata.workspace key, ints)
    # or None: a per-step table paged_attention would otherwise build on the host and copy to the device in its
    # first layer, for the model runner to send in the step's one copy instead (the Triton tile map)
    attention_plan: Callable[..., tuple[tuple, list[int]] | None] = lambda *args: None
    # (decode_layer.DecodeLayerParts) -> a callable running the whole pre-norm layer for a decode batch (its forward's
    # arguments and results; None for a batch it does not take), or None where this backend has no such kernel
    fuse_decode_layer: Callable[..., Callable | None] = lambda parts: None


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, packed: None = None) -> torch.Tensor:
    """SiLU(gate) * up from the gate/up projection, as two passes: the product, then silu_mul."""
    return silu_mul(linear(x, weight, None, packed))


TORCH_KERNELS = Kernels(
    name="torch",
    rotary_write_kv=rotary_write_kv,
    paged_attention=paged_attention,
    rms_norm=rms_norm,
    add_rms_norm=add_rms_norm,
    layer_norm=layer_norm,
    add_layer_norm=add_layer_norm,
    silu_mul=silu_mul,
    gelu_tanh_mul=gelu_tanh_mul,
    pack_linear=no_packing,
    linear=linear,
    pack_gate_up=no_packing,
    linear_silu_mul=linear_silu_mul,
    pack_quantized=pack_fp8,  # --quantization fp8 (torch's scaled matmul); any other format is dequantized
    pack_experts=pack_experts,
    fused_moe=fused_moe,
    argmax=argmax,
)
