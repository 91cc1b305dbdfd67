"""Triton helpers shared by the forward and backward kernels: visibility intervals, masks, bias tiles.

Every mask of a :class:`~biasattn.bias.spec.BiasSpec` except the block layout is an interval per
query row (``klo <= j < khi``) and, equally, per key column (``ilo <= i < ihi``): segments, padded
keys and the band each cut an interval, and intervals intersect into an interval. The kernels reduce
these intervals over a tile to find which neighbouring tiles can be visible at all (``lo``/``hi``)
and which are visible in every element (``full_lo``/``full_hi``, no element mask needed).

Score tiles are kept raw (``q·k`` plus the biases divided by ``qk_scale``, which includes ``log2(e)``);
the scale is applied inside the softmax's ``exp2(s · qk_scale - m)``, one multiply-add per score, and
row maxima are taken before scaling, which needs a positive scale.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
BIG = tl.constexpr(1073741824)  # 2**30, "unbounded" in band terms


@triton.jit
def _chunked_ids(pid0, pid1, n_tiles, n_pairs, chunk, TAIL_ORDER: tl.constexpr):
    """``(tile rank, pair)`` of grid position ``(pid0, pid1)`` on a grid ``(n_tiles, n_pairs)``.

    Blocks start in grid order (``pid0`` fastest), one pair's ranks after another's; the launchers
    order ranks heaviest first. The last ``chunk`` pairs start rank by rank instead (rank 0 of each,
    then rank 1, ...), so the last programs to start are the lightest of several pairs and the
    kernel ends in a short tail, not in one pair's heaviest tile. Without ``TAIL_ORDER`` (or with
    ``chunk = 1``) the order is the plain one.
    """
    if not TAIL_ORDER:
        return pid0, pid1
    lin = pid1 * n_tiles + pid0
    head = (n_pairs - chunk) * n_tiles
    r = tl.maximum(lin - head, 0)
    tail = lin >= head
    return tl.where(tail, r // chunk, pid0), tl.where(tail, n_pairs - chunk + r % chunk, pid1)


@triton.jit
def _program_ids(B, H, n_tiles, chunk, BATCH_INNER: tl.constexpr, TAIL_ORDER: tl.constexpr):
    """``(tile program, batch, head, batch·H + head)`` of a query-tile program.

    Grid ``(tiles, B·H)``, its last ``chunk`` (batch, head) pairs started rank by rank
    (:func:`_chunked_ids`); or with ``BATCH_INNER`` ``(tiles·B, H)`` with the batch varying fastest:
    then the programs of one head and tile run side by side, and a bias tile broadcast over the
    batch is read from memory once for all of them (the others hit the L2 cache).
    """
    if BATCH_INNER:
        pid = tl.program_id(0)
        pid_m = pid // B
        b = pid % B
        h = tl.program_id(1)
    else:
        pid_m, pid_bh = _chunked_ids(tl.program_id(0), tl.program_id(1), n_tiles, B * H, chunk, TAIL_ORDER)
        b = pid_bh // H
        h = pid_bh % H
    return pid_m, b, h, b * H + h


@triton.jit
def _query_rows(pid_m, n_prog_m, Mq, Sched, SCHEDULED: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(prog, first row, end row, segment)`` of a query-tile program: packed segments take the host
    table's (first row, end row, segment); otherwise the tiles run in reverse, the heaviest (last) first."""
    if SCHEDULED:
        prog = pid_m
        m0 = tl.load(Sched + pid_m * 3)
        m_end = tl.load(Sched + pid_m * 3 + 1)
        seg = tl.load(Sched + pid_m * 3 + 2)
    else:
        prog = n_prog_m - 1 - pid_m
        m0 = prog * BLOCK_M
        m_end = tl.minimum(m0 + BLOCK_M, Mq)
        seg = 0
    return prog, m0, m_end, seg


@triton.jit
def _dropout_stream(pid_bh, Mq, Mk, seed_lo, seed_hi):
    """``(seed, row_blocks, base)`` of the dropout bits of one ``(batch, head)`` slice: a row holds
    ``ceil(Mk / 8)`` Philox counters, the slice starts at counter ``base``."""
    row_blocks = (Mk + 7) // 8
    return _dropout_seed(seed_lo, seed_hi), row_blocks, pid_bh.to(tl.int64) * Mq * row_blocks


