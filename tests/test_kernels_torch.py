"""The torch kernels and the CPU (C) kernels against plain dense computations, on ragged batches over a paged cache.

Every case has a fixed seed, so a run is reproducible; `python -m fastgen.benchmarks.kernel_sweep --seconds N` draws
fresh random cases and prints the seeds of any that fail."""

import contextlib
import math
import random

import pytest
import torch

from fastgen.kernels import add_rms_norm, paged_attention, rms_norm, rotary_write_kv
from fastgen.kernels.rotary import rope_cos_sin, rope_inv_freq
from fastgen.testing import cpu_attention_case, dense_attention, make_paged_batch

from .helpers import require_tool


@contextlib.contextmanager
def torch_threads(n):
    """The C kernels split their work over torch's thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def in_threads(n, fn, *args):
    with torch_threads(n):
        return fn(*args)


# Three threads: shares that do not divide evenly. Every output is computed by one thread in a fixed order, so the
# results must equal one thread's bit for bit.
THREADS = 3


@pytest.fixture
def forbid(monkeypatch):
    """forbid(module, name, ...): each named torch fallback of `module` raises when called, so a test proves that the
    C path served."""

    def forbid(module, *names):
        for name in names:

            def fallback(*args, _name=name, **kwargs):
                raise AssertionError(f"fell back to torch's {_name}")

            monkeypatch.setattr(module, name, fallback)

    return forbid


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_paged_attention_matches_dense(seed, block_size, kind):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    decodes = [(rng.randrange(0, 300), 1) for _ in range(rng.randrange(1, 6))] if kind != "prefill" else []
    prefills = (
        [(rng.choice([0, rng.randrange(1, 200)]), rng.randrange(2, 70)) for _ in range(3)] if kind != "decode" else []
    )
    seqs = decodes + prefills
    batch = make_paged_batch(
        [new for _, new in seqs],
        [cached + new for cached, new in seqs],
        heads=2 * rng.choice([1, 2, 3]),
        kv_heads=2,
        head_dim=16,
        block_size=block_size,
        rng=rng,
        spare_blocks=8,
        num_decodes=len(decodes),
    )
    scale = 1 / math.sqrt(16)
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale)
    assert torch.allclose(out, dense_attention(batch, scale), atol=1e-5, rtol=1e-4), f"seed {seed}"


def test_rotary_write_kv_rotates_and_writes_only_its_slots():
    tokens, heads, kv_heads, d = 5, 4, 2, 8
    q, k, v = torch.randn(tokens, heads, d), torch.randn(tokens, kv_heads, d), torch.randn(tokens, kv_heads, d)
    positions = torch.tensor([0, 3, 7, 8, 100])
    cos_sin = rope_cos_sin(rope_inv_freq(d, 10000.0), 128)
    k_cache, v_cache = torch.zeros(4, 4, kv_heads, d), torch.zeros(4, 4, kv_heads, d)
    slots = torch.tensor([1, 6, 9, 14, 15])
    q_rot = rotary_write_kv(q.clone(), k, v, cos_sin, positions, k_cache, v_cache, slots)

    def rotate(x, pos):  # complex-number form of rotate-half rope
        half = d // 2
        angle = pos[:, None] * rope_inv_freq(d, 10000.0)[None, :]
        c = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angle), angle)[:, None, :]
        return torch.cat([c.real, c.imag], dim=-1)

    assert torch.allclose(q_rot, rotate(q, positions.float()), atol=1e-5)
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    assert torch.allclose(flat_k[slots], rotate(k, positions.float()), atol=1e-5)
    assert torch.equal(flat_v[slots], v)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=500000.0, rope_scaling=scaling)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_inv_freq(16, 500000.0, (8.0, 1.0, 4.0, 64))
    assert torch.allclose(ours, ref.float())


def test_rms_norm_and_fused_residual():
    x, r, w = torch.randn(7, 32), torch.randn(7, 32), torch.randn(32)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.allclose(rms_norm(x, w, 1e-5), ref, atol=1e-6)
    out, res = add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(res, x + r)
    assert torch.allclose(out, rms_norm(x + r, w, 1e-5))


def check_cpu_attention(batch, dtype, head_dim: int, context: str) -> None:
    """The CPU backend's attention on one thread against dense attention, and on 2 and THREADS threads bit for bit
    equal to one thread's."""
    from fastgen.kernels import cpu

    scale = head_dim**-0.5
    out = in_threads(1, cpu.paged_attention_cpu, batch.q, batch.k_cache, batch.v_cache, batch.meta, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), dense_attention(batch, scale), atol=tol, rtol=tol), context
    for threads in (2, THREADS):
        shared = in_threads(threads, cpu.paged_attention_cpu, batch.q, batch.k_cache, batch.v_cache, batch.meta, scale)
        assert torch.equal(shared, out), f"{context}: {threads} threads differ from one"


@pytest.fixture
def c_attention(forbid):
    """The CPU backend's attention module, with torch's attention forbidden: every row must go through C."""
    from fastgen.kernels import cpu

    if cpu.load_library() is None:
        require_tool(False, "no C compiler on this machine")  # the torch path serves there
    forbid(cpu, "paged_attention", "prefill_attention")
    return cpu


