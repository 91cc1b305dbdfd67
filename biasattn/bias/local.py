"""Sliding-window (local) attention, aligned bottom-right.

``LocalAttentionMask(window_left=2)`` (Mq=Mk=6)
    ■ □ □ □ □ □
    ■ ■ □ □ □ □
    ■ ■ ■ □ □ □
    □ ■ ■ ■ □ □
    □ □ ■ ■ ■ □
    □ □ □ ■ ■ ■
"""

from __future__ import annotations

from ..errors import InputError
from .band import BOTTOM_RIGHT, band_atom
from .base import AttentionBias


def check_window(name: str, value) -> int:
    """Validate a window size: a non-negative int."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be a non-negative int, got {value!r}")
    if value < 0:
        raise InputError(f"{name} must be >= 0, got {value}")
    return value


class LocalAttentionMask(AttentionBias):
    """Band aligned bottom-right: ``i + (Mk-Mq) - window_left <= j <= i + (Mk-Mq) + window_right``.

    ``window_right=0`` (the default) is causal sliding-window attention; each query sees
    ``window_left + 1`` keys at most.
    """

    def __new__(cls, window_left: int, window_right: int = 0):
        left = check_window("window_left", window_left)
        right = check_window("window_right", window_right)
        return cls._create([band_atom(BOTTOM_RIGHT, left, right, cls.__name__)])
