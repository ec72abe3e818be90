"""The Triton mixture-of-experts path (kernels/triton_moe.py) against kernels/moe.py's torch reference: compiled on a
GPU, under the Triton interpreter on CPU tensors elsewhere, on tiny shapes and skewed routings (every pair to one
expert, an expert no token chose, slots computed on another rank); its alignment step checked directly; and its
graph safety: on meta tensors, which have no data to read back, the whole host side runs and launches the same
grids for any routing.

Seeds are fixed per test (FASTGEN_TEST_SEED=<seed> overrides); outputs are allocated NaN-filled so a row the kernels
forget to write, or read without writing, fails the test.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import zlib

import pytest
import torch

# Imported before TRITON_INTERPRET is set, as tests/test_triton_kernels.py explains: only the kernels decorated while
# the flag is on (a private copy of triton_moe) run in the interpreter.
import triton

import fastgen.kernels as K
from fastgen.kernels import moe

pytestmark = [pytest.mark.slow, pytest.mark.cuda(interpreted=True)]
ON_CUDA = torch.cuda.is_available()
MODULE = "fastgen.kernels.triton_moe"
TABLE = "fastgen.kernels.triton_kernels"
KERNELS = ("_gate_up_kernel", "_down_kernel", "_combine_kernel")
HIDDEN, INTER, EXPERTS, TOP_K = 32, 48, 4, 2


def _import_fresh(name: str, interpret: bool):
    """A private copy of module `name`, its kernels (and triton_moe's, when it imports that) decorated with
    TRITON_INTERPRET on or off; sys.modules, the package's attributes and the environment are left as they were, so
    other test modules importing these get what they would have."""
    names = (MODULE, TABLE)
    saved_modules = {n: sys.modules.pop(n, None) for n in names}
    saved_attrs = {n: K.__dict__.pop(n.rpartition(".")[2], None) for n in names}
    saved_flag = os.environ.pop("TRITON_INTERPRET", None)
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        return importlib.import_module(name)
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
        if saved_flag is not None:
            os.environ["TRITON_INTERPRET"] = saved_flag
        for n in names:
            sys.modules.pop(n, None)
            K.__dict__.pop(n.rpartition(".")[2], None)
            if saved_modules[n] is not None:
                sys.modules[n] = saved_modules[n]
            if saved_attrs[n] is not None:
                K.__dict__[n.rpartition(".")[2]] = saved_attrs[n]


tm = _import_fresh(MODULE, interpret=not ON_CUDA)


@pytest.fixture(autouse=True)
def interpreting(monkeypatch):
    if ON_CUDA:
        torch.set_default_device("cuda")
        yield
        torch.set_default_device(None)
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # see tests/test_triton_kernels.py's fixture of this name
    yield


@pytest.fixture
def seed(request):
    value = int(os.environ.get("FASTGEN_TEST_SEED", zlib.crc32(request.node.nodeid.encode())))
    print(f"FASTGEN_TEST_SEED={value}")
    torch.manual_seed(value)
    return value


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Runs a function with torch.empty returning NaN-filled floating tensors."""
    real_empty = torch.empty

    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(torch, "empty", lambda *a, **kw: _nan_fill(real_empty(*a, **kw)))
            return fn(*args)

    return run


def _nan_fill(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan")) if t.is_floating_point() else t


def make_routing(kind: str, tokens: int) -> moe.Routing:
    """A routing of `tokens` over EXPERTS experts, TOP_K slots each, rows ascending as moe.route gives them."""
    logits = torch.randn(tokens, EXPERTS)
    if kind == "uniform":
        return moe.route(logits, TOP_K, renormalize=True)
    if kind == "idle_expert":  # expert 1 has no token: its weights are never read
        return moe.route(logits.index_fill(1, torch.tensor([1]), float("-inf")), TOP_K, renormalize=False)
    weights = torch.rand(tokens, TOP_K)
    if kind == "one_expert":  # every pair of slot 0 on expert 2, slot 1 on another rank's expert
        ids = torch.tensor([2, EXPERTS]).expand(tokens, TOP_K)
    elif kind == "expert_parallel":  # a random half of the slots computed elsewhere, then each row sorted
        ids = torch.rand(tokens, EXPERTS).argsort(dim=1)[:, :TOP_K]
        ids = torch.where(torch.rand(tokens, TOP_K) < 0.5, EXPERTS, ids).sort(dim=1).values
    else:
        raise ValueError(kind)
    return moe.Routing(weights, ids.contiguous())


def make_weights(dtype: torch.dtype, tokens: int):
    x = torch.randn(tokens, HIDDEN).to(dtype)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN) * HIDDEN**-0.5).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER) * INTER**-0.5).to(dtype)
    return x, w13, w2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