# 209327 failed on an AMD EPYC when the prompt chunk's rows went through torch's attention (see kernels/cpu.py).
@pytest.mark.parametrize("seed", [1, 209327])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])  # 16, 32: bf16 scores on AMX tiles; 1: vdpbf16ps
@pytest.mark.parametrize(
    "kv_heads, head_dim, group",
    [(2, 64, 3), (3, 128, 2), (1, 32, 1), (2, 80, 3), (1, 48, 9), (1, 40, 2), (1, 64, 71), (1, 40, 71)],
)  # 80, 48: masked chunks; 40: portable (f32); 71: Falcon-7B's query heads on its one KV head
def test_cpu_decode_kernel_matches_torch(seed, dtype, block_size, kv_heads, head_dim, group, c_attention):
    """The compiled C attention against dense attention, on a mixed batch (decodes + a prompt chunk), on one thread
    and split over several. Cache slots no sequence owns hold NaN, so a kernel that reads past a sequence's tokens
    and lets it count fails; the torch path must not be taken."""
    batch = cpu_attention_case(seed, dtype, block_size, kv_heads, head_dim, group)
    check_cpu_attention(batch, dtype, head_dim, f"seed {seed}")


def test_a_declined_attention_shape_is_served_by_torch_and_said_once(caplog):
    """A head size past the C decode kernel's (256): torch's attention serves the batch, and the operator is told
    once per shape, not once per layer and step."""
    from fastgen.kernels import cpu

    if cpu.load_library() is None:
        require_tool(False, "no C compiler on this machine")
    cpu.declined.cache_clear()
    batch = make_paged_batch(
        [1, 5], [9, 12], heads=2, kv_heads=1, head_dim=320, block_size=16, dtype=torch.float32, rng=random.Random(0)
    )
    with caplog.at_level("WARNING", logger="fastgen.kernels"):
        for _ in range(3):
            out = cpu.paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, 320**-0.5)
    assert torch.allclose(out, dense_attention(batch, 320**-0.5), atol=1e-5, rtol=1e-5)
    said = [r.getMessage() for r in caplog.records if "does not take" in r.getMessage()]
    assert said == [
        "the C decode attention kernel does not take torch.float32 attention of 2 heads on 1 KV heads of "
        "320, blocks of 16: torch's serves it, several times slower"
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "kv_heads, group, head_dim, block_size, length, chunk",
    [(1, 1, 128, 32, 389, 101), (3, 3, 128, 16, 487, 4), (1, 1, 64, 16, 565, 30)],
)
def test_cpu_attention_of_long_prompts_is_thread_count_independent(
    dtype, kv_heads, group, head_dim, block_size, length, chunk, c_attention
):
    """Prompt chunks over a long history: torch's CPU attention gives float32 results that differ in the last bit
    between 1, 2 and 3 threads on these shapes (on an Ice Lake Xeon); the CPU backend must not."""
    torch.manual_seed(0)
    batch = make_paged_batch(
        [1, chunk],
        [50, length],
        heads=kv_heads * group,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        rng=random.Random(0),
        poison=True,
    )
    check_cpu_attention(batch, dtype, head_dim, f"chunk {chunk} of {length}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group, head_dim", [(1, 32), (3, 64), (8, 128), (8, 32), (1, 128), (3, 128)])
def test_cpu_prefill_attention_avx512_matches_dense(dtype, block_size, group, head_dim, c_attention, forbid):
    """The AVX-512 prompt-chunk kernel (csrc/prefill_attention_avx512.c) on mixed batches (decodes, then chunks of
    1 to 300 rows around its 16-key tiles and 64-row work units, fresh or after a cached history): against dense float32
    attention on one thread, and bit for bit equal on 2 and THREADS threads. Neither torch nor the rows-as-decodes
    fallback may serve (the AMX kernel does, for bfloat16, where there is AMX); slots no sequence owns hold NaN."""
    from fastgen.kernels import clib

    if "avx512f" not in clib.cpu_identity()[1]:
        pytest.skip("no AVX-512F: prompt rows are attended as decodes there")
    forbid(c_attention, "rows_as_decodes")
    rng = random.Random(block_size * 1000 + group * 100 + head_dim)
    torch.manual_seed(block_size + group + head_dim)
    kv_heads = rng.choice([1, 2])
    chunks = [1, 15, 16, 17, 64, 65, 100, 300]
    rng.shuffle(chunks)
    for part in (chunks[:4], chunks[4:]):
        decodes = [(rng.randrange(0, 200), 1) for _ in range(rng.randrange(0, 4))]
        seqs = decodes + [(rng.choice([0, rng.randrange(1, 200)]), c) for c in part]
        batch = make_paged_batch(
            [new for _, new in seqs],
            [cached + new for cached, new in seqs],
            heads=kv_heads * group,
            kv_heads=kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
            rng=rng,
            poison=True,
            num_decodes=len(decodes),
        )
        check_cpu_attention(batch, dtype, head_dim, f"chunks {seqs}")


