"""Backward flash-attention kernels: ``delta`` preprocessing, dK/dV (and the bias gradient), and dQ.

Deterministic: every output element is written by one program. The dK/dV program owns a key tile
of one (batch, KV head) and loops over the query heads of its group and the query tiles that can
see it (GQA reduction in registers; heads and tiles in one loop per kind of tile where every head's
tiles are alike). The dQ program owns a query tile and loops over key tiles,
like the forward; when dQ runs before dK/dV (no side stream) it also computes ``delta`` for its rows,
so the backward is two launches instead of three. The additive-bias gradient ``dS`` is written by the dK/dV program (full bias,
or column sums for a bias broadcast over queries) or by the dQ program (row sums for a bias
broadcast over keys); a full bias broadcast over batch or heads makes one dK/dV program loop over
the batch rows / heads sharing it and accumulate its tile in place.
"""

import triton
import triton.language as tl

from .common_kernels import (
    LOG2E,
    _add_load,
    _col_row_bounds,
    _dropout_keep,
    _dropout_keep_tile,
    _dropout_seed,
    _dropout_stream,
    _list_entry,
    _list_registers,
    _load_kept,
    _load_lines,
    _load_tile,
    _program_ids,
    _query_rows,
    _row_key_bounds,
    _score_tile,
    _span,
    _tile_split,
)


@triton.jit
def _attn_bwd_preprocess_kernel(
    Out, DOut, DLse, Delta, Lse, LseGuarded, DQ32,
    o_strides, do_strides,
    H, Mq, Dv,
    BLOCK_M: tl.constexpr, HEAD_DIM_V: tl.constexpr, HAS_DLSE: tl.constexpr, WRITE_GUARDED: tl.constexpr,
):
    """``Delta [B, H, Mq] = rowsum(dOut * Out) - dLse`` in float32; with ``WRITE_GUARDED`` (the Gluon backward) also
    ``LseGuarded``: ``Lse`` with +inf where it is -inf (a row that saw no key gets P = 0) and NaN where it is +inf
    (a row that saw an infinite score has no defined gradient), and zeros in ``DQ32`` (float32, contiguous
    ``[B, H, Mq, Dv]``), the dQ that its programs add into: one launch fewer than a separate fill."""
    stride_ob, stride_oh, stride_om, stride_od = o_strides
    stride_db, stride_dh, stride_dm, stride_dd = do_strides
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    d = tl.arange(0, HEAD_DIM_V)
    mask = (rows[:, None] < Mq) & (d[None, :] < Dv)
    o = tl.load(Out + b * stride_ob + h * stride_oh + rows64[:, None] * stride_om + d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(DOut + b * stride_db + h * stride_dh + rows64[:, None] * stride_dm + d[None, :] * stride_dd, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLse + pid_bh.to(tl.int64) * Mq + rows64, mask=rows < Mq, other=0.0)
    tl.store(Delta + pid_bh.to(tl.int64) * Mq + rows64, delta, mask=rows < Mq)
    if WRITE_GUARDED:
        lse = tl.load(Lse + pid_bh.to(tl.int64) * Mq + rows64, mask=rows < Mq, other=0.0)
        guarded = tl.where(lse == float("-inf"), float("inf"), lse)
        guarded = tl.where(lse < float("inf"), guarded, float("nan"))
        tl.store(LseGuarded + pid_bh.to(tl.int64) * Mq + rows64, guarded, mask=rows < Mq)
        tl.store(DQ32 + (pid_bh.to(tl.int64) * Mq + rows64[:, None]) * Dv + d[None, :],
                 tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32), mask=mask)


