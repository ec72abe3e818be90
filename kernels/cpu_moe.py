"""The CPU backend's mixture-of-experts layer: float32 experts packed once at load into csrc/linear_f32.c's panels and
run by csrc/moe.c in one call per layer (grouping, every expert with tokens, the weighted sum); bfloat16 experts
packed as dense bfloat16 layers are (packed_bf16.PackedLinear) and run by csrc/moe_bf16.c in one call per layer, on
the dense layers' own GEMM: the matrix engine's tiles on a CPU with AMX (Intel Xeon), vdpbf16ps on one with AVX-512
BF16 and no AMX (AMD Zen 4, Zen 5). Elsewhere bfloat16 experts are reordered once at load into oneDNN's blocked
layout and run expert by expert (those with tokens) through oneDNN (F.linear would reorder each weight on every
call), and kernels/moe.py's torch reference serves what no kernel takes.

Experts quantized at load (`--quantization int8`, Q8_0 blocks) or shipped quantized (a GGUF's blocks) are packed as
dense quantized layers are (quant.QuantLinear) and run, those with tokens, through the dense layers' quantized
kernels: in one call per layer by csrc/moe_quant.c for float32 and for bfloat16 experts of fewer rows than the
bfloat16 GEMM takes (a decode step's), else expert by expert from Python. Each token's result is what those kernels
give it alone; a decode step reads about half of bfloat16's bytes per expert (int8), a quarter to a third (Q4/Q5)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import clib, moe, quant
from .norm import silu_mul
from .packed_bf16 import PackedLinear


@functools.cache
def _moe_f32() -> clib.CLibrary | None:
    """The library where its float32 MoE kernel runs on this CPU (AVX-512, or AVX2 with FMA), else None."""
    library = clib.get_library()
    return library if library is not None and library.moe_f32_available() else None


@functools.cache
def _moe_bf16() -> Callable[..., int] | None:
    """csrc/moe_bf16.c's entry point for the GEMM engine the dense bfloat16 layers use on this CPU (kernels/cpu.py
    _packed_bf16_kernel): the matrix engine where the CPU has AMX and the process may use it, else vdpbf16ps, else
    None. The same choice as the dense layers' keeps a token's expert output that path's bits."""
    library = clib.get_library()
    if library is None:
        return None
    if library.moe_amx_bf16_available():
        return library.moe_amx_bf16
    return library.moe_dpbf16 if library.moe_dpbf16_available() else None


@dataclass(frozen=True)
class PackedExperts:
    """A layer's experts in csrc/moe.c's order, packed once at load: expert e's gate/up as pack_f32_gate_up packs a
    dense MLP's (panel p, step c, lane j < 16: gate row 16 p + j, lane 16 + j: that up row), its down as pack_f32
    packs a dense weight (lane j of panel p: row 32 p + j); rows padded with zeros."""

    w13: torch.Tensor  # (experts, ceil(intermediate / 16), hidden, 32)
    w2: torch.Tensor  # (experts, ceil(hidden / 32), intermediate, 32)
    hidden: int
    intermediate: int

    @property
    def holds_weight(self) -> bool:
        """Every input the kernel declines goes to the reference with the weights unpacked."""
        return True

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """w13 (experts, 2 intermediate, hidden) and w2 (experts, hidden, intermediate) again."""
        experts, inter, hidden = self.w13.shape[0], self.intermediate, self.hidden
        rows = self.w13.permute(0, 1, 3, 2)  # (experts, panels, 32, hidden)
        gate, up = (half.reshape(experts, -1, hidden)[:, :inter] for half in rows.split(16, dim=2))
        w2 = self.w2.permute(0, 1, 3, 2).reshape(experts, -1, inter)[:, :hidden]
        return torch.cat([gate, up], dim=1), w2


def pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> PackedExperts | PackedBf16Experts | OneDnnExperts | None:
    """float32 experts packed for the MoE kernel, bfloat16 ones for csrc/moe_bf16.c or else oneDNN, or None where
    none runs (no compiler, a CPU without AVX-512 or AVX2 or bf16 support, shapes that do not fit together): the
    reference reads the plain weights there."""
    if w13.dtype == torch.bfloat16:
        return pack_bf16(w13, w2) or pack_onednn(w13, w2)
    if (
        _moe_f32() is None
        or not (w13.dtype == w2.dtype == torch.float32)
        or not (w13.device.type == w2.device.type == "cpu")
        or w13.dim() != 3
        or w2.dim() != 3
    ):
        return None
    experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if two_inter % 2 or w2.shape != (experts, hidden, inter) or not (experts and inter and hidden):
        return None
    gate, up = (F.pad(half, (0, 0, 0, -inter % 16)) for half in w13.detach().chunk(2, dim=1))
    pairs = torch.stack([gate.view(experts, -1, 16, hidden), up.view(experts, -1, 16, hidden)], dim=2)
    packed13 = pairs.flatten(2, 3).permute(0, 1, 3, 2).contiguous()
    down = F.pad(w2.detach(), (0, 0, 0, -hidden % 32)).view(experts, -1, 32, inter)
    return PackedExperts(packed13, down.permute(0, 1, 3, 2).contiguous(), hidden, inter)


@dataclass(frozen=True)
class PackedBf16Experts:
    """A layer's bfloat16 experts packed once at load for csrc/moe_bf16.c (both engines read one tile order): each
    expert's gate/up weight (gate rows, then up rows) and its down weight in a dense layer's PackedLinear tiles,
    stacked by expert."""

    w13: torch.Tensor  # (experts, 2 intermediate / 16, hidden / 32, 16, 16, 2)
    w2: torch.Tensor  # (experts, ceil(hidden / 16), intermediate / 32, 16, 16, 2)
    hidden: int
    intermediate: int

    @property
    def holds_weight(self) -> bool:
        return True

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """w13 (experts, 2 intermediate, hidden) and w2 (experts, hidden, intermediate) again."""
        hidden, inter = self.hidden, self.intermediate
        w13 = torch.stack([PackedLinear(t, 2 * inter, hidden).unpacked() for t in self.w13])
        return w13, torch.stack([PackedLinear(t, hidden, inter).unpacked() for t in self.w2])


def pack_bf16(w13: torch.Tensor, w2: torch.Tensor) -> PackedBf16Experts | None:
    """bfloat16 experts packed for csrc/moe_bf16.c, or None where it does not run (module docstring) or the shapes do
    not fit it (hidden and intermediate multiples of 32)."""
    if _moe_bf16() is None or not (w13.dtype == w2.dtype == torch.bfloat16 and w13.is_cpu and w2.is_cpu):
        return None
    if w13.dim() != 3 or w2.dim() != 3:
        return None
    experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if two_inter % 2 or w2.shape != (experts, hidden, inter) or hidden % 32 or inter % 32 or not (experts and inter):
        return None
    w13, w2 = w13.detach(), w2.detach()
    return PackedBf16Experts(
        torch.stack([PackedLinear.of(w).tiles for w in w13]),
        torch.stack([PackedLinear.of(w).tiles for w in w2]),
        hidden,
        inter,
    )


@dataclass(frozen=True)
class OneDnnExperts:
    """bfloat16 experts, each weight reordered once at load for oneDNN's linear (the plain weights are dropped)."""

    w13: tuple[torch.Tensor, ...]  # per expert, gate/up (2 intermediate, hidden) in oneDNN's layout
    w2: tuple[torch.Tensor, ...]  # per expert, down (hidden, intermediate)

    @property
    def holds_weight(self) -> bool:
        return True


def _onednn_bf16() -> bool:
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_onednn(w13: torch.Tensor, w2: torch.Tensor) -> OneDnnExperts | None:
    if not (w13.dtype == w2.dtype == torch.bfloat16 and w13.is_cpu and w2.is_cpu and _onednn_bf16()):
        return None
    # 512 rows: the size hint oneDNN tunes the layout for, as the dense layers' (a full SplitFuse budget)
    reorder = torch.ops.mkldnn._reorder_linear_weight
    return OneDnnExperts(*(tuple(reorder(w.contiguous(), 512) for w in ws.detach()) for ws in (w13, w2)))


