"""The backward at head dims 64, 128 and 256 on Hopper, warp-specialized in Gluon: no bias, causal masks, windows,
padded keys and packed documents, MHA and GQA. At head dim 256 the warpgroups share the work otherwise (``_consume_wide``,
described where it is defined); the rest of this text describes head dims 64 and 128.

A program owns 128 keys of one KV head and walks the 64-row query tiles that see them, for every
query head of the group. A loader warp brings the program's K and V once, then Q, dO, lse and
delta tile by tile through a ring of two stages (TMA copies and mbarriers). Two consumer warpgroups each
own 64 of the keys. Per tile each computes ``S^T = K Q^T`` and ``dP^T = V dO^T``, then ``P^T`` and
``dS^T``, and accumulates ``dV += P^T dO`` and ``dK += dS^T Q`` in registers. dQ takes no extra
matmul of S: each warpgroup stores its half of ``dS^T`` in shared memory, and once both halves are
there each computes half the columns of ``dS K`` over the 128 keys in one product and adds them to a
float32 dQ in global memory by TMA reductions (``cp.reduce.async.bulk``) of 32 columns each. It does so one
tile late, so the two warpgroups rarely wait for each other (``docs/design.md``, "Backwards at D=128 on
Hopper: dQ by TMA reductions").

The reductions add in whatever order the programs reach a tile, so dQ may differ in its last bits
from one run to the next; the caller keeps deterministic runs on the ``triton.language`` kernels.

Masks are intervals of keys per query row, as in the forward (:mod:`.gluon_forward`): a program
walks only the query tiles whose rows see some of its keys, and masks ``P`` only on the tiles at the
edges of that range. Packed documents are tiled per document along the keys (the table of
:func:`.schedule.key_schedule`), so a program's keys belong to one document and its rows to that
document's queries; its query tiles stay on the 64-row grid, rows of the neighbouring documents masked.
A key or value that a row cannot see reaches none of its gradients, whatever it
holds (NaN in an uninitialized cache): ``dS`` is 0 where ``P`` is, and K's rows past a key length and
its non-finite elements are zeroed in shared memory once, so that ``dS K`` takes no ``0 · NaN``.
Tiles past the end of a head read zeros and write nothing: the descriptors are per head
(``[B·H, M, D]``).

:func:`eligible` says which tensors it takes: fp16/bf16, D = Dv = 64, 128 or 256, contiguous ``[B, H, M, D]``
tensors. This module is imported on the first call that may use it.
"""

from __future__ import annotations

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

from .common_kernels import LOG2E, _chunked_ids
from .gluon_forward import _key_bounds, _mma_layout, _whole_tiles, shared_layout
from .launch import direct
from .tma import qualified_descriptor

ROWS = 64  # query rows per tile
HALF = 64  # keys per consumer warpgroup
DQ_COLS = 32  # columns of one dQ reduction: 128 bytes of float32, one swizzled TMA box
RING = 2  # Q/dO tiles in flight
CONSUMER_REGS = {False: 240, True: 232}  # registers per consumer thread, unmasked and masked (the loader takes 24)
_ROWS, _HALF, _DQ_COLS, _RING = (gl.constexpr(x) for x in (ROWS, HALF, DQ_COLS, RING))  # in kernels

if hasattr(tma, "async_atomic_add"):  # newer Triton names the TMA reduction
    _tma_add = tma.async_atomic_add
