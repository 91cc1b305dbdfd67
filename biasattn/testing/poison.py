"""Poison: fill memory that a correct operator must write (or must never read) with NaN.

A kernel that skips a write leaves NaN in its output; a kernel that reads padding it should not
read turns NaN into its result. Both fail :func:`~biasattn.testing.assert_close_to_reference`
instead of passing by luck on zero-initialized memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with NaN (floating tensors) or the dtype's maximum (integer tensors); returns ``t``."""
    with torch.no_grad():
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        else:
            t.fill_(torch.iinfo(t.dtype).max)
    return t


def poison_padding_(x: torch.Tensor, kv_seqlens) -> torch.Tensor:
    """Set ``x[b, :, j]`` to NaN for every key ``j >= kv_seqlens[b]`` (``x``: ``[B, H, Mk, ...]``), in place.

    Use it on k and v with a :class:`~biasattn.PaddedKeysMask` for operators that promise never to
    read padded keys.
    """
    lengths = kv_seqlens.tolist() if isinstance(kv_seqlens, torch.Tensor) else list(kv_seqlens)
    if len(lengths) == 1:
        lengths = lengths * x.shape[0]
    with torch.no_grad():
        for b, n in enumerate(lengths):
            x[b, :, int(n) :] = float("nan")
    return x


def poison_hidden_lines(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias):
    """Copies of ``q``, ``k``, ``v`` with NaN in every query row that ``attn_bias`` hides from all keys
    and every key it hides from all query rows (of every query head sharing the key's KV head).

    Pass the part of a bias whose hidden lines may hold anything, such as a
    :class:`~biasattn.PaddedKeysMask` or a :class:`~biasattn.BlockDiagonalMask`: operators keep
    those lines out of every result. Keys that a band or a causal mask hides are ordinary data.
    """
    from .reference import dense_bias

    B, Hq, Mq, _ = q.shape
    Hkv, Mk = k.shape[1], k.shape[2]
    seen = ~torch.isneginf(dense_bias(attn_bias, (B, Hq, Mq, Mk), torch.float32, q.device))
    rows = seen.any(-1)[..., None]  # [B, Hq, Mq, 1]
    keys = seen.unflatten(1, (Hkv, Hq // Hkv)).any(2).any(-2)[..., None]  # [B, Hkv, Mk, 1]
    nan = float("nan")
    with torch.no_grad():
        return q.masked_fill(~rows, nan), k.masked_fill(~keys, nan), v.masked_fill(~keys, nan)


def visibility(attn_bias, shape, device=None) -> torch.Tensor:
    """Bool ``[B, H, Mq, Mk]`` (``shape``): True where ``attn_bias`` shows key ``j`` to query row ``i``.

    A position is hidden where a mask hides it or an additive term is -inf; an additive NaN at a
    position no mask hides counts as visible.
    """
    from .reference import dense_bias

    if attn_bias is None:
        return torch.ones(tuple(shape), dtype=torch.bool, device=device)
    return ~torch.isneginf(dense_bias(attn_bias, tuple(shape), torch.float32, device))


def poison_key_(x: torch.Tensor, b: int, h: int, j: int, value: float = float("nan")) -> torch.Tensor:
    """Set every entry of ``x[b, h, j]`` (a key or value row, ``x: [B, H, Mk, D]``) to ``value``, in place; returns ``x``.

    Pair it with :func:`visibility`: the rows that do not see key ``j`` must come out as without it.
    """
    with torch.no_grad():
        x[b, h, j] = value
    return x


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Inside the block, ``torch.empty`` and ``torch.empty_like`` return NaN-filled floating tensors.

    Wrap an operator call in it to catch outputs (or workspaces) that a kernel never writes:
    ``with poisoned_allocations(): out = ba.attention(q, k, v, bias, op="triton")``.
    """
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned_empty(*args, **kwargs):
        return _poison_float(empty(*args, **kwargs))

    def poisoned_empty_like(*args, **kwargs):
        return _poison_float(empty_like(*args, **kwargs))

    torch.empty, torch.empty_like = poisoned_empty, poisoned_empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def _poison_float(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() and t.numel():
        with torch.no_grad():
            t.fill_(float("nan"))
    return t
