"""Tensor-parallel layers. Each rank holds a slice of every weight; with one rank they are plain layers.

Column-parallel layers split output features (no communication); row-parallel layers split input features and
all-reduce their partial sums. The embedding splits the vocabulary; the LM head gathers the logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..kernels import TORCH_KERNELS, Kernels
from ..kernels.fp8 import Fp8Tensor
from ..kernels.int4 import QUANTIZED, Int4Tensor
from ..kernels.quant import QuantizedTensor

if TYPE_CHECKING:
    from .lora import LoraLayer

# The single-tensor all-gather: torch 2.13 names it all_gather_single and deprecates all_gather_into_tensor, which the
# older torch of a GPU machine may still be the only name for.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its replica's tensor-parallel group (torch.distributed's default group)."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, op=op)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's x (rows, cols) along the last dimension. One output tensor, not the list form:
        inside a CUDA graph the list form's separate outputs and the copy into them are not what NCCL's graph
        capture supports well, and one gather into one buffer is one collective either way."""
        if self.size == 1:
            return x
        rows, cols = x.shape
        out = x.new_empty(self.size * rows, cols)  # rank r's x in rows r * rows ...
        _all_gather_single(out, x.contiguous())
        return out.view(self.size, rows, cols).movedim(0, 1).reshape(rows, self.size * cols)

    def agree_min(self, n: int, group: dist.ProcessGroup | None = None) -> int:
        """The smallest n over all ranks: what every rank can hold (e.g. KV blocks, sized from each rank's memory).
        Over `group` on the CPU, a gloo group (the batch broadcast's) where the model's collectives run on NCCL: a
        rank that failed to build ends its process, which a gloo peer sees at once as closed sockets, where NCCL's
        all-reduce waits out its whole timeout (--tp-timeout). No shorter deadline: ranks finish loading their
        shards minutes apart, and that is not a failure."""
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return int(t.item())


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {parts}: choose another --tp")
    return n // parts


def _frozen(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ParallelLinear(nn.Module):
    """What every linear layer holds, whatever its split: this rank's weight shard (out, in), its bias or None, the
    weight packed once at load for the kernels (`pack`; where the packed form holds the whole weight, the plain one is
    dropped and `weight` is None), and the kernels' matrix multiply (`project`).

    A checkpoint's weight may come quantized (a GGUF block type, kernels/quant.py's QuantizedTensor; AWQ/GPTQ int4,
    kernels/int4.py's Int4Tensor): its rows are kept as they are (`quantized`: first output row -> rows) and packed
    for the kernels' quantized linear, or, where the kernels have none for it, dequantized into the plain weight at
    pack time.

    With --enable-lora the projections adapters may adapt hold their LoRA slots (`lora`, replica/lora.py), which add
    each adapted row's delta to the output."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, kernels: Kernels) -> None:
        super().__init__()
        self.weight = weight
        self.out_features, self.in_features = weight.shape  # this rank's shard; kept when the weight is dropped
        self.bias = bias
        self.kernels = kernels
        self.packed = None
        self.quantized: list[tuple[int, QuantizedTensor | Int4Tensor | Fp8Tensor]] = []
        self.lora: LoraLayer | None = None  # where LoRA adapters may adapt this layer

    def put(self, name: str, start: int, rows: torch.Tensor | QuantizedTensor | Int4Tensor | Fp8Tensor) -> None:
        """Rows [start, start + len) of parameter `name` from a checkpoint's (already sharded) tensor."""
        if isinstance(rows, QUANTIZED):
            self.quantized.append((start, rows))
        else:
            getattr(self, name).data[start : start + rows.shape[0]].copy_(rows)

    def pack(self) -> None:
        weight = self.weight
        assert weight is not None, "packed once, while the plain weight is there"
        if self.quantized:
            self.packed = self.kernels.pack_quantized(self.quantized, self.out_features)
            if self.packed is not None:
                self.quantized, self.weight = [], None  # the packed blocks are the weight
                return
            for start, rows in self.quantized:  # no kernel for this format here: serve it dequantized
                weight.data[start : start + rows.shape[0]].copy_(rows.dequantize())
            self.quantized = []
        self.packed = self.packed_form(weight)
        if self.packed is not None and self.packed.holds_weight:
            self.weight = None  # two copies of every weight would double the model's memory

    def quantize(self, per_channel: Callable[[torch.Tensor, torch.Tensor], QuantizedTensor | Fp8Tensor | None]) -> None:
        """`--quantization int8|fp8`, before packing: the float weight becomes rows with one scale per output channel
        (`per_channel(weight, each whole row's max |w|)`: kernels/quant.py's quantize_per_channel, kernels/fp8.py's
        quantize_fp8), which pack() then packs like a checkpoint's."""
        if self.weight is not None and not self.quantized:
            rows = per_channel(self.weight, self.row_absmax())
            if rows is not None:
                self.quantized = [(0, rows)]

    def row_absmax(self) -> torch.Tensor:
        """max |w| of each output row: this rank's rows are whole."""
        assert self.weight is not None, "asked before packing (quantize), when the plain weight is there"
        return self.weight.detach().abs().amax(dim=1).float()

    def packed_form(self, weight: torch.Tensor):
        """The weight in the form this layer's kernel reads (None: the plain weight serves)."""
        return self.kernels.pack_linear(weight)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias) on this rank's shard, plus the LoRA delta of the rows that run under an adapter."""
        y = self.kernels.linear(x, self.weight, bias, self.packed)
        return y if self.lora is None else self.lora.add_delta(x, y)