@triton.jit
def _row_key_bounds(
    rows, row_end, seg, b, Mk, KSeqStart, KSeqLen, KvLens, BandLo, BandHi,
    HAS_SEGMENTS: tl.constexpr, HAS_PADDED: tl.constexpr, HAS_BAND: tl.constexpr, BAND_PER_SEGMENT: tl.constexpr,
):
    """Per query row ``rows [BM]``: visible keys ``[klo, khi)`` and whether the row is the program's."""
    klo = tl.zeros_like(rows)
    khi = tl.zeros_like(rows) + Mk
    if HAS_SEGMENTS:
        s = tl.maximum(seg, 0)
        ks = tl.load(KSeqStart + s)
        ke = ks + tl.load(KSeqLen + s)
        ks = tl.where(seg >= 0, ks, 0)
        ke = tl.where(seg >= 0, ke, 0)
        klo = tl.maximum(klo, ks)
        khi = tl.minimum(khi, ke)
    if HAS_PADDED:
        khi = tl.minimum(khi, tl.load(KvLens + b))
    if HAS_BAND:
        if BAND_PER_SEGMENT:
            bi = tl.maximum(seg, 0)
        else:
            bi = 0
        klo = tl.maximum(klo, rows + tl.load(BandLo + bi))
        khi = tl.minimum(khi, rows + tl.load(BandHi + bi) + 1)
    return klo, khi, rows < row_end


@triton.jit
def _col_row_bounds(
    cols, col_end, seg, b, Mq, QSeqStart, KvLens, BandLo, BandHi,
    HAS_SEGMENTS: tl.constexpr, HAS_PADDED: tl.constexpr, HAS_BAND: tl.constexpr, BAND_PER_SEGMENT: tl.constexpr,
):
    """Per key column ``cols [BN]``: visible query rows ``[ilo, ihi)`` and whether the column is the program's."""
    ilo = tl.zeros_like(cols)
    ihi = tl.zeros_like(cols) + Mq
    if HAS_SEGMENTS:
        s = tl.maximum(seg, 0)
        qs = tl.load(QSeqStart + s)
        qe = tl.load(QSeqStart + s + 1)
        qs = tl.where(seg >= 0, qs, 0)
        qe = tl.where(seg >= 0, qe, 0)
        ilo = tl.maximum(ilo, qs)
        ihi = tl.minimum(ihi, qe)
    if HAS_PADDED:
        ihi = tl.where(cols < tl.load(KvLens + b), ihi, 0)
    if HAS_BAND:
        if BAND_PER_SEGMENT:
            bi = tl.maximum(seg, 0)
        else:
            bi = 0
        ilo = tl.maximum(ilo, cols - tl.load(BandHi + bi))
        ihi = tl.minimum(ihi, cols - tl.load(BandLo + bi) + 1)
    return ilo, ihi, cols < col_end


@triton.jit
def _span(lo_v, hi_v, valid):
    """Reduce per-line intervals over a tile: ``(lo, hi)`` spans every visible element, ``[full_lo, full_hi)`` is seen by all lines."""
    nonempty = valid & (lo_v < hi_v)
    lo = tl.min(tl.where(nonempty, lo_v, BIG), 0)
    hi = tl.max(tl.where(nonempty, hi_v, 0), 0)
    full_lo = tl.max(tl.where(valid, lo_v, -BIG), 0)
    full_hi = tl.min(tl.where(valid, hi_v, BIG), 0)
    return lo, hi, full_lo, full_hi


@triton.jit
def _list_registers(tiles, count, LIST_TILES: tl.constexpr):
    """``(slots, listed)``: a program's tile list held in registers (``LIST_TILES > 0``), else nothing."""
    if LIST_TILES > 0:
        slots = tl.arange(0, LIST_TILES)
        listed = tl.load(tiles + slots, mask=slots < count, other=0)
    else:
        slots = 0
        listed = 0
    return slots, listed


@triton.jit
def _list_entry(tiles, t, slots, listed, LIST_TILES: tl.constexpr):
    """Entry ``t`` of a tile list: picked from the registers, so no load sits between the loop counter
    and the tile's address (Triton then prefetches K/V as for a regular loop), or loaded."""
    if LIST_TILES > 0:
        entry = tl.sum(tl.where(slots == t, listed, 0), 0)
    else:
        entry = tl.load(tiles + t)
    return entry


