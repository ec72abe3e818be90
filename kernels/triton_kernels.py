"""Triton versions of the kernels for CUDA (they also run on CPU tensors under TRITON_INTERPRET=1).

Same call signatures and results as the torch references in this package:
- `paged_attention`: one launch for a whole ragged batch (decodes and prompt chunks together). The grid is
  (query tiles, kv heads); a tile holds consecutive new tokens of one sequence times all query heads of one
  kv head, so each cached block is read once per tile whatever the GQA ratio.
- `rotary_write_kv`: rotates q and k (all of each head, or its first rotary_dim dims) and scatters rotated k and
  plain v into their cache slots, one pass.
- `rms_norm` / `add_rms_norm`, `layer_norm` / `add_layer_norm`: one program per row, float32 statistics.
- `gelu_tanh_mul`: GeGLU's GELU(gate) * up, one pass, float32 inside.
- `fused_moe`: grouped GEMMs over the tokens sorted by expert, in kernels/triton_moe.py.
- `lora_sgmv`: the LoRA delta of every adapter in the step in two launches, in kernels/triton_lora.py.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import triton_int4
from .attention import AttentionMetadata
from .norm import silu_mul
from .table import TORCH_KERNELS, Kernels
from .triton_lora import lora_sgmv
from .triton_moe import fused_moe, pack_experts

LOG2_E = 1.4426950408889634

# Reductions go through tl.reduce with triton's own combine functions instead of tl.max / tl.sum, and tiles are
# made with tl.full instead of tl.zeros: those helpers are @triton.jit functions of triton's library, decorated
# once when triton is first imported. If that happened without TRITON_INTERPRET (say a test session imported
# triton before switching the interpreter on for these kernels), the interpreter cannot call them, while it
# recognises these combine functions and reduces with numpy. Compiled code is the same either way.
_max_combine = tl.standard._elementwise_max
_sum_combine = tl.standard._sum_combine


# ---------------------------------------------------------------------------------------------------------------
# Rotary + KV-cache write
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _rotate_half(x1, x2, cos, sin, dtype: tl.constexpr):
    """Rotate-half on float32 tiles, rounding after every op as torch does in `dtype`, so results match it."""
    a = (x1 * cos).to(dtype).to(tl.float32)
    b = (x2 * sin).to(dtype).to(tl.float32)
    c = (x2 * cos).to(dtype).to(tl.float32)
    e = (x1 * sin).to(dtype).to(tl.float32)
    return (a - b).to(dtype), (c + e).to(dtype)


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    positions_ptr,
    slots_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_cs,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    block_size,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim / 2: dims [0, HALF) and [HALF, 2 HALF) of each head rotate together
    PASS: tl.constexpr,  # head_dim - rotary_dim: the dims after the rotated ones, copied unrotated (partial rotary)
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
):
    t = tl.program_id(0)  # one token per program: all its q, k and v heads
    dtype = q_out_ptr.dtype.element_ty
    h = tl.arange(0, HEADS_PAD)[:, None]
    slot = tl.load(slots_ptr + t).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    kh = tl.arange(0, KV_HEADS_PAD)[:, None]
    # Negative slots (padding tokens) are skipped instead of writing out of bounds. The test is folded into the
    # head bound because the interpreter turns `block & scalar` masks into int32.
    kv_heads_ok = kh < tl.where(slot >= 0, KV_HEADS, 0)

    if HALF > 0:  # an empty table (no rotary: OPT) rotates no dim, and everything goes through the copy below
        pos = tl.load(positions_ptr + t).to(tl.int64)
        i = tl.arange(0, HALF_PAD)
        i_ok = i < HALF
        # torch casts the float32 table to the activation dtype before multiplying
        cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=i_ok, other=0.0).to(dtype).to(tl.float32)[None, :]
        sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i, mask=i_ok, other=0.0)
        sin = sin.to(dtype).to(tl.float32)[None, :]

        q_ok = (h < HEADS) & i_ok[None, :]
        q_row = q_ptr + t * stride_qt + h * stride_qh + i[None, :]  # (heads, half)
        q1 = tl.load(q_row, mask=q_ok, other=0.0).to(tl.float32)
        q2 = tl.load(q_row + HALF, mask=q_ok, other=0.0).to(tl.float32)
        o1, o2 = _rotate_half(q1, q2, cos, sin, dtype)
        o_row = q_out_ptr + t * stride_ot + h * stride_oh + i[None, :]
        tl.store(o_row, o1, mask=q_ok)
        tl.store(o_row + HALF, o2, mask=q_ok)

        kv_ok = kv_heads_ok & i_ok[None, :]
        k_row = k_ptr + t * stride_kt + kh * stride_kh + i[None, :]  # (kv_heads, half)
        k1 = tl.load(k_row, mask=kv_ok, other=0.0).to(tl.float32)
        k2 = tl.load(k_row + HALF, mask=kv_ok, other=0.0).to(tl.float32)
        r1, r2 = _rotate_half(k1, k2, cos, sin, k_ptr.dtype.element_ty)
        kc_row = k_cache_ptr + block * stride_kcb + offset * stride_kcs + kh * stride_kch + i[None, :]
        tl.store(kc_row, r1.to(k_cache_ptr.dtype.element_ty), mask=kv_ok)
        tl.store(kc_row + HALF, r2.to(k_cache_ptr.dtype.element_ty), mask=kv_ok)

        # v is copied in the same pieces as q and k (two halves, then the unrotated rest), so no other width is padded
        v_row = v_ptr + t * stride_vt + kh * stride_vh + i[None, :]
        vc_row = v_cache_ptr + block * stride_vcb + offset * stride_vcs + kh * stride_vch + i[None, :]
        tl.store(vc_row, tl.load(v_row, mask=kv_ok).to(v_cache_ptr.dtype.element_ty), mask=kv_ok)
        tl.store(vc_row + HALF, tl.load(v_row + HALF, mask=kv_ok).to(v_cache_ptr.dtype.element_ty), mask=kv_ok)

    if PASS > 0:  # partial rotary (Phi, Falcon): dims from 2 HALF on pass as they are, as in torch's cat
        j = 2 * HALF + tl.arange(0, PASS_PAD)[None, :]
        j_ok = j < 2 * HALF + PASS
        q_pass = (h < HEADS) & j_ok
        q_rest = tl.load(q_ptr + t * stride_qt + h * stride_qh + j, mask=q_pass)
        tl.store(q_out_ptr + t * stride_ot + h * stride_oh + j, q_rest.to(dtype), mask=q_pass)
        kv_pass = kv_heads_ok & j_ok
        k_rest = tl.load(k_ptr + t * stride_kt + kh * stride_kh + j, mask=kv_pass)
        kc_rest = k_cache_ptr + block * stride_kcb + offset * stride_kcs + kh * stride_kch + j
        tl.store(kc_rest, k_rest.to(k_cache_ptr.dtype.element_ty), mask=kv_pass)
        v_rest = tl.load(v_ptr + t * stride_vt + kh * stride_vh + j, mask=kv_pass)
        vc_rest = v_cache_ptr + block * stride_vcb + offset * stride_vcs + kh * stride_vch + j
        tl.store(vc_rest, v_rest.to(v_cache_ptr.dtype.element_ty), mask=kv_pass)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotates q (tokens, heads, head_dim) and k (tokens, kv_heads, head_dim) by position, writes rotated k and v
    into the cache; returns the rotated q (a new tensor: q itself is left as it was, like the torch version). A
    table narrower than head_dim (rotary_dim columns: partial rotary, Phi and Falcon) rotates the first rotary_dim
    dims of each head, the rest are copied as they are; an empty one (no rotary: OPT) rotates none."""
    q, k, v, cos_sin = (_last_dim_contiguous(x) for x in (q, k, v, cos_sin))
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    rotary_dim = cos_sin.shape[-1]
    assert rotary_dim % 2 == 0 and 0 <= rotary_dim <= head_dim, (rotary_dim, head_dim)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    q_out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out
    half, rest = rotary_dim // 2, head_dim - rotary_dim
    _rotary_write_kv_kernel[(tokens,)](
        q,
        k,
        v,
        cos_sin,
        positions,
        slot_mapping,
        q_out,
        k_cache,
        v_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        cos_sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_cache.shape[1],
        HEADS=heads,
        KV_HEADS=kv_heads,
        HALF=half,
        PASS=rest,
        HEADS_PAD=triton.next_power_of_2(heads),
        KV_HEADS_PAD=triton.next_power_of_2(kv_heads),
        HALF_PAD=triton.next_power_of_2(max(half, 1)),
        PASS_PAD=triton.next_power_of_2(max(rest, 1)),
        num_warps=4,
        enable_fp_fusion=False,  # no fused multiply-adds, so the rounding is torch's
    )
    return q_out


