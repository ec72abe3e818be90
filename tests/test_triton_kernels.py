"""Triton kernels against the torch references: compiled, on CUDA tensors, where there is a GPU (the GPU suite runs
these with -m cuda); elsewhere on CPU tensors under the Triton interpreter.

Inputs are random with a fixed seed per test; the seed is printed on failure and FASTGEN_TEST_SEED=<seed> runs
every test with another.
Outputs are allocated NaN-filled (see `poisoned_empty`) so an element the kernel forgets to write fails the test,
and cache slots no sequence owns hold NaN so a read past a sequence's end poisons the result.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import random
import sys
import zlib

import pytest
import torch

# Triton is imported *before* TRITON_INTERPRET is set, on purpose: triton decorates its own library functions
# (tl.sum, tl.max, ...) when first imported, and if the flag were on then, every kernel compiled later in this
# pytest session, by any test module, would fail. The flag only matters when a kernel is decorated, so it is set
# just while a private copy of triton_kernels is imported (see `_import_interpreted`).
import triton

import fastgen.kernels as K
from fastgen.kernels import rope_cos_sin, rope_inv_freq
from fastgen.testing import make_paged_batch

pytestmark = [pytest.mark.slow, pytest.mark.cuda(interpreted=True)]  # the Triton interpreter on CPU, compiled on a GPU
ON_CUDA = torch.cuda.is_available()

MODULE = "fastgen.kernels.triton_kernels"


def _import_interpreted():
    """A copy of triton_kernels whose kernels run in the interpreter. sys.modules, the package attribute and the
    environment are restored afterwards, so other test modules importing triton_kernels get compiled kernels."""
    saved_module, saved_attr = sys.modules.pop(MODULE, None), K.__dict__.pop("triton_kernels", None)
    saved_flag = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return importlib.import_module(MODULE)
    finally:
        if saved_flag is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved_flag
        sys.modules.pop(MODULE, None)
        K.__dict__.pop("triton_kernels", None)
        if saved_module is not None:
            sys.modules[MODULE] = saved_module
        if saved_attr is not None:
            K.triton_kernels = saved_attr


tk = importlib.import_module(MODULE) if ON_CUDA else _import_interpreted()
REF = K.TORCH_KERNELS


@pytest.fixture(autouse=True)
def interpreting(monkeypatch):
    if ON_CUDA:
        # Every tensor a test makes, and every paged batch, on the GPU: the same tests run the compiled kernels.
        monkeypatch.setitem(globals(), "make_paged_batch", functools.partial(make_paged_batch, device="cuda"))
        torch.set_default_device("cuda")
        yield
        torch.set_default_device(None)
        return
    # On the first launch triton lazily imports a module that asserts its library is compiled-mode unless the flag
    # is on; the flag being on while these tests run keeps that working if triton was first imported with it.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def seed(request):
    """Seeds torch and random with the test's own fixed seed (from its id) or FASTGEN_TEST_SEED, printed (pytest shows
    it on failure) and in assertion messages."""
    value = int(os.environ.get("FASTGEN_TEST_SEED", zlib.crc32(request.node.nodeid.encode())))
    print(f"FASTGEN_TEST_SEED={value}")
    torch.manual_seed(value)
    random.seed(value)
    return value


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Makes torch.empty return NaN-filled floating tensors while a kernel wrapper runs."""
    real_empty = torch.empty

    def empty_nan(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(torch, "empty", empty_nan)
            return fn(*args)

    return run


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}  # bf16 is not tested: the interpreter gets it wrong on CPU


# ---------------------------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------------------------


def draw_lengths(kind: str, block_size: int, long: bool = False) -> tuple[list[int], list[int]]:
    """(q_lens, seq_lens) with decodes first. Prompts include a whole prompt in one chunk and a chunk that starts
    mid-block and (for block sizes up to 32) spans several blocks; most last blocks are partly filled."""
    q_lens, seq_lens = [], []
    if kind in ("decode", "mixed"):
        contexts = [1, block_size] + [random.randint(2, 3 * block_size) for _ in range(2)]
        if long:
            contexts.append(random.randint(300, 500))
        q_lens += [1] * len(contexts)
        seq_lens += contexts
    if kind in ("prefill", "mixed"):
        prompt = random.randint(2, 40)
        start = block_size * random.randint(0, 2) + random.randint(1, max(1, block_size - 1))  # mid-block
        chunk = random.randint(2 * block_size + 1, 3 * block_size) if block_size <= 32 else random.randint(20, 40)
        q_lens += [prompt, chunk]
        seq_lens += [prompt, start + chunk]
        if long:
            q_lens.append(random.randint(10, 30))
            seq_lens.append(random.randint(300, 500))
    return q_lens, seq_lens


