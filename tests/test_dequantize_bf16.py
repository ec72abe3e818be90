"""dequantize_rows_bf16 (kernels/csrc/linear_quant.c), a bfloat16 prompt's GEMM operand made per call: in every build
(AVX-512 with AVX-512 BF16's vcvtne2ps2bf16, AVX-512F's integer rounding, AVX2, portable C) the bits of the scalar
rule it replaced (bf16.h's f32_to_bf16: round to nearest even, a NaN kept and quieted) applied to the build's own
float32 weights, and so torch's rounding of gguf's values: every block type, odd row counts, strided rows, several
thread counts, and every float16 scale (subnormal, infinite and NaN ones too)."""

import ctypes
import subprocess

import numpy as np
import pytest
import torch

from fastgen.kernels import clib, quant

from .helpers import require_tool
from .test_quant_kernels import TYPES, cpu_flags, linear_quant_command, random_blocks, reference

BUILDS = {  # name -> (compiler flags past clib.FLAGS' others, CPU flags it needs)
    "native": (["-march=native"], set()),
    "avx512f": (["-march=native", "-mno-avx512bf16"], {"avx512f", "avx512_bf16"}),  # where native would take BF16
    "avx2": (["-march=haswell"], {"avx2", "fma", "f16c"}),
    "portable": (["-march=x86-64"], set()),
}


def scalar_bf16(values: np.ndarray) -> np.ndarray:
    """The old scalar rule, bit for bit: float32 bits -> bfloat16 bits (uint16)."""
    u = values.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # no wrap below NaN
    quiet = ((u >> 16) | 0x40).astype(np.uint16)
    return np.where((u & 0x7FFFFFFF) > 0x7F800000, quiet, rounded)


class Build:
    def __init__(self, path):
        library = ctypes.CDLL(str(path))
        params = clib.signatures()
        for name in ("linear_quant_isa", "dequantize_rows_f32", "dequantize_rows_bf16"):
            fn = getattr(library, name)
            fn.restype, fn.argtypes = ctypes.c_int, list(params[name].values())
            setattr(self, name, fn)

    def f32(self, w: quant.QuantizedTensor) -> np.ndarray:
        out = torch.empty(w.shape, dtype=torch.float32)
        assert self.dequantize_rows_f32(w.data.data_ptr(), w.data.stride(0), out.data_ptr(), *w.shape, w.qtype) == 0
        return out.numpy()

    def bf16(self, w: quant.QuantizedTensor, threads: int) -> torch.Tensor:
        out = torch.full(w.shape, float("nan"), dtype=torch.bfloat16)
        status = self.dequantize_rows_bf16(
            w.data.data_ptr(), w.data.stride(0), out.data_ptr(), *w.shape, w.qtype, threads
        )  # fmt: skip
        assert status == 0
        return out


@pytest.fixture(scope="module", params=list(BUILDS))
def build(request, tmp_path_factory):
    march, needs = BUILDS[request.param]
    compiler = clib.find_compiler()
    require_tool(compiler, "no C compiler on this machine")
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU lacks {needs - cpu_flags()}")
    out = tmp_path_factory.mktemp(request.param) / "linear_quant.so"
    command = linear_quant_command(compiler, out, march)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode and request.param == "portable":
        pytest.skip(f"this compiler does not target x86-64: {result.stderr[-300:]}")
    assert result.returncode == 0, result.stderr
    built = Build(out)
    expected = {"native": None, "avx512f": 2, "avx2": 1, "portable": 0}[request.param]
    assert expected is None or built.linear_quant_isa() == expected
    return built


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows,cols", [(1, 256), (7, 512), (261, 768)])
def test_bfloat16_rows_are_the_scalar_rounding_of_the_float32_ones(build, name, rows, cols):
    w = random_blocks(name, rows, cols, seed=rows)
    values = build.f32(w)
    expected = scalar_bf16(values)
    as_torch = torch.from_numpy(reference(w)).bfloat16()  # torch's round to nearest even of gguf's values
    for threads in (1, 2, 3):  # 261 x 768 weights are 3 shares of the rows; fewer take one thread
        out = build.bf16(w, threads)
        assert np.array_equal(out.view(torch.int16).numpy().view(np.uint16), expected), threads
        assert torch.equal(out, as_torch)  # as values: the kernels' zeros carry no sign


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_strided_rows(build, name):
    """A column shard's rows (a row stride past its own blocks), as narrow(1, ...) cuts them."""
    w = random_blocks(name, 9, 1024, seed=3).narrow(1, 256, 512)
    assert w.data.stride(0) > w.data.shape[1]
    assert np.array_equal(build.bf16(w, 2).view(torch.int16).numpy().view(np.uint16), scalar_bf16(build.f32(w)))


def test_every_float16_scale(build):
    """Q8_0 blocks with every float16 bit pattern as the scale, each against every quant (-128 .. 127), and Q4_1
    blocks with every scale against random offsets (any bit pattern): subnormal, huge, infinite and NaN scales,
    infinities and NaNs among the weights. The vector rounding (vcvtne2ps2bf16 in the native build here) gives the
    scalar rule's bits for all of them, NaNs included."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    _, weights, size = quant.GGML_TYPES["Q8_0"]
    blocks = np.empty((1 << 16, 8, size), dtype=np.uint8)
    blocks[:, :, :2] = halves.view(np.uint8).reshape(-1, 1, 2)
    blocks[:, :, 2:] = np.arange(256, dtype=np.uint32).astype(np.uint8).reshape(1, 8, 32)
    q8 = quant.QuantizedTensor(
        torch.from_numpy(blocks.reshape(1 << 16, -1)), quant.GGML_TYPES["Q8_0"][0], (1 << 16, 256)
    )
    number, weights, size = quant.GGML_TYPES["Q4_1"]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (1 << 16, 2, size), dtype=np.uint8)
    blocks[:, :, :2] = halves.view(np.uint8).reshape(-1, 1, 2)
    q4 = quant.QuantizedTensor(torch.from_numpy(blocks.reshape(1 << 16, -1)), number, (1 << 16, 64))
    for w in (q8, q4):
        values = build.f32(w)
        assert np.isnan(values).any() and np.isinf(values).any()
        got = build.bf16(w, 2).view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(got, scalar_bf16(values))
