"""Modules built on :func:`biasattn.attention`."""

from .multihead import MultiheadAttention, key_padding_bias, right_padding_lengths

__all__ = ["MultiheadAttention", "key_padding_bias", "right_padding_lengths"]
