"""Merging partial attention results by log-sum-exp (split-KV, chunked prefill, ring attention).

One function, two paths: on CUDA, when no gradient is needed, the Triton kernel that the split-KV
operator also uses (:func:`biasattn.ops.triton.splitk.merge_partials_triton`); otherwise the
differentiable PyTorch path below. Both compute the same math.
"""

from __future__ import annotations

import importlib.util

import torch

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _use_triton(outs: torch.Tensor, lses: torch.Tensor) -> bool:
    """True when the Triton merge applies: CUDA tensors, a Triton dtype, no gradient needed."""
    if not (outs.is_cuda and lses.is_cuda) or outs.dtype not in _TRITON_DTYPES or lses.dtype not in _TRITON_DTYPES:
        return False
    if torch.is_grad_enabled() and (outs.requires_grad or lses.requires_grad):
        return False
    return importlib.util.find_spec("triton") is not None


def merge_partials_torch(outs: torch.Tensor, lses: torch.Tensor, out_dtype: torch.dtype | None = None):
    """The PyTorch path of :func:`merge_partials`: differentiable, any device and dtype."""
    dtype = torch.float64 if torch.float64 in (outs.dtype, lses.dtype) else torch.float32
    lses = lses.to(dtype)
    m = lses.amax(0)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m).detach()
    w = torch.exp(lses - m_safe)  # [S, ..., M]
    total = w.sum(0)
    pos = total > 0
    safe = torch.where(pos, total, torch.ones_like(total))
    out = (w[..., None] * outs.to(dtype)).sum(0) / safe[..., None]
    lse = torch.where(pos, m_safe + torch.log(safe), torch.full_like(total, float("-inf")))
    return out.to(out_dtype or outs.dtype), lse


def merge_partials(outs: torch.Tensor, lses: torch.Tensor, out_dtype: torch.dtype | None = None):
    """Merge ``outs [S, ..., M, Dv]`` computed over disjoint key sets with their ``lses [S, ..., M]``.

    Returns ``(out [..., M, Dv], lse [..., M] float32)`` (float64 when the inputs are float64).
    Rows with every ``lse = -inf`` give 0 and
    ``-inf``; differentiable, with no NaN gradients on such rows.
    """
    if _use_triton(outs, lses):
        from .triton.splitk import merge_partials_triton

        return merge_partials_triton(outs, lses, out_dtype)
    return merge_partials_torch(outs, lses, out_dtype)
