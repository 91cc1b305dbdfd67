"""Causal masks, aligned top-left or bottom-right.

``LowerTriangularMask`` (Mq=4, Mk=6)      ``LowerTriangularFromBottomRightMask`` (Mq=4, Mk=6)
    ■ □ □ □ □ □                               ■ ■ ■ □ □ □
    ■ ■ □ □ □ □                               ■ ■ ■ ■ □ □
    ■ ■ ■ □ □ □                               ■ ■ ■ ■ ■ □
    ■ ■ ■ ■ □ □                               ■ ■ ■ ■ ■ ■
"""

from __future__ import annotations

from .band import BOTTOM_RIGHT, TOP_LEFT, band_atom
from .base import AttentionBias, shared


class LowerTriangularMask(AttentionBias):
    """Causal mask aligned top-left: key ``j`` is visible to query ``i`` iff ``j <= i``.

    Unsized: Mq and Mk come from q and k. Query rows beyond Mk see keys up to Mk - 1.
    """

    def __new__(cls):
        return shared(cls, lambda: cls._create([band_atom(TOP_LEFT, None, 0, cls.__name__)]))


class LowerTriangularFromBottomRightMask(AttentionBias):
    """Causal mask aligned bottom-right: key ``j`` is visible to query ``i`` iff ``j <= i + (Mk - Mq)``.

    The last query sees every key: the layout of a KV cache or of chunked prefill. When ``Mq > Mk``
    the first ``Mq - Mk`` query rows see no key (their output is 0, their lse ``-inf``).
    """

    def __new__(cls):
        return shared(cls, lambda: cls._create([band_atom(BOTTOM_RIGHT, None, 0, cls.__name__)]))