def test_cpu_prefill_attention_avx512_declines_shapes_it_does_not_take():
    """head_dim not a multiple of 16, or a group above 16: the kernel returns non-zero and writes nothing, and the
    CPU backend attends the rows as decodes instead."""
    from fastgen.kernels import clib, cpu

    if cpu.load_library() is None or "avx512f" not in clib.cpu_identity()[1]:
        pytest.skip("no C compiler, or no AVX-512F")
    torch.manual_seed(0)
    for heads, kv_heads, head_dim in ((2, 1, 40), (17, 1, 16)):
        batch = make_paged_batch([20], [50], heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16)
        out = torch.zeros_like(batch.q)
        assert not cpu._prefill_attention_avx512(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.5, out)
        assert not out.any()
        got = cpu.paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.5)
        assert torch.allclose(got, dense_attention(batch, 0.5), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("hidden", [576, 40, 100])  # 40, 100: masked tails of the 16-wide vectors
def test_cpu_elementwise_kernels_match_torch(hidden, forbid):
    """The fused bf16 C kernels round where torch rounds: SiLU*up bit for bit, norms but for rare outputs on a
    rounding boundary; rotary (computed in float32 once, where torch rounds each product) within one bf16 step; rows
    with a stride of their own (views into a fused projection) read correctly; several threads give one thread's
    results bit for bit."""
    from fastgen.kernels import cpu, norm, rotary_write_kv
    from fastgen.kernels.rotary import apply_rotary, rope_cos_sin, rope_inv_freq

    if cpu._elementwise() is None:
        pytest.skip("no C compiler, or a CPU without AVX-512 bf16: the torch kernels serve there")
    torch.manual_seed(hidden)
    rows = 2000  # enough work that the kernels split it over threads
    wide = torch.randn(rows, hidden * 3, dtype=torch.bfloat16) * 3
    x, r = wide[:, :hidden], torch.randn(rows, hidden, dtype=torch.bfloat16)  # x: rows with a stride of 3 * hidden
    w = torch.randn(hidden, dtype=torch.bfloat16)
    gate_up = wide[:, : 2 * hidden]
    ref_out, ref_total = norm.add_rms_norm(x, r, w, 1e-5)
    out, total = in_threads(1, cpu.add_rms_norm_cpu, x, r, w, 1e-5)
    # The sum of squares is added up in another order than torch's, so a normalised value on a rounding boundary
    # may round the other way, and the weight's product after it (1 row in 2,000 at hidden 576); the residual sum
    # has no reduction.
    assert torch.equal(total, ref_total)
    assert (out != ref_out).any(dim=1).sum() <= rows // 200
    assert ((out.float() - ref_out.float()).abs() <= ref_out.float().abs() * 2**-5).all()  # two roundings
    assert torch.equal(in_threads(THREADS, cpu.add_rms_norm_cpu, x, r, w, 1e-5)[0], out)
    plain = in_threads(1, cpu.rms_norm_cpu, x, w, 1e-5)
    assert (plain != norm.rms_norm(x, w, 1e-5)).any(dim=1).sum() <= rows // 200
    assert torch.equal(in_threads(THREADS, cpu.rms_norm_cpu, x, w, 1e-5), plain)
    for threads in (1, THREADS):
        assert torch.equal(in_threads(threads, cpu.silu_mul_cpu, gate_up), norm.silu_mul(gate_up))

    forbid(cpu, "rotary_write_kv")  # the reference below is imported separately

    def within_one_step(got, exact):
        # A bf16 step is 2^-7 of the value's binade. Where x1 cos - x2 sin nearly cancel, float32's own error (~1e-7
        # of inputs of size ~1) is larger than that step: values under 2^-10 get the step of 2^-10.
        step = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp(min=2**-10))) - 7)
        return bool(((got.double() - exact).abs() <= step).all())

    head_dim, heads, kv_heads = hidden // 4 * 2, 4, 2
    cos_sin = rope_cos_sin(rope_inv_freq(head_dim, 10000.0), 4096)
    for tokens, threads in ((600, 1), (600, THREADS), (1, 1)):  # one token: torch's views report other strides
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, k, v = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)
        positions, slots = torch.randint(0, 4096, (tokens,)), torch.randperm(64 * 16)[:tokens]
        caches = [torch.zeros(64, 16, kv_heads, head_dim, dtype=torch.bfloat16) for _ in range(4)]
        q_out = in_threads(threads, cpu.rotary_write_kv_cpu, q, k, v, cos_sin, positions, caches[0], caches[1], slots)
        rotary_write_kv(q, k, v, cos_sin, positions, caches[2], caches[3], slots)
        assert within_one_step(q_out, apply_rotary(q.double(), cos_sin.double()[positions]))  # float64, same inputs
        k_slots = caches[0].view(-1, kv_heads, head_dim)[slots]
        assert within_one_step(k_slots, apply_rotary(k.double(), cos_sin.double()[positions]))
        assert torch.equal(caches[1], caches[3])  # v copied as is, to the same slots as torch writes it
        untouched = torch.ones(64 * 16, dtype=torch.bool)
        untouched[slots] = False
        assert not caches[0].view(-1, kv_heads, head_dim)[untouched].any()  # nothing written outside the slots


