"""Hugging Face transformers: ``attn_implementation="biasattn"``.

>>> import biasattn.integrations.transformers as bt
>>> bt.register()                                            # doctest: +SKIP
>>> model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="biasattn")  # doctest: +SKIP

:func:`register` adds an attention function (``AttentionInterface``) and a mask function
(``AttentionMaskInterface``) under one name. The mask function hands the model's 2-D padding mask
through untouched (sliced to the key length, or None when nothing is padded), so no ``Mq × Mk``
mask is ever built; the attention function turns it into lazy biases:

- causal layers get :class:`~biasattn.LowerTriangularFromBottomRightMask` (queries are the last
  positions of the key sequence, which also covers KV caches), or
  :class:`~biasattn.LocalAttentionMask` for sliding-window layers (``sliding_window=w`` keeps the
  last ``w`` keys, as the other implementations do);
- a right-padding mask becomes :class:`~biasattn.PaddedKeysMask` (key lengths only); any other
  padding (left padding for generation, holes) a broadcast ``[B, 1, 1, S]``
  :class:`~biasattn.AdditiveBias`; a static cache's unused slots are cut off;
- packed sequences (batch of one with restarting ``position_ids``, or flash-attention style
  ``cu_seq_lens_q``/``cu_seq_lens_k``) become a :class:`~biasattn.BlockDiagonalMask`;
- grouped-query attention passes k/v with their own heads (no repeat).

Query rows that see no key (left padding) give zeros where ``sdpa`` gives arbitrary values; the
model ignores those positions either way.
"""

from __future__ import annotations

import torch

from ..api import attention
from ..bias import (
    AdditiveBias,
    AttentionBias,
    BlockDiagonalMask,
    LocalAttentionMask,
    LowerTriangularFromBottomRightMask,
)
from ..errors import NotSupportedError
from ..nn.multihead import BiasMemo, compose, key_padding_bias

NAME = "biasattn"


def register(name: str = NAME) -> str:
    """Register the biasattn attention (and its mask function) with transformers under ``name``; returns ``name``."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:  # pragma: no cover - exercised only without transformers
        raise ImportError("biasattn.integrations.transformers needs transformers: pip install -e \".[hf]\"") from e
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The mask function: the 2-D padding mask ``[B, S]`` (True = real token) for the last ``kv_length`` keys, or None.

    Causality, sliding windows and packing are decided in :func:`attention_forward` from the layer's
    own arguments, as for the flash-attention implementations.
    """
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:].bool()
    if not torch.compiler.is_compiling() and attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | AttentionBias | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function: q ``[B, H, L, D]``, k/v ``[B, Hkv, S, D]`` -> ``([B, L, H, D], None)``."""
    if softcap is not None:
        raise NotSupportedError("biasattn does not support attention logit soft-capping (softcap)")
    if kwargs.get("position_bias") is not None:
        raise NotSupportedError("biasattn's transformers integration does not take position_bias; use an AdditiveBias")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    B, L, S = query.shape[0], query.shape[2], key.shape[2]
    bias, kept = _layer_bias(query, attention_mask, kwargs, is_causal, sliding_window, B, L, S)
    if kept < S:  # a static cache: slots past the mask are unused
        key, value = key[:, :, :kept], value[:, :, :kept]
    out = attention(query, key, value, bias, scale=scaling, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


_SOURCES = ("cu_seq_lens_q", "cu_seq_lens_k", "position_ids")  # keyword tensors a bias is built from
_biases = BiasMemo()


def _layer_bias(query, attention_mask, kwargs: dict, is_causal: bool, sliding_window, B: int, L: int, S: int):
    """``(bias, keys kept)`` of one layer's call, built once per forward pass (:class:`BiasMemo`):
    every layer of a pass receives the same mask tensors."""
    sources = (attention_mask,) + tuple(kwargs.get(name) for name in _SOURCES)
    key = (B, L, S, is_causal, sliding_window, query.device, query.dtype)
    return _biases.get(sources, key, lambda: _build_bias(query, attention_mask, kwargs, is_causal, sliding_window, B, L, S))


def _build_bias(query, attention_mask, kwargs: dict, is_causal: bool, sliding_window, B: int, L: int, S: int):
    """``(bias, keys kept)`` from the layer's mask arguments (see the module docstring)."""
    parts: list[AttentionBias] = []

    packed = _packed_sequences(attention_mask, kwargs, B, L, S)
    if packed is not None:
        if sliding_window is not None:
            packed = packed.make_local_attention(sliding_window - 1)
        elif is_causal:
            packed = packed.make_causal_from_bottom_right()
        parts.append(packed)
    else:
        if isinstance(attention_mask, AttentionBias):
            parts.append(attention_mask)
        elif attention_mask is not None and attention_mask.dim() == 4:  # a prepared mask (bool: True = attend)
            m = attention_mask
            parts.append(AdditiveBias(m if m.dtype == torch.bool else m.to(query.dtype)))
        elif attention_mask is not None:  # the 2-D padding mask
            keep = attention_mask.bool()
            S = min(S, keep.shape[1])  # a static cache: slots past the mask are unused
            parts.append(key_padding_bias(keep))
        if sliding_window is not None:  # keeps the last `sliding_window` keys (both sides when not causal)
            parts.append(LocalAttentionMask(sliding_window - 1, 0 if is_causal else sliding_window - 1))
        elif is_causal:
            parts.append(LowerTriangularFromBottomRightMask())

    return compose(parts, query.device), S


def _packed_sequences(attention_mask, kwargs: dict, B: int, L: int, S: int) -> BlockDiagonalMask | None:
    """A block-diagonal mask when a batch of one packs several sequences (flash-attention kwargs or position_ids)."""
    if attention_mask is not None or B != 1:
        return None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        # as tensors: under torch.compile the mask keeps them unread, so new packings never retrace
        return BlockDiagonalMask.from_seqlens(cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1], device=cu_q.device)
    position_ids = kwargs.get("position_ids")
    if position_ids is None or L != S or L < 2 or torch.compiler.is_compiling():
        return None
    pos = position_ids.reshape(-1, position_ids.shape[-1])[0]
    if pos.shape[0] != L:
        return None
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    idx = starts.nonzero().flatten().tolist()
    if len(idx) <= 1:
        return None
    lengths = [b - a for a, b in zip(idx, idx[1:] + [L])]
    return BlockDiagonalMask.from_seqlens(lengths, device=pos.device)


__all__ = ["NAME", "attention_forward", "padding_mask", "register"]
