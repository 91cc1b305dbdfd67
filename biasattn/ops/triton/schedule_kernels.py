"""The per-segment tile tables of packed inputs, built on the device from the segments' tensors in one launch."""

import triton
import triton.language as tl


@triton.jit
def _pieces(idx, QStarts, KStarts, KLens, S, total, keys):
    """Segment ``idx``'s lines ``[a, a + n)`` (clipped to ``[0, total)``) and span: along the queries its
    query lines and key count, along the keys (``keys``) its key lines and query count. Index ``S``
    stands for the end of the lines (``a = total``, no lines), so that the gap before it is the
    uncovered tail."""
    seg = idx < S
    qa = tl.load(QStarts + idx, mask=seg, other=0)
    q_count = tl.load(QStarts + idx + 1, mask=seg, other=0) - qa
    k_count = tl.load(KLens + idx, mask=seg, other=0)
    a = tl.where(keys, tl.load(KStarts + idx, mask=seg, other=0), qa)
    n = tl.where(keys, k_count, q_count)
    span = tl.where(keys, q_count, k_count)
    a = tl.where(seg, tl.minimum(tl.maximum(a, 0), total), total)
    e = tl.minimum(a + tl.maximum(n, 0), total)
    return a, e, span


@triton.jit
def _put_tile(Table, first_row, t, tiles, a, e, seg, block, n_rows):
    """Row ``first_row + t`` holds tile ``t`` (counted from the last) of the lines ``[a, e)``, where ``t < tiles``."""
    row = first_row + t
    put = (t < tiles) & (row < n_rows)
    first = a + (tiles - 1 - t) * block
    tl.store(Table + row * 3, first, mask=put)
    tl.store(Table + row * 3 + 1, tl.minimum(first + block, e), mask=put)
    tl.store(Table + row * 3 + 2, seg, mask=put)


@triton.jit
def _segment_table_kernel(
    Table, QStarts, KStarts, KLens, S, Mq, Mk, along_keys, log_blocks, BLOCK: tl.constexpr,
):
    """Grid ``(cdiv(S + 1, BLOCK), tables)``. Writes the tables one after the other in ``Table``; table
    ``t`` runs along the keys when bit ``t`` of ``along_keys`` is set (else along the queries), in
    tiles of ``2 ** (log_blocks >> 4 t & 15)`` lines, and has ``lines // block + 2 S + 2`` rows
    ``(first line, end line, segment)``.

    Every segment's lines are cut into tiles of ``block`` lines, and so is each run of lines that no
    segment covers (segment -1: their programs write zeros). Rows are ordered by the span of the
    tile's segment (its work per line) descending, then by first line descending; the uncovered
    lines come last, and rows past the last tile are ``(0, 0, -1)`` (programs with no lines).
    Segments must be ordered and disjoint where they have lines. Each program places the tiles of
    ``BLOCK`` segments and of the gaps before them, counting by comparison with every other piece."""
    t = tl.program_id(1)
    first_row = t * 0
    for u in range(0, t):  # the rows of the tables before mine
        lines_u = tl.where(((along_keys >> u) & 1) == 1, Mk, Mq)
        first_row += lines_u // (1 << ((log_blocks >> (4 * u)) & 15)) + 2 * S + 2
    keys = ((along_keys >> t) & 1) == 1
    block = 1 << ((log_blocks >> (4 * t)) & 15)
    total = tl.where(keys, Mk, Mq)
    n_rows = total // block + 2 * S + 2
    Table += first_row * 3
    pid = tl.program_id(0)
    mine = pid * BLOCK + tl.arange(0, BLOCK)
    a_m, e_m, span_m = _pieces(mine, QStarts, KStarts, KLens, S, total, keys)
    # the gap before each of my segments starts where the last non-empty segment before it ends
    gap_m = tl.zeros([BLOCK], dtype=tl.int32)
    for c in range(0, S, BLOCK):
        o = c + tl.arange(0, BLOCK)
        a_o, e_o, _ = _pieces(o, QStarts, KStarts, KLens, S, total, keys)
        earlier = (o[None, :] < mine[:, None]) & (e_o > a_o)[None, :]
        gap_m = tl.maximum(gap_m, tl.max(tl.where(earlier, e_o[None, :], 0), axis=1))
    owns_gap = (mine <= S) & ((e_m > a_m) | (mine == S)) & (a_m > gap_m)
    seg_tiles_m = tl.where(mine < S, (e_m - a_m + block - 1) // block, 0)
    gap_tiles_m = tl.where(owns_gap, (a_m - gap_m + block - 1) // block, 0)

    seg_row = tl.zeros([BLOCK], dtype=tl.int32)  # rows placed before my segments' tiles
    gap_row = tl.zeros([BLOCK], dtype=tl.int32)
    covered = pid * 0  # the end of the non-empty segments before chunk c
    seg_total = pid * 0
    gap_total = pid * 0
    for c in range(0, S + 1, BLOCK):
        o = c + tl.arange(0, BLOCK)
        a_o, e_o, span_o = _pieces(o, QStarts, KStarts, KLens, S, total, keys)
        filled = e_o > a_o
        inner = (o[None, :] < o[:, None]) & filled[None, :]
        gap_o = tl.maximum(tl.max(tl.where(inner, e_o[None, :], 0), axis=1), covered)
        covered = tl.maximum(covered, tl.max(tl.where(filled, e_o, 0), axis=0))
        seg_tiles_o = tl.where(o < S, (e_o - a_o + block - 1) // block, 0)
        owns_o = (o <= S) & (filled | (o == S)) & (a_o > gap_o)
        gap_tiles_o = tl.where(owns_o, (a_o - gap_o + block - 1) // block, 0)
        seg_total += tl.sum(seg_tiles_o, axis=0)
        gap_total += tl.sum(gap_tiles_o, axis=0)
        sp_o, sp_m = span_o[None, :], span_m[:, None]
        first = (sp_o > sp_m) | ((sp_o == sp_m) & ((a_o[None, :] > a_m[:, None])
                                                   | ((a_o[None, :] == a_m[:, None]) & (o[None, :] < mine[:, None]))))
        seg_row += tl.sum(tl.where(first, seg_tiles_o[None, :], 0), axis=1)
        g_o, g_m = gap_o[None, :], gap_m[:, None]
        first = (g_o > g_m) | ((g_o == g_m) & (o[None, :] < mine[:, None]))
        gap_row += tl.sum(tl.where(first, gap_tiles_o[None, :], 0), axis=1)
    gap_row += seg_total  # the uncovered lines come after every segment's tiles

    most = tl.maximum(tl.max(seg_tiles_m, axis=0), tl.max(gap_tiles_m, axis=0))
    for t in range(0, most):  # later tiles first within a piece
        _put_tile(Table, seg_row, t, seg_tiles_m, a_m, e_m, mine, block, n_rows)
        _put_tile(Table, gap_row, t, gap_tiles_m, gap_m, a_m, tl.full([BLOCK], -1, tl.int32), block, n_rows)
    if pid == 0:
        for r0 in range(seg_total + gap_total, n_rows, BLOCK):
            row = r0 + tl.arange(0, BLOCK)
            put = row < n_rows
            zero = tl.zeros([BLOCK], dtype=tl.int32)
            tl.store(Table + row * 3, zero, mask=put)
            tl.store(Table + row * 3 + 1, zero, mask=put)
            tl.store(Table + row * 3 + 2, zero - 1, mask=put)