@pytest.mark.parametrize("hidden", [576, 40])  # 40: a masked tail of every row
def test_cpu_elementwise_f32_kernels_match_torch(hidden, forbid):
    """The fused float32 C kernels: rotary bit for bit torch's (and so Hugging Face's), into the cache slots torch
    writes and nowhere else; the residual sum exact; the norm (its squares summed in another order) and SiLU (a
    polynomial exponential) within a few float32 steps; rows with a stride of their own read correctly; several
    threads give one thread's results bit for bit, and a row's result does not depend on the rows beside it."""
    from fastgen.kernels import cpu, norm, rotary_write_kv
    from fastgen.kernels.rotary import rope_cos_sin, rope_inv_freq

    if cpu._elementwise_for(torch.float32) is None:
        pytest.skip("no C compiler, or a CPU without AVX-512 or AVX2: the torch kernels serve there")
    torch.manual_seed(hidden)
    rows = 2000  # enough work that the kernels split it over threads
    wide = torch.randn(rows, hidden * 3) * 3
    x, r = wide[:, :hidden], torch.randn(rows, hidden)  # x: rows with a stride of 3 * hidden
    w = torch.randn(hidden)
    gate_up = wide[:, : 2 * hidden]
    ref_out, ref_total = norm.add_rms_norm(x, r, w, 1e-5)
    out, total = in_threads(1, cpu.add_rms_norm_cpu, x, r, w, 1e-5)
    assert torch.equal(total, ref_total)
    assert torch.allclose(out, ref_out, rtol=1e-6, atol=1e-6), (out - ref_out).abs().max()
    assert torch.equal(in_threads(THREADS, cpu.add_rms_norm_cpu, x, r, w, 1e-5)[0], out)
    assert torch.equal(in_threads(1, cpu.add_rms_norm_cpu, x[5:6], r[5:6], w, 1e-5)[0], out[5:6])
    plain = in_threads(1, cpu.rms_norm_cpu, x, w, 1e-5)
    assert torch.allclose(plain, norm.rms_norm(x, w, 1e-5), rtol=1e-6, atol=1e-6)
    assert torch.equal(in_threads(THREADS, cpu.rms_norm_cpu, x, w, 1e-5), plain)
    silu = in_threads(1, cpu.silu_mul_cpu, gate_up)
    assert torch.allclose(silu, norm.silu_mul(gate_up), rtol=1e-6, atol=1e-6), (
        (silu - norm.silu_mul(gate_up)).abs().max()
    )
    assert torch.equal(in_threads(THREADS, cpu.silu_mul_cpu, gate_up), silu)

    forbid(cpu, "rotary_write_kv")  # the reference below is imported separately
    head_dim, heads, kv_heads = hidden // 4 * 2, 4, 2
    cos_sin = rope_cos_sin(rope_inv_freq(head_dim, 10000.0), 4096)
    for tokens, threads in ((600, 1), (600, THREADS), (1, 1)):  # one token: torch's views report other strides
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, k, v = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)
        positions, slots = torch.randint(0, 4096, (tokens,)), torch.randperm(64 * 16)[:tokens]
        caches = [torch.zeros(64, 16, kv_heads, head_dim) for _ in range(4)]
        q_out = in_threads(threads, cpu.rotary_write_kv_cpu, q, k, v, cos_sin, positions, caches[0], caches[1], slots)
        q_ref = rotary_write_kv(q, k, v, cos_sin, positions, caches[2], caches[3], slots)
        assert torch.equal(q_out, q_ref)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("head_dim, rotary_dim", [(80, 32), (64, 32), (16, 12), (40, 40), (32, 0)])
def test_cpu_partial_rotary_matches_torch(dtype, head_dim, rotary_dim, forbid):
    """Partial rotary (Phi-2: 32 of 80 dims; Phi-4-mini: 12 of 16) in the C kernels: the first rotary_dim dims of each
    q and k head rotate as the full-rotary kernels do (float32: torch's bits; bfloat16: within one bf16 step of exact),
    the rest are copied bit for bit, into the cache slots torch writes and nowhere else; several threads give one
    thread's results bit for bit. An empty table (no rotary: OPT) rotates nothing; one of odd width is still declined
    (torch serves)."""
    from fastgen.kernels import cpu
    from fastgen.kernels.rotary import apply_rotary

    if cpu._elementwise_for(dtype) is None:
        pytest.skip("no C compiler, or a CPU without the elementwise kernels: the torch kernels serve there")
    torch.manual_seed(head_dim + rotary_dim)
    forbid(cpu, "rotary_write_kv")  # the reference, rotary_write_kv imported here, is not the one forbidden
    heads, kv_heads = 4, 2
    cos_sin = rope_cos_sin(rope_inv_freq(rotary_dim, 10000.0), 4096)  # (positions, rotary_dim)
    results = []
    for tokens, threads in ((600, 1), (600, THREADS), (1, 1)):  # one token: torch's views report other strides
        torch.manual_seed(tokens)
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, k, v = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)
        positions, slots = torch.randint(0, 4096, (tokens,)), torch.randperm(64 * 16)[:tokens]
        caches = [torch.zeros(64, 16, kv_heads, head_dim, dtype=dtype) for _ in range(4)]
        q_out = in_threads(threads, cpu.rotary_write_kv_cpu, q, k, v, cos_sin, positions, caches[0], caches[1], slots)
        q_ref = rotary_write_kv(q, k, v, cos_sin, positions, caches[2], caches[3], slots)
        k_slots = caches[0].view(-1, kv_heads, head_dim)[slots]
        assert torch.equal(caches[1], caches[3])  # v copied as is, to the same slots as torch writes it
        assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])  # the unrotated dims, bit for bit
        assert torch.equal(k_slots[..., rotary_dim:], k[..., rotary_dim:])
        if dtype == torch.float32:
            assert torch.equal(q_out, q_ref) and torch.equal(caches[0], caches[2])
        else:
            rows = cos_sin.double()[positions]
            for got, x in ((q_out, q), (k_slots, k)):
                exact = apply_rotary(x.double(), rows)
                # one bf16 step of the value's binade, 2^-10's below 2^-10 (where x1 cos - x2 sin nearly cancel)
                step = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp(min=2**-10))) - 7)
                assert ((got.double() - exact).abs() <= step).all()
        untouched = torch.ones(64 * 16, dtype=torch.bool)
        untouched[slots] = False
        assert not caches[0].view(-1, kv_heads, head_dim)[untouched].any()  # nothing written outside the slots
        results.append((q_out, caches[0], caches[1]))
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))  # THREADS threads: one thread's bits

    # a table of odd width: declined, so the (forbidden) torch kernel is called
    odd = torch.zeros(8, max(rotary_dim, 2) - 1)
    with pytest.raises(AssertionError, match="fell back"):
        cpu.rotary_write_kv_cpu(q, k, v, odd, torch.zeros(1, dtype=torch.long), *caches[:2], slots)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("kv_heads, head_dim", [(1, 64), (3, 64), (2, 128)])
