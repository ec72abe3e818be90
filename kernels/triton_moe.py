"""Mixture-of-experts layer as Triton kernels for CUDA (CPU tensors too, under TRITON_INTERPRET=1), in the manner of
vLLM's fused_moe: kernels/moe.py's `fused_moe` contract, in four steps and no host read.

1. `align_block_size`: the (token, slot) pairs sorted by expert, each expert's group padded to a multiple of
   BLOCK_M, so every BLOCK_M tile of the sorted order belongs to one expert. Torch ops on the device; every shape
   depends only on (tokens, k, experts, BLOCK_M), so a captured CUDA graph replays it for any routing.
2. `_gate_up_kernel`: one launch over all experts, a program per (tile of one expert's pairs, BLOCK_N features of
   the intermediate): the gate and up GEMMs side by side, SiLU(gate) * up in the epilogue.
3. `_down_kernel`: one launch, the down GEMM over the same tiles, scaled by each pair's routing weight, written to
   the pair's own row.
4. `_combine_kernel`: each token's k rows summed in slot order, which is ascending expert order.

The grids are sized by the most tiles any routing can need; tiles past the routing's padded total exit at once.
Roundings follow the reference (each GEMM result rounded to the activations' dtype, SiLU and the product each
rounded, the weighted contribution rounded, then the sums), so float32 agrees to the GEMMs' summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .moe import Routing


def pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> None:
    """The kernels read the checkpoint's layout, (experts, out, in) with `in` contiguous: nothing to pack."""
    return None


# ---------------------------------------------------------------------------------------------------------------
# Tile configurations
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# Keyed by the rows an expert gets when the batch's pairs spread evenly, ceil(tokens * k / experts), not by tokens
# alone: 64 tokens are 8 rows an expert for Qwen3-30B-A3B (k 8 of 128) but 16 for Mixtral (k 2 of 8). Every
# expert's group is padded to BLOCK_M, so decode wants the smallest tile tensor cores take (16): a larger one is
# mostly padding, and decode is bound by reading the experts' weights anyway, each tile once. With more rows a
# taller tile reads each weight tile once for more of them, which is what prefill is bound by.
# (largest rows an expert, config); the last one serves every larger batch.
_CONFIGS = (
    (16, MoeConfig(16, 64, 128, num_warps=4, num_stages=3)),
    (64, MoeConfig(32, 64, 64, num_warps=4, num_stages=3)),
    (256, MoeConfig(64, 128, 64, num_warps=4, num_stages=3)),
    (None, MoeConfig(128, 128, 64, num_warps=8, num_stages=3)),
)


