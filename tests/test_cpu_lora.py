"""The C LoRA delta (kernels/cpu_lora.py, csrc/lora.c) against a float64 reference of kernels/lora.py's contract:
segments of uneven lengths, an adapter's rows scattered through the batch, ranks below the slots' maximum, a slot
whose rank is 0 here, an output that is a column slice of a wider one; the same bits on one thread and on two."""

from __future__ import annotations

import pytest
import torch

from fastgen.kernels import clib, cpu_lora
from fastgen.kernels.cpu import CPU_KERNELS
from fastgen.kernels.lora import LoraSegments

pytestmark = pytest.mark.skipif(clib.get_library() is None, reason="no C compiler: torch serves the LoRA delta")


# (max_rank, each slot's rank): slot 2 leaves this part alone; ranks below, at and above the 16 lanes of a vector.
RANKS = {"rank8": (8, [8, 3, 0, 5]), "rank40": (40, [40, 3, 0, 21])}


def case(dtype: torch.dtype, seed: int = 0, tokens: int = 40, fan_in: int = 72, out: int = 80, ranks: str = "rank8"):
    g = torch.Generator().manual_seed(seed)
    (max_rank, ranks), slots, half = RANKS[ranks], 4, tokens // 2
    a = torch.zeros(slots, max_rank, fan_in, dtype=dtype)
    b = torch.zeros(slots, out, max_rank, dtype=dtype)
    for slot, r in enumerate(ranks):
        a[slot, :r] = torch.randn(r, fan_in, generator=g).to(dtype)
        b[slot, :, :r] = torch.randn(out, r, generator=g).to(dtype)
    x = torch.randn(tokens, fan_in, generator=g).to(dtype)
    order = torch.randperm(tokens, generator=g).tolist()  # an adapter's rows scattered; some rows get none
    groups = {3: order[:half], 0: order[half : half + 3], 2: order[half + 3 : half + 7], 1: order[half + 7 : half + 8]}
    rows, segments = [], []
    for slot, picked in sorted(groups.items()):
        segments.append((slot, len(rows), len(rows) + len(picked)))
        rows += picked
    table = torch.tensor([[s[i] for s in segments] for i in range(3)])
    seg = LoraSegments(torch.tensor(rows), segments, table, max(len(p) for p in groups.values()))
    wide = torch.randn(tokens, out + 16, generator=g).to(dtype)
    return x, a, b, seg, ranks, wide, groups


@pytest.mark.parametrize("ranks", sorted(RANKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_c_sgmv_matches_the_contract(dtype, ranks):
    x, a, b, seg, ranks, wide, groups = case(dtype, ranks=ranks)
    expected = wide.double()
    for slot, start, end in seg.segments:
        picked = seg.rows[start:end]
        delta = x[picked].double() @ a[slot].double().T @ b[slot].double().T
        expected[picked, 16:] += delta
    got = wide.clone()
    assert CPU_KERNELS.lora_sgmv is cpu_lora.lora_sgmv
    cpu_lora.lora_sgmv(got[:, 16:], x, a, b, seg, ranks)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=1 / 128)
    torch.testing.assert_close(got.double(), expected, **tol)
    assert torch.equal(got[:, :16], wide[:, :16])  # columns outside the slice untouched
    untouched = sorted(set(range(len(wide))) - set(seg.rows.tolist()) | set(groups[2]))
    assert torch.equal(got[untouched], wide[untouched])


@pytest.mark.parametrize("ranks", sorted(RANKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_c_sgmv_gives_the_same_bits_on_any_thread_count(dtype, ranks):
    x, a, b, seg, ranks, wide, _ = case(dtype, seed=1, tokens=400, fan_in=256, out=512, ranks=ranks)  # 2 threads' work
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got = wide.clone()
            cpu_lora.lora_sgmv(got[:, 16:], x, a, b, seg, ranks)
            results.append(got)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


def test_c_sgmv_declines_a_segment_past_the_rows():
    x, a, b, seg, ranks, wide, _ = case(torch.float32)
    bad = LoraSegments(seg.rows, [(0, 0, 99)], torch.tensor([[0], [0], [99]]), 99)
    with pytest.raises(RuntimeError, match="declined"):
        cpu_lora.lora_sgmv(wide[:, 16:], x, a, b, bad, ranks)