class ColumnParallelLinear(ParallelLinear):
    """y = x W^T + b with the output features of each part (e.g. gate and up) split across ranks; no communication.

    `parts` lists the full output sizes fused into this one matrix; part i of a loaded checkpoint goes to
    rows offsets[i]:offsets[i+1] of this rank's weight."""

    def __init__(
        self, in_features: int, parts: list[int], bias: bool, tp: TPGroup, kernels: Kernels = TORCH_KERNELS
    ) -> None:
        self.parts = parts
        self.local_parts = [_divide(p, tp.size, "output features") for p in parts]
        out = sum(self.local_parts)
        super().__init__(_frozen(out, in_features), _frozen(out) if bias else None, kernels)
        self.tp = tp

    def shard_rows(self, tensor: torch.Tensor, part: int) -> torch.Tensor:
        """This rank's rows of a whole part (a weight, a bias, a LoRA B)."""
        size = self.local_parts[part]
        return tensor.narrow(0, self.tp.rank * size, size)

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        self.put(name, sum(self.local_parts[:part]), self.shard_rows(tensor, part))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)


class GateUpParallelLinear(ColumnParallelLinear):
    """The MLP's gate and up projections as one column-parallel layer that returns act(gate) * up: each rank holds
    its shard of both (gate rows, then up rows) and computes its own slice of the intermediate activation, so the
    product of both never needs to be kept. For SiLU the kernels may pack the two side by side and fuse the
    activation; GeGLU ("gelu_tanh") is the plain product, then the kernels' gelu_tanh_mul."""

    def __init__(
        self, hidden: int, intermediate: int, tp: TPGroup, kernels: Kernels = TORCH_KERNELS, activation: str = "silu"
    ) -> None:
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported MLP activation {activation!r}: FastGen supports silu and gelu_tanh")
        super().__init__(hidden, [intermediate, intermediate], False, tp, kernels)
        self.activation = activation

    def packed_form(self, weight: torch.Tensor):
        if self.activation == "silu" and self.lora is None:  # LoRA's delta goes in before the activation
            return self.kernels.pack_gate_up(weight)
        return self.kernels.pack_linear(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None:  # gate and up with their deltas, then the activation
            mul = self.kernels.silu_mul if self.activation == "silu" else self.kernels.gelu_tanh_mul
            return mul(self.project(x, None))
        if self.activation == "silu":
            return self.kernels.linear_silu_mul(x, self.weight, self.packed)  # (tokens, intermediate / tp)
        return self.kernels.gelu_tanh_mul(self.project(x, None))


class QKVParallelLinear(ParallelLinear):
    """Fused q, k, v projection split by heads; no communication. With fewer KV heads than ranks, KV heads are
    replicated: rank r keeps KV head r * kv_heads // tp, the one its query heads attend to."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        bias: bool,
        tp: TPGroup,
        kernels: Kernels = TORCH_KERNELS,
    ) -> None:
        if kv_heads >= tp.size:
            _divide(kv_heads, tp.size, "KV heads")
        elif tp.size % kv_heads:
            raise ValueError(f"tensor-parallel size {tp.size} is not a multiple of the {kv_heads} KV heads")
        self.heads = _divide(heads, tp.size, "attention heads")
        self.kv_heads = max(1, kv_heads // tp.size)
        self.head_dim = head_dim
        self.kv_head_start = tp.rank * kv_heads // tp.size
        self.parts = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]  # of a fused checkpoint tensor
        self.local_parts = [self.heads * head_dim, self.kv_heads * head_dim, self.kv_heads * head_dim]
        out = sum(self.local_parts)
        super().__init__(_frozen(out, hidden), _frozen(out) if bias else None, kernels)
        self.tp = tp

    def shard_rows(self, tensor: torch.Tensor, part: int) -> torch.Tensor:
        size = self.local_parts[part]
        first = self.tp.rank * size if part == 0 else self.kv_head_start * self.head_dim
        return tensor.narrow(0, first, size)

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        self.put(name, sum(self.local_parts[:part]), self.shard_rows(tensor, part))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)


class RowParallelLinear(ParallelLinear):
    """y = x W^T (+ b) with input features split across ranks; partial sums are all-reduced."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TPGroup, kernels: Kernels = TORCH_KERNELS
    ) -> None:
        self.local_in = _divide(in_features, tp.size, "input features")
        super().__init__(_frozen(out_features, self.local_in), _frozen(out_features) if bias else None, kernels)
        self.tp = tp

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        if name == "bias":
            assert self.bias is not None, f"a checkpoint bias is loaded only into a layer made with one ({name})"
            self.bias.data.copy_(tensor)  # whole on every rank, added once after the all-reduce
        elif self.tp.size == 1:
            self.put(name, 0, tensor)  # whole: even a layer whose columns split nowhere (act-order int4)
        else:
            if isinstance(tensor, QUANTIZED) and not tensor.splits_at(self.tp.rank * self.local_in, self.local_in):
                tensor = tensor.dequantize()  # a shard boundary inside a block or group
            self.put(name, 0, tensor.narrow(1, self.tp.rank * self.local_in, self.local_in))

    def row_absmax(self) -> torch.Tensor:
        """max |w| of each whole row, over every rank's columns: the scale a TP 1 replica would pick."""
        return self.tp.all_reduce(super().row_absmax(), dist.ReduceOp.MAX)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.project(x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks; each rank embeds the ids it owns and the results are summed."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.local_vocab = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.local_vocab
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.zeros(self.local_vocab, hidden), requires_grad=False)
        self.dtype = self.weight.dtype
        # A quantized checkpoint's rows (all local_vocab of them), kept as they are: a lookup dequantizes its own rows.
        self.quantized: QuantizedTensor | None = None

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        rows = min(self.local_vocab, self.vocab_size - self.vocab_start)
        shard = tensor.narrow(0, self.vocab_start, rows)
        if isinstance(shard, QuantizedTensor) and rows == self.local_vocab:
            self.quantized, self.weight = shard, None
        else:
            assert self.weight is not None, "loaded once: the plain weight is still there"
            self.weight.data[:rows].copy_(shard.dequantize() if isinstance(shard, QuantizedTensor) else shard)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            assert self.weight is not None, "the plain weight is dropped only for quantized rows"
            return F.embedding(ids, self.weight)
        return self.quantized.index_rows(ids.flatten().to(torch.int64)).dequantize().to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        x = self.lookup(local.masked_fill(outside, 0))
        x = x.masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(x)


