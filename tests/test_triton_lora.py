"""The Triton LoRA delta (kernels/triton_lora.py) against kernels/lora.py's torch reference: compiled on a GPU, under
the Triton interpreter on CPU tensors elsewhere; segments of uneven lengths (one longer than a row tile), rows of one
adapter scattered through the batch, ranks below the slots' maximum, a slot whose rank is 0 here, and an output that
is a column slice of a wider one."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

# Imported before TRITON_INTERPRET is set (tests/test_triton_kernels.py says why): only the private copy of
# triton_lora imported below runs in the interpreter.
import triton  # noqa: F401

from fastgen.kernels.lora import LoraSegments, lora_sgmv

pytestmark = [pytest.mark.slow, pytest.mark.cuda(interpreted=True)]  # the interpreter on CPU, compiled on a GPU
ON_CUDA = torch.cuda.is_available()
MODULE = "fastgen.kernels.triton_lora"


def _load():
    if ON_CUDA:
        return importlib.import_module(MODULE)
    saved = sys.modules.pop(MODULE, None)
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return importlib.import_module(MODULE)
    finally:
        del os.environ["TRITON_INTERPRET"]
        sys.modules.pop(MODULE, None)
        if saved is not None:
            sys.modules[MODULE] = saved


tl_lora = _load()


# bf16 only on a GPU: the interpreter gets it wrong on CPU (as tests/test_triton_kernels.py notes)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else []))
def test_triton_sgmv_matches_the_torch_reference(dtype, monkeypatch):
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    device = "cuda" if ON_CUDA else "cpu"
    torch.manual_seed(0)
    tokens, fan_in, out, slots, max_rank = 40, 48, 80, 4, 8
    ranks = [8, 3, 0, 5]  # slot 2: this part not adapted
    a = torch.zeros(slots, max_rank, fan_in, dtype=dtype, device=device)
    b = torch.zeros(slots, out, max_rank, dtype=dtype, device=device)
    for slot, r in enumerate(ranks):
        a[slot, :r] = torch.randn(r, fan_in, dtype=dtype, device=device)
        b[slot, :, :r] = torch.randn(out, r, dtype=dtype, device=device)
    x = torch.randn(tokens, fan_in, dtype=dtype, device=device)
    order = torch.randperm(tokens).tolist()  # an adapter's rows scattered through the batch; some rows get none
    groups = {0: order[:20], 1: order[20:23], 2: order[23:27], 3: order[27:28]}  # 20 rows: more than one tile
    rows, segments = [], []
    for slot, picked in groups.items():
        segments.append((slot, len(rows), len(rows) + len(picked)))
        rows += picked
    table = torch.tensor([[s[i] for s in segments] for i in range(3)], device=device)
    seg = LoraSegments(torch.tensor(rows, device=device), segments, table, max(len(p) for p in groups.values()))
    wide = torch.randn(tokens, out + 16, dtype=dtype, device=device)
    expected = wide.clone()
    lora_sgmv(expected[:, 16:], x, a, b, seg, ranks)
    got = wide.clone()
    tl_lora.lora_sgmv(got[:, 16:], x, a, b, seg, ranks)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.25, rtol=0.02)
    torch.testing.assert_close(got, expected, **tol)
    assert torch.equal(got[:, :16], wide[:, :16])  # columns outside the slice untouched
    untouched = sorted(set(range(tokens)) - set(rows) | set(groups[2]))
    assert torch.equal(got[untouched], wide[untouched])
