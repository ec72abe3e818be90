"""The quantized linear kernels (kernels/csrc/linear_quant.c, kernels/quant.py) against gguf's own dequantizers
(gguf.quants, the reference for llama.cpp's block layouts): each block type dequantized bit for bit as gguf does,
products as float64 matrix products of those weights, every row's result the same alone or in any batch and on any
thread count. Each build (AVX-512, AVX2, portable C) is compiled here from the same source with the flags that
select it, and tested only where this CPU runs it."""

import ctypes
import subprocess

import numpy as np
import pytest
import torch

from fastgen.kernels import clib, quant

from .helpers import require_tool

gguf_quants = pytest.importorskip("gguf.quants")

# Where each block type keeps its float16 scales (bytes of a block): set to sane values in random blocks.
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2]}
HALF_FIELDS["Q6_K"] = [208]
TYPES = list(quant.GGML_TYPES)


def random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> quant.QuantizedTensor:
    """Random quants and scales of a ggml type: every bit pattern of the quants, scales in [-0.05, 0.05]."""
    number, weights, size = quant.GGML_TYPES[name]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // weights, size), dtype=np.uint8)
    for offset in HALF_FIELDS[name]:
        halves = rng.uniform(-0.05, 0.05, (rows, cols // weights)).astype(np.float16)
        data[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(rows, cols // weights, 2)
    return quant.QuantizedTensor(torch.from_numpy(data.reshape(rows, -1)), number, (rows, cols))


def reference(w: quant.QuantizedTensor) -> np.ndarray:
    return gguf_quants.dequantize(w.data.numpy(), w.qtype).reshape(w.shape).astype(np.float32)


def cpu_flags() -> set[str]:
    return set(clib.cpu_identity()[1])


class Build:
    """linear_quant.c built on its own with `march`, bound as clib binds it."""

    def __init__(self, path):
        library = ctypes.CDLL(str(path))
        params = clib.signatures()
        for name in ("linear_quant_isa", "linear_quant_f32", "dequantize_rows_f32"):
            fn = getattr(library, name)
            fn.restype, fn.argtypes = ctypes.c_int, list(params[name].values())
            setattr(self, name, fn)

    def linear(self, x, w: quant.QuantizedTensor, bias=None, threads=2) -> torch.Tensor:
        rows, n = x.shape[0], w.shape[0]
        y = torch.empty((rows, n), dtype=torch.float32)
        status = self.linear_quant_f32(
            x.data_ptr(), x.stride(0), w.data.data_ptr(), w.data.stride(0),
            None if bias is None else bias.data_ptr(), y.data_ptr(), n, rows, n, w.shape[1], w.qtype, threads,
        )  # fmt: skip
        assert status == 0
        return y

    def dequantize(self, w: quant.QuantizedTensor) -> torch.Tensor:
        out = torch.empty(w.shape, dtype=torch.float32)
        assert self.dequantize_rows_f32(w.data.data_ptr(), w.data.stride(0), out.data_ptr(), *w.shape, w.qtype) == 0
        return out


BUILDS = {  # name -> (march, CPU flags it needs)
    "native": ("native", set()),
    "avx2": ("haswell", {"avx2", "fma", "f16c"}),
    "portable": ("x86-64", set()),
}


def linear_quant_command(compiler: str, out, march: list[str]) -> list[str]:
    """The command building csrc/linear_quant.c alone (with the vdpbf16ps kernel its fused path calls) for `march`."""
    flags = [f for f in clib.FLAGS if not f.startswith("-march")] + march
    sources = [str(clib.CSRC / "linear_quant.c"), str(clib.CSRC / "linear_dpbf16.c")]
    return [compiler, *flags, *clib.OPENMP, "-o", str(out), *sources, "-lm"]


@pytest.fixture(scope="module", params=list(BUILDS))
def build(request, tmp_path_factory):
    march, needs = BUILDS[request.param]
    compiler = clib.find_compiler()
    require_tool(compiler, "no C compiler on this machine")
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU lacks {needs - cpu_flags()}")
    out = tmp_path_factory.mktemp(request.param) / "linear_quant.so"
    command = linear_quant_command(compiler, out, [f"-march={march}"])
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode and march == "x86-64":
        pytest.skip(f"this compiler does not target x86-64: {result.stderr[-300:]}")
    assert result.returncode == 0, result.stderr
    built = Build(out)
    expected = {"native": None, "avx2": 1, "portable": 0}[request.param]
    assert expected is None or built.linear_quant_isa() == expected
    return built


@pytest.mark.parametrize("name", TYPES)
def test_dequantized_weights_are_ggufs_bit_for_bit(build, name):
    w = random_blocks(name, 5, 512)
    assert np.array_equal(build.dequantize(w).numpy(), reference(w))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 21])
def test_linear_matches_the_dequantized_product(build, name, rows):
    w = random_blocks(name, 37, 512, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(37)
    weight = torch.from_numpy(reference(w)).double()
    expected = x.double() @ weight.T + bias.double()
    y = build.linear(x, w, bias)
    # float32 summation: each output within a few ulps of the sum of its terms' magnitudes
    scale = x.double().abs() @ weight.abs().T + bias.double().abs()
    assert ((y.double() - expected).abs() <= 1e-6 * scale).all()


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q6_K"])
def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads(build, name):
    """Decode strips and prompt panels sum in one order: a row alone, in a decode batch and in a prompt batch, on
    one thread or two, gives the same bits."""
    w = random_blocks(name, 70, 768)
    x = torch.randn(40, 768, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([build.linear(x[i : i + 1], w, threads=1) for i in range(len(x))])
    for rows in (3, 8, 40):
        for threads in (1, 2, 3):
            assert torch.equal(build.linear(x[:rows], w, threads=threads), alone[:rows]), (rows, threads)


def test_every_build_gives_the_same_bits(tmp_path_factory):
    """AVX-512, AVX2 and portable follow the same lanes and tree: the same results bit for bit."""
    builds = []
    compiler = clib.find_compiler()
    require_tool(compiler, "no C compiler on this machine")
    for name, (march, needs) in BUILDS.items():
        if not needs <= cpu_flags():
            continue
        out = tmp_path_factory.mktemp(f"same-{name}") / "linear_quant.so"
        command = linear_quant_command(compiler, out, [f"-march={march}"])
        if subprocess.run(command, capture_output=True).returncode == 0:
            builds.append(Build(out))
    w = random_blocks("Q4_K", 19, 512)
    x = torch.randn(11, 512)
    results = [b.linear(x, w) for b in builds]
    assert all(torch.equal(r, results[0]) for r in results[1:])


def test_wrong_arguments_are_declined(build):
    w = random_blocks("Q4_1", 4, 64)
    x = torch.randn(2, 64)
    y = torch.empty(2, 4)
    args = [x.data_ptr(), 64, w.data.data_ptr(), w.data.stride(0), None, y.data_ptr(), 4, 2, 4]
    assert build.linear_quant_f32(*args, 64, 99, 1) == -1  # a type the kernels do not read
    assert build.linear_quant_f32(*args, 48, w.qtype, 1) == -1  # k not a whole number of blocks
    assert build.linear_quant_f32(*args, 64, w.qtype, 1) == 0


# --- kernels/quant.py: the layer's packed form, through the process's library ---


def test_quant_linear_joins_parts_and_keeps_their_types():
    if not quant.quant_kernels():
        require_tool(False, "no C compiler on this machine")
    q, k, v = random_blocks("Q4_1", 64, 256, 1), random_blocks("Q4_1", 32, 256, 2), random_blocks("Q6_K", 32, 256, 3)
    packed = quant.pack_quantized([(96, v), (0, q), (64, k)], 128)
    assert [w.shape[0] for _, w, _ in packed.slabs] == [96, 32] and packed.holds_weight
    x = torch.randn(3, 256)
    bias = torch.randn(128)
    weight = torch.cat([torch.from_numpy(reference(t)) for t in (q, k, v)])
    expected = x.double() @ weight.double().T + bias.double()
    torch.testing.assert_close(quant.quant_linear(x, packed, bias).double(), expected, rtol=1e-4, atol=1e-3)
    assert torch.equal(packed.dequantized(), weight)
    assert quant.quant_linear(x.bfloat16(), packed, None).dtype == torch.bfloat16
    assert quant.pack_quantized([(0, q)], 128) is None  # rows missing: the caller dequantizes


def test_narrowing_keeps_whole_blocks():
    w = random_blocks("Q8_0", 8, 128)
    full = reference(w)
    assert np.array_equal(reference(w.narrow(1, 32, 64)), full[:, 32:96])
    assert np.array_equal(reference(w.narrow(0, 2, 3)), full[2:5])
    with pytest.raises(ValueError, match="multiples of 32"):
        w.narrow(1, 16, 32)


# --- kernels/csrc/linear_q8.c: int8 activations for decode rows, through the process's library ---

INT8_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]


def int8_library(name: str = "Q4_0"):
    """The process's library where its int8-activation path reads this type (AVX-512 VNNI: every one; AVX2: the
    32-value ones)."""
    library = clib.get_library()
    require_tool(library is not None, "no C compiler on this machine")
    if not library.linear_q8_available():
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2: the int8-activation path is not built")
    if quant.GGML_TYPES[name][0] not in quant.int8_types():
        pytest.skip(f"this CPU's int8-activation path (AVX2) does not read {name}: AVX-512 VNNI does")
    return library


def linear_call(run, x, w: quant.QuantizedTensor, bias=None, threads=2) -> torch.Tensor:
    """y = x w^T (+ bias) by one of the kernels' QUANT_LINEAR entry points, y in x's dtype."""
    rows, n = x.shape[0], w.shape[0]
    y = torch.empty((rows, n), dtype=x.dtype)
    status = run(
        x.data_ptr(), x.stride(0), w.data.data_ptr(), w.data.stride(0),
        None if bias is None else bias.data_ptr(), y.data_ptr(), n, rows, n, w.shape[1], w.qtype, threads,
    )  # fmt: skip
    assert status == 0
    return y


def int8_linear(library, x, w: quant.QuantizedTensor, bias=None, threads=2) -> torch.Tensor:
    return linear_call(library.linear_q8_f32, x, w, bias, threads)


def rounded_to_int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as llama.cpp's q8 activations hold it: per 32 values d = max|x| / 127, x / d rounded to nearest even."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True).float()
    d = amax / 127
    inverse = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, 1), 0)
    q = torch.round(blocks.float() * inverse)  # float32 product, as the kernel forms it; round: ties to even
    return (q.double() * d.double()).reshape(x.shape)


@pytest.mark.parametrize(
    "name,rows,k",
    [(name, rows, k) for name in INT8_TYPES for rows, k in [(1, 512), (1, 544), (3, 544), (8, 96), (5, 1536), (1, 64),
                                                             (2, 576)]]
    + [(name, rows, k) for name in K_TYPES for rows, k in [(1, 256), (2, 768), (8, 512), (5, 1536)]],
)  # fmt: skip
def test_int8_activations_are_llamas_rounding_times_the_weights(name, rows, k):
    """Each row's 32-value blocks rounded to int8 as llama.cpp does, multiplied exactly with the file's quants: the
    float64 product of those rounded activations and gguf's dequantized weights, to float32 summation. k past a
    group of 16 blocks, and rows ending in a quad of 1, 2 (its own half-width path) and 3 blocks (k = 544, 576 and 64,
    96) included; the K-quants' super-blocks (their scales, mins and high bits in every bit pattern) one to six a
    row."""
    library = int8_library(name)
    w = random_blocks(name, 37, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
    bias = torch.randn(37)
    weight = torch.from_numpy(reference(w)).double()
    xq = rounded_to_int8_blocks(x)
    expected = xq @ weight.T + bias.double()
    y = int8_linear(library, x, w, bias)
    scale = xq.abs() @ weight.abs().T + bias.double().abs()
    assert ((y.double() - expected).abs() <= 1e-6 * scale).all()
    exact = x.double() @ weight.T + bias.double()  # the rounding's cost: about a part in a thousand, no more
    assert (y.double() - exact).abs().max() <= 2e-2 * exact.abs().max()


@pytest.mark.parametrize(
    "name,k", [(name, k) for name in ["Q4_0", "Q4_1", "Q5_0", "Q8_0"] for k in [800, 576]] + [(n, 768) for n in K_TYPES]
)
def test_int8_rows_do_not_depend_on_their_batch_or_the_threads(name, k):
    """A row alone (2 weight rows at a time) equals the same row in a batch (a weight row at a time), on any thread
    count; 25 and 18 blocks: past a group, a last quad of one block and of two (read at half width)."""
    library = int8_library(name)
    w = random_blocks(name, 71, k)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([int8_linear(library, x[i : i + 1], w, threads=1) for i in range(len(x))])
    for rows in (2, 5, 8):
        for threads in (1, 2, 3):
            assert torch.equal(int8_linear(library, x[:rows], w, threads=threads), alone[:rows]), (rows, threads)


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_float32_prompt_panels_are_linear_f32_on_the_dequantized_layer(name):
    """csrc/linear_quant_panels.c: float32 rows through linear_f32's GEMM on panels dequantized per call give
    linear_f32's product on the dequantized layer bit for bit (n past a panel and a group of panels, a decode-sized
    batch and a blocked one, 1 to 3 threads); quant_linear takes it for F32_PANEL_ROWS rows or more of a layer that
    rounds float32 decode rows, never for one that does not."""
    from fastgen.kernels import cpu

    library = clib.get_library()
    require_tool(library is not None, "no C compiler on this machine")
    if not library.linear_f32_available():
        pytest.skip("this CPU has neither AVX-512 nor AVX2 with FMA: no linear_f32 kernel")
    w = random_blocks(name, 200, 512)
    dense = cpu.pack_f32(w.dequantize())
    bias = torch.randn(200)
    for rows in (3, 40):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        expected = cpu.linear_f32(x, dense, bias)
        for threads in (1, 2, 3):
            assert torch.equal(linear_call(library.linear_quant_panels_f32, x, w, bias, threads), expected)
    x = torch.randn(quant.F32_PANEL_ROWS, 512)
    rounding = quant.pack_quantized([(0, w)], 200, float32_int8=True)
    assert torch.equal(quant.quant_linear(x, rounding, None), cpu.linear_f32(x, dense, None))
    exact = quant.pack_quantized([(0, w)], 200)
    assert torch.equal(quant.quant_linear(x, exact, None), linear_call(library.linear_quant_f32, x, w))


def test_int8_path_declines_what_it_does_not_read():
    library = int8_library()
    w = random_blocks("Q4_K", 4, 512)
    x = torch.randn(2, 512)
    y = torch.empty(2, 4)
    args = [x.data_ptr(), 512, w.data.data_ptr(), w.data.stride(0), None, y.data_ptr(), 4, 2, 4]
    assert library.linear_q8_f32(*args, 288, w.qtype, 1) == -1  # a K-quant's k not a whole number of super-blocks
    assert library.linear_q8_f32(*args, 512, 15, 1) == -1  # a type it does not read (Q8_K)
    # a K-quant where the build reads them (AVX-512 VNNI), declined where it does not (AVX2)
    assert library.linear_q8_f32(*args, 512, w.qtype, 1) == (0 if w.qtype in quant.int8_types() else -1)
    w = random_blocks("Q4_0", 4, 64)
    args[2], args[3] = w.data.data_ptr(), w.data.stride(0)
    assert library.linear_q8_f32(*args, 48, w.qtype, 1) == -1  # k not a whole number of blocks
    assert library.linear_q8_f32(*args, 64, w.qtype, 1) == 0


def test_only_bfloat16_decode_rows_take_int8_activations():
    """float32 activations stay exact (the dequantized model's results); bfloat16 ones take the int8 path for a
    decode batch and the exact path for prompt rows below bf16_gemm_rows()."""
    library = int8_library()
    w = random_blocks("Q4_1", 64, 256)
    packed = quant.pack_quantized([(0, w)], 64)
    vnni = quant.GGML_TYPES["Q6_K"][0] in quant.int8_types()
    assert packed.formats == [
        "q4_1_avx512+vnni" if vnni else f"q4_1_{quant.ISA_NAMES[library.linear_quant_isa()]}+int8"
    ]
    x = torch.randn(12, 256).bfloat16().float()
    exact = quant.quant_linear(x, packed, None)
    assert torch.equal(exact[:3], quant.quant_linear(x[:3], packed, None))  # float32: exact for few rows too
    decode = quant.quant_linear(x[:4].bfloat16(), packed, None)
    assert torch.equal(decode, int8_linear(library, x[:4], w).bfloat16())
    assert not torch.equal(decode, exact[:4].bfloat16())
    eight = quant.quant_linear(x[:8].bfloat16(), packed, None)  # from AMX_INT8_MIN_ROWS on AMX-INT8 where it runs
    amx = quant.amx_int8_kernel()
    assert torch.equal(eight, linear_call(amx or library.linear_q8_bf16, x[:8].bfloat16(), w))
    if (quant.bf16_gemm_rows() or 13) > 12:  # 12 rows, a prompt, below the GEMM's rows where it has them (AMX)
        assert torch.equal(quant.quant_linear(x.bfloat16(), packed, None), exact.bfloat16())
    wide = torch.cat([x[:3], torch.randn(3, 256)], dim=1).bfloat16()  # rows of a wider tensor, as split() makes
    assert torch.equal(quant.quant_linear(wide[:, :256], packed, None), decode[:3])


# --- kernels/csrc/linear_amx_q8.c: int8 activations on AMX-INT8 tiles for a few dozen bfloat16 rows ---


def amx_int8_library():
    library = int8_library()
    if not library.linear_amx_q8_available():
        pytest.skip("this CPU has no AMX-INT8 (or Linux refused this process the tile state)")
    return library


@pytest.mark.parametrize("name", INT8_TYPES)
@pytest.mark.parametrize("rows,k,n", [(20, 576, 37), (9, 1536, 64), (32, 544, 16), (1, 64, 5)])
def test_amx_int8_is_llamas_rounding_times_the_weights(name, rows, k, n):
    """The activations rounded as the VNNI kernel rounds them (q8_block.h), each block's product exact: within a
    bfloat16 step of the VNNI kernel's result (the same products, summed in another order), and the rounding's cost
    against the unrounded product about a part in a thousand. Row tiles past m, a last group of fewer than 16 weight
    rows, and k of 2 to 48 blocks included."""
    library = amx_int8_library()
    w = random_blocks(name, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    weight = torch.from_numpy(reference(w)).double()
    y = linear_call(library.linear_amx_q8_bf16, x, w, bias).double()
    vnni = torch.cat([linear_call(library.linear_q8_bf16, x[i : i + 8], w, bias) for i in range(0, rows, 8)]).double()
    scale = x.double().abs() @ weight.abs().T + bias.double().abs()  # a sum's size before its terms cancel
    assert ((y - vnni).abs() <= 2**-7 * vnni.abs() + 1e-5 * scale).all()
    exact = x.double() @ weight.T + bias.double()
    assert (y - exact).abs().max() <= 2e-2 * exact.abs().max()


@pytest.mark.parametrize("name", ["Q4_1", "Q5_0", "Q8_0"])
def test_amx_int8_rows_do_not_depend_on_their_batch_or_the_threads(name):
    """A row alone (a tile of one row and 15 of padding, 8 of its rows scaled) equals the same row in batches of one
    or two row tiles, on any thread count."""
    library = amx_int8_library()
    w = random_blocks(name, 71, 800)
    x = torch.randn(24, 800, generator=torch.Generator().manual_seed(3)).bfloat16()
    alone = torch.cat([linear_call(library.linear_amx_q8_bf16, x[i : i + 1], w, threads=1) for i in range(len(x))])
    for rows in (5, 9, 17, 24):
        for threads in (1, 2, 3):
            got = linear_call(library.linear_amx_q8_bf16, x[:rows], w, threads=threads)
            assert torch.equal(got, alone[:rows]), (rows, threads)


def test_amx_int8_declines_what_it_does_not_read():
    library = amx_int8_library()
    x = torch.randn(12, 256).bfloat16()
    y = torch.empty(12, 4, dtype=torch.bfloat16)
    w = random_blocks("Q4_K", 4, 256)
    args = [x.data_ptr(), 256, w.data.data_ptr(), w.data.stride(0), None, y.data_ptr(), 4, 12, 4]
    assert library.linear_amx_q8_bf16(*args, 256, w.qtype, 1) == -1  # K-quants: the GEMM or the exact path
    w = random_blocks("Q4_0", 4, 64)
    args[2], args[3] = w.data.data_ptr(), w.data.stride(0)
    assert library.linear_amx_q8_bf16(*args, 48, w.qtype, 1) == -1  # k not a whole number of blocks
    assert library.linear_amx_q8_bf16(*args, 64, w.qtype, 1) == 0


@pytest.mark.parametrize("name", TYPES)
def test_bfloat16_weights_are_the_dequantized_ones_rounded(name):
    """A bfloat16 prompt's GEMM operand: gguf's values rounded to nearest even, as torch rounds them."""
    if not quant.quant_kernels():
        require_tool(False, "no C compiler on this machine")
    parts = [(0, random_blocks(name, 5, 512, 1)), (5, random_blocks("Q8_0", 3, 512, 2))]
    packed = quant.pack_quantized(parts, 8)
    expected = torch.cat([torch.from_numpy(reference(w)) for _, w in parts]).bfloat16()
    assert torch.equal(packed.dequantized_bf16(), expected)  # as values: the kernels' zeros carry no sign


def test_bfloat16_prompts_take_one_gemm_on_the_rounded_weights():
    """Where the CPU has bfloat16 dot products, a bfloat16 batch of at least bf16_gemm_rows() rows is one GEMM on
    the weights rounded to bfloat16 (quantization none's numerics), one row fewer the exact kernel; float32 prompts
    stay exact."""
    threshold = quant.bf16_gemm_rows()
    if threshold is None:
        pytest.skip("this CPU has neither AMX nor AVX-512 BF16")
    assert threshold == next(rows for flag, rows in quant.BF16_GEMM_ROWS.items() if flag in cpu_flags())
    w = random_blocks("Q4_1", 64, 256)
    packed = quant.pack_quantized([(0, w)], 64)
    x = torch.randn(threshold, 256).bfloat16()
    weight = torch.from_numpy(reference(w))
    y = quant.quant_linear(x, packed, None)
    if quant.fused_bf16_kernel() is not None:  # the packed bfloat16 kernel, as quantization none's layers run it
        from fastgen.kernels import cpu

        assert torch.equal(y, cpu.linear_packed_bf16(x, cpu.PackedLinear.of(weight.bfloat16()), None))
    else:
        assert torch.equal(y, torch.nn.functional.linear(x, weight.bfloat16()))
    if threshold - 1 > quant.INT8_MAX_ROWS:
        below = quant.quant_linear(x[1:], packed, None)
        assert torch.equal(below, quant.quant_linear(x[1:].float(), packed, None).bfloat16())
    exact = quant.quant_linear(x.float(), packed, None).double()
    assert ((exact - x.double() @ weight.double().T).abs() <= 1e-5 * (x.double().abs() @ weight.double().abs().T)).all()


@pytest.mark.parametrize("engine", ["amx", "dpbf16"])
@pytest.mark.parametrize("name", TYPES)
def test_panels_dequantized_into_bf16_tiles_give_the_rounded_weights_product(name, engine, monkeypatch):
    """The fused bfloat16 prompt path (csrc/linear_quant.c linear_quant_amx_bf16, linear_quant_dpbf16) equals the
    dense bfloat16 kernel of the same engine (AMX's, vdpbf16ps's) on the layer dequantized to bfloat16 and packed
    whole, bit for bit: two slabs (the second starting mid-panel), a last panel and block short of full, with and
    without bias, row counts around the kernels' row blocks (6 rows; 16 and 32), on one thread and three."""
    from fastgen.kernels import cpu

    from .test_kernels_torch import in_threads

    library = clib.get_library()
    if library is None:
        require_tool(False, "no C compiler on this machine")
    if engine == "amx" and not library.prefill_attention_available():
        pytest.skip("a CPU without AMX, or Linux refused it the tile state")
    if engine == "dpbf16" and not library.linear_dpbf16_available():
        pytest.skip("a CPU without AVX-512 BF16")
    fused, dense = (
        (library.linear_quant_amx_bf16, library.linear_bf16)
        if engine == "amx"
        else (library.linear_quant_dpbf16, library.linear_dpbf16)
    )
    monkeypatch.setattr(quant, "fused_bf16_kernel", lambda: fused)
    monkeypatch.setattr(cpu, "_packed_bf16_kernel", lambda: dense)
    parts = [(0, random_blocks(name, 70, 512, 3)), (70, random_blocks("Q8_0", 30, 512, 4))]
    packed = quant.pack_quantized(parts, 100)
    tiles = cpu.PackedLinear.of(packed.dequantized_bf16())
    bias = torch.randn(100).bfloat16()
    for rows in (1, 6, 7, 13, 17, 33, 70):
        x = torch.randn(rows, 544).bfloat16()[:, 16:528]  # rows of a wider tensor
        for b in (None, bias):
            expected = cpu.linear_packed_bf16(x, tiles, b)
            for threads in (1, 3):
                got = in_threads(threads, quant.fused_bf16_linear, x, packed, b)
                assert got is not None and torch.equal(got, expected), (rows, b is None, threads)
