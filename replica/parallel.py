"""Tensor-parallel layers. Each rank holds a slice of every weight; with one rank they are plain layers.

Column-parallel layers split output features (no communication); row-parallel layers split input features and
all-reduce their partial sums. The embedding splits the vocabulary; the LM head gathers the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu import PackedLinear, linear_amx, pack_linear


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its replica's tensor-parallel group (torch.distributed's default group)."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's x along the last dimension."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def agree_min(self, n: int, device: torch.device) -> int:
        """The smallest n over all ranks: what every rank can hold (e.g. KV blocks, sized from each rank's memory)."""
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


@dataclass(frozen=True)
class PackedWeight:
    """A CPU bfloat16 weight packed once at load, for exactly one kernel: the AMX linear kernel
    (kernels/csrc/linear.c) where it runs, else oneDNN."""

    amx: PackedLinear | None = None
    onednn: torch.Tensor | None = None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
) -> torch.Tensor:
    """x W^T + b, through the packed weight when there is one."""
    if packed is not None and packed.amx is not None:
        y = linear_amx(x, packed.amx, bias)
        if y is not None:
            return y
    elif packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """The weight packed once for a CPU bfloat16 kernel, or None where packing does not apply (float32 keeps the plain
    path, bit-exact with transformers).

    F.linear reorders a bf16 weight into oneDNN's blocked layout on every call. Packed once, oneDNN runs about 1.5x
    faster; the AMX kernel, where it runs, streams the weight 1.3x faster than oneDNN at decode sizes (1-8 rows)
    and, on two threads, keeps level with it or ahead up to 512 rows; on one thread it is ~10% behind from 128 rows
    up (python -m fastgen.benchmarks.cpu_kernels --threads N). Both split their work over the torch threads."""
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.bfloat16
        or not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ):
        return None
    amx = pack_linear(weight)
    if amx is not None:
        return PackedWeight(amx=amx)
    # 512 rows is the size hint oneDNN tunes the layout for: a full SplitFuse budget.
    return PackedWeight(onednn=torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 512))


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {parts}: choose another --tp")
    return n // parts


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with the output features of each part (e.g. gate and up) split across ranks.

    `parts` lists the full output sizes fused into this one matrix; part i of a loaded checkpoint goes to
    rows offsets[i]:offsets[i+1] of this rank's weight."""

    def __init__(self, in_features: int, parts: list[int], bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.local_parts = [_divide(p, tp.size, "output features") for p in parts]
        out = sum(self.local_parts)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        self.packed = None

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        size = self.local_parts[part]
        start = sum(self.local_parts[:part])
        shard = tensor.narrow(0, self.tp.rank * size, size)
        getattr(self, name).data[start : start + size].copy_(shard)

    def pack(self) -> None:
        self.packed = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class QKVParallelLinear(nn.Module):
    """Fused q, k, v projection split by heads. With fewer KV heads than ranks, KV heads are replicated:
    rank r keeps KV head r * kv_heads // tp, the one its query heads attend to."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        if kv_heads >= tp.size:
            _divide(kv_heads, tp.size, "KV heads")
        elif tp.size % kv_heads:
            raise ValueError(f"tensor-parallel size {tp.size} is not a multiple of the {kv_heads} KV heads")
        self.tp = tp
        self.heads = _divide(heads, tp.size, "attention heads")
        self.kv_heads = max(1, kv_heads // tp.size)
        self.head_dim = head_dim
        self.kv_head_start = tp.rank * kv_heads // tp.size
        self.local_parts = [self.heads * head_dim, self.kv_heads * head_dim, self.kv_heads * head_dim]
        out = sum(self.local_parts)
        self.weight = nn.Parameter(torch.empty(out, hidden), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        self.packed = None

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        size = self.local_parts[part]
        first = self.tp.rank * size if part == 0 else self.kv_head_start * self.head_dim
        start = sum(self.local_parts[:part])
        getattr(self, name).data[start : start + size].copy_(tensor.narrow(0, first, size))

    def pack(self) -> None:
        self.packed = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class RowParallelLinear(nn.Module):
    """y = x W^T (+ b) with input features split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.local_in = _divide(in_features, tp.size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed = None

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        if name == "bias":
            self.bias.data.copy_(tensor)
        else:
            self.weight.data.copy_(tensor.narrow(1, self.tp.rank * self.local_in, self.local_in))

    def pack(self) -> None:
        self.packed = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(linear(x, self.weight, None, self.packed))
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

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        rows = min(self.local_vocab, self.vocab_size - self.vocab_start)
        self.weight.data[:rows].copy_(tensor.narrow(0, self.vocab_start, rows))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(x)


class ParallelLMHead(nn.Module):
    """Logits over the vocabulary split across ranks, gathered so every rank sees the full row. With tied
    embeddings it reads the embedding's own shard."""

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = embedding.vocab_size
        self.vocab_start = embedding.vocab_start
        self.local_vocab = embedding.local_vocab
        self.weight = (
            embedding.weight if tied else nn.Parameter(torch.zeros_like(embedding.weight), requires_grad=False)
        )
        self.packed = None

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        rows = min(self.local_vocab, self.vocab_size - self.vocab_start)
        self.weight.data[:rows].copy_(tensor.narrow(0, self.vocab_start, rows))

    def pack(self) -> None:
        self.packed = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last(linear(x, self.weight, None, self.packed))  # (rows, local_vocab * tp)
        return logits[:, : self.vocab_size]
