"""Sliding-window attention and attention logit soft-capping in every kernel backend: the torch reference, the C
decode kernel (every row of a windowed or soft-capped layer goes through it on CPUs) and Triton (interpreted on a
CPU, compiled on a GPU) against dense attention; keys before a query's window are masked per call, and cache slots
no sequence owns hold NaN, so a kernel that reads them fails. GeGLU's activation against transformers'."""

from __future__ import annotations

import random

import pytest
import torch

from fastgen.kernels import TORCH_KERNELS, gelu_tanh_mul
from fastgen.testing import make_paged_batch

from .helpers import require_tool

CASES = [(0, 5.0), (5, 0.0), (16, 0.0), (5, 4.0), (1, 0.0)]  # (window, softcap)


def dense(batch, scale: float, window: int, softcap: float) -> torch.Tensor:
    """Float32 causal attention of the batch's queries over their tokens, windowed and soft-capped as transformers'
    eager attention does it."""
    kf, vf = batch.k_cache.flatten(0, 1), batch.v_cache.flatten(0, 1)
    starts = batch.meta.query_start_host
    outs = []
    for i, idx in enumerate(batch.token_slots):
        k, v = kf[idx].float(), vf[idx].float()  # (len, kv_heads, d)
        group = batch.q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        qi = batch.q[starts[i] : starts[i + 1]].float()
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        total, new = len(idx), starts[i + 1] - starts[i]
        k_pos, q_pos = torch.arange(total)[None, :], torch.arange(total - new, total)[:, None]
        hidden = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window else False)
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v))
    return torch.cat(outs)


def mixed_batch(seed: int, dtype, block_size: int, kv_heads: int = 2, group: int = 2, head_dim: int = 32, **kw):
    """Decodes of assorted lengths (inside and past the window, around 16-token tiles), then prompt chunks after a
    cached history and a whole prompt."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    decodes = [(n, 1) for n in (1, 4, 5, 6, 15, 16, 17, 40)] + [(rng.randrange(1, 120), 1) for _ in range(3)]
    seqs = decodes + [(rng.randrange(0, 50), rng.randrange(2, 40)), (0, 37)]
    return make_paged_batch(
        [new for _, new in seqs],
        [cached + new for cached, new in seqs],
        heads=kv_heads * group,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        rng=rng,
        spare_blocks=4,
        poison=True,
        num_decodes=len(decodes),
        **kw,
    )


@pytest.mark.parametrize("window, softcap", CASES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_torch_reference_windows_and_soft_caps(window, softcap, block_size):
    batch = mixed_batch(window + block_size, torch.float32, block_size)
    scale = 32**-0.5
    out = TORCH_KERNELS.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window, softcap)
    assert torch.allclose(out, dense(batch, scale, window, softcap), atol=1e-5, rtol=1e-5)


@pytest.fixture
def cpu_kernels(monkeypatch):
    """kernels/cpu.py with torch's attention forbidden: every row must go through the C decode kernel."""
    from fastgen.kernels import cpu

    if cpu.load_library() is None:
        require_tool(False, "no C compiler on this machine")

    def forbidden(*args, **kwargs):
        raise AssertionError("the torch attention ran where the C kernel must")

    for name in ("paged_attention", "prefill_attention"):
        monkeypatch.setattr(cpu, name, forbidden)
    return cpu


@pytest.mark.parametrize("window, softcap", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, head_dim", [(1, 32), (16, 64), (16, 40)])  # 40: the portable loop (float32)
def test_c_decode_kernel_windows_and_soft_caps(window, softcap, dtype, block_size, head_dim, cpu_kernels):
    batch = mixed_batch(7 + window, dtype, block_size, head_dim=head_dim)
    scale = head_dim**-0.5
    out = cpu_kernels.paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window, softcap)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), dense(batch, scale, window, softcap), atol=tol, rtol=tol)
    again = cpu_kernels.paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window, softcap)
    assert torch.equal(again, out)  # the per-step rows cached in the metadata give the same answer


