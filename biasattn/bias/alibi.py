"""ALiBi: a linear distance penalty, aligned bottom-right: ``-slope[h] * |i + (Mk - Mq) - j|``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InputError
from .atoms import Atom, Geometry
from .base import AttentionBias


@dataclass(frozen=True, eq=False)
class AlibiAtom(Atom):
    """Adds ``-slopes[b, h] * |j - i - (Mk_full - Mq_full)|``."""

    slopes: torch.Tensor  # float32 [B or 1, H]
    family: str = "ALiBi"
    kind = "alibi"
    is_mask = False

    @property
    def needs_full_size(self) -> bool:
        return True

    def sizes(self):
        b, h = self.slopes.shape
        return (b if b > 1 else None, h if h > 1 else None, None, None)

    def tensors(self):
        return {"slopes": self.slopes}

    def dense(self, g: Geometry, dtype, device) -> torch.Tensor:
        d = (g.cols(device) - g.rows(device) - (g.Mk_full - g.Mq_full)).abs().to(dtype)
        return -self.slopes.to(device=device, dtype=dtype)[:, :, None, None] * d

    def lower(self, builder) -> None:
        g = builder.g
        builder.add_alibi(self.slopes.to(device=builder.device, dtype=torch.float32), g.Mk_full - g.Mq_full)

    def __repr__(self) -> str:
        return f"slopes{list(self.slopes.shape)}"


class ALiBi(AttentionBias):
    """ALiBi bias ``-slopes[h] * |i + (Mk - Mq) - j|``; ``slopes``: ``[H]`` or ``[B, H]``."""

    def __new__(cls, slopes):
        slopes = torch.as_tensor(slopes)
        if not slopes.is_floating_point():
            slopes = slopes.to(torch.float32)
        if slopes.dim() not in (1, 2):
            raise InputError(f"ALiBi slopes must be [H] or [B, H], got shape {list(slopes.shape)}")
        slopes = slopes.to(torch.float32)
        if slopes.dim() == 1:
            slopes = slopes[None]
        return cls._create([AlibiAtom(slopes)], device=slopes.device)

    @staticmethod
    def standard_slopes(num_heads: int) -> torch.Tensor:
        """The geometric slopes of the ALiBi paper for ``num_heads`` heads (float32 ``[H]``)."""
        def power_of_two(n):
            start = 2 ** (-(2 ** -(math.log2(n) - 3)))
            return [start * start**k for k in range(n)]

        if math.log2(num_heads).is_integer():
            vals = power_of_two(num_heads)
        else:
            p = 2 ** math.floor(math.log2(num_heads))
            vals = power_of_two(p) + power_of_two(2 * p)[0::2][: num_heads - p]
        return torch.tensor(vals, dtype=torch.float32)