def test_cpu_prefill_attention_amx_matches_dense(block_size, kv_heads, head_dim, forbid):
    """The AMX prompt-chunk attention against dense float32 attention: fresh prompts and chunks after a cached
    history, lengths around its 16-query tiles and 32-key blocks, GQA; the torch path must not be taken."""
    from fastgen.kernels import cpu

    if cpu._amx() is None:
        pytest.skip("no C compiler, or a CPU/kernel without AMX tiles: the AVX-512 prompt kernel serves prompts there")
    forbid(cpu, "prefill_attention")
    rng = random.Random(block_size * 100 + head_dim + kv_heads)
    torch.manual_seed(block_size)
    chunks = [(0, 1), (0, 15), (0, 16), (0, 17), (0, 33), (31, 1), (32, 16), (100, 47), (5, 64), (0, 130)]
    for _ in range(3):
        rng.shuffle(chunks)
        decodes = [(rng.randrange(1, 200), 1) for _ in range(rng.randrange(0, 3))]
        seqs = decodes + chunks[:4]
        batch = make_paged_batch(
            [new for _, new in seqs],
            [cached + new for cached, new in seqs],
            heads=kv_heads * rng.choice([1, 2, 3]),
            kv_heads=kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype=torch.bfloat16,
            rng=rng,
            spare_blocks=8,
            num_decodes=len(decodes),
        )
        args = (batch.q, batch.k_cache, batch.v_cache, batch.meta, head_dim**-0.5)
        out = in_threads(1, cpu.paged_attention_cpu, *args)
        ref = dense_attention(batch, head_dim**-0.5)
        assert torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2), (out.float() - ref).abs().max()
        assert torch.equal(in_threads(THREADS, cpu.paged_attention_cpu, *args), out)


@pytest.mark.parametrize("kernel", ["amx", "dpbf16"])
@pytest.mark.parametrize("out_features, in_features", [(40, 64), (48, 96), (80, 32), (600, 576)])  # 40, 600: partial
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_packed_bf16_linear_matches_float32(kernel, out_features, in_features, with_bias, monkeypatch):
    """Each packed bfloat16 linear kernel (AMX tiles; AVX-512 BF16 dot products, whose blocks are 6 rows x 4 column
    tiles) against a float32 matmul, over row counts around their blocks and past one pass over x, on rows that are a
    view into wider ones, on one thread and several; and through the layers' packed-weight path, and oneDNN's."""
    from fastgen.kernels import cpu

    library = cpu._amx() if kernel == "amx" else cpu._dpbf16()
    if library is None:
        pytest.skip(f"no C compiler, or a CPU without {kernel}: another bfloat16 kernel serves there")
    entry_point = library.linear_bf16 if kernel == "amx" else library.linear_dpbf16
    monkeypatch.setattr(cpu, "_packed_bf16_kernel", lambda: entry_point)  # on an AMX host, AMX's would serve
    torch.manual_seed(out_features + in_features)
    w = torch.randn(out_features, in_features, dtype=torch.bfloat16) / in_features**0.5
    bias = torch.randn(out_features, dtype=torch.bfloat16) if with_bias else None
    packed = cpu.pack_linear(w)
    assert packed is not None
    layer_weight = cpu.pack_weight(w)
    assert layer_weight.bf16 is not None  # the layers take a packed kernel wherever one runs
    for rows in (1, 2, 5, 6, 7, 13, 15, 16, 17, 32, 33, 64, 100, 300):
        x = torch.randn(rows, in_features + 32, dtype=torch.bfloat16)[:, 16 : 16 + in_features]
        ref = x.float() @ w.float().T + (0 if bias is None else bias.float())
        got = in_threads(1, cpu.linear_packed_bf16, x, packed, bias)
        assert got is not None and got.shape == (rows, out_features)
        assert torch.allclose(got.float(), ref, rtol=1e-2, atol=1e-2), (rows, (got.float() - ref).abs().max())
        assert torch.equal(in_threads(THREADS, cpu.linear_packed_bf16, x, packed, bias), got), rows
        if kernel == "dpbf16":  # a row's result does not depend on the rows beside it
            assert torch.equal(cpu.linear_packed_bf16(x[-1:], packed, bias), got[-1:]), rows
        assert torch.equal(cpu.linear(x, w, bias, layer_weight), got)
        onednn = cpu.PackedWeight(onednn=torch.ops.mkldnn._reorder_linear_weight(w, 512))  # where neither runs
        assert torch.allclose(cpu.linear(x, w, bias, onednn).float(), ref, rtol=1e-2, atol=1e-2), rows


