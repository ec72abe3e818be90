"""Torch references for the dense work around attention: the linear layer and greedy sampling's argmax."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import Fp8Linear, fp8_linear


def no_packing(weight: torch.Tensor) -> None:
    """Torch reads the plain weight: nothing to pack."""
    return None


def linear(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, packed: object | None
) -> torch.Tensor:
    """x W^T + bias: an fp8 layer (`--quantization fp8`) through torch's scaled matmul, any other through the plain
    weight (no_packing made no packed form)."""
    if isinstance(packed, Fp8Linear):
        return fp8_linear(x, packed, bias)
    assert weight is not None, "only a packed form that holds the weight lets a layer drop it"
    return F.linear(x, weight, bias)


def argmax(logits: torch.Tensor) -> list[int]:
    """The index of each row's maximum, the first of equal maxima."""
    return logits.max(dim=-1).indices.tolist()
