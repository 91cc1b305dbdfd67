"""Triton kernels of the split-KV operator: attention over one key range per program, and the LSE merge.

``_splitk_fwd_kernel`` runs one program per (sequence, KV head, row block, split). The rows of a
program are the query heads of one GQA group times the sequence's queries (row ``r`` is head
``r // MQ_STRIDE``, query ``r % MQ_STRIDE``), so each K/V tile is loaded once per group. The
sequence's visible key range is cut into pieces of ``tiles_per_split`` whole tiles (the last split
takes any rest, so every length is covered); short sequences leave their later splits empty, which
keeps the work proportional to the keys present. A program writes its piece's normalized output and
log-sum-exp, and ``_merge_partials_kernel`` combines the pieces.
Score tiles are kept raw and scaled inside ``exp2`` (``qk_scale`` includes log2(e)); row maxima are taken
before scaling, which needs a positive scale.
"""

import triton
import triton.language as tl

from .common_kernels import _accumulate_visible_pv

try:  # programmatic dependent launch (sm_90+): the merge kernel's programs start while the split kernel drains
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without it: launchers keep PDL off (see splitk.pdl_available)
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _splitk_tile(
    acc, m_i, l_i, q, j0,
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    add_rows, stride_an, slope, i_row, alibi_shift,
    seq_lo, seq_hi, band_lo, band_hi, qk_scale, D, Dv,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    HAS_BAND: tl.constexpr, HAS_ADDITIVE: tl.constexpr, HAS_ALIBI: tl.constexpr, PRECISION: tl.constexpr,
    INDEX_64: tl.constexpr,
):
    """One key tile ``[j0, j0 + BLOCK_N)`` of the online softmax; MASKED tiles check every key."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    offs_j = j0 + offs_n
    if INDEX_64:  # a K or V slice spans 2**31 elements
        offs_jk = offs_j.to(tl.int64)
    else:  # 32-bit offsets inside the slice: 64-bit ones cost registers and spill 128x128 tiles
        offs_jk = offs_j
    k_ptrs = k_base + offs_jk[:, None] * stride_kn + offs_d[None, :] * stride_kd  # [BLOCK_N, HEAD_DIM]
    v_ptrs = v_base + offs_jk[:, None] * stride_vn + offs_dv[None, :] * stride_vd  # [BLOCK_N, HEAD_DIM_V]
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
        s = tl.where(bias == float("-inf"), float("-inf"), s)  # hidden even where the key is not finite
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
    if MASKED or HAS_ADDITIVE:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    else:
        m_safe = m_new
    p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=in_seq[:, None] & (offs_dv[None, :] < Dv), other=0.0)
    elif EVEN_DV:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=offs_dv[None, :] < Dv, other=0.0)
    if (MASKED and HAS_BAND) or HAS_ADDITIVE:  # a key of the sequence hidden from some rows only
        acc = _accumulate_visible_pv(acc, alpha, p, s, v, PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _splitk_fwd_kernel(
    Q, K, V, Out, Lse, KvLen, QStart, KStart, KLen, BandLo, BandHi, Add, Slopes, qk_scale, alibi_shift,
    q_strides, k_strides, v_strides, o_strides, lse_strides, add_strides, slope_strides,
    Hkv, Mq, Mk, D, Dv, groups, row_blocks, num_splits, tiles_per_split, MQ_STRIDE,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    HAS_KV_LEN: tl.constexpr, HAS_SEGMENTS: tl.constexpr, HAS_BAND: tl.constexpr, BAND_PER_SEGMENT: tl.constexpr,
    HAS_ADDITIVE: tl.constexpr, HAS_ALIBI: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    PRECISION: tl.constexpr, INDEX_64: tl.constexpr, PDL: tl.constexpr,
):
    """Attention of one row block over one split of its sequence's keys; writes out and lse of the split.

    With ``PDL`` the program lets the merge kernel launch once its key loop is done (its stores follow;
    the merge waits for them)."""
    stride_qz, stride_qh, stride_qm, stride_qd = q_strides
    stride_kz, stride_kh, stride_kn, stride_kd = k_strides
    stride_vz, stride_vh, stride_vn, stride_vd = v_strides
    stride_os, stride_oz, stride_oh, stride_om, stride_od = o_strides
    stride_ls, stride_lz, stride_lh, stride_lm = lse_strides
    stride_az, stride_ah, stride_am, stride_an = add_strides
    stride_sz, stride_sh = slope_strides
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

    r = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    g = r // MQ_STRIDE
    i_local = r % MQ_STRIDE
    row_valid = (g < groups) & (i_local < nq)
    h = hkv * groups + g
    i_row = q_start + i_local
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
            BLOCK_N, HEAD_DIM, HEAD_DIM_V, True, EVEN_D, EVEN_DV, HAS_BAND, HAS_ADDITIVE, HAS_ALIBI, PRECISION, INDEX_64,
        )
    for t in range(f0, f1):
        acc, m_i, l_i = _splitk_tile(
            acc, m_i, l_i, q, t * BLOCK_N, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            add_rows, stride_an, slope, i_row, alibi_shift, seq_lo, seq_hi, band_lo, band_hi, qk_scale, D, Dv,
            BLOCK_N, HEAD_DIM, HEAD_DIM_V, False, EVEN_D, EVEN_DV, HAS_BAND, HAS_ADDITIVE, HAS_ALIBI, PRECISION, INDEX_64,
        )
    for t in range(f1, b):
        acc, m_i, l_i = _splitk_tile(
            acc, m_i, l_i, q, t * BLOCK_N, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            add_rows, stride_an, slope, i_row, alibi_shift, seq_lo, seq_hi, band_lo, band_hi, qk_scale, D, Dv,
            BLOCK_N, HEAD_DIM, HEAD_DIM_V, True, EVEN_D, EVEN_DV, HAS_BAND, HAS_ADDITIVE, HAS_ALIBI, PRECISION, INDEX_64,
        )

    if PDL:
        gdc_launch_dependents()
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


@triton.jit
def _merge_partials_kernel(
    Parts, PartLse, Out, Lse, S, Dv,
    stride_ps, stride_pr, stride_pd, stride_ls, stride_lr, stride_or, stride_od, stride_lser,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Row ``r``: ``out = Σ_s exp(lse_s - lse) · parts_s`` and ``lse = log Σ_s exp(lse_s)``.

    BLOCK_S splits at a time, their LSEs and outputs loaded together and folded into a running
    maximum, so up to BLOCK_S splits cost one round of memory latency.
    With ``PDL`` (launched as a programmatic dependent) it first waits until the kernel before it has
    finished and its writes are visible."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < Dv
    offs_s = tl.arange(0, BLOCK_S)
    lse_row = PartLse + row * stride_lr
    part_row = Parts + row * stride_pr
    if PDL:
        gdc_wait()
    m = tl.full([], float("-inf"), dtype=tl.float32)
    tot = tl.zeros([], dtype=tl.float32)
    out = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        smask = s0 + offs_s < S
        lses = tl.load(lse_row + (s0 + offs_s) * stride_ls, mask=smask, other=float("-inf")).to(tl.float32)
        part_ptrs = part_row + (s0 + offs_s)[:, None].to(tl.int64) * stride_ps + cols[None, :] * stride_pd
        part = tl.load(part_ptrs, mask=smask[:, None] & cmask[None, :], other=0.0).to(tl.float32)  # [BLOCK_S, BLOCK_D]
        m_new = tl.maximum(m, tl.max(lses, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp(m - m_safe)  # 0 while nothing was seen
        w = tl.exp(lses - m_safe)
        out = out * rescale + tl.sum(tl.where(w[:, None] > 0, w[:, None] * part, 0.0), 0)
        tot = tot * rescale + tl.sum(w, 0)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    safe = tl.where(tot > 0, tot, 1.0)
    tl.store(Out + row * stride_or + cols * stride_od, (out / safe).to(Out.dtype.element_ty), mask=cmask)
    if tl.program_id(1) == 0:
        tl.store(Lse + row * stride_lser, tl.where(tot > 0, m_safe + tl.log(safe), float("-inf")))
