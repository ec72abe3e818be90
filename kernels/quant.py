"""Quantized weights: a linear layer's weight kept in a GGUF block type (llama.cpp's layouts, ggml-quants.h) and
multiplied in that form by csrc/linear_quant.c, so a replica holds the model at its file's size and a decode step
reads 4.5 to 8.5 bits per weight.

`QuantizedTensor` is a weight as the checkpoint ships it: rows of blocks, sliced by rows (column-parallel shards,
fused q/k/v and gate/up parts) or by whole blocks of columns (row-parallel shards) without dequantizing. A layer's
packed form, `QuantLinear`, holds its row slabs (consecutive parts of one type are one slab) and the kernel chosen
for them at load: one per (block type, CPU feature), `QUANT_KERNELS`. The model never sees the format: the layer
calls the kernels' `linear` as for any packed weight, which hands a `QuantLinear` to its own `linear`.

The kernels take float32 activations and write float32 (every weight dequantized in registers to gguf's value, no
rounding of the activations); bfloat16 activations are widened on the way in and rounded on the way out.

A decode batch (at most `INT8_MAX_ROWS` rows) of bfloat16 activations takes csrc/linear_q8.c instead where the CPU has
AVX-512 VNNI (every type here) or AVX2 (the 32-value types; `int8_types()`): the activations rounded to int8 per
32-value block and multiplied with the weights' quants in integers, as llama.cpp and vLLM's GGUF kernels do (llama.cpp
rounds a K-quant layer's activations per 256 values, coarser); from `AMX_INT8_MIN_ROWS` rows the 32-value types'
products run on AMX-INT8 tiles (csrc/linear_amx_q8.c, the same rounding) where the process may use them. bfloat16
activations have already lost more than that rounding costs; float32 activations take it only where the layer says so
(`QuantLinear.float32_int8`: a GGUF served in float32 because the CPU has no bfloat16 arithmetic, the dtype left to
auto), else float32 results stay the dequantized model's.
A decode batch of a few dozen rows past that (to `AMX_INT8_MAX_ROWS`) of the 32-value types (`AMX_INT8_TYPES`) takes
csrc/linear_amx_q8.c in the fused decode layer (kernels/decode_layer.py) as well. Other bfloat16 batches of
`bf16_gemm_rows()` rows or more (12 with AMX, 9 with AVX-512 BF16 alone) take one bfloat16 GEMM on the layer's values
rounded to bfloat16 instead: past those rows the exact kernels are bound by arithmetic, not by the weights' reads. That
is csrc/linear_quant.c's fused path (`fused_bf16_linear`), which dequantizes 64 rows at a time into the tiles of the
dense bfloat16 layers' kernel (AMX's with AMX, else vdpbf16ps's) and never writes the layer out whole; where neither
runs, oneDNN's GEMM on the layer dequantized for the call."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import clib

# ggml type name -> (ggml type number, weights per block, bytes per block): the types csrc/linear_quant.c reads.
GGML_TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}
TYPE_NAMES = {number: name for name, (number, _, _) in GGML_TYPES.items()}
ISA_NAMES = {0: "portable", 1: "avx2", 2: "avx512"}
# The most rows of x csrc/linear_q8.c is handed (a decode batch).
INT8_MAX_ROWS = 8
# The 32-value types, which csrc/linear_amx_q8.c reads (and linear_q8.c on AVX2).
AMX_INT8_TYPES = frozenset(number for number, weights, _ in GGML_TYPES.values() if weights == 32)
# The fewest bfloat16 rows that take one GEMM on the layer's values rounded to bfloat16 (the layer dequantized in
# panels into AMX or vdpbf16ps tiles, fused_bf16_linear) instead of the exact kernels, by the bfloat16 dot products the
# CPU has (the first of these flags it has), from the crossover of benchmarks/cpu_kernels.py --quant-only --threads 2
# (quant_rows_table: SmolLM2-135M's layers but the LM head, 106M weights):
#   amx_bf16: Intel Xeon with AMX, 2026-12-07, the fused AMX path (linear_quant_amx_bf16), 5 repeats: 14.6 ms
#     against the exact kernel's 12.3 at 8 rows, 16.1 against 20.9 at 16, 17.4 against 32.9 at 32 (oneDNN on the
#     layers dequantized per call, the path before it: 27.8, 29.5, 30.2); the fused path's cost is mostly its
#     dequantization (10.4 ms alone), so it overtakes the exact kernel near 12 rows.
#   avx512_bf16 without AMX: AMD EPYC Zen 4, 2026-12-06, where the GEMM is csrc/linear_quant.c's fused one (panels
#     dequantized into vdpbf16ps tiles, fused_bf16_linear): it tied the exact kernel and int8 activations at 8 rows
#     on the embedded Q4_1 layers (13.0 against 13.3 and 13.2 ms) and took 0.54x the exact kernel's time at 16,
#     0.40x at 64; so from the first row count int8 activations do not take. Zen 5 (the same kernels) not measured.
BF16_GEMM_ROWS = {"amx_bf16": 12, "avx512_bf16": INT8_MAX_ROWS + 1}
# The most decode rows the fused decode layer takes where csrc/linear_amx_q8.c (int8 activations on AMX-INT8 tiles)
# runs, past INT8_MAX_ROWS: from benchmarks/cpu_kernels.py --quant-rows-only, Intel Xeon with AMX, 2026-12-07, the
# file's Q4_1 layers (106M weights), 1 thread: 15.2 ms against the fused GEMM's 26.1 (VNNI's 23.3) at 12 rows, 15.2
# against 25.9 at 16, 22.9 against 28.8 at 32, 29.7 against 32.9 at 48 (2 threads: 19.8 against 20.0), 36.0 against
# 35.8 at 64. Each 32-value block's int32 products leave the tiles to be scaled, which past a few row tiles costs more
# than dequantizing the layer into bfloat16 tiles once. At 8 rows VNNI's loop is about as fast (15.6 against 13.9 on
# one thread, 9.2 against 8.6 on two), and faster below.
# Prompt rows never take int8 past INT8_MAX_ROWS (a first token's outsized activations lose most to the rounding).
AMX_INT8_MAX_ROWS = 32
# The fewest rows of int8 activations whose products (the 32-value types') take AMX-INT8 tiles rather than VNNI's loop,
# whose cost grows with every row, in quant_linear (to INT8_MAX_ROWS) and the fused decode layer (to AMX_INT8_MAX_ROWS;
# the same rounding of the activations either way): Intel Xeon with AMX, 2026-12-07, the file's layers but the LM
# head, 12 alternating passes, VNNI against AMX (a tile of at most 8 live rows scaling only those): 2 threads 6.95 /
# 7.07 ms at 4 rows, 7.83 / 7.19 at 5, 8.49 / 6.99 at 6, 11.49 / 7.46 at 8; 1 thread 12.91 / 13.04, 14.17 / 12.86,
# 16.05 / 13.99, 21.74 / 14.27.
AMX_INT8_MIN_ROWS = 5
# The fewest float32 rows of a layer that rounds float32 decode rows (QuantLinear.float32_int8) that take
# csrc/linear_quant_panels.c (linear_f32's GEMM on panels dequantized per call) instead of the exact kernels: AMD Zen 3,
# 2026-12-08, SmolLM2's 120 Q4_1 layers (random blocks), 2 threads, 5 passes: exact against panels 63.6 / 102.6 ms at
# 9 rows, 102.4 / 98.1 at 32, 202.4 / 158.2 at 64, 1390.9 / 811.2 at 430 (a 430-token prompt).
F32_PANEL_ROWS = 32


def block_shape(qtype: int) -> tuple[int, int]:
    """(weights, bytes) of one block of a taken type."""
    _, weights, size = GGML_TYPES[TYPE_NAMES[qtype]]
    return weights, size


def takes(qtype: int, in_features: int) -> bool:
    """Whether the kernels read rows of in_features weights of this ggml type."""
    return qtype in TYPE_NAMES and in_features % block_shape(qtype)[0] == 0


@dataclass(frozen=True)
class QuantizedTensor:
    """A weight (rows, cols) in ggml type `qtype`: data is uint8 (rows, bytes of a row), each row cols / block
    weights blocks in llama.cpp's layout."""

    data: torch.Tensor
    qtype: int
    shape: tuple[int, int]

    @property
    def name(self) -> str:
        return TYPE_NAMES.get(self.qtype, str(self.qtype))

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def splits_at(self, *columns: int) -> bool:
        """Whether every one of these column offsets falls between blocks (a shard may start or end there)."""
        weights, _ = block_shape(self.qtype)
        return all(c % weights == 0 for c in columns)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        """Rows (dim 0) or whole blocks of columns (dim 1) [start, start + length)."""
        rows, cols = self.shape
        if dim == 0:
            return QuantizedTensor(self.data.narrow(0, start, length), self.qtype, (length, cols))
        weights, size = block_shape(self.qtype)
        if start % weights or length % weights:
            raise ValueError(f"a {self.name} weight splits only at multiples of {weights} columns")
        data = self.data.narrow(1, start // weights * size, length // weights * size)
        return QuantizedTensor(data, self.qtype, (rows, length))

    def index_rows(self, index: torch.Tensor) -> QuantizedTensor:
        return QuantizedTensor(self.data.index_select(0, index), self.qtype, (len(index), self.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (rows, cols): the values the kernels multiply with."""
        library = clib.get_library()
        data = self.data.contiguous()
        rows, cols = self.shape
        out = torch.empty((rows, cols), dtype=torch.float32)
        if (
            library is not None
            and library.dequantize_rows_f32(data.data_ptr(), data.stride(0), out.data_ptr(), rows, cols, self.qtype)
            == 0
        ):
            return out
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize  # gguf's reference dequantizers, where no kernel library was built

        values = dequantize(data.numpy(), GGMLQuantizationType(self.qtype))
        return torch.from_numpy(values.copy()).reshape(rows, cols)


def quantize_per_channel(weight: torch.Tensor, absmax: torch.Tensor | None = None) -> QuantizedTensor | None:
    """`--quantization int8`: weight (rows, cols) as int8 with one scale per row (output channel), scale =
    max|row| / 127 in float16 and q = round(w / scale), nearest even. Written as Q8_0 blocks that all carry their row's
    scale, so every Q8_0 path (exact, int8 activations, bfloat16 GEMM, the fused layer) serves it; the repeated scale
    costs 2 bytes per 32 weights. absmax: the rows' max |w| where this is a shard of wider rows (a row-parallel
    layer's), so every TP size serves the same values. None where cols is not a whole number of blocks."""
    rows, cols = weight.shape
    qtype = GGML_TYPES["Q8_0"][0]
    per_block, _ = block_shape(qtype)
    if cols % per_block:
        return None
    w = weight.detach().float()
    if absmax is None:
        absmax = w.abs().amax(dim=1)
    # The smallest float16 subnormal keeps a tiny row's scale from rounding to zero (an all-zero row gives q = 0).
    scale = (absmax.float() / 127).clamp(min=2**-24).half()  # (rows,)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)  # (rows, cols)
    blocks = cols // per_block
    scales = scale.view(torch.uint8).view(rows, 1, 2).expand(rows, blocks, 2)
    quants = q.view(torch.uint8).view(rows, blocks, per_block)
    data = torch.cat([scales, quants], dim=2).reshape(rows, -1)  # (rows, blocks * 34): llama.cpp's block_q8_0
    return QuantizedTensor(data, qtype, (rows, cols))


@dataclass(frozen=True)
class QuantKernel:
    """The linear kernel of one block type on one CPU feature level, chosen at load."""

    qtype: int
    isa: int
    run: Callable[..., int]
    # The int8-activation kernel for decode rows of bfloat16 activations, where this CPU has one: run's arguments
    # with x and y in bfloat16 (linear_q8_bf16); run_int8_f32 the same in float32 (linear_q8_f32).
    run_int8: Callable[..., int] | None = None
    run_int8_f32: Callable[..., int] | None = None

    @property
    def name(self) -> str:
        # the int8 loop: VNNI's (which reads the K-quants too) or AVX2's, whatever the exact kernel's ISA
        int8 = "" if self.run_int8 is None else "+vnni" if GGML_TYPES["Q6_K"][0] in int8_types() else "+int8"
        return f"{TYPE_NAMES[self.qtype].lower()}_{ISA_NAMES.get(self.isa, self.isa)}{int8}"


@functools.cache
def quant_kernels() -> dict[int, QuantKernel]:
    """ggml type -> its kernel on this CPU; empty where the C library could not be built."""
    library = clib.get_library()
    if library is None:
        return {}
    isa = library.linear_quant_isa()
    kernels = {}
    for number, _, _ in GGML_TYPES.values():
        int8 = number in int8_types()
        kernels[number] = QuantKernel(
            number,
            isa,
            library.linear_quant_f32,
            library.linear_q8_bf16 if int8 else None,
            library.linear_q8_f32 if int8 else None,
        )
    return kernels


@functools.cache
def int8_types() -> frozenset[int]:
    """The ggml types csrc/linear_q8.c reads on this CPU: every one with AVX-512 VNNI, the 32-value ones on AVX2,
    none elsewhere."""
    library = clib.get_library()
    mask = library.linear_q8_types() if library is not None else 0
    return frozenset(number for number, _, _ in GGML_TYPES.values() if mask >> number & 1)


@dataclass(frozen=True)
class QuantLinear:
    """A quantized linear layer's packed form: row slabs (first output row, weight) covering its out_features in
    order, each with its kernel. It alone computes the layer (holds_weight)."""

    slabs: tuple[tuple[int, QuantizedTensor, QuantKernel], ...]
    out_features: int
    in_features: int
    # GPTQ act-order (kernels/int4.py): the input column of each stored one; quant_linear takes x in that order
    perm: torch.Tensor | None = None
    # float32 decode rows take int8 activations too (llama.cpp's numerics), not only bfloat16 ones: a GGUF served
    # with the dtype left to auto on a CPU without bfloat16 arithmetic (replica/builder.py); else float32 stays exact
    float32_int8: bool = False

    holds_weight = True

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for _, w, _ in self.slabs)

    @property
    def formats(self) -> list[str]:
        return [kernel.name for _, _, kernel in self.slabs]

    def dequantized(self) -> torch.Tensor:
        return torch.cat([w.dequantize() for _, w, _ in self.slabs])

    def dequantized_bf16(self) -> torch.Tensor:
        """(out_features, in_features) bfloat16: the weights' values rounded to nearest even, as
        dequantized().to(torch.bfloat16) gives them, on the torch threads."""
        library = clib.get_library()
        assert library is not None, "a QuantLinear is made only where the kernels were built (quant_kernels)"
        out = torch.empty((self.out_features, self.in_features), dtype=torch.bfloat16)
        threads = torch.get_num_threads()
        for call in self.calls:
            part = out[call.start : call.start + call.rows]
            status = library.dequantize_rows_bf16(
                call.weight, call.weight_stride, part.data_ptr(), call.rows, self.in_features, call.qtype, threads
            )
            if status != 0:
                raise RuntimeError(f"the {TYPE_NAMES[call.qtype].lower()} blocks could not be dequantized")
        return out

    @functools.cached_property
    def calls(self) -> tuple[SlabCall, ...]:
        """Each slab's kernel arguments that do not change between calls (a decode step makes ~100 of them)."""
        return tuple(
            SlabCall(
                start,
                w.data.data_ptr(),
                w.data.stride(0),
                w.shape[0],
                w.qtype,
                kernel.run,
                kernel.run_int8,
                kernel.run_int8_f32,
            )
            for start, w, kernel in self.slabs
        )

    @functools.cached_property
    def int8(self) -> bool:
        """Whether every slab has the int8-activation kernel (a decode batch of bfloat16 rows takes it)."""
        return all(call.run_int8 is not None for call in self.calls)


@dataclass(frozen=True)
class SlabCall:
    start: int  # the slab's first output row
    weight: int  # address of its blocks
    weight_stride: int  # bytes per row
    rows: int
    qtype: int
    run: Callable[..., int]
    run_int8: Callable[..., int] | None
    run_int8_f32: Callable[..., int] | None


def pack_quantized(
    parts: list[tuple[int, QuantizedTensor]], out_features: int, float32_int8: bool = False
) -> QuantLinear | None:
    """A layer's quantized parts (first output row, weight) as its packed form, or None where this CPU has no kernel
    for one of them (the caller dequantizes). Consecutive parts of one type are joined into one slab (q, k and v of
    one type: one kernel call). float32_int8: QuantLinear's."""
    kernels = quant_kernels()
    parts = sorted(parts, key=lambda p: p[0])
    if not parts or any(
        not isinstance(p, QuantizedTensor) or p.qtype not in kernels or not takes(p.qtype, p.shape[1]) for _, p in parts
    ):
        return None
    in_features = parts[0][1].shape[1]
    slabs: list[tuple[int, list[QuantizedTensor]]] = []
    row = 0
    for start, part in parts:
        if start != row or part.shape[1] != in_features:
            return None
        if slabs and slabs[-1][1][0].qtype == part.qtype:
            slabs[-1][1].append(part)
        else:
            slabs.append((start, [part]))
        row += part.shape[0]
    if row != out_features:
        return None
    joined = []
    for start, group in slabs:
        data = group[0].data
        # One part that is all of its own storage is the slab as it is: a tied LM head then shares its embedding's
        # blocks instead of holding a second copy. Anything else is joined (or cut out of a larger tensor) by a copy.
        if len(group) > 1 or not data.is_contiguous() or data.untyped_storage().nbytes() != data.nbytes:
            data = torch.cat([p.data for p in group]).contiguous()
        weight = QuantizedTensor(data, group[0].qtype, (data.shape[0], in_features))
        joined.append((start, weight, kernels[weight.qtype]))
    return QuantLinear(tuple(joined), out_features, in_features, float32_int8=float32_int8)


@functools.cache
def bf16_gemm_rows() -> int | None:
    """The fewest bfloat16 rows that take a bfloat16 GEMM on the rounded weights, on CPUs with bfloat16 dot products
    (AMX, AVX-512 BF16); None elsewhere (the exact kernels serve every row count)."""
    flags = set(clib.cpu_identity()[1])
    rows = next((rows for flag, rows in BF16_GEMM_ROWS.items() if flag in flags), None)
    return rows if rows is not None and torch.ops.mkldnn._is_mkldnn_bf16_supported() else None


@functools.cache
def amx_int8_kernel() -> Callable[..., int] | None:
    """csrc/linear_amx_q8.c's entry point where this process may use AMX-INT8 (linear_q8_bf16's arguments), else
    None."""
    library = clib.get_library()
    return library.linear_amx_q8_bf16 if library is not None and library.linear_amx_q8_available() else None


@functools.cache
def fused_bf16_kernel() -> Callable[..., int] | None:
    """csrc/linear_quant.c's fused path for bfloat16 prompts on the dense bfloat16 layers' engine: the matrix engine
    (linear_quant_amx_bf16) where this process may use AMX, else vdpbf16ps (linear_quant_dpbf16) with AVX-512 BF16;
    None elsewhere (oneDNN's GEMM on the layer dequantized for the call)."""
    library = clib.get_library()
    if library is None:
        return None
    if library.prefill_attention_available():  # AMX granted (csrc/amx.h)
        return library.linear_quant_amx_bf16
    return library.linear_quant_dpbf16 if library.linear_dpbf16_available() else None


def run_slabs(
    packed: QuantLinear,
    kernel_of: Callable[[SlabCall], Callable[..., int] | None],
    x: torch.Tensor,
    y: torch.Tensor,
    bias: torch.Tensor | None,
) -> SlabCall | None:
    """y[:, each slab's columns] = x W_slab^T (+ bias) by kernel_of(slab), all sharing one argument list (csrc's
    QUANT_LINEAR): y and bias in the kernel's dtype, x rows of unit stride. The slab a kernel declined, else None."""
    threads = torch.get_num_threads()
    for call in packed.calls:
        run = kernel_of(call)
        assert run is not None, "int8 only where every call has run_int8 (QuantLinear.int8)"
        status = run(
            x.data_ptr(),
            x.stride(0),
            call.weight,
            call.weight_stride,
            None if bias is None else bias.data_ptr() + bias.element_size() * call.start,
            y.data_ptr() + y.element_size() * call.start,
            packed.out_features,
            x.shape[0],
            call.rows,
            packed.in_features,
            call.qtype,
            threads,
        )
        if status != 0:
            return call
    return None


def fused_bf16_linear(x: torch.Tensor, packed: QuantLinear, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x W^T + bias, bfloat16, each slab's blocks dequantized a panel at a time into the vdpbf16ps kernel's tiles (the
    values dequantized_bf16 gives, never the whole layer at once); None where that kernel does not run here."""
    kernel = fused_bf16_kernel()
    if kernel is None or x.stride(-1) != 1:
        return None
    y = torch.empty((x.shape[0], packed.out_features), dtype=torch.bfloat16)
    bias = None if bias is None else bias.to(torch.bfloat16).contiguous()
    return y if run_slabs(packed, lambda call: kernel, x, y, bias) is None else None


def panels_f32_linear(x: torch.Tensor, packed: QuantLinear, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x W^T + bias in float32 by csrc/linear_quant_panels.c: linear_f32's GEMM on each slab's dequantized panels
    (the dequantized layer's float32 product, bit for bit); None where that kernel does not run here."""
    library = clib.get_library()
    if library is None or not library.linear_f32_available():
        return None
    y = torch.empty((x.shape[0], packed.out_features), dtype=torch.float32)
    bias = None if bias is None else bias.float().contiguous()
    return y if run_slabs(packed, lambda call: library.linear_quant_panels_f32, x, y, bias) is None else None


def quant_linear(x: torch.Tensor, packed: QuantLinear, bias: torch.Tensor | None) -> torch.Tensor:
    """x (rows, in_features) W^T + bias through the quantized kernels, in x's dtype (float32 inside, except
    bfloat16 decode batches, int8 activations, and bfloat16 prompts, a bfloat16 GEMM: see the module's docstring)."""
    if packed.perm is not None:
        x = x.index_select(-1, packed.perm)
    dtype = x.dtype
    rows = x.shape[0]
    if dtype == torch.bfloat16 and (threshold := bf16_gemm_rows()) is not None and rows >= threshold:
        y = fused_bf16_linear(x, packed, bias)
        if y is not None:
            return y
        # the weights' bfloat16 values (quantization none's) for this call only: the layer keeps its blocks
        return F.linear(x, packed.dequantized_bf16(), None if bias is None else bias.to(dtype))
    rounds = dtype == torch.bfloat16 or (dtype == torch.float32 and packed.float32_int8)
    int8 = rounds and 0 < rows <= INT8_MAX_ROWS and packed.int8
    if dtype == torch.float32 and packed.float32_int8 and rows >= F32_PANEL_ROWS and x.stride(-1) == 1:
        y = panels_f32_linear(x, packed, bias)
        if y is not None:
            return y
    xk = x if (dtype == torch.float32 or int8) and x.stride(-1) == 1 else x.float().contiguous()
    y = torch.empty((rows, packed.out_features), dtype=xk.dtype)
    if rows == 0:
        return y.to(dtype)
    bias = None if bias is None else bias.float().contiguous()
    bf16 = xk.dtype == torch.bfloat16
    amx = amx_int8_kernel() if int8 and bf16 and rows >= AMX_INT8_MIN_ROWS else None

    def kernel_of(call: SlabCall) -> Callable[..., int] | None:
        if not int8:
            return call.run
        if amx is not None and call.qtype in AMX_INT8_TYPES:
            return amx
        return call.run_int8 if bf16 else call.run_int8_f32

    declined = run_slabs(packed, kernel_of, xk, y, bias)
    if declined is not None:
        raise RuntimeError(f"the {TYPE_NAMES[declined.qtype].lower()} linear kernel declined its arguments")
    return y if y.dtype == dtype else y.to(dtype)
