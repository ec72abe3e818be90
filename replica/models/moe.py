"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a float32 router picks each token's top-k experts,
the experts' SiLU-gated MLPs run grouped by expert in one kernels.fused_moe call, and a sigmoid-gated shared expert
joins where the family has one.

Two ways to share the experts over a tensor-parallel group, both ending in one all-reduce per layer:
- tensor parallel (default, as vLLM): every rank holds every expert's slice of the intermediate dimension;
- expert parallel (`--enable-expert-parallel`): each rank holds whole experts, experts / ranks of them. Attention's
  tensor parallelism leaves every rank with every token, so a rank computes its own experts' share of each token
  and the all-reduce sums the shares; an all-to-all would move the tokens a rank already has (vLLM does the same
  without data-parallel attention)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...kernels import Kernels
from ...kernels.int4 import QUANTIZED
from ...kernels.moe import Routing, route
from ...kernels.quant import QuantizedTensor
from ..parallel import ColumnParallelLinear, GateUpParallelLinear, RowParallelLinear, TPGroup, _divide

# A checkpoint's per-expert tensor: <layer>.mlp.experts.<e>.<gate|up|down>_proj.weight (Mixtral's w1/w3/w2 renamed)
EXPERT_TENSOR = re.compile(r"^(?P<module>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    experts_per_token: int  # k
    intermediate_size: int  # each expert's
    renormalize: bool  # the k weights rescaled to sum to one (Mixtral; Qwen's norm_topk_prob)
    sparse_layers: tuple[bool, ...]  # per layer: an MoE MLP (True) or the dense one (Qwen's mlp_only_layers)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert; 0: none

    def active_fraction(self) -> float:
        """The share of the experts' weights one token reads: what a decode step's cost scales with."""
        return self.experts_per_token / self.num_experts


class FusedExperts(nn.Module):
    """This rank's experts: w13 (local experts, 2 local intermediate, hidden) (gate rows, then up rows) and w2 (local
    experts, hidden, local intermediate). Tensor parallel: every expert, a slice of each one's intermediate rows;
    expert parallel: experts [first, first + local) whole."""

    def __init__(self, moe: MoEConfig, hidden: int, tp: TPGroup, expert_parallel: bool, kernels: Kernels) -> None:
        super().__init__()
        by_expert = expert_parallel and tp.size > 1
        self.local_experts = _divide(moe.num_experts, tp.size, "experts") if by_expert else moe.num_experts
        self.first = tp.rank * self.local_experts if by_expert else 0
        self.intermediate = (
            moe.intermediate_size if by_expert else _divide(moe.intermediate_size, tp.size, "expert intermediate size")
        )
        self.row0 = 0 if by_expert else tp.rank * self.intermediate  # this rank's first intermediate row
        self.num_experts = moe.num_experts
        self.w13 = nn.Parameter(torch.empty(self.local_experts, 2 * self.intermediate, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.local_experts, hidden, self.intermediate), requires_grad=False)
        self.local_parts = list(range(3 * self.local_experts))  # (expert, gate | up | down): what a load must fill
        self.packed = None
        self.kernels = kernels
        # the ranks holding slices of each down row (tensor parallel), whose scales quantize() takes whole
        self.down_row_ranks = TPGroup() if by_expert else tp
        self.quantized: tuple[list, list] | None = None  # per expert, gate/up and down rows quantized at load
        # a GGUF's blocks as shipped, by part (3 e + 0 | 1 | 2: gate, up, down rows of this rank), until pack()
        self.shipped: dict[int, QuantizedTensor] = {}
        # why the file's expert blocks were dequantized instead (a tensor-parallel slice between blocks), for the log
        self.dequantized_why: str | None = None

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor | QuantizedTensor) -> list[int]:
        """One expert's gate_proj/up_proj (intermediate, hidden) or down_proj (hidden, intermediate) from a
        checkpoint; returns the parts it filled (none: another rank's expert). A GGUF's blocks are kept as shipped
        where the backend runs quantized experts and this rank's slice falls between blocks (pack() takes them);
        anything else is served in float."""
        e = expert - self.first
        if not 0 <= e < self.local_experts:
            return []
        n, r = self.intermediate, self.row0
        part = 3 * e + {"gate_proj": 0, "up_proj": 1, "down_proj": 2}[proj]
        if (
            isinstance(tensor, QuantizedTensor)
            and self.kernels.pack_quantized_experts is not None
            and (proj != "down_proj" or tensor.splits_at(r, r + n))
        ):
            self.shipped[part] = tensor.narrow(1, r, n) if proj == "down_proj" else tensor.narrow(0, r, n)
            return [part]
        if isinstance(tensor, QuantizedTensor) and self.kernels.pack_quantized_experts is not None:
            self.dequantized_why = (
                f"this rank's {n} columns of the experts' down projection from column {r} do not fall between its "
                f"{tensor.name} blocks"
            )
        if isinstance(tensor, QUANTIZED):
            tensor = tensor.dequantize()
        assert isinstance(tensor, torch.Tensor)
        self.load_float(part, tensor if proj == "down_proj" else tensor[r : r + n], proj == "down_proj")
        return [part]

    def load_float(self, part: int, tensor: torch.Tensor, down: bool) -> None:
        """This rank's rows of a part: gate or up (n, hidden), or down (hidden, its n columns of the full tensor)."""
        assert self.w13 is not None and self.w2 is not None, "loaded before packing, which may drop them"
        e, n, r = part // 3, self.intermediate, self.row0
        if down:
            self.w2.data[e].copy_(tensor[:, r : r + n] if tensor.shape[1] != n else tensor)
        else:
            half = part % 3
            self.w13.data[e, half * n : (half + 1) * n].copy_(tensor)

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> list[int]:
        """transformers 5's fused form: gate_up_proj (experts, 2 intermediate, hidden), down_proj (experts, hidden,
        intermediate)."""
        filled = []
        for expert in range(self.first, self.first + self.local_experts):
            if name == "gate_up_proj":
                gate, up = tensor[expert].chunk(2)
                filled += self.load_expert(expert, "gate_proj", gate) + self.load_expert(expert, "up_proj", up)
            elif name == "down_proj":
                filled += self.load_expert(expert, "down_proj", tensor[expert])
            else:
                raise ValueError(f"unexpected experts tensor {name!r} in the checkpoint")
        return filled

    def quantize(self, per_channel: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
        """`--quantization int8`, before packing: each expert's gate/up and down rows with one scale per output channel
        (a down row split over tensor-parallel ranks takes its whole row's max |w|, as RowParallelLinear does), kept
        for pack(). A backend without quantized experts, or shapes the format cannot hold, leave them in --dtype."""
        if self.w13 is None or self.w2 is None or self.kernels.pack_quantized_experts is None:
            return
        w13, w2 = self.w13.detach(), self.w2.detach()
        absmax13 = w13.abs().amax(dim=2).float()  # (experts, 2 intermediate)
        absmax2 = self.down_row_ranks.all_reduce(w2.abs().amax(dim=2).float(), dist.ReduceOp.MAX)  # (experts, hidden)
        gate_up = [per_channel(w, m) for w, m in zip(w13, absmax13)]
        down = [per_channel(w, m) for w, m in zip(w2, absmax2)]
        if all(q is not None for q in gate_up + down):
            self.quantized = ([[(0, q)] for q in gate_up], [[(0, q)] for q in down])

    def pack(self) -> None:
        assert self.w13 is not None and self.w2 is not None, "packed once, while the plain weights are there"
        if self.shipped:
            self.pack_shipped()
            if self.packed is not None:
                return
        if self.quantized is not None and self.kernels.pack_quantized_experts is not None:
            self.packed = self.kernels.pack_quantized_experts(*self.quantized)
            self.quantized = None
            if self.packed is not None:  # else no kernel here reads them: the float experts serve
                self.w13 = self.w2 = None
                return
        self.packed = self.kernels.pack_experts(self.w13, self.w2)
        if self.packed is not None and self.packed.holds_weight:
            self.w13 = self.w2 = None  # two copies of every expert would double the model's memory

    def pack_shipped(self) -> None:
        """A GGUF's experts in their blocks (every part of every local expert kept: the float parameters were never
        written, so their pages were never touched), else the kept parts dequantized into the float ones."""
        shipped, self.shipped = self.shipped, {}
        assert self.kernels.pack_quantized_experts is not None, "parts are kept only for a backend that packs them"
        n = self.intermediate
        if len(shipped) == len(self.local_parts):
            gate_up = [[(0, shipped[3 * e]), (n, shipped[3 * e + 1])] for e in range(self.local_experts)]
            down = [[(0, shipped[3 * e + 2])] for e in range(self.local_experts)]
            self.packed = self.kernels.pack_quantized_experts(gate_up, down)
            if self.packed is not None:
                self.w13 = self.w2 = None
                return
        for part, tensor in shipped.items():  # some parts in float, or blocks this CPU has no kernel for
            self.load_float(part, tensor.dequantize(), part % 3 == 2)

    def local_routing(self, routing: Routing) -> Routing:
        """Expert parallel: ids of this rank's experts made local; another rank's become local_experts (a slot the
        kernels skip, adding nothing)."""
        if self.local_experts == self.num_experts:
            return routing
        local = routing.ids - self.first
        mine = (local >= 0) & (local < self.local_experts)
        return Routing(routing.weights, torch.where(mine, local, self.local_experts))

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        # (tokens, hidden): this rank's share, summed over the group by the layer's all-reduce
        return self.kernels.fused_moe(x, self.w13, self.w2, self.packed, self.local_routing(routing))


class Router(nn.Module):
    """The router's weight (experts, hidden), whole on every rank and kept in float32: routing decisions are
    discrete, so the logits are computed at full precision whatever the activations' dtype."""

    def __init__(self, experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden, dtype=torch.float32), requires_grad=False)

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        self.weight.data.copy_(tensor.dequantize() if isinstance(tensor, QUANTIZED) else tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)  # (tokens, experts) float32


