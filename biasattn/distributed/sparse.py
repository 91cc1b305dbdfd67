"""Rows read: each rank receives only the key rows of other ranks' shards that some of its queries see.

With packed documents, a sliding window or padded keys, most rows of the other ranks' shards are
hidden from this rank's queries: a document that crosses a chunk boundary is the only thing one
chunk reads from another. Every rank works out, from the full bias's host metadata alone (no
communication, no device sync), which rows each rank reads from each other rank; those rows travel
in one all-to-all and their dK/dV go back to their owners the same way.
:class:`SparseAttention` computes (query piece, key block) pairs over the rows held, merged by
log-sum-exp; its rows are exchanged again in the backward, so memory stays O(M_local). Packed
documents take a single call instead (:mod:`.documents`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..bias import lower
from ..ops.tiles import key_range
from .layout import Piece, pieces
from .ring import gathered_backward, gathered_forward

Ranges = tuple[tuple[int, int], ...]  # [start, stop) rows of the full sequence, sorted and disjoint

#: The exchange of the rows read replaces a whole all-gather when it moves at most this share of it.
SPARSE_MAX_SHARE = 0.25


def merge_ranges(ranges: list[tuple[int, int]]) -> Ranges:
    """``[start, stop)`` ranges sorted, empty ones dropped, overlapping and adjacent ones merged."""
    out: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[0] < r[1]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def rows_read(call, B: int, H: int, device) -> list[list[Ranges]]:
    """``reads[r][s]``: the rows of rank ``s``'s pieces that some query row of rank ``r`` may see.

    Bounds come from the full bias's host metadata (:func:`~biasattn.ops.tiles.key_range` over each
    query piece), so they cover every visible key; a bias whose lengths only the device holds reads
    everything."""
    W = call.world
    spec = lower(call.bias, B, H, call.Mq_full, call.Mk_full, device) if call.bias is not None else None
    known = spec is not None and (spec.q_seqstart is None or spec.host.q_seqstart is not None) and (
        spec.kv_seqlens is None or spec.host.kv_seqlens is not None) and (
        spec.band_lo is None or spec.host.band_lo is not None)
    k_pieces = [pieces(call.layout, W, s, call.Mk_full) for s in range(W)]
    reads = []
    for r in range(W):
        seen = [key_range(spec, qp.start, qp.start + qp.length) if known else (0, call.Mk_full)
                for qp in pieces(call.layout, W, r, call.Mq_full)]
        reads.append([merge_ranges([(max(lo, kp.start), min(hi, kp.start + kp.length))
                                    for lo, hi in seen for kp in k_pieces[s]]) for s in range(W)])
    return reads


def worth_it(reads: list[list[Ranges]], shard_rows: int) -> bool:
    """Whether the rows read from other ranks are at most :data:`SPARSE_MAX_SHARE` of an all-gather's."""
    W = len(reads)
    moved = sum(b - a for r in range(W) for s in range(W) if s != r for a, b in reads[r][s])
    return moved <= SPARSE_MAX_SHARE * W * (W - 1) * shard_rows


def _local(ranges: Ranges, own: tuple[Piece, ...]) -> list[tuple[int, int]]:
    """The ``[start, stop)`` rows of a shard (its pieces ``own``) that hold the full-sequence ``ranges``."""
    out = []
    for a, b in ranges:
        for p in own:
            lo, hi = max(a, p.start), min(b, p.start + p.length)
            if lo < hi:
                out.append((p.local + lo - p.start, p.local + hi - p.start))
    return out


