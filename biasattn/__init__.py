"""biasattn: fast, exact attention with structured biases that are never materialized.

>>> import torch, biasattn as ba
>>> q = k = v = torch.randn(1, 2, 8, 16)
>>> out = ba.attention(q, k, v, attn_bias=ba.LowerTriangularMask())

The subpackages ``biasattn.nn``, ``biasattn.testing``, ``biasattn.integrations`` (and
``biasattn.distributed`` where present) are attributes imported on first use, as ``torch.nn`` is:
``import biasattn`` alone stays light.
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

_SUBPACKAGES = ("distributed", "integrations", "nn", "testing")


def _present(name: str) -> bool:
    """Whether the subpackage ``biasattn.<name>`` is part of this build."""
    import importlib.util

    return importlib.util.find_spec(f"{__name__}.{name}") is not None


def __getattr__(name: str):
    """Import a subpackage on first access (``biasattn.nn``, ``biasattn.testing``, ...)."""
    if name in _SUBPACKAGES and _present(name):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names plus the subpackages that import on first access."""
    return sorted(set(globals()) | {n for n in _SUBPACKAGES if _present(n)})

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
