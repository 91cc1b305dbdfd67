"""The dropout mask the flash kernels draw, written out: for tests and for users who check a mask."""

import triton
import triton.language as tl

from .common_kernels import _dropout_keep, _dropout_keep_tile, _dropout_seed


@triton.jit
def _dropout_mask_kernel(
    Out, seed_lo, seed_hi, thresh, keep_scale, Mq, Mk, row_blocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr,
):
    """Grid ``(query tiles, key tiles, B·H)``: ``Out [B, H, Mq, Mk]`` = ``keep_scale`` where kept, else 0.

    ``ALIGNED`` draws whole tiles (:func:`_dropout_keep_tile`), otherwise one element at a time
    (:func:`_dropout_keep`); the two must agree bit for bit."""
    bh = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c0 = tl.program_id(1) * BLOCK_N
    cols = c0 + tl.arange(0, BLOCK_N)
    seed = _dropout_seed(seed_lo, seed_hi)
    row_base = bh * Mq * row_blocks
    if ALIGNED:
        keep = _dropout_keep_tile(seed, row_base, rows, c0, row_blocks, thresh, BLOCK_M, BLOCK_N)
    else:
        keep = _dropout_keep(seed, row_base, rows[:, None], cols[None, :], row_blocks, thresh)
    ptrs = Out + (bh * Mq + rows.to(tl.int64)[:, None]) * Mk + cols[None, :]
    tl.store(ptrs, tl.where(keep, keep_scale, 0.0), mask=(rows[:, None] < Mq) & (cols[None, :] < Mk))
