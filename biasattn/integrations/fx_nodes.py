"""Predicates on FX nodes shared by the attention-site recognisers of :mod:`biasattn.integrations.fx`."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

MATMUL = {operator.matmul, torch.matmul, torch.bmm}
SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax}
CASTS = {"float", "double", "to", "type", "type_as", "half", "bfloat16", "contiguous"}
FULL_SLICE = slice(None, None, None)


def is_call(node, targets) -> bool:
    """Whether ``node`` calls one of the functions ``targets``."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def method(node, *names) -> bool:
    """Whether ``node`` calls a tensor method named in ``names``."""
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target in names


def arg(node, i, name, default=None):
    """Argument ``i`` of ``node``, positional or by keyword ``name``."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def const(x) -> float | None:
    """``x`` as a float if it is a Python number."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def is_matmul(node) -> bool:
    """Whether ``node`` is a matrix product (``@``, ``torch.matmul``, ``bmm``)."""
    return is_call(node, MATMUL) or method(node, "matmul", "bmm")


def skip_casts(node):
    """``node`` with single-use dtype casts peeled off."""
    while method(node, *CASTS) and len(node.users) == 1:
        node = node.args[0]
    return node
