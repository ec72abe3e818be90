"""Kernel benchmark for a CUDA machine: the Triton kernels against the torch references and SDPA.

    python benchmarks/kernels.py [--dtype bf16|fp16]

1. Checks the Triton kernels against the torch references in fp16 and bf16.
2. Measures the card: copy bandwidth (a large device-to-device copy) and bf16 matmul rate.
3. Times (median of triton.testing.do_bench) paged attention for decode, prefill and a mixed SplitFuse batch
   against torch's scaled_dot_product_attention over the same sequences laid out as a padded dense batch, and
   the rotary/KV-write and RMSNorm kernels against their torch references.
Prints markdown tables; exits with status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from fastgen.kernels import TORCH_KERNELS, rope_cos_sin, rope_inv_freq, select_kernels
from fastgen.testing import PagedBatch, make_paged_batch

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DEVICE = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}  # relative error ‖out − ref‖ / ‖ref‖


# ---------------------------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------------------------


# The benchmark's model shape, on the card; no spare blocks.
SHAPE = dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, device=DEVICE, spare_blocks=0)


def padded_dense(b: PagedBatch):
    """The same attention for SDPA: (q, k, v, mask), queries padded to the longest chunk (seqs, heads, Lq, d),
    keys to the longest sequence (seqs, kv_heads, Lk, d); mask (seqs, 1, Lq, Lk) or None when no padding or
    chunk offset needs one (then every query sees all keys, or the batch is plain causal prefill)."""
    seqs, lq, lk = len(b.q_lens), max(b.q_lens), max(b.seq_lens)
    block_size = b.k_cache.shape[1]
    tables = b.meta.block_tables[:, : -(-lk // block_size)].long()
    k, v = (c[tables].flatten(1, 2)[:, :lk].transpose(1, 2).contiguous() for c in (b.k_cache, b.v_cache))
    q = b.q.new_zeros(seqs, b.q.shape[1], lq, b.q.shape[2])
    starts = b.meta.query_start_host
    for i, n in enumerate(b.q_lens):
        q[i, :, :n] = b.q[starts[i] : starts[i] + n].transpose(0, 1)
    if len(set(b.q_lens)) == 1 and len(set(b.seq_lens)) == 1 and b.q_lens[0] in (1, b.seq_lens[0]):
        return q, k, v, None
    seq_lens = torch.tensor(b.seq_lens, device=q.device)[:, None, None]
    q_lens = torch.tensor(b.q_lens, device=q.device)[:, None, None]
    rows = torch.arange(lq, device=q.device)[None, :, None]
    keys = torch.arange(lk, device=q.device)[None, None, :]
    # Padding rows see key 0 only, so they stay finite; they are not part of the result.
    mask = keys <= seq_lens - q_lens + torch.minimum(rows, q_lens - 1)  # (seqs, Lq, Lk)
    return q, k, v, mask[:, None]


def attention_work(b: PagedBatch) -> tuple[float, float]:
    """(bytes, flops) that paged attention must move and compute: every cached K/V row once, q and the output
    once; 4 flops per (query head, visible key, dim). The shape is read from the batch."""
    elem = b.q.element_size()
    heads, kv_heads, head_dim = b.q.shape[1], b.k_cache.shape[2], b.k_cache.shape[3]
    kv_bytes = 2 * sum(b.seq_lens) * kv_heads * head_dim * elem
    q_bytes = 2 * b.q.numel() * elem
    pairs = sum(n * (s - n) + n * (n + 1) // 2 for n, s in zip(b.q_lens, b.seq_lens))
    return kv_bytes + q_bytes, 4.0 * pairs * heads * head_dim


# ---------------------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------------------


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def run_checks(triton_k, torch_k, device: str = DEVICE) -> list[tuple[str, str, float, float]]:
    """(check, dtype, relative error, tolerance) rows."""
    rows = []
    shape = dict(SHAPE, device=device)
    cos_sin = rope_cos_sin(rope_inv_freq(HEAD_DIM, 500000.0), 8192).to(device)
    for dtype in (torch.float16, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        tol = TOLERANCE[dtype]
        for block_size in (16, 32):
            # decodes first, then a whole prompt and a chunk that starts mid-block
            b = make_paged_batch(
                [1] * 6 + [200, 300],
                [1, 17, 100, 513, 1500, 2048, 200, 1000 + 7],
                block_size=block_size,
                dtype=dtype,
                **shape,
            )
            out = triton_k.paged_attention(b.q, b.k_cache, b.v_cache, b.meta, HEAD_DIM**-0.5)
            ref = torch_k.paged_attention(b.q, b.k_cache, b.v_cache, b.meta, HEAD_DIM**-0.5)
            err = rel_err(out, ref)
            rows.append((f"paged_attention mixed, block {block_size}", name, err, tol))

        b = make_paged_batch([1] * 4 + [64], [30, 300, 700, 1200, 500], block_size=16, dtype=dtype, **shape)
        tokens = b.q.shape[0]
        k, v = (torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=dtype, device=device) for _ in "kv")
        positions = torch.randint(0, 8192, (tokens,), device=device)
        caches = [(b.k_cache.clone(), b.v_cache.clone()) for _ in range(2)]
        q_out = triton_k.rotary_write_kv(b.q, k, v, cos_sin, positions, *caches[0], b.meta.slot_mapping)
        q_ref = torch_k.rotary_write_kv(b.q, k, v, cos_sin, positions, *caches[1], b.meta.slot_mapping)
        written = [c.flatten(0, 1)[b.meta.slot_mapping] for pair in caches for c in pair]  # k0, v0, k1, v1
        err = max(rel_err(q_out, q_ref), rel_err(written[0], written[2]), rel_err(written[1], written[3]))
        rows.append(("rotary_write_kv (q, written k and v)", name, err, tol))

        x, residual = (torch.randn(300, 4096, dtype=dtype, device=device) for _ in range(2))
        weight = torch.randn(4096, dtype=dtype, device=device)
        out, new_res = triton_k.add_rms_norm(x, residual, weight, 1e-5)
        ref, ref_res = torch_k.add_rms_norm(x, residual, weight, 1e-5)
        err = max(rel_err(out, ref), rel_err(new_res, ref_res))
        rows.append(("add_rms_norm (out, residual)", name, err, tol))
        err = rel_err(triton_k.rms_norm(x, weight, 1e-5), torch_k.rms_norm(x, weight, 1e-5))
        rows.append(("rms_norm", name, err, tol))
        rows += quantized_linear_checks(triton_k, dtype, device)
    return rows


def quantized_linear_checks(
    triton_k, dtype: torch.dtype, device: str, features: int = 4096
) -> list[tuple[str, str, float, float]]:
    """The quantized linear layers at a Llama-3-8B projection's shape (features x features), a decode batch and a
    prompt: AWQ-style int4 in groups of 128 (in order, and in act-order's permuted order) against F.linear on its
    values in the dtype; fp8 against the same E4M3 operands multiplied in float64."""
    from fastgen.kernels.fp8 import fp8_linear_reference, quantize_fp8
    from fastgen.kernels.int4 import Int4Tensor, pack_nibbles

    name, tol, rows = str(dtype).removeprefix("torch."), TOLERANCE[dtype], []
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (features, features), generator=gen)
    zeros = torch.randint(0, 16, (features, features // 128), generator=gen).to(torch.uint8)
    scales = (torch.rand(features, features // 128, generator=gen) * 0.004 + 0.001).half()
    for order, perm in (("in order", None), ("act-order", torch.randperm(features, generator=gen))):
        weight = Int4Tensor(pack_nibbles(q), scales, zeros, 128, perm)
        packed = triton_k.pack_quantized([(0, weight)], features)
        dense = weight.dequantize().to(device=device, dtype=dtype)
        for tokens in (1, 300):
            x = torch.randn(tokens, features, dtype=dtype, device=device)
            err = rel_err(triton_k.linear(x, None, None, packed), F.linear(x, dense))
            rows.append((f"int4 linear, {order}, {tokens} rows", name, err, tol))
    fp8 = quantize_fp8(torch.randn(features, features, device=device) * 0.02)
    packed = triton_k.pack_quantized([(0, fp8)], features)
    for tokens in (1, 300):
        x = torch.randn(tokens, features, dtype=dtype, device=device)
        err = rel_err(triton_k.linear(x, None, None, packed), fp8_linear_reference(x, packed))
        rows.append((f"fp8 linear, {tokens} rows", name, err, tol))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------


def bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def card_peaks(device=DEVICE, copy_bytes: int = 2**30, n: int = 8192, timer=None) -> tuple[float, float]:
    """(copy bytes/s, bf16 matmul flop/s) measured on this card; smaller sizes and another timer (ms of a call)
    let the GPU suite's dry run take the same path on a CPU."""
    timer = timer or bench_ms
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)  # 1 GiB by default: far past any cache
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / (timer(lambda: dst.copy_(src)) * 1e-3)  # read + write
    src = dst = None  # frees the card's memory before the matmul
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    matmul = 2 * n**3 / (timer(lambda: a @ b) * 1e-3)
    return copy, matmul


