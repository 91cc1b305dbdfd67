"""Block-sparse masks: a bool layout of visible ``block_q × block_k`` tiles.

``BlockSparseMask(layout=[[1, 0], [1, 1]], block_size=2)`` (Mq=Mk=4)
    ■ ■ □ □
    ■ ■ □ □
    ■ ■ ■ ■
    ■ ■ ■ ■
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from .atoms import Atom, Geometry, visible_to_additive
from .base import AttentionBias


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, eq=False)
class LayoutAtom(Atom):
    """Element ``(i, j)`` is visible iff ``layout[b, h, i // block_q, j // block_k]``."""

    layout: torch.Tensor  # bool [B or 1, H or 1, ceil(Mq/bq), ceil(Mk/bk)]
    block_q: int
    block_k: int
    family: str = "BlockSparseMask"
    kind = "layout"

    def sizes(self):
        b, h = self.layout.shape[:2]
        return (b if b > 1 else None, h if h > 1 else None, None, None)

    def tensors(self):
        return {"layout": self.layout}

    def combinable_with(self, other) -> bool:
        return (self.block_q, self.block_k) == (other.block_q, other.block_k)

    def incompatibility(self, other) -> str:
        return f"block sizes differ: {(self.block_q, self.block_k)} and {(other.block_q, other.block_k)}"

    def check(self, g: Geometry) -> None:
        """Raise if the layout does not cover the bias' full size exactly.

        A slice of a bias whose full size is unknown (unsized, never bound) only needs the layout to
        cover the rows and columns it reaches.
        """
        want = (_cdiv(g.Mq_full, self.block_q), _cdiv(g.Mk_full, self.block_k))
        got = tuple(self.layout.shape[2:])
        ok = [w == n if known else w <= n for w, n, known in zip(want, got, g.full_known)]
        if not all(ok):
            raise InputError(
                f"BlockSparseMask layout must have ceil(Mq/block_q) x ceil(Mk/block_k) = {want[0]} x {want[1]} "
                f"blocks for Mq={g.Mq_full}, Mk={g.Mk_full}, got {got[0]} x {got[1]}"
            )

    def dense(self, g: Geometry, dtype, device) -> torch.Tensor:
        self.check(g)
        rows = g.rows(device)[:, 0] // self.block_q
        cols = g.cols(device)[0] // self.block_k
        layout = self.layout.to(device)
        visible = layout[:, :, rows][:, :, :, cols]
        return visible_to_additive(visible, dtype)

    def lower(self, builder) -> None:
        self.check(builder.g)
        builder.add_layout(self.layout.to(builder.device), self.block_q, self.block_k)

    def __repr__(self) -> str:
        text = f"layout={list(self.layout.shape)}, block=({self.block_q}, {self.block_k})"
        if self.layout.device.type == "cpu":  # elsewhere the density would need a device read (a sync, or none on meta)
            density = float(self.layout.float().mean()) if self.layout.numel() else 0.0
            text += f", density={density:.2f}"
        return text


class BlockSparseMask(AttentionBias):
    """Only the ``block_q × block_k`` tiles where ``layout`` is True are visible.

    ``layout``: bool ``[B or 1, H or 1, ceil(Mq/block_q), ceil(Mk/block_k)]`` (3-D means B=1, 2-D
    means B=H=1). ``block_size``: an int or ``(block_q, block_k)``.
    """

    def __new__(cls, layout: torch.Tensor, block_size):
        if not isinstance(layout, torch.Tensor):
            layout = torch.as_tensor(layout)
        if layout.dtype != torch.bool:
            if layout.is_floating_point():
                raise InputError(f"layout must be a bool (or 0/1 integer) tensor, got dtype {layout.dtype}")
            layout = layout != 0
        if layout.dim() not in (2, 3, 4):
            raise InputError(f"layout must be [B, H, nq, nk] (or 3-D / 2-D), got shape {list(layout.shape)}")
        while layout.dim() < 4:
            layout = layout[None]
        bq, bk = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
        for name, b in (("block_q", bq), ("block_k", bk)):
            if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
                raise InputError(f"{name} must be a positive int, got {b!r}")
        return cls._create([LayoutAtom(layout, bq, bk)], device=layout.device)

    @property
    def layout(self) -> torch.Tensor:
        """The 4-D bool layout."""
        return self.atoms[0].layout