@triton.jit
def _dkdv_tile(
    dk, dv, dcol, k, v, m0, ktile, qdo, sizes, bias, drop, bias_raw, FEATURES: tl.constexpr,
    MASKED: tl.constexpr, LAYOUT_MASK: tl.constexpr, PRELOADED: tl.constexpr,
):
    """Query tile ``[m0, m0 + BLOCK_M)`` against the program's key tile, in transposed form ``[BLOCK_N, BLOCK_M]``;
    masked tiles read only the rows of the program's span ``[row_lo, row_hi)``.

    Grouped arguments: ``ktile`` the key tile (columns, their row bounds and span, batch, head),
    ``qdo`` the Q/dO bases, lse, delta and bias-gradient operands of the query head, ``sizes``
    ``(Mq, Mk, D, Dv, qk_scale)``, ``bias`` the additive, ALiBi and block-layout operands, ``drop``
    the dropout stream, ``FEATURES`` the switches every tile of a launch shares."""
    cols, col_end, ilo, ihi, row_lo, row_hi, b, h = ktile
    (Q_base, DO_base, LD_off, Lse, Delta, DBias, stride_qm, stride_qd, stride_dom, stride_dod,
     stride_gb, stride_gh, stride_gm, stride_gn) = qdo
    Mq, Mk, D, Dv, qk_scale = sizes
    seed, row_blocks, drop_thresh, drop_scale, c0 = drop
    HAS_ADDITIVE: tl.constexpr = FEATURES[0]
    HAS_ALIBI: tl.constexpr = FEATURES[1]
    FULL_DBIAS: tl.constexpr = FEATURES[2]
    DBIAS_ACCUM: tl.constexpr = FEATURES[3]
    COL_DBIAS: tl.constexpr = FEATURES[4]
    BLOCK_M: tl.constexpr = FEATURES[5]
    HEAD_DIM: tl.constexpr = FEATURES[6]
    HEAD_DIM_V: tl.constexpr = FEATURES[7]
    EVEN_D: tl.constexpr = FEATURES[8]
    DOT_PRECISION: tl.constexpr = FEATURES[9]
    INDEX_64: tl.constexpr = FEATURES[10]
    HAS_DROPOUT: tl.constexpr = FEATURES[11]
    DROP_ALIGNED: tl.constexpr = FEATURES[12]
    HIDDEN_LINES: tl.constexpr = FEATURES[13]
    rows = m0 + tl.arange(0, BLOCK_M)
    if INDEX_64:
        rows64 = rows.to(tl.int64)
    else:
        rows64 = rows
    dqd = tl.arange(0, HEAD_DIM)
    dvd = tl.arange(0, HEAD_DIM_V)
    q_ptrs = Q_base + rows64[:, None] * stride_qm + dqd[None, :] * stride_qd
    do_ptrs = DO_base + rows64[:, None] * stride_dom + dvd[None, :] * stride_dod
    q = _load_tile(q_ptrs, rows, row_lo, row_hi, Mq, dqd, D, MASKED, HIDDEN_LINES, EVEN_D)
    do = _load_tile(do_ptrs, rows, row_lo, row_hi, Mq, dvd, Dv, MASKED, HIDDEN_LINES, EVEN_D)
    if MASKED:
        lse = tl.load(Lse + LD_off + rows64, mask=rows < Mq, other=float("-inf"))
        delta = tl.load(Delta + LD_off + rows64, mask=rows < Mq, other=0.0)
    else:
        lse = tl.load(Lse + LD_off + rows64)
        delta = tl.load(Delta + LD_off + rows64)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # rows that saw nothing get p = 0
    sT, vis = _score_tile(  # [BLOCK_N, BLOCK_M]
        k, q, rows[None, :], cols[:, None], rows[None, :], ilo[:, None], ihi[:, None], m0, b, h, Mq, Mk, qk_scale, bias,
        bias_raw, HAS_ADDITIVE=HAS_ADDITIVE, HAS_ALIBI=HAS_ALIBI, MASKED=MASKED, LAYOUT_MASK=LAYOUT_MASK,
        PRELOADED=PRELOADED, INDEX_64=INDEX_64, DOT_PRECISION=DOT_PRECISION,
    )
    pT = tl.math.exp2(sT * qk_scale - lse2[None, :])
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    if HAS_DROPOUT:  # dV sees the dropped probabilities; dP reaches only the kept ones
        if DROP_ALIGNED:
            keepT = tl.trans(_dropout_keep_tile(
                seed, LD_off * row_blocks, rows, c0, row_blocks, drop_thresh, BLOCK_M, cols.shape[0]).to(tl.int8)) != 0
        else:  # a key tile that starts off the 8-key grid (packed segments): element by element
            keepT = _dropout_keep(seed, LD_off * row_blocks, rows[None, :], cols[:, None], row_blocks, drop_thresh)
        dv += tl.dot(tl.where(keepT, pT * drop_scale, 0.0).to(do.dtype), do, input_precision=DOT_PRECISION)
        dpT = tl.where(keepT, dpT * drop_scale, 0.0)
    else:
        dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PRECISION)
    dsT = pT * (dpT - delta[None, :])
    if MASKED:  # a value hidden from some rows may hold NaN or inf: 0 · NaN must not reach dK
        dsT = tl.where(vis, dsT, 0.0)
    dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PRECISION)
    if FULL_DBIAS:
        if INDEX_64:
            gcols = cols.to(tl.int64)
        else:
            gcols = cols
        g_ptrs = (DBias + b.to(tl.int64) * stride_gb + h.to(tl.int64) * stride_gh
                  + rows64[None, :] * stride_gm + gcols[:, None] * stride_gn)
        g_mask = (rows[None, :] < Mq) & (cols[:, None] < col_end)
        if DBIAS_ACCUM:
            tl.store(g_ptrs, tl.load(g_ptrs, mask=g_mask, other=0.0) + dsT, mask=g_mask)
            tl.debug_barrier()  # the next (batch, head) of this program reads these elements back
        else:
            tl.store(g_ptrs, dsT, mask=g_mask)
    if COL_DBIAS:
        dcol += tl.sum(dsT, 1)
    return dk, dv, dcol


@triton.jit
def _head_operands(h, b, b64, keys, lo, hi, qdo_ops, grads, shape):
    """``(ktile, qdo, sizes)`` of :func:`_dkdv_tile` for query head ``h``: the key tile, the head's Q/dO
    bases, lse/delta offset and gradient operands, and the sizes."""
    cols, cols64, n_end, cvalid, ilo, ihi = keys
    Q, DO, Lse, Delta, stride_qb, stride_qh, stride_qm, stride_qd, stride_dob, stride_doh, stride_dom, stride_dod = qdo_ops
    DBias, DCol, stride_gb, stride_gh, stride_gm, stride_gn = grads
    H, Mq, Mk, D, Dv, qk_scale = shape
    h64 = h.to(tl.int64)
    qdo = (Q + b64 * stride_qb + h64 * stride_qh, DO + b64 * stride_dob + h64 * stride_doh, (b64 * H + h64) * Mq,
           Lse, Delta, DBias, stride_qm, stride_qd, stride_dom, stride_dod, stride_gb, stride_gh, stride_gm, stride_gn)
    return (cols, n_end, ilo, ihi, lo, hi, b, h), qdo, (Mq, Mk, D, Dv, qk_scale)