else:
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin

    @builtin
    def _tma_add(tensor_desc, coord, src, _semantic=None):
        """Add the shared tile ``src`` into global memory at ``coord`` through a TMA reduction."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)


@gluon.jit
def _load(k_desc, v_desc, q_desc, do_desc, l_desc, d_desc, k_smem, v_smem, q_bufs, do_bufs, l_bufs, d_bufs, kv_bar,
          ready, empty, prog, LISTED: gl.constexpr):
    bh_k, bh_q, n0, n_end, lo, n_tiles, n_head, a, e, tiles, row_lo, n_rows, key_lo, key_hi, band_lo, band_hi = prog
    KEYS: gl.constexpr = k_desc.block_type.shape[1]  # keys of one half
    mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
    for h in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [bh_k, n0 + h * KEYS, 0], kv_bar, k_smem.index(h))
        tma.async_copy_global_to_shared(v_desc, [bh_k, n0 + h * KEYS, 0], kv_bar, v_smem.index(h))
    for t in range(n_tiles):
        s = t % _RING
        mbarrier.wait(empty.index(s), ((t // _RING) & 1) ^ 1)
        rb = ready.index(s)
        mbarrier.expect(rb, 2 * q_desc.block_type.nbytes + 2 * l_desc.block_type.nbytes)
        bh, m0 = bh_q + t // n_head, _tile_row(t % n_head, lo, tiles, LISTED)
        tma.async_copy_global_to_shared(q_desc, [bh, m0, 0], rb, q_bufs.index(s))
        tma.async_copy_global_to_shared(do_desc, [bh, m0, 0], rb, do_bufs.index(s))
        tma.async_copy_global_to_shared(l_desc, [bh, m0], rb, l_bufs.index(s))
        tma.async_copy_global_to_shared(d_desc, [bh, m0], rb, d_bufs.index(s))


@gluon.jit
def _clean_keys(buf, k0, key_lo, key_hi):
    """A ``[1, keys, D]`` shared K tile (keys from ``k0``) with the rows outside ``[key_lo, key_hi)`` and every
    non-finite element set to zero, so that ``dS K`` (where ``dS`` is 0 for keys a row cannot see) takes no
    ``0 · NaN``. The scores of rows that see a non-finite key are NaN anyway: their lse is NaN."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [1, 4, 1], [2, 1, 0])
    x = buf.load(layout)
    keys = k0 + gl.arange(0, buf.type.shape[1], layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    keep = ((keys >= key_lo) & (keys < key_hi))[None, :, None] & (x == x) & (gl.abs(x) < float("inf"))
    buf.store(gl.where(keep, x, 0.0).to(x.dtype))


@gluon.jit
def _flat(buf):
    """A ``[1, rows, cols]`` shared tile (a per-head TMA box) as ``[rows, cols]``."""
    return buf.reshape([buf.type.shape[1], buf.type.shape[2]])


@gluon.jit
def _tile_row(i, lo, tiles, LISTED: gl.constexpr):
    """First row of a head's query tile ``i``: ``lo + 64 i``, or with ``LISTED`` the ``i``-th of the program's
    list of 64-row tiles (a block layout's visible tiles, :func:`.schedule.layout_tile_lists`)."""
    if LISTED:
        return gl.load(tiles + i) * _ROWS
    return lo + i * _ROWS


@gluon.jit
def _ring_tile(t, ready, q_bufs, do_bufs, bh_q, lo, n_head, tiles, LISTED: gl.constexpr):
    """A consumer's tile ``t`` once the loader has brought it: ``(ring stage, Q, dO, query tile of its head,
    query head, first row)``."""
    s = t % _RING
    mbarrier.wait(ready.index(s), (t // _RING) & 1)
    q = _flat(q_bufs.index(s))
    do = _flat(do_bufs.index(s))
    i = t % n_head
    return s, q, do, i, bh_q + t // n_head, _tile_row(i, lo, tiles, LISTED)


@gluon.jit
def _dq_part(ds_smem, k_smem, dq_smem, dq_desc, buf, bh, m0, zero_q, sm_scale, PART: gl.constexpr):
    """Add columns ``[D/2 PART, +D/2)`` of ``dS K`` of the tile whose ``dS^T`` halves are in ``buf``, in one
    product, staged whole and added by 32-column reductions: at D=128 in this warpgroup's one buffer (whose
    reductions were issued a tile earlier), at D=64 in one of two that alternate by tile."""
    D: gl.constexpr = k_smem.type.shape[3]
    W: gl.constexpr = D // 2
    col: gl.constexpr = PART * W
    dq = warpgroup_mma(ds_smem.index(2 * buf).permute((1, 0)), _flat(k_smem.index(0)).slice(col, W, dim=1),
                       zero_q, use_acc=False, is_async=True)
    dq = warpgroup_mma(ds_smem.index(2 * buf + 1).permute((1, 0)), _flat(k_smem.index(1)).slice(col, W, dim=1), dq,
                       is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
    if D == 128:
        tma.store_wait(0)  # the reductions that last read this buffer are done
        gl.thread_barrier()
        out = dq_smem.index(PART)
    else:
        tma.store_wait(1)  # the reduction that last read this buffer, two tiles back, is done
        gl.thread_barrier()
        out = dq_smem.index(2 * PART + buf)
    _flat(out).store(dq * sm_scale)
    fence_async_shared()
    gl.thread_barrier()
    for c in gl.static_range(W // _DQ_COLS):
        _tma_add(dq_desc, [bh, m0, col + c * _DQ_COLS], out.slice(c * _DQ_COLS, _DQ_COLS, dim=2))


@gluon.jit
def _store_tile(desc, buf, x, bh, row):
    """Write ``x`` (``[rows, D]`` registers) to rows ``[row, +rows)`` of head ``bh`` of ``desc`` through the shared
    ``[1, rows, D]`` buffer ``buf``: one TMA store, whose rows past the head's end are dropped."""
    _flat(buf).store(x)
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(desc, [bh, row, 0], buf)


@gluon.jit
def _rows_in(rows, row_lo, n_rows, Mq, DOCUMENTS: gl.constexpr):
    """Which ``rows`` are the program's: ``[row_lo, row_lo + n_rows)`` (one unsigned compare) with ``DOCUMENTS``,
    else those before ``Mq``."""
    if DOCUMENTS:
        return (rows - row_lo).to(gl.uint32) < n_rows
    return rows < Mq


@gluon.jit
def _consume(k_smem, v_smem, q_bufs, do_bufs, l_bufs, d_bufs, ds_smem, dq_smem, bars, dq_desc, DK, DV, prog, qk_scale,
             sm_scale, Mq, Mk, MASKED: gl.constexpr, PART: gl.constexpr, DOCUMENTS: gl.constexpr,
             LISTED: gl.constexpr):
    kv_bar, ready, empty, ds_bar = bars
    bh_k, bh_q, n0, n_end, lo, n_tiles, n_head, a, e, tiles, row_lo, n_rows, key_lo, key_hi, band_lo, band_hi = prog
    D: gl.constexpr = k_smem.type.shape[3]
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = _mma_layout(_ROWS)
    o_layout: gl.constexpr = _mma_layout(D)
    q_layout: gl.constexpr = _mma_layout(D // 2)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    k_w = k_smem.index(PART)
    v_w = v_smem.index(PART)
    k0 = n0 + PART * _HALF
    zero_s = gl.zeros([_HALF, _ROWS], gl.float32, layout=s_layout)
    zero_q = gl.zeros([_ROWS, D // 2], gl.float32, layout=q_layout)
    dv = gl.zeros([_HALF, D], gl.float32, layout=o_layout)
    dk = gl.zeros([_HALF, D], gl.float32, layout=o_layout)
    mbarrier.wait(kv_bar, 0)
    if MASKED:  # a key some rows cannot see may hold anything, NaN included (an uninitialized cache)
        _clean_keys(k_w, k0, key_lo, key_hi)
        fence_async_shared()
        gl.thread_barrier()
    k_w = _flat(k_w)
    v_w = _flat(v_w)
    bh_prev = bh_q
    m_prev = lo
    for t in range(n_tiles):
        s, q, do, i, bh, m0 = _ring_tile(t, ready, q_bufs, do_bufs, bh_q, lo, n_head, tiles, LISTED)
        st = warpgroup_mma(k_w, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_w, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
        # lse is read in natural log and scaled here: so scheduled, the unmasked loop runs 15% faster
        lse = l_bufs.index(s).reshape([_ROWS]).load(col_s) * LOG2E
        pt = gl.exp2(st * qk_scale - lse[None, :])
        if MASKED:
            if (i < a) | (i >= e):
                keys = k0 + gl.arange(0, _HALF, layout=row_s)
                rows = m0 + gl.arange(0, _ROWS, layout=col_s)
                d = keys[:, None] - rows[None, :]
                vis = (d >= band_lo) & (d <= band_hi) & (keys >= key_lo)[:, None] & (keys < key_hi)[:, None]
                pt = gl.where(vis & _rows_in(rows, row_lo, n_rows, Mq, DOCUMENTS)[None, :], pt, 0.0)
        dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt,))
        delta = d_bufs.index(s).reshape([_ROWS]).load(col_s)
        ds = pt * (dpt - delta[None, :])
        if MASKED:  # where P is 0 (a key the row cannot see), dP may be NaN from a hidden value: dS is 0
            ds = gl.where(pt != 0.0, ds, 0.0)
        ds = ds.to(dtype)
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do, dv, is_async=True)
        dk = warpgroup_mma(gl.convert_layout(ds, a_layout), q, dk, is_async=True)
        prev = (t + 1) % 2  # dQ of the previous tile, whose dS^T halves are both stored by now
        if t > 0:
            mbarrier.wait(ds_bar.index(prev), ((t - 1) // 2) & 1)
            _dq_part(ds_smem, k_smem, dq_smem, dq_desc, prev, bh_prev, m_prev, zero_q, sm_scale, PART)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        mbarrier.arrive(empty.index(s), count=1)
        ds_smem.index(2 * (t % 2) + PART).store(ds)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ds_bar.index(t % 2), count=1)
        bh_prev = bh
        m_prev = m0
    dk_out = (dk * sm_scale).to(dtype)
    dv_out = dv.to(dtype)
    if n_tiles > 0:
        mbarrier.wait(ds_bar.index((n_tiles - 1) % 2), ((n_tiles - 1) // 2) & 1)
        _dq_part(ds_smem, k_smem, dq_smem, dq_desc, (n_tiles - 1) % 2, bh_prev, m_prev, zero_q, sm_scale, PART)
    if not DOCUMENTS:  # staged in the ring, whose stages are free once both warpgroups are past the last tile's dS^T
        _store_tile(DK, q_bufs.index(PART), dk_out, bh_k, k0)
        _store_tile(DV, do_bufs.index(PART), dv_out, bh_k, k0)
    tma.store_wait(0)
    if DOCUMENTS:  # the program's keys end at its document's: the rows past it are the next program's
        dims = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        keys_o = k0 + gl.arange(0, _HALF, layout=gl.SliceLayout(1, o_layout))
        offs = (bh_k.to(gl.int64) * Mk + keys_o)[:, None] * D + dims[None, :]
        keep = (keys_o < n_end)[:, None]
        gl.store(DK + offs, dk_out, mask=keep)
        gl.store(DV + offs, dv_out, mask=keep)


# Head dim 256: dK and dV of 64 keys by 256 dims do not fit in one warpgroup's registers. A program owns 64 keys;
# each warpgroup computes the scores and dP of 32 of them for the tile's 64 rows, stores its halves of P and dS
# in shared memory, and, once both halves are there, accumulates dV and dK for 128 of the 256 dims and adds
# the same 128 columns of dS K into dQ. No product is computed twice.
WIDE_KEYS = 32  # keys of each warpgroup's scores at head dim 256 (the program owns 64)
WIDE_REGS = 240


@gluon.jit
def _dq_wide(ds_own, ds_smem, k_smem, dq_smem, dq_desc, bh, m0, zero_q, sm_scale, PART: gl.constexpr,
             C: gl.constexpr):
    """Add columns ``[128 PART + 32 C, +32)`` of ``dS K`` into dQ, staged in this warpgroup's buffer: dS of the
    warpgroup's own 32 keys from its registers (``ds_own``), of the other 32 from ``ds_smem`` (the tile's
    ``[rows, 64 keys]``); the two 32-key halves of K in ``k_smem``."""
    D: gl.constexpr = k_smem.type.shape[3]
    KEYS: gl.constexpr = k_smem.type.shape[2]
    col: gl.constexpr = PART * (D // 2) + C * _DQ_COLS
    if PART == 0:  # keys in order: [0, 32) then [32, 64)
        dq = warpgroup_mma(ds_own, _flat(k_smem.index(0)).slice(col, _DQ_COLS, dim=1), zero_q, use_acc=False,
                           is_async=True)
        dq = warpgroup_mma(ds_smem.slice(KEYS, KEYS, dim=1), _flat(k_smem.index(1)).slice(col, _DQ_COLS, dim=1), dq,
                           is_async=True)
    else:
        dq = warpgroup_mma(ds_smem.slice(0, KEYS, dim=1), _flat(k_smem.index(0)).slice(col, _DQ_COLS, dim=1),
                           zero_q, use_acc=False, is_async=True)
        dq = warpgroup_mma(ds_own, _flat(k_smem.index(1)).slice(col, _DQ_COLS, dim=1), dq, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
    tma.store_wait(0)  # the reduction that last read this buffer is done
    gl.thread_barrier()
    out = dq_smem.index(PART)
    _flat(out).store(dq * sm_scale)
    fence_async_shared()
    gl.thread_barrier()
    _tma_add(dq_desc, [bh, m0, col], out)


@gluon.jit
def _consume_wide(k_smem, v_smem, q_bufs, do_bufs, l_bufs, d_bufs, p_smem, ds_smem, dq_smem, bars, dq_desc, DK, DV,
                  prog, qk_scale, sm_scale, Mq, Mk, MASKED: gl.constexpr, PART: gl.constexpr,
                  DOCUMENTS: gl.constexpr, LISTED: gl.constexpr):
    """Warpgroup ``PART`` of the head-dim-256 backward (see above): scores of keys ``[32 PART, +32)``, then dV,
    dK and dQ for dims ``[128 PART, +128)``."""
    kv_bar, ready, empty, full, free = bars
    bh_k, bh_q, n0, n_end, lo, n_tiles, n_head, a, e, tiles, row_lo, n_rows, key_lo, key_hi, band_lo, band_hi = prog
    D: gl.constexpr = k_smem.type.shape[3]
    DH: gl.constexpr = D // 2
    KEYS: gl.constexpr = k_smem.type.shape[2]
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = _mma_layout(KEYS)
    o_layout: gl.constexpr = _mma_layout(DH)
    q_layout: gl.constexpr = _mma_layout(_DQ_COLS)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=q_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    k0 = n0 + PART * KEYS
    zero_s = gl.zeros([_ROWS, KEYS], gl.float32, layout=s_layout)
    zero_q = gl.zeros([_ROWS, _DQ_COLS], gl.float32, layout=q_layout)
    dv = gl.zeros([2 * KEYS, DH], gl.float32, layout=o_layout)
    dk = gl.zeros([2 * KEYS, DH], gl.float32, layout=o_layout)
    mbarrier.wait(kv_bar, 0)
    if MASKED:  # a key some rows cannot see may hold anything, NaN included (an uninitialized cache)
        _clean_keys(k_smem.index(PART), k0, key_lo, key_hi)
        fence_async_shared()
        gl.thread_barrier()
    k_w = _flat(k_smem.index(PART))
    v_w = _flat(v_smem.index(PART))
    for t in range(n_tiles):
        s, q, do, i, bh, m0 = _ring_tile(t, ready, q_bufs, do_bufs, bh_q, lo, n_head, tiles, LISTED)
        sc = warpgroup_mma(q, k_w.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma(do, v_w.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc,))
        lse = l_bufs.index(s).reshape([_ROWS]).load(row_s) * LOG2E
        p = gl.exp2(sc * qk_scale - lse[:, None])
        if MASKED:
            if (i < a) | (i >= e):
                keys = k0 + gl.arange(0, KEYS, layout=col_s)
                rows = m0 + gl.arange(0, _ROWS, layout=row_s)
                d = keys[None, :] - rows[:, None]
                vis = (d >= band_lo) & (d <= band_hi) & (keys >= key_lo)[None, :] & (keys < key_hi)[None, :]
                p = gl.where(vis & _rows_in(rows, row_lo, n_rows, Mq, DOCUMENTS)[:, None], p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        delta = d_bufs.index(s).reshape([_ROWS]).load(row_s)
        ds = p * (dp - delta[:, None])
        if MASKED:  # where P is 0 (a key the row cannot see), dP may be NaN from a hidden value: dS is 0
            ds = gl.where(p != 0.0, ds, 0.0)
        if t > 0:  # both warpgroups are done with the previous tile's P and dS
            mbarrier.wait(free, (t - 1) & 1)
        p_smem.slice(PART * KEYS, KEYS, dim=1).store(p.to(dtype))
        ds_own = gl.convert_layout(ds.to(dtype), a_layout)  # dQ's products over this warpgroup's keys read it here
        ds_smem.slice(PART * KEYS, KEYS, dim=1).store(ds.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(full, count=1)
        mbarrier.wait(full, t & 1)
        dv = warpgroup_mma(p_smem.permute((1, 0)), do.slice(PART * DH, DH, dim=1), dv, is_async=True)
        dk = warpgroup_mma(ds_smem.permute((1, 0)), q.slice(PART * DH, DH, dim=1), dk, is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        mbarrier.arrive(empty.index(s), count=1)
        for c in gl.static_range(DH // _DQ_COLS):
            _dq_wide(ds_own, ds_smem, k_smem, dq_smem, dq_desc, bh, m0, zero_q, sm_scale, PART, c)
        mbarrier.arrive(free, count=1)
    tma.store_wait(0)
    dims = PART * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))
    keys_o = n0 + gl.arange(0, 2 * KEYS, layout=gl.SliceLayout(1, o_layout))
    offs = (bh_k.to(gl.int64) * Mk + keys_o)[:, None] * D + dims[None, :]
    keep = (keys_o < (n_end if DOCUMENTS else Mk))[:, None]
    gl.store(DK + offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=keep)
    gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=keep)


@gluon.jit
def _consumer(smem, bars, dq_desc, DK, DV, prog, qk_scale, sm_scale, Mq, Mk, MASKED: gl.constexpr, PART: gl.constexpr,
              DOCUMENTS: gl.constexpr = False, LISTED: gl.constexpr = False):
    """Warpgroup ``PART``: :func:`_consume_wide` at head dim 256, :func:`_consume` below; ``DOCUMENTS`` when the
    program's keys and rows are those of one packed document (its row of the segments' table), ``LISTED`` when
    it walks a list of query tiles (a block layout's)."""
    if smem[0].type.shape[3] == 256:
        _consume_wide(*smem, bars, dq_desc, DK, DV, prog, qk_scale, sm_scale, Mq, Mk, MASKED, PART, DOCUMENTS, LISTED)
    else:
        _consume(*smem, bars, dq_desc, DK, DV, prog, qk_scale, sm_scale, Mq, Mk, MASKED, PART, DOCUMENTS, LISTED)


# The partitions: worker partitions take the same arguments and no constexpr, so each variant and half has its own.
@gluon.jit
def _first(k_desc, v_desc, q_desc, do_desc, l_desc, d_desc, dq_desc, smem, bars, DK, DV, prog, qk_scale, sm_scale, Mq,
           Mk):
    _consumer(smem, bars, dq_desc, DK, DV, prog, qk_scale, sm_scale, Mq, Mk, False, 0)


@gluon.jit
def _second(k_desc, v_desc, q_desc, do_desc, l_desc, d_desc, dq_desc, smem, bars, DK, DV, prog, qk_scale, sm_scale,
            Mq, Mk):
    _consumer(smem, bars, dq_desc, DK, DV, prog, qk_scale, sm_scale, Mq, Mk, False, 1)


@gluon.jit
def _first_masked(k_desc, v_desc, q_desc, do_desc, l_desc, d_desc, dq_desc, smem, bars, DK, DV, prog, qk_scale,
                  sm_scale, Mq, Mk):
    _consumer(smem, bars, dq_desc, DK, DV, prog, qk_scale, sm_scale, Mq, Mk, True, 0)


@gluon.jit
def _second_masked(k_desc, v_desc, q_desc, do_desc, l_desc, d_desc, dq_desc, smem, bars, DK, DV, prog, qk_scale,
                   sm_scale, Mq, Mk):
    _consumer(smem, bars, dq_desc, DK, DV, prog, qk_scale, sm_scale, Mq, Mk, True, 1)


@gluon.jit
def _first_documents(k_desc, v_desc, q_desc, do_desc, l_desc, d_desc, dq_desc, smem, bars, DK, DV, prog, qk_scale,
                     sm_scale, Mq, Mk):
    _consumer(smem, bars, dq_desc, DK, DV, prog, qk_scale, sm_scale, Mq, Mk, True, 0, True)


@gluon.jit
def _second_documents(k_desc, v_desc, q_desc, do_desc, l_desc, d_desc, dq_desc, smem, bars, DK, DV, prog, qk_scale,
                      sm_scale, Mq, Mk):
    _consumer(smem, bars, dq_desc, DK, DV, prog, qk_scale, sm_scale, Mq, Mk, True, 1, True)


@gluon.jit
def _first_listed(k_desc, v_desc, q_desc, do_desc, l_desc, d_desc, dq_desc, smem, bars, DK, DV, prog, qk_scale,
                  sm_scale, Mq, Mk):
    _consumer(smem, bars, dq_desc, DK, DV, prog, qk_scale, sm_scale, Mq, Mk, False, 0, False, True)


@gluon.jit
def _second_listed(k_desc, v_desc, q_desc, do_desc, l_desc, d_desc, dq_desc, smem, bars, DK, DV, prog, qk_scale,
                   sm_scale, Mq, Mk):
    _consumer(smem, bars, dq_desc, DK, DV, prog, qk_scale, sm_scale, Mq, Mk, False, 1, False, True)


@gluon.jit
def _loader(k_desc, v_desc, q_desc, do_desc, l_desc, d_desc, dq_desc, smem, bars, DK, DV, prog, qk_scale, sm_scale,
            Mq, Mk):
    _load(k_desc, v_desc, q_desc, do_desc, l_desc, d_desc, smem[0], smem[1], smem[2], smem[3], smem[4], smem[5], bars[0],
          bars[1], bars[2], prog, False)


@gluon.jit
def _loader_listed(k_desc, v_desc, q_desc, do_desc, l_desc, d_desc, dq_desc, smem, bars, DK, DV, prog, qk_scale,
                   sm_scale, Mq, Mk):
    _load(k_desc, v_desc, q_desc, do_desc, l_desc, d_desc, smem[0], smem[1], smem[2], smem[3], smem[4], smem[5], bars[0],
          bars[1], bars[2], prog, True)


@gluon.jit
def _key_tile(pid, Sched, Mk, SCHEDULED: gl.constexpr, KEYS: gl.constexpr):
    """``(first key, end key, segment)`` of program ``pid``: the packed segments' table, or the regular tiles of
    ``KEYS`` keys from the first (under a causal mask the heaviest)."""
    if SCHEDULED:
        n0 = gl.load(Sched + pid * 3)
        n_end = gl.load(Sched + pid * 3 + 1)
        seg = gl.load(Sched + pid * 3 + 2)
    else:
        n0 = pid * KEYS
        n_end = gl.minimum(n0 + KEYS, Mk)
        seg = 0
    return n0, n_end, seg


@gluon.jit
def _query_rows(seg, Mq, QSeqStart, HAS_SEGMENTS: gl.constexpr):
    """``(row_lo, row_hi)``: the query rows of segment ``seg`` (none for ``-1``), or all ``Mq``."""
    row_lo = gl.to_tensor(0)
    row_hi = gl.to_tensor(Mq)
    if HAS_SEGMENTS:
        s = gl.maximum(seg, 0)
        row_lo = gl.where(seg >= 0, gl.load(QSeqStart + s), 0)
        row_hi = gl.where(seg >= 0, gl.load(QSeqStart + s + 1), 0)
    return row_lo, row_hi


@gluon.jit
def _row_span(n0, row_lo, row_hi, bounds, MASKED: gl.constexpr, KEYS: gl.constexpr):
    """``(first row, query tiles, a, e)`` of keys ``[n0, n0 + KEYS)``: the tiles of 64 rows from ``first row``
    (a multiple of 64) that see some of them, of which tiles ``[a, e)`` see them all. Row ``i`` sees key ``j`` when
    ``row_lo <= i < row_hi``, ``key_lo <= j < key_hi`` and ``band_lo <= j - i <= band_hi`` (``bounds``). Tiles
    start on the 64-row grid because lse and delta are read by TMA along their rows, whose boxes must start
    on 16 bytes (a document's first row need not)."""
    if MASKED:
        key_lo, key_hi, band_lo, band_hi = bounds
        first = gl.maximum(n0, key_lo)  # the keys some row may see: [first, last]
        last = gl.minimum(n0 + KEYS, key_hi) - 1
        lo = gl.maximum(first - band_hi, row_lo) // _ROWS * _ROWS
        hi = gl.minimum(last - band_lo + 1, row_hi)
        n = gl.where((first <= last) & (lo < hi), gl.cdiv(gl.maximum(hi - lo, 0), _ROWS), 0)
        inside = (n0 >= key_lo) & (n0 + KEYS <= key_hi)
        full_lo = gl.maximum(n0 + KEYS - 1 - band_hi, row_lo)  # rows that see every key: [full_lo, full_hi)
        full_hi = gl.minimum(n0 - band_lo + 1, row_hi)
        a, e = _whole_tiles(lo, n, full_lo, full_hi, inside, _ROWS)  # keys past a key bound: every tile masks
        lo = gl.where(n > 0, lo, 0)
    else:
        lo = gl.to_tensor(0)
        n = gl.to_tensor(row_hi // _ROWS)
        a = gl.to_tensor(0)
        e = n
    return lo, n, a, e


@gluon.jit
def _attn_bwd_ws_kernel(k_desc, v_desc, q_desc, do_desc, l_desc, d_desc, dq_desc, DK, DV, Sched, QSeqStart, KSeqStart,
                        KSeqLen, KvLens, BandLo, BandHi, TileCount, TileIdx, stride_cb, stride_ch, stride_tb,
                        stride_th, stride_tp, Hkv, G, Mq, Mk, chunk, qk_scale, sm_scale, REGS: gl.constexpr,
                        MASKED: gl.constexpr, SCHEDULED: gl.constexpr, HAS_SEGMENTS: gl.constexpr,
                        HAS_PADDED: gl.constexpr, HAS_BAND: gl.constexpr, BAND_PER_SEGMENT: gl.constexpr,
                        LISTED: gl.constexpr, TAIL_ORDER: gl.constexpr):
    """Grid ``(key tiles, B * Hkv)``: a program owns twice the keys of K's box (128, or 64 at head dim 256), its
    keys those of its row of the packed segments' table ``Sched`` with ``SCHEDULED``, the last ``chunk`` pairs
    started rank by rank with ``TAIL_ORDER`` (``common_kernels._chunked_ids``). Q, dO and dQ (float32, zeroed)
    are ``[B·H, Mq, D]`` descriptors, lse (natural log; +inf for a row that saw no key, NaN for one that saw an
    infinite score) and delta ``[B·H, Mq]``, K and V ``[B·Hkv, Mk, D]`` (``G`` query heads per KV head); writes
    dK and dV (``[B, Hkv, Mk, D]``, contiguous) and adds into dQ. Without ``MASKED``, Mq is a multiple of 64, Mk
    of the program's keys, and every row sees every key, or with ``LISTED`` every key of the program's listed
    query tiles (``TileCount [Bl, Hl, programs]`` and ``TileIdx [Bl, Hl, programs, tiles]``, strides ``stride_c*``
    and ``stride_t*``, of a block layout whose blocks hold whole tiles, the same for every query head of a
    group)."""
    dtype: gl.constexpr = k_desc.dtype
    KEYS: gl.constexpr = k_desc.block_type.shape[1]  # keys of one box: one half of the program's
    WIDE: gl.constexpr = k_desc.block_type.shape[2] == 256
    pid, bh_k = _chunked_ids(gl.program_id(0), gl.program_id(1), gl.num_programs(0), gl.num_programs(1), chunk,
                             TAIL_ORDER)  # bh_k: (batch row, KV head)
    n0, n_end, seg = _key_tile(pid, Sched, Mk, SCHEDULED, 2 * KEYS)
    b = bh_k // Hkv
    key_lo, key_hi, band_lo, band_hi = _key_bounds(seg, b, Mk, KSeqStart, KSeqLen, KvLens, BandLo, BandHi,
                                                   HAS_SEGMENTS, HAS_PADDED, HAS_BAND, BAND_PER_SEGMENT)
    key_hi = gl.minimum(key_hi, n_end)
    row_lo, row_hi = _query_rows(seg, Mq, QSeqStart, HAS_SEGMENTS)
    bounds = (key_lo, key_hi, band_lo, band_hi)
    lo, n_head, a, e = _row_span(n0, row_lo, row_hi, bounds, MASKED, 2 * KEYS)
    tiles = TileIdx
    if LISTED:
        h_l = (bh_k % Hkv) * G  # the group's first query head: its list is the group's
        tiles = TileIdx + b.to(gl.int64) * stride_tb + h_l.to(gl.int64) * stride_th + pid.to(gl.int64) * stride_tp
        n_head = gl.load(TileCount + b * stride_cb + h_l * stride_ch + pid)
        e = n_head
    k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [_RING] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [_RING] + q_desc.block_type.shape, q_desc.layout)
    l_bufs = gl.allocate_shared_memory(gl.float32, [_RING] + l_desc.block_type.shape, l_desc.layout)
    d_bufs = gl.allocate_shared_memory(gl.float32, [_RING] + l_desc.block_type.shape, l_desc.layout)
    if WIDE:  # P and dS of one tile, 32 keys from each warpgroup; one dQ staging buffer per warpgroup
        t_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_ROWS, 2 * KEYS], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [_ROWS, 2 * KEYS], t_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [_ROWS, 2 * KEYS], t_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    else:  # dS^T halves of two tiles; dQ staging per warpgroup: one [64, 64] buffer at D=128, two [64, 32] at D=64
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, _ROWS], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [4, KEYS, _ROWS], ds_layout)
        if k_desc.block_type.shape[2] == 128:
            w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, _ROWS, 64], gl.float32)
            dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, _ROWS, 64], w_layout)
        else:
            dq_smem = gl.allocate_shared_memory(gl.float32, [4] + dq_desc.block_type.shape, dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [_RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [_RING, 1], mbarrier.MBarrierLayout())
    if WIDE:  # both warpgroups' halves stored (full), both done reading them (free)
        full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    else:
        ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(_RING):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    if WIDE:
        mbarrier.init(full, count=2)
        mbarrier.init(free, count=2)
        smem = (k_smem, v_smem, q_bufs, do_bufs, l_bufs, d_bufs, p_smem, ds_smem, dq_smem)
        bars = (kv_bar, ready, empty, full, free)
    else:
        for i in gl.static_range(2):
            mbarrier.init(ds_bar.index(i), count=2)
        smem = (k_smem, v_smem, q_bufs, do_bufs, l_bufs, d_bufs, ds_smem, dq_smem)
        bars = (kv_bar, ready, empty, ds_bar)
    bh_q = b * Hkv * G + (bh_k % Hkv) * G  # the group's first query head
    n_rows = (row_hi - row_lo).to(gl.uint32)  # rows - row_lo < n_rows, unsigned: one compare in the masked loop
    prog = (bh_k, bh_q, n0, n_end, lo, n_head * G, n_head, a, e, tiles, row_lo, n_rows) + bounds
    args = (k_desc, v_desc, q_desc, do_desc, l_desc, d_desc, dq_desc, smem, bars, DK, DV, prog, qk_scale, sm_scale,
            Mq, Mk)
    if LISTED:
        gl.warp_specialize([(_first_listed, args), (_second_listed, args), (_loader_listed, args)], [4, 1],
                           [REGS, 24])
    elif HAS_SEGMENTS:
        gl.warp_specialize([(_first_documents, args), (_second_documents, args), (_loader, args)], [4, 1], [REGS, 24])
    elif MASKED:
        gl.warp_specialize([(_first_masked, args), (_second_masked, args), (_loader, args)], [4, 1], [REGS, 24])
    else:
        gl.warp_specialize([(_first, args), (_second, args), (_loader, args)], [4, 1], [REGS, 24])


_launch_bwd = direct(_attn_bwd_ws_kernel)  # repeated launches skip Triton's binding


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor) -> bool:
    """Whether this kernel can run a backward on these tensors (see the module doc; the caller checks the
    device, the bias, dropout, determinism and the size, and passes dO contiguous)."""
    B, H, Mq, D = q.shape
    Mk = k.shape[2]
    if D not in (64, 128, 256) or k.shape[3] != D or v.shape[3] != D or min(Mq, Mk) == 0:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if not all(t.is_contiguous() for t in (q, k, v, lse)) or B * H * Mq >= 2**31 or B * k.shape[1] * Mk >= 2**31:
        return False
    return all(t.data_ptr() % 16 == 0 for t in (q, k, v, lse)) and Mq % 4 == 0


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor of ``t`` (contiguous) viewed as ``[heads, rows(, D)]`` with boxes of ``block``."""
    if t.dim() == 4:
        B, H, M, X = t.shape
        shape, strides = [B * H, M, X], [M * X, X, 1]
    else:
        B, H, M = t.shape
        shape, strides = [B * H, M], [M, 1]
    layout = shared_layout(tuple(block), t.dtype, swizzled=len(block) == 3)  # lse and delta: unswizzled rows
    return qualified_descriptor(TensorDescriptor, t, shape, strides, block, layout=layout)


def tma_outputs(D: int, documents: bool) -> bool:
    """Whether the kernel writes dK and dV through TMA stores (:func:`descriptors`)."""
    return D != 256 and not documents


def descriptors(q, k, v, dout, lse, delta, dq32, dk, dv, documents: bool) -> tuple:
    """The TMA descriptors :func:`attn_bwd` launches with (per head: ``[B·H, M(, D)]``), dK's and dV's too at head
    dims 64 and 128 without packed ``documents`` (whose programs end their rows at a document's end): built per
    call, they are roles of a launch plan."""
    D = q.shape[3]
    half = WIDE_KEYS if D == 256 else HALF
    outs = (_descriptor(dk, [1, ROWS, D]), _descriptor(dv, [1, ROWS, D])) if tma_outputs(D, documents) else ()
    return (_descriptor(k, [1, half, D]), _descriptor(v, [1, half, D]), _descriptor(q, [1, ROWS, D]),
            _descriptor(dout, [1, ROWS, D]), _descriptor(lse, [1, ROWS]), _descriptor(delta, [1, ROWS]),
            _descriptor(dq32, [1, ROWS, DQ_COLS])) + outs


def attn_bwd(q, k, dk, dv, descs: tuple, qk_scale: float, scale: float, n_prog: int, table: torch.Tensor,
             bounds: tuple, switches: dict, chunk: int = 1, lists: tuple | None = None) -> None:
    """Write ``dk`` and ``dv`` (their descriptors where :func:`tma_outputs`) and add dQ into the float32 (zeroed)
    buffer of an :func:`eligible` call, every other operand in ``descs`` (the first seven :func:`descriptors`,
    of ``q, k, v, dout, lse, delta, dq32``): ``lse``
    the forward's, guarded (+inf where it is -inf, NaN where +inf), and ``delta = rowsum(dout * out) - dlse``
    (float32 ``[B, H, Mq]``, both from the backward's preprocessing); ``qk_scale`` the softmax ``scale`` times
    log2(e); ``n_prog`` key-tile programs, those of the packed segments' ``table`` (:func:`.schedule.key_schedule`
    at :func:`program_keys`) with ``SCHEDULED``; ``bounds`` the int32 tensors ``(q_seqstart, k_seqstart,
    k_seqlen, kv_seqlens, band_lo, band_hi)`` and ``switches`` the ``SCHEDULED``, ``HAS_*`` and
    ``BAND_PER_SEGMENT`` flags of the bias; the last ``chunk`` (batch, KV head) pairs start their key tiles rank
    by rank. ``lists`` ``(count, index, count strides (b, h), index strides (b, h, program))``: the query tiles
    of 64 rows each program walks (a block layout's, :func:`.schedule.layout_tile_lists`), every row of them
    seeing every key of the program; the layout is the call's only mask."""
    B, H, Mq, D = q.shape
    Hkv, Mk = k.shape[1], k.shape[2]
    wide = D == 256
    masked = any(switches.values()) or Mq % ROWS != 0 or Mk % program_keys(D) != 0
    if lists is not None and masked:
        raise ValueError("a listed backward takes no other mask, Mq a multiple of 64 and Mk of the program's keys")
    count, index, cs, ts = lists if lists is not None else (table, table, (0, 0), (0, 0, 0))
    _launch_bwd[(n_prog, B * Hkv)](
        *descs, dk, dv, table, *bounds, count, index, *cs, *ts, Hkv, H // Hkv, Mq, Mk, chunk, qk_scale, scale,
        WIDE_REGS if wide else CONSUMER_REGS[masked], masked, **switches, LISTED=lists is not None,
        TAIL_ORDER=chunk > 1, num_warps=4,
    )


def program_keys(D: int) -> int:
    """Keys a program owns at head dim ``D``: its key tile, and the block of its segments' table."""
    return 2 * (WIDE_KEYS if D == 256 else HALF)
