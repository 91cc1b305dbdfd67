"""Triton kernels of the split-KV operator: attention over one key range per program, and the LSE merge.

``_splitk_fwd_kernel`` runs one program per (sequence, KV head, row block, split). The rows of a
program are the query heads of one GQA group times the sequence's queries (row ``r`` is head
``r // MQ_STRIDE``, query ``r % MQ_STRIDE``), so each K/V tile is loaded once per group. The
sequence's visible key range is cut into pieces of ``tiles_per_split`` whole tiles (the last split
takes any rest, so every length is covered); short sequences leave their later splits empty, which
keeps the work proportional to the keys present. A program writes its piece's normalized output and
log-sum-exp. With ``FUSED_MERGE`` the pieces are combined in the same launch: once all its threads
have stored (a barrier), a program counts its arrival on an int32 counter of its (sequence, KV head,
row block) with an acquire-release atomic, and the last one to arrive sets the counter back to 0
and merges all pieces of its rows into the final output, reading them past the L1 cache (``.cg``).
Otherwise ``_merge_partials_kernel`` combines them in a second launch. Both merge with
``_lse_merge``.

Score tiles are kept raw and scaled inside ``exp2`` (``qk_scale`` includes log2(e)); row maxima are taken
before scaling, which needs a positive scale.
"""

import triton
import triton.language as tl


@triton.jit
def _splitk_tile(
    acc, m_i, l_i, q, j0,
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    add_rows, stride_an, slope, i_row, alibi_shift,
    seq_lo, seq_hi, band_lo, band_hi, qk_scale, D, Dv,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    HAS_BAND: tl.constexpr, HAS_ADDITIVE: tl.constexpr, HAS_ALIBI: tl.constexpr, PRECISION: tl.constexpr,
):
    """One key tile ``[j0, j0 + BLOCK_N)`` of the online softmax; MASKED tiles check every key."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    offs_j = j0 + offs_n
    k_tile = k_base + j0 * stride_kn  # j0 is int64
    v_tile = v_base + j0 * stride_vn
    k_ptrs = k_tile + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd  # [BLOCK_N, HEAD_DIM]
    v_ptrs = v_tile + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd  # [BLOCK_N, HEAD_DIM_V]
    in_seq = (offs_j >= seq_lo) & (offs_j < seq_hi)
    if MASKED:
        k = tl.load(k_ptrs, mask=in_seq[:, None] & (offs_d[None, :] < D), other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=offs_d[None, :] < D, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N], raw: scaled in exp2's FMA
    if HAS_ADDITIVE:
        bias = tl.load(add_rows + offs_j[None, :].to(tl.int64) * stride_an, mask=in_seq[None, :], other=0.0)
        s += bias.to(tl.float32) * (1.4426950408889634 / qk_scale)
    if HAS_ALIBI:  # distances in float32 relative to the tile (exact within 2**24 positions)
        dist = tl.abs(offs_n[None, :].to(tl.float32) - (i_row + alibi_shift - j0).to(tl.float32)[:, None])
        s -= (slope[:, None] * (1.4426950408889634 / qk_scale)) * dist
    if MASKED:
        visible = in_seq[None, :]
        if HAS_BAND:
            d = offs_j[None, :] - i_row[:, None]
            visible = visible & (d >= band_lo) & (d <= band_hi)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # qk_scale > 0: the scale commutes with the max
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=in_seq[:, None] & (offs_dv[None, :] < Dv), other=0.0)
    elif EVEN_DV:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=offs_dv[None, :] < Dv, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _block_rows(rb, hkv, q_start, nq, groups, MQ_STRIDE, ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The first ROWS rows of row block ``rb``: ``(query head, query index, valid)`` of each."""
    r = rb * BLOCK_M + tl.arange(0, ROWS)
    g = r // MQ_STRIDE
    i_local = r % MQ_STRIDE
    return hkv * groups + g, q_start + i_local, (g < groups) & (i_local < nq)