def check_attention(kind, kv_heads, heads, head_dim, block_size, dtype, seed, poisoned_empty, long=False):
    q_lens, seq_lens = draw_lengths(kind, block_size, long)
    b = make_paged_batch(
        q_lens,
        seq_lens,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        poison=True,
    )
    q, k_cache, v_cache, meta = b.q, b.k_cache, b.v_cache, b.meta
    scale = head_dim**-0.5
    out = poisoned_empty(tk.paged_attention, q, k_cache, v_cache, meta, scale)
    # The reference gathers whole blocks and masks afterwards, so it needs finite values in unowned slots.
    ref = REF.paged_attention(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), meta, scale)
    context = f"seed={seed} q_lens={q_lens} seq_lens={seq_lens}"
    assert out.shape == ref.shape and out.dtype == ref.dtype, context
    assert not out.isnan().any(), f"unwritten or poisoned outputs: {context}"
    err = rel_err(out, ref)
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}: {context}"


# ---------------------------------------------------------------------------------------------------------------
# Paged attention
# ---------------------------------------------------------------------------------------------------------------

GQA = [(2, 2), (2, 4), (3, 9), (1, 4), (1, 8)]  # (kv_heads, heads): ratios 1, 2, 3, 4, 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("kv_heads,heads", GQA, ids=[f"gqa{h // kv}" for kv, h in GQA])
def test_attention_gqa_and_head_dims(kv_heads, heads, head_dim, dtype, seed, poisoned_empty):
    block_size = 16 if (head_dim // 16 + heads // kv_heads) % 2 else 32  # every ratio and head dim meets both
    check_attention("mixed", kv_heads, heads, head_dim, block_size, dtype, seed, poisoned_empty)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [1, 16, 32, 128])  # 1: the engine accepts any size
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_attention_batch_kinds(kind, block_size, dtype, seed, poisoned_empty):
    check_attention(kind, 2, 8, 128, block_size, dtype, seed, poisoned_empty)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_attention_long_contexts(dtype, seed, poisoned_empty):
    check_attention("mixed", 1, 3, 80, 16, dtype, seed, poisoned_empty, long=True)


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_attention_strided_q_and_group_32(kind, seed, poisoned_empty):
    # q as the model makes it: a view into a fused qkv projection; 32 query heads share one kv head.
    q_lens, seq_lens = draw_lengths(kind, 16)
    b = make_paged_batch(q_lens, seq_lens, heads=32, kv_heads=1, head_dim=64, block_size=16, poison=True)
    q, k_cache, v_cache, meta = b.q, b.k_cache, b.v_cache, b.meta
    qkv = torch.randn(q.shape[0], 34 * 64)
    qkv[:, : 32 * 64] = q.flatten(1)
    q_view = qkv[:, : 32 * 64].view(-1, 32, 64)  # (tokens, heads, head_dim), token stride 34 * 64
    out = poisoned_empty(tk.paged_attention, q_view, k_cache, v_cache, meta, 0.125)
    ref = REF.paged_attention(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), meta, 0.125)
    assert rel_err(out, ref) < 1e-5, f"seed={seed} q_lens={q_lens} seq_lens={seq_lens}"


def test_attention_chunk_mid_block_over_several_blocks(seed, poisoned_empty):
    # Positions 35..74 with 16-token blocks: starts 3 tokens into block 2, ends 11 tokens into block 4.
    b = make_paged_batch([1, 40], [9, 75], heads=4, kv_heads=2, head_dim=64, block_size=16, poison=True)
    q, k_cache, v_cache, meta = b.q, b.k_cache, b.v_cache, b.meta
    out = poisoned_empty(tk.paged_attention, q, k_cache, v_cache, meta, 0.125)
    ref = REF.paged_attention(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), meta, 0.125)
    assert rel_err(out, ref) < 1e-5, f"seed={seed}"


# ---------------------------------------------------------------------------------------------------------------
# Rotary + cache write
# ---------------------------------------------------------------------------------------------------------------