def attention_rate(kernels, b: PagedBatch, timer=None) -> tuple[float, float, float]:
    """(ms, bytes/s, flop/s) of the kernels' paged attention over one batch."""
    head_dim = b.q.shape[2]
    ms = (timer or bench_ms)(lambda: kernels.paged_attention(b.q, b.k_cache, b.v_cache, b.meta, head_dim**-0.5))
    nbytes, flops = attention_work(b)
    return ms, nbytes / (ms * 1e-3), flops / (ms * 1e-3)


def sdpa_ms(q, k, v, mask, causal) -> tuple[float, str]:
    """Fastest of SDPA with enable_gqa and SDPA on K/V repeated to every query head (some backends only take
    the latter); (ms, which)."""
    group = q.shape[1] // k.shape[1]
    k_full, v_full = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    variants = {
        "gqa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True),
        "repeated kv": lambda: F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask, is_causal=causal),
    }
    times = {}
    for name, fn in variants.items():
        try:
            times[name] = bench_ms(fn)
        except RuntimeError as e:  # a backend refusing this shape/mask combination
            print(f"SDPA {name}: {e}", file=sys.stderr)
    if not times:
        return float("nan"), "failed"
    best = min(times, key=times.get)
    return times[best], best


def attention_rows(triton_k, dtype, copy_bw, matmul_flops) -> list[str]:
    cases = {
        "decode 64 × 2048": ([1] * 64, [2048] * 64),
        "prefill 4 × 2048": ([2048] * 4, [2048] * 4),
        # SplitFuse: 4 prompt chunks of 512 tokens at different depths, 60 decodes
        "mixed 4 chunks × 512 + 60 decodes": ([1] * 60 + [512] * 4, [2048] * 60 + [512, 1024, 1536, 2048]),
    }
    rows = []
    for label, (q_lens, seq_lens) in cases.items():
        for block_size in (16, 32):
            b = make_paged_batch(q_lens, seq_lens, block_size=block_size, dtype=dtype, **SHAPE)
            ours, bw, rate = attention_rate(triton_k, b)
            q, k, v, mask = padded_dense(b)
            causal = mask is None and b.q_lens[0] > 1
            theirs, variant = sdpa_ms(q, k, v, mask, causal)
            rows.append(
                f"| {label} | {block_size} | {ours:.3f} | {theirs:.3f} ({variant}) | {theirs / ours:.2f}× "
                f"| {bw / 1e9:.0f} ({100 * bw / copy_bw:.0f}%) | {rate / 1e12:.1f} ({100 * rate / matmul_flops:.0f}%) |"
            )
            b = q = k = v = mask = None  # frees the card's memory for the next case
            torch.cuda.empty_cache()
    return rows


