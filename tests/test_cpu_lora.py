"""The C LoRA delta (kernels/cpu_lora.py, csrc/lora.c) against a float64 reference of kernels/lora.py's contract:
segments of uneven lengths, an adapter's rows scattered through the batch, ranks below the slots' maximum, a slot
whose rank is 0 here, an output that is a column slice of a wider one; the same bits on one thread and on two.

The row kernel serves float32, and bfloat16 where fan_in is not a multiple of 32 (the first cases, fan_in 72); the
AMX path serves bfloat16 otherwise, on CPUs with AMX: prompt chunks beside decodes, each output the exact result
rounded once, and a row's bits independent of the batch around it and of the thread count."""

from __future__ import annotations

import ctypes

import pytest
import torch

from fastgen.kernels import clib, cpu_lora
from fastgen.kernels.cpu import CPU_KERNELS
from fastgen.kernels.lora import LoraSegments
from fastgen.kernels.lora import lora_sgmv as torch_lora_sgmv

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


# The AMX path (bfloat16, fan_in a multiple of 32): prompt-like segments whose rows are consecutive (read in place)
# beside decode-like ones of a few scattered rows (gathered), blocks of 16 rows and partial ones, outputs that are
# not a multiple of 16 columns, ranks from 2 to 64 (one K block of the expand or several; one rank tile or four).
AMX_SHAPES = {  # (fan_in, fan_out, max_rank, each slot's rank)
    "smollm-q": (576, 576, 16, [16, 16, 0, 16]),
    "down": (256, 80, 16, [16, 5, 0, 9]),
    "rank8-odd-out": (64, 87, 8, [8, 3, 0, 5]),
    "rank40": (96, 40, 40, [40, 3, 0, 21]),
    "rank64": (128, 200, 64, [64, 33, 0, 1]),
    "rank5": (32, 17, 5, [5, 2, 0, 5]),
}
needs_amx = pytest.mark.skipif(not cpu_lora.on_amx(), reason="no AMX here: the row kernel serves bfloat16 too")


def mixed_case(shape: str, seed: int = 0, prompt: int = 150, dtype: torch.dtype = torch.bfloat16):
    """x and y as column slices of wider tensors; slot 0 a prompt chunk of consecutive rows, slot 1 a few scattered
    rows (decodes), slot 2 rank 0 here, slot 3 a second chunk that ends in a partial block."""
    fan_in, out, max_rank, ranks = AMX_SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    slots = len(ranks)
    a = torch.zeros(slots, max_rank, fan_in, dtype=dtype)
    b = torch.zeros(slots, out, max_rank, dtype=dtype)
    for slot, r in enumerate(ranks):
        a[slot, :r] = (torch.randn(r, fan_in, generator=g) * fan_in**-0.5).to(dtype)
        b[slot, :, :r] = torch.randn(out, r, generator=g).to(dtype)
    tokens = prompt + 60
    x = torch.randn(tokens, fan_in + 32, generator=g).to(dtype)[:, 32:]
    decodes = torch.randperm(40, generator=g)[:7].add(prompt).tolist()
    groups = {0: list(range(prompt)), 1: decodes, 2: [prompt + 40, prompt + 41], 3: list(range(prompt + 42, tokens))}
    rows, segments = [], []
    for slot, picked in sorted(groups.items()):
        segments.append((slot, len(rows), len(rows) + len(picked)))
        rows += picked
    table = torch.tensor([[s[i] for s in segments] for i in range(3)])
    seg = LoraSegments(torch.tensor(rows), segments, table, max(len(p) for p in groups.values()))
    wide = torch.randn(tokens, out + 16, generator=g).to(dtype)
    return x, a, b, seg, ranks, wide, groups


def exact(x, a, b, seg, ranks, wide):
    """y + the delta in float64, and the magnitude of what was summed (for the float32 accumulation's error)."""
    expected, scale = wide.double()[:, 16:].clone(), wide.double()[:, 16:].abs()
    for slot, start, end in seg.segments:
        if ranks[slot]:
            picked = seg.rows[start:end]
            expected[picked] += x[picked].double() @ a[slot].double().T @ b[slot].double().T
            scale[picked] += x[picked].double().abs() @ a[slot].double().abs().T @ b[slot].double().abs().T
    return expected, scale


def assert_within_an_ulp(got: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor) -> None:
    """got (bfloat16) is the exact result rounded once: at most one bfloat16 step off it, beyond float32's error."""
    step = torch.pow(2.0, torch.floor(torch.log2(expected.abs().clamp_min(1e-30))) - 7)
    excess = (got.double() - expected).abs() - step - scale * 2**-16
    assert excess.max().item() <= 0, f"{(excess > 0).sum().item()} outputs off by more than a bfloat16 step"


@needs_amx
@pytest.mark.parametrize("shape", sorted(AMX_SHAPES))
def test_amx_sgmv_rounds_the_exact_delta_once(shape):
    x, a, b, seg, ranks, wide, groups = mixed_case(shape)
    got = wide.clone()
    cpu_lora.lora_sgmv(got[:, 16:], x, a, b, seg, ranks)
    expected, scale = exact(x, a, b, seg, ranks, wide)
    adapted = sorted(set(seg.rows.tolist()) - set(groups[2]))
    assert_within_an_ulp(got[adapted, 16:], expected[adapted], scale[adapted])
    assert torch.equal(got[:, :16], wide[:, :16])  # columns outside the slice untouched
    untouched = sorted(set(range(len(wide))) - set(adapted))
    assert torch.equal(got[untouched], wide[untouched])
    # Within the reference's tolerance too: the torch path rounds the shrunk vector and the delta to bfloat16.
    reference = wide.clone()
    torch_lora_sgmv(reference[:, 16:], x, a, b, seg, ranks)
    torch.testing.assert_close(got.double(), reference.double(), atol=0.1, rtol=1 / 64)


