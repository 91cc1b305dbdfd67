"""Host-side scheduling for the Triton kernels: per-segment tile tables and block-layout tile lists.

Packed (block-diagonal) inputs are tiled per segment, so no tile straddles two sequences: the table
``[programs, 3]`` (int32) holds ``(first line, end line, segment)`` for every program, built from
the spec's host copies (no device sync) and cached. Lines that belong to no segment get programs
with segment ``-1``, which write zeros.

A block layout becomes, per (batch, head, program), the ascending list of kernel tiles along the
other axis that hold at least one visible layout block, computed on the device with torch ops
(2-D prefix sums of the layout, then a stable sort) and cached per layout tensor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ...bias.atoms import to_device
from ...bias.spec import BiasSpec
from ...memo import BoundedCache


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


@dataclass(frozen=True)
class Schedule:
    """Programs along one axis: ``table`` (device int32 ``[n, 3]``) or None for the regular grid of ``n`` tiles."""

    n: int
    table: torch.Tensor | None
    starts: tuple[int, ...]
    ends: tuple[int, ...]


def _gaps(starts: np.ndarray, ends: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, ends)`` of the parts of ``[0, total)`` that no interval ``[starts[i], ends[i])`` covers."""
    keep = ends > starts
    order = np.argsort(starts[keep], kind="stable")
    a, b = starts[keep][order], ends[keep][order]
    covered = np.maximum.accumulate(b) if b.size else b  # the end of what is covered so far
    before = np.concatenate([[0], covered])  # covered up to interval i (and after the last one)
    gap_start = before
    gap_end = np.concatenate([a, [total]])
    kept = gap_end > gap_start
    return gap_start[kept], gap_end[kept]


def _segment_programs(starts: tuple[int, ...], ends: tuple[int, ...], total: int, block: int,
                      spans: tuple[int, ...]) -> np.ndarray:
    """``[programs, 3]`` int32: tiles ``(first, end, segment)`` of each segment's lines (segment ``-1``
    for the lines no segment covers); longest spans first, and within them later tiles first."""
    a = np.asarray(starts, dtype=np.int64)
    e = np.asarray(ends, dtype=np.int64)
    ga, ge = _gaps(a, e, total)
    piece_a = np.concatenate([a, ga])
    piece_e = np.concatenate([e, ge])
    seg = np.concatenate([np.arange(len(a)), np.full(len(ga), -1)])
    span = np.concatenate([np.asarray(spans, dtype=np.int64) if spans else np.zeros(len(a), np.int64),
                           np.full(len(ga), -1)])
    tiles = np.maximum(piece_e - piece_a + block - 1, 0) // block
    piece = np.repeat(np.arange(len(tiles)), tiles)
    offset = np.arange(piece.size) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    first = piece_a[piece] + offset * block
    table = np.stack([first, np.minimum(first + block, piece_e[piece]), seg[piece]], axis=1)
    order = np.lexsort((-first, -span[piece]))  # stable: descending (span, first)
    return table[order].astype(np.int32)


_SEGMENTED = BoundedCache(64)


def _segmented(key, make, device) -> Schedule:
    """The schedule of the programs ``make()`` returns, built and copied to ``device`` once per key (a bounded cache)."""
    k = (key, str(device))
    sched = _SEGMENTED.get(k)
    if sched is None:
        progs = make()
        table = to_device(torch.from_numpy(progs), device)
        sched = Schedule(len(progs), table, tuple(progs[:, 0].tolist()), tuple(progs[:, 1].tolist()))
        _SEGMENTED[k] = sched
    return sched


@functools.lru_cache(maxsize=256)
def _regular(total: int, block: int) -> Schedule:
    starts = tuple(range(0, total, block))
    return Schedule(cdiv(total, block), None, starts, tuple(min(a + block, total) for a in starts))


def query_schedule(spec: BiasSpec, block_m: int, device) -> Schedule:
    """Query-tile programs: the regular grid, or per-segment tiles when the spec has segments."""
    if spec.q_seqstart is None:
        return _regular(spec.Mq, block_m)
    h = spec.host
    qs = h.q_seqstart
    return _segmented(("q", qs, spec.Mq, block_m, h.k_seqlen),
                      lambda: _segment_programs(qs[:-1], qs[1:], spec.Mq, block_m, h.k_seqlen), device)


def key_schedule(spec: BiasSpec, block_n: int, device) -> Schedule:
    """Key-tile programs: the regular grid, or per-segment tiles when the spec has segments."""
    if spec.q_seqstart is None:
        return _regular(spec.Mk, block_n)
    h = spec.host
    qs, ks, kl = h.q_seqstart, h.k_seqstart, h.k_seqlen

    def make():
        starts = ks[: len(kl)]
        ends = tuple(a + n for a, n in zip(starts, kl))
        return _segment_programs(starts, ends, spec.Mk, block_n, tuple(b - a for a, b in zip(qs, qs[1:])))

    return _segmented(("k", ks, kl, qs, spec.Mk, block_n), make, device)


