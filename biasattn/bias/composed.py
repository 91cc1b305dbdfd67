"""The class of biases built by ``&`` and ``+``."""

from __future__ import annotations

from .base import AttentionBias


class ComposedBias(AttentionBias):
    """A composition of biases: the intersection of its masks plus the sum of its additive terms."""

    def _family(self) -> str:
        masks = sorted({a.family for a in self.atoms if a.is_mask})
        terms = " & ".join(masks)
        additive = sorted({a.family for a in self.atoms if not a.is_mask})
        if additive:
            terms = " + ".join(([f"({terms})" if len(masks) > 1 else terms] if masks else []) + additive)
        return f"ComposedBias({terms})"