@triton.jit
def _dkdv_head(dk, dv, k, v, keys, span, b, b64, h, pid_n, qdo_ops, grads, lists, shape, bias, drop,
               LOOPS: tl.constexpr, FEATURES: tl.constexpr):
    """Accumulate query head ``h``'s contribution to the program's dK/dV tile (and write its bias gradient).

    Grouped arguments: ``keys`` the key tile (columns, their end, validity and row bounds), ``span``
    the rows they see together ``(lo, hi, full_lo, full_hi)`` and their tile split ``(n, a, e)``, the
    Q/dO operands ``qdo_ops`` and gradient outputs ``grads`` of every query head, the tile lists
    ``lists`` of a block layout, ``shape`` ``(H, Mq, Mk, D, Dv, qk_scale)``, ``bias`` and ``drop`` as
    in :func:`_dkdv_tile`; ``LOOPS`` the switches of the tile loops, ``FEATURES`` those of the tile."""
    cols, cols64, n_end, cvalid, ilo, ihi = keys
    lo, hi, full_lo, full_hi, n, a, e = span
    DCol = grads[1]
    TileCount, TileIdx, stride_cb, stride_ch, stride_tb, stride_th, stride_tp = lists
    H, Mq, Mk = shape[0], shape[1], shape[2]
    BLOCK_M: tl.constexpr = LOOPS[0]
    HAS_LAYOUT: tl.constexpr = LOOPS[1]
    LAYOUT_EXACT: tl.constexpr = LOOPS[2]
    LIST_ONLY: tl.constexpr = LOOPS[3]
    LIST_TILES: tl.constexpr = LOOPS[4]
    HAS_ADDITIVE: tl.constexpr = FEATURES[0]
    COL_DBIAS: tl.constexpr = FEATURES[4]
    INDEX_64: tl.constexpr = FEATURES[10]
    Add, stride_ab, stride_ah, stride_am, stride_an = bias[0], bias[1], bias[2], bias[3], bias[4]
    h64 = h.to(tl.int64)
    ktile, qdo, sizes = _head_operands(h, b, b64, keys, lo, hi, qdo_ops, grads, shape)
    dcol = tl.zeros_like(cols).to(tl.float32)
    if HAS_LAYOUT:
        count = tl.load(TileCount + b * stride_cb + h * stride_ch + pid_n)
        tiles = TileIdx + b64 * stride_tb + h64 * stride_th + pid_n.to(tl.int64) * stride_tp
        if LIST_ONLY:  # every listed tile is fully visible: a loop without branches, which Triton pipelines
            slots, listed = _list_registers(tiles, count, LIST_TILES)
            for t in range(0, count):
                m0 = _list_entry(tiles, t, slots, listed, LIST_TILES) * BLOCK_M
                dk, dv, dcol = _dkdv_tile(
                    dk, dv, dcol, k, v, m0, ktile, qdo, sizes, bias, drop, 0.0, FEATURES,
                    MASKED=False, LAYOUT_MASK=False, PRELOADED=False,
                )
        else:
            for t in range(0, count):
                m0 = tl.load(tiles + t) * BLOCK_M
                if (m0 < hi) & (m0 + BLOCK_M > lo):
                    # LAYOUT_EXACT: tiles lie inside layout blocks, so the list settles the layout
                    if LAYOUT_EXACT and (m0 >= full_lo) & (m0 + BLOCK_M <= full_hi):
                        dk, dv, dcol = _dkdv_tile(
                            dk, dv, dcol, k, v, m0, ktile, qdo, sizes, bias, drop, 0.0, FEATURES,
                            MASKED=False, LAYOUT_MASK=False, PRELOADED=False,
                        )
                    else:
                        dk, dv, dcol = _dkdv_tile(
                            dk, dv, dcol, k, v, m0, ktile, qdo, sizes, bias, drop, 0.0, FEATURES,
                            MASKED=True, LAYOUT_MASK=not LAYOUT_EXACT, PRELOADED=False,
                        )
    else:
        for t in range(0, a):
            dk, dv, dcol = _dkdv_tile(
                dk, dv, dcol, k, v, lo + t * BLOCK_M, ktile, qdo, sizes, bias, drop, 0.0, FEATURES,
                MASKED=True, LAYOUT_MASK=False, PRELOADED=False,
            )
        nxt = 0.0  # the next query tile's additive tile, loaded one iteration ahead (see the forward)
        if HAS_ADDITIVE:
            nxt = _add_load((lo + a * BLOCK_M + tl.arange(0, BLOCK_M))[None, :], cols[:, None], b, h, Mq, Mk,
                            Add, stride_ab, stride_ah, stride_am, stride_an, INDEX_64)
        for t in range(a, e):
            m0 = lo + t * BLOCK_M
            cur = nxt
            if HAS_ADDITIVE:
                nxt = _add_load((m0 + BLOCK_M + tl.arange(0, BLOCK_M))[None, :], cols[:, None], b, h, Mq, Mk,
                                Add, stride_ab, stride_ah, stride_am, stride_an, INDEX_64)
            dk, dv, dcol = _dkdv_tile(
                dk, dv, dcol, k, v, m0, ktile, qdo, sizes, bias, drop, cur, FEATURES,
                MASKED=False, LAYOUT_MASK=False, PRELOADED=HAS_ADDITIVE,
            )
        for t in range(e, n):
            dk, dv, dcol = _dkdv_tile(
                dk, dv, dcol, k, v, lo + t * BLOCK_M, ktile, qdo, sizes, bias, drop, 0.0, FEATURES,
                MASKED=True, LAYOUT_MASK=False, PRELOADED=False,
            )
    if COL_DBIAS:
        tl.store(DCol + (b64 * H + h64) * Mk + cols64, dcol, mask=cvalid)
    return dk, dv


