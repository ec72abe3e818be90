"""The AMX bfloat16 prompt-chunk kernel (kernels/csrc/prefill_attention.c) under a sliding window: a query at position
p sees keys [p - window + 1, p], as the torch reference (kernels/attention.py) and the decode kernel's starts
(kernels/cpu.py window_starts) have it. Windows smaller than a chunk, larger than the whole history, not multiples of
the kernel's 16-query tiles or 32-key blocks; chunks of lengths that are not multiples of 16; GQA; one thread and two
give the same bits. Cache slots no sequence owns hold NaN, and the table entries before the blocks a window still needs
name a NaN block, or alias a held one, as after the engine gives blocks behind every layer's window back: the kernel
must not let any of those keys count (it does not read them at all), so the output does not change."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from fastgen.kernels import TORCH_KERNELS
from fastgen.testing import make_paged_batch

from .test_kernels_torch import torch_threads
from .test_sliding_window import dense


@pytest.fixture
def amx(monkeypatch):
    """kernels/cpu.py where the AMX prompt kernel runs, with every other way of attending a prompt chunk forbidden
    (torch's attention, the AVX-512 prompt kernel, rows as decodes); records the windows it was called with."""
    from fastgen.kernels import cpu

    if cpu._amx() is None:
        pytest.skip("no C compiler, or a CPU/kernel without AMX tiles: the AVX-512 prompt kernel serves prompts there")

    def forbidden(*args, **kwargs):
        raise AssertionError("a prompt chunk went elsewhere than the AMX kernel")

    for name in ("paged_attention", "prefill_attention", "_prefill_attention_avx512", "rows_as_decodes"):
        monkeypatch.setattr(cpu, name, forbidden)
    kernel, windows = cpu._prefill_attention_amx, []

    def spy(*args, **kwargs):
        windows.append(args[6] if len(args) > 6 else kwargs.get("window", 0))
        ok = kernel(*args, **kwargs)
        assert ok, "the AMX kernel declined"
        return ok

    monkeypatch.setattr(cpu, "_prefill_attention_amx", spy)
    monkeypatch.setattr(cpu, "amx_windows", windows, raising=False)
    return cpu


def batch_of(seqs, kv_heads: int, group: int, head_dim: int, block_size: int, seed: int, num_decodes: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    return make_paged_batch(
        [new for _, new in seqs],
        [cached + new for cached, new in seqs],
        heads=kv_heads * group,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.bfloat16,
        rng=rng,
        spare_blocks=3,
        poison=True,
        num_decodes=num_decodes,
    )


def attend(cpu, batch, scale: float, window: int, threads: int, tables=None) -> torch.Tensor:
    meta = batch.meta
    if tables is not None:
        meta = dataclasses.replace(meta, block_tables=tables, workspace={})
    with torch_threads(threads):
        return cpu.paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, meta, scale, window)


def released_tables(batch, window: int, alias: bool) -> torch.Tensor:
    """The batch's block tables with, for every prompt chunk, the entries before the block holding its first row's
    window start pointing elsewhere: at a block no sequence owns (every slot NaN), or (alias) at the first block the
    window still needs, as the scheduler leaves a table after giving the blocks behind the window back."""
    meta, block_size = batch.meta, batch.k_cache.shape[1]
    tables = meta.block_tables.clone()
    owned = {b for i, n in enumerate(batch.seq_lens) for b in tables[i, : -(-n // block_size)].tolist()}
    spare = next(b for b in range(batch.k_cache.shape[0]) if b not in owned)
    for i in range(meta.num_decodes, len(batch.seq_lens)):
        first_pos = batch.seq_lens[i] - batch.q_lens[i]
        first_block = max(0, first_pos + 1 - window) // block_size
        if first_block:
            tables[i, :first_block] = tables[i, first_block] if alias else spare
    return tables


# (cached, new) per sequence: decodes first, then chunks of lengths that are not multiples of 16 (and some that are)
# after histories shorter and longer than the windows.
SEQS = [(37, 1), (290, 1), (0, 45), (200, 17), (517, 130), (61, 1), (300, 64), (3, 7)]


@pytest.mark.parametrize("window", [1, 5, 16, 33, 100, 256, 4096])  # 4096: past every sequence's length
@pytest.mark.parametrize(
    "kv_heads, group, head_dim, block_size", [(1, 1, 64, 16), (2, 3, 64, 5), (2, 2, 128, 16), (1, 4, 64, 1)]
)
def test_amx_prompt_kernel_windows_match_the_torch_reference(window, kv_heads, group, head_dim, block_size, amx):
    """Against dense float32 attention and the torch reference (kernels/attention.py's paged_attention with the
    window), on one thread; two threads give the same bits."""
    batch = batch_of(SEQS, kv_heads, group, head_dim, block_size, window + head_dim + block_size, num_decodes=2)
    scale = head_dim**-0.5
    out = attend(amx, batch, scale, window, threads=1)
    assert amx.amx_windows == [window]  # the AMX kernel took every prompt chunk, under the window
    ref = dense(batch, scale, window, 0.0)
    assert torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2), (out.float() - ref).abs().max()
    torch_ref = TORCH_KERNELS.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window)
    assert torch.allclose(out.float(), torch_ref.float(), atol=3e-2, rtol=3e-2), (out.float() - torch_ref).abs().max()
    assert torch.equal(attend(amx, batch, scale, window, threads=2), out)


@pytest.mark.parametrize("window", [3, 31, 100, 256])
@pytest.mark.parametrize("block_size", [1, 16, 5])
@pytest.mark.parametrize("alias", [False, True])
def test_amx_prompt_kernel_reads_no_key_before_the_window(window, block_size, alias, amx):
    """Table entries before the blocks a chunk's windows need name a NaN block (alias=False) or another held block
    (alias=True, as after the engine gives blocks back): the output is the same, bit for bit, on 1 and 2 threads."""
    seqs = [(300, 1), (512, 512), (250, 37), (40, 3), (1000, 100)]
    batch = batch_of(seqs, 2, 2, 64, block_size, window * 7 + block_size, num_decodes=1)
    scale = 0.125
    out = attend(amx, batch, scale, window, threads=1)
    ref = dense(batch, scale, window, 0.0)
    assert torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2), (out.float() - ref).abs().max()
    tables = released_tables(batch, window, alias)
    assert not torch.equal(tables, batch.meta.block_tables)  # some entries do name released blocks
    prompts = slice(batch.meta.query_start_host[batch.meta.num_decodes], None)
    for threads in (1, 2):
        released = attend(amx, batch, scale, window, threads, tables)
        assert torch.equal(released[prompts], out[prompts]), threads


def test_a_window_past_the_history_gives_the_unwindowed_bits(amx):
    """A window that reaches back to every query's first token attends exactly as no window, bit for bit."""
    batch = batch_of([(0, 77), (130, 50), (20, 33)], 2, 2, 64, 16, 5, num_decodes=0)
    plain = attend(amx, batch, 0.125, 0, threads=1)
    assert torch.equal(attend(amx, batch, 0.125, 180, threads=1), plain)
    assert torch.equal(attend(amx, batch, 0.125, 10**6, threads=2), plain)
    assert amx.amx_windows == [0, 180, 10**6]
