"""One (query piece, key piece) pair: its lazy bias slice, whether it is skipped, and its raw passes.

A pair is planned once per call: the full bias is sliced lazily to the pair's rows and columns and
lowered; a pair whose slice hides every key from every query is dropped (nothing is launched for
it). The forward runs the chosen operator's raw ``fwd`` and merges by log-sum-exp. The backward is
the flash-attention decomposition: with the merged (global) ``out`` and ``lse`` of the rows, a
pair's ``dq``, ``dk``, ``dv`` and ``dbias`` are exactly its share of the full gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import dispatch
from ..bias import AttentionBias
from ..bias.spec import BiasSpec
from ..inputs import AttentionInputs, make_inputs
from ..ops.base import Operator
from ..ops.merge import merge_partials
from ..ops.tiles import key_range, layout_allows, query_range
from .layout import Piece

#: Operators whose backward computes the probabilities from the ``lse`` it is given and the row
#: term ``Σ dout·out`` from the ``out`` it is given (when the forward was another operator's): given
#: the merged out and lse, their backward on one pair is that pair's share of the gradient.
GLOBAL_LSE_BACKWARD = ("chunked", "triton", "flash2", "cudnn")


@dataclass
class Pair:
    """A (query piece, key piece) pair to compute: rows of the local q, rows of a K/V block, and how."""

    q_piece: Piece  # its rows of this rank's q shard: q_piece.local_rows
    k_piece: Piece  # its rows of the K/V block the pair reads: k_piece.local_rows
    bias: AttentionBias | None  # the lazy slice of the full bias
    spec: BiasSpec
    fwd_op: Operator
    bwd_op: Operator | None
    global_lse_backward: bool  # bwd_op takes the merged out and lse (else: the pair's own, re-derived)

    @property
    def q_rows(self) -> slice:
        return self.q_piece.local_rows

    @property
    def k_rows(self) -> slice:
        return self.k_piece.local_rows

    def inputs(self, q, k, v, scale: float, requires_grad: bool) -> AttentionInputs:
        """The pair's attention inputs on the given q shard and K/V block."""
        qr, kr = self.q_rows, self.k_rows
        return AttentionInputs(q=q[:, :, qr], k=k[:, :, kr], v=v[:, :, kr], bias=self.bias, spec=self.spec, scale=scale,
                               dropout_p=0.0, requires_grad=requires_grad)


def hides_everything(spec: BiasSpec) -> bool:
    """True when the spec hides every key from every query (decided from host metadata, no device sync)."""
    if spec.Mq == 0 or spec.Mk == 0:
        return True
    lo, hi = key_range(spec, 0, spec.Mq)
    return lo >= hi or not layout_allows(spec, 0, spec.Mq, lo, hi)


def slice_additive(additive: torch.Tensor, q: Piece, k: Piece) -> torch.Tensor:
    """The rows and columns of a 4-D additive tensor (broadcast dims stay 1) that a pair sees."""
    a = additive[:, :, q.rows] if additive.shape[2] != 1 else additive
    return a[:, :, :, k.rows] if a.shape[3] != 1 else a


def plan_pair(q, k, v, bias, qp: Piece, kp: Piece, *, scale: float, requires_grad: bool,
              additive: torch.Tensor | None) -> Pair | None:
    """Plan the pair of global pieces ``qp`` × ``kp`` (read at their ``local`` rows of q and k); None when skipped.

    ``q``, ``k``, ``v`` only need the shapes of the real tensors. ``additive``: the full 4-D
    additive tensor when its gradient is wanted (the pair's slice of it then carries the gradient).
    """
    qr, kr = qp.local_rows, kp.local_rows
    sliced = None if bias is None else bias[..., qp.rows, kp.rows]
    inp = make_inputs(q[:, :, qr], k[:, :, kr], v[:, :, kr], sliced, scale=scale, requires_grad=requires_grad)
    if hides_everything(inp.spec):
        return None
    lo, hi = query_range(inp.spec)
    if (lo, hi) != (0, qp.length):  # only these rows see a key of kp: the pair (and its merge) is theirs alone
        return plan_pair(q, k, v, bias, Piece(qp.start + lo, hi - lo, qp.local + lo), kp, scale=scale,
                         requires_grad=requires_grad, additive=additive)
    if additive is not None:
        inp = inp.with_tensors(inp.q, inp.k, inp.v, slice_additive(additive, qp, kp).detach().requires_grad_(True))
    # Every operator's forward gives the lse the merge needs, and a backward that takes the merged out
    # and lse needs no gradient through the pair's own lse: the choice is the one of a plain call.
    fwd_op, bwd_op = dispatch.choose(inp)
    if bwd_op is not None and bwd_op.NAME not in GLOBAL_LSE_BACKWARD:  # prefer one that takes the merged out and lse
        merged = (op for op in dispatch.candidates(inp.device.type, inp, backward=True)
                  if op.NAME in GLOBAL_LSE_BACKWARD and op.supports(inp, backward=True))
        bwd_op = next(merged, None) or dispatch.choose(inp, need_lse=True)[1]  # else: a gradient through its own lse
    global_lse = bwd_op is not None and bwd_op.NAME in GLOBAL_LSE_BACKWARD
    return Pair(qp, kp, sliced, inp.spec, fwd_op, bwd_op, global_lse)


