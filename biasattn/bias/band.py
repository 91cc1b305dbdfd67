"""The diagonal band atom shared by the causal and local-attention families."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .atoms import Atom, Geometry, visible_to_additive

TOP_LEFT = "top_left"
BOTTOM_RIGHT = "bottom_right"


def segment_diagonals(q_starts: torch.Tensor, k_starts: torch.Tensor, alignment: str) -> torch.Tensor:
    """Per packed segment, the ``d = j - i`` of its diagonal, from the ``[S+1]`` start tensors (on their device,
    nothing read): its first key against its first query, or with ``BOTTOM_RIGHT`` its last against its last."""
    return (k_starts[1:] - q_starts[1:]) if alignment == BOTTOM_RIGHT else (k_starts[:-1] - q_starts[:-1])


@dataclass(frozen=True, eq=False)
class BandAtom(Atom):
    """Keys with ``i + shift - window_left <= j <= i + shift + window_right`` are visible.

    ``shift`` is 0 for top-left alignment and ``Mk - Mq`` (full sizes) for bottom-right alignment;
    a window of None is unbounded on that side.
    """

    alignment: str
    window_left: int | None
    window_right: int | None
    family: str = "LowerTriangularMask"
    kind = "band"

    @property
    def needs_full_size(self) -> bool:
        return self.alignment == BOTTOM_RIGHT

    def diagonal_bounds(self, g: Geometry) -> tuple[int | None, int | None]:
        """Bounds on ``d = j - i`` in the bias' global coordinates (None = unbounded)."""
        shift = 0 if self.alignment == TOP_LEFT else g.Mk_full - g.Mq_full
        lo = None if self.window_left is None else shift - self.window_left
        hi = None if self.window_right is None else shift + self.window_right
        return lo, hi

    def dense(self, g: Geometry, dtype, device) -> torch.Tensor:
        lo, hi = self.diagonal_bounds(g)
        d = g.cols(device) - g.rows(device)
        visible = torch.ones_like(d, dtype=torch.bool)
        if lo is not None:
            visible &= d >= lo
        if hi is not None:
            visible &= d <= hi
        return visible_to_additive(visible, dtype)[None, None]

    def lower(self, builder) -> None:
        builder.add_band(*self.diagonal_bounds(builder.g))

    def __repr__(self) -> str:
        return f"band({self.alignment}, left={self.window_left}, right={self.window_right})"


@functools.lru_cache(maxsize=256)
def band_atom(alignment: str, window_left: int | None, window_right: int | None, family: str) -> BandAtom:
    """The one :class:`BandAtom` of a band: masks built afresh every call hold the same atom, so the
    spec lowered for one of them is found for the next by identity (:func:`~biasattn.bias.spec.lowered_before`)."""
    return BandAtom(alignment, window_left, window_right, family=family)
