"""CPU kernels: the torch kernels, with the hot paths done by small C kernels (csrc/).

- Decode attention (csrc/decode_attention.c): pure torch must gather every decode's cache blocks into a padded copy
  before attending; the C kernel follows the block tables directly and reads each cached key and value once for
  all query heads of its group, which is what a memory-bound decode needs.
- Prompt-chunk attention for bfloat16 on CPUs with AMX (csrc/prefill_attention.c): flash attention with both
  products on the matrix engine, reading the chunk's keys and values from the paged cache.
- Elementwise work between the matrix multiplies for bfloat16 (csrc/elementwise.c): residual add + RMSNorm,
  SiLU(gate) * up, rotary embedding + KV cache write, each one pass over memory instead of several; and greedy
  sampling's argmax over the logits.
- Linear layers for bfloat16 on CPUs with AMX (csrc/linear.c): weights packed once at load (pack_linear) in the
  order the kernel streams them; replica/parallel.py decides per weight between this and oneDNN.

Every kernel splits its work over the process's torch threads (torch.get_num_threads()) through OpenMP, on the same
thread pool as torch's own ops (csrc/parallel.h); small work stays on one thread. Results do not depend on the
thread count.

The library is compiled at first use with the machine's C compiler and cached under $FASTGEN_CACHE/kernels;
without a compiler, or for shapes and dtypes a kernel does not take, the torch kernels serve."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import Kernels, rotary_write_kv
from .attention import AttentionMetadata, paged_attention, prefill_attention
from .norm import add_rms_norm, rms_norm, silu_mul

log = logging.getLogger("fastgen.kernels")
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / name for name in ("decode_attention.c", "prefill_attention.c", "elementwise.c", "linear.c")]
HEADERS = [CSRC / "vector_math.h", CSRC / "paged_cache.h", CSRC / "amx.h", CSRC / "parallel.h"]
# Reassociation lets the compiler vectorise the portable loops' reductions; no finite-math assumptions (the
# softmax starts from -inf).
FLAGS = [
    "-O3",
    "-march=native",
    "-fPIC",
    "-shared",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]
# OpenMP splits the kernels over the process's torch threads. The library needs libgomp.so.1 by name, which the
# dynamic loader finds already loaded with torch, so both share one thread pool. Where the compiler has no OpenMP the
# kernels are built without it and run on one thread.
OPENMP = ["-fopenmp"]
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "decode_attention_bf16": [_P] * 6 + [_I] * 6 + [_F, _I],
    "decode_attention_f32": [_P] * 6 + [_I] * 6 + [_F, _I],
    "elementwise_available": [],
    "prefill_attention_available": [],
    "prefill_attention_bf16": [_P] * 5 + [_L] + [_I] * 6 + [_F, _I],
    "add_rms_norm_bf16": [_P] * 5 + [_I, _I, _L, _F, _I],
    "silu_mul_bf16": [_P, _P, _I, _I, _L, _I],
    "rotary_write_kv_bf16": [_P] * 3 + [_L] + [_P] * 6 + [_I] * 5,
    "linear_bf16": [_P, _L, _P, _P, _P, _L, _I, _I, _I, _I],
    "argmax_bf16": [_P, _I, _I, _L, _P, _I],
}


def _cache_dir() -> Path:
    return Path(os.environ.get("FASTGEN_CACHE", Path.home() / ".cache" / "fastgen")) / "kernels"


def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first use; None where no C compiler is available."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: the CPU kernels fall back to torch")
        return None
    digest = hashlib.sha256(" ".join([compiler, *FLAGS, *OPENMP]).encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    target = _cache_dir() / f"fastgen_cpu-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            for openmp in (OPENMP, []):
                command = [compiler, *FLAGS, *openmp, "-o", str(built), *map(str, SOURCES), "-lm"]
                result = subprocess.run(command, capture_output=True, text=True)
                if result.returncode == 0:
                    break
                if openmp:
                    log.warning("building the CPU kernels with OpenMP failed; they will run on one thread")
            else:
                log.warning("building the CPU kernels failed, torch serves instead:\n%s", result.stderr[-2000:])
                return None
            os.replace(built, target)  # atomic: processes building at once all end with a whole library
    library = ctypes.CDLL(str(target))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(library, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return library


@functools.cache
def _get_library() -> ctypes.CDLL | None:
    return load_library()


# Asked once: each of these is a call through ctypes, and the layers would ask it several times per layer.
@functools.cache
def _elementwise() -> ctypes.CDLL | None:
    """The library where its bfloat16 elementwise kernels run on this CPU (AVX-512 with bf16), else None."""
    library = _get_library()
    return library if library is not None and library.elementwise_available() else None


@functools.cache
def _amx() -> ctypes.CDLL | None:
    """The library where this process may use the matrix engine (AMX), else None. prefill_attention_available()
    asks Linux for the tile state; the linear kernel, built under the same guard, needs nothing more."""
    library = _get_library()
    return library if library is not None and library.prefill_attention_available() else None


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float, out=None) -> torch.Tensor | None:
    """q (seqs, heads, head_dim) over each sequence's cache, into `out` (contiguous, like q) when given; None where
    the C kernel does not apply."""
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
    out = torch.empty_like(q) if out is None else out
    status = kernel(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        seqs,
        heads,
        kv_heads,
        head_dim,
        block_size,
        tables.shape[1],
        scale,
        torch.get_num_threads(),
    )
    return out if status == 0 else None


def paged_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Same contract as attention.paged_attention."""
    nd = meta.num_decodes
    out = torch.empty_like(q)
    if (
        nd
        and decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale, out[:nd])
        is None
    ):
        return paged_attention(q, k_cache, v_cache, meta, scale)
    prefill_attention_cpu(q, k_cache, v_cache, meta, scale, out)
    return out