@triton.jit
def _lse_merge(parts, lses, stride_ps, stride_ls, S, mask, row_mask, BLOCK_S: tl.constexpr, CACHE: tl.constexpr):
    """Merge ``S`` partial results of a block of rows: ``(out [R, C], lse [R])`` in float32.

    ``parts [R, C]`` and ``lses [R]`` point at the first split's values, ``stride_ps`` and
    ``stride_ls`` step to the next split; ``mask``/``row_mask`` select the block's elements.
    ``lse = log Σ_s exp(lse_s)`` and ``out = Σ_s exp(lse_s - lse) · part_s``, in one pass over the
    splits, BLOCK_S at a time (running maximum, earlier sums rescaled). A split with
    ``lse_s = -inf`` is skipped whatever its output holds, and a row with every ``lse_s = -inf``
    gives 0 and -inf. ``CACHE`` is the loads' cache modifier.
    """
    offs_s = tl.arange(0, BLOCK_S)
    m = tl.full(lses.shape, float("-inf"), dtype=tl.float32)
    total = tl.zeros(lses.shape, dtype=tl.float32)
    acc = tl.zeros(parts.shape, dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = (s0 + offs_s).to(tl.int64)
        live = s < S
        l_ptrs = lses[None, :] + s[:, None] * stride_ls  # [BLOCK_S, R]
        l = tl.load(l_ptrs, mask=live[:, None] & row_mask[None, :], other=float("-inf"), cache_modifier=CACHE)
        p_ptrs = parts[None, :, :] + s[:, None, None] * stride_ps  # [BLOCK_S, R, C]
        part = tl.load(p_ptrs, mask=live[:, None, None] & mask[None, :, :], other=0.0, cache_modifier=CACHE)
        m_new = tl.maximum(m, tl.max(l.to(tl.float32), 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)  # 0 while nothing was seen
        w = tl.exp(l.to(tl.float32) - m_safe[None, :])  # [BLOCK_S, R]
        acc = acc * alpha[:, None] + tl.sum(tl.where(w[:, :, None] > 0, w[:, :, None] * part.to(tl.float32), 0.0), 0)
        total = total * alpha + tl.sum(w, 0)
        m = m_new
    safe = tl.where(total > 0, total, 1.0)
    return acc / safe[:, None], tl.where(total > 0, m + tl.log(safe), float("-inf"))


@triton.jit
def _splitk_fwd_kernel(
    Q, K, V, Out, Lse,
    KvLen, QStart, KStart, KLen, BandLo, BandHi, Add, Slopes,
    FinalOut, FinalLse, Counter,
    qk_scale, alibi_shift,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_os, stride_oz, stride_oh, stride_om, stride_od,
    stride_ls, stride_lz, stride_lh, stride_lm,
    stride_az, stride_ah, stride_am, stride_an,
    stride_sz, stride_sh,
    stride_fz, stride_fh, stride_fm, stride_fd,
    stride_gz, stride_gh, stride_gm,
    Hkv, Mq, Mk, D, Dv, groups, row_blocks, num_splits, tiles_per_split, MQ_STRIDE,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    HAS_KV_LEN: tl.constexpr, HAS_SEGMENTS: tl.constexpr, HAS_BAND: tl.constexpr, BAND_PER_SEGMENT: tl.constexpr,
    HAS_ADDITIVE: tl.constexpr, HAS_ALIBI: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr, FUSED_MERGE: tl.constexpr, MERGE_ROWS: tl.constexpr, MERGE_BLOCK_S: tl.constexpr,
):
    """Attention of one row block over one split of its sequence's keys; writes out and lse of the split.

    With FUSED_MERGE, the last split of the row block to finish also merges every split's result
    into ``FinalOut``/``FinalLse``, ``MERGE_BLOCK_S`` splits of ``MERGE_ROWS`` rows at a time;
    ``Counter[pid]`` is 0 before and after the launch.
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rb = pid % row_blocks
    hkv = (pid // row_blocks) % Hkv
    z = pid // (row_blocks * Hkv)  # batch row, or packed segment

    # The sequence: its query rows [q_start, q_start + nq) and keys [seq_lo, seq_hi).
    if HAS_SEGMENTS:
        zb = z * 0
        q_start = tl.load(QStart + z)
        nq = tl.load(QStart + z + 1) - q_start
        seq_lo = tl.load(KStart + z)
        seq_hi = seq_lo + tl.load(KLen + z)
    else:
        zb = z
        q_start = 0
        nq = Mq
        seq_lo = 0
        seq_hi = Mk
        if HAS_KV_LEN:
            seq_hi = tl.minimum(tl.load(KvLen + z), Mk)

    h, i_row, row_valid = _block_rows(rb, hkv, q_start, nq, groups, MQ_STRIDE, BLOCK_M, BLOCK_M)
    i_last = q_start + nq - 1

    # Keys some row sees [key_lo, key_hi), and keys every row sees [full_lo, full_hi) (no mask needed).
    if HAS_BAND:
        bidx = z if BAND_PER_SEGMENT else 0
        band_lo = tl.load(BandLo + bidx)
        band_hi = tl.load(BandHi + bidx)
        key_lo = tl.maximum(seq_lo, q_start + band_lo)
        key_hi = tl.minimum(seq_hi, i_last + band_hi + 1)
        full_lo = tl.maximum(seq_lo, i_last + band_lo)
        full_hi = tl.minimum(seq_hi, q_start + band_hi + 1)
    else:
        band_lo = 0
        band_hi = 0
        key_lo = seq_lo
        key_hi = seq_hi
        full_lo = seq_lo
        full_hi = seq_hi
    any_row = tl.sum(row_valid.to(tl.int32), 0) > 0
    key_hi = tl.where(any_row & (key_hi > key_lo), key_hi, key_lo)

    # This split's tiles [a, b), cut into masked head [a, f0), unmasked middle [f0, f1), masked tail [f1, b).
    t_lo = key_lo // BLOCK_N
    t_hi = tl.where(key_hi > key_lo, (key_hi + BLOCK_N - 1) // BLOCK_N, t_lo)
    a = tl.minimum(t_lo + split * tiles_per_split, t_hi)
    b = tl.where(split == num_splits - 1, t_hi, tl.minimum(a + tiles_per_split, t_hi))
    f0 = tl.minimum(tl.maximum((full_lo + BLOCK_N - 1) // BLOCK_N, a), b)
    f1 = tl.minimum(tl.maximum(tl.maximum(full_hi, 0) // BLOCK_N, f0), b)
    a, b, f0, f1 = a.to(tl.int64), b.to(tl.int64), f0.to(tl.int64), f1.to(tl.int64)  # 64-bit key offsets

    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    zb64 = zb.to(tl.int64)
    h64 = h.to(tl.int64)
    q_ptrs = Q + zb64 * stride_qz + h64[:, None] * stride_qh + i_row[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_valid[:, None] & (offs_d[None, :] < D), other=0.0)  # [BLOCK_M, HEAD_DIM]
    k_base = K + zb64 * stride_kz + hkv.to(tl.int64) * stride_kh
    v_base = V + zb64 * stride_vz + hkv.to(tl.int64) * stride_vh
    add_rows = Add
    if HAS_ADDITIVE:
        add_off = zb64 * stride_az + h64[:, None] * stride_ah + i_row[:, None].to(tl.int64) * stride_am
        add_rows = Add + tl.where(row_valid[:, None], add_off, 0)  # padding rows read the first row
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slope = tl.load(Slopes + zb * stride_sz + h * stride_sh, mask=row_valid, other=0.0)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for t in range(a, f0):
        acc, m_i, l_i = _splitk_tile(
            acc, m_i, l_i, q, t * BLOCK_N, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            add_rows, stride_an, slope, i_row, alibi_shift, seq_lo, seq_hi, band_lo, band_hi, qk_scale, D, Dv,
            BLOCK_N, HEAD_DIM, HEAD_DIM_V, True, EVEN_D, EVEN_DV, HAS_BAND, HAS_ADDITIVE, HAS_ALIBI, PRECISION,
        )
    for t in range(f0, f1):
        acc, m_i, l_i = _splitk_tile(
            acc, m_i, l_i, q, t * BLOCK_N, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            add_rows, stride_an, slope, i_row, alibi_shift, seq_lo, seq_hi, band_lo, band_hi, qk_scale, D, Dv,
            BLOCK_N, HEAD_DIM, HEAD_DIM_V, False, EVEN_D, EVEN_DV, HAS_BAND, HAS_ADDITIVE, HAS_ALIBI, PRECISION,
        )
    for t in range(f1, b):
        acc, m_i, l_i = _splitk_tile(
            acc, m_i, l_i, q, t * BLOCK_N, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            add_rows, stride_an, slope, i_row, alibi_shift, seq_lo, seq_hi, band_lo, band_hi, qk_scale, D, Dv,
            BLOCK_N, HEAD_DIM, HEAD_DIM_V, True, EVEN_D, EVEN_DV, HAS_BAND, HAS_ADDITIVE, HAS_ALIBI, PRECISION,
        )

    # Normalized output and natural-log LSE of this split; rows that saw nothing give 0 and -inf.
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(seen, (m_safe + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    split64 = split.to(tl.int64)
    o_ptrs = Out + split64 * stride_os + zb64 * stride_oz + h64[:, None] * stride_oh + i_row[:, None] * stride_om
    tl.store(o_ptrs + offs_dv[None, :] * stride_od, o.to(Out.dtype.element_ty), mask=row_valid[:, None] & (offs_dv[None, :] < Dv))
    l_ptrs = Lse + split64 * stride_ls + zb64 * stride_lz + h64 * stride_lh + i_row * stride_lm
    tl.store(l_ptrs, lse, mask=row_valid)

    if FUSED_MERGE:
        tl.debug_barrier()  # every thread's stores come before the release of the arrival below
        arrived = tl.atomic_add(Counter + pid, 1, sem="acq_rel")
        if arrived == num_splits - 1:  # the last split of this row block: all partials are written
            tl.atomic_xchg(Counter + pid, 0, sem="relaxed")  # ready for the next launch
            tl.debug_barrier()  # every thread reads after the acquire
            # Decode row blocks are mostly padding: merge only the first MERGE_ROWS rows, which hold every valid one.
            # (Names differ from the ones above: a runtime branch may not change a variable's shape.)
            mh, mi, mvalid = _block_rows(rb, hkv, q_start, nq, groups, MQ_STRIDE, MERGE_ROWS, BLOCK_M)
            mh64 = mh.to(tl.int64)
            if EVEN_DV:  # a mask constant along rows keeps the loads and stores vectorized
                mmask = tl.broadcast_to(mvalid[:, None], [MERGE_ROWS, HEAD_DIM_V])
            else:
                mmask = mvalid[:, None] & (offs_dv[None, :] < Dv)
            parts = Out + zb64 * stride_oz + mh64[:, None] * stride_oh + mi[:, None] * stride_om + offs_dv[None, :] * stride_od
            lses = Lse + zb64 * stride_lz + mh64 * stride_lh + mi * stride_lm
            merged, merged_lse = _lse_merge(parts, lses, stride_os, stride_ls, num_splits, mmask, mvalid, MERGE_BLOCK_S, ".cg")
            f_ptrs = FinalOut + zb64 * stride_fz + mh64[:, None] * stride_fh + mi[:, None] * stride_fm + offs_dv[None, :] * stride_fd
            tl.store(f_ptrs, merged.to(FinalOut.dtype.element_ty), mask=mmask)
            tl.store(FinalLse + zb64 * stride_gz + mh64 * stride_gh + mi * stride_gm, merged_lse, mask=mvalid)


@triton.jit
def _merge_partials_kernel(
    Parts, PartLse, Out, Lse, S, Dv,
    stride_ps, stride_pr, stride_pd, stride_ls, stride_lr, stride_or, stride_od, stride_lser,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Row ``r``, columns of block ``program_id(1)``: ``_lse_merge`` of the row's ``S`` partial results."""
    row = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)  # a block of one row
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols[None, :] < Dv
    parts = Parts + row[:, None] * stride_pr + cols[None, :] * stride_pd
    out, lse = _lse_merge(parts, PartLse + row * stride_lr, stride_ps, stride_ls, S, mask, row >= 0, BLOCK_S, "")
    tl.store(Out + row[:, None] * stride_or + cols[None, :] * stride_od, out.to(Out.dtype.element_ty), mask=mask)
    if tl.program_id(1) == 0:
        tl.store(Lse + row * stride_lser, lse)
