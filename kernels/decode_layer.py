"""A decoder layer's decode step in one C call (kernels/csrc/decode_layer.c): Llama's pre-norm layer over GGUF blocks
with bfloat16 activations, for a batch of decode rows; or with float32 ones where the layers round float32 decode rows
to int8 (QuantLinear.float32_int8: a CPU without bfloat16 arithmetic, Zen 3, where the layer's Python cost the most).

The model offers each layer's parts once, after packing (`DecodeLayerParts`); a backend's `fuse_decode_layer` answers
with a `FusedDecodeLayer` where the whole layer fits the C kernel, else None (the layer runs module by module, as on
every other path). The C kernel calls the same kernels as that path, in the same order, so the results are the same
bits: what it removes is the Python between them, about as long as the weights' reads in a small model's decode
step. From AMX_INT8_MIN_ROWS decode rows (its `amx_rows`, to its `max_rows`: `decode_rows`) the C layer's
projections in 32-value types take int8 activations on AMX-INT8 tiles, where the module path, which cannot tell decode
rows from prompt rows, runs VNNI's loop to INT8_MAX_ROWS rows and a bfloat16 GEMM past them: for those batches the
results are the fused layer's own. A call returns None for a batch it does not take
(prompt rows, more rows than a decode batch, another dtype), and the layer runs module by module."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import clib
from .attention import AttentionMetadata
from .quant import AMX_INT8_MAX_ROWS, AMX_INT8_MIN_ROWS, AMX_INT8_TYPES, INT8_MAX_ROWS, QuantLinear, amx_int8_kernel


@dataclass(frozen=True)
class DecodeLayerParts:
    """What a pre-norm layer (RMSNorm, q/k/v, rotary, attention, o, RMSNorm, SiLU(gate) * up, down) is made of, on
    one rank, with no bias, LoRA, window or soft-capping (the model offers only such layers)."""

    input_norm: torch.Tensor  # (hidden,) RMSNorm weight
    post_norm: torch.Tensor  # (hidden,)
    eps: float
    qkv: object  # each projection's packed form, as the backend's pack_* made it
    o: object
    gate_up: object  # gate rows, then up rows
    down: object
    heads: int
    kv_heads: int
    head_dim: int
    scale: float  # the attention's score scale


@dataclass(frozen=True)
class FusedDecodeLayer:
    parts: DecodeLayerParts
    library: clib.CLibrary
    weights: tuple  # the C call's per-layer arguments, from input_norm to head_dim
    max_rows: int = INT8_MAX_ROWS  # the most decode rows it takes (decode_rows(its types) where it is made)
    amx_rows: int = 0  # the fewest rows whose 32-value projections take AMX-INT8 tiles (amx_rows()); 0: never
    dtype: torch.dtype = torch.bfloat16  # the activations', norms' and caches' (float32: decode_layer_q8_f32)

    def __call__(
        self, x, residual, positions, cos_sin, meta: AttentionMetadata, k_cache, v_cache
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the layer's output, the residual stream after attention), as DecoderLayer.forward returns them (residual
        None in the first layer); None for a batch this path does not take."""
        rows, hidden = x.shape
        if not (
            0 < rows <= self.max_rows
            and meta.num_decodes == rows == len(meta.seq_lens_host)
            and x.dtype == k_cache.dtype == v_cache.dtype == self.dtype
            and x.is_contiguous()
            and (
                residual is None
                or (residual.dtype == x.dtype and residual.is_contiguous() and residual.shape == x.shape)
            )
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and cos_sin.dtype == torch.float32
            and cos_sin.is_contiguous()
            and cos_sin.shape[1] == self.parts.head_dim
        ):
            return None
        step = meta.workspace.get("decode_layer")
        if step is None:  # the step's index tensors in the kernels' types, once for every layer
            step = meta.workspace["decode_layer"] = (
                positions.to(torch.int64).contiguous(),
                meta.slot_mapping.to(torch.int64).contiguous(),
                meta.block_tables.to(torch.int32).contiguous(),
                meta.seq_lens.to(torch.int32).contiguous(),
            )
        positions, slots, tables, lens = step
        out, residual_out = torch.empty_like(x), torch.empty_like(x)
        run = self.library.decode_layer_q8_bf16 if self.dtype == torch.bfloat16 else self.library.decode_layer_q8_f32
        status = run(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            out.data_ptr(),
            residual_out.data_ptr(),
            rows,
            hidden,
            *self.weights,
            self.parts.scale,
            cos_sin.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            k_cache.shape[1],
            tables.shape[1],
            self.amx_rows,
            torch.get_num_threads(),
        )
        return (out, residual_out) if status == 0 else None