class SparseMoeBlock(nn.Module):
    def __init__(self, moe: MoEConfig, hidden: int, tp: TPGroup, expert_parallel: bool, kernels: Kernels) -> None:
        super().__init__()
        self.gate = Router(moe.num_experts, hidden)
        self.experts = FusedExperts(moe, hidden, tp, expert_parallel, kernels)
        if moe.shared_expert_intermediate_size:  # split like a dense MLP in either mode
            self.shared_expert = SharedExpert(hidden, moe.shared_expert_intermediate_size, tp, kernels)
            self.shared_expert_gate = ColumnParallelLinear(hidden, [1], False, TPGroup(), kernels)
        self.k, self.renormalize = moe.experts_per_token, moe.renormalize
        self.has_shared = bool(moe.shared_expert_intermediate_size)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = route(self.gate(x), self.k, self.renormalize)  # (tokens, k) each
        y = self.experts(x, routing)  # (tokens, hidden), this rank's partial sum
        if self.has_shared:  # sigmoid(g) is per token, so it scales the partial sums before the all-reduce
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(y)


class SharedExpert(nn.Module):
    """A gated MLP whose down projection's partial sums are left for the MoE block's single all-reduce."""

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup, kernels: Kernels) -> None:
        super().__init__()
        self.gate_up_proj = GateUpParallelLinear(hidden, intermediate, tp, kernels)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, tp, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.project(self.gate_up_proj(x), None)  # (tokens, hidden): partial sums, not reduced
