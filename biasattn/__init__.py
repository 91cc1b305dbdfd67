"""biasattn: fast, exact attention with structured biases that are never materialized.

>>> import torch, biasattn as ba
>>> q = k = v = torch.randn(1, 2, 8, 16)
>>> out = ba.attention(q, k, v, attn_bias=ba.LowerTriangularMask())
"""

from . import dispatch, errors, inputs, ops
from .api import attention, attention_with_lse, explain, merge_attentions
from .bias import (
    AdditiveBias,
    ALiBi,
    AttentionBias,
    BiasSpec,
    BlockDiagonalMask,
    BlockSparseMask,
    ComposedBias,
    LocalAttentionMask,
    LowerTriangularFromBottomRightMask,
    LowerTriangularMask,
    PaddedKeysMask,
)
from .dispatch import use_ops
from .errors import BiasCompositionError, InputError, InputTypeError, NotSupportedError

__version__ = "0.1.0"

__all__ = [
    "ALiBi",
    "AdditiveBias",
    "AttentionBias",
    "BiasCompositionError",
    "BiasSpec",
    "BlockDiagonalMask",
    "BlockSparseMask",
    "ComposedBias",
    "InputError",
    "InputTypeError",
    "LocalAttentionMask",
    "LowerTriangularFromBottomRightMask",
    "LowerTriangularMask",
    "NotSupportedError",
    "PaddedKeysMask",
    "attention",
    "attention_with_lse",
    "dispatch",
    "errors",
    "explain",
    "inputs",
    "merge_attentions",
    "ops",
    "use_ops",
]
