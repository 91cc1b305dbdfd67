"""Kernels around the gradient of an additive bias: its sum over sharers, and dQ read back from it.

``_attn_bwd_dbias_kernel`` computes a gradient shared by batch rows or heads, ``dBias = sum dS``.

One program owns one ``[BLOCK_M, BLOCK_N]`` tile of one bias slice and loops over the (batch row,
head) pairs that read it, recomputing ``P`` and ``dP`` from ``Q``, ``K``, ``V``, ``dO`` and the
forward's ``lse``; the sum stays in registers and is written once. Deterministic, and neither a
read-modify-write of the gradient per batch row nor a per-row workspace. Without packed segments
only (a tile may then straddle documents); the dK/dV kernel serves that case.
"""

import triton
import triton.language as tl

from .common_kernels import (
    LOG2E,
    _add_load,
    _additive_tile,
    _alibi_tile,
    _dropout_keep_tile,
    _dropout_seed,
    _layout_visible,
    _load_lines,
    _load_span,
    _row_key_bounds,
    _span,
)


@triton.jit(do_not_specialize=["n_sharers", "layout_q_off", "layout_k_off", "block_q", "block_k", "alibi_shift",
                             "seed_lo", "seed_hi", "drop_thresh"])
def _attn_bwd_dbias_kernel(
    Q, K, V, DO, Lse, Delta, DBias, Add, Slopes, Layout, KvLens, BandLo, BandHi, qk_scale,
    q_strides, k_strides, v_strides, do_strides, g_strides, add_strides, slope_strides, layout_strides,
    H, G, Hb, Mq, Mk, D, Dv, n_tiles_n, n_sharers, heads_shared, layout_q_off, layout_k_off, block_q, block_k,
    alibi_shift, seed_lo, seed_hi, drop_thresh, drop_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    EVEN_D: tl.constexpr, HAS_PADDED: tl.constexpr, HAS_BAND: tl.constexpr, HAS_LAYOUT: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, INDEX_64: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    """Grid ``(query tiles * key tiles, Bb * Hb)`` for a gradient ``DBias [Bb, Hb, Mq, Mk]``.

    The program's sharers are ``n_sharers`` (batch row, head) pairs: ``i`` maps to batch row
    ``bb + i // heads_shared`` and head ``hh + i % heads_shared``, with ``bb`` = 0 when the bias is
    broadcast over the batch and ``hh`` = 0 when it is broadcast over heads (``heads_shared`` = H),
    else ``heads_shared`` = 1.
    """
    stride_qb, stride_qh, stride_qm, stride_qd = q_strides
    stride_kb, stride_kh, stride_kn, stride_kd = k_strides
    stride_vb, stride_vh, stride_vn, stride_vd = v_strides
    stride_dob, stride_doh, stride_dom, stride_dod = do_strides
    stride_gb, stride_gh, stride_gm, stride_gn = g_strides
    stride_ab, stride_ah, stride_am, stride_an = add_strides
    stride_sb, stride_sh = slope_strides
    stride_lb, stride_lh, stride_lq, stride_lk = layout_strides
    pid = tl.program_id(0)
    tm = pid // n_tiles_n
    tn = pid % n_tiles_n
    pid_g = tl.program_id(1)
    bb = pid_g // Hb
    hh = pid_g % Hb
    rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    if INDEX_64:
        rows64 = rows.to(tl.int64)
        cols64 = cols.to(tl.int64)
    else:
        rows64 = rows
        cols64 = cols
    vis0 = (rows[:, None] < Mq) & (cols[None, :] < Mk)
    visible = tm * BLOCK_M < Mq
    if HAS_BAND:  # the band does not depend on the batch row: whole tiles outside it are skipped
        klo = rows + tl.load(BandLo)
        khi = rows + tl.load(BandHi) + 1
        vis0 = vis0 & (cols[None, :] >= klo[:, None]) & (cols[None, :] < khi[:, None])
        in_rows = rows < Mq
        lo = tl.min(tl.where(in_rows, klo, Mk), 0)
        hi = tl.max(tl.where(in_rows, khi, 0), 0)
        visible = visible & (tn * BLOCK_N < hi) & (tn * BLOCK_N + BLOCK_N > lo)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    seed = _dropout_seed(seed_lo, seed_hi)
    row_blocks = (Mk + 7) // 8
    if visible:
        raw = _add_load(rows[:, None], cols[None, :], bb, hh, Mq, Mk, Add, stride_ab, stride_ah, stride_am, stride_an, INDEX_64)
        dqd = tl.arange(0, HEAD_DIM)
        dvd = tl.arange(0, HEAD_DIM_V)
        for i in range(0, n_sharers):
            b = bb + i // heads_shared
            h = hh + i % heads_shared
            b64 = b.to(tl.int64)
            h64 = h.to(tl.int64)
            hk64 = (h // G).to(tl.int64)
            key_end = Mk
            if HAS_PADDED:  # keys past the cache length may hold anything: never read
                key_end = tl.minimum(tl.load(KvLens + b), Mk)
            q = _load_lines(Q + b64 * stride_qb + h64 * stride_qh + rows64[:, None] * stride_qm + dqd[None, :] * stride_qd,
                            rows, Mq, dqd, D, True, EVEN_D)
            do = _load_lines(DO + b64 * stride_dob + h64 * stride_doh + rows64[:, None] * stride_dom + dvd[None, :] * stride_dod,
                             rows, Mq, dvd, Dv, True, EVEN_D)
            k = _load_lines(K + b64 * stride_kb + hk64 * stride_kh + cols64[:, None] * stride_kn + dqd[None, :] * stride_kd,
                            cols, key_end, dqd, D, True, EVEN_D)
            v = _load_lines(V + b64 * stride_vb + hk64 * stride_vh + cols64[:, None] * stride_vn + dvd[None, :] * stride_vd,
                            cols, key_end, dvd, Dv, True, EVEN_D)
            ld = (b64 * H + h64) * Mq + rows64
            lse = tl.load(Lse + ld, mask=rows < Mq, other=float("-inf"))
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # rows that saw nothing get p = 0
            delta = tl.load(Delta + ld, mask=rows < Mq, other=0.0)
            bias = _additive_tile(rows[:, None], cols[None, :], b, h, Mq, Mk, Add, stride_ab, stride_ah, stride_am, stride_an,
                                  qk_scale, raw, True, INDEX_64)
            s = tl.dot(q, tl.trans(k), acc=bias, input_precision=DOT_PRECISION)
            if HAS_ALIBI:
                s += _alibi_tile(rows[:, None], cols[None, :], tn * BLOCK_N, b, h, Slopes, stride_sb, stride_sh, alibi_shift,
                                 qk_scale)
            vis = vis0
            if HAS_PADDED:
                vis = vis & (cols[None, :] < key_end)
            if HAS_LAYOUT:
                vis = vis & _layout_visible(
                    rows[:, None], cols[None, :], b, h, Layout, stride_lb, stride_lh, stride_lq, stride_lk,
                    layout_q_off, layout_k_off, block_q, block_k,
                )
            p = tl.math.exp2(tl.where(vis, s, float("-inf")) * qk_scale - lse2[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            if HAS_DROPOUT:
                keep = _dropout_keep_tile(seed, (b64 * H + h64) * Mq * row_blocks, rows, tn * BLOCK_N, row_blocks,
                                          drop_thresh, BLOCK_M, BLOCK_N)
                dp = tl.where(keep, dp * drop_scale, 0.0)
            # a value hidden from a row (p = 0) may hold NaN or inf: 0 · NaN must not reach the shared gradient
            acc += tl.where(p > 0, p * (dp - delta[:, None]), 0.0)
    g_ptrs = (DBias + bb.to(tl.int64) * stride_gb + hh.to(tl.int64) * stride_gh
              + rows64[:, None] * stride_gm + cols64[None, :] * stride_gn)
    tl.store(g_ptrs, acc.to(DBias.dtype.element_ty), mask=(rows[:, None] < Mq) & (cols[None, :] < Mk))


@triton.jit
def _attn_bwd_dq_from_ds_kernel(
    K, DS, DQ, KvLens, BandLo, BandHi, sm_scale,
    k_strides, g_strides, dq_strides,
    H, G, Mq, Mk, D,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_PADDED: tl.constexpr, HAS_BAND: tl.constexpr, DOT_PRECISION: tl.constexpr, INDEX_64: tl.constexpr,
):
    """Grid ``(query tiles, B * Hq)``: ``DQ = sm_scale · dS @ K`` from the bias gradient ``DS [B, Hq, Mq, Mk]``.

    When every (batch row, head) owns its bias slice, the gradient the dK/dV kernel wrote is ``dS``
    itself (0 where a key is hidden), so dQ needs one product per tile instead of recomputing ``S``,
    ``P`` and ``dP`` (three). The program walks the key span its rows can see.
    """
    stride_kb, stride_kh, stride_kn, stride_kd = k_strides
    stride_gb, stride_gh, stride_gm, stride_gn = g_strides
    stride_dqb, stride_dqh, stride_dqm, stride_dqd = dq_strides
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    klo, khi, valid = _row_key_bounds(rows, Mq, 0, b, Mk, KvLens, KvLens, KvLens, BandLo, BandHi,
                                      False, HAS_PADDED, HAS_BAND, False)
    lo, hi, _, _ = _span(klo, khi, valid)
    key_lo = lo  # keys outside [key_lo, hi) may hold anything (past a cache length): never read
    lo = lo // 16 * 16
    if INDEX_64:
        rows64 = rows.to(tl.int64)
    else:
        rows64 = rows
    dqd = tl.arange(0, HEAD_DIM)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    K_base = K + b64 * stride_kb + (h // G).to(tl.int64) * stride_kh
    ds_rows = DS + b64 * stride_gb + h64 * stride_gh + rows64[:, None] * stride_gm
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = tl.multiple_of(n0, 16) + tl.arange(0, BLOCK_N)
        if INDEX_64:
            cols64 = cols.to(tl.int64)
        else:
            cols64 = cols
        k = _load_span(K_base + cols64[:, None] * stride_kn + dqd[None, :] * stride_kd, cols, key_lo, hi, dqd, D, EVEN_D)
        ds = tl.load(ds_rows + cols64[None, :] * stride_gn, mask=(rows[:, None] < Mq) & (cols[None, :] < Mk), other=0.0)
        k = tl.where((k == k) & (tl.abs(k) < float("inf")), k, tl.zeros_like(k))  # dS is 0 where a key is hidden
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    dq_ptrs = DQ + b64 * stride_dqb + h64 * stride_dqh + rows64[:, None] * stride_dqm + dqd[None, :] * stride_dqd
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=valid[:, None] & (dqd[None, :] < D))
