"""Attention biases: lazy ``torch.Tensor`` subclasses that compose with ``&`` and ``+``."""

from .additive import AdditiveBias
from .alibi import ALiBi
from .base import AttentionBias
from .block_diagonal import BlockDiagonalMask
from .block_sparse import BlockSparseMask
from .causal import LowerTriangularFromBottomRightMask, LowerTriangularMask
from .composed import ComposedBias
from .local import LocalAttentionMask
from .padded import PaddedKeysMask
from .spec import BiasSpec, lower

__all__ = [
    "ALiBi",
    "AdditiveBias",
    "AttentionBias",
    "BiasSpec",
    "BlockDiagonalMask",
    "BlockSparseMask",
    "ComposedBias",
    "LocalAttentionMask",
    "LowerTriangularFromBottomRightMask",
    "LowerTriangularMask",
    "PaddedKeysMask",
    "lower",
]
