"""Choosing operators: priority lists per device kind, explanations, and ``use_ops``.

The CUDA list is ordered by measured speed (``benchmarks/results/``); the dispatcher picks the
first operator with no reasons to refuse, separately for the forward and the backward pass.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from . import ops
from .errors import NotSupportedError
from .inputs import AttentionInputs
from .ops.base import Operator

PRIORITY: dict[str, tuple[str, ...]] = {
    "cuda": ("triton_splitk", "cudnn", "flash2", "triton", "cutlass", "chunked", "reference"),
    "cpu": ("chunked", "reference"),
}
DEFAULT_PRIORITY: tuple[str, ...] = ("chunked", "reference")

_allowed: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("biasattn_allowed_ops", default=None)


@contextlib.contextmanager
def use_ops(*names: str) -> Iterator[None]:
    """Restrict the dispatcher to the named operators inside the block (like torch's ``sdpa_kernel``).

    Operators missing from the device's priority list (``triton`` on the CPU, under the Triton
    interpreter) are tried after it, in the order given.
    """
    for n in names:
        ops.get(n)
    token = _allowed.set(tuple(names))
    try:
        yield
    finally:
        _allowed.reset(token)


def candidates(device_type: str) -> list[Operator]:
    """Operators the dispatcher will try for a device kind, in order."""
    order = list(PRIORITY.get(device_type, DEFAULT_PRIORITY))
    allowed = _allowed.get()
    if allowed is not None:
        order = [n for n in order if n in allowed] + [n for n in allowed if n not in order]
    registered = set(ops.available())
    return [ops.get(n) for n in order if n in registered]


def _reasons(inp: AttentionInputs, need_lse: bool, backward: bool) -> dict[str, list[str]]:
    return {op.NAME: op.not_supported_reasons(inp, need_lse=need_lse, backward=backward) for op in candidates(inp.device.type)}


def choose(inp: AttentionInputs, *, need_lse: bool = False, op=None) -> tuple[Operator, Operator | None]:
    """``(forward operator, backward operator or None)`` for ``inp``; raises NotSupportedError."""
    backward = inp.requires_grad
    if op is not None:
        forced = ops.get(op)
        why = forced.not_supported_reasons(inp, need_lse=need_lse, backward=backward)
        if why:
            raise NotSupportedError(f"operator {forced.NAME!r} was forced but cannot run {inp.describe()}", {forced.NAME: why})
        return forced, forced if backward else None
    same_op = backward and inp.dropout_p > 0  # the dropout mask lives in the forward operator
    fwd_reasons = _reasons(inp, need_lse, backward=same_op)
    fwd = next((ops.get(n) for n, why in fwd_reasons.items() if not why), None)
    if fwd is None:
        raise NotSupportedError(f"no operator can run {inp.describe()}", fwd_reasons)
    if not backward:
        return fwd, None
    if same_op:
        return fwd, fwd
    bwd_reasons = _reasons(inp, need_lse, backward=True)
    bwd = next((ops.get(n) for n, why in bwd_reasons.items() if not why), None)
    if bwd is None:
        raise NotSupportedError(f"no operator can compute gradients for {inp.describe()}", {n: w for n, w in bwd_reasons.items()})
    return fwd, bwd


def explanation(inp: AttentionInputs, *, need_lse: bool = False) -> str:
    """Human-readable report: every candidate operator with 'chosen' or its reasons."""
    lines = [f"inputs: {inp.describe()}"]
    try:
        fwd, bwd = choose(inp, need_lse=need_lse)
    except NotSupportedError:
        fwd = bwd = None
    passes = [("forward", False)] + ([("backward", True)] if inp.requires_grad else [])
    for title, backward in passes:
        chosen = fwd if not backward else bwd
        lines.append(f"{title}:")
        same_op = inp.requires_grad and inp.dropout_p > 0
        for name, why in _reasons(inp, need_lse, backward=backward or same_op).items():
            if chosen is not None and name == chosen.NAME:
                lines.append(f"  {name:<14} chosen")
            elif not why:
                lines.append(f"  {name:<14} available (lower priority)")
            else:
                lines.append(f"  {name:<14} " + "; ".join(why))
        if chosen is None:
            lines.append("  -> no operator can run these inputs")
    return "\n".join(lines)
