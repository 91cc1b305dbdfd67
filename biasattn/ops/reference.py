"""The reference operator: materialize the bias, softmax in float32 (float64 for float64 inputs).

It is the oracle every other operator is compared to; its memory is O(B·H·Mq·Mk).
"""

from __future__ import annotations

import torch

from ..bias.atoms import Geometry
from ..inputs import AttentionInputs
from .base import Operator
from .common import compute_dtype, dropout_keep, new_seed
from .tiles import visible_matmul


def dense_bias(inp: AttentionInputs, dtype: torch.dtype, additive: torch.Tensor | None) -> torch.Tensor | None:
    """``[B|1, H|1, Mq, Mk]``: the bias' masks and ALiBi materialized, plus ``additive`` (the spec's).

    Positions that a mask hides are -inf whatever ``additive`` holds there (NaN and +inf included).
    """
    if inp.bias is None:
        return None
    g: Geometry = inp.bias.geometry(inp.B, inp.Hq, inp.Mq, inp.Mk)
    out = torch.zeros((1, 1, inp.Mq, inp.Mk), dtype=dtype, device=inp.device)
    for atom in inp.bias.atoms:
        if atom.kind != "additive":
            out = out + atom.dense(g, dtype, inp.device)
    if additive is not None:
        out = torch.where(torch.isneginf(out), float("-inf"), out + additive.to(dtype))
    return out


def visible_scores(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """``q @ kᵀ`` whose gradients stay finite when a hidden row or key holds NaN or inf.

    Rows and keys hidden everywhere are zeroed; a key with a non-finite entry gives its scores as
    constants (a row that sees it is NaN or inf anyway), so ``0 · NaN`` never enters ``dq``.
    """
    rows, keys = visible.any(-1)[..., None], visible.any(-2)[..., None]
    q, k = torch.where(rows, q, 0.0), torch.where(keys, k, 0.0)
    bad = ~torch.isfinite(k).all(-1)  # [B, H, Mk]
    s = q @ torch.where(bad[..., None], 0.0, k).transpose(-1, -2)
    return torch.where(bad[..., None, :], (q @ k.transpose(-1, -2)).detach(), s)


def softmax_attention(q, k, v, bias, scale: float, dtype: torch.dtype, dropout_keep_mask=None):
    """Plain attention in ``dtype`` with GQA by repetition; fully masked rows give 0 and lse -inf.

    A position that ``bias`` hides (-inf) takes no part in its row, whatever q, k, v hold there: the
    mask is applied with ``where`` to the scores and to ``p @ v``. Differentiable (no NaN gradients
    on fully masked rows). Returns ``(out, lse)`` in ``dtype``.
    """
    g = q.shape[1] // k.shape[1]
    q = q.to(dtype)
    k = k.to(dtype).repeat_interleave(g, dim=1)
    v = v.to(dtype).repeat_interleave(g, dim=1)
    visible = None
    if bias is None:
        s = (q @ k.transpose(-1, -2)) * scale
    else:  # hidden positions may hold garbage (NaN padding, a NaN key a causal mask hides): keep it out
        visible = ~torch.isneginf(bias)
        s = torch.where(visible, visible_scores(q, k, visible) * scale + bias, float("-inf"))
    if s.shape[-1] == 0:  # no keys at all: every row sees nothing
        m = s.new_full((*s.shape[:-1], 1), float("-inf"))
    else:
        m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    pos = l > 0
    lse = torch.where(pos, m + torch.log(torch.where(pos, l, torch.ones_like(l))), torch.full_like(l, float("-inf")))
    p = p / torch.where(pos, l, torch.ones_like(l))
    if dropout_keep_mask is not None:
        p = p * dropout_keep_mask
    if visible is None:
        return p @ v, lse.squeeze(-1)
    return visible_matmul(p, visible, v), lse.squeeze(-1)


class ReferenceOperator(Operator):
    """Materialize + softmax. Every feature, forward and backward (by autograd), any device."""

    NAME = "reference"
    DESCRIPTION = "materialized bias + softmax in float32/float64 (the oracle); O(Mq·Mk) memory"
    FEATURES = frozenset({"segments", "padded_keys", "band", "layout", "additive", "alibi"})
    SUPPORTS_DROPOUT = True
    SUPPORTS_BACKWARD = True
    SUPPORTS_BIAS_GRAD = True
    SUPPORTS_GQA = True
    SUPPORTS_EMPTY = True
    DEVICE_SEGMENTS = True

    def _run(self, inp, additive, seed):
        dtype = compute_dtype(inp.dtype)
        keep = None
        if inp.dropout_p > 0:
            keep = dropout_keep(seed, (0, 0), (inp.B, inp.Hq, inp.Mq, inp.Mk), inp.dropout_p, inp.device).to(dtype)
        return softmax_attention(inp.q, inp.k, inp.v, dense_bias(inp, dtype, additive), inp.scale, dtype, keep)

    def fwd(self, inp: AttentionInputs):
        seed = new_seed() if inp.dropout_p > 0 else 0
        with torch.no_grad():
            out, lse = self._run(inp, inp.additive, seed)
        return out.to(inp.dtype), lse.to(compute_dtype(inp.dtype)), seed

    def bwd(self, inp, out, lse, ctx, dout, dlse):
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (inp.q, inp.k, inp.v))
            add = inp.additive
            add = add.detach().requires_grad_() if add is not None else None
            o, l = self._run(inp.with_tensors(q, k, v, add), add, ctx)
            outs, grads = [o], [dout.to(o.dtype)]
            if dlse is not None:
                outs.append(l)
                grads.append(dlse.to(l.dtype))
            wrt = [q, k, v] + ([add] if add is not None else [])
            got = torch.autograd.grad(outs, wrt, grads, allow_unused=True)
        dq, dk, dv = got[:3]
        dadd = got[3] if add is not None else None
        return dq.to(inp.q.dtype), dk.to(inp.k.dtype), dv.to(inp.v.dtype), dadd
