"""CPU kernels: the torch kernels, with decode attention done by a small C kernel (csrc/decode_attention.c).

Pure torch must gather every decode's cache blocks into a padded copy before attending; the C kernel follows
the block tables directly and reads each cached key and value once for all query heads of its group, which is
what a memory-bound decode needs. It is compiled at first use with the machine's C compiler and cached under
$FASTGEN_CACHE/kernels; without a compiler the torch path serves instead."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .attention import AttentionMetadata, paged_attention, prefill_attention

log = logging.getLogger("fastgen.kernels")
SOURCE = Path(__file__).resolve().parent / "csrc" / "decode_attention.c"
# Reassociation lets the compiler vectorise the dot-product reductions; no finite-math assumptions (the
# softmax starts from -inf).
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math"]
_FUNCTIONS = {torch.bfloat16: "decode_attention_bf16", torch.float32: "decode_attention_f32"}


def _cache_dir() -> Path:
    return Path(os.environ.get("FASTGEN_CACHE", Path.home() / ".cache" / "fastgen")) / "kernels"


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; None where no C compiler is available."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: CPU decode attention falls back to torch")
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"decode_attention-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm"], capture_output=True,
                                    text=True)  # fmt: skip
            if result.returncode != 0:
                log.warning("building %s failed, CPU decode attention falls back to torch:\n%s", SOURCE.name,
                            result.stderr[-2000:])  # fmt: skip
                return None
            os.replace(built, target)  # atomic: processes building at once all end with a whole library
    library = ctypes.CDLL(str(target))
    for name in _FUNCTIONS.values():
        fn = getattr(library, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float]
    return library


_library: ctypes.CDLL | None | bool = False  # False: not loaded yet


def _get_library() -> ctypes.CDLL | None:
    global _library
    if _library is False:
        _library = load_library()
    return _library


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float) -> torch.Tensor | None:
    """q (seqs, heads, head_dim) over each sequence's cache, or None where the C kernel does not apply."""
    library = _get_library()
    fn_name = _FUNCTIONS.get(q.dtype)
    if library is None or fn_name is None or q.device.type != "cpu" or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    seqs, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    status = getattr(library, fn_name)(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
        seqs, heads, kv_heads, head_dim, block_size, tables.shape[1], scale,
    )  # fmt: skip
    return out if status == 0 else None


def paged_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Same contract as attention.paged_attention."""
    nd = meta.num_decodes
    decoded = decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale) if nd else None
    if nd and decoded is None:
        return paged_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = decoded
    prefill_attention(q, k_cache, v_cache, meta, scale, out)
    return out