@triton.jit
def _tile_split(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """Tiles ``lo + t*BLOCK``: ``[0, a)`` and ``[e, n)`` need element masks, ``[a, e)`` are fully visible."""
    n = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK)
    a = tl.minimum(tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK), n)
    e = tl.minimum(tl.maximum(tl.maximum(full_hi - lo, 0) // BLOCK, a), n)
    return n, a, e


@triton.jit
def _add_load(ii, jj, b, h, Mq, Mk, Add, stride_ab, stride_ah, stride_am, stride_an, INDEX_64: tl.constexpr):
    """The additive tensor at rows ``ii`` and columns ``jj`` (broadcastable 2-D) in its own dtype, 0 outside."""
    base = Add + b.to(tl.int64) * stride_ab + h.to(tl.int64) * stride_ah
    if INDEX_64:  # offsets inside one (batch, head) slice may pass 2**31
        ptrs = base + ii.to(tl.int64) * stride_am + jj.to(tl.int64) * stride_an
    else:
        ptrs = base + ii * stride_am + jj * stride_an
    return tl.load(ptrs, mask=(ii < Mq) & (jj < Mk), other=0.0)


@triton.jit
def _additive_tile(
    ii, jj, b, h, Mq, Mk, Add, stride_ab, stride_ah, stride_am, stride_an, qk_scale, raw,
    PRELOADED: tl.constexpr, INDEX_64: tl.constexpr,
):
    """The additive tensor at rows ``ii`` and columns ``jj`` (broadcastable 2-D) in float32, in the units
    of the raw score ``q·k`` (base-2 units divided by ``qk_scale``): one multiply per element.

    With ``PRELOADED`` the tile is ``raw`` (from :func:`_add_load`, issued an iteration earlier so
    that its latency hides behind the previous tile's work)."""
    if not PRELOADED:
        raw = _add_load(ii, jj, b, h, Mq, Mk, Add, stride_ab, stride_ah, stride_am, stride_an, INDEX_64)
    return raw.to(tl.float32) * (LOG2E / qk_scale)


@triton.jit
def _alibi_tile(ii, jj, ref, b, h, Slopes, stride_sb, stride_sh, alibi_shift, qk_scale):
    """ALiBi's ``-slope·|j - i - shift|`` at rows ``ii`` and columns ``jj`` (broadcastable 2-D), in the units
    of the raw score ``q·k`` (base-2 units divided by ``qk_scale``).

    Positions are converted to float32 relative to ``ref`` (a position near the tile) while still
    a row or a column vector, so the tile itself costs one subtraction and one multiply-add per
    score instead of integer arithmetic and a conversion; exact while the positions and the shift
    stay within 2**24 of ``ref``."""
    slope = tl.load(Slopes + b * stride_sb + h * stride_sh).to(tl.float32) * (LOG2E / qk_scale)
    return -slope * tl.abs((jj - ref).to(tl.float32) - (ii + alibi_shift - ref).to(tl.float32))


@triton.jit
def _layout_visible(ii, jj, b, h, Layout, stride_lb, stride_lh, stride_lq, stride_lk, layout_q_off, layout_k_off, block_q, block_k):
    """Element visibility from the block layout at rows ``ii`` and columns ``jj`` (broadcastable 2-D)."""
    base = Layout + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
    r = (ii + layout_q_off) // block_q  # layouts hold far fewer than 2**31 blocks per (batch, head)
    c = (jj + layout_k_off) // block_k
    return tl.load(base + r * stride_lq + c * stride_lk) != 0


@triton.jit
def _score_tile(
    x, y, ii, jj, lines, lo, hi, ref, b, h, Mq, Mk, qk_scale, bias, bias_raw,
    HAS_ADDITIVE: tl.constexpr, HAS_ALIBI: tl.constexpr, MASKED: tl.constexpr, LAYOUT_MASK: tl.constexpr,
    PRELOADED: tl.constexpr, INDEX_64: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """``(s, vis)``: the raw scores ``x @ yᵀ`` of one tile (scaled later, in exp2's multiply-add) with the
    additive and ALiBi terms, and on ``MASKED`` tiles ``-inf`` where ``vis`` is False.

    The forward and dQ pass ``x = q``, ``y = k`` (``[BLOCK_M, BLOCK_N]``), dK/dV ``x = k``, ``y = q``
    (transposed, ``[BLOCK_N, BLOCK_M]``). ``ii``/``jj`` are the query rows and key columns broadcast to
    the tile's orientation, ``lines`` whichever of them each line of the tile bounds, ``[lo, hi)`` those
    bounds per line, ``ref`` ALiBi's reference position; ``bias`` the additive, ALiBi and block-layout
    operands. ``vis`` is 0 on unmasked tiles."""
    (Add, stride_ab, stride_ah, stride_am, stride_an, Slopes, stride_sb, stride_sh, alibi_shift,
     Layout, stride_lb, stride_lh, stride_lq, stride_lk, layout_q_off, layout_k_off, block_q, block_k) = bias
    if HAS_ADDITIVE:  # the additive tile enters as the dot's accumulator, in the dot's own layout
        acc = _additive_tile(ii, jj, b, h, Mq, Mk, Add, stride_ab, stride_ah, stride_am, stride_an, qk_scale, bias_raw,
                             PRELOADED, INDEX_64)
        s = tl.dot(x, tl.trans(y), acc=acc, input_precision=DOT_PRECISION)
    else:
        s = tl.dot(x, tl.trans(y), input_precision=DOT_PRECISION)
    if HAS_ALIBI:
        s += _alibi_tile(ii, jj, ref, b, h, Slopes, stride_sb, stride_sh, alibi_shift, qk_scale)
    vis = 0
    if MASKED:
        vis = (lines >= lo) & (lines < hi)
        if LAYOUT_MASK:
            vis = vis & _layout_visible(ii, jj, b, h, Layout, stride_lb, stride_lh, stride_lq, stride_lk,
                                        layout_q_off, layout_k_off, block_q, block_k)
        s = tl.where(vis, s, float("-inf"))
    return s, vis


@triton.jit
def _load_lines(ptrs, lines, line_end, dims, dim_end, MASK_LINES: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a ``[lines, dims]`` tile; masks lines at or past ``line_end`` (when asked) and padded head dims."""
    if MASK_LINES:
        mask = lines[:, None] < line_end
        if not EVEN_D:
            mask = mask & (dims[None, :] < dim_end)
        x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=dims[None, :] < dim_end, other=0.0)
    return x


@triton.jit
def _load_span(ptrs, lines, lo, hi, dims, dim_end, EVEN_D: tl.constexpr):
    """Load a ``[lines, dims]`` tile with the lines outside ``[lo, hi)`` (and padded head dims) as zeros.

    Lines that no row or column of a program can see (keys past a cache length, lines outside every
    packed segment) may hold anything, NaN included; masked tiles read only the program's span."""
    return _load_kept(ptrs, (lines >= lo) & (lines < hi), dims, dim_end, EVEN_D)


@triton.jit
def _load_tile(ptrs, lines, lo, hi, line_end, dims, dim_end, MASKED: tl.constexpr, SPAN: tl.constexpr,
               EVEN_D: tl.constexpr):
    """A K/V or Q/dO tile: lines ``[lo, hi)`` only on masked tiles of specs that can hide lines (``SPAN``),
    else lines before ``line_end`` (masked tiles) or all of them."""
    if MASKED and SPAN:
        x = _load_span(ptrs, lines, lo, hi, dims, dim_end, EVEN_D)
    else:
        x = _load_lines(ptrs, lines, line_end, dims, dim_end, MASKED, EVEN_D)
    return x


@triton.jit
def _load_kept(ptrs, keep, dims, dim_end, EVEN_D: tl.constexpr):
    """Load a ``[lines, dims]`` tile with the lines where ``keep [lines]`` is false (and padded head dims) as zeros."""
    mask = keep[:, None]
    if not EVEN_D:
        mask = mask & (dims[None, :] < dim_end)
    return tl.load(ptrs, mask=mask, other=0.0)


# Dropout. Element (i, j) of the slice of (batch, head) ``bh`` draws 16 random bits: half ``s % 2``
# of word ``s // 2`` (``s = j % 8``) of the Philox4x32 block numbered ``(bh·Mq + i)·ceil(Mk/8) + j // 8``
# under the call's seed. It is kept when those bits are at least ``thresh = round(p·2**16)``, so one
# Philox call serves eight neighbouring keys, and every kernel (and tile shape) draws the same mask.


@triton.jit
def _dropout_seed(seed_lo, seed_hi):
    """The call's 62-bit Philox key from its two 31-bit halves (kernel arguments stay 32-bit)."""
    return (seed_hi.to(tl.int64) << 31) | seed_lo.to(tl.int64)


@triton.jit
def _dropout_keep(seed, row_base, ii, jj, row_blocks, thresh):
    """Keep mask at rows ``ii`` and columns ``jj`` (broadcastable 2-D) of one slice, any alignment.

    ``row_base`` is ``bh · Mq · row_blocks`` (int64), ``row_blocks`` is ``ceil(Mk / 8)``. One Philox
    call per element: :func:`_dropout_keep_tile` gives the same bits for eight times less work."""
    cnt = row_base + ii.to(tl.int64) * row_blocks + (jj // 8).to(tl.int64)
    r0, r1, r2, r3 = tl.randint4x(seed, cnt)
    s = jj % 8
    w = s // 2
    word = tl.where(w == 0, r0, tl.where(w == 1, r1, tl.where(w == 2, r2, r3)))
    bits = tl.where(s % 2 == 0, word & 0xFFFF, word >> 16)
    return bits.to(tl.int32) >= thresh


@triton.jit
def _dropout_keep_tile(seed, row_base, rows, c0, row_blocks, thresh, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Keep mask ``[ROWS, COLS]`` at rows ``rows`` and columns ``c0 + arange(COLS)``, ``c0`` a multiple of 8."""
    cnt = (row_base + rows.to(tl.int64)[:, None] * row_blocks
           + (c0 // 8 + tl.arange(0, COLS // 8)).to(tl.int64)[None, :])
    r0, r1, r2, r3 = tl.randint4x(seed, cnt)
    lo = tl.join(tl.join(r0 & 0xFFFF, r2 & 0xFFFF), tl.join(r1 & 0xFFFF, r3 & 0xFFFF))
    hi = tl.join(tl.join(r0 >> 16, r2 >> 16), tl.join(r1 >> 16, r3 >> 16))
    bits = tl.join(lo, hi)  # [R, COLS / 8, a, b, c] (the last join varies fastest): word 2a + b, half c
    return tl.reshape(bits, (ROWS, COLS)).to(tl.int32) >= thresh


@triton.jit
def _accumulate_visible_pv(acc, alpha, p, s, v, DOT_PRECISION: tl.constexpr):
    """``acc · alpha + p @ v`` in which a key that a row cannot see (score ``-inf``) takes no part in that
    row, even when its value holds NaN or inf (where a plain product gives ``0 * NaN``).

    The product takes the finite values only. A tile that holds a non-finite value then visits its
    keys one by one: the rows that see such a key get, in each dim, what IEEE arithmetic gives
    (+inf, -inf, NaN where both or a NaN). Nothing here keeps another ``[rows, dims]`` tile alive
    beside ``acc``: three 0/1 products did, and spilled the whole kernel (2x slower forwards)."""
    bad = ~(tl.abs(v.to(tl.float32)) < float("inf"))
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), tl.where(bad, 0.0, v).to(v.dtype), input_precision=DOT_PRECISION)
    if tl.sum(tl.sum(bad.to(tl.int32), 1), 0) > 0:
        seen = ((s > float("-inf")) | (s != s)).to(tl.int32)  # a NaN score (a visible NaN key) sees the value too
        keys = tl.arange(0, s.shape[1])
        bad_key = tl.max(bad.to(tl.int32), 1)
        vf = v.to(tl.float32)
        for j in range(0, s.shape[1]):
            if tl.max(tl.where(keys == j, bad_key, 0), 0) > 0:
                row = tl.max(tl.where(keys[None, :] == j, seen, 0), 1) > 0  # the rows that see key j
                vj = tl.sum(tl.where(keys[:, None] == j, vf, 0.0), 0)  # its value
                acc = tl.where(row[:, None] & (vj == float("inf"))[None, :],
                               tl.where(acc == float("-inf"), float("nan"), float("inf")), acc)
                acc = tl.where(row[:, None] & (vj == float("-inf"))[None, :],
                               tl.where(acc == float("inf"), float("nan"), float("-inf")), acc)
                acc = tl.where(row[:, None] & (vj != vj)[None, :], float("nan"), acc)
    return acc
