"""Public functions: ``attention``, ``attention_with_lse``, ``merge_attentions``, ``explain``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import dispatch
from .bias import AttentionBias, LowerTriangularMask, protocol
from .errors import InputError
from .inputs import as_bias, make_inputs
from .ops import autograd, custom_ops
from .ops.merge import merge_partials


def attention(q, k, v, attn_bias=None, *, scale: float | None = None, dropout_p: float = 0.0, op=None) -> torch.Tensor:
    """Exact attention ``softmax(q kᵀ · scale + bias) v``.

    Args:
        q: ``[B, Hq, Mq, D]``; k: ``[B, Hkv, Mk, D]``; v: ``[B, Hkv, Mk, Dv]`` with ``Hq % Hkv == 0``.
        attn_bias: a biasattn bias (``LowerTriangularMask()``, compositions, ...), a float tensor
            broadcastable to ``[B, Hq, Mq, Mk]`` (added), a bool tensor (True = visible), or None.
        scale: defaults to ``1 / sqrt(D)``.
        dropout_p: dropout probability on the attention weights.
        op: force an operator (name or object); raises :class:`~biasattn.NotSupportedError` with
            its reasons if it cannot run these inputs.

    Returns:
        ``[B, Hq, Mq, Dv]`` in q's dtype. Query rows that see no key give 0. Where q keeps each row's
        heads side by side (a view of a ``[B, M, H * D]`` projection), the ``triton`` operator and
        compiled calls lay the output out the same way, as SDPA's flash and cuDNN backends do:
        ``out.transpose(1, 2).reshape(B, Mq, Hq * Dv)`` is then a view, not a copy.
    """
    if torch.compiler.is_compiling():  # torch.compile / export: through the custom ops
        return custom_ops.attention(q, k, v, attn_bias, scale=scale, dropout_p=dropout_p, op=op)[0]
    return dispatch.attention_out(q, k, v, attn_bias, scale=scale, dropout_p=dropout_p, op=op)


def attention_with_lse(q, k, v, attn_bias=None, *, scale: float | None = None, op=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`attention` (no dropout) and also the log-sum-exp ``lse [B, Hq, Mq]`` (float32).

    ``lse`` is ``-inf`` on rows that see no key; gradients flow through both outputs.
    """
    if torch.compiler.is_compiling():
        return custom_ops.attention(q, k, v, attn_bias, scale=scale, op=op, need_lse=True)
    inp, fwd, bwd = dispatch.prepare(q, k, v, attn_bias, scale=scale, need_lse=True, op=op)
    return autograd.run(inp, fwd, bwd)


def merge_attentions(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over disjoint key sets: ``outs[i] [B, H, M, Dv]``, ``lses[i] [B, H, M]``.

    Returns ``(out, lse)`` equal to attention over the union of the key sets.
    """
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise InputError(f"outs and lses must be non-empty and of equal length, got {len(outs)} and {len(lses)}")
    for n, (o, s) in enumerate(zip(outs, lses)):
        if o.shape != outs[0].shape:
            raise InputError(f"outs[{n}] has shape {list(o.shape)}, outs[0] has {list(outs[0].shape)}")
        if s.shape != o.shape[:-1]:
            raise InputError(f"lses[{n}] must have shape {list(o.shape[:-1])}, got {list(s.shape)}")
    return merge_partials(torch.stack(outs), torch.stack(lses))


def explain(q, k, v, attn_bias=None, dropout_p: float = 0.0, requires_grad: bool | None = None, *, scale=None) -> str:
    """Which operator :func:`attention` would choose for these inputs, and why each other one refuses."""
    inp = make_inputs(q, k, v, attn_bias, scale=scale, dropout_p=dropout_p, requires_grad=requires_grad)
    return dispatch.explanation(inp)


def _sdpa_from_torch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` called with a biasattn bias lands here."""
    bias = as_bias(attn_mask)
    if is_causal:
        bias = LowerTriangularMask().to(query.device) if bias is None else bias & LowerTriangularMask().to(query.device)
    unbatched = query.dim() == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    if query.shape[-3] != key.shape[-3] and not enable_gqa:
        raise InputError(
            f"query has {query.shape[-3]} heads and key has {key.shape[-3]}; pass enable_gqa=True for grouped-query attention"
        )
    out = attention(query, key, value, bias, scale=scale, dropout_p=dropout_p)
    return out[0] if unbatched else out


protocol.register_torch_function(F.scaled_dot_product_attention, _sdpa_from_torch)

__all__ = ["AttentionBias", "attention", "attention_with_lse", "explain", "merge_attentions"]