def test_decode_splits_fill_the_device_only_where_the_grid_is_small():
    assert tk.decode_splits(64, 8, 4096) == 1  # 512 programs already
    assert tk.decode_splits(1, 8, 4096) == 16  # 8 programs on 132 SMs: 16 splits of 256 keys
    assert tk.decode_splits(1, 8, 300) == 2  # no split shorter than MIN_KEYS_PER_SPLIT
    assert tk.decode_splits(1, 8, 200) == 1
    assert tk.decode_splits(4, 8, 100_000) == 4  # 32 programs x 4 reaches the target
    assert tk.decode_splits(1, 1, 100_000) == tk.MAX_SPLITS


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "kv_heads,heads,head_dim,block_size,softcap", [(2, 8, 128, 16, 0.0), (1, 3, 80, 32, 0.0), (4, 4, 64, 16, 30.0)]
)
def test_split_kv_decode_matches_the_reference(
    kv_heads, heads, head_dim, block_size, softcap, dtype, seed, poisoned_empty
):
    """Flash-decoding (decode-only steps with few sequences x KV heads split their keys over programs, merged after):
    against the torch reference, with a one-token context (every split but the first empty) and contexts that end
    mid-block and mid-split."""
    seq_lens = [1, block_size, random.randint(300, 700), random.randint(900, 1300)]
    b = make_paged_batch(
        [1] * 4,
        seq_lens,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        poison=True,
    )
    assert tk.decode_splits(4, kv_heads, b.meta.max_seq_len) > 1
    scale = head_dim**-0.5
    out = poisoned_empty(tk.paged_attention, b.q, b.k_cache, b.v_cache, b.meta, scale, 0, softcap)
    ref = REF.paged_attention(b.q, b.k_cache.nan_to_num(0.0), b.v_cache.nan_to_num(0.0), b.meta, scale, 0, softcap)
    assert not out.isnan().any(), f"seed={seed} seq_lens={seq_lens}"
    assert rel_err(out, ref) < TOLERANCE[dtype], f"seed={seed} seq_lens={seq_lens}"