# ---------------------------------------------------------------------------------------------------------------
# Paged attention
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    tiles_ptr,
    query_start_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_tiles,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,  # sliding window in tokens, 0: off (compiled out)
    SOFTCAP: tl.constexpr,  # scores -> SOFTCAP * tanh(scores / SOFTCAP), 0.0: off (compiled out)
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tiles_ptr + tile)
    tile_start = tl.load(tiles_ptr + num_tiles + tile)  # first query token of the tile within its sequence
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)

    # Row r of the tile is query token tile_start + r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // GROUP
    row_ok = (rows < TOKENS_PER_TILE * GROUP) & (tok < q_len)
    # Padding rows reuse the last real token so their softmax stays finite; they are never stored.
    tok = tl.minimum(tok, q_len - 1)
    head = kv_head * GROUP + rows % GROUP
    q_pos = seq_len - q_len + tok  # position of each row's token in its sequence
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q_off = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]  # (BLOCK_M, HEAD_DIM_PAD)
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, tl.float32)
    kv_end = seq_len - q_len + tl.minimum(tile_start + TOKENS_PER_TILE, q_len)  # causal: past the tile's last token
    kv_start = 0
    if WINDOW > 0:  # nothing before the tile's first token's window is read
        kv_start = tl.maximum(seq_len - q_len + tile_start - WINDOW + 1, 0)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        # BLOCK_N need not match the cache block size: every key looks up its own block
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = n % BLOCK_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k_off = block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_cache_ptr + k_off, mask=kv_mask, other=0.0)  # (BLOCK_N, HEAD_DIM_PAD)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if SOFTCAP > 0:  # qk_scale is the plain scale here: cap, then log2 units
            s = (2.0 / (1.0 + tl.exp(-2.0 * s / SOFTCAP)) - 1.0) * (SOFTCAP * 1.4426950408889634)  # tanh; LOG2_E
        visible = n[None, :] <= q_pos[:, None]
        if WINDOW > 0:
            visible = visible & (n[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
        if WINDOW > 0:  # a row may see no key of a block yet: keep its running max finite
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        # else key 0 is visible to every row, so m_new is finite from the first block on
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        v_off = block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :]
        v = tl.load(v_cache_ptr + v_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_off = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    query_start_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    tokens,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Flash-decoding: one program per (decoding sequence, KV head, split of its keys). Each split's running max m,
    sum l and unnormalised output acc (log2 units) go to fp32 partials, which _combine_splits merges. The split's
    range comes from the sequence length on the device, so a captured graph serves any lengths."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    tok = tl.load(query_start_ptr + seq)  # one query token per sequence
    kv_end = tl.load(seq_lens_ptr + seq)  # every cached key is visible to a decode
    # Keys per split in whole BLOCK_N tiles; ceilings by hand, as tl.cdiv is one of the library functions noted above
    chunk = ((kv_end + SPLITS - 1) // SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    kv_start = split * chunk
    kv_stop = tl.minimum(kv_start + chunk, kv_end)

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    head = kv_head * GROUP + tl.minimum(rows, GROUP - 1)  # padding rows repeat the last head; never stored
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q_off = tok.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_stop, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_stop
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = n % BLOCK_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k_off = block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_cache_ptr + k_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if SOFTCAP > 0:
            s = (2.0 / (1.0 + tl.exp(-2.0 * s / SOFTCAP)) - 1.0) * (SOFTCAP * 1.4426950408889634)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))  # finite: every block holds a visible key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        v_off = block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :]
        v = tl.load(v_cache_ptr + v_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # An empty split (a sequence shorter than the splits) stores m = -inf, l = 0, acc = 0: weight 0 when merged.
    part = (split * tokens + tok).to(tl.int64) * HEADS + head  # (BLOCK_M,) row of the (SPLITS, tokens, HEADS) partials
    tl.store(m_ptr + part, m_i, mask=row_ok)
    tl.store(l_ptr + part, l_i, mask=row_ok)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


# Below about this many (sequence, KV head) programs a decode-only step leaves most of an H100/H200's 132 SMs idle:
# split each sequence's keys over more programs (flash-decoding).
SPLIT_TARGET_PROGRAMS = 128
MAX_SPLITS = 16
MIN_KEYS_PER_SPLIT = 256  # shorter splits cost more in partials and merging than they save


def decode_splits(seqs: int, kv_heads: int, max_seq_len: int) -> int:
    """Splits of each sequence's keys for a decode-only step (1: no split). From shapes and the longest context only:
    in a captured graph these are the bucket's size and the model's length, so one graph serves every step."""
    programs = seqs * kv_heads
    if programs >= SPLIT_TARGET_PROGRAMS:
        return 1
    return max(1, min(MAX_SPLITS, SPLIT_TARGET_PROGRAMS // programs, -(-max_seq_len // MIN_KEYS_PER_SPLIT)))


def _decode_split_attention(q, k_cache, v_cache, meta, scale, softcap, splits, out) -> torch.Tensor:
    """Decode-only paged attention over `splits` programs per (sequence, KV head), merged on the device."""
    tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    m = torch.empty((splits, tokens, heads), dtype=torch.float32, device=q.device)
    l_sum = torch.empty((splits, tokens, heads), dtype=torch.float32, device=q.device)
    acc = torch.empty((splits, tokens, heads, head_dim), dtype=torch.float32, device=q.device)
    small = q.dtype == torch.float32 or head_dim_pad > 128
    _decode_split_kernel[(tokens, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        m,
        l_sum,
        acc,
        meta.query_start,
        meta.seq_lens,
        meta.block_tables,
        tokens,
        scale if softcap else scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        meta.block_tables.stride(0),
        HEADS=heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=32 if small else 64,
        SPLITS=splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SOFTCAP=float(softcap),
        num_warps=4,
        num_stages=2,
        enable_fp_fusion=True,
    )
    # Merge: each split weighted by 2^(its max - the overall max); split 0 always holds key 0, so that max is finite.
    weight = torch.exp2(m - m.amax(0))  # (splits, tokens, heads)
    total = (weight * l_sum).sum(0)
    out.copy_(((weight[..., None] * acc).sum(0) / total[..., None]).to(out.dtype))
    return out


def _tiles_host(query_start: list[int] | tuple[int, ...], tokens_per_tile: int) -> list[int]:
    """The tile map as host ints: every tile's sequence, then every tile's first query token within it."""
    seqs, firsts = [], []
    for i, (start, end) in enumerate(zip(query_start[:-1], query_start[1:])):
        for first in range(0, end - start, tokens_per_tile):
            seqs.append(i)
            firsts.append(first)
    return seqs + firsts


@functools.lru_cache(maxsize=32)
def _tile_map(query_start: tuple[int, ...], tokens_per_tile: int, device: torch.device) -> torch.Tensor:
    """(2, tiles) int32 on device: each tile's sequence and first query token within it. Cached because every
    layer of a step asks for the same map. The model runner sends it with the step's inputs instead
    (`attention_plan`); this serves other callers (graph capture, benchmarks)."""
    return torch.tensor(_tiles_host(query_start, tokens_per_tile), dtype=torch.int32).view(2, -1).to(device)


def _attention_config(max_query_len: int, group: int, head_dim_pad: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps). Decode-only batches use the smallest tile that holds one token's heads:
    decode is bound by reading the cache, so larger tiles would only add idle rows. Float32 (no tensor-core path
    at full precision) and head dims over 128 get smaller tiles, which keep them from spilling registers."""
    rows = triton.next_power_of_2(group)
    decode_only = max_query_len <= 1
    if dtype == torch.float32 or head_dim_pad > 128:
        return max(16 if decode_only else 32, rows), 32, 8
    return max(16 if decode_only else 64, rows), 64, 4


def _tiles_key(max_query_len: int, group: int, head_dim: int, dtype: torch.dtype) -> tuple[tuple, int, int, int]:
    """(workspace key of the tile map: ("tiles", tokens per tile), BLOCK_M, BLOCK_N, num_warps) of an attention
    call."""
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, num_warps = _attention_config(max_query_len, group, head_dim_pad, dtype)
    return ("tiles", block_m // group), block_m, block_n, num_warps


def attention_plan(
    query_start: list[int], max_query_len: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[tuple, list[int]]:
    """The step's tile map as host ints, with the workspace key paged_attention looks it up by: the model runner sends
    it in the step's one pinned copy (a (2, tiles) view of it), so no layer copies it from pageable memory."""
    key = _tiles_key(max_query_len, heads // kv_heads, head_dim, dtype)[0]
    return key, _tiles_host(query_start, key[1])


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of q (tokens, heads, head_dim) over each sequence's cache; returns (tokens, heads, head_dim).
    window, softcap: as attention.paged_attention's (0: off)."""
    q = _last_dim_contiguous(q)
    tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert heads % kv_heads == 0 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = heads // kv_heads
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    if meta.max_query_len <= 1 and not window:
        splits = decode_splits(tokens, kv_heads, meta.max_seq_len)
        if splits > 1:
            return _decode_split_attention(q, k_cache, v_cache, meta, scale, softcap, splits, out)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    key, block_m, block_n, num_warps = _tiles_key(meta.max_query_len, group, head_dim, q.dtype)
    tokens_per_tile = key[1]
    # Held by the step's metadata (sent there by the model runner, or made here once per step): a captured graph
    # keeps reading this tensor, so it must outlive the cache entry.
    tiles = meta.workspace.get(key)
    if tiles is None:
        tiles = meta.workspace[key] = _tile_map(tuple(meta.query_start_host), tokens_per_tile, q.device)
    num_tiles = tiles.shape[1]
    _paged_attention_kernel[(num_tiles, kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        tiles,
        meta.query_start,
        meta.seq_lens,
        meta.block_tables,
        num_tiles,
        scale if softcap else scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        meta.block_tables.stride(0),
        GROUP=group,
        TOKENS_PER_TILE=tokens_per_tile,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        # fp32 inputs would otherwise go through tf32 tensor cores and lose ~3 digits
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WINDOW=int(window),
        SOFTCAP=float(softcap),
        num_warps=num_warps,
        num_stages=2,
        enable_fp_fusion=True,
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        # rounded to the input dtype before normalising, exactly as torch's `x + residual`
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.reduce(x32 * x32, 0, _sum_combine) / hidden + eps)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def _launch_rms_norm(x, residual, weight, eps):
    hidden = x.shape[-1]
    x2 = _last_dim_contiguous(x.reshape(-1, hidden))  # (rows, hidden)
    weight = weight.contiguous()
    if residual is None:
        r2 = res_out = x2  # unused: HAS_RESIDUAL is off
        in_dtype = x.dtype
    else:
        r2 = _last_dim_contiguous(residual.reshape(-1, hidden))
        in_dtype = torch.promote_types(x.dtype, residual.dtype)  # the dtype of `x + residual`
        res_out = torch.empty(x2.shape, dtype=in_dtype, device=x.device)
    out_dtype = torch.promote_types(weight.dtype, in_dtype)  # what `weight * normed` gives in torch
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out,
            res_out,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            res_out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
            enable_fp_fusion=False,
        )
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (tokens, hidden) normalised in float32 and scaled by weight, as Hugging Face LlamaRMSNorm."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the normalised input of the next block and the new residual."""
    return _launch_rms_norm(x, residual, weight, eps)


# ---------------------------------------------------------------------------------------------------------------
# LayerNorm (Phi-2, OPT, Falcon)
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _layer_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        # rounded to the input dtype before normalising, exactly as torch's `x + residual`
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=ok)
    # Mean, then the variance of the centred row (two passes over registers: no cancellation), in float32 as torch
    x32 = x.to(tl.float32)
    mean = tl.reduce(x32, 0, _sum_combine) / hidden
    centred = tl.where(ok, x32 - mean, 0.0)
    rstd = tl.math.rsqrt(tl.reduce(centred * centred, 0, _sum_combine) / hidden + eps)
    y = centred * rstd
    if HAS_WEIGHT:
        y = y * tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    # one rounding to the output dtype, as torch's kernels (float32 inside, for half-precision inputs too)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def _launch_layer_norm(x, residual, weight, bias, eps):
    hidden = x.shape[-1]
    x2 = _last_dim_contiguous(x.reshape(-1, hidden))  # (rows, hidden)
    if residual is None:
        r2 = res_out = x2  # unused: HAS_RESIDUAL is off
        in_dtype = x.dtype
    else:
        r2 = _last_dim_contiguous(residual.reshape(-1, hidden))
        in_dtype = torch.promote_types(x.dtype, residual.dtype)  # the dtype of `x + residual`
        res_out = torch.empty(x2.shape, dtype=in_dtype, device=x.device)
    # F.layer_norm returns its input's dtype, whatever the dtype of its weight and bias
    out = torch.empty(x2.shape, dtype=in_dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden)
        _layer_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            x2 if weight is None else weight.contiguous(),  # unused when absent: HAS_WEIGHT / HAS_BIAS are off
            x2 if bias is None else bias.contiguous(),
            out,
            res_out,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            res_out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
            enable_fp_fusion=False,
        )
    return out.view(x.shape), res_out.view(x.shape)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim (Phi-2, Falcon, OPT), as torch.nn.LayerNorm computes it."""
    return _launch_layer_norm(x, None, weight, bias, eps)[0]


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (layer_norm(x + residual), x + residual), add_rms_norm's contract."""
    return _launch_layer_norm(x, residual, weight, bias, eps)


# ---------------------------------------------------------------------------------------------------------------
# GeGLU (Gemma)
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _gelu_tanh_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=ok, other=0.0).to(tl.float32)
    # GELU's tanh form, x/2 (1 + tanh(y)) with y = sqrt(2/pi) (x + 0.044715 x^3), written as x sigmoid(2y): the same
    # function with no 1 + tanh cancellation for negative x, and no tanh (the interpreter has none). From
    # e = exp(-2|y|), which cannot overflow: sigmoid(2y) = 1 / (1 + e) for y >= 0, e / (1 + e) below; e underflows
    # to 0 for large negative x, giving -0.0 as torch's 0.5 x (1 - 1) does.
    y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    e = tl.exp(-2.0 * tl.abs(y))
    act = g * tl.where(y >= 0, 1.0, e) / (1.0 + e)
    # torch rounds the activation to the input dtype before `* up`, then rounds the product
    act = act.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * u).to(dtype), mask=ok)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate, tanh approximation) * up (GeGLU, Gemma's gelu_pytorch_tanh) for gate_up (tokens, 2 * intermediate),
    gate in the first half: (tokens, intermediate), within a few ulp of torch's."""
    width = gate_up.shape[-1]
    assert width % 2 == 0, width
    inter = width // 2
    x2 = _last_dim_contiguous(gate_up.reshape(-1, width))
    out = torch.empty((x2.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if x2.shape[0] and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _gelu_tanh_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2,
            out,
            x2.stride(0),
            out.stride(0),
            inter,
            BLOCK=block,
            num_warps=min(8, max(1, block // 256)),
            enable_fp_fusion=False,
        )
    return out.view(*gate_up.shape[:-1], inter)


# Float linear layers (the gate/up one's SiLU * up too) and the argmax are torch's (cuBLAS and a max over the logits
# serve on CUDA); int4 ones are kernels/triton_int4.py's.
TRITON_KERNELS = Kernels(
    name="triton",
    rotary_write_kv=rotary_write_kv,
    paged_attention=paged_attention,
    rms_norm=rms_norm,
    add_rms_norm=add_rms_norm,
    silu_mul=silu_mul,
    gelu_tanh_mul=gelu_tanh_mul,
    layer_norm=layer_norm,
    add_layer_norm=add_layer_norm,
    pack_linear=TORCH_KERNELS.pack_linear,
    linear=triton_int4.linear,
    pack_gate_up=TORCH_KERNELS.pack_gate_up,
    linear_silu_mul=triton_int4.linear_silu_mul,
    pack_quantized=triton_int4.pack_quantized,  # AWQ/GPTQ int4, fp8; GGUF blocks are dequantized on CUDA
    pack_experts=pack_experts,
    fused_moe=fused_moe,
    argmax=TORCH_KERNELS.argmax,
    lora_sgmv=lora_sgmv,
    graph_safe=True,
    attention_plan=attention_plan,
)