def test_bfloat16_layers_hold_one_copy_of_their_weights(tiny_model_dir):
    """A bfloat16 layer's packed form (AMX tiles or oneDNN's blocked layout) is its only copy of the weight: the plain
    one is dropped, and the AMX tile order unpacks to it exactly for the inputs the kernel declines."""
    from fastgen.kernels import cpu
    from fastgen.replica import pipeline
    from fastgen.replica.parallel import ParallelLinear

    w = torch.randn(40, 64, dtype=torch.bfloat16)
    assert torch.equal(cpu.PackedLinear.of(w).unpacked(), w)  # 40 rows: a partial tile of 16
    if cpu.pack_weight(w) is None:
        pytest.skip("oneDNN has no bfloat16 on this CPU: the plain weight serves")
    model = pipeline(str(tiny_model_dir), dtype="bfloat16", progress=False).engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, ParallelLinear)]
    assert layers and all(m.weight is None and m.packed is not None for m in layers)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    head = model.lm_head  # tied: the embedding keeps its table, the head only its packed copy
    assert model.embed_tokens.weight is not None
    reference = x.float() @ model.embed_tokens.weight.float().T
    assert torch.allclose(head.project(x, None).float(), reference, rtol=2e-2, atol=2e-2)


# 37, 5, 3, 18: a last panel short of 32 features (masked); 960: more panels than one group; 1030: two k blocks, the
# partial sums kept in the output between them
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (37, 50), (5, 16), (3, 7), (18, 1030)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_linear_f32_matches_float64_and_is_batch_invariant(out_features, in_features, with_bias):
    """The float32 linear kernel against a float64 matmul at decode and prompt row counts, on rows that are a view
    into wider ones; each row's result bit for bit the same alone or in any batch, on one thread or several; the
    layers' float32 path is this kernel on the packed weight, and drops the plain one; other dtypes left to torch."""
    from fastgen.kernels import cpu

    torch.manual_seed(out_features + in_features)
    w = torch.randn(out_features, in_features) / in_features**0.5
    bias = torch.randn(out_features) if with_bias else None
    packed = cpu.pack_f32(w)
    if packed is None:
        pytest.skip("no C compiler, or a CPU without AVX-512 or AVX2: sgemm serves there")
    assert torch.equal(packed.unpacked(), w)
    layer_weight = cpu.pack_weight(w)
    assert layer_weight.f32 is not None and layer_weight.holds_weight
    most = 300
    x = torch.randn(most, in_features + 32)[:, 16 : 16 + in_features]
    alone = torch.cat([in_threads(1, cpu.linear_f32, x[i : i + 1], packed, bias) for i in range(most)])
    for rows in (*range(1, 18), 25, 33, 64, most):
        ref = (x[:rows].double() @ w.double().T + (0 if bias is None else bias.double())).float()
        got = in_threads(1, cpu.linear_f32, x[:rows], packed, bias)
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), (rows, (got - ref).abs().max())
        assert torch.equal(in_threads(THREADS, cpu.linear_f32, x[:rows], packed, bias), got), rows
        assert torch.equal(got, alone[:rows]), f"a row's result depends on the batch ({rows} rows)"
        assert torch.equal(cpu.linear(x[:rows], None, bias, layer_weight), got)
    assert torch.equal(in_threads(1, cpu.linear_f32, x[7:19], packed, bias), alone[7:19])  # nor on its place in it
    assert cpu.linear_f32(x[:2].bfloat16(), packed, None) is None
    # An input the kernel declines (not a matrix) still gets its answer, from the packed weight unpacked.
    batched = cpu.linear(x[:6].reshape(2, 3, -1), None, bias, layer_weight)
    assert torch.allclose(batched, alone[:6].reshape(2, 3, -1), rtol=1e-5, atol=1e-5)