# (kv_heads, heads, head_dim, rotary_dim, block_size); rotary_dim < head_dim: partial rotary, the first rotary_dim dims
# of each head rotate and the rest pass (Phi-2: 32 of 80; 12 of 16, a half that is not a power of two: Phi-4-mini's);
# 0: an empty table, no dim rotates (OPT), k and v are only written to the cache
ROTARY_CASES = [
    (2, 4, 64, 64, 16),
    (3, 9, 80, 80, 32),
    (1, 8, 128, 128, 16),
    (2, 4, 64, 32, 16),
    (3, 9, 80, 32, 32),
    (2, 6, 16, 12, 8),
    (1, 3, 32, 0, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kv_heads,heads,head_dim,rotary_dim,block_size", ROTARY_CASES)
def test_rotary_write_kv(kv_heads, heads, head_dim, rotary_dim, block_size, dtype, seed, poisoned_empty):
    q_lens, seq_lens = draw_lengths("mixed", block_size)
    b = make_paged_batch(
        q_lens,
        seq_lens,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        poison=True,
    )
    q, k_cache, v_cache, meta = b.q, b.k_cache, b.v_cache, b.meta
    tokens = q.shape[0]
    k, v = (torch.randn(tokens, kv_heads, head_dim).to(dtype) for _ in "kv")
    cos_sin = rope_cos_sin(rope_inv_freq(rotary_dim, 10000.0), 512)  # (positions, rotary_dim)
    positions = torch.cat([torch.arange(s - n, s) for n, s in zip(q_lens, seq_lens)])
    k_cache, v_cache = k_cache.nan_to_num(-7.0), v_cache.nan_to_num(-7.0)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    k_before, v_before, q_before = k_cache.clone(), v_cache.clone(), q.clone()

    out = poisoned_empty(tk.rotary_write_kv, q, k, v, cos_sin, positions, k_cache, v_cache, meta.slot_mapping)
    ref = REF.rotary_write_kv(q, k, v, cos_sin, positions, ref_k, ref_v, meta.slot_mapping)

    context = f"seed={seed} q_lens={q_lens} seq_lens={seq_lens}"
    # The kernel rounds after every op as torch does, so results agree bit for bit on CPU.
    assert torch.equal(out, ref), context
    assert torch.equal(q, q_before), f"q was modified: {context}"
    written = torch.zeros(k_cache.shape[0] * block_size, dtype=torch.bool)
    written[meta.slot_mapping] = True
    for cache, expected, before in ((k_cache, ref_k, k_before), (v_cache, ref_v, v_before)):
        cache, expected, before = (c.flatten(0, 1) for c in (cache, expected, before))  # (slots, kv_heads, head_dim)
        assert torch.equal(cache[written], expected[written]), context
        assert torch.equal(cache[~written], before[~written]), f"unwritten slots changed: {context}"


@pytest.mark.parametrize("rotary_dim", [96, 32])
def test_rotary_write_kv_strided_inputs(rotary_dim, seed):
    tokens, heads, kv_heads, head_dim = 9, 4, 2, 96
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, v = qkv.view(tokens, -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)  # views, token stride 768
    cos_sin = rope_cos_sin(rope_inv_freq(rotary_dim, 10000.0), 64)
    positions = torch.randint(0, 64, (tokens,))
    slots = torch.randperm(4 * 16)[:tokens]
    caches = [(torch.zeros(4, 16, kv_heads, head_dim), torch.zeros(4, 16, kv_heads, head_dim)) for _ in range(2)]
    out = tk.rotary_write_kv(q, k, v, cos_sin, positions, *caches[0], slots)
    ref = REF.rotary_write_kv(q, k, v, cos_sin, positions, *caches[1], slots)
    assert torch.equal(out, ref) and torch.equal(caches[0][0], caches[1][0]), f"seed={seed}"
    assert torch.equal(caches[0][1], caches[1][1]), f"seed={seed}"


@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_rotary_write_kv_skips_negative_slots(rotary_dim, seed):
    q, k, v = torch.randn(3, 2, 64), torch.randn(3, 1, 64), torch.randn(3, 1, 64)
    cos_sin = rope_cos_sin(rope_inv_freq(rotary_dim, 10000.0), 16)
    k_cache, v_cache = torch.zeros(2, 16, 1, 64), torch.zeros(2, 16, 1, 64)
    tk.rotary_write_kv(q, k, v, cos_sin, torch.tensor([0, 1, 2]), k_cache, v_cache, torch.tensor([5, -1, 17]))
    assert torch.count_nonzero(k_cache.flatten(0, 1).abs().sum(-1)) == 2
    assert torch.equal(v_cache[0, 5], v[0]) and torch.equal(v_cache[1, 1], v[2])


# ---------------------------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------------------------

NORM_TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3}  # fp16: differences are single roundings


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("hidden", [64, 96, 1000])
def test_rms_norm(hidden, dtype, seed, poisoned_empty):
    x = (torch.randn(7, hidden) * 3).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    out = poisoned_empty(tk.rms_norm, x, weight, 1e-6)
    ref = REF.rms_norm(x, weight, 1e-6)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert rel_err(out, ref) < NORM_TOLERANCE[dtype], f"seed={seed}"


@pytest.mark.parametrize("weight_dtype", [torch.float16, torch.float32], ids=["w_fp16", "w_fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("hidden", [64, 200])
def test_add_rms_norm(hidden, dtype, weight_dtype, seed, poisoned_empty):
    x, residual = (torch.randn(5, hidden).to(dtype) for _ in range(2))
    weight = torch.randn(hidden).to(weight_dtype)
    out, new_residual = poisoned_empty(tk.add_rms_norm, x, residual, weight, 1e-5)
    ref, ref_residual = REF.add_rms_norm(x, residual, weight, 1e-5)
    assert out.dtype == ref.dtype and new_residual.dtype == ref_residual.dtype
    assert torch.equal(new_residual, ref_residual), f"seed={seed}"
    assert rel_err(out, ref) < NORM_TOLERANCE[dtype], f"seed={seed}"


# ---------------------------------------------------------------------------------------------------------------
# LayerNorm (Phi-2, OPT, Falcon) and GeGLU (Gemma)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("hidden", [64, 80, 1000])
def test_layer_norm(hidden, dtype, with_bias, seed, poisoned_empty):
    x = (torch.randn(7, hidden) * 3 + 2).to(dtype)  # off-centre rows: the mean must come out before the variance
    weight = torch.randn(hidden).to(dtype)
    bias = torch.randn(hidden).to(dtype) if with_bias else None
    out = poisoned_empty(tk.layer_norm, x, weight, bias, 1e-5)
    ref = REF.layer_norm(x, weight, bias, 1e-5)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any(), f"seed={seed}"
    assert rel_err(out, ref) < NORM_TOLERANCE[dtype], f"seed={seed}"
    # Element by element: float32 within a few of its steps of the terms torch adds up, x rstd w and mean rstd w (x -
    # mean may cancel, and the bias may cancel the rest); float16 one rounding apart (both compute in float32 and
    # round once), down to float16's smallest step.
    xd = x.double()
    scale = torch.rsqrt(xd.var(-1, unbiased=False, keepdim=True) + 1e-5) * weight.double().abs()
    terms = (xd.abs() + xd.mean(-1, True).abs()) * scale
    eps = torch.finfo(dtype).eps
    bound = 8 * eps * (ref.double().abs() + terms) if dtype == torch.float32 else eps * ref.double().abs()
    bound = bound + (0.0 if dtype == torch.float32 else 2.0**-24)
    assert ((out.double() - ref.double()).abs() <= bound).all(), f"seed={seed}"


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("hidden", [64, 200])
def test_add_layer_norm(hidden, dtype, with_bias, seed, poisoned_empty):
    x, residual = ((torch.randn(5, hidden) + 1).to(dtype) for _ in range(2))
    weight = torch.randn(hidden).to(dtype)
    bias = torch.randn(hidden).to(dtype) if with_bias else None
    out, new_residual = poisoned_empty(tk.add_layer_norm, x, residual, weight, bias, 1e-5)
    ref, ref_residual = REF.add_layer_norm(x, residual, weight, bias, 1e-5)
    assert out.dtype == ref.dtype and new_residual.dtype == ref_residual.dtype
    assert torch.equal(new_residual, ref_residual), f"seed={seed}"
    assert rel_err(out, ref) < NORM_TOLERANCE[dtype], f"seed={seed}"


def test_layer_norm_of_strided_rows_and_3d_input(seed):
    """Rows with a stride of their own (a view into a wider tensor) and a (batch, tokens, hidden) input, as
    F.layer_norm takes them."""
    wide = torch.randn(2, 3, 150)
    x = wide[..., :72]  # rows of 72 with a stride of 150
    weight, bias = torch.randn(72), torch.randn(72)
    out = tk.layer_norm(x, weight, bias, 1e-6)
    assert out.shape == x.shape and rel_err(out, REF.layer_norm(x, weight, bias, 1e-6)) < 1e-6, f"seed={seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("inter", [24, 100, 1100])  # 100: a masked tail; 1100: two column blocks, the second partial
def test_gelu_tanh_mul(inter, dtype, seed, poisoned_empty):
    gate_up = (torch.randn(5, 2 * inter + 8) * 3).to(dtype)[:, : 2 * inter]  # rows with a stride of their own
    gate_up[0, :6] = torch.tensor([-30.0, -10.0, -3.0, 0.0, 10.0, 30.0])  # saturated tails and zero
    out = poisoned_empty(tk.gelu_tanh_mul, gate_up)
    ref = REF.gelu_tanh_mul(gate_up)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any(), f"seed={seed}"
    gate, up = (half.double() for half in gate_up.chunk(2, dim=-1))
    # A few steps of the output's size; and for negative gates torch's own 1 + tanh(y) loses up to half a float32
    # step of 1 (ours, x sigmoid(2y), does not cancel): 2^-24 |gate * up|. Float16: one rounding of the activation
    # (its float32 values may straddle a float16 boundary) and one of the product, each down to float16's smallest
    # step, 2^-24 (subnormal).
    eps = torch.finfo(dtype).eps
    tiny = 0.0 if dtype == torch.float32 else 2.0**-24 * (up.abs() + 1)
    bound = (4 if dtype == torch.float32 else 2) * eps * ref.double().abs() + 2.0**-24 * (gate * up).abs() + tiny
    assert ((out.double() - ref.double()).abs() <= bound).all(), f"seed={seed}"


# ---------------------------------------------------------------------------------------------------------------
# Interface
# ---------------------------------------------------------------------------------------------------------------


def test_same_signatures_as_torch():
    assert tk.TRITON_KERNELS.name == "triton"
    names = ("rotary_write_kv", "paged_attention", "rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm")
    for name in (*names, "gelu_tanh_mul"):
        ours, theirs = getattr(tk.TRITON_KERNELS, name), getattr(REF, name)
        assert inspect.signature(ours) == inspect.signature(theirs), name


def test_tile_map():
    # query_start [0, 1, 2, 12, 13]: two decodes, a 10-token chunk over 4-token tiles, a decode.
    tiles = tk._tile_map((0, 1, 2, 12, 13), 4, torch.device("cpu"))
    assert tiles.tolist() == [[0, 1, 2, 2, 2, 3], [0, 0, 0, 4, 8, 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 1, 10, 1], [37]])
def test_attention_plan_is_the_map_paged_attention_reads(q_lens, dtype, seed):
    """The tile map the model runner sends with the step's inputs (attention_plan) is found by paged_attention under
    its key, so no layer builds and copies its own; and the output is the same as with the map it would build."""
    b = make_paged_batch(q_lens, [n + 20 for n in q_lens], heads=6, kv_heads=2, head_dim=80, block_size=16, dtype=dtype)
    key, ints = tk.attention_plan(b.meta.query_start_host, b.meta.max_query_len, 6, 2, 80, dtype)
    assert ints == tk._tiles_host(b.meta.query_start_host, key[1])
    own = tk.paged_attention(b.q, b.k_cache, b.v_cache, b.meta, 0.1)
    assert list(b.meta.workspace) == [key]  # the key the kernel looks its map up by
    built = b.meta.workspace.pop(key)
    b.meta.workspace[key] = sent = torch.tensor(ints, device=b.q.device).view(2, -1).to(torch.int32)
    torch.testing.assert_close(tk.paged_attention(b.q, b.k_cache, b.v_cache, b.meta, 0.1), own, rtol=0, atol=0)
    assert b.meta.workspace[key] is sent and torch.equal(sent, built)


# ---------------------------------------------------------------------------------------------------------------
# The real compiler: the interpreter accepts code that would not compile, so lower every kernel to a cubin for
# sm_90 and sm_80 (no GPU needed), with the argument types and specialisations a launch would give it.
# ---------------------------------------------------------------------------------------------------------------


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


_TRITON_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "u1",
    torch.uint8: "u8",
}


def _specialize(value) -> tuple[str, bool]:
    """(Triton type, divisible by 16) of one launch argument, as a launch specialises it: pointers by dtype, ints as
    i32 unless they need 64 bits, an int of 1 folded to a constexpr, None a constexpr; 16-divisible ints and
    16-aligned pointers marked. Written out here rather than taken from triton._C, whose name and signature change
    between Triton releases (the GPU machine's may be older than ours)."""
    if isinstance(value, torch.Tensor):
        return "*" + _TRITON_TYPES[value.dtype], value.data_ptr() % 16 == 0
    if value is None or (type(value) is int and value == 1):
        return "constexpr", False
    if isinstance(value, bool):
        return "u1", False
    if isinstance(value, int):
        return ("i32" if -(2**31) <= value < 2**31 else "i64"), value % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    raise TypeError(f"no Triton type for a launch argument of type {type(value).__name__}")


def _compile_for_gpu(kernel, args, kwargs, capability: int = 90):
    from triton.backends.compiler import BaseBackend, GPUTarget

    names = kernel.arg_names
    values = list(args) + [kwargs[n] for n in names[len(args) :]]
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, value) in enumerate(zip(names, values)):
        if name in kwargs:
            signature[name], constexprs[(i,)] = "constexpr", value
            continue
        signature[name], divisible = _specialize(value)
        if signature[name] == "constexpr":
            constexprs[(i,)] = value
        elif divisible:
            attrs[(i,)] = BaseBackend.parse_attr("D")
    options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages", "enable_fp_fusion")}
    src = triton.compiler.ASTSource(kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


def test_launch_specialisation_agrees_with_triton_where_it_can_tell():
    """_specialize against Triton's own (private) rule, where this Triton has it under the name it had in 3.4-3.9."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        pytest.skip("this Triton has no native_specialize_impl to compare with")
    for value in [torch.zeros(4, dtype=d) for d in _TRITON_TYPES] + [1, 0, 16, 17, -3, 2**31, 2**40, 0.5, True, None]:
        ty, key = native_specialize_impl(BaseBackend, value, False, True, True)
        assert _specialize(value) == (ty, key == "D"), value


def test_kernels_compile_for_gpu(monkeypatch):
    if not isinstance(triton.language.standard.sum, triton.runtime.JITFunction):
        pytest.skip("triton was first imported with TRITON_INTERPRET=1 in this session, so it cannot compile")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    compiled = importlib.import_module(MODULE)
    recorders = {}
    kernels = (
        "_paged_attention_kernel",
        "_decode_split_kernel",
        "_rotary_write_kv_kernel",
        "_rms_norm_kernel",
        "_layer_norm_kernel",
        "_gelu_tanh_mul_kernel",
    )
    for name in kernels:
        recorders[name] = _Recorder(getattr(compiled, name))
        monkeypatch.setattr(compiled, name, recorders[name])

    for dtype, q_lens, seq_lens, (kv_heads, heads, head_dim) in [
        (torch.float16, [1, 1], [50, 60], (8, 32, 128)),  # decode-only tile
        (torch.bfloat16, [1, 1], [50, 3000], (8, 32, 128)),  # split-KV decode
        (torch.bfloat16, [1, 40], [50, 60], (3, 9, 80)),  # prefill tile
        (torch.float32, [1, 40], [50, 60], (2, 16, 96)),  # float32 tile
    ]:
        b = make_paged_batch(
            q_lens, seq_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16, dtype=dtype, poison=True
        )
        q, k_cache, v_cache, meta = b.q, b.k_cache, b.v_cache, b.meta
        compiled.paged_attention(q, k_cache, v_cache, meta, 0.1)
        k = torch.zeros(q.shape[0], kv_heads, head_dim, dtype=dtype)
        compiled.rotary_write_kv(
            q,
            k,
            k,
            torch.zeros(64, head_dim),
            torch.zeros(q.shape[0], dtype=torch.long),
            k_cache,
            v_cache,
            meta.slot_mapping,
        )
        compiled.rotary_write_kv(  # partial rotary: the first 32 dims of each head (Phi-2's share of 80)
            q, k, k, torch.zeros(64, 32), torch.zeros(q.shape[0], dtype=torch.long), k_cache, v_cache, meta.slot_mapping
        )
        x = torch.zeros(4, 4096, dtype=dtype)
        compiled.rms_norm(x, x[0], 1e-6)
        compiled.add_rms_norm(x, x, x[0], 1e-6)
        compiled.layer_norm(x[:, :2560], x[0, :2560], x[0, :2560], 1e-5)  # Phi-2's hidden size, with a bias
        compiled.add_layer_norm(x, x, x[0], None, 1e-5)
        compiled.gelu_tanh_mul(torch.zeros(4, 2 * 3000, dtype=dtype))

    for name, recorder in recorders.items():
        assert recorder.launches, name
        for args, kwargs in recorder.launches:
            for capability in (90, 80):  # H100/H200, A100
                assert _compile_for_gpu(recorder.kernel, args, kwargs, capability).asm["cubin"], (name, capability)


def test_the_model_runner_sends_the_tile_map_with_the_step(tiny_model_dir):
    """ModelRunner.prepare puts the Triton kernels' tile map in the step's metadata, a view of the step's one copy,
    under the key paged_attention reads: a mixed step's first layer no longer builds it and copies it from pageable
    memory (a blocking copy on CUDA)."""
    from fastgen.replica import pipeline
    from fastgen.replica.batch import Batch, ScheduledSeq

    runner = pipeline(str(tiny_model_dir), dtype="float16", kernels="torch", device="cpu", progress=False).engine.runner
    runner.model.kernels = tk.TRITON_KERNELS  # prepare asks the model's table; the layers keep theirs (unused here)
    batch = Batch([ScheduledSeq(0, [5], 9, [0], True), ScheduledSeq(1, list(range(3, 40)), 0, [1, 2, 3], True)], 1, [])
    meta = runner.prepare(batch).meta
    attn = runner.model.layers[0].self_attn
    key = tk.attention_plan(
        meta.query_start_host, meta.max_query_len, attn.heads, attn.kv_heads, attn.head_dim, torch.float16
    )[0]
    tiles = meta.workspace[key]
    expected = tk._tile_map(tuple(meta.query_start_host), key[1], "cpu")
    assert tiles.dtype == torch.int32 and torch.equal(tiles.cpu(), expected)