def _rows(x: torch.Tensor, local: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([x[:, :, a:b] for a, b in local], 2) if len(local) != 1 else x[:, :, local[0][0]:local[0][1]]


class Exchange:
    """Where the rows read travel for this rank: what it sends to each rank and the layout of what it holds.

    ``blocks``: the rows this rank computes with, sorted by their place in the full sequence, as
    pieces of one gathered buffer (``local`` is the row in that buffer): its own pieces and the
    ranges received from the others, adjacent ones merged."""

    def __init__(self, call, reads: list[list[Ranges]]):
        W, r = call.world, call.rank
        self.group, self.world = call.group, W
        self.moves = any(reads[d][o] for d in range(W) for o in range(W) if d != o)  # the same on every rank
        own = pieces(call.layout, W, r, call.Mk_full)
        self.sends = {d: _local(reads[d][r], own) for d in range(W) if d != r and reads[d][r]}
        self.received = {s: reads[r][s] for s in range(W) if s != r and reads[r][s]}
        # the buffer's parts in order: (full-sequence start, rows, the own piece or the rank sending them)
        parts = [(p.start, p.length, p) for p in own]
        parts += [(a, b - a, s) for s, ranges in self.received.items() for a, b in ranges]
        self.parts = sorted(parts, key=lambda part: part[0])
        blocks, offset = [], 0
        for start, length, _ in self.parts:
            if blocks and blocks[-1].start + blocks[-1].length == start:
                last = blocks.pop()
                blocks.append(Piece(last.start, last.length + length, last.local))
            else:
                blocks.append(Piece(start, length, offset))
            offset += length
        self.blocks = tuple(blocks)

    def _exchange(self, sends: dict, rows: dict, like: torch.Tensor) -> dict:
        """Send ``sends[d]`` (``[B, H, n, D]``) to rank ``d``; receive from rank ``s`` such a tensor of ``rows[s]``
        rows. One all-to-all, in which every rank takes part (ranks with nothing to move included)."""
        if not self.moves:
            return {}
        B, H, D = like.shape[0], like.shape[1], like.shape[3]
        out_splits = [rows.get(s, 0) for s in range(self.world)]
        in_splits = [sends[d].shape[2] if d in sends else 0 for d in range(self.world)]
        inp = torch.cat([sends[d].permute(2, 0, 1, 3) for d in range(self.world) if d in sends], 0) if sends else (
            like.new_empty((0, B, H, D)))
        out = like.new_empty((sum(out_splits), B, H, D))
        dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=self.group)
        return {s: t.permute(1, 2, 0, 3) for s, t in enumerate(out.split(out_splits, 0)) if out_splits[s]}

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers of :attr:`blocks` for this rank's shards of K and V: their own rows and the rows
        received (K and V travel together, side by side along the last dim)."""
        sends = {d: torch.cat([_rows(k, local), _rows(v, local)], 3) for d, local in self.sends.items()}
        rows = {s: sum(b - a for a, b in ranges) for s, ranges in self.received.items()}
        got = {s: iter(t.split([b - a for a, b in self.received[s]], 2))
               for s, t in self._exchange(sends, rows, k.new_empty((*k.shape[:3], k.shape[3] + v.shape[3]))).items()}
        D = k.shape[3]
        ks, vs = [], []
        for _, _, who in self.parts:
            if isinstance(who, Piece):
                ks.append(k[:, :, who.local_rows])
                vs.append(v[:, :, who.local_rows])
            else:
                t = next(got[who])
                ks.append(t[..., :D])
                vs.append(t[..., D:])
        return torch.cat(ks, 2), torch.cat(vs, 2)

    def scatter_back(self, dk: torch.Tensor, dv: torch.Tensor, shard_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's dK and dV shards (``shard_rows`` rows) from ``dk`` and ``dv``, laid out as :attr:`blocks`:
        its own rows, plus what every other rank computed for the rows it read from this rank."""
        D = dk.shape[3]
        out = [g.new_zeros((*g.shape[:2], shard_rows, g.shape[3])) for g in (dk, dv)]
        back: dict[int, list[torch.Tensor]] = {}
        offset = 0
        for _, length, who in self.parts:
            rows = slice(offset, offset + length)
            if isinstance(who, Piece):  # own pieces are disjoint: copied before the others' shares arrive
                for o, g in zip(out, (dk, dv)):
                    o[:, :, who.local_rows] = g[:, :, rows]
            else:
                back.setdefault(who, []).append(torch.cat([dk[:, :, rows], dv[:, :, rows]], 3))
            offset += length
        sends = {s: torch.cat(ts, 2) for s, ts in back.items()}
        counts = {d: sum(b - a for a, b in local) for d, local in self.sends.items()}
        like = dk.new_empty((*dk.shape[:3], D + dv.shape[3]))
        for d, t in self._exchange(sends, counts, like).items():
            at = 0
            for a, b in self.sends[d]:
                out[0][:, :, a:b] += t[:, :, at:at + b - a, :D]
                out[1][:, :, a:b] += t[:, :, at:at + b - a, D:]
                at += b - a
        return out[0], out[1]


class SparseAttention(torch.autograd.Function):
    """``out`` of this rank's query shard against the key rows it reads, exchanged by all-to-all."""

    @staticmethod
    def forward(ctx, q, k, v, additive, call, exchange: Exchange):
        k_all, v_all = exchange.gather(k, v)
        plan = call.plan(q, k_all, v_all, lambda qp: _cut(exchange.blocks, qp), additive)
        out, lse = gathered_forward(plan, call, q, k_all, v_all)
        ctx.save_for_backward(q, k, v, additive, out, lse)  # the rows are exchanged again: memory stays O(M_local)
        ctx.call, ctx.plan, ctx.exchange = call, plan, exchange
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, additive, out, lse = ctx.saved_tensors
        call, exchange = ctx.call, ctx.exchange
        k_all, v_all = exchange.gather(k, v)
        dq, dadd, dk_all, dv_all = gathered_backward(ctx.plan, call, q, k_all, v_all, out, lse, dout, additive)
        dk, dv = exchange.scatter_back(dk_all, dv_all, k.shape[2])
        return dq, dk.to(k.dtype), dv.to(v.dtype), dadd, None, None


def _cut(blocks: tuple[Piece, ...], qp: Piece) -> tuple[Piece, ...]:
    """``blocks`` cut where the query piece starts and ends (a causal pair then splits into a fully visible
    part and a plain causal square)."""
    out = []
    for b in blocks:
        cuts = sorted({b.start, b.start + b.length, *(c for c in (qp.start, qp.start + qp.length)
                                                       if b.start < c < b.start + b.length)})
        out += [Piece(a, e - a, b.local + a - b.start) for a, e in zip(cuts, cuts[1:])]
    return tuple(out)
