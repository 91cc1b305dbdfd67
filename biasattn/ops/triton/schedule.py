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


def _chunks(start: int, end: int, block: int, seg: int) -> list[tuple[int, int, int]]:
    return [(a, min(a + block, end), seg) for a in range(start, end, block)]


def _gaps(intervals: list[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    """Parts of ``[0, total)`` covered by none of the (sorted, disjoint) intervals."""
    out, pos = [], 0
    for a, b in sorted(intervals):
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < total:
        out.append((pos, total))
    return out


@functools.lru_cache(maxsize=64)
def _segment_programs(starts: tuple[int, ...], ends: tuple[int, ...], total: int, block: int,
                      spans: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """Tiles of each segment's lines and of the uncovered lines; longest segments first, later tiles first."""
    progs, order = [], []
    for s, (a, b) in enumerate(zip(starts, ends)):
        for p in _chunks(a, b, block, s):
            progs.append(p)
            order.append((spans[s] if spans else 0, p[0]))
    for a, b in _gaps([(a, b) for a, b in zip(starts, ends) if b > a], total):
        for p in _chunks(a, b, block, -1):
            progs.append(p)
            order.append((-1, p[0]))
    idx = sorted(range(len(progs)), key=lambda n: order[n], reverse=True)
    return tuple(progs[n] for n in idx)


_SEGMENTED = BoundedCache(64)


def _segmented(key, progs, device) -> Schedule:
    """The schedule of ``progs``, its table copied to ``device`` once per key (a bounded cache)."""
    k = (key, str(device))
    sched = _SEGMENTED.get(k)
    if sched is None:
        table = to_device(progs, device, torch.int32).reshape(-1, 3)
        sched = Schedule(len(progs), table, tuple(p[0] for p in progs), tuple(p[1] for p in progs))
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
    progs = _segment_programs(tuple(qs[:-1]), tuple(qs[1:]), spec.Mq, block_m, tuple(h.k_seqlen))
    return _segmented(("q", qs, spec.Mq, block_m, h.k_seqlen), progs, device)


def key_schedule(spec: BiasSpec, block_n: int, device) -> Schedule:
    """Key-tile programs: the regular grid, or per-segment tiles when the spec has segments."""
    if spec.q_seqstart is None:
        return _regular(spec.Mk, block_n)
    h = spec.host
    qs, ks, kl = h.q_seqstart, h.k_seqstart, h.k_seqlen
    ends = tuple(a + n for a, n in zip(ks, kl))
    progs = _segment_programs(tuple(ks), ends, spec.Mk, block_n, tuple(b - a for a, b in zip(qs, qs[1:])))
    return _segmented(("k", ks, kl, qs, spec.Mk, block_n), progs, device)


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
