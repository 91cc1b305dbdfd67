"""Modules built on :func:`biasattn.attention`."""

from .multihead import BiasMemo, MultiheadAttention, key_padding_bias, right_padding_lengths

__all__ = ["BiasMemo", "MultiheadAttention", "key_padding_bias", "right_padding_lengths"]
