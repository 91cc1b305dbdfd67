"""The autograd function joining a forward operator with a backward operator."""

from __future__ import annotations

import torch

from ..inputs import AttentionInputs
from .base import Operator


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, additive, inp: AttentionInputs, fwd_op: Operator, bwd_op: Operator | None):
        inp = inp.with_tensors(q, k, v, additive)
        out, lse, saved = fwd_op.fwd(inp)
        ctx.save_for_backward(q, k, v, additive, out, lse)
        ctx.inp, ctx.saved, ctx.bwd_op = inp, saved, bwd_op
        ctx.set_materialize_grads(False)  # an unused lse gets no zero gradient (no allocation, no dlse term)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, additive, out, lse = ctx.saved_tensors
        if ctx.bwd_op is None:
            raise RuntimeError(
                "biasattn: this attention call was made without gradients in mind; call it again with requires_grad inputs"
            )
        inp = ctx.inp.with_tensors(q, k, v, additive)
        if dout is None:
            dout = torch.zeros_like(out)
        # operators take any strides with a unit last one: a dout laid out like out needs no copy
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        dq, dk, dv, dadd = ctx.bwd_op.bwd(inp, out, lse, ctx.saved, dout, dlse)
        return dq, dk, dv, dadd, None, None, None


def run(
    inp: AttentionInputs, fwd_op: Operator, bwd_op: Operator | None, *, need_lse: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out, lse)`` through ``fwd_op``; gradients through ``bwd_op`` when ``inp.requires_grad``. Without
    gradients and ``need_lse=False`` the lse is None and the operator may skip it."""
    if not inp.requires_grad:
        # no graph to keep out unless some input asks for gradients (inference usually runs under no_grad already)
        if torch.is_grad_enabled() and (
                inp.q.requires_grad or inp.k.requires_grad or inp.v.requires_grad
                or (inp.additive is not None and inp.additive.requires_grad)):
            with torch.no_grad():
                return _without_graph(inp, fwd_op, need_lse)
        return _without_graph(inp, fwd_op, need_lse)
    if not need_lse and fwd_op is bwd_op:
        out = fwd_op.graph_out(inp)
        if out is not None:
            return out, None
    return _AttentionFunction.apply(inp.q, inp.k, inp.v, inp.additive, inp, fwd_op, bwd_op)


def _without_graph(inp: AttentionInputs, fwd_op: Operator, need_lse: bool):
    if not need_lse:
        return fwd_op.fwd_out(inp), None
    out, lse, _ = fwd_op.fwd(inp)
    return out, lse