def segments_disjoint(spec: BiasSpec) -> bool:
    """True when the key segments are ordered and do not overlap (the backward kernels rely on it)."""
    return spec.cached("segments_disjoint", lambda: _segments_disjoint(spec))


def _segments_disjoint(spec: BiasSpec) -> bool:
    h = spec.host
    if h.k_seqstart is None:
        return True
    pos = 0
    for a, n in zip(h.k_seqstart, h.k_seqlen):
        if n == 0:
            continue
        if a < pos:
            return False
        pos = a + n
    return True


def layout_exact(spec: BiasSpec, sched: Schedule, block_other: int, along_keys: bool) -> bool:
    """True when every (program, tile) pair lies inside one layout block (no element mask needed)."""
    return _layout_exact(spec.block_q, spec.block_k, spec.layout_q_off, spec.layout_k_off, spec.Mq, spec.Mk,
                         sched, block_other, along_keys)


@functools.lru_cache(maxsize=256)
def _layout_exact(bq, bk, qo, ko, Mq, Mk, sched: Schedule, block_other: int, along_keys: bool) -> bool:
    if along_keys:  # programs over queries, tiles over keys
        pb, po, tb, to, tlen = bq, qo, bk, ko, Mk
    else:
        pb, po, tb, to, tlen = bk, ko, bq, qo, Mq
    for a, e in zip(sched.starts, sched.ends):
        if e > a and (a + po) // pb != (e - 1 + po) // pb:
            return False
    for a in range(0, tlen, block_other):
        e = min(a + block_other, tlen)
        if (a + to) // tb != (e - 1 + to) // tb:
            return False
    return True


_LIST_CACHE = BoundedCache(32)


def layout_tile_lists(spec: BiasSpec, sched: Schedule, block_other: int, along_keys: bool, device):
    """``(count [Bl, Hl, P] int32, index [Bl, Hl, P, T] int32)``: visible tiles of the other axis per program.

    ``along_keys``: programs are query tiles and the lists hold key tiles (forward, dq); otherwise
    programs are key tiles and the lists hold query tiles (dk/dv).
    """
    layout = spec.layout
    key = (
        id(layout), layout._version, layout.data_ptr(), spec.layout_q_off, spec.layout_k_off, spec.block_q, spec.block_k,
        spec.Mq, spec.Mk, sched.starts, sched.ends, block_other, along_keys, str(device),
    )
    hit = _LIST_CACHE.get(key)
    if hit is not None and hit[0] is layout:
        return hit[1]
    lay = layout.to(device=device, dtype=torch.int32)
    if along_keys:
        p_off, p_blk, o_off, o_blk, o_len = spec.layout_q_off, spec.block_q, spec.layout_k_off, spec.block_k, spec.Mk
    else:
        lay = lay.transpose(2, 3)
        p_off, p_blk, o_off, o_blk, o_len = spec.layout_k_off, spec.block_k, spec.layout_q_off, spec.block_q, spec.Mq
    Bl, Hl, R, C = lay.shape
    pre = torch.zeros((Bl, Hl, R + 1, C + 1), dtype=torch.int32, device=device)
    pre[:, :, 1:, 1:] = lay.cumsum(2).cumsum(3)
    i64 = dict(dtype=torch.int64, device=device)
    starts = to_device(sched.starts, device, torch.int64)
    ends = to_device(sched.ends, device, torch.int64)
    empty = ends <= starts
    r0 = ((starts + p_off) // p_blk).clamp(0, R)
    r1 = ((ends - 1 + p_off) // p_blk + 1).clamp(0, R)
    r1 = torch.where(empty, r0, r1)
    t0 = torch.arange(0, o_len, block_other, **i64)
    t1 = torch.clamp(t0 + block_other, max=o_len)
    c0 = ((t0 + o_off) // o_blk).clamp(0, C)
    c1 = ((t1 - 1 + o_off) // o_blk + 1).clamp(0, C)

    def at(r, c):  # pre[:, :, r[p], c[t]] -> [Bl, Hl, P, T]
        return pre[:, :, r][:, :, :, c]

    blocks = at(r1, c1) - at(r0, c1) - at(r1, c0) + at(r0, c0)
    visible = blocks > 0
    count = visible.sum(-1, dtype=torch.int32)
    index = torch.argsort((~visible).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    result = (count.contiguous(), index.contiguous())
    _LIST_CACHE[key] = (layout, result)
    return result
