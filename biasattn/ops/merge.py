"""Merging partial attention results by log-sum-exp (split-KV, chunked prefill, ring attention)."""

from __future__ import annotations

import torch


def merge_partials(outs: torch.Tensor, lses: torch.Tensor, out_dtype: torch.dtype | None = None):
    """Merge ``outs [S, ..., M, Dv]`` computed over disjoint key sets with their ``lses [S, ..., M]``.

    Returns ``(out [..., M, Dv], lse [..., M] float32)``. Rows with every ``lse = -inf`` give 0 and
    ``-inf``; differentiable, with no NaN gradients on such rows.
    """
    lses = lses.float()
    m = lses.amax(0)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m).detach()
    w = torch.exp(lses - m_safe)  # [S, ..., M]
    total = w.sum(0)
    pos = total > 0
    safe = torch.where(pos, total, torch.ones_like(total))
    out = (w[..., None] * outs.float()).sum(0) / safe[..., None]
    lse = torch.where(pos, m_safe + torch.log(safe), torch.full_like(total, float("-inf")))
    return out.to(out_dtype or outs.dtype), lse
