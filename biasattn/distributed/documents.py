"""Packed documents under context parallelism: one local attention call per rank over the rows it holds.

Restricted to a rank's query rows and the key rows it holds (its own and those it reads from the
others, :mod:`.sparse`), a packed-documents mask is again block-diagonal: every document keeps its
query rows and its key rows in order, and a causal or local band keeps its diagonal when each
document's query rows end where its key rows end (or start where they start). The rank then runs
one plain :func:`~biasattn.attention` call under that smaller mask: no pairs, no merges.
"""

from __future__ import annotations

import numpy as np
import torch

from ..api import attention
from ..bias import BlockDiagonalMask, lower
from ..bias.band import BOTTOM_RIGHT, TOP_LEFT
from ..bias.block_diagonal import SegmentsAtom
from .layout import pieces
from .sparse import Exchange, Ranges, merge_ranges, rows_read


def reads_and_documents(call, B: int, H: int, device):
    """``(rows read, this rank's packed-documents mask or None)`` (:func:`rows_read`, :func:`documents_bias`),
    worked out once per full bias, shapes, layout and rank: every layer of a model that passes the same
    bias reuses them."""
    spec = lower(call.bias, B, H, call.Mq_full, call.Mk_full, device)

    def make():
        reads = rows_read(call, B, H, device)
        return reads, documents_bias(call, reads, device)

    return spec.cached(("context parallel", call.world, call.rank, call.layout), make)


class GatheredRows(torch.autograd.Function):
    """``(k_all, v_all)``: this rank's K/V rows and the rows it reads from the others (:attr:`Exchange.blocks`);
    the backward sends the gradients of the rows read back to their owners."""

    @staticmethod
    def forward(ctx, k, v, exchange: Exchange):
        ctx.exchange, ctx.rows = exchange, k.shape[2]
        return exchange.gather(k, v)

    @staticmethod
    def backward(ctx, dk_all, dv_all):
        dk, dv = ctx.exchange.scatter_back(dk_all, dv_all, ctx.rows)
        return dk, dv, None


def _documents(bias) -> SegmentsAtom | None:
    """The segments of a bias that is packed self-attention documents alone (lengths on the host), else None."""
    atoms = getattr(bias, "atoms", ())
    if len(atoms) != 1 or not isinstance(atoms[0], SegmentsAtom) or bias._offsets != (0, 0):
        return None
    seg = atoms[0]
    return seg if seg.starts_known() and seg.q_host == seg.k_host else None


def _blocks(call, reads: list[list[Ranges]], r: int) -> Ranges:
    """The full-sequence rows rank ``r`` computes with: its own pieces and the rows it reads, merged."""
    own = [(p.start, p.start + p.length) for p in pieces(call.layout, call.world, r, call.Mk_full)]
    return merge_ranges(own + [rg for s in range(call.world) if s != r for rg in reads[r][s]])


def _overlaps(a: np.ndarray, b: np.ndarray, ranges: list[Ranges]):
    """Per rank, document ``[a, b)`` and range of that rank's ``ranges``: the overlap's start, stop and
    length (0 if none), as ``[R, S, n]`` arrays (ranks with fewer ranges padded with empty ones)."""
    r = np.zeros((len(ranges), max(map(len, ranges), default=0), 2), dtype=np.int64)
    for n, rs in enumerate(ranges):
        r[n, : len(rs)] = rs
    lo = np.maximum(a[None, :, None], r[:, None, :, 0])
    hi = np.minimum(b[None, :, None], r[:, None, :, 1])
    return lo, hi, np.maximum(hi - lo, 0)


def _restricted(seg: SegmentsAtom, q_rows: list[Ranges], blocks: list[Ranges]):
    """``(q_seqlens, kv_seqlens, alignment)`` per rank: the documents restricted to rank ``r``'s query rows
    ``q_rows[r]`` and key rows ``blocks[r]``; None when that is not block-diagonal with the same band for some rank.

    A document's rows stay together in both (rows and blocks are in sequence order), so without a band
    any document works. With a band, the positions must keep their spacing: each document meets one
    run of query rows and one run of key rows, and in every document of a rank the two runs end
    together (bottom-right alignment) or in every one they start together (top-left)."""
    starts = np.asarray(seg.q_host, dtype=np.int64)
    q_lo, q_hi, q_n = _overlaps(starts[:-1], starts[1:], q_rows)
    k_lo, k_hi, k_n = _overlaps(starts[:-1], starts[1:], blocks)
    met, queried = k_n.sum(2) > 0, q_n.sum(2) > 0  # [R, S]; every query row is in the blocks
    lens = [(q_n[r].sum(1)[met[r]].tolist(), k_n[r].sum(1)[met[r]].tolist()) for r in range(len(q_rows))]
    if seg.band is None:
        return [(q, k, None) for q, k in lens]
    if ((q_n > 0).sum(2) > 1).any() or ((k_n > 0).sum(2) > 1).any():
        return None
    ends = ((np.where(q_n > 0, q_hi, 0).sum(2) == np.where(k_n > 0, k_hi, 0).sum(2)) | ~queried).all(1)
    begins = ((np.where(q_n > 0, q_lo, 0).sum(2) == np.where(k_n > 0, k_lo, 0).sum(2)) | ~queried).all(1)
    if not (ends | begins).all():
        return None
    return [(q, k, BOTTOM_RIGHT if e else TOP_LEFT) for (q, k), e in zip(lens, ends)]


def documents_bias(call, reads: list[list[Ranges]], device):
    """This rank's packed-documents mask over its query rows and the key rows of :class:`Exchange`, or None
    when the bias is not packed documents or some rank's restriction is not block-diagonal (every rank
    decides alike, from the same host metadata, so that all take the same path)."""
    seg = _documents(call.bias)
    if seg is None or call.Mq_full != call.Mk_full:
        return None
    W = call.world
    q_rows = [merge_ranges([(p.start, p.start + p.length) for p in pieces(call.layout, W, r, call.Mq_full)]) for r in range(W)]
    every = _restricted(seg, q_rows, [_blocks(call, reads, r) for r in range(W)])
    if every is None:
        return None
    q_lens, k_lens, alignment = every[call.rank]
    bias = BlockDiagonalMask.from_seqlens(q_lens, k_lens, device=device)
    return bias if alignment is None else bias._with_band((alignment, *seg.band[1:]))


def documents_attention(q, k, v, scale, exchange: Exchange, bias) -> torch.Tensor:
    """This rank's output: one attention of its queries over the key rows it holds and reads, under ``bias``
    from :func:`documents_bias`."""
    k_all, v_all = GatheredRows.apply(k, v, exchange)
    return attention(q, k_all, v_all, bias, scale=scale)