def decode_rows(qtypes: set[int]) -> int:
    """The most decode rows the fused layer of projections in these ggml types takes: AMX_INT8_MAX_ROWS where its
    linear layers have AMX-INT8 past INT8_MAX_ROWS rows (csrc/decode_layer.c; 32-value types only), else
    INT8_MAX_ROWS (VNNI's loop, whose cost grows with every row)."""
    return AMX_INT8_MAX_ROWS if amx_int8_kernel() is not None and qtypes <= AMX_INT8_TYPES else INT8_MAX_ROWS


def amx_rows() -> int:
    """The fewest decode rows whose projections in 32-value types the fused layer runs on AMX-INT8 tiles
    (AMX_INT8_MIN_ROWS where the process may use them), else 0: VNNI's loop for every batch."""
    return AMX_INT8_MIN_ROWS if amx_int8_kernel() is not None else 0


def fuse_decode_layer_cpu(parts: DecodeLayerParts) -> FusedDecodeLayer | None:
    """The fused decode step of a layer whose projections are all GGUF blocks the int8-activation kernel reads (one
    slab each, or two for q/k/v: K-quant mixes give v another type) and whose norms are bfloat16, or float32 with
    projections that round float32 decode rows (as the module path then does), where this CPU runs the kernels it
    calls; else None."""
    library = clib.get_library()
    dtype = parts.input_norm.dtype
    if library is None or not library.linear_q8_available():
        return None
    if not (library.elementwise_available() if dtype == torch.bfloat16 else library.elementwise_f32_available()):
        return None
    qkv, o, gate_up, down = parts.qkv, parts.o, parts.gate_up, parts.down
    if not (
        isinstance(qkv, QuantLinear)
        and isinstance(o, QuantLinear)
        and isinstance(gate_up, QuantLinear)
        and isinstance(down, QuantLinear)
    ):
        return None
    projections = (qkv, o, gate_up, down)
    if not all(p.int8 and p.perm is None and (dtype == torch.bfloat16 or p.float32_int8) for p in projections):
        return None
    if len(qkv.calls) > 2 or any(len(p.calls) != 1 for p in (o, gate_up, down)):
        return None
    hidden = o.out_features
    q_width = parts.heads * parts.head_dim
    intermediate = down.in_features
    shapes_fit = (
        qkv.out_features == q_width + 2 * parts.kv_heads * parts.head_dim
        and qkv.in_features == gate_up.in_features == down.out_features == hidden
        and o.in_features == q_width
        and gate_up.out_features == 2 * intermediate
        and parts.head_dim % 2 == 0
    )
    norms_fit = dtype in (torch.bfloat16, torch.float32) and all(
        w.dtype == dtype and w.is_contiguous() and w.shape == (hidden,) for w in (parts.input_norm, parts.post_norm)
    )
    if not (shapes_fit and norms_fit):
        return None
    qkv_call, o_call, gate_up_call, down_call = (p.calls[0] for p in projections)
    # q/k/v's second slab, or its only one again (then not read: qkv_call.rows is all rows)
    rest = max(qkv.calls, key=lambda call: call.start)
    weights = (
        parts.input_norm.data_ptr(),
        parts.post_norm.data_ptr(),
        parts.eps,
        *(qkv_call.weight, qkv_call.weight_stride, qkv_call.qtype, qkv_call.rows),
        *(rest.weight, rest.weight_stride, rest.qtype),
        *(o_call.weight, o_call.weight_stride, o_call.qtype),
        *(gate_up_call.weight, gate_up_call.weight_stride, gate_up_call.qtype),
        *(down_call.weight, down_call.weight_stride, down_call.qtype),
        intermediate,
        parts.heads,
        parts.kv_heads,
        parts.head_dim,
    )
    if dtype == torch.float32:  # int8 activations on VNNI's or AVX2's loop to INT8_MAX_ROWS, no AMX path
        return FusedDecodeLayer(parts, library, weights, INT8_MAX_ROWS, 0, dtype)
    qtypes = {call.qtype for p in projections for call in p.calls}
    return FusedDecodeLayer(parts, library, weights, decode_rows(qtypes), amx_rows(), dtype)
