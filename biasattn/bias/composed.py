"""The class of biases built by ``&`` and ``+``."""

from __future__ import annotations

from .base import AttentionBias


class ComposedBias(AttentionBias):
    """A composition of biases: the intersection of its masks plus the sum of its additive terms."""

    def _family(self) -> str:
        return "ComposedBias(" + " & ".join(sorted({a.family for a in self.atoms})) + ")"
