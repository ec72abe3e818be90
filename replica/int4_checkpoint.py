"""AWQ and GPTQ checkpoints: a Hugging Face folder whose config.json carries a `quantization_config` and whose
quantized linear layers ship as `qweight`, `qzeros` and `scales` (GPTQ adds `g_idx`) instead of `weight`. Each such
layer is read into one kernels/int4.py Int4Tensor, named `<module>.weight`, so the model loads it as it loads any
weight and the kernels decide how to serve it.

The layouts (AutoAWQ's GEMM version; AutoGPTQ's and GPTQModel's `gptq` and `gptq_v2` formats), with w = (q - zero)
* scale per group of `group_size` input rows:
- AWQ: qweight int32 (in, out / 8) and qzeros int32 (in / g, out / 8), 8 output columns a word in AWQ's order (nibble
  i holds column 8c + AWQ_ORDER[i]); scales (in / g, out).
- GPTQ: qweight int32 (in / 8, out), nibble i of word r holding input row 8r + i; qzeros int32 (in / g, out / 8)
  in plain order, stored as zero - 1 in the `gptq` format (zero itself in `gptq_v2`); scales (in / g, out); g_idx
  (in,), each input row's group. A checkpoint made with act-order (desc_act) has input rows out of group order: the
  layer keeps them sorted by group with the order they came from (Int4Tensor.perm), and the kernels (Triton's, the
  CPU's) permute the activations to match; a row-parallel shard of such a layer is dequantized at load."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..kernels.int4 import NIBBLES, Int4Tensor, pack_nibbles, unpack_nibbles

METHODS = ("awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its eight
_AWQ_UNDO = torch.tensor([AWQ_ORDER.index(j) for j in range(NIBBLES)])  # column j is nibble _AWQ_UNDO[j]
PARTS = ("qweight", "qzeros", "scales")  # every int4 layer's
# GPTQ's g_idx, where a checkpoint has it (some writers leave it out when the groups are in order); a module's names
# sort g_idx first, so it is there when the last of PARTS arrives


@dataclass(frozen=True)
class Int4Format:
    """What a checkpoint's quantization_config says of its int4 layers."""

    method: str  # "awq" | "gptq"
    group_size: int  # input rows per (scale, zero); -1 in a config: all of them
    zeros_minus_one: bool = False  # GPTQ's `gptq` format stores each zero point less one


def int4_format(hf_config: dict) -> Int4Format | None:
    """The int4 format of a checkpoint's config.json; None where it has no quantization_config. A config this reader
    cannot serve is refused with what it holds and what FastGen takes."""
    quant = hf_config.get("quantization_config")
    if not quant:
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(
            f"the checkpoint's quantization_config has quant_method {method!r}: FastGen reads AWQ and GPTQ int4 "
            "checkpoints and GGUF files; serve another format's unquantized checkpoint"
        )
    bits = quant.get("bits", quant.get("w_bit"))
    if bits != 4:
        raise ValueError(f"the {method.upper()} checkpoint has {bits}-bit weights: FastGen reads 4-bit ones only")
    group_size = int(quant.get("group_size", quant.get("q_group_size", 128)))
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"the AWQ checkpoint is AutoAWQ's {version!r} version: FastGen reads the GEMM layout")
        if not quant.get("zero_point", True):
            raise ValueError("the AWQ checkpoint has no zero points: FastGen reads AWQ with zero_point true")
        return Int4Format("awq", group_size)
    checkpoint = str(quant.get("checkpoint_format", "gptq")).lower()
    if checkpoint not in ("gptq", "gptq_v2"):
        raise ValueError(f"the GPTQ checkpoint is in format {checkpoint!r}: FastGen reads gptq and gptq_v2")
    return Int4Format("gptq", group_size, zeros_minus_one=checkpoint == "gptq")


def check_int4_method(quantization: str, fmt: Int4Format | None, model: str) -> None:
    """`--quantization awq|gptq` (vLLM's names) asks for a checkpoint in that format: refused for any other."""
    if quantization in METHODS and (fmt is None or fmt.method != quantization):
        found = f"a {fmt.method.upper()} checkpoint" if fmt is not None else "not an AWQ or GPTQ checkpoint"
        raise ValueError(
            f"--quantization {quantization}, but {model} is {found}: pass --quantization auto to serve a checkpoint "
            "in the format it ships in"
        )


