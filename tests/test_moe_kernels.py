"""The mixture-of-experts layer: the CPU kernels (kernels/csrc/moe.c and moe_bf16.c through kernels/cpu_moe.py) and
the torch reference (kernels/moe.py) against a per-token loop written here, at skewed routings (every token to the same
experts, uniform, experts no token chose) and batch sizes from one decode token to a prompt. In float32 the kernel
is also each token's dense float32 path bit for bit (it sums in linear_f32's order), on any thread count; an expert
with no tokens is never read; the packed and plain weights give the same layer. The AVX2 build is compiled here and
tested where this CPU runs it. In bfloat16 the grouped kernel is each token's dense bfloat16 path bit for bit likewise,
on the engine this CPU's dense layers use: AMX's tiles, or AVX-512 BF16's vdpbf16ps."""

import ctypes
import subprocess

import pytest
import torch
import torch.nn.functional as F

from fastgen.kernels import clib, cpu, cpu_moe, moe
from fastgen.kernels.packed_bf16 import PackedLinear

from .helpers import require_tool

REFERENCE = moe.fused_moe  # before forbid_reference replaces it
EXPERTS = 8
# hidden 80, intermediate 40: last panels short of 32 and 16 features (masked); 640 x 600: both GEMMs in two k blocks
# (more than linear_f32.h's KC steps), the gated sums kept in a scratch between them
SHAPES = {"small": (80, 40), "large": (640, 600)}
# bfloat16's kernel (csrc/moe_bf16.c) takes multiples of 32: 96 x 64, down's 6 column blocks in a group of 4 and a
# short one of 2; 640 x 576, model sizes
SHAPES_BF16 = {"small": (96, 64), "large": (640, 576)}
KINDS = ["one", "uniform", "sparse"]
TOKENS = [1, 3, 64, 300]
# Three threads: shares that do not divide evenly; every output is one thread's, so the bits must not change.
THREADS = 3


