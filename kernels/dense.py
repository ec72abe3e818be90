"""Torch references for the dense work around attention: the linear layer and greedy sampling's argmax."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def no_packing(weight: torch.Tensor) -> None:
    """Torch reads the plain weight: nothing to pack."""
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: object | None) -> torch.Tensor:
    """x W^T + bias; `packed` is unused (no_packing made it)."""
    return F.linear(x, weight, bias)


def argmax(logits: torch.Tensor) -> list[int]:
    """The index of each row's maximum, the first of equal maxima."""
    return logits.max(dim=-1).indices.tolist()