def iter_int4(
    tensors: Iterable[tuple[str, torch.Tensor]], fmt: Int4Format, dequantize: bool = False
) -> Iterator[tuple[str, torch.Tensor | Int4Tensor]]:
    """The checkpoint's tensors with each quantized layer's parts joined into `<module>.weight`: an Int4Tensor, or
    its float32 values where `dequantize` (quantization none, int8, fp8)."""
    parts = (*PARTS, "g_idx") if fmt.method == "gptq" else PARTS
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, leaf = name.rpartition(".")
        if leaf not in parts:
            yield name, tensor
            continue
        got = pending.setdefault(module, {})
        got[leaf] = tensor
        if all(p in got for p in PARTS):
            del pending[module]
            weight = _read_layer(module, got, fmt)
            yield f"{module}.weight", weight.dequantize() if dequantize and isinstance(weight, Int4Tensor) else weight
    if pending:
        module, got = next(iter(pending.items()))
        missing = ", ".join(p for p in PARTS if p not in got)
        raise ValueError(f"checkpoint is incomplete: {module} has no {missing}")


def _read_layer(module: str, t: dict[str, torch.Tensor], fmt: Int4Format) -> Int4Tensor:
    for leaf, tensor in t.items():
        if tensor.dim() != (1 if leaf == "g_idx" else 2):
            raise ValueError(f"{module}.{leaf} has shape {tuple(tensor.shape)}: not an {fmt.method.upper()} layer's")
        if leaf in ("qweight", "qzeros") and tensor.dtype != torch.int32:
            raise ValueError(f"{module}.{leaf} is {tensor.dtype}: AWQ and GPTQ pack int4 values in int32")
    scales = t["scales"]
    if fmt.method == "awq":
        fan_in = t["qweight"].shape[0]
        q = _awq_columns(t["qweight"])  # (in, out)
        zeros = _awq_columns(t["qzeros"])  # (groups, out)
    else:
        fan_in = t["qweight"].shape[0] * NIBBLES
        q = None  # GPTQ's words already run along the input: transposed, they are Int4Tensor's
        zeros = unpack_nibbles(t["qzeros"])
        if fmt.zeros_minus_one:
            zeros = (zeros + 1) & 0xF
    g = fan_in if fmt.group_size == -1 else fmt.group_size
    groups = -(-fan_in // g)
    fan_out = scales.shape[1]
    if scales.shape[0] != groups or zeros.shape != (groups, fan_out) or fan_in % g:
        raise ValueError(
            f"{module}: scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} do not fit {fan_in} input "
            f"features in groups of {g}: is the config's group_size the checkpoint's?"
        )
    perm = None
    if "g_idx" in t and not torch.equal(t["g_idx"].long(), torch.arange(fan_in) // g):
        # act-order: input rows in another order than their groups'; sorted by group, each group whole
        perm = torch.argsort(t["g_idx"].long(), stable=True)
        if not torch.equal(t["g_idx"].long()[perm], torch.arange(fan_in) // g):
            raise ValueError(f"{module}.g_idx does not give each group {g} input rows: is group_size the checkpoint's?")
        q = unpack_nibbles(t["qweight"].t()).t()[perm]  # (in, out), sorted by group
    qweight = pack_nibbles(q.t()) if q is not None else t["qweight"].t().contiguous()
    if scales.dtype != torch.float16 and torch.equal(scales.half().to(scales.dtype), scales):
        scales = scales.half()  # float16 where exact: the form GGUF's blocks take
    return Int4Tensor(qweight, scales.t().contiguous(), zeros.t().to(torch.uint8).contiguous(), g, perm)


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 (n, out / 8) -> int32 (n, out) of values 0..15 in column order."""
    nibbles = unpack_nibbles(words).unflatten(-1, (-1, NIBBLES))  # (n, out / 8, 8) in AWQ's order
    return nibbles[..., _AWQ_UNDO].flatten(-2)