@needs_amx
@pytest.mark.parametrize("shape", ["smollm-q", "rank40"])
def test_amx_sgmv_gives_a_row_the_same_bits_in_any_batch_and_on_any_thread_count(shape):
    x, a, b, seg, ranks, wide, _ = mixed_case(shape, seed=1, prompt=600)  # enough work for two threads
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
    # Each segment's rows one at a time, and a prompt row among a few others: the same bits as in the whole batch.
    alone = wide.clone()
    for slot, start, end in seg.segments:
        for i in (start, end - 1):
            row = seg.rows[i : i + 1]
            cpu_lora.lora_sgmv(
                alone[:, 16:], x, a, b, LoraSegments(row, [(slot, 0, 1)], torch.tensor([[slot], [0], [1]]), 1), ranks
            )
            assert torch.equal(alone[row], results[0][row]), f"slot {slot}, row {row.item()}"
    few = seg.rows[5:9]
    cpu_lora.lora_sgmv(alone[:, 16:], x, a, b, LoraSegments(few, [(0, 0, 4)], torch.tensor([[0], [0], [4]]), 4), ranks)
    assert torch.equal(alone[few], results[0][few])


@needs_amx
def test_amx_sgmv_matches_the_row_kernel_closely():
    """The AMX path keeps the shrunk vector to about 16 bits (two bfloat16 parts): its outputs are those of the
    float32 row kernel (fan_in 72 is not a multiple of 32: there the row kernel serves) but for rounding ties."""
    x, a, b, seg, ranks, wide, _ = mixed_case("smollm-q", seed=2)
    got = wide.clone()
    cpu_lora.lora_sgmv(got[:, 16:], x, a, b, seg, ranks)
    via_rows = wide.clone()  # x with four zero columns appended: the same delta, on the row kernel
    padded = torch.cat([x, torch.zeros(len(x), 4, dtype=x.dtype)], dim=1)
    cpu_lora.lora_sgmv(via_rows[:, 16:], padded, torch.nn.functional.pad(a, (0, 4)), b, seg, ranks)
    differ = (got != via_rows).sum().item()
    assert differ <= got.numel() // 100, f"{differ} of {got.numel()} outputs differ"  # rounding s alone: ~40%
    torch.testing.assert_close(got.double(), via_rows.double(), atol=1e-3, rtol=1 / 128)  # a step apart


def untiled(y, x, a, b, seg, ranks) -> None:
    """The C kernel on the slots as they lie (dtype 1: it packs A and B into tiles itself, per call)."""
    library = clib.get_library()
    status = library.lora_sgmv(
        y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), a.data_ptr(), b.data_ptr(), seg.rows.data_ptr(),
        seg.table.data_ptr(), (ctypes.c_int32 * len(ranks))(*ranks), seg.rows.numel(), len(seg.segments),
        a.shape[0], a.shape[2], b.shape[1], a.shape[1], 1, torch.get_num_threads(),
    )  # fmt: skip
    assert status == 0


@needs_amx
@pytest.mark.parametrize("shape", sorted(AMX_SHAPES))
def test_amx_sgmv_reads_the_kept_tiles_as_it_packs_the_slots(shape):
    """cpu_lora keeps A and B in tile order beside the slots (tile_order); the kernel packing them itself from the
    contract's layouts gives the same bits."""
    x, a, b, seg, ranks, wide, _ = mixed_case(shape, seed=3)
    kept, packed = wide.clone(), wide.clone()
    cpu_lora.lora_sgmv(kept[:, 16:], x, a, b, seg, ranks)
    assert getattr(a, "_fastgen_lora_tiles", None) is not None  # the tiled path ran
    untiled(packed[:, 16:], x, a, b, seg, ranks)
    assert torch.equal(kept, packed)


@needs_amx
def test_amx_sgmv_follows_an_adapter_loaded_into_a_slot():
    """Loading an adapter writes into the slots in place (replica/lora.py's LoraLayer.load): the kept tiles are made
    again, and the next call uses the new weights."""
    x, a, b, seg, ranks, wide, _ = mixed_case("smollm-q", seed=4)
    cpu_lora.lora_sgmv(wide.clone()[:, 16:], x, a, b, seg, ranks)  # tiles kept for the old weights
    g = torch.Generator().manual_seed(5)
    a[1, :5].copy_(torch.randn(5, a.shape[2], generator=g).to(a.dtype))  # slot 1 now holds a rank-5 adapter
    b[1].zero_()
    b[1, :, :5].copy_(torch.randn(b.shape[1], 5, generator=g).to(b.dtype))
    ranks = [*ranks[:1], 5, *ranks[2:]]
    got, expected = wide.clone(), wide.clone()
    cpu_lora.lora_sgmv(got[:, 16:], x, a, b, seg, ranks)
    untiled(expected[:, 16:], x, a, b, seg, ranks)
    assert torch.equal(got, expected)


@needs_amx
def test_amx_sgmv_packs_per_call_slots_made_in_inference_mode():
    """Tensors made under torch.inference_mode keep no version counter: the slots are then packed on every call."""
    with torch.inference_mode():
        x, a, b, seg, ranks, wide, _ = mixed_case("rank40", seed=6)
        got = wide.clone()
        cpu_lora.lora_sgmv(got[:, 16:], x, a, b, seg, ranks)
    assert getattr(a, "_fastgen_lora_tiles", None) is None
    expected = wide.clone()
    untiled(expected[:, 16:], x, a, b, seg, ranks)
    assert torch.equal(got, expected)
