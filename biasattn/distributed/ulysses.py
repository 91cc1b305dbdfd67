"""Ulysses context parallelism: an all-to-all trades the sequence split for a head split.

Each rank sends head group ``g`` of its sequence shard to rank ``g`` and receives its own head
group of every shard: it then holds the full sequence for ``H / R`` heads and runs one ordinary
attention with the full bias (restricted to those heads). A second all-to-all brings the output
back to sequence shards. Both all-to-alls are differentiable (each one's backward is the other).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..api import attention
from ..bias import AttentionBias
from ..errors import InputError, NotSupportedError
from . import comm
from .layout import assemble, split

# The dim of each atom kind's tensor that holds heads, counted from the end (absent: no heads).
_HEAD_DIM_FROM_END = {"additive": -3, "alibi": -1, "layout": -3}


def select_heads(bias: AttentionBias | None, h0: int, h1: int) -> AttentionBias | None:
    """``bias`` restricted to heads ``[h0, h1)`` (unchanged when it broadcasts over heads); stays lazy.

    Gradients of additive tensors flow through the selection.
    """
    if bias is None or bias.sizes[1] is None:
        return bias
    atoms = []
    for atom in bias.atoms:
        changes = {}
        at = _HEAD_DIM_FROM_END.get(atom.kind)
        if atom.sizes()[1] is not None and at is None:
            raise NotSupportedError(f"cannot restrict a {atom.family} term to a head group for method='ulysses'")
        for name, t in atom.tensors().items() if atom.sizes()[1] is not None else ():
            if t.dim() >= -at and t.shape[at] != 1:
                changes[name] = t.narrow(t.dim() + at, h0, h1 - h0)
        atoms.append(replace(atom, **changes) if changes else atom)
    return bias._derive(atoms=tuple(atoms))


class _SequenceToHeads(torch.autograd.Function):
    """``[B, H, M_local, D]`` sequence shards → ``[B, H / R, M, D]``: all rows of this rank's head group."""

    @staticmethod
    def forward(ctx, x, group, world, layout):
        ctx.args = (group, world, layout)
        return sequence_to_heads(x, group, world, layout)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_sequence(grad, *ctx.args), None, None, None


class _HeadsToSequence(torch.autograd.Function):
    """The inverse of :class:`_SequenceToHeads`."""

    @staticmethod
    def forward(ctx, x, group, world, layout):
        ctx.args = (group, world, layout)
        return heads_to_sequence(x, group, world, layout)

    @staticmethod
    def backward(ctx, grad):
        return sequence_to_heads(grad, *ctx.args), None, None, None


def sequence_to_heads(x: torch.Tensor, group, world: int, layout: str) -> torch.Tensor:
    """The all-to-all of :class:`_SequenceToHeads` (no autograd)."""
    B, H, M, D = x.shape
    chunks = x.reshape(B, world, H // world, M, D).transpose(0, 1)  # chunk g: head group g
    received = comm.all_to_all(chunks, group)  # chunk r: rank r's rows of this rank's head group
    return assemble(list(received.unbind(0)), 2, layout)


def heads_to_sequence(x: torch.Tensor, group, world: int, layout: str) -> torch.Tensor:
    """The all-to-all of :class:`_HeadsToSequence` (no autograd)."""
    B, Hg, _, D = x.shape
    received = comm.all_to_all(torch.stack(split(x, 2, layout, world)), group)  # chunk g: head group g of my rows
    return received.transpose(0, 1).reshape(B, world * Hg, -1, D)


def ulysses_attention(q, k, v, bias, *, group, world: int, rank: int, layout: str, scale, dropout_p: float):
    """This rank's output shard by the head split (see the module doc)."""
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hq % world:
        raise InputError(
            f"method='ulysses' splits the heads over the {world} ranks: q has Hq={Hq} heads, not a multiple of {world}"
        )
    repeat = world // math.gcd(Hkv, world)  # KV heads repeated until each head group has whole KV heads
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    qh, kh, vh = (_SequenceToHeads.apply(t, group, world, layout) for t in (q, k, v))
    per = Hq // world
    out = attention(qh, kh, vh, select_heads(bias, rank * per, (rank + 1) * per), scale=scale, dropout_p=dropout_p)
    return _HeadsToSequence.apply(out, group, world, layout)
