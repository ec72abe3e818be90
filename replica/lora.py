"""LoRA adapters on the model's linear layers: PEFT's format read and checked, and each adapted layer's weight slots.

An adapter is a folder as PEFT saves it: adapter_config.json (r, lora_alpha, use_rslora, target_modules, ...) and
adapter_model.safetensors with, per adapted module, `<module>.lora_A.weight` (r, in) and `<module>.lora_B.weight`
(out, r). Any of the attention's q/k/v/o and the gated MLP's gate/up/down projections may be adapted, each with its
own rank (PEFT's rank_pattern: the rank is read from the tensors).

Every adaptable layer gets `max_loras` slots of A (max_rank, in) and B (out, max_rank) per sub-projection (q, k, v
of the fused qkv layer; gate, up of gate_up): a packed layer adds each sub-projection's delta to its own slice of
the output. The adapter's scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B at load. Tensor
parallelism splits them as the base weights are split: a column-parallel layer keeps its rows of B (A whole), a
row-parallel layer its columns of A (B whole), so that its partial delta joins the partial sums the layer
all-reduces anyway.

The layers read the step's rows by adapter (`LoraStep.segments`) from the LoraStep the model runner fills before
every forward pass: the model's forward signatures stay those of the base model."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..kernels.lora import LoraSegments
from .models.decoder import FUSED, DecoderModel
from .parallel import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

# The layers LoRA adapts (the TARGETS projections): split by output rows (column, q/k/v) or by input columns (row).
AdaptedLinear = ColumnParallelLinear | QKVParallelLinear | RowParallelLinear

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# A checkpoint's projection name -> (our layer, its sub-projection): the fused layers hold several.
TARGETS = {**FUSED, "o_proj": ("o_proj", 0), "down_proj": ("down_proj", 0)}
# adapter_config.json settings that would change what the adapter computes and that FastGen does not apply.
_UNSUPPORTED = {
    "use_dora": "DoRA adapters",
    "alpha_pattern": "per-module lora_alpha (alpha_pattern)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "fan_in_fan_out": "fan_in_fan_out weights",
    "layer_replication": "layer_replication",
}


@dataclass
class Adapter:
    """One adapter read from its folder: per (our layer, sub-projection), A (r, in) and B (out, r) whole, with the
    scaling folded into B."""

    path: str
    rank: int  # the largest rank of its modules
    weights: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def read_adapter(path: str | Path, renames: tuple[tuple[str, str], ...] = ()) -> Adapter:
    """Reads and checks a PEFT LoRA folder; ValueError says what is wrong with it. `renames`: the model family's
    (checkpoint's, ours) module renames."""
    folder = Path(path)
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ValueError(f"LoRA adapter {str(folder)!r} needs {CONFIG_FILE} and {WEIGHTS_FILE} (PEFT's format)")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{folder / CONFIG_FILE} is not valid JSON: {exc}") from exc
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {str(folder)!r} is a {config['peft_type']} adapter: FastGen serves LoRA adapters")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"adapter {str(folder)!r} uses {what}, which FastGen does not serve")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter {str(folder)!r} trains biases (bias={config['bias']!r}): FastGen serves bias='none'")
    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    rslora = bool(config.get("use_rslora", False))
    tensors = load_file(str(folder / WEIGHTS_FILE))
    pairs: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module, kind = _split_name(name, folder)
        for theirs, ours in renames:
            module = module.replace(theirs, ours)
        prefix, _, leaf = module.rpartition(".")
        if leaf not in TARGETS or not prefix:
            raise ValueError(
                f"adapter {str(folder)!r} adapts {module!r}: FastGen adapts the {', '.join(TARGETS)} projections"
            )
        ours, part = TARGETS[leaf]
        pairs.setdefault((f"{prefix}.{ours}", part), {})[kind] = tensor
    if not pairs:
        raise ValueError(f"adapter {str(folder)!r} holds no LoRA weights")
    adapter = Adapter(str(folder), 0)
    for key, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter {str(folder)!r}: {key[0]} part {key[1]} lacks its lora_A or lora_B weight")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r or r < 1:
            raise ValueError(f"adapter {str(folder)!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} disagree")
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        adapter.weights[key] = (a.float(), b.float() * scaling)
        adapter.rank = max(adapter.rank, r)
    return adapter


def _split_name(name: str, folder: Path) -> tuple[str, str]:
    """'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' -> ('layers.0.self_attn.q_proj', 'A')."""
    for kind in ("A", "B"):
        for tail in (f".lora_{kind}.weight", f".lora_{kind}.default.weight"):
            if name.endswith(tail):
                module = name[: -len(tail)].removeprefix("base_model.model.").removeprefix("model.")
                return module, kind
    raise ValueError(f"adapter {str(folder)!r} holds {name!r}, which is not a LoRA A or B weight")


@dataclass
class LoraStep:
    """The step's rows by adapter, set by the model runner before each forward pass (None: no adapter runs)."""

    segments: LoraSegments | None = None