def fused_cases(dtype, tokens: int = 8192, hidden: int = 4096, shape: dict = SHAPE):
    """The fused kernels over one prompt of `tokens` tokens: (label, make, bytes) with make(kernels) a call to
    time and bytes what it must move. `shape` as SHAPE (the GPU suite's dry run passes a small one on the CPU)."""
    device = shape["device"]
    b = make_paged_batch([tokens], [tokens], block_size=16, dtype=dtype, **shape)
    kv_heads, head_dim = b.k_cache.shape[2], b.k_cache.shape[3]
    x, residual = (torch.randn(tokens, hidden, dtype=dtype, device=device) for _ in range(2))
    weight = torch.randn(hidden, dtype=dtype, device=device)
    elem = x.element_size()
    norm_bytes = 4 * tokens * hidden * elem  # read x, residual; write out, residual

    k, v = (torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device=device) for _ in "kv")
    cos_sin = rope_cos_sin(rope_inv_freq(head_dim, 500000.0), tokens).to(device)
    positions = torch.arange(tokens, device=device)
    rotary_bytes = 2 * b.q.numel() * elem + 4 * k.numel() * elem  # q read + written; k, v read + written to cache

    def norm(kernels):
        return lambda: kernels.add_rms_norm(x, residual, weight, 1e-5)

    def rotary(kernels):
        return lambda: kernels.rotary_write_kv(b.q, k, v, cos_sin, positions, b.k_cache, b.v_cache, b.meta.slot_mapping)

    return [
        (f"add_rms_norm {tokens} × {hidden}", norm, norm_bytes),
        (f"rotary_write_kv {tokens} tokens", rotary, rotary_bytes),
    ]