def _onednn_moe(x: torch.Tensor, packed: OneDnnExperts, routing: moe.Routing) -> torch.Tensor:
    linear = torch.ops.mkldnn._linear_pointwise

    def mlp(e: int, xs: torch.Tensor) -> torch.Tensor:
        return linear(silu_mul(linear(xs, packed.w13[e], None, "none", [], "")), packed.w2[e], None, "none", [], "")

    return moe.per_expert(x.to(torch.bfloat16), routing, len(packed.w13), mlp).to(x.dtype)


# int64s per expert in csrc/moe_quant.c's table: the number of gate/up slabs, whether gate/up and down take int8
# activations (QuantLinear.int8), two gate/up slabs, the down slab, each (address of its blocks, bytes per row, first
# output row, rows, ggml type) as quant.SlabCall holds them
SLAB_FIELDS, GATE_UP_SLABS, HEAD_FIELDS = 5, 2, 3
MOE_QUANT_WIDTH = HEAD_FIELDS + SLAB_FIELDS * (GATE_UP_SLABS + 1)


@dataclass(frozen=True)
class QuantExperts:
    """A layer's experts quantized at load or shipped quantized, each weight packed as a dense quantized layer's (its
    gate/up rows, gate then up; its down rows), and their slabs as csrc/moe_quant.c's table (None where an expert's
    slabs do not fit it: the Python loop serves)."""

    w13: tuple[quant.QuantLinear, ...]  # per expert, (2 intermediate, hidden)
    w2: tuple[quant.QuantLinear, ...]  # per expert, (hidden, intermediate)
    table: torch.Tensor | None  # (experts, MOE_QUANT_WIDTH) int64, addresses into w13's and w2's blocks

    @property
    def holds_weight(self) -> bool:
        return True


def slab_table(w13: list[quant.QuantLinear], w2: list[quant.QuantLinear]) -> torch.Tensor | None:
    """csrc/moe_quant.c's table of the experts' slabs, or None where one has more than it takes."""
    rows = []
    for gate_up, down in zip(w13, w2):
        if len(gate_up.calls) > GATE_UP_SLABS or len(down.calls) != 1:
            return None
        slabs = list(gate_up.calls) + [gate_up.calls[0]] * (GATE_UP_SLABS - len(gate_up.calls)) + list(down.calls)
        fields = [f for c in slabs for f in (c.weight, c.weight_stride, c.start, c.rows, c.qtype)]
        rows.append([len(gate_up.calls), int(gate_up.int8), int(down.int8), *fields])
    return torch.tensor(rows, dtype=torch.int64)


def pack_quantized_experts(w13: list, w2: list) -> QuantExperts | None:
    """Per expert its quantized gate/up and down rows, each a list of parts (first row, QuantizedTensor), packed for
    the quantized kernels, or None where this CPU has no kernel for one of them (the experts then stay in --dtype)."""

    def pack(parts: list) -> quant.QuantLinear | None:
        return quant.pack_quantized(parts, sum(w.shape[0] for _, w in parts))

    gate_up = [pack(parts) for parts in w13]
    down = [pack(parts) for parts in w2]
    if not gate_up or any(p is None for p in gate_up + down):
        return None
    packed: list[quant.QuantLinear] = gate_up + down  # type: ignore[assignment]
    gate_up, down = packed[: len(w13)], packed[len(w13) :]
    return QuantExperts(tuple(gate_up), tuple(down), slab_table(gate_up, down))


@functools.cache
def _moe_quant() -> clib.CLibrary | None:
    """The library where csrc/moe_quant.c runs for float32 or bfloat16 here (its SiLU kernel built), else None."""
    library = clib.get_library()
    return (
        library if library is not None and (library.moe_quant_available(0) or library.moe_quant_available(1)) else None
    )


def _quant_moe(x: torch.Tensor, packed: QuantExperts, routing: moe.Routing) -> torch.Tensor:
    y = _quant_moe_kernel(x, packed, routing)
    if y is not None:
        return y

    def mlp(e: int, xs: torch.Tensor) -> torch.Tensor:
        return quant.quant_linear(silu_mul(quant.quant_linear(xs, packed.w13[e], None)), packed.w2[e], None)

    return moe.per_expert(x, routing, len(packed.w13), mlp)