@triton.jit
def _dkdv_group(dk, dv, k, v, keys, span, b, b64, hk, G, qdo_ops, grads, shape, bias, drop, BLOCK_M: tl.constexpr,
                FEATURES: tl.constexpr):
    """The query heads of KV head ``hk`` against the program's key tile, in one loop per kind of tile
    (masked left edge, unmasked middle, masked right edge) that runs over the heads and the tiles
    together: a loop over heads around the tile loops makes Triton spill the accumulators. For
    biases whose tiles are alike for every head (no block layout or column gradient); an additive
    bias's tile is prefetched one (head, tile) ahead in the unmasked loop.
    Grouped arguments as :func:`_dkdv_head`'s."""
    lo, hi, full_lo, full_hi, n, a, e = span
    dk, dv = _dkdv_heads_tiles(dk, dv, k, v, hk * G, G, 0, a, keys, lo, hi, b, b64, qdo_ops, grads, shape, bias, drop,
                               BLOCK_M, FEATURES, MASKED=True)
    dk, dv = _dkdv_heads_tiles(dk, dv, k, v, hk * G, G, a, e - a, keys, lo, hi, b, b64, qdo_ops, grads, shape, bias, drop,
                               BLOCK_M, FEATURES, MASKED=False)
    dk, dv = _dkdv_heads_tiles(dk, dv, k, v, hk * G, G, e, n - e, keys, lo, hi, b, b64, qdo_ops, grads, shape, bias, drop,
                               BLOCK_M, FEATURES, MASKED=True)
    return dk, dv


@triton.jit
def _dkdv_heads_tiles(dk, dv, k, v, h0, G, first, count, keys, lo, hi, b, b64, qdo_ops, grads, shape, bias, drop,
                      BLOCK_M: tl.constexpr, FEATURES: tl.constexpr, MASKED: tl.constexpr):
    """Query tiles ``first .. first + count`` of the span, of each of the ``G`` heads from ``h0``: one loop."""
    cols = keys[0]
    Mq, Mk = shape[1], shape[2]
    HAS_ADDITIVE: tl.constexpr = FEATURES[0]
    INDEX_64: tl.constexpr = FEATURES[10]
    PREFETCH: tl.constexpr = HAS_ADDITIVE and not MASKED  # the next (head, tile)'s additive tile, one step ahead
    Add, stride_ab, stride_ah, stride_am, stride_an = bias[0], bias[1], bias[2], bias[3], bias[4]
    dcol = tl.zeros_like(cols).to(tl.float32)
    nxt = 0.0
    if PREFETCH:
        nxt = _add_load((lo + first * BLOCK_M + tl.arange(0, BLOCK_M))[None, :], cols[:, None], b, h0, Mq, Mk,
                        Add, stride_ab, stride_ah, stride_am, stride_an, INDEX_64)
    for i in range(0, G * count):
        h = h0 + i // count
        ktile, qdo, sizes = _head_operands(h, b, b64, keys, lo, hi, qdo_ops, grads, shape)
        cur = nxt
        if PREFETCH:
            j = tl.minimum(i + 1, G * count - 1)
            nxt = _add_load((lo + (first + j % count) * BLOCK_M + tl.arange(0, BLOCK_M))[None, :], cols[:, None], b,
                            h0 + j // count, Mq, Mk, Add, stride_ab, stride_ah, stride_am, stride_an, INDEX_64)
        dk, dv, dcol = _dkdv_tile(
            dk, dv, dcol, k, v, lo + (first + i % count) * BLOCK_M, ktile, qdo, sizes, bias, drop, cur, FEATURES,
            MASKED=MASKED, LAYOUT_MASK=False, PRELOADED=PREFETCH,
        )
    return dk, dv


@triton.jit
def _dkdv_program(b, hk, G, cols, n_end, seg, pid_n, kv_ops, bounds, qdo_ops, grads, lists, shape, bias, drop,
                  KEYS: tl.constexpr, LOOPS: tl.constexpr, FEATURES: tl.constexpr):
    """dK and dV of one key tile of KV head ``hk`` in batch row ``b``: loops over its query heads and tiles.

    Grouped arguments: ``kv_ops`` K, V, dK, dV, their strides and the softmax scale, ``bounds`` the
    length tensors (query starts of packed segments, key lengths, band), ``KEYS`` the switches of the
    key tile; the others go to :func:`_dkdv_group` or :func:`_dkdv_head`."""
    (K, V, DK, DV, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
     stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd, sm_scale) = kv_ops
    QSeqStart, KvLens, BandLo, BandHi = bounds
    Mq = shape[1]
    D = shape[3]
    Dv = shape[4]
    BLOCK_N: tl.constexpr = KEYS[0]
    GQA: tl.constexpr = KEYS[1]
    HAS_SEGMENTS: tl.constexpr = KEYS[2]
    HAS_PADDED: tl.constexpr = KEYS[3]
    HAS_BAND: tl.constexpr = KEYS[4]
    BAND_PER_SEGMENT: tl.constexpr = KEYS[5]
    BLOCK_M: tl.constexpr = LOOPS[0]
    HEAD_DIM: tl.constexpr = FEATURES[6]
    HEAD_DIM_V: tl.constexpr = FEATURES[7]
    EVEN_D: tl.constexpr = FEATURES[8]
    INDEX_64: tl.constexpr = FEATURES[10]
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    if INDEX_64:
        cols64 = cols.to(tl.int64)
    else:
        cols64 = cols
    dkd = tl.arange(0, HEAD_DIM)
    dvd = tl.arange(0, HEAD_DIM_V)
    ilo, ihi, cvalid = _col_row_bounds(
        cols, n_end, seg, b, Mq, QSeqStart, KvLens, BandLo, BandHi, HAS_SEGMENTS, HAS_PADDED, HAS_BAND, BAND_PER_SEGMENT
    )
    lo, hi, full_lo, full_hi = _span(ilo, ihi, cvalid)
    n, a, e = _tile_split(lo, hi, full_lo, full_hi, BLOCK_M)
    seen = cvalid & (ilo < ihi)  # keys no row sees (past a cache length, outside every segment) may hold anything
    k = _load_kept(K + b64 * stride_kb + hk64 * stride_kh + cols64[:, None] * stride_kn + dkd[None, :] * stride_kd,
                   seen, dkd, D, EVEN_D)
    v = _load_kept(V + b64 * stride_vb + hk64 * stride_vh + cols64[:, None] * stride_vn + dvd[None, :] * stride_vd,
                   seen, dvd, Dv, EVEN_D)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], dtype=tl.float32)
    keys = (cols, cols64, n_end, cvalid, ilo, ihi)
    span = (lo, hi, full_lo, full_hi, n, a, e)
    COL_DBIAS: tl.constexpr = FEATURES[4]
    HAS_LAYOUT: tl.constexpr = LOOPS[1]
    if GQA and not (HAS_LAYOUT or COL_DBIAS):
        dk, dv = _dkdv_group(dk, dv, k, v, keys, span, b, b64, hk, G, qdo_ops, grads, shape, bias, drop, BLOCK_M, FEATURES)
    elif GQA:  # per-head tile lists or column gradients: a loop over heads around the tile loops
        for g in range(0, G):
            dk, dv = _dkdv_head(dk, dv, k, v, keys, span, b, b64, hk * G + g, pid_n, qdo_ops, grads, lists, shape, bias,
                                drop, LOOPS, FEATURES)
    else:
        dk, dv = _dkdv_head(dk, dv, k, v, keys, span, b, b64, hk, pid_n, qdo_ops, grads, lists, shape, bias, drop,
                            LOOPS, FEATURES)
    dk_ptrs = DK + b64 * stride_dkb + hk64 * stride_dkh + cols64[:, None] * stride_dkn + dkd[None, :] * stride_dkd
    dv_ptrs = DV + b64 * stride_dvb + hk64 * stride_dvh + cols64[:, None] * stride_dvn + dvd[None, :] * stride_dvd
    tl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=cvalid[:, None] & (dkd[None, :] < D))
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=cvalid[:, None] & (dvd[None, :] < Dv))


