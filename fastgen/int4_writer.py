"""AWQ and GPTQ checkpoints made from a float one, for tests and benchmarks (no quantizer library is installed, and
nothing may be downloaded): round-to-nearest int4 per group, packed bit for bit as AutoAWQ's GEMM packer and
AutoGPTQ's packer write them, beside a float folder holding exactly the values the int4 one stands for (what
transformers runs as the reference).

The packers here follow those libraries' loops (word by word, nibble i from column ORDER[i]); FastGen's reader
(replica/int4_checkpoint.py) unpacks by shifts and a gather, so the two are written independently of each other."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order_map: nibble i of a word holds column AWQ_ORDER[i]
# projection -> the input it reads (act-order's column order is that input's); the others read their own
SAME_INPUT = {
    "q_proj": "attention input",
    "k_proj": "attention input",
    "v_proj": "attention input",
    "o_proj": "attention output",
    "gate_proj": "mlp input",
    "up_proj": "mlp input",
    "down_proj": "mlp activation",
}


def _words(values: Any, order: tuple[int, ...] = tuple(range(8))) -> Any:
    """int values 0..15 (..., 8 n) -> int32 (..., n): nibble i of each word from element order[i] of its eight."""
    import torch

    v = values.to(torch.int64).unflatten(-1, (-1, 8))
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for i, column in enumerate(order):
        word |= v[..., column] << (4 * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def quantize_groups(w: Any, group: Any, groups: int, sym: bool) -> tuple[Any, Any, Any]:
    """Round-to-nearest int4 of w (out, in), input column c in group group[c]: (q (out, in), scales float16 (out,
    groups), zeros (out, groups)), with w ~ (q - zero) * scale. Asymmetric: the group's min..max over 0..15;
    symmetric: zero 8 and scale max|w| / 7."""
    import torch

    out = w.shape[0]
    scales = torch.empty(out, groups, dtype=torch.float16)
    zeros = torch.empty(out, groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, group == g].float()
        if sym:
            s = (cols.abs().amax(1) / 7).clamp(min=1e-5).half()
            z = torch.full((out,), 8)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = ((hi - lo) / 15).clamp(min=1e-5).half()
            z = (-lo / s.float()).round().clamp(0, 15).long()
        scales[:, g], zeros[:, g] = s, z
    q = (w.float() / scales.float()[:, group]).round().long() + zeros[:, group]
    return q.clamp(0, 15), scales, zeros


def write_int4_checkpoint(
    src: Path,
    dst: Path,
    reference: Path,
    method: str,
    group_size: int = 32,
    sym: bool = False,
    act_order: bool = False,
    checkpoint_format: str = "gptq",
    seed: int = 0,
) -> None:
    """Quantizes the decoder layers' linear weights of the float folder `src` into `dst` (AWQ or GPTQ, its
    quantization_config in config.json) and writes `reference`, the same model with those weights dequantized.
    act_order (GPTQ): groups hold input columns in a shuffled order, as desc_act checkpoints' do."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    packed, dense = {}, {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            dense[name] = t
            if not (".layers." in name and name.endswith("proj.weight") and t.dim() == 2):
                packed[name] = t
                continue
            fan_out, fan_in = t.shape
            # act-order sorts input columns by the Hessian of the layer's input: the same for q, k and v, and for gate
            # and up, which read the same input (each layer's own draw here, shared by those projections)
            shares = SAME_INPUT.get(name.split(".")[-2], name.split(".")[-2])
            layer = int(name.split(".layers.")[1].split(".")[0])
            draw = torch.Generator().manual_seed(zlib.crc32(f"{seed} {layer} {shares}".encode()))
            order = torch.randperm(fan_in, generator=draw) if act_order else torch.arange(fan_in)
            group = torch.empty(fan_in, dtype=torch.int64)
            group[order] = torch.arange(fan_in) // group_size  # column order[k] falls in group k // group_size
            q, scales, zeros = quantize_groups(t, group, fan_in // group_size, sym)
            dense[name] = ((q - zeros[:, group]).float() * scales.float()[:, group]).to(t.dtype)
            module = name.removesuffix(".weight")
            if method == "awq":
                packed[f"{module}.qweight"] = _words(q.t(), AWQ_ORDER)  # (in, out / 8)
                packed[f"{module}.qzeros"] = _words(zeros.t(), AWQ_ORDER)  # (groups, out / 8)
            else:
                stored = (zeros - 1) & 0xF if checkpoint_format == "gptq" else zeros
                packed[f"{module}.qweight"] = _words(q.t().unflatten(0, (-1, 8)).transpose(1, 2)).squeeze(
                    -1
                )  # (in / 8, out)
                packed[f"{module}.qzeros"] = _words(stored.t())  # (groups, out / 8)
                packed[f"{module}.g_idx"] = group.to(torch.int32)
            packed[f"{module}.scales"] = scales.t().contiguous()  # (groups, out)
    config = json.loads((src / "config.json").read_text())
    quantization = _quantization_config(method, group_size, sym, act_order, checkpoint_format)
    for folder, tensors, folder_config in (
        (dst, packed, {**config, "quantization_config": quantization}),
        (reference, dense, config),
    ):
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(folder_config, indent=1))
        for extra in src.iterdir():
            if extra.name not in ("config.json", "model.safetensors", "fastgen-sha256.json"):
                shutil.copy(extra, folder / extra.name)


def _quantization_config(method: str, group_size: int, sym: bool, act_order: bool, fmt: str) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "sym": sym,
        "desc_act": act_order,
        "checkpoint_format": fmt,
    }
