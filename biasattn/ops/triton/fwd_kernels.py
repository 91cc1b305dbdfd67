"""The forward flash-attention kernel: online softmax over the key tiles a query tile can see.

One program computes ``out [BLOCK_M, Dv]`` and ``lse [BLOCK_M]`` of one query tile of one
(batch, head). Each :class:`~biasattn.bias.spec.BiasSpec` field is a compile-time switch. Key tiles
outside the tile's visible span are never visited; tiles that every row sees entirely run without
an element mask; with a block layout the program walks a precomputed list of visible key tiles.
"""

import triton
import triton.language as tl

from .common_kernels import (
    LN2,
    _accumulate_visible_pv,
    _add_load,
    _dropout_keep_tile,
    _dropout_stream,
    _list_entry,
    _list_registers,
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
def _online_softmax(s, m_i, qk_scale, GUARD: tl.constexpr):
    """``(m_new, p, alpha, row sums of p)`` of one tile of raw scores ``s`` against the running max ``m_i``
    (base 2); ``GUARD`` where a row may have seen nothing yet (keeps exp2 away from inf - inf)."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # qk_scale > 0: the scale commutes with the max
    if GUARD:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.math.exp2(s * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    return m_new, p, alpha, tl.sum(p, 1)


@triton.jit
def _fwd_tile(
    acc, m_i, l_i, q, n0, qtile, kv, sizes, bias, drop, bias_raw, FEATURES: tl.constexpr,
    MASKED: tl.constexpr, LAYOUT_MASK: tl.constexpr, PRELOADED: tl.constexpr, TMA_KV: tl.constexpr, EXACT: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM_V: tl.constexpr, EVEN_D: tl.constexpr, INDEX_64: tl.constexpr,
    SPAN_CUT: tl.constexpr = True,
):
    """One key tile ``[n0, n0 + BLOCK_N)`` of the online softmax.

    Grouped arguments: ``qtile`` the query tile (rows, their key bounds and
    span, batch, head, KV head), ``kv`` the K/V bases and strides, ``sizes`` ``(Mq, Mk, D, Dv,
    qk_scale)``, ``bias`` the additive, ALiBi and block-layout operands, ``drop`` the dropout stream,
    ``FEATURES`` the switches every tile of a launch shares.

    With ``TMA_KV``, the tile comes through ``K_base``/``V_base``, tensor descriptors of the whole
    ``[B, Hkv, Mk, D]`` K and V: the copy engine fetches it and fills keys past ``Mk`` and dims past
    ``D`` with zeros. Otherwise it comes through the pointers ``KP_base``/``VP_base``, and a masked
    tile reads only the keys of the program's span ``[key_lo, key_hi)``. Keys that a row cannot see
    may hold anything, NaN included. Hidden scores are masked with ``where``, so a hidden key's NaN
    or inf reaches no row through its score. On masked tiles the values of keys outside the span are
    zeros (a masked load, or with ``SPAN_CUT`` a ``where`` after a TMA load), so such a value reaches
    no row of the program; without ``SPAN_CUT`` (launches whose marked rows
    :func:`_attn_fwd_exact_kernel` computes again) it may reach them as ``0 * NaN``, and the exact
    pass then takes it out. With ``EXACT`` (that kernel) it reaches no row that cannot see it."""
    rows, klo, khi, key_lo, key_hi, b, h, hk = qtile
    K_base, V_base, KP_base, VP_base, stride_kn, stride_kd, stride_vn, stride_vd = kv
    Mq, Mk, D, Dv, qk_scale = sizes
    Add, stride_ab, stride_ah, stride_am, stride_an = bias[0], bias[1], bias[2], bias[3], bias[4]  # the exact pass's reload
    seed, drop_base, row_blocks, drop_thresh = drop
    HAS_ADDITIVE: tl.constexpr = FEATURES[0]
    HAS_ALIBI: tl.constexpr = FEATURES[1]
    HEAD_DIM: tl.constexpr = FEATURES[2]
    DOT_PRECISION: tl.constexpr = FEATURES[3]
    HAS_DROPOUT: tl.constexpr = FEATURES[4]
    HIDDEN_LINES: tl.constexpr = FEATURES[5]
    cols = n0 + tl.arange(0, BLOCK_N)
    if INDEX_64:
        cols64 = cols.to(tl.int64)
    else:
        cols64 = cols
    dk = tl.arange(0, HEAD_DIM)
    dv = tl.arange(0, HEAD_DIM_V)
    if TMA_KV:  # both loads first: the pipeliner then waits on one barrier and syncs the CTA once per tile
        k = K_base.load([b, hk, n0, 0]).reshape(BLOCK_N, HEAD_DIM)
        if not (MASKED and SPAN_CUT and HEAD_DIM_V >= 256):  # a D=256 tile that cuts V waits for it until its use
            v = V_base.load([b, hk, n0, 0]).reshape(BLOCK_N, HEAD_DIM_V)  # (below): cut from here, it spills
    else:
        k = _load_tile(KP_base + cols64[:, None] * stride_kn + dk[None, :] * stride_kd, cols, key_lo, key_hi, Mk,
                       dk, D, MASKED, HIDDEN_LINES, EVEN_D)
    s, vis = _score_tile(  # [BLOCK_M, BLOCK_N]
        q, k, rows[:, None], cols[None, :], cols[None, :], klo[:, None], khi[:, None], n0, b, h, Mq, Mk, qk_scale, bias,
        bias_raw, HAS_ADDITIVE=HAS_ADDITIVE, HAS_ALIBI=HAS_ALIBI, MASKED=MASKED, LAYOUT_MASK=LAYOUT_MASK,
        PRELOADED=PRELOADED, INDEX_64=INDEX_64, DOT_PRECISION=DOT_PRECISION,
    )
    m_new, p, alpha, row_sum = _online_softmax(s, m_i, qk_scale, MASKED or HAS_ADDITIVE)
    if HAS_ADDITIVE and EXACT:  # a NaN score: a non-finite key, which an additive -inf may hide from some rows
        if tl.sum((row_sum != row_sum).to(tl.int32), 0) > 0:
            add = _add_load(rows[:, None], cols[None, :], b, h, Mq, Mk, Add, stride_ab, stride_ah, stride_am, stride_an,
                            INDEX_64)
            s = tl.where(add == float("-inf"), float("-inf"), s)
            m_new, p, alpha, row_sum = _online_softmax(s, m_i, qk_scale, True)
    l_i = l_i * alpha + row_sum
    if HAS_DROPOUT:  # the normalizer sums every probability; only the kept ones reach the output
        keep = _dropout_keep_tile(seed, drop_base, rows, n0, row_blocks, drop_thresh, rows.shape[0], BLOCK_N)
        p = tl.where(keep, p, 0.0)
    # a masked tile takes only the values of its span's keys: a NaN or inf in a value that no row of
    # the program sees (past the causal diagonal, outside the band) would reach every row as 0 * NaN
    if not TMA_KV:
        v = _load_tile(VP_base + cols64[:, None] * stride_vn + dv[None, :] * stride_vd, cols, key_lo, key_hi, Mk,
                       dv, Dv, MASKED, True, EVEN_D)
    elif MASKED:
        if SPAN_CUT and HEAD_DIM_V >= 256:
            v = V_base.load([b, hk, n0, 0]).reshape(BLOCK_N, HEAD_DIM_V)
        if SPAN_CUT:  # one pass over V in registers, held across the softmax: it costs registers
            v = tl.where(((cols >= key_lo) & (cols < key_hi))[:, None], v, 0.0).to(v.dtype)
    if EXACT:
        acc = _accumulate_visible_pv(acc, alpha, p, s, v, DOT_PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _store_rows(acc, m_i, l_i, o_ptrs, lse_ptrs, keep, dims, dim_end, drop_scale, HAS_DROPOUT: tl.constexpr,
                MARK_NONFINITE: tl.constexpr):
    """Normalize and store ``out`` of one query tile (``dims`` of its rows) and its natural-log ``lse``;
    rows that saw no key get 0 and -inf. With ``MARK_NONFINITE``, a row whose output holds a NaN or
    inf gets a NaN lse: :func:`_attn_fwd_exact_kernel` computes such rows' programs again."""
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    if HAS_DROPOUT:
        out = out * drop_scale
    tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=keep[:, None] & (dims[None, :] < dim_end))
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    if MARK_NONFINITE:
        lse = tl.where(tl.abs(tl.sum(acc, 1)) < float("inf"), lse, float("nan"))  # a NaN or inf anywhere in the row
    tl.store(lse_ptrs, lse, mask=keep)