def other_rows(triton_k, torch_k, dtype, copy_bw) -> list[str]:
    rows = []
    for label, make, nbytes in fused_cases(dtype):
        ours, theirs = bench_ms(make(triton_k)), bench_ms(make(torch_k))
        bw = nbytes / (ours * 1e-3)
        speed = f"{theirs / ours:.2f}×"
        rows.append(f"| {label} | {ours:.3f} | {theirs:.3f} | {speed} | {bw / 1e9:.0f} ({100 * bw / copy_bw:.0f}%) |")
    return rows


# ---------------------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="dtype of the timed runs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU, and torch sees none here: nothing to measure.", file=sys.stderr)
        return 2

    import triton

    triton_k = select_kernels("triton", "cuda")
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}: torch {torch.__version__}, triton {triton.__version__}\n")

    checks = run_checks(triton_k, TORCH_KERNELS)
    print("## Checks against the torch references\n")
    print("| check | dtype | relative error | result |\n|---|---|---|---|")
    for name, dt, err, tol in checks:
        print(f"| {name} | {dt} | {err:.2e} | {'ok' if err < tol else f'FAIL (tolerance {tol:.0e})'} |")

    copy_bw, matmul_flops = card_peaks()
    print(f"\n## Card\n\ncopy bandwidth {copy_bw / 1e9:.0f} GB/s, bf16 matmul {matmul_flops / 1e12:.0f} TFLOP/s\n")

    print(f"## Paged attention ({args.dtype}, {HEADS} q heads / {KV_HEADS} kv heads, head_dim {HEAD_DIM})\n")
    print("Bandwidth counts each cached K/V row, q and the output once; FLOP/s counts the causal work only.\n")
    header = [
        "batch",
        "block",
        "triton ms",
        "SDPA ms (padded)",
        "speedup",
        "triton GB/s (% copy)",
        "triton TFLOP/s (% matmul)",
    ]
    print("| " + " | ".join(header) + " |\n" + "|---" * len(header) + "|")
    for row in attention_rows(triton_k, dtype, copy_bw, matmul_flops):
        print(row, flush=True)

    print(f"\n## Other kernels ({args.dtype})\n")
    print("| kernel | triton ms | torch ms | speedup | triton GB/s (% copy) |\n|---|---|---|---|---|")
    for row in other_rows(triton_k, TORCH_KERNELS, dtype, copy_bw):
        print(row, flush=True)

    failed = [c for c in checks if not c[2] < c[3]]
    if failed:
        print(f"\n{len(failed)} check(s) FAILED", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