def moe_config(tokens: int, k: int, experts: int, dtype: torch.dtype) -> MoeConfig:
    """The tile configuration for a batch of `tokens`: a function of the batch size only (not of the routing), so a
    graph captured for a size always launches the same kernels."""
    rows = -(-tokens * k // max(experts, 1))
    config = next(c for bound, c in _CONFIGS if bound is None or rows <= bound)
    if dtype == torch.float32:  # no tensor cores at full precision: narrower tiles keep registers from spilling
        config = MoeConfig(config.block_m, min(config.block_n, 64), 32, config.num_warps, 2)
    return config


# ---------------------------------------------------------------------------------------------------------------
# Alignment
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Alignment:
    """A routing's (token, slot) pairs (pair p = token * k + slot) sorted by expert, each expert's run padded to a
    multiple of block_m. Experts without pairs and slots computed elsewhere (id == experts) get no tile."""

    sorted_ids: torch.Tensor  # (blocks * block_m,) int32: pairs by expert; padding and unused tail hold tokens * k
    expert_ids: torch.Tensor  # (blocks,) int32: each tile's expert; = experts past the padded total
    total: torch.Tensor  # (1,) int32: the padded pair count, a multiple of block_m
    block_m: int


def max_padded(pairs: int, experts: int, block_m: int) -> int:
    """The most padded pairs any routing gives: at most min(pairs, experts) experts have a pair, and each pads by
    fewer than block_m."""
    return pairs + min(pairs, experts) * (block_m - 1)


def align_block_size(ids: torch.Tensor, experts: int, block_m: int) -> Alignment:
    """Sorts ids (tokens, k)'s pairs by expert on the device, with no host read (graph-safe)."""
    tokens, k = ids.shape
    pairs, device = tokens * k, ids.device
    blocks = -(-max_padded(pairs, experts, block_m) // block_m)
    flat = ids.reshape(-1)  # (pairs,)
    # bincount would size its output by the largest id, read on the host; scatter_add_ does not
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts[:experts] + block_m - 1) // block_m * block_m  # (experts,)
    padded_end = padded.cumsum(0)  # (experts,)
    order = flat.argsort(stable=True)  # (pairs,) grouped by expert, token order within each; id == experts last
    expert_of = flat[order]
    start = counts.cumsum(0) - counts  # (experts + 1,) each expert's first position in `order`
    rank = torch.arange(pairs, device=device) - start[expert_of]  # (pairs,) place within its expert's run
    dest = (padded_end - padded)[expert_of.clamp(max=experts - 1)] + rank
    dest = torch.where(expert_of < experts, dest, blocks * block_m)  # pairs computed elsewhere: a discarded slot
    sorted_ids = torch.full((blocks * block_m + 1,), pairs, dtype=torch.int64, device=device)
    sorted_ids = sorted_ids.scatter_(0, dest, order)[:-1].to(torch.int32)
    # tile b's expert: how many experts' padded runs end at or before its first row (all of them past the total)
    firsts = torch.arange(0, blocks * block_m, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, firsts, right=True, out_int32=True)
    total = padded_end[-1:].to(torch.int32)
    return Alignment(sorted_ids, expert_ids, total, block_m)


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    h_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    total_ptr,
    pairs,
    hidden,
    inter,
    stride_xt,
    stride_we,
    stride_wn,
    stride_hp,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Tiles along axis 0: the programs running together share a feature tile, so an expert's tiles after the
    # first find its weights in L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # (BLOCK_M,)
    row_ok = pair < pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + (pair // TOP_K)[:, None] * stride_xt  # (BLOCK_M, 1); padding rows are masked
    gate_cols = w13_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn  # (1, BLOCK_N)
    up_cols = gate_cols + inter * stride_wn
    acc_gate = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    acc_up = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + kk
        k_ok = k < hidden
        a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        b_mask = k_ok[:, None] & n_ok[None, :]
        b_gate = tl.load(gate_cols + k[:, None], mask=b_mask, other=0.0)  # (BLOCK_K, BLOCK_N)
        b_up = tl.load(up_cols + k[:, None], mask=b_mask, other=0.0)
        acc_gate += tl.dot(a, b_gate, input_precision=PRECISION)
        acc_up += tl.dot(a, b_up, input_precision=PRECISION)
    # rounded where the reference's linear and silu_mul round, each op in the activations' dtype
    dtype = h_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    h = (act * up).to(dtype)
    tl.store(h_ptr + pair[:, None] * stride_hp + n[None, :], h, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr,
    w2_ptr,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    total_ptr,
    pairs,
    hidden,
    inter,
    stride_hp,
    stride_we,
    stride_wn,
    stride_op,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # (BLOCK_M,)
    row_ok = pair < pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    kk = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + pair[:, None] * stride_hp  # (BLOCK_M, 1)
    w_cols = w2_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn  # (1, BLOCK_N)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + kk
        k_ok = k < inter
        a = tl.load(h_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        b = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
        acc += tl.dot(a, b, input_precision=PRECISION)
    # the reference's combine: the expert's output in the activations' dtype times the float32 weight, rounded
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)  # (BLOCK_M,) float32
    out = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    tl.store(out_ptr + pair[:, None] * stride_op + n[None, :], out, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(
    rows_ptr, ids_ptr, out_ptr, hidden, experts, stride_rp, stride_ot, TOP_K: tl.constexpr, BLOCK: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dtype = out_ptr.dtype.element_ty
    # A slot computed elsewhere (id == experts) has no row: it reads as the zero it adds. The test is folded into
    # the column bound because the interpreter turns `block & scalar` masks into int32.
    e = tl.load(ids_ptr + t * TOP_K)
    acc = tl.load(rows_ptr + t * TOP_K * stride_rp + cols, mask=cols < tl.where(e < experts, hidden, 0), other=0.0)
    acc = acc.to(tl.float32)
    # Slots are in ascending expert order: the reference's sum order. (static_range iterates only in the compiler; its
    # Python __iter__ raises, so pyright takes it for not iterable.)
    for slot in tl.static_range(1, TOP_K):  # pyright: ignore[reportGeneralTypeIssues]
        e = tl.load(ids_ptr + t * TOP_K + slot)
        row = rows_ptr + (t * TOP_K + slot) * stride_rp + cols
        v = tl.load(row, mask=cols < tl.where(e < experts, hidden, 0), other=0.0)
        acc = (acc + v.to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, acc.to(dtype), mask=cols < hidden)


# ---------------------------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------------------------


def _contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, packed: object | None, routing: Routing
) -> torch.Tensor:
    """kernels/moe.py's fused_moe: x (tokens, hidden), w13 (experts, 2 intermediate, hidden), w2 (experts, hidden,
    intermediate) -> (tokens, hidden) in x's dtype. `packed` is pack_experts' None."""
    return _fused_moe(x, w13, w2, routing, moe_config(x.shape[0], routing.ids.shape[1], w13.shape[0], x.dtype))


def _fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing, config: MoeConfig):
    x, w13, w2 = (_contiguous_rows(t) for t in (x, w13, w2))
    tokens, hidden = x.shape
    experts, inter = w13.shape[0], w2.shape[2]
    k = routing.ids.shape[1]
    assert w13.shape == (experts, 2 * inter, hidden) and w2.shape == (experts, hidden, inter)
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    pairs = tokens * k
    ids = routing.ids.contiguous()
    weights = routing.weights.float().contiguous()  # (tokens, k): pair p's weight at p
    aligned = align_block_size(ids, experts, config.block_m)
    blocks = aligned.expert_ids.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 would otherwise lose ~3 digits to tf32
    h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)  # (pairs, intermediate) SiLU(gate) * up
    _gate_up_kernel[(blocks, triton.cdiv(inter, config.block_n))](
        x,
        w13,
        h,
        aligned.sorted_ids,
        aligned.expert_ids,
        aligned.total,
        pairs,
        hidden,
        inter,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        h.stride(0),
        TOP_K=k,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        PRECISION=precision,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        enable_fp_fusion=True,
    )
    rows = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)  # (pairs, hidden) weighted contributions
    _down_kernel[(blocks, triton.cdiv(hidden, config.block_n))](
        h,
        w2,
        rows,
        weights,
        aligned.sorted_ids,
        aligned.expert_ids,
        aligned.total,
        pairs,
        hidden,
        inter,
        h.stride(0),
        w2.stride(0),
        w2.stride(1),
        rows.stride(0),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        PRECISION=precision,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        enable_fp_fusion=True,
    )
    block = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(tokens, triton.cdiv(hidden, block))](
        rows,
        ids,
        out,
        hidden,
        experts,
        rows.stride(0),
        out.stride(0),
        TOP_K=k,
        BLOCK=block,
        num_warps=4,
        enable_fp_fusion=False,  # plain adds, rounded as torch's
    )
    return out
