"""A reference attention computed straight from ``bias.materialize``, independent of the lowering.

Every operator lowers a bias to a :class:`~biasattn.BiasSpec` and reads only the spec;
:func:`reference_attention` never looks at the spec. It materializes the dense ``[B, H, Mq, Mk]``
bias (the single definition of what a bias means) and runs the textbook softmax, so a lowering bug
and an operator bug both show up as a difference from it.
"""

from __future__ import annotations

import math

import torch

from ..bias import AdditiveBias, AttentionBias
from ..ops.reference import visible_scores
from ..ops.tiles import visible_matmul


def dense_bias(attn_bias, shape, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor | None:
    """The additive ``[B, H, Mq, Mk]`` tensor of ``attn_bias`` (a bias, a float/bool tensor or None).

    A plain float tensor is broadcast and cast; a bool tensor means True = visible.
    """
    if attn_bias is None:
        return None
    if isinstance(attn_bias, AttentionBias):
        dense = attn_bias.materialize(shape, dtype=dtype, device=device)
        g = attn_bias.geometry(*shape)
        masks = [a.dense(g, dtype, dense.device) for a in attn_bias.atoms if a.kind != "additive"]
        if not masks or len(masks) == len(attn_bias.atoms):
            return dense
        hidden = torch.stack([torch.isneginf(m).expand(shape) for m in masks]).any(0)
        return dense.masked_fill(hidden, float("-inf"))  # a mask hides whatever an additive term holds there
    if isinstance(attn_bias, torch.Tensor):
        return AdditiveBias(attn_bias.detach()).materialize(shape, dtype=dtype, device=device)
    raise TypeError(f"attn_bias must be a bias, a tensor or None, got {type(attn_bias).__name__}")


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_bias=None,
    *,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
    bias_dense: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook attention over the materialized bias: ``(out [B, Hq, Mq, Dv], lse [B, Hq, Mq])``.

    Args:
        q: ``[B, Hq, Mq, D]``; k: ``[B, Hkv, Mk, D]``; v: ``[B, Hkv, Mk, Dv]`` (``Hq % Hkv == 0``).
        attn_bias: any biasattn bias, a float tensor (added) or a bool tensor (True = visible).
        scale: defaults to ``1 / sqrt(D)``.
        compute_dtype: the dtype of every step (float64 for the oracle; pass ``q.dtype`` to get the
            same math in low precision, the yardstick of :func:`assert_close_to_reference`).
        bias_dense: a dense additive tensor broadcastable to ``[B, Hq, Mq, Mk]`` to use instead of
            materializing ``attn_bias`` (pass one that requires grad to get the bias gradient).

    Both outputs are in ``compute_dtype`` and differentiable. A row that sees no key gives 0 in
    ``out``, ``-inf`` in ``lse`` and 0 gradients (never NaN). A position that the bias hides takes
    no part in its row, whatever the key, the value or an additive term holds there (NaN, inf).
    """
    B, Hq, Mq, D = q.shape
    Hkv, Mk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if bias_dense is None:
        bias_dense = dense_bias(attn_bias, (B, Hq, Mq, Mk), compute_dtype, q.device)
    groups = Hq // Hkv
    q = q.to(compute_dtype)
    k = k.to(compute_dtype).repeat_interleave(groups, dim=1)
    v = v.to(compute_dtype).repeat_interleave(groups, dim=1)
    if bias_dense is None:
        s = (q @ k.transpose(-1, -2)) * scale
    else:  # a hidden position takes no part in its row, whatever q, k, v or the bias hold there
        visible = ~torch.isneginf(bias_dense.detach())
        s = torch.where(visible, visible_scores(q, k, visible) * scale + bias_dense.to(compute_dtype), float("-inf"))
    m = s.detach().amax(-1, keepdim=True) if Mk > 0 else s.new_full((B, Hq, Mq, 1), float("-inf"))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    seen = denom > 0
    safe = torch.where(seen, denom, torch.ones_like(denom))
    p = p / safe
    out = p @ v if bias_dense is None else visible_matmul(p, visible, v)
    lse = torch.where(seen, m + torch.log(safe), torch.full_like(m, float("-inf")))
    return out, lse.squeeze(-1)
