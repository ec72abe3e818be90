"""CPU kernel benchmark, bfloat16: the two kernels a decode step spends its time in.

    python -m fastgen.benchmarks.cpu_kernels [--repeats 5] [--threads 1] [--linear-only | --prompt-only | ...]

1. Linear layers: every linear layer of SmolLM2-135M (the LM head included) at 1 to 512 rows, the packed bfloat16
   kernel this CPU runs (kernels/csrc/linear.c on AMX, else kernels/csrc/linear_dpbf16.c on AVX-512 BF16) against
   oneDNN with its weight packed once, both reading weights that are not in cache (the whole model per pass, as a
   forward pass does), paired; the weight bytes per second at each size against the host's read bandwidth.
2. Decode attention: 64 sequences x 400 cached tokens (SmolLM2's 9 query / 3 KV heads of 64), 30 layers' caches in
   turn, the C kernel against the torch reference; bytes of K/V read per second.
3. Prompt attention, float32 and bfloat16: one prompt chunk over its cached history (also under a sliding window), as
   the CPU kernels attend it (the AMX prompt kernel, kernels/csrc/prefill_attention.c, for bfloat16 where there is
   AMX, else the AVX-512 prompt kernel, kernels/csrc/prefill_attention_avx512.c) against every row through the C
   decode kernel (the fallback; paired, order alternating) and torch's CPU attention, whose results depend on the
   thread count. Where AMX runs, the windowed bfloat16 chunk also on the AVX-512 prompt kernel, which took it before
   the AMX kernel had a window.
4. Linear layers, float32: every linear layer of SmolLM2-135M at 1 to 2048 rows (the LM head up to 64, the most rows
   a step samples), the batch-invariant AVX-512/AVX2 kernel on its packed weights (kernels/csrc/linear_f32.c) against
   torch's F.linear (MKL's sgemm) on the plain ones, weights not in cache; also the FLOP/s at each size. The
   MLP's gate/up layer counts with its SiLU(gate) * up: sgemm then the C silu_mul, against the fused kernel.
5. The gate/up layers alone, float32: the linear kernel then the C silu_mul (two passes, the (rows, 2 intermediate)
   products through memory) against the fused kernel (kernels/csrc/linear_f32.c linear_f32_silu_mul).
6. Quantized linear layers (--quant-only): every linear layer of SmolLM2-135M in each GGUF block type the quantized
   kernels read (kernels/csrc/linear_quant.c; the embedded file's own Q4_1 layers with its Q8_0 LM head, and the
   same shapes in every other type, random blocks), at 1 to 430 rows: ms per pass over all layers, weight GB/s
   against the host's read bandwidth (a float32 sum over 1 GiB); decode rows also in bfloat16, which take the
   int8-activation kernel (kernels/csrc/linear_q8.c) where the CPU has AVX-512 VNNI, and a bfloat16 prompt, which
   takes one bfloat16 GEMM on the weights dequantized for the call where the CPU has AMX or AVX-512 BF16.
   Then the bfloat16 rows' crossover (also alone: --quant-rows-only): the file's layers (LM head aside) at 1 to 128
   rows through each path: the exact kernel, int8 activations (VNNI, and on AMX-INT8 tiles where the CPU has them:
   kernels/csrc/linear_amx_q8.c, the fused decode layer's past 8 decode rows), dequantized per call then a bfloat16
   GEMM, dequantized in panels into the GEMM's tiles, and bfloat16 weights held (none).
7. One stream's decode through the whole engine (--quant-only): tokens/s of the embedded model served quantized
   (quantization auto, bfloat16 and float32) against dequantized to bfloat16 (none), the same prompt, greedy, EOS
   ignored.
8. Quantized experts (--moe-quant-only): one mixture-of-experts layer's experts in GGUF blocks (random: Mixtral's
   proportions in Q8_0, int8's blocks; Qwen3-MoE's in Q4_0), a bfloat16 decode batch of 1 to 16 tokens routed at
   random: csrc/moe_quant.c's one call against the Python loop over experts it replaced (paired, order alternating).
The kernels and oneDNN split their work over --threads threads. Medians of --repeats; prints markdown tables.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fastgen.kernels import AttentionMetadata, cpu, paged_attention


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_s(first, second, repeats: int) -> tuple[float, float, float]:
    """Both timed in turn, the order alternating: their median times and the median of each pair's ratio
    (first / second), which a host whose speed drifts between the two affects least."""
    first(), second()  # warm-up
    a, b = [], []
    for i in range(repeats):
        for fn, times in ((first, a), (second, b)) if i % 2 == 0 else ((second, b), (first, a)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b), statistics.median(x / y for x, y in zip(a, b))


def linear_table(repeats: int) -> list[str]:
    from fastgen.replica import pipeline

    if cpu._packed_bf16_kernel() is None:
        return ["(no packed bfloat16 linear kernel runs on this machine: neither AMX nor AVX-512 BF16)"]
    name = "AMX" if cpu._amx() is not None else "vdpbf16ps"
    model = pipeline("smollm2-135m", dtype="bfloat16", quantization="none", progress=False).engine.runner.model
    # The layers hold only their packed tiles: the plain weights again, for oneDNN's own packing
    weights = [m.packed.bf16.unpacked() for m in model.modules() if getattr(m, "packed", None) is not None]
    tiles = [cpu.pack_linear(w) for w in weights]
    onednn_packed = [torch.ops.mkldnn._reorder_linear_weight(w, 512) for w in weights]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    bandwidth = read_bandwidth_gbs(repeats)
    rows = [
        f"Packed kernel: {name}; host read bandwidth (float32 sum over 1 GiB): {bandwidth:.1f} GB/s",
        "",
        f"| rows | oneDNN ms | {name} ms | {name} / oneDNN speed (median of pairs) | oneDNN weight GB/s "
        f"| {name} weight GB/s | {name} % of bandwidth |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in (1, 2, 4, 8, 16, 64, 128, 512):
        xs = {w.shape[1]: torch.randn(m, w.shape[1], dtype=torch.bfloat16) for w in weights}

        def onednn(xs=xs):
            for w, p in zip(weights, onednn_packed):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

        def packed(xs=xs):
            for w, p in zip(weights, tiles):
                cpu.linear_packed_bf16(xs[w.shape[1]], p, None)

        a, b, ratio = paired_s(onednn, packed, repeats)
        rows.append(
            f"| {m} | {a * 1e3:.2f} | {b * 1e3:.2f} | {ratio:.2f}x | {weight_bytes / a / 1e9:.1f} "
            f"| {weight_bytes / b / 1e9:.1f} | {100 * weight_bytes / b / 1e9 / bandwidth:.0f}% |"
        )
    return rows


def linear_f32_table(repeats: int) -> list[str]:
    from fastgen.replica import pipeline
    from fastgen.replica.parallel import ParallelLinear, ParallelLMHead

    model = pipeline("smollm2-135m", dtype="float32", quantization="none", progress=False).engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, ParallelLinear)]
    if any(layer.packed is None or layer.packed.f32 is None for layer in layers):
        return ["(the float32 linear kernel does not run on this machine)"]
    rows = [
        "| rows | F.linear (sgemm) ms | linear_f32 ms | linear_f32 / sgemm speed | sgemm GFLOP/s "
        "| linear_f32 GFLOP/s |",
        "|---|---|---|---|---|---|",
    ]
    # The layers hold only their packed weights; sgemm gets each one unpacked, as torch keeps a weight.
    packed = [(layer.packed.f32, isinstance(layer, ParallelLMHead)) for layer in layers]
    plain = [p.unpacked().contiguous() for p, _ in packed]
    for m in (1, 2, 4, 8, 16, 64, 512, 2048):
        chosen = [(p, w) for (p, is_head), w in zip(packed, plain) if m <= 64 or not is_head]
        xs = {w.shape[1]: torch.randn(m, w.shape[1]) for _, w in chosen}
        flops = sum(2 * m * w.shape[0] * w.shape[1] for _, w in chosen)

        def sgemm(xs=xs, chosen=chosen):
            for p, w in chosen:
                y = torch.nn.functional.linear(xs[w.shape[1]], w)
                if p.gated:
                    cpu.silu_mul_cpu(y)

        def ours(xs=xs, chosen=chosen):
            for p, _ in chosen:
                if p.gated:
                    cpu.linear_f32_silu_mul(xs[p.in_features], p)
                else:
                    cpu.linear_f32(xs[p.in_features], p, None)

        reps = repeats if m <= 512 else max(1, repeats // 2)
        a, b = median_s(sgemm, reps), median_s(ours, reps)
        rows.append(
            f"| {m} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.2f}x | {flops / a / 1e9:.0f} | {flops / b / 1e9:.0f} |"
        )
    return rows


def attention_table(repeats: int) -> list[str]:
    seqs, length, heads, kv_heads, head_dim, block, layers = 64, 400, 9, 3, 64, 16, 30
    per_seq = -(-length // block)
    caches = [
        (
            torch.randn(seqs * per_seq, block, kv_heads, head_dim, dtype=torch.bfloat16),
            torch.randn(seqs * per_seq, block, kv_heads, head_dim, dtype=torch.bfloat16),
        )
        for _ in range(layers)
    ]
    # blocks handed out round-robin, as sequences that grow together get them
    tables = torch.arange(seqs * per_seq, dtype=torch.int32).view(per_seq, seqs).t().contiguous()
    lens = torch.full((seqs,), length, dtype=torch.int32)
    q = torch.randn(seqs, heads, head_dim, dtype=torch.bfloat16)
    meta = AttentionMetadata(
        torch.arange(seqs + 1, dtype=torch.int32),
        lens,
        tables,
        torch.zeros(seqs, dtype=torch.int64),
        seqs,
        1,
        length,
        list(range(seqs + 1)),
        [length] * seqs,
    )

    def c_kernel():
        for k, v in caches:
            assert cpu.decode_attention(q, k, v, tables, lens, head_dim**-0.5) is not None

    def torch_reference():
        for k, v in caches[:3]:  # slow: three layers stand for all
            paged_attention(q, k, v, meta, head_dim**-0.5)

    kv_bytes = seqs * length * kv_heads * head_dim * 2 * 2
    c = median_s(c_kernel, repeats) / layers
    t = median_s(torch_reference, max(1, repeats // 2)) / 3
    return [
        "| kernel | ms per layer | K/V GB/s |",
        "|---|---|---|",
        f"| C (csrc/decode_attention.c) | {c * 1e3:.2f} | {kv_bytes / c / 1e9:.1f} |",
        f"| torch reference | {t * 1e3:.2f} | {kv_bytes / t / 1e9:.1f} |",
    ]


def prompt_attention_table(repeats: int) -> list[str]:
    from fastgen.kernels.attention import paged_attention as torch_attention
    from fastgen.testing import make_paged_batch

    rows = [
        "| dtype | chunk / sequence | window | CPU kernels ms | rows as decodes ms | torch ms "
        "| CPU kernels / rows as decodes | CPU kernels / torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for chunk, length, window in ((128, 128, 0), (512, 512, 0), (512, 1024, 0), (512, 1024, 256)):
            torch.manual_seed(0)
            b = make_paged_batch([chunk], [length], heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
            tables, lens = cpu.rows_as_decodes(b.meta)
            starts = cpu.window_starts(lens, window)

            def as_decodes(b=b, tables=tables, lens=lens, starts=starts):
                out = torch.empty_like(b.q)
                assert cpu.decode_attention(b.q, b.k_cache, b.v_cache, tables, lens, 0.125, out, starts) is not None

            def ours(b=b, window=window):
                cpu.paged_attention_cpu(b.q, b.k_cache, b.v_cache, b.meta, 0.125, window)

            def theirs(b=b, window=window):
                torch_attention(b.q, b.k_cache, b.v_cache, b.meta, 0.125, window)

            ours_s, decodes_s = paired_s(ours, as_decodes, repeats)[:2]
            theirs_s = median_s(theirs, repeats)
            name = str(dtype).removeprefix("torch.")
            rows.append(
                f"| {name} | {chunk} / {length} | {window or '–'} | {ours_s * 1e3:.2f} | {decodes_s * 1e3:.2f} "
                f"| {theirs_s * 1e3:.2f} | {ours_s / decodes_s:.2f} | {ours_s / theirs_s:.2f} |"
            )
            if window and dtype == torch.bfloat16 and cpu._amx_prefill_applies(b.q, b.k_cache, b.v_cache, b.q):

                def avx512(b=b, window=window):
                    out = torch.empty_like(b.q)
                    assert cpu._prefill_attention_avx512(b.q, b.k_cache, b.v_cache, b.meta, 0.125, out, window)

                avx_s, decodes_s = paired_s(avx512, as_decodes, repeats)[:2]
                rows.append(
                    f"| {name}, AVX-512 prompt kernel | {chunk} / {length} | {window} | {avx_s * 1e3:.2f} "
                    f"| {decodes_s * 1e3:.2f} | {theirs_s * 1e3:.2f} | {avx_s / decodes_s:.2f} "
                    f"| {avx_s / theirs_s:.2f} |"
                )
    return rows


def gate_up_f32_table(repeats: int) -> list[str]:
    from fastgen.replica import pipeline
    from fastgen.replica.parallel import GateUpParallelLinear

    model = pipeline("smollm2-135m", dtype="float32", quantization="none", progress=False).engine.runner.model
    gated = [m.packed.f32 for m in model.modules() if isinstance(m, GateUpParallelLinear)]
    if any(p is None or not p.gated for p in gated):
        return ["(the fused gate/up kernel does not run on this machine: it is built for AVX-512 only)"]
    plain = [cpu.pack_f32(p.unpacked()) for p in gated]
    rows = [
        "| rows | linear_f32 + silu_mul ms | fused ms | fused / two passes speed (median of pairs) | fused GFLOP/s |",
        "|---|---|---|---|---|",
    ]
    for m in (1, 4, 16, 64, 512, 2048):
        x = torch.randn(m, gated[0].in_features)
        flops = sum(2 * m * p.out_features * p.in_features for p in gated)

        def two_passes(x=x):
            for p in plain:
                cpu.silu_mul_cpu(cpu.linear_f32(x, p, None))

        def fused(x=x):
            for p in gated:
                cpu.linear_f32_silu_mul(x, p)

        a, b, ratio = paired_s(two_passes, fused, repeats)
        rows.append(f"| {m} | {a * 1e3:.1f} | {b * 1e3:.1f} | {ratio:.2f}x | {flops / b / 1e9:.0f} |")
    return rows


def read_bandwidth_gbs(repeats: int) -> float:
    """The host's memory read bandwidth: a float32 sum over 1 GiB, on the torch threads."""
    big = torch.ones(1 << 28)
    return big.numel() * 4 / median_s(big.sum, repeats) / 1e9


