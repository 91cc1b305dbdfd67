"""Ring and all-gather context parallelism: the autograd functions over (query piece, key piece) pairs.

Ring, forward (``R`` ranks, step ``t``): rank ``r`` holds the K/V shard of rank ``r - t``; it sends
that shard on to ``r + 1`` and receives the next from ``r - 1`` while it computes the pairs of its
query pieces with the shard's key pieces. Backward: the K/V shards travel the same way, each with
its dK/dV accumulator, to which every rank adds its share; after ``R`` hops the accumulators are
back with their owners. All-gather: K/V are gathered once; their gradients are reduce-scattered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.common import compute_dtype
from . import comm
from .layout import Piece, assemble, pieces, split
from .pairs import Accumulator, Pair, pair_backward, pair_forward, plan_pair, slice_additive


@dataclass
class Call:
    """What one context-parallel call needs besides its tensors."""

    group: object
    world: int
    rank: int
    layout: str
    scale: float
    bias: object  # the full bias, sized, or None
    Mq_full: int
    Mk_full: int
    requires_grad: bool

    def q_pieces(self) -> tuple[Piece, ...]:
        return pieces(self.layout, self.world, self.rank, self.Mq_full)

    def plan(self, q, k, v, k_pieces, additive) -> list[Pair]:
        """The pairs of this rank's query pieces with ``k_pieces`` of the K/V block ``k``, ``v`` (skipped ones
        left out); ``k_pieces`` may be a function of the query piece."""
        planned = (
            plan_pair(q, k, v, self.bias, qp, kp, scale=self.scale, requires_grad=self.requires_grad, additive=additive)
            for qp in self.q_pieces() for kp in (k_pieces(qp) if callable(k_pieces) else k_pieces)
        )
        # pairs over more rows first: a query row's first partial is copied, the later ones merged
        return sorted((p for p in planned if p is not None), key=lambda p: -p.q_piece.length)

    def keys_cut_at(self, qp: Piece) -> tuple[Piece, ...]:
        """The gathered keys in up to three pieces, cut where the query piece ``qp`` starts and ends: with
        a causal mask the first is fully visible and the second is a plain causal square, which the
        fastest kernels take, where one pair over all keys would be a band with an offset."""
        cuts = sorted({0, min(qp.start, self.Mk_full), min(qp.start + qp.length, self.Mk_full), self.Mk_full})
        return tuple(Piece(a, b - a, a) for a, b in zip(cuts, cuts[1:]))


class Gradients:
    """Float accumulators of dq, and of dadditive when it is wanted."""

    def __init__(self, q, additive):
        dtype = compute_dtype(q.dtype)
        self.dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        self.dadd = None if additive is None else torch.zeros(additive.shape, dtype=dtype, device=additive.device)

    def pair(self, pair: Pair, q, k, v, scale, out, lse, dout, additive, dk, dv) -> None:
        """Run one pair's backward and add its gradients (dK/dV into ``dk``, ``dv`` at the pair's key rows)."""
        add = None if additive is None else slice_additive(additive, pair.q_piece, pair.k_piece)
        gq, gk, gv, ga = pair_backward(pair, q, k, v, scale, out, lse, dout, add)
        self.dq[:, :, pair.q_rows] += gq
        dk[:, :, pair.k_rows] += gk
        dv[:, :, pair.k_rows] += gv
        if self.dadd is not None and ga is not None:
            slice_additive(self.dadd, pair.q_piece, pair.k_piece).add_(ga)

    def result(self, q, additive):
        return self.dq.to(q.dtype), None if self.dadd is None else self.dadd.to(additive.dtype)


def gathered_forward(plan: list[Pair], call: Call, q, k_all, v_all) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out in q's dtype, lse)`` of this rank's queries from the pairs of ``plan`` over gathered K/V rows."""
    acc = Accumulator(q, v_all.shape[3], compute_dtype(q.dtype))
    for pair in plan:
        pair_forward(pair, q, k_all, v_all, call.scale, acc)
    return acc.out.to(q.dtype), acc.lse


