"""Scheduling for the Triton kernels: per-segment tile tables and block-layout tile lists.

Packed (block-diagonal) inputs are tiled per segment, so no tile straddles two sequences: the table
``[programs, 3]`` (int32) holds ``(first line, end line, segment)`` for every program. One launch
builds a spec's tables for the usual tile lengths on the device from the segments' tensors, without
reading a value, and the number of programs follows from shapes alone (lines, tile, number of
segments): a new set of lengths changes no grid. Lines that belong to no segment get programs with
segment ``-1``, which write zeros.

A block layout becomes, per (batch, head, program), the ascending list of kernel tiles along the
other axis that hold at least one visible layout block, computed on the device with torch ops
(2-D prefix sums of the layout, then a stable sort) and cached per layout tensor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...bias.spec import BiasSpec
from ...memo import BoundedCache
from ..common import int32_on


@functools.cache
def _table_kernel():
    """The table kernel's launcher, made on first use (this module's checks run without Triton)."""
    from .launch import direct
    from .schedule_kernels import _segment_table_kernel

    return direct(_segment_table_kernel)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


@dataclass(frozen=True)
class Schedule:
    """Programs along one axis of ``total`` lines in tiles of ``block``: the regular grid of ``n`` tiles
    (``table`` None), or the device table ``[n, 3]`` (int32) of packed segments, whose ``n`` follows
    from shapes alone (rows past the last tile are programs with no lines)."""

    n: int
    table: torch.Tensor | None
    total: int
    block: int


def table_rows(total: int, block: int, segments: int) -> int:
    """Rows of a segment table: every line in one tile, each of the ``segments`` segments and of
    the ``segments + 1`` runs of uncovered lines ending at most one partial tile."""
    return total // block + 2 * segments + 2


TABLE_BLOCK = 64  # segments each program of the table kernel places
# Tile lengths whose tables a spec's first table brings along, in the same launch: the forward's
# query tiles, dQ's and dK/dV's are among them, so a packed call makes one table launch, not three.
TABLE_BLOCKS = (64, 128)


def segment_tables(q_seqstart: torch.Tensor, k_seqstart: torch.Tensor, k_seqlen: torch.Tensor, Mq: int, Mk: int,
                   wanted: tuple[tuple[bool, int], ...]) -> tuple[Schedule, ...]:
    """The tile tables of packed segments, one per ``(along_keys, block)`` of ``wanted``, built in one
    launch on the device without reading a value. Along the queries, segment ``s`` holds the lines
    ``[q_seqstart[s], q_seqstart[s + 1])`` and its tiles are ordered by its key count; along the keys,
    ``[k_seqstart[s], k_seqstart[s] + k_seqlen[s])`` by its query count. Tiles of a segment with more
    work come first, later tiles first within it; see ``_segment_table_kernel``."""
    if not 0 < len(wanted) <= 6 or any(block <= 0 or block & (block - 1) for _, block in wanted):
        raise ValueError(f"wanted must hold 1 to 6 tables with power-of-two blocks, got {wanted}")
    S = k_seqlen.numel()
    rows = [table_rows(Mk if keys else Mq, block, S) for keys, block in wanted]
    tables = torch.empty((sum(rows), 3), dtype=torch.int32, device=q_seqstart.device).split(rows)
    along_keys = sum(1 << t for t, (keys, _) in enumerate(wanted) if keys)
    log_blocks = sum((block.bit_length() - 1) << (4 * t) for t, (_, block) in enumerate(wanted))
    _table_kernel().unrecorded(
        (cdiv(S + 1, TABLE_BLOCK), len(wanted)), tables[0], q_seqstart, k_seqstart, k_seqlen, S, Mq, Mk,
        along_keys, log_blocks, BLOCK=TABLE_BLOCK,
    )
    return tuple(Schedule(n, table, Mk if keys else Mq, block) for n, table, (keys, block) in zip(rows, tables, wanted))


@functools.lru_cache(maxsize=256)
def _regular(total: int, block: int) -> Schedule:
    return Schedule(cdiv(total, block), None, total, block)


def query_schedule(spec: BiasSpec, block_m: int, device) -> Schedule:
    """Query-tile programs: the regular grid, or per-segment tiles when the spec has segments (ordered by
    each segment's key count), built once per spec."""
    return _schedule(spec, False, block_m, device)


def key_schedule(spec: BiasSpec, block_n: int, device) -> Schedule:
    """Key-tile programs: the regular grid, or per-segment tiles when the spec has segments (ordered by
    each segment's query count), built once per spec."""
    return _schedule(spec, True, block_n, device)


def _schedule(spec: BiasSpec, along_keys: bool, block: int, device) -> Schedule:
    if spec.q_seqstart is None:
        return _regular(spec.Mk if along_keys else spec.Mq, block)
    made = spec.cached(("segment tables", str(device)), dict)
    sched = made.get((along_keys, block))
    if sched is None:  # this table, and both roles' tables of the usual tile lengths not made yet
        wanted = tuple((keys, b) for b in sorted({block, *TABLE_BLOCKS}) for keys in (False, True)
                       if (keys, b) not in made)
        made.update(zip(wanted, segment_tables(*(int32_on(t, device) for t in (
            spec.q_seqstart, spec.k_seqstart, spec.k_seqlen)), spec.Mq, spec.Mk, wanted)))
        sched = made[(along_keys, block)]
    return sched


def line_ranges(sched: Schedule, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, end)`` line of each program (int64, on ``device``)."""
    if sched.table is not None:
        return sched.table[:, 0].to(torch.int64), sched.table[:, 1].to(torch.int64)
    first = torch.arange(0, sched.n * sched.block, sched.block, dtype=torch.int64, device=device)
    return first, torch.clamp(first + sched.block, max=sched.total)


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
    """True when every (program, tile) pair lies inside one layout block (no element mask needed); never
    claimed for segment tables, whose lines only the device knows."""
    if sched.table is not None:
        return False
    return _layout_exact(spec.block_q, spec.block_k, spec.layout_q_off, spec.layout_k_off, spec.Mq, spec.Mk,
                         sched, block_other, along_keys)


@functools.lru_cache(maxsize=256)
def _layout_exact(bq, bk, qo, ko, Mq, Mk, sched: Schedule, block_other: int, along_keys: bool) -> bool:
    if along_keys:  # programs over queries, tiles over keys
        pb, po, tb, to, tlen = bq, qo, bk, ko, Mk
    else:
        pb, po, tb, to, tlen = bk, ko, bq, qo, Mq
    for a in range(0, sched.total, sched.block):
        e = min(a + sched.block, sched.total)
        if (a + po) // pb != (e - 1 + po) // pb:
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
        spec.Mq, spec.Mk, sched.n, sched.total, sched.block, id(sched.table), block_other, along_keys, str(device),
    )
    hit = _LIST_CACHE.get(key)
    if hit is not None and hit[0] is layout and hit[1] is sched.table:
        return hit[2]
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
    starts, ends = line_ranges(sched, device)
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
    _LIST_CACHE[key] = (layout, sched.table, result)
    return result