class Accumulator:
    """The merged output and log-sum-exp of this rank's query rows, in the compute dtype."""

    def __init__(self, q: torch.Tensor, Dv: int, dtype: torch.dtype):
        B, H, M, _ = q.shape
        self.out = torch.zeros((B, H, M, Dv), dtype=dtype, device=q.device)
        self.lse = torch.full((B, H, M), float("-inf"), dtype=dtype, device=q.device)
        self.seen: list[tuple[int, int]] = []  # row ranges that hold a partial already

    def add(self, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge the attention of ``rows`` over more keys into what is held."""
        if not any(a < rows.stop and rows.start < b for a, b in self.seen):  # a first partial is copied, not merged
            self.seen.append((rows.start, rows.stop))
            self.out[:, :, rows] = out
            self.lse[:, :, rows] = lse
            return
        o, s = merge_partials(
            torch.stack([self.out[:, :, rows], out.to(self.out.dtype)]),
            torch.stack([self.lse[:, :, rows], lse.to(self.lse.dtype)]),
            self.out.dtype,
        )
        self.out[:, :, rows] = o
        self.lse[:, :, rows] = s


def pair_forward(pair: Pair, q, k, v, scale: float, acc: Accumulator) -> None:
    """Attention of one pair, merged into ``acc``."""
    out, lse, _ = pair.fwd_op.fwd(pair.inputs(q, k, v, scale, False))
    acc.add(pair.q_rows, out, lse)


def pair_backward(pair: Pair, q, k, v, scale: float, out, lse, dout, additive: torch.Tensor | None):
    """``(dq, dk, dv, dadditive or None)`` of one pair given the merged ``out``, ``lse`` of its rows.

    ``out``, ``lse``, ``dout``: this rank's full shard (the pair's rows are taken here). ``additive``:
    the pair's slice of the additive tensor when its gradient is wanted.
    """
    inp = pair.inputs(q, k, v, scale, True)
    if additive is not None:
        inp = inp.with_tensors(inp.q, inp.k, inp.v, additive.detach().requires_grad_(True))
    rows = pair.q_rows
    o, s, do = out[:, :, rows], lse[:, :, rows], dout[:, :, rows]
    if pair.global_lse_backward:
        return pair.bwd_op.bwd(inp, o, s, None, do, None)
    # Any other operator: its own forward of the pair, and the gradient that reaches the pair's
    # (out_p, lse_p) through the merge: dout_p = w·dout, dlse_p = w·Σ dout·(out_p − out), w = e^(lse_p − lse).
    op = pair.bwd_op
    o_p, s_p, ctx = op.fwd(inp)
    dtype = s_p.dtype
    w = torch.exp(s_p.to(dtype) - torch.where(torch.isneginf(s), 0.0, s).to(dtype))
    w = torch.where(torch.isneginf(s_p), 0.0, w)
    do_p = (w[..., None] * do.to(dtype)).to(do.dtype)
    dlse_p = w * (do.to(dtype) * (o_p.to(dtype) - o.to(dtype))).sum(-1)
    return op.bwd(inp, o_p, s_p, ctx, do_p, dlse_p)


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    """``scale``, or ``1/sqrt(D)``."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
