"""The kernels' mask and bias arguments that reproduce a spec exactly, decided on its :class:`~.layout.SequenceLayout`.

- :func:`cutlass_mask_type`, :func:`flash_window`, :func:`cudnn_causal`: the kernel's mask argument
  that reproduces the spec's band exactly on every sequence, or None.
- :func:`alibi_matches`: whether the kernel's ALiBi alignment equals the spec's.
- :func:`aligned_bias`: the additive tensor with the kernel's alignment (a padded copy only if needed).
"""

from __future__ import annotations

import functools

import torch

from .layout import SequenceLayout, effective_band, round_up

NO_MASK, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = 0, 1, 2  # aten._efficient_attention_forward custom_mask_type


def _per_layout(fn):
    """Memoize ``fn(layout)`` on the layout: dispatch asks each question several times per call."""

    name = fn.__name__

    @functools.wraps(fn)
    def memoized(layout: SequenceLayout):
        return layout.cached(name, fn, layout)

    return memoized


def _matches(layout: SequenceLayout, kernel_band) -> bool:
    """True when ``kernel_band(seq) -> (lo, hi)`` equals every sequence's band on its rectangle."""
    for s in layout.seqs:
        if s.Lq == 0 or s.Lk == 0:
            continue
        lo, hi = kernel_band(s)
        if effective_band(lo, hi, s.Lq, s.Lk) != (s.lo, s.hi):
            return False
    return True


@_per_layout
def cutlass_mask_type(layout: SequenceLayout) -> int | None:
    """``custom_mask_type`` (0 none, 1 causal top-left, 2 causal bottom-right) matching the layout, or None."""
    for mask_type, band in (
        (NO_MASK, lambda s: (None, None)),
        (CAUSAL_TOP_LEFT, lambda s: (None, 0)),
        (CAUSAL_BOTTOM_RIGHT, lambda s: (None, s.Lk - s.Lq)),
    ):
        if _matches(layout, band):
            return mask_type
    return None


@_per_layout
def cudnn_causal(layout: SequenceLayout) -> bool | None:
    """``is_causal`` for cuDNN (top-left causal), or None when the band is neither none nor that."""
    if _matches(layout, lambda s: (None, None)):
        return False
    if _matches(layout, lambda s: (None, 0)):
        return True
    return None


@_per_layout
def flash_window(layout: SequenceLayout) -> tuple[int, int] | None:
    """``(window_size_left, window_size_right)`` for FlashAttention (-1 = unbounded), or None.

    FlashAttention keeps key ``j`` of row ``i`` when ``i + Lk - Lq - left <= j <= i + Lk - Lq + right``
    in each sequence; a window of at least ``max_k`` keys counts as unbounded.
    """
    max_k = layout.max_k
    result = []
    for side in ("left", "right"):
        exact: set[int] = set()
        floor = 0  # an exact value must be >= floor to stay harmless on unbounded sequences
        for s in layout.seqs:
            if s.Lq == 0 or s.Lk == 0:
                continue
            bound = s.lo if side == "left" else s.hi
            if bound is None:
                floor = max(floor, s.Lk - 1 if side == "left" else s.Lq - 1)
            else:
                w = (s.Lk - s.Lq) - bound if side == "left" else bound - (s.Lk - s.Lq)
                if w < 0:
                    return None
                exact.add(w)
        if not exact:
            result.append(-1)
            continue
        if len(exact) > 1:
            return None
        w = exact.pop()
        if w < floor or w >= max_k:  # would hide keys elsewhere, or the kernel would read it as unbounded
            return None
        result.append(w)
    left, right = result
    if left >= 0 and right < 0 and any(s.Lq > max_k + 1 for s in layout.seqs if s.Lk):
        # With a left window, the kernel reads an unbounded right one as ``max_k`` keys, which hides
        # keys from the first rows of a sequence with more than ``max_k + 1`` queries.
        return None
    return left, right


def alibi_matches(layout: SequenceLayout) -> bool:
    """True when each sequence's ALiBi shift is the kernels' bottom-right one, ``Lk - Lq``."""
    return all(s.alibi_shift == s.Lk - s.Lq for s in layout.seqs if s.Lq and s.Lk)


# --------------------------------------------------------------------------------------- tensors
def bias_is_aligned(t: torch.Tensor, Mk: int, dtype: torch.dtype, align: int = 8) -> bool:
    """True when ``t`` (4-D) can be handed to the kernels as is: dtype, contiguous last dim of size
    ``Mk``, strides of dims 0-2 multiples of ``align`` elements (or of size 1), 16-byte aligned start."""
    if t.dtype != dtype or t.dim() != 4 or t.shape[-1] != Mk or (Mk > 1 and t.stride(-1) != 1):
        return False
    if any(t.shape[d] > 1 and t.stride(d) % align for d in range(3)):
        return False
    return t.data_ptr() % (align * t.element_size()) == 0


def aligned_bias(t: torch.Tensor, shape: tuple[int, int, int, int], dtype: torch.dtype, align: int = 8) -> torch.Tensor:
    """``t`` (4-D, broadcastable to ``shape = [B, H, Mq, Mk]``) as an aligned ``[B, H, Mq, Mk]`` view.

    Copies only when :func:`bias_is_aligned` fails: into a buffer whose last dim is padded to a
    multiple of ``align``, keeping broadcast dims of size 1 (expanded with stride 0, never copied).
    """
    Mk = shape[3]
    if not bias_is_aligned(t, Mk, dtype, align):
        lead = tuple(t.shape[:3])
        buf = torch.empty((*lead, round_up(Mk, align)), dtype=dtype, device=t.device)[..., :Mk]
        buf.copy_(t.expand(*lead, Mk))
        t = buf
    return t.expand(shape)
