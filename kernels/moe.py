"""Mixture-of-experts references: the router's top-k and the experts' gated MLPs over the tokens routed to them.

The contract every backend's `fused_moe` keeps (kernels/table.py): tokens are grouped by expert, each expert with
tokens runs its gate/up and down GEMMs once over its group (an expert no token chose is never read), and each
token's k contributions, each scaled by its routing weight, are summed in ascending expert order: the order
transformers' experts loop adds them in, so float32 results are its bits wherever the GEMMs are. An id equal to the
number of experts the weights hold marks a slot another rank computes (expert parallelism): it adds nothing, and
sorts last."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .norm import silu_mul


@dataclass(frozen=True)
class Routing:
    """Which experts each token goes to and with what weight."""

    weights: torch.Tensor  # (tokens, k) float32
    ids: torch.Tensor  # (tokens, k) int64, each row ascending; = experts: a slot computed elsewhere


def route(router_logits: torch.Tensor, k: int, renormalize: bool) -> Routing:
    """Softmax over experts in float32, the k largest, renormalised to sum to one where the family does (Mixtral,
    Qwen3-MoE; Qwen2-MoE does not). Each row is then sorted by expert id, the order contributions are summed in."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # (tokens, experts)
    weights, ids = torch.topk(probs, k, dim=-1)  # (tokens, k), largest first; ties to the lower id as transformers
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids, order = ids.sort(dim=-1)
    return Routing(weights.gather(1, order), ids)


@dataclass(frozen=True)
class ExpertGroups:
    """The (token, slot) pairs of a routing sorted by expert: pair i of the sorted order is token rows[i], and
    expert e's pairs are [starts[e], starts[e + 1]); the slots computed elsewhere come last."""

    order: torch.Tensor  # (tokens * k,) flat (token, slot) indices, grouped by expert
    rows: torch.Tensor  # (tokens * k,) the token of each
    starts: list[int]  # experts + 1 offsets into order


def group_by_expert(ids: torch.Tensor, experts: int) -> ExpertGroups:
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=experts + 1).tolist()[:experts]
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    return ExpertGroups(order, order // ids.shape[1], starts)


def combine(contributions: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(tokens, k, hidden) expert outputs -> (tokens, hidden): each scaled by its weight (in float32, as
    transformers multiplies by float32 scores), rounded to the activations' dtype, then added slot by slot in
    ascending expert order (the slots are already in it)."""
    scaled = (contributions * weights[..., None]).to(dtype)
    out = scaled[:, 0].clone()
    for slot in range(1, scaled.shape[1]):
        out += scaled[:, slot]
    return out


def pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> None:
    """The torch reference reads the plain weights: nothing to pack."""
    return None


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, packed: object | None, routing: Routing
) -> torch.Tensor:
    """sum over k of weight * down_e(SiLU(gate_e x) * up_e x) for x (tokens, hidden), w13 (experts, 2 intermediate,
    hidden) (gate rows, then up rows), w2 (experts, hidden, intermediate) -> (tokens, hidden) in x's dtype.

    The reference runs one GEMM pair per expert that has tokens; the backends' kernels do the same grouping in one
    call."""
    return per_expert(x, routing, w13.shape[0], lambda e, xs: F.linear(silu_mul(F.linear(xs, w13[e])), w2[e]))


def per_expert(
    x: torch.Tensor, routing: Routing, experts: int, mlp: Callable[[int, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """fused_moe with each expert's MLP as mlp(e, its rows of x) -> (rows, hidden), called once per expert that has
    tokens (a loop over experts, for backends without a grouped kernel for the dtype)."""
    tokens, k = routing.ids.shape
    groups = group_by_expert(routing.ids, experts)
    xs = x[groups.rows]  # (tokens * k, hidden) grouped by expert
    out = torch.zeros(tokens * k, x.shape[1], dtype=x.dtype, device=x.device)  # slots computed elsewhere: 0
    for e in range(experts):
        lo, hi = groups.starts[e], groups.starts[e + 1]
        if lo < hi:
            out[lo:hi] = mlp(e, xs[lo:hi])
    contributions = torch.empty_like(out)
    contributions[groups.order] = out
    return combine(contributions.view(tokens, k, -1), routing.weights, x.dtype)
