"""The spec's meaning on one tile, in plain PyTorch, and host-side ranges of visible keys.

``tile_bias`` evaluates a :class:`~biasattn.bias.spec.BiasSpec` on rows ``[i0, i1)`` and columns
``[j0, j1)``; ``key_range`` bounds the keys a block of query rows can see (and ``query_range`` the
rows that see any key), from host metadata only (no device sync), so that operators skip hidden key
blocks. ``visible_matmul`` is ``p @ v`` in which
the keys hidden from a row take no part in that row, whatever their values hold (no ``0 · NaN``).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import replace

import torch

from ..bias.spec import BiasSpec


def _unmasked(spec: BiasSpec) -> BiasSpec:
    """The spec without its mask fields (segments, padded keys, band, layout)."""
    none = dict.fromkeys(("q_seqstart", "k_seqstart", "k_seqlen", "kv_seqlens", "band_lo", "band_hi", "layout"))
    return replace(spec, **none)


def _segment_rows(spec: BiasSpec, i0: int, i1: int):
    """Yield ``(s, r0, r1)``: segment ``s`` owns rows ``[r0, r1)`` of the row block ``[i0, i1)``."""
    qs = spec.host.q_seqstart
    s = max(bisect_right(qs, i0) - 1, 0)
    while s < len(qs) - 1 and qs[s] < i1:
        r0, r1 = max(qs[s], i0), min(qs[s + 1], i1)
        if r0 < r1:
            yield s, r0, r1
        s += 1


def key_range(spec: BiasSpec, i0: int, i1: int) -> tuple[int, int]:
    """``[j_lo, j_hi)`` containing every key visible to some row in ``[i0, i1)`` (may be empty)."""
    h = spec.host
    if spec.q_seqstart is not None and h.q_seqstart is None:
        return (0, spec.Mk)  # lengths only the device holds: any key may be visible
    lo_all, hi_all = spec.Mk, 0

    def band(s: int) -> tuple[int, int]:
        if h.band_lo is None:
            return (-(2**31), 2**31)
        k = 0 if len(h.band_lo) == 1 else s
        return h.band_lo[k], h.band_hi[k]

    if spec.q_seqstart is not None:
        for s, r0, r1 in _segment_rows(spec, i0, i1):
            lo_d, hi_d = band(s)
            lo = max(h.k_seqstart[s], r0 + lo_d, 0)
            hi = min(h.k_seqstart[s] + h.k_seqlen[s], r1 - 1 + hi_d + 1, spec.Mk)
            if lo < hi:
                lo_all, hi_all = min(lo_all, lo), max(hi_all, hi)
    else:
        lo_d, hi_d = band(0)
        lo_all = max(0, i0 + lo_d)
        hi_all = min(spec.Mk, i1 - 1 + hi_d + 1)
        if h.kv_seqlens is not None:
            hi_all = min(hi_all, max(h.kv_seqlens, default=0))
    return (lo_all, hi_all) if lo_all < hi_all else (0, 0)


def query_range(spec: BiasSpec) -> tuple[int, int]:
    """``[i_lo, i_hi)`` containing every query row that may see some key (may be empty): the rows of
    segments with keys, within reach of their band, and of a band's reach into ``[0, Mk)``."""
    h = spec.host
    if spec.q_seqstart is not None and h.q_seqstart is None or spec.kv_seqlens is not None and h.kv_seqlens is None:
        return (0, spec.Mq)  # lengths only the device holds
    if spec.band_lo is not None and h.band_lo is None:
        return (0, spec.Mq)
    unbounded = (-(2**31), 2**31)
    band = (lambda s: (h.band_lo[0 if len(h.band_lo) == 1 else s], h.band_hi[0 if len(h.band_hi) == 1 else s])) \
        if h.band_lo is not None else (lambda s: unbounded)
    if spec.q_seqstart is not None:
        spans = [(h.q_seqstart[s], h.q_seqstart[s + 1], h.k_seqstart[s], h.k_seqstart[s] + h.k_seqlen[s], *band(s))
                 for s in range(len(h.k_seqlen))]
    else:
        keys = min(spec.Mk, max(h.kv_seqlens)) if h.kv_seqlens is not None else spec.Mk
        spans = [(0, spec.Mq, 0, keys, *band(0))]
    lo_all, hi_all = spec.Mq, 0
    for r0, r1, k0, k1, lo_d, hi_d in spans:  # row i sees key j of [k0, k1) when lo_d <= j - i <= hi_d
        lo, hi = max(r0, k0 - hi_d, 0), min(r1, k1 - 1 - lo_d + 1, spec.Mq)
        if k0 < k1 and lo < hi:
            lo_all, hi_all = min(lo_all, lo), max(hi_all, hi)
    return (lo_all, hi_all) if lo_all < hi_all else (0, 0)


def layout_allows(spec: BiasSpec, i0: int, i1: int, j0: int, j1: int) -> bool:
    """False when the block layout hides the whole tile for every batch row and head."""
    if spec.host.layout is None:
        return True
    qb0 = (i0 + spec.layout_q_off) // spec.block_q
    qb1 = (i1 - 1 + spec.layout_q_off) // spec.block_q + 1
    kb0 = (j0 + spec.layout_k_off) // spec.block_k
    kb1 = (j1 - 1 + spec.layout_k_off) // spec.block_k + 1
    return bool(spec.host.layout[:, :, qb0:qb1, kb0:kb1].any())


