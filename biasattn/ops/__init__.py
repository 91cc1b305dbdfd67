"""Operator registry: ``available()`` names the registered operators, ``get(name)`` returns one."""

from __future__ import annotations

from ..errors import InputError
from .base import Operator
from .chunked import ChunkedOperator
from .reference import ReferenceOperator

_REGISTRY: dict[str, Operator] = {}
_GENERATION = [0]


def register(op: Operator) -> Operator:
    """Add an operator to the registry (replacing one of the same name)."""
    _REGISTRY[op.NAME] = op
    _GENERATION[0] += 1
    return op


def unregister(name: str) -> None:
    """Remove the operator named ``name`` from the registry (no error if it is absent)."""
    if _REGISTRY.pop(name, None) is not None:
        _GENERATION[0] += 1


def generation() -> int:
    """A number that changes whenever the registry does (dispatch decisions are cached by it)."""
    return _GENERATION[0]


def available() -> list[str]:
    """Names of the registered operators, in registration order."""
    return list(_REGISTRY)


def get(name: str | Operator) -> Operator:
    """The operator named ``name`` (an Operator passes through)."""
    if isinstance(name, Operator):
        return name
    try:
        return _REGISTRY[name]
    except KeyError:
        raise InputError(f"op must be one of {available()}, got {name!r}") from None


def _register_builtin() -> None:
    for module, cls in (
        ("triton_flash", "TritonOperator"),
        ("triton_splitk", "TritonSplitKOperator"),
        ("vendor.cutlass", "CutlassOperator"),
        ("vendor.flash2", "Flash2Operator"),
        ("vendor.cudnn", "CudnnOperator"),
        ("vendor.cpu_flash", "CpuFlashOperator"),
    ):
        try:
            mod = __import__(f"{__name__}.{module}", fromlist=[cls])
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith(__name__):
                continue  # operator not part of this build
            raise
        register(getattr(mod, cls)())
    register(ChunkedOperator())
    register(ReferenceOperator())


_register_builtin()

__all__ = ["Operator", "available", "generation", "get", "register", "unregister"]
