"""CPU kernels: the torch kernels, with the hot paths done by small C kernels (csrc/, called through kernels/clib.py).

- Attention (csrc/decode_attention.c): pure torch must gather every decode's cache blocks into a padded copy before
  attending; the C kernel follows the block tables directly and reads each cached key and value once for all query
  heads of its group, which is what a memory-bound decode needs. Each query row of a prompt chunk is attended the
  same way, as a decode whose sequence ends at that row's position, where the prompt kernels below do not apply:
  torch's CPU attention rounds differently depending on the thread count, these rows do not.
- Prompt-chunk attention elsewhere with AVX-512F (csrc/prefill_attention_avx512.c): flash attention in float32
  over 16-query x 16-key tiles, float32 or bfloat16 in, reading the cache in place.
- Prompt-chunk attention for bfloat16 on CPUs with AMX (csrc/prefill_attention.c): flash attention with both
  products on the matrix engine, reading the chunk's keys and values from the paged cache.
- Elementwise work between the matrix multiplies (csrc/elementwise.c for bfloat16, csrc/elementwise_f32.c for
  float32): residual add + RMSNorm, SiLU(gate) * up, rotary embedding + KV cache write, each one pass over memory
  instead of several; and, for bfloat16, greedy sampling's argmax over the logits.
- Linear layers (`pack_weight`, `linear`): weights packed once at load. bfloat16: for the AMX kernel (csrc/linear.c)
  where it runs, else in oneDNN's blocked layout. float32 with AVX-512 or AVX2: for a kernel whose every output sums
  in one order whatever the batch (csrc/linear_f32.c), so a request's logits do not depend on the requests beside it;
  with AVX-512, the MLP's gate and up projections packed side by side, so the same kernel applies SiLU(gate) * up as
  it stores its outputs (`pack_gate_up`, `linear_silu_mul`) and the (tokens, 2 intermediate) products never go to
  memory.
- Mixture-of-experts layers in float32 (kernels/cpu_moe.py, csrc/moe.c): every expert with tokens, on the same
  packed panels and inner loops as the float32 linear layers, and the weighted sum, in one call per layer.

Every kernel splits its work over the process's torch threads (torch.get_num_threads()) through OpenMP, on the same
thread pool as torch's own ops (csrc/parallel.h); small work stays on one thread. Each output is computed by one
thread in a fixed order, so results do not depend on the thread count.

The library is compiled at first use with the machine's C compiler and cached under $FASTGEN_CACHE/kernels (see
kernels/clib.py); without a compiler, or for shapes and dtypes a kernel does not take, the torch kernels serve."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import clib, cpu_lora, cpu_moe
from .attention import AttentionMetadata, paged_attention, prefill_attention
from .decode_layer import fuse_decode_layer_cpu
from .dense import argmax
from .int4 import pack_for_cpu
from .norm import add_layer_norm, add_rms_norm, gelu_tanh_mul, layer_norm, rms_norm, silu_mul
from .packed_bf16 import PackedLinear
from .quant import QuantLinear, quant_linear
from .rotary import rotary_write_kv
from .table import Kernels


def load_library() -> clib.CLibrary | None:
    """The compiled kernels, building them on first use; None where no C compiler is available."""
    return clib.load_library()


def _get_library() -> clib.CLibrary | None:
    return clib.get_library()


@functools.cache
def declined(kernel: str, what: str) -> None:
    """Says once per process and shape that a C kernel declined its inputs and torch serves them: a model on that
    path runs several times slower, which its operator should know."""
    clib.log.warning("the C %s kernel does not take %s: torch's serves it, several times slower", kernel, what)


# Asked once: each of these is a call through ctypes, and the layers would ask it several times per layer.
@functools.cache
def _elementwise() -> clib.CLibrary | None:
    """The library where its bfloat16 elementwise kernels run on this CPU (AVX-512 with bf16), else None."""
    library = _get_library()
    return library if library is not None and library.elementwise_available() else None


@functools.cache
def _linear_f32() -> clib.CLibrary | None:
    """The library where its float32 linear kernel runs on this CPU (AVX-512, or AVX2 with FMA), else None."""
    library = _get_library()
    return library if library is not None and library.linear_f32_available() else None


@functools.cache
def _linear_f32_gated() -> clib.CLibrary | None:
    """The library where its float32 linear kernel also stores SiLU(gate) * up (AVX-512, as the float32 silu_mul it
    must equal), else None."""
    library = _linear_f32()
    return library if library is not None and library.linear_f32_silu_mul_available() else None


@functools.cache
def _amx() -> clib.CLibrary | None:
    """The library where this process may use the matrix engine (AMX), else None. prefill_attention_available()
    asks Linux for the tile state; the linear kernel, built under the same guard, needs nothing more."""
    library = _get_library()
    return library if library is not None and library.prefill_attention_available() else None


@functools.cache
def _dpbf16() -> clib.CLibrary | None:
    """The library where its AVX-512 BF16 linear kernel (csrc/linear_dpbf16.c) runs on this CPU, else None."""
    library = _get_library()
    return library if library is not None and library.linear_dpbf16_available() else None


# ---------------------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------------------


def decode_attention(
    q, k_cache, v_cache, block_tables, seq_lens, scale: float, out=None, starts=None, softcap: float = 0.0
) -> torch.Tensor | None:
    """One query row per entry: q (rows, heads, head_dim), row i attending to the first seq_lens[i] cached tokens
    of its block_tables row, from starts[i] on where starts (int32, a sliding window's first tokens) is given, the
    scores soft-capped where softcap > 0; into `out` (contiguous, like q) when given. None where the C kernel does
    not apply."""
    library = _get_library()
    if (
        library is None
        or q.dtype not in (torch.bfloat16, torch.float32)
        or not q.is_cpu
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or (out is not None and not out.is_contiguous())
    ):
        return None
    kernel = library.decode_attention_bf16 if q.dtype == torch.bfloat16 else library.decode_attention_f32
    seqs, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    starts = None if starts is None else starts.to(torch.int32).contiguous()
    out = torch.empty_like(q) if out is None else out
    status = kernel(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        None if starts is None else starts.data_ptr(),
        out.data_ptr(),
        seqs,
        heads,
        kv_heads,
        head_dim,
        block_size,
        tables.shape[1],
        scale,
        softcap,
        torch.get_num_threads(),
    )
    return out if status == 0 else None


def rows_as_decodes(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(block table, causal length) of every query row of the batch: a decode's own, and for row j of a prompt chunk
    of c new tokens over a sequence of n, its sequence's table and length n - c + j + 1."""
    starts, lens = meta.query_start_host, meta.seq_lens_host
    if meta.num_decodes == len(lens):
        return meta.block_tables, meta.seq_lens
    seq_of_row: list[int] = []
    row_lens: list[int] = []
    for i, n in enumerate(lens):
        chunk = starts[i + 1] - starts[i]
        seq_of_row += [i] * chunk
        row_lens += range(n - chunk + 1, n + 1)
    tables = meta.block_tables.index_select(0, torch.tensor(seq_of_row, device=meta.block_tables.device))
    return tables, torch.tensor(row_lens, dtype=torch.int32)


def window_starts(lens: torch.Tensor, window: int) -> torch.Tensor | None:
    """Each row's first visible token under a sliding window of `window` tokens (None: no window)."""
    return (lens.to(torch.int32) - window).clamp_(min=0) if window else None


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Same contract as attention.paged_attention. Decodes in one call of the C decode kernel; prompt chunks on the
    AMX kernel (bfloat16 on CPUs with AMX), else on the AVX-512 prompt kernel, else each of their rows as a decode in
    that same decode call; where the decode kernel does not apply, torch for the whole batch. A sliding window's
    prompt chunks take the same prompt kernels, each row within its window; soft-capping sends every row through the
    decode kernel, which alone takes it."""
    if softcap:
        return _attention_as_decodes(q, k_cache, v_cache, meta, scale, window, softcap)
    out = torch.empty_like(q)
    has_prompts = meta.num_decodes < len(meta.seq_lens_host)
    prompts_on_amx = has_prompts and _amx_prefill_applies(q, k_cache, v_cache, out)
    prompts_done = prompts_on_amx or (
        has_prompts and _prefill_attention_avx512(q, k_cache, v_cache, meta, scale, out, window)
    )
    if window and has_prompts and not prompts_done:
        return _attention_as_decodes(q, k_cache, v_cache, meta, scale, window, softcap)
    if prompts_done:
        rows, tables, lens = meta.num_decodes, meta.block_tables[: meta.num_decodes], meta.seq_lens[: meta.num_decodes]
    else:
        rows, (tables, lens) = q.shape[0], rows_as_decodes(meta)
    starts = None
    if window:  # the decode rows' first visible tokens, once per step (every window layer asks for the same)
        starts = meta.workspace.get(("cpu_starts", window, rows))
        if starts is None:
            starts = meta.workspace[("cpu_starts", window, rows)] = window_starts(lens, window)
    if rows and decode_attention(q[:rows], k_cache, v_cache, tables, lens, scale, out[:rows], starts) is None:
        declined("decode attention", attention_shape(q, k_cache))
        return paged_attention(q, k_cache, v_cache, meta, scale, window)
    if prompts_on_amx and not _prefill_attention_amx(q, k_cache, v_cache, meta, scale, out, window):
        prefill_attention(q, k_cache, v_cache, meta, scale, out, window)  # shapes the AMX kernel does not take
    return out


def _attention_as_decodes(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int, softcap: float):
    """Every query row of the batch as one decode row of the C kernel, each from its window's first token; the rows'
    tables, lengths and starts are derived once per step (every layer of a window asks for the same)."""
    rows = meta.workspace.get(("cpu_rows", window))
    if rows is None:
        tables, lens = rows_as_decodes(meta)
        rows = meta.workspace[("cpu_rows", window)] = (tables, lens, window_starts(lens, window))
    tables, lens, starts = rows
    out = decode_attention(q, k_cache, v_cache, tables, lens, scale, torch.empty_like(q), starts, softcap)
    if out is None:
        declined("decode attention", attention_shape(q, k_cache))
        return paged_attention(q, k_cache, v_cache, meta, scale, window, softcap)
    return out


def attention_shape(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    _, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    return f"{q.dtype} attention of {heads} heads on {kv_heads} KV heads of {head_dim}, blocks of {block_size}"


def _prefill_attention_avx512(
    q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor, window: int = 0
) -> bool:
    """Every prompt chunk of the batch on the AVX-512 prompt kernel (csrc/prefill_attention_avx512.c) in one call,
    each row within its sliding window where window > 0, into out; False where it does not apply (no library,
    dtypes, layouts, shapes it declines)."""
    library = _get_library()
    if (
        library is None
        or q.dtype not in (torch.bfloat16, torch.float32)
        or not (k_cache.dtype == v_cache.dtype == q.dtype)
        or not q.is_cpu
        or not all(t.is_contiguous() for t in (q, k_cache, v_cache, out))
    ):
        return False
    kernel = (
        library.prefill_attention_avx512_bf16 if q.dtype == torch.bfloat16 else library.prefill_attention_avx512_f32
    )
    first = meta.num_decodes
    heads, head_dim = q.shape[1:]
    block_size, kv_heads = k_cache.shape[1:3]
    tables = meta.block_tables[first:].to(torch.int32).contiguous()
    starts = torch.tensor(meta.query_start_host[first:], dtype=torch.int32)
    lens = torch.tensor(meta.seq_lens_host[first:], dtype=torch.int32)
    status = kernel(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        starts.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        len(lens),
        heads,
        kv_heads,
        head_dim,
        block_size,
        tables.shape[1],
        scale,
        window,
        torch.get_num_threads(),
    )
    return status == 0


def _amx_prefill_applies(q, k_cache, v_cache, out) -> bool:
    """Whether the AMX kernel takes the step's prompt chunks, sliding window or not; the AVX-512 one serves the rest
    (head sizes that are not a multiple of 64, as the AMX kernel's tiles need: Phi-2's 80, tiny test models' 32)."""
    head_dim = q.shape[2]
    return (
        _amx() is not None
        and head_dim % 64 == 0
        and head_dim <= 256
        and q.dtype == torch.bfloat16
        and k_cache.dtype == torch.bfloat16
        and q.is_contiguous()
        and out.is_contiguous()
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def _prefill_attention_amx(
    q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor, window: int = 0
) -> bool:
    """The prompt chunks of the batch on the AMX kernel, a sequence per call, each row within its sliding window where
    window > 0 (no key before a chunk's first window is read: table entries there may name blocks given back), into
    out; False where it declines."""
    library = _amx()
    assert library is not None, "called where _amx_prefill_applies"
    heads, head_dim = q.shape[1:]
    block_size, kv_heads = k_cache.shape[1:3]
    tables = meta.block_tables.to(torch.int32).contiguous()
    row_bytes = tables.stride(0) * tables.element_size()
    starts, lens = meta.query_start_host, meta.seq_lens_host
    threads = torch.get_num_threads()
    for i in range(meta.num_decodes, len(lens)):
        lo, hi = starts[i], starts[i + 1]
        status = library.prefill_attention_bf16(
            q[lo].data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr() + i * row_bytes,
            out[lo].data_ptr(),
            heads * head_dim,
            lens[i],
            hi - lo,
            heads,
            kv_heads,
            head_dim,
            block_size,
            scale,
            window,
            threads,
        )
        if status != 0:
            return False
    return True


# ---------------------------------------------------------------------------------------------------------------
# Elementwise
# ---------------------------------------------------------------------------------------------------------------


def _rows(x: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> bool:
    """x is a CPU matrix of dtype whose rows are contiguous (a row stride of its own is fine)."""
    return x.dtype == dtype and x.is_cpu and x.dim() == 2 and x.stride(1) == 1


@dataclass(frozen=True)
class Elementwise:
    """The fused elementwise kernels of one activation dtype (csrc/elementwise.c for bfloat16, csrc/elementwise_f32.c
    for float32), all taking the same arguments whatever the dtype."""

    dtype: torch.dtype
    add_rms_norm: Callable[..., int]
    silu_mul: Callable[..., int]
    gelu_tanh_mul: Callable[..., int]
    rotary_write_kv: Callable[..., int]


@functools.cache
def _elementwise_for(dtype: torch.dtype) -> Elementwise | None:
    """The fused elementwise kernels for activations of dtype where they run on this CPU, else None (torch serves)."""
    if dtype == torch.bfloat16 and (library := _elementwise()) is not None:
        return Elementwise(
            dtype,
            library.add_rms_norm_bf16,
            library.silu_mul_bf16,
            library.gelu_tanh_mul_bf16,
            library.rotary_write_kv_bf16,
        )
    library = _get_library()
    if dtype == torch.float32 and library is not None and library.elementwise_f32_available():
        return Elementwise(
            dtype,
            library.add_rms_norm_f32,
            library.silu_mul_f32,
            library.gelu_tanh_mul_f32,
            library.rotary_write_kv_f32,
        )
    return None


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as norm.rms_norm."""
    kernels = _elementwise_for(x.dtype)
    if kernels is None or not _rows(x, kernels.dtype) or weight.dtype != kernels.dtype or not weight.is_contiguous():
        return rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    rows, hidden = x.shape
    kernels.add_rms_norm(
        x.data_ptr(),
        None,
        weight.data_ptr(),
        out.data_ptr(),
        None,
        rows,
        hidden,
        x.stride(0),
        eps,
        torch.get_num_threads(),
    )
    return out


def add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as norm.add_rms_norm."""
    kernels = _elementwise_for(x.dtype)
    if (
        kernels is None
        or not _rows(x, kernels.dtype)
        or not (_rows(residual, kernels.dtype) and residual.is_contiguous())
        or weight.dtype != kernels.dtype
        or not weight.is_contiguous()
    ):
        return add_rms_norm(x, residual, weight, eps)
    out, total = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
    rows, hidden = x.shape
    kernels.add_rms_norm(
        x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        total.data_ptr(),
        rows,
        hidden,
        x.stride(0),
        eps,
        torch.get_num_threads(),
    )
    return out, total


def _gated(gate_up: torch.Tensor, which: str, reference: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """act(gate) * up by the elementwise kernel `which` (silu_mul, gelu_tanh_mul), else by the torch reference."""
    kernels = _elementwise_for(gate_up.dtype)
    if kernels is None or not _rows(gate_up, kernels.dtype) or gate_up.shape[1] % 2:
        return reference(gate_up)
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    kernel = getattr(kernels, which)
    kernel(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, gate_up.stride(0), torch.get_num_threads())
    return out


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as norm.silu_mul."""
    return _gated(gate_up, "silu_mul", silu_mul)


def gelu_tanh_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as norm.gelu_tanh_mul (GeGLU), within a few ulp of torch's GELU."""
    return _gated(gate_up, "gelu_tanh_mul", gelu_tanh_mul)


def rotary_write_kv_cpu(q, k, v, cos_sin, positions, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """Same contract as rotary.rotary_write_kv, for q, k, v that are views into one fused qkv row per token."""
    kernels = _elementwise_for(q.dtype)
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    # One row stride for q, k and v (views of one fused projection); a single token's row stride is whatever torch
    # chose for a size-1 dimension and is never used.
    row_stride = q.stride(0) if tokens > 1 else 0
    same_rows = tokens == 1 or q.stride(0) == k.stride(0) == v.stride(0)
    same_rows = same_rows and all(t.stride()[1:] == (head_dim, 1) for t in (q, k, v))
    if (
        kernels is None
        or not same_rows
        or not all(t.dtype == kernels.dtype and t.is_cpu for t in (q, k, v, k_cache, v_cache))
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or cos_sin.dtype != torch.float32
        or not cos_sin.is_contiguous()
        # rotary_dim, the table's width: the first dims of each head rotate (partial rotary: Phi; 0: none, OPT) and
        # the rest pass; an odd width is no rotate-half table
        or cos_sin.shape[1] % 2
        or cos_sin.shape[1] > head_dim
    ):
        return rotary_write_kv(q, k, v, cos_sin, positions, k_cache, v_cache, slot_mapping)
    positions = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    q_out = torch.empty((tokens, heads, head_dim), dtype=q.dtype)
    kernels.rotary_write_kv(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        row_stride,
        cos_sin.data_ptr(),
        positions.data_ptr(),
        slots.data_ptr(),
        q_out.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tokens,
        heads,
        kv_heads,
        head_dim,
        cos_sin.shape[1],
        torch.get_num_threads(),
    )
    return q_out


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Same contract as dense.argmax (the first of equal maxima), in C for bfloat16 rows: greedy sampling over the
    vocabulary, where torch's max is slow for bfloat16."""
    library = _elementwise()
    if library is None or not _rows(logits) or logits.shape[1] == 0:
        return argmax(logits)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    library.argmax_bf16(
        logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr(), torch.get_num_threads()
    )
    return out.tolist()


# ---------------------------------------------------------------------------------------------------------------
# Linear layers
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def _packed_bf16_kernel() -> Callable[..., int] | None:
    """The packed bfloat16 linear kernel this CPU runs: AMX's tiles where it has them (faster at prompt sizes), else
    AVX-512 BF16 dot products; None where neither runs."""
    amx, dpbf16 = _amx(), _dpbf16()
    return amx.linear_bf16 if amx is not None else dpbf16.linear_dpbf16 if dpbf16 is not None else None


def pack_linear(weight: torch.Tensor) -> PackedLinear | None:
    """The weight in the packed bfloat16 kernels' order, or None where neither runs (no AMX nor AVX-512 BF16, not
    bfloat16, in_features not a multiple of 32)."""
    if (
        _packed_bf16_kernel() is None
        or weight.dtype != torch.bfloat16
        or weight.device.type != "cpu"
        or weight.shape[1] % 32
    ):
        return None
    return PackedLinear.of(weight)


def linear_packed_bf16(x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x (rows, in_features) W^T + bias through the packed bfloat16 kernel, or None where it does not take x."""
    if not _rows(x) or x.shape[1] != packed.in_features or (bias is not None and bias.dtype != torch.bfloat16):
        return None
    rows = x.shape[0]
    y = torch.empty((rows, packed.out_features), dtype=torch.bfloat16)
    bias = None if bias is None else bias.contiguous()
    kernel = _packed_bf16_kernel()
    assert kernel is not None, "a PackedLinear is made only where a packed kernel runs (pack_linear)"
    status = kernel(
        x.data_ptr(),
        x.stride(0),
        packed.tiles.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        packed.out_features,
        rows,
        packed.out_features,
        packed.in_features,
        torch.get_num_threads(),
    )
    return y if status == 0 else None


@dataclass(frozen=True)
class PackedF32:
    """A float32 weight (out_features, in_features) in csrc/linear_f32.c's panel order, packed once at load: panel p,
    column c, lane j holds w[32 p + j][c]; out_features padded to 32 with zero rows. A gate/up weight (gate rows,
    then as many up rows) packed `gated` pairs them instead: lanes j < 16 hold gate row 16 p + j, lanes 16 + j the
    same up row, each half padded to 16."""

    panels: torch.Tensor  # (panels, in_features, 32)
    out_features: int
    in_features: int
    gated: bool = False

    def unpacked(self) -> torch.Tensor:
        """The weight (out_features, in_features) again, for the rare input the kernel does not take."""
        rows = self.panels.permute(0, 2, 1)  # (panels, 32, in_features)
        if not self.gated:
            return rows.reshape(-1, self.in_features)[: self.out_features]
        inter = self.out_features // 2
        gate, up = (half.reshape(-1, self.in_features)[:inter] for half in rows.split(16, dim=1))
        return torch.cat([gate, up])


def pack_f32(weight: torch.Tensor) -> PackedF32 | None:
    """The weight in the float32 kernel's panel order, or None where that kernel does not run (no AVX-512 or AVX2, not a
    float32 CPU matrix)."""
    if _linear_f32() is None or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    out_features, in_features = weight.shape
    padded = F.pad(weight.detach(), (0, 0, 0, -out_features % 32))
    panels = padded.view(-1, 32, in_features).permute(0, 2, 1).contiguous()
    return PackedF32(panels, out_features, in_features)


def pack_f32_gate_up(weight: torch.Tensor) -> PackedF32 | None:
    """A gate/up weight (2 intermediate, in_features) packed for linear_f32_silu_mul, or None where the float32
    kernel does not store SiLU(gate) * up on this CPU."""
    if _linear_f32_gated() is None or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    out_features, in_features = weight.shape
    if out_features % 2:
        return None
    gate, up = (F.pad(half, (0, 0, 0, -half.shape[0] % 16)) for half in weight.detach().chunk(2))
    pairs = torch.stack([gate.view(-1, 16, in_features), up.view(-1, 16, in_features)], dim=1)  # (panels, 2, 16, in)
    panels = pairs.flatten(1, 2).permute(0, 2, 1).contiguous()  # (panels, in_features, 32)
    return PackedF32(panels, out_features, in_features, gated=True)


def _takes(x: torch.Tensor, packed: PackedF32) -> bool:
    """Whether the float32 kernels take x as it is (else the caller computes with torch)."""
    return (
        x.dtype == torch.float32
        and x.is_cpu
        and x.dim() == 2
        and x.shape[0] > 0
        and x.stride(1) == 1
        and x.shape[1] == packed.in_features
    )


def linear_f32_silu_mul(x: torch.Tensor, packed: PackedF32) -> torch.Tensor | None:
    """SiLU(x Wg^T) * (x Wu^T) (rows, intermediate) from a gated pack (csrc/linear_f32.c), bit for bit linear_f32
    followed by silu_mul_cpu, or None where the kernel does not take the tensors."""
    if not (packed.gated and _takes(x, packed)):
        return None
    rows, inter = x.shape[0], packed.out_features // 2
    h = torch.empty((rows, inter), dtype=torch.float32)
    library = _linear_f32()
    assert library is not None, "a PackedF32 is made only where the float32 kernels run (pack_f32_gate_up)"
    status = library.linear_f32_silu_mul(
        x.data_ptr(),
        x.stride(0),
        packed.panels.data_ptr(),
        h.data_ptr(),
        inter,
        rows,
        inter,
        packed.in_features,
        torch.get_num_threads(),
    )
    return h if status == 0 else None


def linear_f32(x: torch.Tensor, packed: PackedF32, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x (rows, in_features) W^T + bias in float32 (csrc/linear_f32.c), each row's result the same in any batch and
    on any thread count, or None where the kernel does not take the tensors."""
    if (
        packed.gated
        or not _takes(x, packed)
        or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))
    ):
        return None
    rows = x.shape[0]
    y = torch.empty((rows, packed.out_features), dtype=torch.float32)
    library = _linear_f32()
    assert library is not None, "a PackedF32 is made only where the float32 kernels run (pack_f32)"
    status = library.linear_f32(
        x.data_ptr(),
        x.stride(0),
        packed.panels.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        packed.out_features,
        rows,
        packed.out_features,
        packed.in_features,
        torch.get_num_threads(),
    )
    return y if status == 0 else None


@dataclass(frozen=True)
class PackedWeight:
    """A CPU weight packed once at load, for exactly one kernel: in bfloat16 the packed kernel (csrc/linear.c on AMX,
    csrc/linear_dpbf16.c on AVX-512 BF16) where one runs, else oneDNN; in float32 the batch-invariant kernel
    (csrc/linear_f32.c)."""

    bf16: PackedLinear | None = None
    onednn: torch.Tensor | None = None
    f32: PackedF32 | None = None

    # The packed form alone computes the layer, so the layer drops its plain weight, which would double the model's
    # memory: oneDNN takes every input; an input the float32 or packed bfloat16 kernel declines goes to torch with it
    # unpacked.
    holds_weight = True


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """The weight packed once for a CPU kernel, or None where packing does not apply.

    Float32 goes to the batch-invariant kernel where it runs (AVX-512, AVX2): a row's result does not depend on the rows
    around it, which sgemm's does. It keeps up with sgemm at prompt sizes and is faster for decode batches, whose
    weight it streams once for all rows (python -m fastgen.benchmarks.cpu_kernels --linear-f32-only).

    F.linear reorders a bf16 weight into oneDNN's blocked layout on every call; packed once, that work is gone. The
    packed bfloat16 kernels (AMX tiles, else AVX-512 BF16 dot products), where they run, stream the weight faster than
    oneDNN at decode sizes and keep up with it at prompt sizes on several threads (python -m
    fastgen.benchmarks.cpu_kernels --threads N; benchmarks/RESULTS.md). All split their work over the torch threads."""
    f32 = pack_f32(weight)
    if f32 is not None:
        return PackedWeight(f32=f32)
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.bfloat16
        or not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ):
        return None
    tiles = pack_linear(weight)
    if tiles is not None:
        return PackedWeight(bf16=tiles)
    # 512 rows is the size hint oneDNN tunes the layout for: a full SplitFuse budget.
    return PackedWeight(onednn=torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 512))


def linear(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, packed: PackedWeight | None
) -> torch.Tensor:
    """x W^T + b, through the packed weight when there is one (weight may then be None: packed.holds_weight)."""
    if isinstance(packed, QuantLinear):
        return quant_linear(x, packed, bias)
    if packed is not None and packed.f32 is not None:
        y = linear_f32(x, packed.f32, bias)
        if y is not None:
            return y
        return F.linear(x, packed.f32.unpacked() if weight is None else weight, bias)
    if packed is not None and packed.bf16 is not None:
        y = linear_packed_bf16(x, packed.bf16, bias)
        if y is not None:
            return y
        return F.linear(x, packed.bf16.unpacked() if weight is None else weight, bias)
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
    assert weight is not None, "weight is None only beside a packed weight that holds it"
    return F.linear(x, weight, bias)


def pack_gate_up(weight: torch.Tensor) -> PackedWeight | None:
    """The MLP's gate/up weight (gate rows, then up rows) packed once: for the float32 kernel, gate and up side by
    side so that it applies SiLU(gate) * up itself; otherwise as any other weight."""
    gated = pack_f32_gate_up(weight)
    return PackedWeight(f32=gated) if gated is not None else pack_weight(weight)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor | None, packed: PackedWeight | None) -> torch.Tensor:
    """SiLU(x Wg^T) * (x Wu^T) for the gate/up weight [Wg; Wu] (weight may be None: packed.holds_weight)."""
    if isinstance(packed, QuantLinear):
        return silu_mul_cpu(quant_linear(x, packed, None))
    if packed is not None and packed.f32 is not None and packed.f32.gated:
        h = linear_f32_silu_mul(x, packed.f32)
        if h is not None:
            return h
        return silu_mul_cpu(F.linear(x, packed.f32.unpacked() if weight is None else weight))
    return silu_mul_cpu(linear(x, weight, None, packed))


CPU_KERNELS = Kernels(
    name="cpu",
    rotary_write_kv=rotary_write_kv_cpu,
    paged_attention=paged_attention_cpu,
    rms_norm=rms_norm_cpu,
    add_rms_norm=add_rms_norm_cpu,
    layer_norm=layer_norm,
    add_layer_norm=add_layer_norm,
    silu_mul=silu_mul_cpu,
    gelu_tanh_mul=gelu_tanh_mul_cpu,
    pack_linear=pack_weight,
    linear=linear,
    pack_gate_up=pack_gate_up,
    linear_silu_mul=linear_silu_mul,
    pack_quantized=pack_for_cpu,  # GGUF blocks; AWQ/GPTQ int4 converted to them
    pack_experts=cpu_moe.pack_experts,
    fused_moe=cpu_moe.fused_moe,
    pack_quantized_experts=cpu_moe.pack_quantized_experts,
    argmax=argmax_rows,
    lora_sgmv=cpu_lora.lora_sgmv,
    fuse_decode_layer=fuse_decode_layer_cpu,
)
# The same with float32 decode rows over quantized blocks on int8 activations (QuantLinear.float32_int8): a GGUF served
# in float32 because the CPU has no bfloat16 arithmetic, with llama.cpp's numerics (replica/builder.py decides).
CPU_KERNELS_FLOAT32_INT8 = dataclasses.replace(
    CPU_KERNELS, pack_quantized=functools.partial(pack_for_cpu, float32_int8=True)
)
