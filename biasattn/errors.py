"""Exceptions raised by biasattn.

Every message names the argument, the expected value and the actual value, so that a user can act
on it without reading the library's code.
"""

from __future__ import annotations


class BiasattnError(Exception):
    """Base class of every error raised by biasattn."""


class InputError(BiasattnError, ValueError):
    """An argument has the wrong shape, size, or value (``q has head dim 8, k has 16``)."""


class InputTypeError(BiasattnError, TypeError):
    """An argument has the wrong type or dtype, or two arguments' dtypes or devices disagree."""


class BiasCompositionError(BiasattnError, TypeError):
    """Two biases cannot be composed with the operator used (names the pair and what to do)."""


class NotSupportedError(BiasattnError, RuntimeError):
    """No operator (or the forced one) can run the given inputs.

    ``reasons`` maps an operator name to the list of sentences explaining why it refused.
    """

    def __init__(self, message: str, reasons: dict[str, list[str]] | None = None):
        self.reasons = dict(reasons or {})
        lines = [message]
        for name, why in self.reasons.items():
            lines.append(f"  {name}:")
            lines.extend(f"    - {w}" for w in why)
        super().__init__("\n".join(lines))