@triton.jit(do_not_specialize=["nb_loop", "nhk_loop", "layout_q_off", "layout_k_off", "block_q", "block_k", "alibi_shift",
                             "seed_lo", "seed_hi", "drop_thresh"])  # values that vary per call: no recompiles
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, DBias, DCol, Add, Slopes, Layout, QSeqStart, KvLens, BandLo, BandHi, Sched,
    TileCount, TileIdx, qk_scale, sm_scale,
    q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides, g_strides, add_strides, slope_strides,
    layout_strides, count_strides, tile_strides,
    H, G, Hkv, Mq, Mk, D, Dv, nb_loop, nhk_loop, layout_q_off, layout_k_off, block_q, block_k, alibi_shift,
    seed_lo, seed_hi, drop_thresh, drop_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    EVEN_D: tl.constexpr, SCHEDULED: tl.constexpr, HAS_SEGMENTS: tl.constexpr, HAS_PADDED: tl.constexpr,
    HAS_BAND: tl.constexpr, BAND_PER_SEGMENT: tl.constexpr, HAS_LAYOUT: tl.constexpr, LAYOUT_EXACT: tl.constexpr,
    LIST_ONLY: tl.constexpr, LIST_TILES: tl.constexpr, HAS_ADDITIVE: tl.constexpr, HAS_ALIBI: tl.constexpr,
    FULL_DBIAS: tl.constexpr, DBIAS_ACCUM: tl.constexpr, COL_DBIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INDEX_64: tl.constexpr, GQA: tl.constexpr, OUTER_LOOPS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DROP_ALIGNED: tl.constexpr, HIDDEN_LINES: tl.constexpr,
):
    """Grid ``(key tiles, (B / nb_loop) * (Hkv / nhk_loop))``. Writes ``DK``, ``DV`` ``[B, Hkv, Mk, D|Dv]``."""
    stride_qb, stride_qh, stride_qm, stride_qd = q_strides
    stride_kb, stride_kh, stride_kn, stride_kd = k_strides
    stride_vb, stride_vh, stride_vn, stride_vd = v_strides
    stride_dob, stride_doh, stride_dom, stride_dod = do_strides
    stride_dkb, stride_dkh, stride_dkn, stride_dkd = dk_strides
    stride_dvb, stride_dvh, stride_dvn, stride_dvd = dv_strides
    stride_gb, stride_gh, stride_gm, stride_gn = g_strides
    stride_ab, stride_ah, stride_am, stride_an = add_strides
    stride_sb, stride_sh = slope_strides
    stride_lb, stride_lh, stride_lq, stride_lk = layout_strides
    stride_cb, stride_ch = count_strides
    stride_tb, stride_th, stride_tp = tile_strides
    pid_n = tl.program_id(0)
    pid = tl.program_id(1)
    n_hk_groups = Hkv // nhk_loop
    bg = pid // n_hk_groups
    hg = pid % n_hk_groups
    if SCHEDULED:
        n0 = tl.load(Sched + pid_n * 3)
        n_end = tl.load(Sched + pid_n * 3 + 1)
        seg = tl.load(Sched + pid_n * 3 + 2)
    else:
        n0 = pid_n * BLOCK_N
        n_end = tl.minimum(n0 + BLOCK_N, Mk)
        seg = 0
    cols = n0 + tl.arange(0, BLOCK_N)
    c0 = n0
    seed = _dropout_seed(seed_lo, seed_hi)
    row_blocks = (Mk + 7) // 8
    kv_ops = (K, V, DK, DV, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
              stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd, sm_scale)
    bounds = (QSeqStart, KvLens, BandLo, BandHi)
    qdo_ops = (Q, DO, Lse, Delta, stride_qb, stride_qh, stride_qm, stride_qd, stride_dob, stride_doh, stride_dom, stride_dod)
    grads = (DBias, DCol, stride_gb, stride_gh, stride_gm, stride_gn)
    lists = (TileCount, TileIdx, stride_cb, stride_ch, stride_tb, stride_th, stride_tp)
    shape = (H, Mq, Mk, D, Dv, qk_scale)
    bias = (Add, stride_ab, stride_ah, stride_am, stride_an, Slopes, stride_sb, stride_sh, alibi_shift,
            Layout, stride_lb, stride_lh, stride_lq, stride_lk, layout_q_off, layout_k_off, block_q, block_k)
    drop = (seed, row_blocks, drop_thresh, drop_scale, c0)
    KEYS: tl.constexpr = (BLOCK_N, GQA, HAS_SEGMENTS, HAS_PADDED, HAS_BAND, BAND_PER_SEGMENT)
    LOOPS: tl.constexpr = (BLOCK_M, HAS_LAYOUT, LAYOUT_EXACT, LIST_ONLY, LIST_TILES)
    FEATURES: tl.constexpr = (HAS_ADDITIVE, HAS_ALIBI, FULL_DBIAS, DBIAS_ACCUM, COL_DBIAS, BLOCK_M, HEAD_DIM, HEAD_DIM_V,
                              EVEN_D, DOT_PRECISION, INDEX_64, HAS_DROPOUT, DROP_ALIGNED, HIDDEN_LINES)
    if OUTER_LOOPS:  # a bias gradient shared by batch rows or heads: one program owns them all
        for bi in range(0, nb_loop):
            for hki in range(0, nhk_loop):
                _dkdv_program(bg * nb_loop + bi, hg * nhk_loop + hki, G, cols, n_end, seg, pid_n, kv_ops, bounds, qdo_ops,
                              grads, lists, shape, bias, drop, KEYS, LOOPS, FEATURES)
    else:
        _dkdv_program(bg, hg, G, cols, n_end, seg, pid_n, kv_ops, bounds, qdo_ops, grads, lists, shape, bias, drop,
                      KEYS, LOOPS, FEATURES)