@triton.jit(do_not_specialize=["n_prog_m", "layout_q_off", "layout_k_off", "block_q", "block_k", "alibi_shift",
                             "seed_lo", "seed_hi", "drop_thresh"])
def _attn_fwd_exact_kernel(
    Q, KP, VP, Out, Lse, Add, Slopes, Layout, QSeqStart, KSeqStart, KSeqLen, KvLens, BandLo, BandHi, Sched,
    qk_scale,
    q_strides, k_strides, v_strides, o_strides, add_strides, slope_strides, layout_strides,
    H, G, Mq, Mk, D, Dv, n_prog_m, layout_q_off, layout_k_off, block_q, block_k, alibi_shift, seed_lo,
    seed_hi, drop_thresh, drop_scale,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, SCHEDULED: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr, HAS_PADDED: tl.constexpr, HAS_BAND: tl.constexpr, BAND_PER_SEGMENT: tl.constexpr,
    HAS_LAYOUT: tl.constexpr, HAS_ADDITIVE: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HIDDEN_LINES: tl.constexpr, SUB_M: tl.constexpr, TILES: tl.constexpr,
):
    """The forward again for the programs of :func:`_attn_fwd_kernel` that marked a row (a NaN lse),
    each non-finite value kept from the rows that cannot see it; the other programs return at once.

    Where rows of a program see different keys of its span (a band, a block layout finer than the
    tile, an additive -inf), a NaN or inf in a value that some rows cannot see reaches them as
    ``0 * NaN`` in the pipelined kernel. This rare path runs the marked rows' blocks of ``SUB_M``
    rows, 16 keys by 16 value dims at a time, every tile masked: a kernel of its own, so the pipelined
    one keeps its registers, and a small one, so the programs that return at once cost little.

    Grid ``(ceil(query tiles / TILES), B * Hq)``: a program checks the lse of ``TILES`` query tiles
    of one (batch, head) with one load, then computes the marked tiles again one by one."""
    stride_qb, stride_qh, stride_qm, stride_qd = q_strides
    stride_kb, stride_kh, stride_kn, stride_kd = k_strides
    stride_vb, stride_vh, stride_vn, stride_vd = v_strides
    stride_ob, stride_oh, stride_om, stride_od = o_strides
    stride_ab, stride_ah, stride_am, stride_an = add_strides
    stride_sb, stride_sh = slope_strides
    stride_lb, stride_lh, stride_lq, stride_lk = layout_strides
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    slots = tl.arange(0, TILES)
    tiles = tl.program_id(0) * TILES + slots
    in_grid = tiles < n_prog_m
    if SCHEDULED:  # a tile's rows are the table's (first row, end row)
        firsts = tl.load(Sched + tiles * 3, mask=in_grid, other=0)
        ends = tl.load(Sched + tiles * 3 + 1, mask=in_grid, other=0)
    else:
        firsts = tiles * BLOCK_M
        ends = tl.minimum(firsts + BLOCK_M, Mq)
    rows = firsts[:, None] + tl.arange(0, BLOCK_M)[None, :]
    lse_tiles = tl.load(Lse + pid_bh.to(tl.int64) * Mq + rows, mask=in_grid[:, None] & (rows < ends[:, None]), other=0.0)
    marked = tl.sum((lse_tiles != lse_tiles).to(tl.int32), 1)  # [TILES]: marked rows per tile
    FEATURES: tl.constexpr = (HAS_ADDITIVE, HAS_ALIBI, HEAD_DIM, DOT_PRECISION, HAS_DROPOUT, HIDDEN_LINES)
    if tl.sum(marked, 0) > 0:
        seed, row_blocks, drop_base = _dropout_stream(pid_bh, Mq, Mk, seed_lo, seed_hi)
        drop = (seed, drop_base, row_blocks, drop_thresh)
        bias = (Add, stride_ab, stride_ah, stride_am, stride_an, Slopes, stride_sb, stride_sh, alibi_shift,
                Layout, stride_lb, stride_lh, stride_lq, stride_lk, layout_q_off, layout_k_off, block_q, block_k)
        hk = h // G
        b64 = b.to(tl.int64)
        KP_base = KP + b64 * stride_kb + hk.to(tl.int64) * stride_kh
        VP_base = VP + b64 * stride_vb + hk.to(tl.int64) * stride_vh
        dq = tl.arange(0, HEAD_DIM)
        dims = tl.arange(0, 16)
        for t in range(0, TILES):
            if tl.sum(tl.where(slots == t, marked, 0), 0) > 0:
                tile = tl.program_id(0) * TILES + t
                if SCHEDULED:
                    pid_m = tile
                else:  # _query_rows runs unscheduled tiles in reverse
                    pid_m = n_prog_m - 1 - tile
                prog, m0, m_end, seg = _query_rows(pid_m, n_prog_m, Mq, Sched, SCHEDULED, BLOCK_M)
                for r0 in range(0, BLOCK_M, SUB_M):  # the marked rows' blocks of SUB_M rows
                    sub = m0 + r0 + tl.arange(0, SUB_M)
                    klo, khi, sub_valid = _row_key_bounds(
                        sub, m_end, seg, b, Mk, KSeqStart, KSeqLen, KvLens, BandLo, BandHi, HAS_SEGMENTS, HAS_PADDED, HAS_BAND,
                        BAND_PER_SEGMENT,
                    )
                    keep = sub_valid & (sub < Mq)
                    sub64 = sub.to(tl.int64)
                    lse_ptrs = Lse + pid_bh.to(tl.int64) * Mq + sub64
                    again = tl.load(lse_ptrs, mask=keep, other=0.0)
                    if tl.sum((again != again).to(tl.int32), 0) > 0:
                        lo, hi, full_lo, full_hi = _span(klo, khi, sub_valid)
                        q = _load_lines(Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + sub64[:, None] * stride_qm
                                        + dq[None, :] * stride_qd, sub, Mq, dq, D, True, EVEN_D)
                        o_rows = Out + b64 * stride_ob + h.to(tl.int64) * stride_oh + sub64 * stride_om
                        for c0 in range(0, Dv, 16):
                            m_i = tl.full([SUB_M], float("-inf"), dtype=tl.float32)
                            l_i = tl.zeros([SUB_M], dtype=tl.float32)
                            acc = tl.zeros([SUB_M, 16], dtype=tl.float32)
                            for n0 in range(lo // 16 * 16, hi, 16):
                                acc, m_i, l_i = _fwd_tile(
                                    acc, m_i, l_i, q, tl.multiple_of(n0, 16), (sub, klo, khi, lo, hi, b, h, hk),
                                    (KP_base, VP_base + c0 * stride_vd, KP_base, VP_base + c0 * stride_vd, stride_kn, stride_kd,
                                     stride_vn, stride_vd), (Mq, Mk, D, Dv - c0, qk_scale), bias, drop, 0.0, FEATURES,
                                    MASKED=True, LAYOUT_MASK=HAS_LAYOUT, PRELOADED=False, TMA_KV=False, EXACT=True,
                                    BLOCK_N=16, HEAD_DIM_V=16, EVEN_D=False, INDEX_64=True,
                                )
                            _store_rows(acc, m_i, l_i, o_rows[:, None] + (c0 + dims)[None, :] * stride_od, lse_ptrs, keep, dims,
                                        Dv - c0, drop_scale, HAS_DROPOUT, False)


@triton.jit(do_not_specialize=["B", "n_prog_m", "chunk", "layout_q_off", "layout_k_off", "block_q", "block_k", "alibi_shift",
                             "seed_lo", "seed_hi", "drop_thresh"])  # values that vary per call: no recompiles
def _attn_fwd_kernel(
    Q, K, V, KP, VP, Out, Lse, Add, Slopes, Layout, QSeqStart, KSeqStart, KSeqLen, KvLens, BandLo, BandHi, Sched,
    TileCount, TileIdx, qk_scale,
    q_strides, k_strides, v_strides, o_strides, add_strides, slope_strides, layout_strides, count_strides,
    tile_strides,
    B, H, G, Mq, Mk, D, Dv, n_prog_m, chunk, layout_q_off, layout_k_off, block_q, block_k, alibi_shift, seed_lo,
    seed_hi, drop_thresh, drop_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    EVEN_D: tl.constexpr, SCHEDULED: tl.constexpr, HAS_SEGMENTS: tl.constexpr, HAS_PADDED: tl.constexpr,
    HAS_BAND: tl.constexpr, BAND_PER_SEGMENT: tl.constexpr, HAS_LAYOUT: tl.constexpr, LAYOUT_EXACT: tl.constexpr,
    LIST_ONLY: tl.constexpr, HAS_ADDITIVE: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INDEX_64: tl.constexpr, BATCH_INNER: tl.constexpr, HAS_DROPOUT: tl.constexpr, LIST_TILES: tl.constexpr,
    TAIL_ORDER: tl.constexpr, TMA_KV: tl.constexpr, TMA_EDGES: tl.constexpr, HIDDEN_LINES: tl.constexpr,
    MARKED: tl.constexpr,
):
    """Grid ``(query tiles, B * Hq)`` (``(query tiles * B, Hq)`` with ``BATCH_INNER``). Writes ``Out [B, Hq, Mq, Dv]`` and ``Lse [B, Hq, Mq]`` (natural log).

    With ``HAS_DROPOUT`` the output is the dropped, rescaled one; ``Lse`` stays that of the full softmax.
    With ``TMA_KV``, ``K`` and ``V`` are tensor descriptors (Hopper's copy engine) and ``KP``/``VP``
    the same tensors as pointers; the unmasked tiles come through the descriptors, the masked ones too
    with ``TMA_EDGES`` (without cache lengths: the keys past a cache's length are never read, while a
    key that packed segments hide from every row may be read whole with its tile, its value cut to
    zero or its rows computed again by :func:`_attn_fwd_exact_kernel`). ``MARKED`` launches (the
    launcher's :func:`~biasattn.ops.triton.flash.marked_rows`) give a row whose output holds a NaN or
    inf a NaN lse, which that kernel computes again; their masked tiles need not cut the values of
    keys outside the span."""
    stride_qb, stride_qh, stride_qm, stride_qd = q_strides
    stride_kb, stride_kh, stride_kn, stride_kd = k_strides
    stride_vb, stride_vh, stride_vn, stride_vd = v_strides
    stride_ob, stride_oh, stride_om, stride_od = o_strides
    stride_ab, stride_ah, stride_am, stride_an = add_strides
    stride_sb, stride_sh = slope_strides
    stride_lb, stride_lh, stride_lq, stride_lk = layout_strides
    stride_cb, stride_ch = count_strides
    stride_tb, stride_th, stride_tp = tile_strides
    pid_m, b, h, pid_bh = _program_ids(B, H, n_prog_m, chunk, BATCH_INNER, TAIL_ORDER)
    seed, row_blocks, drop_base = _dropout_stream(pid_bh, Mq, Mk, seed_lo, seed_hi)
    hk = h // G
    prog, m0, m_end, seg = _query_rows(pid_m, n_prog_m, Mq, Sched, SCHEDULED, BLOCK_M)
    rows = m0 + tl.arange(0, BLOCK_M)
    klo, khi, valid = _row_key_bounds(
        rows, m_end, seg, b, Mk, KSeqStart, KSeqLen, KvLens, BandLo, BandHi, HAS_SEGMENTS, HAS_PADDED, HAS_BAND, BAND_PER_SEGMENT
    )
    lo, hi, full_lo, full_hi = _span(klo, khi, valid)
    key_lo, key_hi = lo, hi  # every key some row sees

    b64 = b.to(tl.int64)
    if INDEX_64:
        rows64 = rows.to(tl.int64)
    else:
        rows64 = rows
    dq = tl.arange(0, HEAD_DIM)
    q_base = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh
    q = _load_lines(q_base + rows64[:, None] * stride_qm + dq[None, :] * stride_qd, rows, Mq, dq, D, True, EVEN_D)
    KP_base = KP + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    VP_base = VP + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    if TMA_KV:
        K_base = K
        V_base = V
    else:
        K_base = KP_base
        V_base = VP_base

    qtile = (rows, klo, khi, key_lo, key_hi, b, h, hk)
    kv = (K_base, V_base, KP_base, VP_base, stride_kn, stride_kd, stride_vn, stride_vd)
    sizes = (Mq, Mk, D, Dv, qk_scale)
    bias = (Add, stride_ab, stride_ah, stride_am, stride_an, Slopes, stride_sb, stride_sh, alibi_shift,
            Layout, stride_lb, stride_lh, stride_lq, stride_lk, layout_q_off, layout_k_off, block_q, block_k)
    drop = (seed, drop_base, row_blocks, drop_thresh)
    FEATURES: tl.constexpr = (HAS_ADDITIVE, HAS_ALIBI, HEAD_DIM, DOT_PRECISION, HAS_DROPOUT, HIDDEN_LINES)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    if HAS_LAYOUT:  # walk the precomputed list of key tiles the layout leaves visible
        count = tl.load(TileCount + b * stride_cb + h * stride_ch + prog)
        tiles = TileIdx + b64 * stride_tb + h.to(tl.int64) * stride_th + prog.to(tl.int64) * stride_tp
        if LIST_ONLY:  # every listed tile is fully visible: a loop without branches, which Triton pipelines
            slots, listed = _list_registers(tiles, count, LIST_TILES)
            for t in range(0, count):
                n0 = _list_entry(tiles, t, slots, listed, LIST_TILES) * BLOCK_N
                acc, m_i, l_i = _fwd_tile(
                    acc, m_i, l_i, q, n0, qtile, kv, sizes, bias, drop, 0.0, FEATURES,
                    MASKED=False, LAYOUT_MASK=False, PRELOADED=False, TMA_KV=TMA_KV, EXACT=False,
                    BLOCK_N=BLOCK_N, HEAD_DIM_V=HEAD_DIM_V, EVEN_D=EVEN_D, INDEX_64=INDEX_64,
                )
        else:
            for t in range(0, count):
                n0 = tl.load(tiles + t) * BLOCK_N
                if (n0 < hi) & (n0 + BLOCK_N > lo):
                    # LAYOUT_EXACT: tiles lie inside layout blocks, so the list settles the layout
                    if LAYOUT_EXACT and (n0 >= full_lo) & (n0 + BLOCK_N <= full_hi):
                        acc, m_i, l_i = _fwd_tile(
                            acc, m_i, l_i, q, n0, qtile, kv, sizes, bias, drop, 0.0, FEATURES,
                            MASKED=False, LAYOUT_MASK=False, PRELOADED=False, TMA_KV=TMA_KV, EXACT=False,
                            BLOCK_N=BLOCK_N, HEAD_DIM_V=HEAD_DIM_V, EVEN_D=EVEN_D, INDEX_64=INDEX_64,
                        )
                    else:
                        acc, m_i, l_i = _fwd_tile(
                            acc, m_i, l_i, q, n0, qtile, kv, sizes, bias, drop, 0.0, FEATURES,
                            MASKED=True, LAYOUT_MASK=not LAYOUT_EXACT, PRELOADED=False, TMA_KV=TMA_EDGES, EXACT=False,
                            BLOCK_N=BLOCK_N, HEAD_DIM_V=HEAD_DIM_V, EVEN_D=EVEN_D, INDEX_64=INDEX_64, SPAN_CUT=not MARKED,
                        )
    else:  # masked tiles at the span's left edge, unmasked middle, masked right edge
        lo = lo // 16 * 16  # 16-aligned tile starts: a bias row is read in 16-byte vectors
        n, a, e = _tile_split(lo, hi, full_lo, full_hi, BLOCK_N)
        for t in range(0, a):
            acc, m_i, l_i = _fwd_tile(
                acc, m_i, l_i, q, tl.multiple_of(lo + t * BLOCK_N, 16), qtile, kv, sizes, bias, drop, 0.0, FEATURES,
                MASKED=True, LAYOUT_MASK=False, PRELOADED=False, TMA_KV=TMA_EDGES, EXACT=False,
                BLOCK_N=BLOCK_N, HEAD_DIM_V=HEAD_DIM_V, EVEN_D=EVEN_D, INDEX_64=INDEX_64, SPAN_CUT=not MARKED,
            )
        # the additive tile of the next key tile is loaded one iteration ahead: Triton pipelines only
        # dot operands, and a bias load waited on at once would stall every iteration
        nxt = 0.0
        if HAS_ADDITIVE:
            nxt = _add_load(rows[:, None], (lo + a * BLOCK_N + tl.arange(0, BLOCK_N))[None, :], b, h, Mq, Mk,
                            Add, stride_ab, stride_ah, stride_am, stride_an, INDEX_64)
        for t in range(a, e):
            n0 = tl.multiple_of(lo + t * BLOCK_N, 16)
            cur = nxt
            if HAS_ADDITIVE:
                nxt = _add_load(rows[:, None], (n0 + BLOCK_N + tl.arange(0, BLOCK_N))[None, :], b, h, Mq, Mk,
                                Add, stride_ab, stride_ah, stride_am, stride_an, INDEX_64)
            acc, m_i, l_i = _fwd_tile(
                acc, m_i, l_i, q, n0, qtile, kv, sizes, bias, drop, cur, FEATURES,
                MASKED=False, LAYOUT_MASK=False, PRELOADED=HAS_ADDITIVE, TMA_KV=TMA_KV, EXACT=False,
                BLOCK_N=BLOCK_N, HEAD_DIM_V=HEAD_DIM_V, EVEN_D=EVEN_D, INDEX_64=INDEX_64,
            )
        for t in range(e, n):
            acc, m_i, l_i = _fwd_tile(
                acc, m_i, l_i, q, tl.multiple_of(lo + t * BLOCK_N, 16), qtile, kv, sizes, bias, drop, 0.0, FEATURES,
                MASKED=True, LAYOUT_MASK=False, PRELOADED=False, TMA_KV=TMA_EDGES, EXACT=False,
                BLOCK_N=BLOCK_N, HEAD_DIM_V=HEAD_DIM_V, EVEN_D=EVEN_D, INDEX_64=INDEX_64, SPAN_CUT=not MARKED,
            )

    keep = valid & (rows < Mq)
    dv = tl.arange(0, HEAD_DIM_V)
    o_rows = Out + b64 * stride_ob + h.to(tl.int64) * stride_oh + rows64 * stride_om
    lse_ptrs = Lse + pid_bh.to(tl.int64) * Mq + rows64
    # rows whose output a hidden non-finite value may have reached: see _attn_fwd_exact_kernel
    _store_rows(acc, m_i, l_i, o_rows[:, None] + dv[None, :] * stride_od, lse_ptrs, keep, dv, Dv, drop_scale, HAS_DROPOUT,
                MARKED)