def prefill_attention_cpu(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """Same contract as attention.prefill_attention: the AMX kernel per sequence where it applies."""
    if meta.num_decodes == len(meta.seq_lens_host):
        return  # decodes only
    library = _amx()
    heads, head_dim = q.shape[1:]
    block_size, kv_heads = k_cache.shape[1:3]
    if (
        library is None
        or q.dtype != torch.bfloat16
        or k_cache.dtype != torch.bfloat16
        or not (q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        return prefill_attention(q, k_cache, v_cache, meta, scale, out)
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
            threads,
        )
        if status != 0:  # shapes the kernel does not take: torch for the whole batch
            return prefill_attention(q, k_cache, v_cache, meta, scale, out)


def _rows(x: torch.Tensor) -> bool:
    """x is a bfloat16 CPU matrix whose rows are contiguous (a row stride of its own is fine)."""
    return x.dtype == torch.bfloat16 and x.is_cpu and x.dim() == 2 and x.stride(1) == 1


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as norm.rms_norm."""
    library = _elementwise()
    if library is None or not _rows(x) or weight.dtype != torch.bfloat16:
        return rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    rows, hidden = x.shape
    library.add_rms_norm_bf16(
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
    library = _elementwise()
    if (
        library is None
        or not _rows(x)
        or not (_rows(residual) and residual.is_contiguous())
        or weight.dtype != torch.bfloat16
    ):
        return add_rms_norm(x, residual, weight, eps)
    out, total = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
    rows, hidden = x.shape
    library.add_rms_norm_bf16(
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


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as norm.silu_mul."""
    library = _elementwise()
    if library is None or not _rows(gate_up) or gate_up.shape[1] % 2:
        return silu_mul(gate_up)
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    library.silu_mul_bf16(
        gate_up.data_ptr(), out.data_ptr(), rows, width // 2, gate_up.stride(0), torch.get_num_threads()
    )
    return out


def rotary_write_kv_cpu(q, k, v, cos_sin, positions, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """Same contract as kernels.rotary_write_kv, for q, k, v that are views into one fused qkv row per token."""
    library = _elementwise()
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    # One row stride for q, k and v (views of one fused projection); a single token's row stride is whatever torch
    # chose for a size-1 dimension and is never used.
    row_stride = q.stride(0) if tokens > 1 else 0
    same_rows = tokens == 1 or q.stride(0) == k.stride(0) == v.stride(0)
    same_rows = same_rows and all(t.stride()[1:] == (head_dim, 1) for t in (q, k, v))
    if (
        library is None
        or not same_rows
        or not all(t.dtype == torch.bfloat16 for t in (q, k, v, k_cache, v_cache))
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or cos_sin.dtype != torch.float32
        or not cos_sin.is_contiguous()
        or head_dim % 2
    ):
        return rotary_write_kv(q, k, v, cos_sin, positions, k_cache, v_cache, slot_mapping)
    positions = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    q_out = torch.empty((tokens, heads, head_dim), dtype=q.dtype)
    library.rotary_write_kv_bf16(
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
        torch.get_num_threads(),
    )
    return q_out


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The index of each row's maximum (the first of equal maxima, as torch's max), in C for bfloat16 rows: greedy
    sampling over the vocabulary, 2.5 ms per step in torch at 64 rows of SmolLM2."""
    library = _elementwise()
    if library is None or not _rows(logits) or logits.shape[1] == 0:
        return logits.max(dim=-1).indices.tolist()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    library.argmax_bf16(
        logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr(), torch.get_num_threads()
    )
    return out.tolist()


CPU_KERNELS = Kernels("cpu", rotary_write_kv_cpu, paged_attention_cpu, rms_norm_cpu, add_rms_norm_cpu, silu_mul_cpu)


@dataclass(frozen=True)
class PackedLinear:
    """A bfloat16 weight (out_features, in_features) in csrc/linear.c's tile order, packed once at load."""

    tiles: torch.Tensor
    out_features: int
    in_features: int


def pack_linear(weight: torch.Tensor) -> PackedLinear | None:
    """The weight in the AMX linear kernel's order, or None where that kernel does not run (no AMX, not bfloat16,
    in_features not a multiple of 32)."""
    out_features, in_features = weight.shape
    if _amx() is None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or in_features % 32:
        return None
    padded = F.pad(weight.detach(), (0, 0, 0, -out_features % 16))
    # tile (nb, kb), row r, dword c, half i = w[16 nb + c][32 kb + 2 r + i]
    tiles = padded.view(-1, 16, in_features // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()
    return PackedLinear(tiles, out_features, in_features)


def linear_amx(x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x (rows, in_features) W^T + bias on the matrix engine, or None where the kernel does not take x."""
    if not _rows(x) or x.shape[1] != packed.in_features or (bias is not None and bias.dtype != torch.bfloat16):
        return None
    rows = x.shape[0]
    y = torch.empty((rows, packed.out_features), dtype=torch.bfloat16)
    bias = None if bias is None else bias.contiguous()
    status = _amx().linear_bf16(
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