def tile_fully_visible(spec: BiasSpec, i0: int, i1: int, j0: int, j1: int) -> bool:
    """True when no mask of the spec hides any element of the tile, for every batch row and head.

    Decided from host metadata only; such tiles need no mask (``tile_bias(..., masks=False)``).
    """
    h = spec.host
    s = 0
    if spec.q_seqstart is not None:
        segs = list(_segment_rows(spec, i0, i1))
        if len(segs) != 1 or segs[0][1:] != (i0, i1):
            return False
        s = segs[0][0]
        if j0 < h.k_seqstart[s] or j1 > h.k_seqstart[s] + h.k_seqlen[s]:
            return False
    if h.band_lo is not None:
        k = 0 if len(h.band_lo) == 1 else s
        if j0 - (i1 - 1) < h.band_lo[k] or (j1 - 1) - i0 > h.band_hi[k]:
            return False
    if spec.kv_seqlens is not None and (h.kv_seqlens is None or j1 > min(h.kv_seqlens, default=0)):
        return False
    if h.layout is not None:
        qb0 = (i0 + spec.layout_q_off) // spec.block_q
        qb1 = (i1 - 1 + spec.layout_q_off) // spec.block_q + 1
        kb0 = (j0 + spec.layout_k_off) // spec.block_k
        kb1 = (j1 - 1 + spec.layout_k_off) // spec.block_k + 1
        if not bool(h.layout[:, :, qb0:qb1, kb0:kb1].all()):
            return False
    return True


def tile_bias(
    spec: BiasSpec, i0: int, i1: int, j0: int, j1: int, dtype: torch.dtype, device, *, masks: bool = True
) -> torch.Tensor | None:
    """Additive bias ``[B or 1, H or 1, i1-i0, j1-j0]`` of the tile (0 / -inf / values), or None if all zero.

    ``masks=False`` leaves the masks out (for tiles that :func:`tile_fully_visible` cleared).
    """
    if not masks:
        if spec.additive is None and spec.alibi_slopes is None:
            return None
        spec = _unmasked(spec)
    i = torch.arange(i0, i1, device=device)[:, None]
    j = torch.arange(j0, j1, device=device)[None, :]
    visible = None

    def both(a, b):
        return b if a is None else a & b

    if spec.q_seqstart is not None:
        qs = spec.q_seqstart.to(device=device, dtype=torch.int64)
        seg = torch.searchsorted(qs, i[:, 0].contiguous(), right=True) - 1
        nseg = qs.numel() - 1
        inside = (seg >= 0) & (seg < nseg)
        seg = seg.clamp(0, max(nseg - 1, 0))
        ks = spec.k_seqstart.to(device=device, dtype=torch.int64)[seg][:, None]
        kl = spec.k_seqlen.to(device=device, dtype=torch.int64)[seg][:, None]
        visible = inside[:, None] & (j >= ks) & (j < ks + kl)
    else:
        seg = None
    if spec.band_lo is not None:
        lo = spec.band_lo.to(device=device, dtype=torch.int64)
        hi = spec.band_hi.to(device=device, dtype=torch.int64)
        if lo.numel() > 1:
            lo, hi = lo[seg][:, None], hi[seg][:, None]
        d = j - i
        visible = both(visible, (d >= lo) & (d <= hi))
    if visible is not None:
        visible = visible[None, None]
    if spec.kv_seqlens is not None:
        lens = spec.kv_seqlens.to(device=device, dtype=torch.int64)[:, None, None, None]
        visible = both(visible, j[None, None] < lens)
    if spec.layout is not None:
        rows = (i[:, 0] + spec.layout_q_off) // spec.block_q
        cols = (j[0] + spec.layout_k_off) // spec.block_k
        layout = spec.layout.to(device)
        visible = both(visible, layout[:, :, rows][:, :, :, cols])
    out = None
    if spec.additive is not None:
        a = spec.additive
        a = a[:, :, i0:i1] if a.shape[2] != 1 else a
        a = a[:, :, :, j0:j1] if a.shape[3] != 1 else a
        out = a.to(dtype)
    if visible is not None:  # where, not + -inf: an additive NaN or +inf at a hidden position stays hidden
        out = torch.where(visible, 0.0 if out is None else out, float("-inf")).to(dtype)
    if spec.alibi_slopes is not None:
        dist = (j - i - spec.alibi_shift).abs().to(dtype)
        al = -spec.alibi_slopes.to(device=device, dtype=dtype)[:, :, None, None] * dist
        out = al if out is None else out + al
    return out


def visible_matmul(p: torch.Tensor, visible: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``Σ_j p[..., i, j] · v[..., j, :]`` over the keys ``j`` that ``visible`` (bool, broadcastable to ``p``) shows row ``i``.

    ``p: [..., M, N]`` non-negative weights, zero wherever ``visible`` is False; ``v: [..., N, Dv]``.
    A plain ``p @ v`` turns a NaN or ±inf in a hidden key's value into NaN (``0 · NaN``); here hidden
    keys take no part, and the visible ones give what IEEE arithmetic gives (``p · inf = inf`` for
    ``p > 0``, NaN for ``p = 0`` or opposite infinities). Finite values go through one matmul (and
    carry the gradient); non-finite ones are located by four matmuls of 0/1 flags, with no device sync.
    """
    finite = torch.isfinite(v)
    out = p @ torch.where(finite, v, 0.0)
    flags = p.dtype if p.dtype in (torch.float32, torch.float64) else torch.float32
    seen = visible.expand(p.shape).to(flags)
    pos = (visible & (p.detach() > 0)).to(flags)

    def any_of(a: torch.Tensor, hit: torch.Tensor) -> torch.Tensor:
        return (a @ hit.to(flags)) > 0

    up, down = any_of(pos, torch.isposinf(v)), any_of(pos, torch.isneginf(v))
    nan = any_of(seen, torch.isnan(v)) | any_of(seen - pos, torch.isinf(v)) | (up & down)
    out = torch.where(up, float("inf"), out)
    out = torch.where(down, float("-inf"), out)
    return torch.where(nan, float("nan"), out)