ROUTINGS = ["uniform", "one_expert", "idle_expert", "expert_parallel"]


# ---------------------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("tokens", [1, 5, 17])
@pytest.mark.parametrize("kind", ROUTINGS)
def test_matches_reference(kind, tokens, dtype, seed, poisoned_empty):
    x, w13, w2 = make_weights(dtype, tokens)
    routing = make_routing(kind, tokens)
    out = poisoned_empty(tm.fused_moe, x, w13, w2, None, routing)
    ref = moe.fused_moe(x, w13, w2, None, routing)
    context = f"seed={seed} ids={routing.ids.tolist()}"
    assert out.shape == ref.shape and out.dtype == ref.dtype, context
    assert not out.isnan().any(), f"unwritten or poisoned outputs: {context}"
    assert rel_err(out, ref) < TOLERANCE[dtype], context


# Tiles smaller than the shapes: several feature tiles, a last one partly outside the intermediate (48 = 32 + 16),
# K loops of several steps, a partial last step in the down GEMM, and experts spanning several row tiles.
@pytest.mark.parametrize("block_m,block_n,block_k", [(16, 16, 16), (16, 32, 32), (4, 32, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kind", ["uniform", "one_expert"])
def test_tiles_smaller_than_the_shapes(kind, dtype, block_m, block_n, block_k, seed, poisoned_empty):
    x, w13, w2 = make_weights(dtype, 17)
    routing = make_routing(kind, 17)
    config = tm.MoeConfig(block_m, block_n, block_k)
    out = poisoned_empty(tm._fused_moe, x, w13, w2, routing, config)
    ref = moe.fused_moe(x, w13, w2, None, routing)
    assert not out.isnan().any(), f"seed={seed}"
    assert rel_err(out, ref) < TOLERANCE[dtype], f"seed={seed}"


def test_no_tokens():
    x, w13, w2 = make_weights(torch.float32, 0)
    routing = moe.Routing(torch.empty(0, TOP_K), torch.empty(0, TOP_K, dtype=torch.int64))
    assert tm.fused_moe(x, w13, w2, None, routing).shape == (0, HIDDEN)


# ---------------------------------------------------------------------------------------------------------------
# Alignment
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_m", [4, 16])
@pytest.mark.parametrize("tokens", [1, 5, 17])
@pytest.mark.parametrize("kind", ROUTINGS)
def test_alignment(kind, tokens, block_m, seed):
    routing = make_routing(kind, tokens)
    a = tm.align_block_size(routing.ids, EXPERTS, block_m)
    pairs = tokens * TOP_K
    blocks = -(-tm.max_padded(pairs, EXPERTS, block_m) // block_m)
    assert a.sorted_ids.shape == (blocks * block_m,) and a.expert_ids.shape == (blocks,) and a.total.shape == (1,)
    flat, sorted_ids, expert_ids = routing.ids.flatten().tolist(), a.sorted_ids.tolist(), a.expert_ids.tolist()
    total = a.total.item()
    counts = [flat.count(e) for e in range(EXPERTS)]
    assert total == sum(-(-n // block_m) * block_m for n in counts) and total % block_m == 0
    # Every pair of a local expert appears once, in a tile of its expert, tokens ascending within each expert; the
    # rest of the padded total is padding (= pairs), and so is everything past it.
    real = [p for p in sorted_ids if p < pairs]
    assert sorted(real) == [p for p in range(pairs) if flat[p] < EXPERTS]
    assert all(p == pairs for p in sorted_ids[total:]) and all(0 <= p <= pairs for p in sorted_ids)
    assert all(flat[p] == expert_ids[i // block_m] for i, p in enumerate(sorted_ids) if p < pairs)
    # Each expert owns ceil(count / block_m) consecutive tiles, in ascending expert order; the tiles past the
    # total are marked with the id of no expert.
    expected = [e for e in range(EXPERTS) for _ in range(-(-counts[e] // block_m))]
    assert expert_ids[: total // block_m] == expected
    assert all(e == EXPERTS for e in expert_ids[total // block_m :])
    for e in range(EXPERTS):
        run = [p for i, p in enumerate(sorted_ids[:total]) if expert_ids[i // block_m] == e]
        assert run[: counts[e]] == sorted(run[: counts[e]]) and all(p == pairs for p in run[counts[e] :])


# ---------------------------------------------------------------------------------------------------------------
# Graph safety and the table
# ---------------------------------------------------------------------------------------------------------------


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def _launches(module, monkeypatch, *args) -> list:
    recorders = {name: _Recorder(getattr(module, name)) for name in KERNELS}
    with monkeypatch.context() as m:
        for name, recorder in recorders.items():
            m.setattr(module, name, recorder)
        module.fused_moe(*args)
    return [(name, launch) for name, r in recorders.items() for launch in r.launches]


def _signature(launch) -> tuple:
    """What a captured graph fixes of a launch: the grid, tensor shapes, every other argument."""
    name, (grid, args, kwargs) = launch
    return name, grid, tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args), kwargs


@pytest.mark.parametrize("tokens", [1, 5, 17])
def test_host_reads_nothing_per_step(tokens, monkeypatch):
    """Meta tensors hold no data: `.tolist()`, `.item()`, `if tensor:` or a routing-dependent shape would raise on
    them, so the host side running through (alignment included, the kernels recorded) is a graph-safe forward. The
    launches for the meta routing are those of every real one of the same size."""
    meta = [t.to("meta") for t in make_weights(torch.float16, tokens)]
    routing = make_routing("uniform", tokens)
    on_meta = _launches(tm, monkeypatch, *meta, None, moe.Routing(routing.weights.to("meta"), routing.ids.to("meta")))
    assert [name for name, _ in on_meta] == list(KERNELS)
    expected = [_signature(launch) for launch in on_meta]
    for kind in ROUTINGS:
        real = _launches(tm, monkeypatch, *make_weights(torch.float16, tokens), None, make_routing(kind, tokens))
        assert [_signature(launch) for launch in real] == expected, kind


def test_in_the_triton_table():
    table = _import_fresh(TABLE, interpret=not ON_CUDA).TRITON_KERNELS
    assert table.graph_safe
    for name in ("fused_moe", "pack_experts"):
        ours, theirs = getattr(table, name), getattr(K.TORCH_KERNELS, name)
        assert (ours.__module__, ours.__name__) == (MODULE, name)
        assert inspect.signature(ours) == inspect.signature(theirs), name
    assert tm.pack_experts(*make_weights(torch.float32, 1)[1:]) is None


def test_config_depends_on_batch_size_only():
    decode = tm.moe_config(1, 8, 128, torch.float16)
    assert decode.block_m == 16 and tm.moe_config(8192, 8, 128, torch.float16).block_m > decode.block_m
    assert tm.moe_config(64, 2, 8, torch.float16).block_m == 16  # 16 rows an expert: still decode-sized
    assert tm.moe_config(512, 2, 8, torch.float16).block_m == 64
    assert tm.moe_config(4096, 2, 8, torch.float32).block_k == 32


# ---------------------------------------------------------------------------------------------------------------
# The real compiler (see tests/test_triton_kernels.py): every kernel lowered to a cubin for sm_90, no GPU needed
# ---------------------------------------------------------------------------------------------------------------


def test_kernels_compile_for_gpu(monkeypatch):
    if not isinstance(triton.language.standard.sum, triton.runtime.JITFunction):
        pytest.skip("triton was first imported with TRITON_INTERPRET=1 in this session, so it cannot compile")
    from fastgen.tests.test_triton_kernels import _compile_for_gpu

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    compiled = _import_fresh(MODULE, interpret=False)
    launches = []
    for dtype, tokens in [(torch.float16, 1), (torch.bfloat16, 4096), (torch.float32, 64)]:
        x, w13, w2 = (t.to("meta") for t in make_weights(dtype, 1))
        x = torch.empty(tokens, HIDDEN, dtype=dtype, device="meta")
        ids = torch.empty(tokens, TOP_K, dtype=torch.int64, device="meta")
        launches += _launches(compiled, monkeypatch, x, w13, w2, None, moe.Routing(ids.float(), ids))
    for name, (_grid, args, kwargs) in launches:
        # meta tensors carry no address: stand-ins on the CPU of the same dtypes specialise the same way
        args = [torch.empty(1, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
        assert _compile_for_gpu(getattr(compiled, name), args, kwargs).asm["cubin"], name
