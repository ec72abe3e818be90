"""RMSNorm, alone and fused with the residual add that precedes it; the MLP's gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (tokens, hidden) normalised in float32 and scaled by weight, as Hugging Face LlamaRMSNorm."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the normalised input of the next block and the new residual."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim (Phi-2, Falcon, OPT), as torch.nn.LayerNorm computes it."""
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (layer_norm(x + residual), x + residual), add_rms_norm's contract."""
    residual = x + residual
    return layer_norm(residual, weight, bias, eps), residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up (tokens, 2 * intermediate), gate in the first half: (tokens, intermediate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate, tanh approximation) * up (GeGLU, Gemma's gelu_pytorch_tanh): the same contract as silu_mul."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
