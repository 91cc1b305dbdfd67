"""The forward at head dims 128 and 256 on Hopper, warp-specialized in Gluon: no bias, causal masks, windows,
padded keys and packed documents.

``triton.language`` cannot split a kernel into producer and consumer warps; Gluon
(``triton.experimental.gluon``, shipped with Triton) can. In this kernel one loader warp feeds Q and
a ring of K/V stages through TMA copies and mbarriers: three of 128 keys at D=128, two of 64 keys at
D=256 (:data:`TILES`), where a stage's K is refilled as soon as its score products ran, before its V
(``docs/design.md``, "D=256 forward on Hopper"). Two consumer warpgroups each
take a 64-row half of a 128-row query tile and take turns issuing their warpgroup MMAs. Each issues
the scores of key tile j before the value product of tile j-1, and runs the softmax of tile j while
that product runs (``docs/design.md``, "Forwards at D=128 on Hopper: warp-specialized in Gluon").

Every mask it takes is an interval of keys per query row (``klo <= j < khi``), as in the
``triton.language`` kernels: a program visits the key tiles of its rows' span only, and masks the
scores of the span's edge tiles. Rows whose output is not finite (a NaN or inf in a value that the
row cannot see, read with the tile) get a NaN lse, and the ``triton`` forward's exact pass computes
them again.

:func:`eligible` says which tensors it takes: fp16/bf16, D = Dv = 128 or 256, contiguous ``[B, H, M, D]``
tensors; the caller checks the device (sm_90), the bias (no bias, or only segments, key lengths and a
band), dropout (none) and size (the ``gluon_min_scores`` option: smaller calls run faster on the
``triton.language`` kernels). This module is imported on the first such call only.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .common_kernels import _chunked_ids
from .launch import direct
from .tma import qualified_descriptor

ROWS = 64  # query rows of each consumer warpgroup
BLOCK_M = 2 * ROWS  # query rows of a program
TILES = {128: (128, 3), 256: (64, 2)}  # head dim: (keys per tile, K/V tiles in flight), the most that fit in shared memory
CONSUMER_REGS = 240  # registers per consumer thread (the loader warp takes 24)
BIG = gl.constexpr(2**30)  # "unbounded" in band terms


@gluon.constexpr_function
def _mma_layout(cols):
    """The layout of a warpgroup MMA's result of ``cols`` columns (four warps, 16-row steps)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])