def test_cpu_linear_f32_avx2_build_gives_the_native_builds_bits(tmp_path):
    """csrc/linear_f32.c built for AVX2 (AVX-512 turned off, as on an AMD Zen 3 or an older Xeon) sums every output in
    the native build's order: the same bits at decode and prompt row counts, masked last panels, two k blocks, on
    one thread or several. On an AVX-512 CPU this is the AVX2 path's only test; on an AVX2 CPU both builds are it."""
    import ctypes
    import subprocess

    from fastgen.kernels import clib, cpu

    compiler = clib.find_compiler()
    if compiler is None or cpu.pack_f32(torch.ones(8, 8)) is None:
        pytest.skip("no C compiler, or a CPU without AVX-512 or AVX2: sgemm serves there")
    built = tmp_path / "linear_f32_avx2.so"
    command = [compiler, *clib.FLAGS, "-mno-avx512f", *clib.OPENMP, "-o", str(built), str(clib.CSRC / "linear_f32.c")]
    subprocess.run(command, check=True, capture_output=True)
    avx2 = ctypes.CDLL(str(built))
    if not avx2.linear_f32_available():
        pytest.skip("a CPU without AVX2 and FMA")
    assert avx2.linear_f32_silu_mul_available() == 0  # gate/up fused on AVX-512 only
    avx2.linear_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    avx2.linear_f32.argtypes += [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    for out_features, in_features in [(960, 576), (37, 50), (18, 1030)]:
        torch.manual_seed(out_features)
        w = torch.randn(out_features, in_features) / in_features**0.5
        bias = torch.randn(out_features)
        packed = cpu.pack_f32(w)
        x = torch.randn(40, in_features + 16)[:, 8 : 8 + in_features]
        for rows in (1, 2, 3, 4, 7, 13, 40):
            native = in_threads(1, cpu.linear_f32, x[:rows], packed, bias)
            for threads in (1, THREADS):
                y = torch.empty(rows, out_features)
                args = (x.data_ptr(), x.stride(0), packed.panels.data_ptr(), bias.data_ptr(), y.data_ptr())
                status = avx2.linear_f32(*args, out_features, rows, out_features, in_features, threads)
                assert status == 0 and torch.equal(y, native), (out_features, in_features, rows, threads)


def test_cpu_elementwise_f32_avx2_build_gives_the_native_builds_bits(tmp_path, monkeypatch):
    """csrc/elementwise_f32.c built for AVX2 (AVX-512 turned off, as on an AMD Zen 3), called through kernels/cpu.py as
    the native build is: SiLU(gate)·up, GELU(gate)·up and rotary + cache write give the native build's bits (the same
    operations on 8 lanes, scalef as two exact powers of two), exp's underflow included; the norm sums its squares
    over 8 lanes, so it is held to torch's within a few float32 steps, its residual sum exact. Masked tails, on one
    thread or several. On an AVX-512 CPU this is the AVX2 path's only test."""
    import ctypes
    import subprocess

    from fastgen.kernels import clib, cpu, norm
    from fastgen.kernels.rotary import rope_cos_sin, rope_inv_freq

    compiler = clib.find_compiler()
    native = cpu._elementwise_for(torch.float32)
    if compiler is None or native is None:
        pytest.skip("no C compiler, or a CPU without AVX-512 or AVX2: the torch kernels serve there")
    built = tmp_path / "elementwise_f32_avx2.so"
    source = str(clib.CSRC / "elementwise_f32.c")
    command = [compiler, *clib.FLAGS, "-mno-avx512f", *clib.OPENMP, "-I", str(clib.CSRC), "-o", str(built), source]
    subprocess.run(command, check=True, capture_output=True)
    library = ctypes.CDLL(str(built))
    assert library.elementwise_f32_available() == 1
    names = ("add_rms_norm", "silu_mul", "gelu_tanh_mul", "rotary_write_kv")
    for name, native_function in zip(
        names, (native.add_rms_norm, native.silu_mul, native.gelu_tanh_mul, native.rotary_write_kv)
    ):
        getattr(library, f"{name}_f32").argtypes = native_function.argtypes
    called = set()

    def counted(name):
        function = getattr(library, f"{name}_f32")
        return lambda *args: called.add(name) or function(*args)

    avx2 = cpu.Elementwise(torch.float32, *map(counted, names))

    def both(threads, function, *args):
        """function(*args) on `threads` threads, on the AVX2 build, then on the native one."""
        results = []
        for kernels in (avx2, native):
            monkeypatch.setattr(cpu, "_elementwise_for", lambda dtype, kernels=kernels: kernels)
            results.append(in_threads(threads, function, *args))
        return results

    torch.manual_seed(3)
    cos_sin = rope_cos_sin(rope_inv_freq(64, 10000.0), 512)
    for hidden, threads in ((576, THREADS), (40, 1), (13, THREADS)):
        gate_up = torch.randn(300, 2 * hidden) * 4
        gate_up[0, :3] = torch.tensor([-100.0, 90.0, -87.5])[: min(3, hidden)]  # exp's underflow, subnormal sigmoids
        for function in (cpu.silu_mul_cpu, cpu.gelu_tanh_mul_cpu):
            got, expected = both(threads, function, gate_up)
            assert torch.equal(got, expected), function.__name__
        x, r, w = torch.randn(300, hidden), torch.randn(300, hidden), torch.randn(hidden)
        (out, total), _ = both(threads, cpu.add_rms_norm_cpu, x, r, w, 1e-5)
        ref_out, ref_total = norm.add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(total, ref_total) and torch.allclose(out, ref_out, rtol=1e-6, atol=1e-6)
    q, k, v = torch.randn(50, 5 * 64).split([3 * 64, 64, 64], -1)
    q, k, v = q.view(-1, 3, 64), k.view(-1, 1, 64), v.view(-1, 1, 64)
    positions, slots = torch.randint(0, 512, (50,)), torch.randperm(128)[:50]

    def rotate(q, k, v):
        caches = torch.zeros(128, 1, 1, 64), torch.zeros(128, 1, 1, 64)
        return cpu.rotary_write_kv_cpu(q, k, v, cos_sin, positions, *caches, slots), *caches

    got, expected = both(THREADS, rotate, q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert called == set(names)  # the C kernels ran, not torch's fallbacks


# 1536 x 576: SmolLM2's MLP (more panels than one group); 20: a last panel short of 16 features (masked); 9 x 1030:
# two k blocks, the partial sums kept in a scratch between them
@pytest.mark.parametrize("intermediate, in_features", [(1536, 576), (20, 50), (9, 1030)])
def test_cpu_linear_silu_mul_f32_is_the_linear_kernel_then_silu_mul(intermediate, in_features):
    """The fused gate/up kernel (gate and up packed side by side, SiLU(gate) * up applied as it stores) gives the
    unfused path's result bit for bit: the linear kernel on the same weight, then the elementwise silu_mul, at every
    decode row count, prompt counts, one thread or several; so it keeps the batch invariance and the exactness of
    both. The layers' float32 path is this kernel, and a row view or an input it declines still gets the answer."""
    from fastgen.kernels import cpu

    torch.manual_seed(intermediate + in_features)
    w = torch.randn(2 * intermediate, in_features) / in_features**0.5  # gate rows, then up rows
    gated, plain = cpu.pack_f32_gate_up(w), cpu.pack_f32(w)
    if gated is None or cpu._elementwise_for(torch.float32) is None:
        pytest.skip("no C compiler, or a CPU without AVX-512: torch serves there")
    assert torch.equal(gated.unpacked(), w)
    layer_weight = cpu.pack_gate_up(w)
    assert layer_weight.f32.gated and torch.equal(layer_weight.f32.panels, gated.panels) and layer_weight.holds_weight
    most = 100
    x = torch.randn(most, in_features + 32)[:, 16 : 16 + in_features]
    for rows in (*range(1, 14), 25, most):
        unfused = in_threads(1, lambda part: cpu.silu_mul_cpu(cpu.linear_f32(part, plain, None)), x[:rows])
        for threads in (1, THREADS):
            got = in_threads(threads, cpu.linear_f32_silu_mul, x[:rows], gated)
            assert torch.equal(got, unfused), (rows, threads, (got - unfused).abs().max())
        assert torch.equal(cpu.linear_silu_mul(x[:rows], None, layer_weight), unfused)
    ref = torch.nn.functional.silu(x @ w[:intermediate].T) * (x @ w[intermediate:].T)
    assert torch.allclose(cpu.linear_silu_mul(x, None, layer_weight), ref, rtol=1e-4, atol=1e-5)
    assert cpu.linear_f32(x, gated, None) is None  # a gated pack is not a plain weight
    assert cpu.linear_f32_silu_mul(x, plain) is None
    batched = cpu.linear_silu_mul(x[:6].reshape(2, 3, -1), None, layer_weight)  # declined: torch on the unpacked
    assert torch.allclose(batched, ref[:6].reshape(2, 3, -1), rtol=1e-4, atol=1e-5)


def test_cpu_argmax_matches_torch():
    """Greedy sampling's C argmax against torch's max over bf16 rows: ties (the first index wins), -inf rows, vocab
    sizes around its 16-wide vectors, rows that are views into wider ones."""
    from fastgen.kernels import cpu

    if cpu._elementwise() is None:
        pytest.skip("no C compiler, or a CPU without AVX-512 bf16: torch's max serves there")
    torch.manual_seed(0)
    for vocab in (1, 15, 16, 17, 1000, 49152):
        wide = (torch.randn(9, vocab + 8) * 4).round().to(torch.bfloat16)  # rounded: many ties
        logits = wide[:, 3 : 3 + vocab]
        logits[1] = float("-inf")
        logits[2, vocab // 2 :] = logits[2].max() + 1  # ties spanning vector lanes
        for threads in (1, THREADS):
            assert in_threads(threads, cpu.argmax_rows, logits) == logits.max(dim=-1).indices.tolist(), (vocab, threads)


def test_the_torch_floor_has_what_the_attention_kernels_call():
    """scaled_dot_product_attention's enable_gqa, which the torch attention kernels pass, is new in torch 2.5: the
    floor pyproject.toml declares must not promise an older torch (it once said 2.4)."""
    import inspect
    import re
    from pathlib import Path

    import fastgen
    from fastgen.kernels import attention

    assert "enable_gqa=True" in inspect.getsource(attention)
    pyproject = (Path(fastgen.__file__).parents[1] / "pyproject.toml").read_text()
    major, minor = re.search(r'^\s*"torch>=(\d+)\.(\d+)', pyproject, re.MULTILINE).groups()
    assert (int(major), int(minor)) >= (2, 5), f"torch>={major}.{minor}"