@triton.jit
def _dq_tile(
    dq, drow, q, do, lse2, delta, n0, qtile, kv, sizes, bias, drop, bias_raw, FEATURES: tl.constexpr,
    MASKED: tl.constexpr, LAYOUT_MASK: tl.constexpr, PRELOADED: tl.constexpr,
):
    """Key tile ``[n0, n0 + BLOCK_N)`` of the program's query tile: accumulates ``dS @ K``; masked
    tiles read only the keys of the program's span ``[key_lo, key_hi)``.

    Grouped arguments as :func:`_dkdv_tile`'s, with ``qtile`` the query tile and ``kv`` the K/V bases."""
    rows, klo, khi, key_lo, key_hi, b, h = qtile
    K_base, V_base, stride_kn, stride_kd, stride_vn, stride_vd = kv
    Mq, Mk, D, Dv, qk_scale = sizes
    seed, drop_base, row_blocks, drop_thresh, drop_scale = drop
    HAS_ADDITIVE: tl.constexpr = FEATURES[0]
    HAS_ALIBI: tl.constexpr = FEATURES[1]
    ROW_DBIAS: tl.constexpr = FEATURES[2]
    BLOCK_N: tl.constexpr = FEATURES[3]
    HEAD_DIM: tl.constexpr = FEATURES[4]
    HEAD_DIM_V: tl.constexpr = FEATURES[5]
    EVEN_D: tl.constexpr = FEATURES[6]
    DOT_PRECISION: tl.constexpr = FEATURES[7]
    INDEX_64: tl.constexpr = FEATURES[8]
    HAS_DROPOUT: tl.constexpr = FEATURES[9]
    HIDDEN_LINES: tl.constexpr = FEATURES[10]
    cols = n0 + tl.arange(0, BLOCK_N)
    if INDEX_64:
        cols64 = cols.to(tl.int64)
    else:
        cols64 = cols
    dkd = tl.arange(0, HEAD_DIM)
    dvd = tl.arange(0, HEAD_DIM_V)
    k_ptrs = K_base + cols64[:, None] * stride_kn + dkd[None, :] * stride_kd
    v_ptrs = V_base + cols64[:, None] * stride_vn + dvd[None, :] * stride_vd
    k = _load_tile(k_ptrs, cols, key_lo, key_hi, Mk, dkd, D, MASKED, HIDDEN_LINES, EVEN_D)
    v = _load_tile(v_ptrs, cols, key_lo, key_hi, Mk, dvd, Dv, MASKED, HIDDEN_LINES, EVEN_D)
    s, vis = _score_tile(  # [BLOCK_M, BLOCK_N]
        q, k, rows[:, None], cols[None, :], cols[None, :], klo[:, None], khi[:, None], n0, b, h, Mq, Mk, qk_scale, bias,
        bias_raw, HAS_ADDITIVE=HAS_ADDITIVE, HAS_ALIBI=HAS_ALIBI, MASKED=MASKED, LAYOUT_MASK=LAYOUT_MASK,
        PRELOADED=PRELOADED, INDEX_64=INDEX_64, DOT_PRECISION=DOT_PRECISION,
    )
    p = tl.math.exp2(s * qk_scale - lse2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        keep = _dropout_keep_tile(seed, drop_base, rows, n0, row_blocks, drop_thresh, rows.shape[0], BLOCK_N)
        dp = tl.where(keep, dp * drop_scale, 0.0)
    ds = p * (dp - delta[:, None])
    if MASKED:  # a key or value hidden from some rows may hold NaN or inf, and 0 · NaN would reach their dq
        ds = tl.where(vis, ds, 0.0)
        k = tl.where((k == k) & (tl.abs(k) < float("inf")), k, tl.zeros_like(k))
    dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    if ROW_DBIAS:
        drow += tl.sum(ds, 1)
    return dq, drow


@triton.jit(do_not_specialize=["B", "n_prog_m", "layout_q_off", "layout_k_off", "block_q", "block_k", "alibi_shift",
                             "seed_lo", "seed_hi", "drop_thresh"])  # values that vary per call: no recompiles
def _attn_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, DRow, Out, DLse, Add, Slopes, Layout, KSeqStart, KSeqLen, KvLens, BandLo, BandHi,
    Sched, TileCount, TileIdx, qk_scale, sm_scale,
    q_strides, k_strides, v_strides, do_strides, dq_strides, o_strides, add_strides, slope_strides, layout_strides,
    count_strides, tile_strides,
    B, H, G, Mq, Mk, D, Dv, n_prog_m, layout_q_off, layout_k_off, block_q, block_k, alibi_shift, seed_lo, seed_hi,
    drop_thresh, drop_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    EVEN_D: tl.constexpr, SCHEDULED: tl.constexpr, HAS_SEGMENTS: tl.constexpr, HAS_PADDED: tl.constexpr,
    HAS_BAND: tl.constexpr, BAND_PER_SEGMENT: tl.constexpr, HAS_LAYOUT: tl.constexpr, LAYOUT_EXACT: tl.constexpr,
    LIST_ONLY: tl.constexpr, LIST_TILES: tl.constexpr, HAS_ADDITIVE: tl.constexpr, HAS_ALIBI: tl.constexpr,
    ROW_DBIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, INDEX_64: tl.constexpr, BATCH_INNER: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, FUSED_DELTA: tl.constexpr, HAS_DLSE: tl.constexpr, HIDDEN_LINES: tl.constexpr,
):
    """Grid ``(query tiles, B * Hq)`` (``(query tiles * B, Hq)`` with ``BATCH_INNER``). Writes ``DQ [B, Hq, Mq, D]`` (and ``DRow [B, Hq, Mq]`` row sums of dS).

    With ``FUSED_DELTA`` the program computes its rows' ``Delta = rowsum(dO * Out) - dLse`` and stores
    it for the dK/dV kernel launched after it (no preprocessing launch); otherwise it reads ``Delta``."""
    stride_qb, stride_qh, stride_qm, stride_qd = q_strides
    stride_kb, stride_kh, stride_kn, stride_kd = k_strides
    stride_vb, stride_vh, stride_vn, stride_vd = v_strides
    stride_dob, stride_doh, stride_dom, stride_dod = do_strides
    stride_dqb, stride_dqh, stride_dqm, stride_dqd = dq_strides
    stride_ob, stride_oh, stride_om, stride_od = o_strides
    stride_ab, stride_ah, stride_am, stride_an = add_strides
    stride_sb, stride_sh = slope_strides
    stride_lb, stride_lh, stride_lq, stride_lk = layout_strides
    stride_cb, stride_ch = count_strides
    stride_tb, stride_th, stride_tp = tile_strides
    pid_m, b, h, pid_bh = _program_ids(B, H, n_prog_m, 1, BATCH_INNER, False)
    hk = h // G
    seed, row_blocks, drop_base = _dropout_stream(pid_bh, Mq, Mk, seed_lo, seed_hi)
    prog, m0, m_end, seg = _query_rows(pid_m, n_prog_m, Mq, Sched, SCHEDULED, BLOCK_M)
    rows = m0 + tl.arange(0, BLOCK_M)
    klo, khi, valid = _row_key_bounds(
        rows, m_end, seg, b, Mk, KSeqStart, KSeqLen, KvLens, BandLo, BandHi, HAS_SEGMENTS, HAS_PADDED, HAS_BAND, BAND_PER_SEGMENT
    )
    lo, hi, full_lo, full_hi = _span(klo, khi, valid)
    key_lo, key_hi = lo, hi  # every key some row sees
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    if INDEX_64:
        rows64 = rows.to(tl.int64)
    else:
        rows64 = rows
    dqd = tl.arange(0, HEAD_DIM)
    dvd = tl.arange(0, HEAD_DIM_V)
    q = _load_lines(Q + b64 * stride_qb + h64 * stride_qh + rows64[:, None] * stride_qm + dqd[None, :] * stride_qd, rows, Mq, dqd, D, True, EVEN_D)
    do = _load_lines(DO + b64 * stride_dob + h64 * stride_doh + rows64[:, None] * stride_dom + dvd[None, :] * stride_dod,
                     rows, Mq, dvd, Dv, True, EVEN_D)
    lse = tl.load(Lse + pid_bh.to(tl.int64) * Mq + rows64, mask=rows < Mq, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    if FUSED_DELTA:
        o = _load_lines(Out + b64 * stride_ob + h64 * stride_oh + rows64[:, None] * stride_om + dvd[None, :] * stride_od,
                        rows, Mq, dvd, Dv, True, EVEN_D)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        if HAS_DLSE:
            delta -= tl.load(DLse + pid_bh.to(tl.int64) * Mq + rows64, mask=rows < Mq, other=0.0)
        tl.store(Delta + pid_bh.to(tl.int64) * Mq + rows64, delta, mask=rows < m_end)  # this program's rows only
    else:
        delta = tl.load(Delta + pid_bh.to(tl.int64) * Mq + rows64, mask=rows < Mq, other=0.0)
    K_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    V_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    qtile = (rows, klo, khi, key_lo, key_hi, b, h)
    kv = (K_base, V_base, stride_kn, stride_kd, stride_vn, stride_vd)
    sizes = (Mq, Mk, D, Dv, qk_scale)
    bias = (Add, stride_ab, stride_ah, stride_am, stride_an, Slopes, stride_sb, stride_sh, alibi_shift,
            Layout, stride_lb, stride_lh, stride_lq, stride_lk, layout_q_off, layout_k_off, block_q, block_k)
    drop = (seed, drop_base, row_blocks, drop_thresh, drop_scale)
    FEATURES: tl.constexpr = (HAS_ADDITIVE, HAS_ALIBI, ROW_DBIAS, BLOCK_N, HEAD_DIM, HEAD_DIM_V, EVEN_D, DOT_PRECISION,
                              INDEX_64, HAS_DROPOUT, HIDDEN_LINES)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    drow = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_LAYOUT:
        count = tl.load(TileCount + b * stride_cb + h * stride_ch + prog)
        tiles = TileIdx + b64 * stride_tb + h64 * stride_th + prog.to(tl.int64) * stride_tp
        if LIST_ONLY:  # every listed tile is fully visible: a loop without branches, which Triton pipelines
            slots, listed = _list_registers(tiles, count, LIST_TILES)
            for t in range(0, count):
                n0 = _list_entry(tiles, t, slots, listed, LIST_TILES) * BLOCK_N
                dq, drow = _dq_tile(
                    dq, drow, q, do, lse2, delta, n0, qtile, kv, sizes, bias, drop, 0.0, FEATURES,
                    MASKED=False, LAYOUT_MASK=False, PRELOADED=False,
                )
        else:
            for t in range(0, count):
                n0 = tl.load(tiles + t) * BLOCK_N
                if (n0 < hi) & (n0 + BLOCK_N > lo):
                    # LAYOUT_EXACT: tiles lie inside layout blocks, so the list settles the layout
                    if LAYOUT_EXACT and (n0 >= full_lo) & (n0 + BLOCK_N <= full_hi):
                        dq, drow = _dq_tile(
                            dq, drow, q, do, lse2, delta, n0, qtile, kv, sizes, bias, drop, 0.0, FEATURES,
                            MASKED=False, LAYOUT_MASK=False, PRELOADED=False,
                        )
                    else:
                        dq, drow = _dq_tile(
                            dq, drow, q, do, lse2, delta, n0, qtile, kv, sizes, bias, drop, 0.0, FEATURES,
                            MASKED=True, LAYOUT_MASK=not LAYOUT_EXACT, PRELOADED=False,
                        )
    else:
        lo = lo // 16 * 16  # 16-aligned tile starts: a bias row is read in 16-byte vectors
        n, a, e = _tile_split(lo, hi, full_lo, full_hi, BLOCK_N)
        for t in range(0, a):
            dq, drow = _dq_tile(
                dq, drow, q, do, lse2, delta, tl.multiple_of(lo + t * BLOCK_N, 16), qtile, kv, sizes, bias, drop, 0.0, FEATURES,
                MASKED=True, LAYOUT_MASK=False, PRELOADED=False,
            )
        nxt = 0.0  # the next key tile's additive tile, loaded one iteration ahead (see the forward)
        if HAS_ADDITIVE:
            nxt = _add_load(rows[:, None], (lo + a * BLOCK_N + tl.arange(0, BLOCK_N))[None, :], b, h, Mq, Mk,
                            Add, stride_ab, stride_ah, stride_am, stride_an, INDEX_64)
        for t in range(a, e):
            n0 = tl.multiple_of(lo + t * BLOCK_N, 16)
            cur = nxt
            if HAS_ADDITIVE:
                nxt = _add_load(rows[:, None], (n0 + BLOCK_N + tl.arange(0, BLOCK_N))[None, :], b, h, Mq, Mk,
                                Add, stride_ab, stride_ah, stride_am, stride_an, INDEX_64)
            dq, drow = _dq_tile(
                dq, drow, q, do, lse2, delta, n0, qtile, kv, sizes, bias, drop, cur, FEATURES,
                MASKED=False, LAYOUT_MASK=False, PRELOADED=HAS_ADDITIVE,
            )
        for t in range(e, n):
            dq, drow = _dq_tile(
                dq, drow, q, do, lse2, delta, tl.multiple_of(lo + t * BLOCK_N, 16), qtile, kv, sizes, bias, drop, 0.0, FEATURES,
                MASKED=True, LAYOUT_MASK=False, PRELOADED=False,
            )
    keep = valid & (rows < Mq)
    dq_ptrs = DQ + b64 * stride_dqb + h64 * stride_dqh + rows64[:, None] * stride_dqm + dqd[None, :] * stride_dqd
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=keep[:, None] & (dqd[None, :] < D))
    if ROW_DBIAS:
        tl.store(DRow + pid_bh.to(tl.int64) * Mq + rows64, drow, mask=keep)