@gluon.jit
def _load(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bars, k_ready, v_ready, k_free, v_free, row_q, row_k,
          n_tiles, tiles, LISTED: gl.constexpr):
    """The loader partition: both halves of the query tile, then the span's K/V tiles (from key row
    ``row_k``, or with ``LISTED`` the key tiles of the program's list ``tiles`` from the head's first key row
    ``row_k``) into the ring, a stage's K refilled once both consumers' scores read it and its V once both
    value products did."""
    HALF: gl.constexpr = q_desc.block_type.shape[0]
    TILE: gl.constexpr = k_desc.block_type.shape[0]
    RING: gl.constexpr = k_bufs.type.shape[0]
    for h in gl.static_range(2):
        qb = q_bars.index(h)
        mbarrier.expect(qb, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row_q + h * HALF, 0], qb, q_smem.index(h))
    for j in range(n_tiles):
        s = j % RING
        if LISTED:
            key = row_k + gl.load(tiles + j) * TILE
        else:
            key = row_k + j * TILE
        mbarrier.wait(k_free.index(s), ((j // RING) & 1) ^ 1)
        kr = k_ready.index(s)
        mbarrier.expect(kr, k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [key, 0], kr, k_bufs.index(s))
        mbarrier.wait(v_free.index(s), ((j // RING) & 1) ^ 1)
        vr = v_ready.index(s)
        mbarrier.expect(vr, v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [key, 0], vr, v_bufs.index(s))


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, row_o: gl.constexpr, GUARD: gl.constexpr):
    """Online softmax of one score tile: ``(p, new row max, new row sum, rescale of the output rows)``;
    ``GUARD`` where a row may have seen nothing yet (keeps exp2 away from inf - inf)."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    if GUARD:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = gl.exp2(s * qk_scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, gl.convert_layout(alpha, row_o)


@gluon.jit
def _mask(s, col0, klo, khi, s_layout: gl.constexpr):
    """Scores outside their row's keys ``[klo, khi)`` hidden; the tile's keys from ``col0``."""
    cols = col0 + gl.arange(0, s.type.shape[1], layout=gl.SliceLayout(0, s_layout))
    return gl.where((cols[None, :] >= klo[:, None]) & (cols[None, :] < khi[:, None]), s, float("-inf"))


@gluon.jit
def _masked_tile(j, a, e, MASKED: gl.constexpr):
    """Whether tile ``j`` of the span needs an element mask: outside ``[a, e)``, the tiles every row sees whole."""
    if MASKED:
        edge = (j < a) | (j >= e)
    else:
        edge = False
    return edge


@gluon.jit
def _attend(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, qk_scale, my_turn, their_turn, span, klo, khi,
            MASKED: gl.constexpr):
    """One consumer's rows against the key tiles of the span ``(first key, tiles, a, e)``: ``(out, row max,
    row sum)``, out normalized (0 where a row saw no key). With ``MASKED``, tiles outside ``[a, e)`` hide
    the scores outside each row's keys ``[klo, khi)``."""
    HALF: gl.constexpr = q_smem.type.shape[0]
    TILE: gl.constexpr = k_bufs.type.shape[1]
    HEAD_DIM: gl.constexpr = k_bufs.type.shape[2]
    RING: gl.constexpr = k_bufs.type.shape[0]
    EARLY_K: gl.constexpr = RING < 3  # K's stage freed after its score product (the value product frees V's)
    s_layout: gl.constexpr = _mma_layout(TILE)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype
    lo, n_tiles, a, e = span
    m_i = gl.full([HALF], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.full([HALF], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([HALF, HEAD_DIM], gl.float32, layout=o_layout)
    zero_s = gl.zeros([HALF, TILE], gl.float32, layout=s_layout)
    mbarrier.wait(k_ready.index(0), 0)
    mbarrier.wait(my_turn, 0)
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.arrive(their_turn, count=1)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    if EARLY_K:
        mbarrier.arrive(k_free.index(0), count=1)
    if _masked_tile(0, a, e, MASKED):
        s = _mask(s, lo, klo, khi, s_layout)
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, row_o, MASKED)
    for j in range(1, n_tiles):
        st = j % RING
        prev = (j - 1) % RING
        mbarrier.wait(k_ready.index(st), (j // RING) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // RING) & 1)
        mbarrier.wait(my_turn, j & 1)
        s = warpgroup_mma(q_smem, k_bufs.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_bufs.index(prev), acc, is_async=True)
        mbarrier.arrive(their_turn, count=1)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        if EARLY_K:
            mbarrier.arrive(k_free.index(st), count=1)
        if _masked_tile(j, a, e, MASKED):
            s = _mask(s, lo + j * TILE, klo, khi, s_layout)
        p, m_new, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, row_o, MASKED)
        m_i = m_new
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(v_free.index(prev), count=1)
        if not EARLY_K:
            mbarrier.arrive(k_free.index(prev), count=1)
        acc = acc * alpha[:, None]
    last = (n_tiles - 1) % RING
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // RING) & 1)
    mbarrier.wait(my_turn, n_tiles & 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_bufs.index(last), acc, is_async=True)
    mbarrier.arrive(their_turn, count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    l_o = gl.convert_layout(l_i, row_o)
    if MASKED:
        l_o = gl.where(l_o > 0, l_o, 1.0)  # a row that saw no key: out 0 (its lse is set apart below)
    return acc / l_o[:, None], gl.convert_layout(m_i, row_o), gl.convert_layout(l_i, row_o)


@gluon.jit
def _write(out, m_o, l_o, o_desc, o_buf, Out, Lse, row, n_rows):
    """Store one consumer's rows ``[row, row + n_rows)`` of the flat ``[rows, D]`` output: ``out`` through
    TMA for a whole half, element stores for a partial one (the next rows are another program's), and
    the natural-log lse: -inf for a row that saw no key, NaN for a row whose output holds a NaN or inf
    (the exact pass of the ``triton`` forward computes such rows again)."""
    HALF: gl.constexpr = o_buf.type.shape[0]
    HEAD_DIM: gl.constexpr = o_buf.type.shape[1]
    lse = gl.where(l_o > 0, (m_o + gl.log2(l_o)) * 0.6931471805599453, float("-inf"))
    lse = gl.where(gl.abs(gl.sum(out, 1)) < float("inf"), lse, float("nan"))
    rows = gl.arange(0, HALF, layout=m_o.type.layout)
    if n_rows == HALF:
        o_buf.store(out.to(o_buf.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [row, 0], o_buf)
        gl.store(Lse + row + rows, lse)
        tma.store_wait(0)
    else:
        dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out.type.layout))
        ptrs = Out + (row + rows).to(gl.int64)[:, None] * HEAD_DIM + dims[None, :]
        gl.store(ptrs, out.to(Out.dtype.element_ty), mask=(rows < n_rows)[:, None])
        gl.store(Lse + row + rows, lse, mask=rows < n_rows)


@gluon.jit
def _unseen(HALF: gl.constexpr, HEAD_DIM: gl.constexpr):
    """``(out, row max, row sum)`` of rows that saw no key, in :func:`_attend`'s layouts."""
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    return (gl.zeros([HALF, HEAD_DIM], gl.float32, layout=o_layout), gl.full([HALF], float("-inf"), gl.float32, row_o),
            gl.zeros([HALF], gl.float32, layout=row_o))


@gluon.jit
def _consume(q_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Out, Lse, prog, qk_scale, MASKED: gl.constexpr,
             PART: gl.constexpr, LISTED: gl.constexpr = False):
    """Consumer ``PART`` (0 or 1): its half of the query tile, written out through its query buffer, free
    once its last score product has run. With ``LISTED`` the key tiles are those of the program's list, each
    seen whole by every row, and an empty list writes rows that saw no key."""
    q_bars, k_ready, v_ready, k_free, v_free, turns = bars
    row_q, row_k, m0, m_end, lo, n_tiles, a, e, tiles, seg_lo, seg_hi, band_lo, band_hi = prog
    HALF: gl.constexpr = q_desc.block_type.shape[0]
    TILE: gl.constexpr = k_bufs.type.shape[1]
    s_layout: gl.constexpr = _mma_layout(TILE)
    rows = m0 + PART * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    klo = gl.maximum(rows + band_lo, seg_lo)
    khi = gl.minimum(rows + band_hi + 1, seg_hi)
    mbarrier.wait(q_bars.index(PART), 0)
    if LISTED:
        if n_tiles > 0:
            out, m_o, l_o = _attend(q_smem.index(PART), k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, qk_scale,
                                    turns.index(PART), turns.index(1 - PART), (lo, n_tiles, a, e), klo, khi, False)
        else:
            out, m_o, l_o = _unseen(HALF, k_bufs.type.shape[2])
    else:
        out, m_o, l_o = _attend(q_smem.index(PART), k_bufs, v_bufs, k_ready, v_ready, k_free, v_free, qk_scale,
                                turns.index(PART), turns.index(1 - PART), (lo, n_tiles, a, e), klo, khi, MASKED)
    n_rows = gl.minimum(gl.maximum(m_end - m0 - PART * HALF, 0), HALF)
    _write(out, m_o, l_o, o_desc, q_smem.index(PART), Out, Lse, row_q + PART * HALF, n_rows)


# The partitions: worker partitions take the same arguments and no constexpr, so each variant and half has its own.
@gluon.jit
def _first(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Out, Lse, prog, qk_scale):
    _consume(q_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Out, Lse, prog, qk_scale, False, 0)


@gluon.jit
def _second(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Out, Lse, prog, qk_scale):
    _consume(q_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Out, Lse, prog, qk_scale, False, 1)


@gluon.jit
def _first_masked(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Out, Lse, prog, qk_scale):
    _consume(q_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Out, Lse, prog, qk_scale, True, 0)


@gluon.jit
def _second_masked(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Out, Lse, prog, qk_scale):
    _consume(q_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Out, Lse, prog, qk_scale, True, 1)


@gluon.jit
def _first_listed(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Out, Lse, prog, qk_scale):
    _consume(q_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Out, Lse, prog, qk_scale, False, 0, True)


@gluon.jit
def _second_listed(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Out, Lse, prog, qk_scale):
    _consume(q_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Out, Lse, prog, qk_scale, False, 1, True)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Out, Lse, prog, qk_scale):
    q_bars, k_ready, v_ready, k_free, v_free, turns = bars
    row_q, row_k, m0, m_end, lo, n_tiles, a, e, tiles, seg_lo, seg_hi, band_lo, band_hi = prog
    _load(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bars, k_ready, v_ready, k_free, v_free, row_q,
          row_k + lo, n_tiles, tiles, False)


@gluon.jit
def _loader_listed(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Out, Lse, prog, qk_scale):
    q_bars, k_ready, v_ready, k_free, v_free, turns = bars
    row_q, row_k, m0, m_end, lo, n_tiles, a, e, tiles, seg_lo, seg_hi, band_lo, band_hi = prog
    _load(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bars, k_ready, v_ready, k_free, v_free, row_q,
          row_k, n_tiles, tiles, True)


@gluon.jit
def _query_tile(pid, Sched, n_prog, Mq, SCHEDULED: gl.constexpr, BLOCK: gl.constexpr):
    """``(first row, end row, segment)`` of tile program ``pid``: the packed segments' table, or the regular
    tiles from the last (the heaviest under a causal mask) to the first."""
    if SCHEDULED:
        m0 = gl.load(Sched + pid * 3)
        m_end = gl.load(Sched + pid * 3 + 1)
        seg = gl.load(Sched + pid * 3 + 2)
    else:
        m0 = (n_prog - 1 - pid) * BLOCK
        m_end = gl.minimum(m0 + BLOCK, Mq)
        seg = 0
    return m0, m_end, seg


@gluon.jit
def _key_bounds(seg, b, Mk, KSeqStart, KSeqLen, KvLens, BandLo, BandHi, HAS_SEGMENTS: gl.constexpr,
                HAS_PADDED: gl.constexpr, HAS_BAND: gl.constexpr, BAND_PER_SEGMENT: gl.constexpr):
    """``(seg_lo, seg_hi, band_lo, band_hi)``: row ``i`` of the program sees the keys
    ``[max(seg_lo, i + band_lo), min(seg_hi, i + band_hi + 1))``."""
    seg_lo = gl.to_tensor(0)
    seg_hi = gl.to_tensor(Mk)
    if HAS_SEGMENTS:
        s = gl.maximum(seg, 0)
        ks = gl.load(KSeqStart + s)
        seg_lo = gl.where(seg >= 0, ks, 0)
        seg_hi = gl.where(seg >= 0, ks + gl.load(KSeqLen + s), 0)
    if HAS_PADDED:
        seg_hi = gl.minimum(seg_hi, gl.load(KvLens + b))
    band_lo = gl.to_tensor(-BIG)
    band_hi = gl.to_tensor(BIG)
    if HAS_BAND:
        if BAND_PER_SEGMENT:
            bi = gl.maximum(seg, 0)
        else:
            bi = 0
        band_lo = gl.load(BandLo + bi)
        band_hi = gl.load(BandHi + bi)
    return seg_lo, seg_hi, band_lo, band_hi


@gluon.jit
def _whole_tiles(lo, n, full_lo, full_hi, inside, TILE: gl.constexpr):
    """``(a, e)``: of ``n`` tiles of ``TILE`` lines from line ``lo``, tiles ``[a, e)`` lie within lines
    ``[full_lo, full_hi)`` (``a = e`` where none does, and ``a = e = n`` unless ``inside``)."""
    a = gl.where(inside, gl.minimum(gl.cdiv(gl.maximum(full_lo - lo, 0), TILE), n), n)
    e = gl.minimum(gl.maximum(gl.maximum(full_hi - lo, 0) // TILE, a), n)
    return a, e


@gluon.jit
def _span(m0, m_end, bounds, Mk, MASKED: gl.constexpr, TILE: gl.constexpr):
    """``(first key, tiles, a, e)`` of the key span of rows ``[m0, m_end)``: tiles ``[a, e)`` are seen whole
    by every row, the others need element masks. A program whose rows see no key gets one masked tile
    (its rows then write 0 and an lse of -inf).

    A row's first and end keys never decrease from one row to the next, so the span follows from the
    first and last rows that see a key, in scalars: no reduction over the rows."""
    if MASKED:
        seg_lo, seg_hi, band_lo, band_hi = bounds
        first = gl.maximum(m0, seg_lo - band_hi)  # the rows that see a key: [first, last]
        last = gl.minimum(m_end, seg_hi - band_lo) - 1
        seen = (first <= last) & (band_lo <= band_hi) & (seg_lo < seg_hi)
        lo = gl.maximum(first + band_lo, seg_lo) // 16 * 16
        hi = gl.minimum(last + band_hi + 1, seg_hi)
        n = gl.where(seen, gl.cdiv(gl.maximum(hi - lo, 0), TILE), 0)
        full_lo = gl.maximum(m_end - 1 + band_lo, seg_lo)  # keys every row sees: [full_lo, full_hi)
        full_hi = gl.minimum(m0 + band_hi + 1, seg_hi)
        a, e = _whole_tiles(lo, n, full_lo, full_hi, True, TILE)
        lo = gl.where(n > 0, lo, 0)
        n = gl.maximum(n, 1)
    else:
        lo = gl.to_tensor(0)
        n = gl.to_tensor(Mk // TILE)
        a = gl.to_tensor(0)
        e = n
    return lo, n, a, e


@gluon.jit
def _attn_fwd_ws_kernel(q_desc, k_desc, v_desc, o_desc, Out, Lse, Sched, KSeqStart, KSeqLen, KvLens, BandLo, BandHi,
                        TileCount, TileIdx, stride_cb, stride_ch, stride_tb, stride_th, stride_tp,
                        H, G, Mq, Mk, n_prog, chunk, qk_scale, RING: gl.constexpr, REGS: gl.constexpr,
                        MASKED: gl.constexpr, SCHEDULED: gl.constexpr, HAS_SEGMENTS: gl.constexpr,
                        HAS_PADDED: gl.constexpr, HAS_BAND: gl.constexpr, BAND_PER_SEGMENT: gl.constexpr,
                        LISTED: gl.constexpr, TAIL_ORDER: gl.constexpr):
    """Grid ``(query tiles, B * H)``, the last ``chunk`` pairs started rank by rank with ``TAIL_ORDER``
    (``common_kernels._chunked_ids``). Q/out are ``[B·H·Mq, D]`` views and K/V ``[B·Hkv·Mk, D]`` (``G`` query
    heads per KV head); writes out (``Out`` the same memory as ``o_desc``) and ``Lse [B·H·Mq]``. Without
    ``MASKED``, Mq is a multiple of 128, Mk of the key tile, and every row sees every key, or with ``LISTED``
    every key of the program's listed key tiles (``TileCount [Bl, Hl, programs]`` and ``TileIdx [Bl, Hl,
    programs, tiles]``, strides ``stride_c*`` and ``stride_t*``, of a block layout whose blocks hold whole
    tiles)."""
    HALF: gl.constexpr = q_desc.block_type.shape[0]
    TILE: gl.constexpr = k_desc.block_type.shape[0]
    pid, bh = _chunked_ids(gl.program_id(0), gl.program_id(1), n_prog, gl.num_programs(1), chunk, TAIL_ORDER)
    b = bh // H
    m0, m_end, seg = _query_tile(pid, Sched, n_prog, Mq, SCHEDULED, 2 * HALF)
    bounds = _key_bounds(seg, b, Mk, KSeqStart, KSeqLen, KvLens, BandLo, BandHi, HAS_SEGMENTS, HAS_PADDED, HAS_BAND,
                         BAND_PER_SEGMENT)
    lo, n_tiles, a, e = _span(m0, m_end, bounds, Mk, MASKED, TILE)
    tiles = TileIdx
    if LISTED:  # the lists are by query tile, which programs take from the last
        h = bh % H
        i = m0 // (2 * HALF)
        tiles = TileIdx + b.to(gl.int64) * stride_tb + h.to(gl.int64) * stride_th + i.to(gl.int64) * stride_tp
        n_tiles = gl.load(TileCount + b * stride_cb + h * stride_ch + i)
        e = n_tiles
    row_q = bh * Mq + m0
    row_k = (b * (H // G) + (bh % H) // G) * Mk
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [RING] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [RING] + k_desc.block_type.shape, k_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(turns.index(i), count=1)
    mbarrier.arrive(turns.index(0), count=1)  # the first half issues first
    for i in gl.static_range(RING):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_free.index(i), count=2)
        mbarrier.init(v_free.index(i), count=2)
    bars = (q_bars, k_ready, v_ready, k_free, v_free, turns)
    seg_lo, seg_hi, band_lo, band_hi = bounds
    prog = (row_q, row_k, m0, m_end, lo, n_tiles, a, e, tiles, seg_lo, seg_hi, band_lo, band_hi)
    args = (q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Out, Lse, prog, qk_scale)
    if LISTED:
        gl.warp_specialize([(_first_listed, args), (_second_listed, args), (_loader_listed, args)], [4, 1],
                           [REGS, 24])
    elif MASKED:
        gl.warp_specialize([(_first_masked, args), (_second_masked, args), (_loader, args)], [4, 1], [REGS, 24])
    else:
        gl.warp_specialize([(_first, args), (_second, args), (_loader, args)], [4, 1], [REGS, 24])


_launch_fwd = direct(_attn_fwd_ws_kernel)  # repeated launches skip Triton's binding


@functools.cache
def shared_layout(block: tuple[int, ...], dtype: torch.dtype, swizzled: bool = True) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a TMA box ``block`` of ``dtype``, swizzled for the tensor cores or not (rows of
    lse); made once per box, since it costs more host time than the descriptor around it."""
    if not swizzled:
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * dtype.itemsize, rank=len(block))
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gdt)


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether this kernel can run a forward on these tensors (see the module doc; the caller checks the
    device, the bias, dropout and the size)."""
    B, H, Mq, D = q.shape
    Mk = k.shape[2]
    if D not in TILES or k.shape[3] != D or v.shape[3] != D or min(Mq, Mk) == 0:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if not all(t.is_contiguous() for t in (q, k, v, out)) or B * H * Mq >= 2**31 or B * k.shape[1] * Mk >= 2**31:
        return False
    return all(t.data_ptr() % 16 == 0 for t in (q, k, v, out))


def descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> tuple:
    """The TMA descriptors of Q, K, V and the output that :func:`attn_fwd` launches with, rows of all heads in one
    ``[B·H·M, D]`` view: built per call, they are roles of a launch plan."""
    D = q.shape[3]
    block_n, _ = TILES[D]
    half, tile = shared_layout((ROWS, D), q.dtype), shared_layout((block_n, D), q.dtype)
    descs = []
    for t, block, layout in ((q, ROWS, half), (k, block_n, tile), (v, block_n, tile), (out, ROWS, half)):
        descs.append(qualified_descriptor(TensorDescriptor, t, [t.numel() // D, D], [D, 1], [block, D], layout=layout))
    return tuple(descs)


def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, qk_scale: float,
             n_prog: int, table: torch.Tensor, bounds: tuple, switches: dict, descs: tuple, chunk: int = 1,
             lists: tuple | None = None) -> bool:
    """Write ``out [B, H, Mq, D]`` (contiguous) and ``lse [B, H, Mq]`` (float32, natural log; NaN where a
    row's output is not finite) of an :func:`eligible` call; ``qk_scale`` is the softmax scale times
    log2(e). ``n_prog`` query tiles of :data:`BLOCK_M` rows, ``table`` their rows when packed (the launch switch
    ``SCHEDULED``); ``bounds`` the int32 tensors ``(k_seqstart, k_seqlen, kv_seqlens, band_lo, band_hi)``
    and ``switches`` the ``SCHEDULED``, ``HAS_*`` and ``BAND_PER_SEGMENT`` flags of the bias; ``descs`` those of
    :func:`descriptors`; the last ``chunk`` (batch, head) pairs start their tiles rank by rank
    (``flash.program_chunk``); ``lists`` ``(count, index, count strides (b, h), index strides (b, h, program))``
    the key tiles each program reads (a block layout's, :func:`.schedule.layout_tile_lists`), every key of them
    seen by every row, the layout the call's only mask. Returns whether the launch masked scores (then rows may
    carry a NaN lse for the exact pass)."""
    B, H, Mq, D = q.shape
    Mk = k.shape[2]
    block_n, stages = TILES[D]
    masked = any(switches.values()) or Mq % BLOCK_M != 0 or Mk % block_n != 0
    if lists is not None and masked:
        raise ValueError("a listed forward takes no other mask, Mq a multiple of 128 and Mk of the key tile")
    count, index, cs, ts = lists if lists is not None else (table, table, (0, 0), (0, 0, 0))
    _launch_fwd[(n_prog, B * H)](
        *descs, out, lse, table, *bounds, count, index, *cs, *ts, H, H // k.shape[1], Mq, Mk, n_prog, chunk, qk_scale,
        stages, CONSUMER_REGS, masked, **switches, LISTED=lists is not None, TAIL_ORDER=chunk > 1, num_warps=4,
    )
    return masked