@dataclass
class LoraSlice:
    """One sub-projection's slots: its delta goes to columns [offset, offset + b.shape[1]) of the layer's output."""

    offset: int
    a: torch.Tensor  # (slots, max_rank, in on this rank)
    b: torch.Tensor  # (slots, out on this rank, max_rank)
    ranks: list[int]  # per slot: the adapter's rank here; 0 where it leaves this sub-projection alone


class LoraLayer:
    """The adapter slots of one linear layer, and the delta it adds to the layer's output."""

    def __init__(self, layer: AdaptedLinear, step: LoraStep, max_loras: int, max_rank: int) -> None:
        self.layer = layer
        self.step = step
        self.row_parallel = isinstance(layer, RowParallelLinear)
        local_parts = [layer.out_features] if isinstance(layer, RowParallelLinear) else layer.local_parts
        weight = layer.weight
        assert weight is not None, "attached before packing: the weight is there"
        self.slices = []
        offset = 0
        for size in local_parts:
            a = torch.zeros(max_loras, max_rank, layer.in_features, dtype=weight.dtype, device=weight.device)
            b = torch.zeros(max_loras, size, max_rank, dtype=weight.dtype, device=weight.device)
            self.slices.append(LoraSlice(offset, a, b, [0] * max_loras))
            offset += size

    def full_shapes(self, part: int) -> tuple[int, int]:
        """(in, out) of sub-projection `part` over all ranks: what an adapter's A and B must match."""
        layer = self.layer
        if isinstance(layer, RowParallelLinear):
            return layer.local_in * layer.tp.size, layer.out_features
        return layer.in_features, layer.parts[part]

    def load(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Writes this rank's share of an adapter's A (r, in) and scaled B (out, r) into `slot`."""
        layer, s, r = self.layer, self.slices[part], a.shape[0]
        if isinstance(layer, RowParallelLinear):
            a = a.narrow(1, layer.tp.rank * layer.local_in, layer.local_in)
        else:
            b = layer.shard_rows(b, part)
        s.a[slot, :r].copy_(a)
        s.b[slot, :, :r].copy_(b)
        s.ranks[slot] = r

    def clear(self, slot: int) -> None:
        for s in self.slices:
            s.a[slot].zero_()
            s.b[slot].zero_()
            s.ranks[slot] = 0

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (tokens, out on this rank) plus each adapted row's delta, in place; y itself where no adapter runs."""
        seg = self.step.segments
        if seg is None:
            return y
        whole = len(self.slices) == 1  # the delta covers y's columns: no view to make
        for s in self.slices:
            if any(s.ranks[slot] for slot, _, _ in seg.segments):
                out = y if whole else y.narrow(1, s.offset, s.b.shape[1])
                self.layer.kernels.lora_sgmv(out, x, s.a, s.b, seg, s.ranks)
        return y


class LoraWeights:
    """Every adaptable layer's slots in a model, and the loads into them."""

    def __init__(self, model: DecoderModel, max_loras: int, max_rank: int) -> None:
        if max_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {max_rank}")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.renames = model.config.renames
        self.step = LoraStep()
        self.layers: dict[str, LoraLayer] = {}
        for name, module in model.named_modules():
            leaf = name.rpartition(".")[2]
            if leaf in {ours for ours, _ in TARGETS.values()} and isinstance(module, AdaptedLinear):
                module.lora = self.layers[name] = LoraLayer(module, self.step, max_loras, max_rank)
        if not self.layers:
            raise ValueError(
                f"{model.config.architecture} has no layer LoRA can adapt here (its projections are not "
                f"{', '.join(TARGETS)}): start it without --enable-lora"
            )

    def check(self, adapter: Adapter) -> None:
        """ValueError where an adapter does not fit this model or the slots' rank."""
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"adapter {adapter.path!r} has rank {adapter.rank} but --max-lora-rank is {self.max_rank}: "
                "raise --max-lora-rank"
            )
        for (module, part), (a, b) in adapter.weights.items():
            layer = self.layers.get(module)
            if layer is None or part >= len(layer.slices):
                raise ValueError(f"adapter {adapter.path!r} adapts {module!r}, which this model does not have")
            fan_in, fan_out = layer.full_shapes(part)
            if a.shape[1] != fan_in or b.shape[0] != fan_out:
                raise ValueError(
                    f"adapter {adapter.path!r}: {module} part {part} has lora_A {tuple(a.shape)} and lora_B "
                    f"{tuple(b.shape)}, but the model's projection is ({fan_out}, {fan_in}): "
                    "was it trained for another base model?"
                )

    def read(self, path: str) -> Adapter:
        """The adapter at `path`, read and checked against this model."""
        adapter = read_adapter(path, self.renames)
        self.check(adapter)
        return adapter

    def load(self, slot: int, path: str) -> None:
        """Reads the adapter at `path` into `slot` of every layer (the modules it leaves alone get rank 0)."""
        adapter = self.read(path)
        for layer in self.layers.values():
            layer.clear(slot)
        for (module, part), (a, b) in adapter.weights.items():
            layer = self.layers[module]
            dtype = layer.slices[part].a.dtype
            layer.load(slot, part, a.to(dtype), b.to(dtype))
