"""4-bit integer weights with a scale and a zero point per group of input columns, as AWQ and GPTQ checkpoints ship
them: w = (q - zero) * scale, q and zero in 0..15, scale float16 (as a rule), one (scale, zero) per `group_size`
columns of a row.

`Int4Tensor` holds one weight (out_features, in_features) in one layout whatever the checkpoint's (replica/
int4_checkpoint.py unpacks AWQ's and GPTQ's into it): `qweight` int32 (rows, cols / 8), nibble j (lowest first) of
word c holding column 8c + j, so a row's quants are contiguous and a shard is a slice of rows or of whole groups of
columns, as for a GGUF weight (kernels/quant.py's QuantizedTensor, which it stands beside in the layers).

Where it is served:
- CUDA: kernels/triton_int4.py reads it as it is (dequantized in registers, one kernel per call).
- CPU: it becomes GGUF blocks the C kernels read (`to_ggml`, `pack_for_cpu`), exactly: Q5_0 holds d * (q5 - 16)
  with q5 in 0..31, so q5 = q - zero + 16 and d = scale give every weight its value bit for bit at 5.5 bits a
  weight; where every zero is 8 (GPTQ's symmetric checkpoints) Q4_0, d * (q - 8), holds it at 4.5 bits.
- elsewhere, or for a layout no kernel takes: dequantized to the layer's dtype at load (`dequantize`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .quant import GGML_TYPES, QuantizedTensor, QuantLinear, pack_quantized

NIBBLES = 8  # 4-bit values per int32 word
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble j of a word sits at bit 4j
_BIT_OF_BYTE = torch.arange(8, dtype=torch.uint8)


def unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 (..., n) -> int32 (..., 8 n) of values 0..15, nibble j of word c at 8c + j."""
    return ((words.unsqueeze(-1) >> _SHIFTS) & 0xF).flatten(-2)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_nibbles: (..., 8 n) values 0..15 -> int32 (..., n)."""
    words = (values.to(torch.int64).unflatten(-1, (-1, NIBBLES)) << _SHIFTS.to(torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the top nibble's bit is the sign


@dataclass(frozen=True)
class Int4Tensor:
    """A weight (rows, cols) of 4-bit quants: w[r, c] = (q[r, c] - zeros[r, c // g]) * scales[r, c // g].

    With `perm` (GPTQ's act-order: the groups hold input columns out of order), the columns are stored sorted by
    group: stored column j is input column perm[j], and a product takes x[:, perm] in place of x."""

    qweight: torch.Tensor  # int32 (rows, cols / 8)
    scales: torch.Tensor  # float16, or bfloat16 where a checkpoint's are (rows, cols / group_size)
    zeros: torch.Tensor  # uint8 (rows, cols / group_size), each 0..15
    group_size: int
    perm: torch.Tensor | None = None  # int64 (cols,): the input column of each stored one; None: in order

    name = "int4"

    def __post_init__(self) -> None:
        rows, words = self.qweight.shape
        groups = words * NIBBLES // self.group_size
        if self.scales.shape != (rows, groups) or self.zeros.shape != (rows, groups):
            raise ValueError(
                f"int4 weight of {rows} rows and {words * NIBBLES} columns in groups of {self.group_size}: scales "
                f"{tuple(self.scales.shape)} and zeros {tuple(self.zeros.shape)}, expected ({rows}, {groups})"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * NIBBLES

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * 4 + self.scales.numel() * 2 + self.zeros.numel()

    @property
    def symmetric(self) -> bool:
        """Every zero point is 8 (GPTQ's sym=True): the weights are d * (q - 8), Q4_0's form."""
        return bool((self.zeros == 8).all())

    def splits_at(self, *columns: int) -> bool:
        """Whether every one of these column offsets falls between groups (a shard may start or end there); never
        for permuted columns, whose groups span every shard."""
        return self.perm is None and all(c % self.group_size == 0 for c in columns)

    def narrow(self, dim: int, start: int, length: int) -> Int4Tensor:
        """Rows (dim 0) or whole groups of columns (dim 1) [start, start + length)."""
        if dim == 0:
            return self._map_rows(lambda t: t.narrow(0, start, length))
        if not self.splits_at(start, length):
            raise ValueError(
                f"an int4 weight in groups of {self.group_size} splits only at multiples of them, in order"
            )
        g = self.group_size
        return Int4Tensor(
            self.qweight.narrow(1, start // NIBBLES, length // NIBBLES),
            self.scales.narrow(1, start // g, length // g),
            self.zeros.narrow(1, start // g, length // g),
            g,
        )

    def index_rows(self, index: torch.Tensor) -> Int4Tensor:
        return self._map_rows(lambda t: t.index_select(0, index))

    def _map_rows(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> Int4Tensor:
        """The same rows of quants, scales and zeros."""
        return Int4Tensor(rows(self.qweight), rows(self.scales), rows(self.zeros), self.group_size, self.perm)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (rows, cols): (q - zero) * scale, each exact in float32."""
        q = unpack_nibbles(self.qweight).unflatten(-1, (-1, self.group_size))  # (rows, groups, g)
        w = ((q - self.zeros.to(torch.int32).unsqueeze(-1)).float() * self.scales.float().unsqueeze(-1)).flatten(-2)
        if self.perm is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.perm, w)  # stored column j back at input column perm[j]

    def to_ggml(self) -> QuantizedTensor | None:
        """The same values as GGUF blocks of 32 (Q4_0 where every zero is 8, else Q5_0), for the CPU's quantized
        kernels, the columns in their stored order (a permuted layer's packed form keeps `perm`: pack_for_cpu); None
        where a group is not a whole number of blocks or the scales are not float16."""
        if self.group_size % 32 or self.scales.dtype != torch.float16:
            return None
        rows, cols = self.shape
        name = "Q4_0" if self.symmetric else "Q5_0"
        chunk = 256  # rows converted at a time: the unpacked quants take 8 bytes a weight
        data = torch.cat([self.narrow(0, r, min(chunk, rows - r))._blocks(name) for r in range(0, rows, chunk)])
        return QuantizedTensor(data, GGML_TYPES[name][0], (rows, cols))

    def _blocks(self, name: str) -> torch.Tensor:
        """uint8 (rows, bytes of a row): each row's blocks of 32 in ggml's layout of type `name`. In bytes throughout:
        a load converts every weight of the model."""
        rows, cols = self.shape
        words = self.qweight.contiguous().view(torch.uint8)  # little-endian: byte b of a word holds nibbles 2b, 2b + 1
        q = torch.stack([words & 0xF, words >> 4], dim=-1).view(rows, cols // 32, 32)
        per_group = self.group_size // 32
        d = self.scales.repeat_interleave(per_group, dim=1).contiguous().view(torch.uint8).view(rows, -1, 2)
        if name == "Q4_0":
            blocks = torch.cat([d, _low_high(q)], dim=-1)
        else:
            zeros = self.zeros.repeat_interleave(per_group, dim=1).unsqueeze(-1)
            q5 = q + 16 - zeros  # 1..31, never below 0 in uint8
            high = (q5 >> 4).view(rows, cols // 32, 4, 8) << _BIT_OF_BYTE  # the 5th bits, 8 to a byte
            qh = high.sum(-1, dtype=torch.uint8)  # a little-endian uint32: bit j is value j's
            blocks = torch.cat([d, qh, _low_high(q5 & 0xF)], dim=-1)
        assert blocks.shape[-1] == GGML_TYPES[name][2]
        return blocks.reshape(rows, -1)


def random_int4(
    rows: int, cols: int, group_size: int, std: float, generator: torch.Generator, device: torch.device | str
) -> Int4Tensor:
    """Random quants and zero points 8, the scales set so the values spread as N(0, std)'s do (load_format dummy of
    an AWQ/GPTQ config): made where the kernels read them, nothing crossing from the CPU."""
    q = torch.randint(0, 16, (rows, cols), generator=generator, device=device, dtype=torch.int32)
    words = (q.view(rows, -1, NIBBLES) << _SHIFTS.to(device)).sum(-1, dtype=torch.int32)  # wraps as the sign bit
    groups = cols // group_size
    scales = torch.full((rows, groups), std / 4.6, dtype=torch.float16, device=device)  # std of q - 8 is 4.6
    zeros = torch.full((rows, groups), 8, dtype=torch.uint8, device=device)
    return Int4Tensor(words, scales, zeros, group_size)


def _low_high(values: torch.Tensor) -> torch.Tensor:
    """(..., 32) 4-bit values -> (..., 16) bytes, byte j = value j | value j + 16 << 4 (ggml's nibble order)."""
    return (values[..., :16] | (values[..., 16:] << 4)).to(torch.uint8)  # uint8 in, uint8 out


def int4_linear_reference(x: torch.Tensor, w: Int4Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + bias with W dequantized to x's dtype: what the kernels compute, up to summation order."""
    y = torch.nn.functional.linear(x, w.dequantize().to(x.dtype), bias)
    return y


class MixedOrders(ValueError):
    """A layer's int4 parts store their columns in different orders: one input cannot serve them all."""


def common_perm(parts: Sequence[tuple[int, object]]) -> torch.Tensor | None:
    """The column order every int4 part of a layer shares (None: in order); MixedOrders where they differ, as q, k
    and v quantized with act-order never do (GPTQ orders each by the Hessian of their one input)."""
    perms = [rows.perm for _, rows in parts if isinstance(rows, Int4Tensor)]
    first = perms[0] if perms else None
    if any(not (p is first or (p is not None and first is not None and torch.equal(p, first))) for p in perms):
        raise MixedOrders("the layer's parts store their columns in different orders")
    if first is not None and len(perms) != len(parts):
        raise MixedOrders("the layer mixes permuted int4 parts with other formats")
    return first


def pack_for_cpu(
    parts: list[tuple[int, QuantizedTensor | Int4Tensor]], out_features: int, float32_int8: bool = False
) -> QuantLinear | None:
    """The CPU backend's packed form of a layer's quantized parts: GGUF blocks for kernels/quant.py's kernels, each
    int4 part converted (to_ggml), act-order's column order kept for the input (QuantLinear.perm); None where a part
    converts to no blocks or the parts' orders differ (the layer dequantizes)."""
    try:
        perm = common_perm(parts)
    except MixedOrders:
        return None
    blocks = []
    for start, rows in parts:
        converted = rows.to_ggml() if isinstance(rows, Int4Tensor) else rows
        if converted is None:
            return None
        blocks.append((start, converted))
    packed = pack_quantized(blocks, out_features, float32_int8)
    return packed if packed is None or perm is None else dataclasses.replace(packed, perm=perm)


QUANTIZED = (QuantizedTensor, Int4Tensor)  # what a checkpoint's loader may hand a layer in place of a float tensor