class ParallelLMHead(ParallelLinear):
    """Logits over the vocabulary split across ranks, gathered so every rank sees the full row. With tied
    embeddings it reads the embedding's own shard. A bias (Phi-2) is split by vocabulary as the rows are."""

    def __init__(
        self,
        embedding: VocabParallelEmbedding,
        tied: bool,
        tp: TPGroup,
        kernels: Kernels = TORCH_KERNELS,
        bias: bool = False,
    ) -> None:
        shared = embedding.weight
        assert shared is not None, "made before loading, while the embedding has its plain weight"
        weight = shared if tied else nn.Parameter(torch.zeros_like(shared), requires_grad=False)
        super().__init__(weight, _frozen(embedding.local_vocab) if bias else None, kernels)
        self.embedding = embedding if tied else None
        self.tp = tp
        self.vocab_size = embedding.vocab_size
        self.vocab_start = embedding.vocab_start
        self.local_vocab = embedding.local_vocab

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        rows = min(self.local_vocab, self.vocab_size - self.vocab_start)
        self.put(name, 0, tensor.narrow(0, self.vocab_start, rows))

    def pack(self) -> None:
        """Tied to a quantized embedding: the same blocks serve the logits (or, where the kernels cannot read them,
        the embedding's dequantized weight, which the embedding then uses too)."""
        embedding = self.embedding
        if embedding is not None and embedding.quantized is not None:
            self.packed = self.kernels.pack_quantized([(0, embedding.quantized)], self.out_features)
            if self.packed is not None:
                self.weight = None
                return
            weight = self.weight
            assert weight is not None, "packed once, while the plain weight is there"
            embedding.weight = weight
            weight.data.copy_(embedding.quantized.dequantize())
            embedding.quantized = None
        super().pack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last(self.project(x, self.bias))  # (rows, local_vocab * tp)
        return logits[:, : self.vocab_size]