@pytest.mark.parametrize("window", [3, 64, 70, 130])  # 64: a key tile of the prompt kernel; 70, 130: past one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_prompt_kernel_windows_over_long_chunks(window, dtype, cpu_kernels, monkeypatch):
    """Long prompt chunks after long histories take the AVX-512 prompt kernel with the window (its first key tile
    after the first row's window start, rows whose window starts past a tile skipped, keys before each row's window
    masked), decode rows the decode kernel's: against dense attention, on one thread and on several. The AMX kernel,
    which takes bfloat16 chunks where it runs, is kept out (tests/test_amx_prefill_window.py covers it)."""
    from fastgen.kernels import clib

    monkeypatch.setattr(cpu_kernels, "_amx_prefill_applies", lambda *a, **k: False)
    calls = []
    prompt_kernel = cpu_kernels._prefill_attention_avx512
    monkeypatch.setattr(
        cpu_kernels, "_prefill_attention_avx512", lambda *a, **k: calls.append(prompt_kernel(*a, **k)) or calls[-1]
    )
    rng = random.Random(window)
    torch.manual_seed(window)
    seqs = [(40, 1), (300, 1), (150, 200), (0, 141), (260, 67)]  # (cached, new): decodes first
    batch = make_paged_batch(
        [new for _, new in seqs],
        [cached + new for cached, new in seqs],
        heads=4,
        kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        rng=rng,
        spare_blocks=4,
        poison=True,
        num_decodes=2,
    )
    scale = 64**-0.5
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.set_num_threads(1)
    try:
        out = cpu_kernels.paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window)
        # the prompt kernel took the chunks where the CPU has AVX-512 (else they went row by row as decodes)
        assert calls == ["avx512f" in clib.cpu_identity()[1]]
        assert torch.allclose(out.float(), dense(batch, scale, window, 0.0), atol=tol, rtol=tol)
        torch.set_num_threads(2)
        again = cpu_kernels.paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(again, out)


def test_c_kernel_without_window_or_cap_is_unchanged(cpu_kernels):
    """window 0 and softcap 0 take the unwindowed path: the same bits as the call without them."""
    batch = mixed_batch(3, torch.float32, 16)
    plain = cpu_kernels.paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2)
    assert torch.equal(
        cpu_kernels.paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2, 0, 0.0), plain
    )


@pytest.mark.slow
@pytest.mark.cuda(interpreted=True)
@pytest.mark.parametrize("window, softcap", CASES)
def test_triton_attention_windows_and_soft_caps(window, softcap, monkeypatch):
    from . import test_triton_kernels as triton_tests  # its interpreted (or, on a GPU, compiled) copy of the kernels

    device = "cuda" if triton_tests.ON_CUDA else "cpu"
    if not triton_tests.ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    batch = mixed_batch(11 + window, torch.float32, 16, device=device)
    scale = 32**-0.5
    out = triton_tests.tk.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window, softcap)
    ref = dense(batch, scale, window, softcap)
    assert torch.allclose(out.float().cpu(), ref.cpu(), atol=1e-4, rtol=1e-4)


def test_gelu_tanh_mul_is_transformers_geglu():
    from transformers.activations import ACT2FN

    gate_up = torch.randn(7, 2 * 24)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(gelu_tanh_mul(gate_up), ACT2FN["gelu_pytorch_tanh"](gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [24, 100])  # 100: a masked tail
def test_c_gelu_tanh_mul_matches_torch(dtype, inter):
    from fastgen.kernels import clib, cpu

    require_tool(clib.get_library() is not None, "no C compiler")
    if cpu._elementwise_for(dtype) is None:  # a CPU's lack, not a tool's: skipped in CI too
        pytest.skip(f"a CPU without the {dtype} elementwise kernels (bfloat16: AVX-512 BF16; float32: AVX2)")
    gate_up = (torch.randn(9, 2 * inter + 8) * 3).to(dtype)[:, : 2 * inter]  # rows with a stride of their own
    ref = gelu_tanh_mul(gate_up.float()).to(dtype) if dtype == torch.float32 else gelu_tanh_mul(gate_up)
    out = cpu.gelu_tanh_mul_cpu(gate_up)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol)