def _quant_moe_kernel(x: torch.Tensor, packed: QuantExperts, routing: moe.Routing) -> torch.Tensor | None:
    """csrc/moe_quant.c's one call: None where it declines (bfloat16 experts of a GEMM's rows, a CPU without the
    elementwise kernels, a table it cannot take), and the loop serves."""
    library = _moe_quant()
    ids, weights = routing.ids, routing.weights
    if (
        library is None
        or packed.table is None
        or x.dtype not in (torch.float32, torch.bfloat16)
        or not x.is_cpu
        or x.dim() != 2
        or x.stride(1) != 1
        or x.shape[0] == 0
        or ids.shape != weights.shape
        or ids.dim() != 2
        or ids.shape[0] != x.shape[0]
    ):
        return None
    tokens, k = ids.shape
    hidden, inter = packed.w2[0].out_features, packed.w2[0].in_features
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    y = torch.empty((tokens, hidden), dtype=x.dtype)
    bf16 = x.dtype == torch.bfloat16
    status = library.moe_quant(
        x.data_ptr(),
        int(bf16),
        x.stride(0) if tokens > 1 else hidden,
        packed.table.data_ptr(),
        ids.data_ptr(),
        weights.data_ptr(),
        y.data_ptr(),
        tokens,
        k,
        len(packed.w13),
        hidden,
        inter,
        quant.bf16_gemm_rows() or 0,
        torch.get_num_threads(),
    )
    if status < 0:
        raise RuntimeError("the quantized experts' kernel declined its arguments")
    return y if status == 0 else None


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor | None,
    w2: torch.Tensor | None,
    packed: PackedExperts | None,
    routing: moe.Routing,
) -> torch.Tensor:
    """Same contract as moe.fused_moe (w13 and w2 may be None: packed.holds_weight): float32 through csrc/moe.c and
    bfloat16 through csrc/moe_bf16.c, each token's result bit for bit the dense path's (float32's; the matrix engine's
    or vdpbf16ps's) on its own; anything else through the reference."""
    if isinstance(packed, OneDnnExperts):
        return _onednn_moe(x, packed, routing)
    if isinstance(packed, QuantExperts):
        return _quant_moe(x, packed, routing)
    if isinstance(packed, PackedExperts | PackedBf16Experts):
        y = _moe_kernel(x, packed, routing)
        if y is not None:
            return y
        if w13 is None or w2 is None:
            w13, w2 = packed.unpacked()
    assert w13 is not None and w2 is not None, "w13 and w2 are None only beside packed experts that hold them"
    return moe.fused_moe(x, w13, w2, None, routing)


def _moe_kernel(
    x: torch.Tensor, packed: PackedExperts | PackedBf16Experts, routing: moe.Routing
) -> torch.Tensor | None:
    ids, weights = routing.ids, routing.weights
    dtype = torch.float32 if isinstance(packed, PackedExperts) else torch.bfloat16
    if (
        x.dtype != dtype
        or not x.is_cpu
        or x.dim() != 2
        or x.stride(1) != 1
        or x.shape[0] == 0
        or x.shape[1] != packed.hidden
        or ids.dim() != 2
        or ids.shape != weights.shape
        or ids.shape[0] != x.shape[0]
    ):
        return None
    tokens, k = ids.shape
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    y = torch.empty((tokens, packed.hidden), dtype=dtype)
    library = _moe_f32()
    kernel = library.moe_f32 if dtype == torch.float32 and library is not None else _moe_bf16()
    assert kernel is not None, "packed experts are made only where their MoE kernel runs (pack_experts)"
    status = kernel(
        x.data_ptr(),
        x.stride(0) if tokens > 1 else packed.hidden,  # a single row's stride is whatever torch chose: unused
        packed.w13.data_ptr(),
        packed.w2.data_ptr(),
        ids.data_ptr(),
        weights.data_ptr(),
        y.data_ptr(),
        tokens,
        k,
        packed.w13.shape[0],
        packed.hidden,
        packed.intermediate,
        torch.get_num_threads(),
    )
    return y if status == 0 else None