def layer(hidden: int, inter: int, seed: int = 0, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(EXPERTS, hidden, inter, generator=g) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def routing(kind: str, tokens: int, k: int, seed: int = 0) -> moe.Routing:
    """one: every token to the same k experts (all to expert 5 when k is 1); uniform: the router on random logits;
    sparse: only experts 1, 4, 6 and 7 chosen, the others left without a token."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, EXPERTS, generator=g)
    if kind == "one":
        logits[:, [5, 2, 7, 0][:k]] += 100.0
    elif kind == "sparse":
        unused = [e for e in range(EXPERTS) if e not in (1, 4, 6, 7)]
        logits[:, unused] = -float("inf")
    return moe.route(logits, k, renormalize=True)


def per_token(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, r: moe.Routing) -> torch.Tensor:
    """The layer one token and one slot at a time, in float64."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in range(r.ids.shape[1]):
            e, weight = int(r.ids[t, slot]), float(r.weights[t, slot])
            gate_up = w13[e].double() @ x[t].double()
            h = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += weight * (w2[e].double() @ h)
    return out


def in_threads(n, fn, *args):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def kernel():
    """The CPU MoE kernel, skipping where it cannot be built or does not run on this CPU."""
    if cpu.load_library() is None:
        require_tool(False, "no C compiler on this machine")
    if cpu_moe._moe_f32() is None:
        pytest.skip("a CPU without AVX-512 or AVX2: the torch reference serves")
    return cpu_moe


@pytest.fixture
def forbid_reference(monkeypatch):
    """The torch reference raises when called: the kernel must serve."""

    def reference(*args, **kwargs):
        raise AssertionError("fell back to the torch reference")

    monkeypatch.setattr(moe, "fused_moe", reference)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("tokens", TOKENS)
def test_kernel_matches_the_per_token_loop(kernel, forbid_reference, tokens, k, kind, shape):
    """float32 through the kernel (the reference forbidden) against float64, on one thread and several, on rows
    that are a view into wider ones."""
    hidden, inter = SHAPES[shape]
    w13, w2 = layer(hidden, inter, seed=tokens + k)
    packed = kernel.pack_experts(w13, w2)
    assert packed is not None and packed.holds_weight
    x = torch.randn(tokens, hidden + 16, generator=torch.Generator().manual_seed(k))[:, 8 : 8 + hidden]
    r = routing(kind, tokens, k, seed=tokens)
    y = in_threads(1, kernel.fused_moe, x, None, None, packed, r)
    torch.testing.assert_close(y.double(), per_token(x, w13, w2, r), rtol=1e-5, atol=2e-5)
    assert torch.equal(in_threads(THREADS, kernel.fused_moe, x, None, None, packed, r), y)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_tokens_result_is_the_dense_float32_paths_bit_for_bit(kernel, kind, shape):
    """A token's output is what linear_f32_silu_mul, linear_f32 and combine give it alone: the same bits in a batch
    of any size and routing, so a request does not depend on the requests beside it."""
    if cpu._linear_f32_gated() is None:
        pytest.skip("gate/up fused on AVX-512 only: the AVX2 build's SiLU is its own (test_avx2_build_...)")
    hidden, inter = SHAPES[shape]
    w13, w2 = layer(hidden, inter, seed=3)
    packed = kernel.pack_experts(w13, w2)
    gate_up = [cpu.pack_f32_gate_up(w) for w in w13]
    down = [cpu.pack_f32(w) for w in w2]
    tokens, k = 40, 2
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(4))
    r = routing(kind, tokens, k, seed=5)
    rows = []
    for t in range(tokens):
        slots = [cpu.linear_f32(cpu.linear_f32_silu_mul(x[t : t + 1], gate_up[e]), down[e], None) for e in r.ids[t]]
        rows.append(moe.combine(torch.cat(slots)[None], r.weights[t : t + 1], torch.float32))
    alone = torch.cat(rows)
    for threads in (1, THREADS):
        assert torch.equal(in_threads(threads, kernel.fused_moe, x, None, None, packed, r), alone), threads
    middle = moe.Routing(r.weights[7:19], r.ids[7:19])  # nor on its place in the batch
    assert torch.equal(kernel.fused_moe(x[7:19], None, None, packed, middle), alone[7:19])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_reference_matches_the_per_token_loop(dtype, tokens, k, kind):
    w13, w2 = layer(*SHAPES["small"], seed=k, dtype=dtype)
    x = torch.randn(tokens, SHAPES["small"][0], generator=torch.Generator().manual_seed(tokens)).to(dtype)
    r = routing(kind, tokens, k, seed=k)
    y = moe.fused_moe(x, w13, w2, None, r)
    assert y.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(y.double(), per_token(x, w13, w2, r), rtol=tol, atol=tol)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_experts_run_through_onednn_packed_once(tokens, kind):
    """bfloat16 experts the grouped kernel does not take (80 x 40: not multiples of 32): packed once for oneDNN where
    the CPU has bf16 (the plain weights dropped), expert by expert; within bfloat16's rounding of the per-token loop,
    as the reference is. Where oneDNN has no bf16, nothing is packed and the reference serves."""
    w13, w2 = layer(*SHAPES["small"], dtype=torch.bfloat16)
    x = torch.randn(tokens, SHAPES["small"][0]).bfloat16()
    r = routing(kind, tokens, 2)
    packed = cpu.CPU_KERNELS.pack_experts(w13, w2)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert isinstance(packed, cpu_moe.OneDnnExperts) and packed.holds_weight
        y = cpu.CPU_KERNELS.fused_moe(x, None, None, packed, r)
    else:
        assert packed is None
        y = cpu.CPU_KERNELS.fused_moe(x, w13, w2, None, r)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), per_token(x, w13, w2, r), rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(y.double(), moe.fused_moe(x, w13, w2, None, r).double(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_an_expert_with_no_tokens_is_not_read(kernel, tokens):
    """NaN weights in every expert the routing leaves out: the output stays finite, and is the clean weights'."""
    w13, w2 = layer(*SHAPES["small"])
    r = routing("sparse", tokens, 2)
    unused = [e for e in range(EXPERTS) if e not in r.ids.unique().tolist()]
    assert unused
    poisoned13, poisoned2 = w13.clone(), w2.clone()
    poisoned13[unused], poisoned2[unused] = float("nan"), float("nan")
    x = torch.randn(tokens, SHAPES["small"][0])
    clean = kernel.fused_moe(x, None, None, kernel.pack_experts(w13, w2), r)
    got = in_threads(THREADS, kernel.fused_moe, x, None, None, kernel.pack_experts(poisoned13, poisoned2), r)
    assert torch.isfinite(got).all() and torch.equal(got, clean)
    assert torch.isfinite(moe.fused_moe(x, poisoned13, poisoned2, None, r)).all()  # the reference neither


def test_packed_and_plain_weights_agree(kernel):
    """The CPU table on packed experts (the layer dropped its plain weights) and on plain ones (the reference); an
    input the kernel declines (columns not contiguous) goes to the reference with the weights unpacked."""
    w13, w2 = layer(*SHAPES["small"], seed=9)
    packed = cpu.CPU_KERNELS.pack_experts(w13, w2)
    assert isinstance(packed, cpu_moe.PackedExperts) and packed.holds_weight
    assert all(torch.equal(a, b) for a, b in zip(packed.unpacked(), (w13, w2)))
    x = torch.randn(64, SHAPES["small"][0])
    r = routing("uniform", 64, 2)
    fused = cpu.CPU_KERNELS.fused_moe(x, None, None, packed, r)
    plain = cpu.CPU_KERNELS.fused_moe(x, w13, w2, None, r)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(cpu.CPU_KERNELS.fused_moe(x, w13, w2, packed, r), fused)
    strided = x.T.contiguous().T
    assert torch.equal(cpu.CPU_KERNELS.fused_moe(strided, None, None, packed, r), moe.fused_moe(x, w13, w2, None, r))


def test_wrong_arguments_are_declined(kernel):
    w13, w2 = layer(*SHAPES["small"])
    packed = kernel.pack_experts(w13, w2)
    x, y = torch.randn(2, 80), torch.empty(2, 80)
    weights = torch.full((2, 2), 0.5)
    library = kernel._moe_f32()
    for ids, status in (([[0, 3], [1, 9]], -1), ([[0, 3], [-1, 2]], -1), ([[0, 3], [1, 7]], 0), ([[0, 8], [8, 8]], 0)):
        ids = torch.tensor(ids)
        args = (x.data_ptr(), 80, packed.w13.data_ptr(), packed.w2.data_ptr(), ids.data_ptr(), weights.data_ptr())
        assert library.moe_f32(*args, y.data_ptr(), 2, 2, EXPERTS, 80, 40, 1) == status, ids
    assert kernel.pack_experts(w13, w2[:, :, :39]) is None  # shapes that do not fit together


@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_slots_of_another_ranks_experts_add_nothing(kernel, forbid_reference, tokens):
    """Expert parallelism: an id equal to the number of experts held is a slot another rank computes. The kernel
    skips it (its expert is not read) and the token's other slots sum as before; a token with no slot here gets 0."""
    w13, w2 = layer(*SHAPES["small"])
    packed = kernel.pack_experts(w13[:4], w2[:4])  # this rank holds experts 0-3 of 8
    x = torch.randn(tokens, 80, generator=torch.Generator().manual_seed(tokens))
    r = routing("uniform", tokens, 2, seed=tokens)
    local = moe.Routing(r.weights, torch.where(r.ids < 4, r.ids, 4))
    mine = moe.Routing(r.weights * (r.ids < 4), torch.where(r.ids < 4, r.ids, 0))  # the same sum, other slots zeroed
    y = kernel.fused_moe(x, None, None, packed, local)
    torch.testing.assert_close(y.double(), per_token(x, w13[:4], w2[:4], mine), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(y, REFERENCE(x, w13[:4], w2[:4], None, local), rtol=1e-5, atol=2e-5)


def test_avx2_build_matches_the_native_build(kernel, tmp_path):
    """csrc/moe.c built for AVX2 (AVX-512 off, as on a Zen 3 or an older Xeon): the same gate/up and down sums, its
    own scalar SiLU, so within a few ulp of the native build at decode and prompt sizes, on any thread count."""
    compiler = clib.find_compiler()
    built = tmp_path / "moe_avx2.so"
    command = [compiler, *clib.FLAGS, "-mno-avx512f", *clib.OPENMP, "-o", str(built), str(clib.CSRC / "moe.c"), "-lm"]
    subprocess.run(command, check=True, capture_output=True)
    avx2 = ctypes.CDLL(str(built))
    if not avx2.moe_f32_available():
        pytest.skip("a CPU without AVX2 and FMA")
    avx2.moe_f32.restype, avx2.moe_f32.argtypes = ctypes.c_int, list(clib.signatures()["moe_f32"].values())
    for shape, tokens, k in (("small", 1, 2), ("small", 64, 4), ("large", 3, 2), ("large", 300, 2)):
        hidden, inter = SHAPES[shape]
        w13, w2 = layer(hidden, inter, seed=tokens)
        packed = kernel.pack_experts(w13, w2)
        x = torch.randn(tokens, hidden)
        r = routing("uniform", tokens, k, seed=tokens)
        native = kernel.fused_moe(x, None, None, packed, r)
        ptrs = (packed.w13.data_ptr(), packed.w2.data_ptr(), r.ids.data_ptr(), r.weights.contiguous().data_ptr())
        first = None
        for threads in (1, THREADS):
            y = torch.empty(tokens, hidden)
            status = avx2.moe_f32(x.data_ptr(), hidden, *ptrs, y.data_ptr(), tokens, k, EXPERTS, hidden, inter, threads)
            assert status == 0
            torch.testing.assert_close(y, native, rtol=1e-5, atol=1e-5)
            assert first is None or torch.equal(y, first)
            first = y


# ---- bfloat16: csrc/moe_bf16.c ----
@pytest.fixture(params=["amx", "dpbf16"])
def bf16_kernel(request, monkeypatch):
    """csrc/moe_bf16.c on one engine, the dense layers' packed kernel set to the same (a CPU with AMX has AVX-512 BF16
    too, so both are tested there); skipping the engines this CPU lacks."""
    library = cpu.load_library()
    if library is None:
        require_tool(False, "no C compiler on this machine")
    if request.param == "amx":
        if not library.moe_amx_bf16_available():
            pytest.skip("a CPU without AMX, or Linux refused it the tile state")
        moe_kernel, linear_kernel = library.moe_amx_bf16, library.linear_bf16
    else:
        if not library.moe_dpbf16_available():
            pytest.skip("a CPU without AVX-512 BF16")
        moe_kernel, linear_kernel = library.moe_dpbf16, library.linear_dpbf16
    monkeypatch.setattr(cpu_moe, "_moe_bf16", lambda: moe_kernel)
    monkeypatch.setattr(cpu, "_packed_bf16_kernel", lambda: linear_kernel)
    return cpu_moe


def dense_bf16(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, r: moe.Routing) -> torch.Tensor:
    """Each token alone through the dense bfloat16 path (the packed linear kernel, AMX's or vdpbf16ps's, the
    elementwise SiLU(gate) * up, the packed linear kernel) per slot, then combine."""
    gate_up = [PackedLinear.of(w) for w in w13]
    down = [PackedLinear.of(w) for w in w2]
    rows = []
    for t in range(x.shape[0]):
        slots = [
            cpu.linear_packed_bf16(
                cpu.silu_mul_cpu(cpu.linear_packed_bf16(x[t : t + 1], gate_up[e], None)), down[e], None
            )
            for e in r.ids[t]
        ]
        rows.append(moe.combine(torch.cat(slots)[None], r.weights[t : t + 1], torch.bfloat16))
    return torch.cat(rows)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tokens", [1, 3, 64, 300])
@pytest.mark.parametrize("shape", list(SHAPES_BF16))
def test_bfloat16_kernel_is_each_tokens_dense_path_bit_for_bit(bf16_kernel, forbid_reference, kind, tokens, shape):
    """bfloat16 experts packed once as dense layers are, run in one call: a token's output is the dense bfloat16
    path's for it alone, on one thread and several, within bfloat16's rounding of the float64 loop."""
    hidden, inter = SHAPES_BF16[shape]
    w13, w2 = layer(hidden, inter, seed=tokens, dtype=torch.bfloat16)
    packed = cpu.CPU_KERNELS.pack_experts(w13, w2)
    assert isinstance(packed, cpu_moe.PackedBf16Experts) and packed.holds_weight
    assert all(torch.equal(a, b) for a, b in zip(packed.unpacked(), (w13, w2)))
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).bfloat16()
    r = routing(kind, tokens, 2, seed=tokens)
    alone = dense_bf16(x, w13, w2, r)
    for threads in (1, THREADS):
        y = in_threads(threads, cpu.CPU_KERNELS.fused_moe, x, None, None, packed, r)
        assert y.dtype == torch.bfloat16 and torch.equal(y, alone), threads
    torch.testing.assert_close(alone.double(), per_token(x, w13, w2, r), rtol=5e-2, atol=5e-2)


def test_bfloat16_kernel_skips_unread_experts_and_other_ranks_slots(bf16_kernel, forbid_reference):
    """NaN weights in the experts no token chose leave the output finite and the same; a slot of another rank's
    expert (id = experts held) adds nothing, as moe.fused_moe's reference has it."""
    hidden, inter = SHAPES_BF16["small"]
    w13, w2 = layer(hidden, inter, dtype=torch.bfloat16)
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(1)).bfloat16()
    r = routing("sparse", 5, 2)
    unused = [e for e in range(EXPERTS) if e not in r.ids.unique().tolist()]
    poisoned13, poisoned2 = w13.clone(), w2.clone()
    poisoned13[unused], poisoned2[unused] = float("nan"), float("nan")
    clean = cpu.CPU_KERNELS.fused_moe(x, None, None, cpu.CPU_KERNELS.pack_experts(w13, w2), r)
    got = cpu.CPU_KERNELS.fused_moe(x, None, None, cpu.CPU_KERNELS.pack_experts(poisoned13, poisoned2), r)
    assert torch.isfinite(got).all() and torch.equal(got, clean)
    local = moe.Routing(r.weights, torch.where(r.ids < 4, r.ids, 4))  # this rank holds experts 0-3
    mine = cpu.CPU_KERNELS.fused_moe(x, None, None, cpu.CPU_KERNELS.pack_experts(w13[:4], w2[:4]), local)
    assert torch.equal(mine, REFERENCE(x, w13[:4], w2[:4], None, local))


def test_bfloat16_shapes_the_kernel_does_not_take_go_to_onednn(bf16_kernel):
    """hidden or intermediate not a multiple of 32: oneDNN per expert, as before the kernel."""
    w13, w2 = layer(*SHAPES["small"], dtype=torch.bfloat16)
    assert isinstance(cpu.CPU_KERNELS.pack_experts(w13, w2), cpu_moe.OneDnnExperts)


# ---- experts quantized at load (--quantization int8): the dense quantized kernels, expert by expert ----
@pytest.fixture(scope="module")
def int8_experts():
    """(w13, w2, their packed QuantExperts, the int8 values as float): hidden and intermediate whole Q8_0 blocks."""
    from fastgen.kernels import quant

    if cpu.load_library() is None:
        require_tool(False, "no C compiler on this machine")
    if not quant.quant_kernels():
        pytest.skip("a CPU without the quantized kernels: the experts stay float")
    w13, w2 = layer(*SHAPES_BF16["small"], seed=5)
    q13, q2 = [quant.quantize_per_channel(w) for w in w13], [quant.quantize_per_channel(w) for w in w2]
    packed = cpu.CPU_KERNELS.pack_quantized_experts(whole(q13), whole(q2))
    assert isinstance(packed, cpu_moe.QuantExperts) and packed.holds_weight
    values = torch.stack([q.dequantize() for q in q13]), torch.stack([q.dequantize() for q in q2])
    return q13, q2, packed, values


def whole(weights: list) -> list:
    """Each expert's weight as its one part."""
    return [[(0, w)] for w in weights]


def quant_alone(x: torch.Tensor, packed, r: moe.Routing, silu_mul) -> torch.Tensor:
    """Each token alone through the dense quantized path (gate/up, silu_mul(gate, up), down) per slot, then combine."""
    from fastgen.kernels import quant

    rows = []
    for t in range(x.shape[0]):
        slots = [
            quant.quant_linear(silu_mul(quant.quant_linear(x[t : t + 1], packed.w13[e], None)), packed.w2[e], None)
            for e in r.ids[t]
        ]
        rows.append(moe.combine(torch.cat(slots)[None], r.weights[t : t + 1], x.dtype))
    return torch.cat(rows)


@pytest.fixture(params=["kernel", "loop"])
def quant_moe_path(request, monkeypatch):
    """csrc/moe_quant.c's one call, or the Python loop over experts; the SiLU each runs: the dense MLP's elementwise
    kernel, torch's."""
    from fastgen.kernels.norm import silu_mul

    if request.param == "loop":
        monkeypatch.setattr(cpu_moe, "_moe_quant", lambda: None)
        return request.param, silu_mul
    if cpu_moe._moe_quant() is None:
        pytest.skip("no elementwise kernels on this CPU: the loop serves quantized experts")
    return request.param, cpu.silu_mul_cpu


def forbid_expert_loop(monkeypatch) -> None:
    def loop(*args, **kwargs):
        raise AssertionError("the quantized experts' kernel declined rows it takes")

    monkeypatch.setattr(moe, "per_expert", loop)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_int8_experts_are_each_tokens_dense_quantized_path(
    int8_experts, forbid_reference, quant_moe_path, monkeypatch, dtype, kind, tokens
):
    """float32: bit for bit each token's dense quantized path alone (those kernels do not depend on the batch), on
    any thread count, by the kernel and by the loop; bfloat16 (whose decode rows and prompt rows take different
    kernels, as dense layers' do): within its rounding. Both within rounding of the float64 loop on the int8 values.
    The kernel declines bfloat16 experts of a GEMM's rows (64 tokens), which the loop serves."""
    path, silu_mul = quant_moe_path
    if path == "kernel":
        library = cpu_moe._moe_quant()
        assert library is not None
        if not library.moe_quant_available(int(dtype == torch.bfloat16)):
            pytest.skip(f"no {dtype} elementwise kernels on this CPU (its SiLU): the loop serves these experts")
        if not (dtype == torch.bfloat16 and tokens == 64):
            forbid_expert_loop(monkeypatch)
    _, _, packed, (v13, v2) = int8_experts
    x = torch.randn(tokens, SHAPES_BF16["small"][0], generator=torch.Generator().manual_seed(tokens)).to(dtype)
    r = routing(kind, tokens, 2, seed=tokens)
    for threads in (1, THREADS):
        y = in_threads(threads, cpu.CPU_KERNELS.fused_moe, x, None, None, packed, r)
        assert y.dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(y, quant_alone(x, packed, r, silu_mul)), threads
    tol = 2e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(y.double(), per_token(x, v13, v2, r), rtol=tol, atol=tol)


def test_int8_experts_no_token_chose_are_not_read(int8_experts, forbid_reference):
    """NaN scales in every block of the experts the routing leaves out: the output stays finite and the same."""
    from fastgen.kernels import quant

    q13, q2, packed, _ = int8_experts
    r = routing("sparse", 5, 2)
    unused = [e for e in range(EXPERTS) if e not in r.ids.unique().tolist()]

    def poisoned(q: quant.QuantizedTensor) -> quant.QuantizedTensor:
        data = q.data.clone()
        data.view(q.shape[0], -1, 34)[:, :, :2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # float16 NaN
        return quant.QuantizedTensor(data, q.qtype, q.shape)

    bad = cpu.CPU_KERNELS.pack_quantized_experts(
        whole([poisoned(q) if e in unused else q for e, q in enumerate(q13)]),
        whole([poisoned(q) if e in unused else q for e, q in enumerate(q2)]),
    )
    x = torch.randn(5, SHAPES_BF16["small"][0])
    got = cpu.CPU_KERNELS.fused_moe(x, None, None, bad, r)
    assert torch.isfinite(got).all() and torch.equal(got, cpu.CPU_KERNELS.fused_moe(x, None, None, packed, r))
    all_poisoned = cpu.CPU_KERNELS.pack_quantized_experts(
        whole([poisoned(q) for q in q13]), whole([poisoned(q) for q in q2])
    )
    assert not torch.isfinite(cpu.CPU_KERNELS.fused_moe(x, None, None, all_poisoned, r)).all()  # the poison bites
