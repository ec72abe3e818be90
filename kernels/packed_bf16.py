"""A bfloat16 weight in the order the packed bfloat16 kernels read it (csrc/linear.c on AMX, csrc/linear_dpbf16.c
by vdpbf16ps): the dense layers' (kernels/cpu.py) and the experts' of a mixture (kernels/cpu_moe.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PackedLinear:
    """A bfloat16 weight (out_features, in_features) in the order the packed bfloat16 kernels read it (csrc/linear.c on
    AMX, csrc/linear_dpbf16.c by vdpbf16ps), packed once at load: tile (nb, kb), row r, dword c, half i =
    w[16 nb + c][32 kb + 2 r + i], out_features padded to 16 with zero rows."""

    tiles: torch.Tensor  # (out_features / 16, in_features / 32, 16, 16, 2)
    out_features: int
    in_features: int

    @staticmethod
    def of(weight: torch.Tensor) -> PackedLinear:
        out_features, in_features = weight.shape
        padded = F.pad(weight.detach(), (0, 0, 0, -out_features % 16))
        tiles = padded.view(-1, 16, in_features // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()
        return PackedLinear(tiles, out_features, in_features)

    def unpacked(self) -> torch.Tensor:
        """The weight (out_features, in_features) again, for the rare input the kernel does not take."""
        return self.tiles.permute(0, 3, 1, 2, 4).reshape(-1, self.in_features)[: self.out_features]