def quant_table(repeats: int) -> list[str]:
    from fastgen.kernels import quant
    from fastgen.replica import pipeline
    from fastgen.replica.parallel import ParallelLinear

    model = pipeline("smollm2-135m", dtype="float32", quantization="auto", progress=False).engine.runner.model
    layers = [m.packed for m in model.modules() if isinstance(m, ParallelLinear)]
    if not all(isinstance(p, quant.QuantLinear) for p in layers):
        return ["(the quantized kernels do not run on this machine)"]
    bandwidth = read_bandwidth_gbs(repeats)
    isa = quant.ISA_NAMES[quant.quant_kernels()[3].isa]
    rows = [
        f"Host read bandwidth (float32 sum over 1 GiB): {bandwidth:.1f} GB/s; quantized kernels' path: {isa}",
        "",
        "| weights | rows | activations | MiB | ms per pass | weight GB/s | share of read bandwidth | GFLOP/s |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def in_type(name: str, packed: quant.QuantLinear) -> quant.QuantLinear:
        number, weights, size = quant.GGML_TYPES[name]
        k = packed.in_features
        if k % weights:  # K-quants need 256 | k (ffn_down only in SmolLM2): llama.cpp falls back to Q5_0/Q8_0 there
            number, weights, size = quant.GGML_TYPES["Q8_0" if name == "Q6_K" else "Q5_0"]
        data = torch.randint(0, 256, (packed.out_features, k // weights * size), dtype=torch.uint8)
        blocks = data.view(packed.out_features, -1, size)
        half_at = [size - 2] if name == "Q6_K" else [0, 2]
        for at in half_at:  # sane float16 scales
            blocks[:, :, at : at + 2] = (
                torch.full(blocks.shape[:2], 0.01, dtype=torch.float16).view(torch.uint8).view(*blocks.shape[:2], 2)
            )
        tensor = quant.QuantizedTensor(data, number, (packed.out_features, k))
        return quant.pack_quantized([(0, tensor)], packed.out_features)

    sets = {"file (Q4_1, Q8_0 head)": layers}
    for name in quant.GGML_TYPES:
        sets[name] = [in_type(name, p) for p in layers]
    # each type's own kernel alone: the layers every type reads whole (ffn_down, 1,536 wide), 26.5M weights
    downs = [p for p in layers if p.in_features % 256 == 0 and p.out_features < 10000]
    for name in ("Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):
        sets[f"{name}, ffn_down only"] = [in_type(name, p) for p in downs]
    for label, chosen in sets.items():
        nbytes = sum(p.nbytes for p in chosen)
        int8 = all(p.int8 for p in chosen)
        gemm_rows = quant.bf16_gemm_rows()
        for m, dtype in [(1, torch.float32), (1, torch.bfloat16), (8, torch.float32), (8, torch.bfloat16)] + [
            (64, torch.float32),
            (430, torch.float32),
            (430, torch.bfloat16),
        ]:
            bf16_path = "bf16 (int8 blocks)" if m <= quant.INT8_MAX_ROWS and int8 else None
            if gemm_rows is not None and m >= gemm_rows:
                bf16_path = "bf16 (bf16 GEMM)"
            if dtype == torch.bfloat16 and bf16_path is None:
                continue
            xs = {p.in_features: torch.randn(m, p.in_features, dtype=dtype) for p in chosen}
            flops = sum(2 * m * p.out_features * p.in_features for p in chosen)

            def run(xs=xs, chosen=chosen):
                for p in chosen:
                    quant.quant_linear(xs[p.in_features], p, None)

            t = median_s(run, repeats if m <= 64 else max(1, repeats // 2))
            activations = "float32" if dtype == torch.float32 else bf16_path
            rows.append(
                f"| {label} | {m} | {activations} | {nbytes / 2**20:.0f} | {t * 1e3:.2f} | {nbytes / t / 1e9:.1f} "
                f"| {nbytes / t / 1e9 / bandwidth:.0%} | {flops / t / 1e9:.0f} |"
            )
    return rows


QUANT_ROWS = (1, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def quant_rows_table(repeats: int) -> list[str]:
    """Where a bfloat16 batch should leave the quantized kernels for one bfloat16 GEMM on the layer dequantized for
    the call (kernels/quant.py bf16_gemm_rows): the embedded model's quantized layers but the LM head, ms per pass over
    all of them at each row count, every path timed in turn (the order rotating) within each repeat; medians."""
    import torch.nn.functional as F

    from fastgen.kernels import quant
    from fastgen.replica import pipeline
    from fastgen.replica.parallel import ParallelLinear

    model = pipeline("smollm2-135m", dtype="bfloat16", quantization="auto", progress=False).engine.runner.model
    layers = [
        m.packed
        for m in model.modules()
        if isinstance(m, ParallelLinear) and isinstance(m.packed, quant.QuantLinear) and m.packed.out_features < 10000
    ]
    if not layers or quant.bf16_gemm_rows() is None:
        return ["(no bfloat16 GEMM on dequantized layers on this machine)"]
    # as quantization none holds them: packed once for the bfloat16 kernel this CPU runs (or oneDNN)
    held = [cpu.pack_weight(p.dequantized_bf16()) for p in layers]
    threads, weights = torch.get_num_threads(), sum(p.out_features * p.in_features for p in layers)

    def int8(x, p, amx=False):  # quant_linear's int8 branch at any number of rows (it takes it up to INT8_MAX_ROWS)
        y = torch.empty((x.shape[0], p.out_features), dtype=torch.bfloat16)
        for c in p.calls:
            run = quant.amx_int8_kernel() if amx else c.run_int8
            args = (c.weight, c.weight_stride, None, y.data_ptr() + 2 * c.start, p.out_features, x.shape[0], c.rows)
            assert run(x.data_ptr(), x.stride(0), *args, p.in_features, c.qtype, threads) == 0

    paths = {
        "exact float32 kernel": lambda xs, x32: [quant.quant_linear(x32[p.in_features], p, None) for p in layers],
        "int8 activations": lambda xs, x32: [int8(xs[p.in_features], p) for p in layers],
        # the fused decode layer's projections past INT8_MAX_ROWS decode rows (csrc/linear_amx_q8.c)
        "int8 activations, AMX": lambda xs, x32: [int8(xs[p.in_features], p, amx=True) for p in layers],
        "dequantized per call, bf16 GEMM": lambda xs, x32: [
            F.linear(xs[p.in_features], p.dequantized_bf16()) for p in layers
        ],
        "dequantized in panels, fused": lambda xs, x32: [
            quant.fused_bf16_linear(xs[p.in_features], p, None) for p in layers
        ],
        "bf16 weights held": lambda xs, x32: [
            cpu.linear(xs[p.in_features], None, None, w) for p, w in zip(layers, held)
        ],
        "dequantize alone": lambda xs, x32: [p.dequantized_bf16().data_ptr() for p in layers],  # each freed at once
    }
    if not all(p.int8 for p in layers):
        del paths["int8 activations"]
    if not all(p.int8 for p in layers) or quant.amx_int8_kernel() is None:
        del paths["int8 activations, AMX"]
    if quant.fused_bf16_kernel() is None:
        del paths["dequantized in panels, fused"]
    inputs = {}
    for m in QUANT_ROWS:
        xs = {k: torch.randn(m, k).bfloat16() for k in {p.in_features for p in layers}}
        inputs[m] = xs, {k: x.float() for k, x in xs.items()}
    times: dict[tuple[int, str], list[float]] = {(m, name): [] for m in QUANT_ROWS for name in paths}
    for r in range(repeats + 1):  # the first round warms up
        for m in QUANT_ROWS:
            names = list(paths)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                start = time.perf_counter()
                paths[name](*inputs[m])
                if r:
                    times[m, name].append(time.perf_counter() - start)
    ms = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    dequantize = statistics.median(ms[m, "dequantize alone"] for m in QUANT_ROWS)
    shown = [name for name in paths if name != "dequantize alone"]
    rows = [
        f"{len(layers)} quantized layers, {weights / 1e6:.0f}M weights, {threads} threads: dequantize_rows_bf16 "
        f"{dequantize:.1f} ms ({weights / dequantize / 1e6:.1f} G weights/s); bf16_gemm_rows() = "
        f"{quant.bf16_gemm_rows()}",
        "",
        "| rows | " + " | ".join(f"{name}, ms" for name in shown) + " | fastest from the blocks |",
        "|---|" + "---|" * (len(shown) + 1),
    ]
    for m in QUANT_ROWS:
        fastest = min((name for name in shown if name != "bf16 weights held"), key=lambda name: ms[m, name])
        rows.append(f"| {m} | " + " | ".join(f"{ms[m, name]:.1f}" for name in shown) + f" | {fastest} |")
    return rows


def decode_table(repeats: int) -> list[str]:
    from fastgen.replica import pipeline

    prompt, tokens = "Write a long story about a lighthouse keeper.", 128
    rows = ["| weights | one stream decode tok/s (median) |", "|---|---|"]
    from fastgen.replica.weights import default_dtype

    # the dtype left to auto: bfloat16 where the CPU computes it, else float32 with int8 decode rows (Zen 3)
    auto = "bfloat16" if default_dtype(torch.device("cpu")) == torch.bfloat16 else "float32, int8 decode rows"
    pipes = {
        f"GGUF Q4_1 served quantized (auto), dtype auto ({auto}), one C call a layer": pipeline(
            "smollm2-135m", dtype=None, quantization="auto", progress=False
        ),
        "GGUF Q4_1 served quantized (auto), bfloat16: int8 activations, one C call a layer": pipeline(
            "smollm2-135m", dtype="bfloat16", quantization="auto", progress=False
        ),
        "GGUF Q4_1 served quantized (auto), float32: exact": pipeline(
            "smollm2-135m", dtype="float32", quantization="auto", progress=False
        ),
        "dequantized to bfloat16 (none)": pipeline(
            "smollm2-135m", dtype="bfloat16", quantization="none", progress=False
        ),
    }
    results: dict[str, list[float]] = {name: [] for name in pipes}
    for pipe in pipes.values():
        pipe([prompt], max_new_tokens=8, ignore_eos=True)  # warm-up
    for _ in range(repeats):  # interleaved
        for name, pipe in pipes.items():
            start = time.perf_counter()
            out = pipe([prompt], max_new_tokens=tokens, min_new_tokens=tokens)[0]
            results[name].append(len(out.token_ids) / (time.perf_counter() - start))
    for name, values in results.items():
        rows.append(f"| {name} | {statistics.median(values):.1f} |")
    return rows


def moe_quant_table(repeats: int) -> list[str]:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from fastgen.kernels import cpu_moe, moe, quant

    def blocks(w: torch.Tensor, qtype: str) -> list:
        data = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType[qtype])).reshape(w.shape[0], -1)
        return [(0, quant.QuantizedTensor(data, int(GGMLQuantizationType[qtype]), (w.shape[0], w.shape[1])))]

    kernel = cpu_moe._moe_quant
    rows = ["| experts | tokens | one call ms | Python loop ms | loop ÷ call |", "|---|---|---|---|---|"]
    shapes = {
        "Mixtral-like, 8 of 2816, top 2, Q8_0": (8, 1024, 2816, 2, "Q8_0"),
        "Qwen3-MoE-like, 32 of 512, top 4, Q4_0": (32, 1024, 512, 4, "Q4_0"),
    }
    for name, (experts, hidden, inter, k, qtype) in shapes.items():
        g = torch.Generator().manual_seed(0)
        w13 = [blocks(torch.randn(2 * inter, hidden, generator=g) * 0.05, qtype) for _ in range(experts)]
        w2 = [blocks(torch.randn(hidden, inter, generator=g) * 0.05, qtype) for _ in range(experts)]
        packed = cpu.CPU_KERNELS.pack_quantized_experts(w13, w2)
        for tokens in (1, 8, 16):
            x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
            routing = moe.route(torch.randn(tokens, experts, generator=g), k, True)

            def layer(use_kernel: bool, x=x, routing=routing, packed=packed):
                cpu_moe._moe_quant = kernel if use_kernel else lambda: None
                for _ in range(20):
                    cpu.CPU_KERNELS.fused_moe(x, None, None, packed, routing)

            call, loop, ratio = paired_s(lambda: layer(True), lambda: layer(False), repeats)
            rows.append(f"| {name} | {tokens} | {call / 20 * 1e3:.3f} | {loop / 20 * 1e3:.3f} | {1 / ratio:.2f}× |")
    cpu_moe._moe_quant = kernel
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--linear-only", action="store_true", help="only the packed bfloat16 linear table")
    p.add_argument("--prompt-only", action="store_true", help="only the prompt-attention table")
    p.add_argument("--linear-f32-only", action="store_true", help="only the float32 linear tables")
    p.add_argument("--quant-only", action="store_true", help="only the quantized linear and decode tables")
    p.add_argument("--moe-quant-only", action="store_true", help="only the quantized experts' table")
    p.add_argument("--quant-rows-only", action="store_true", help="only the bfloat16 rows' crossover table")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.quant_only:
        tables = [quant_table, quant_rows_table, decode_table]
    elif args.moe_quant_only:
        tables = [moe_quant_table]
    elif args.quant_rows_only:
        tables = [quant_rows_table]
    elif args.linear_only:
        tables = [linear_table]
    elif args.prompt_only:
        tables = [prompt_attention_table]
    elif args.linear_f32_only:
        tables = [linear_f32_table, gate_up_f32_table]
    else:
        tables = [
            linear_table,
            attention_table,
            prompt_attention_table,
            linear_f32_table,
            gate_up_f32_table,
            quant_table,
            quant_rows_table,
        ]
    print("\n\n".join("\n".join(table(args.repeats)) for table in tables))


if __name__ == "__main__":
    main()