def gathered_backward(plan: list[Pair], call: Call, q, k_all, v_all, out, lse, dout, additive):
    """``(dq, dadditive, dk_all, dv_all)`` of the pairs of ``plan`` over gathered K/V rows (dK/dV in the
    compute dtype, laid out as ``k_all`` and ``v_all``)."""
    dtype = compute_dtype(q.dtype)
    dk_all = torch.zeros(k_all.shape, dtype=dtype, device=k_all.device)
    dv_all = torch.zeros(v_all.shape, dtype=dtype, device=v_all.device)
    grads, dout = Gradients(q, additive), dout.contiguous()
    for pair in plan:
        grads.pair(pair, q, k_all, v_all, call.scale, out, lse, dout, additive, dk_all, dv_all)
    dq, dadd = grads.result(q, additive)
    return dq, dadd, dk_all, dv_all


class RingAttention(torch.autograd.Function):
    """``out`` of this rank's query shard; K/V (and in the backward dK/dV) travel around the ring."""

    @staticmethod
    def forward(ctx, q, k, v, additive, call: Call):
        W, r = call.world, call.rank
        plans = [call.plan(q, k, v, pieces(call.layout, W, s, call.Mk_full), additive) for s in range(W)]
        acc = Accumulator(q, v.shape[3], compute_dtype(q.dtype))
        kv = [k, v]
        for t in range(W):
            ex = comm.Exchange(kv, call.group, W, r, comm.KV_TAG) if t < W - 1 else None
            for pair in plans[(r - t) % W]:
                pair_forward(pair, q, kv[0], kv[1], call.scale, acc)
            if ex is not None:
                kv = ex.wait()
        out = acc.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, additive, out, acc.lse)
        ctx.call, ctx.plans = call, plans
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, additive, out, lse = ctx.saved_tensors
        call, W, r = ctx.call, ctx.call.world, ctx.call.rank
        dout = dout.contiguous()
        grads = Gradients(q, additive)
        dtype = compute_dtype(q.dtype)
        kv, travelling = [k, v], None
        for t in range(W):
            ex = comm.Exchange(kv, call.group, W, r, comm.KV_TAG) if t < W - 1 else None
            dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
            dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
            for pair in ctx.plans[(r - t) % W]:
                grads.pair(pair, q, kv[0], kv[1], call.scale, out, lse, dout, additive, dk, dv)
            if travelling is not None:  # the shares of the ranks before this one
                before = travelling.wait()
                dk += before[0]
                dv += before[1]
            travelling = comm.Exchange([dk, dv], call.group, W, r, comm.GRAD_TAG) if W > 1 else None
            if ex is not None:
                kv = ex.wait()
        dk, dv = travelling.wait() if travelling is not None else (dk, dv)
        dq, dadd = grads.result(q, additive)
        return dq, dk.to(k.dtype), dv.to(v.dtype), dadd, None


class AllGatherAttention(torch.autograd.Function):
    """``out`` of this rank's query shard against K/V gathered once; dK/dV reduce-scattered back."""

    @staticmethod
    def _gather(t, call: Call):
        return assemble(comm.all_gather_shards(t, call.group, call.world), 2, call.layout)

    @staticmethod
    def forward(ctx, q, k, v, additive, call: Call):
        k_all, v_all = AllGatherAttention._gather(k, call), AllGatherAttention._gather(v, call)
        plan = call.plan(q, k_all, v_all, call.keys_cut_at, additive)
        out, lse = gathered_forward(plan, call, q, k_all, v_all)
        ctx.save_for_backward(q, k, v, additive, out, lse)  # K/V gathered again in the backward: memory stays O(M_local)
        ctx.call, ctx.plan = call, plan
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, additive, out, lse = ctx.saved_tensors
        call = ctx.call
        k_all, v_all = AllGatherAttention._gather(k, call), AllGatherAttention._gather(v, call)
        dq, dadd, dk_all, dv_all = gathered_backward(ctx.plan, call, q, k_all, v_all, out, lse, dout, additive)
        dk = comm.reduce_scatter_shards(split(dk_all, 2, call.layout, call.world), call.group)
        dv = comm.reduce_scatter_shards(split(dv_all, 2, call.layout, call.world), call.group)
        return dq, dk.to(k.dtype), dv.to(v.dtype), dadd, None
