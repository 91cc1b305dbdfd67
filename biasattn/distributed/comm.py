"""The collectives context parallelism uses, on any torch.distributed backend (NCCL, gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .layout import global_rank

# Tags keep the two point-to-point streams of the ring backward apart on backends that match by tag.
KV_TAG = 11
GRAD_TAG = 12


class Exchange:
    """Tensors sent to the next rank of the ring while the same number arrive from the previous one.

    ``wait()`` returns the received tensors; until then neither side may be read or written.
    """

    def __init__(self, send: list[torch.Tensor], group, world: int, rank: int, tag: int):
        self.sent = [t.contiguous() for t in send]
        self.received = [torch.empty_like(t) for t in self.sent]
        nxt, prv = global_rank(group, (rank + 1) % world), global_rank(group, (rank - 1) % world)
        ops = [dist.P2POp(dist.isend, t, nxt, group, tag) for t in self.sent]
        ops += [dist.P2POp(dist.irecv, t, prv, group, tag) for t in self.received]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        self.works, self.sent = [], []
        return self.received


# torch 2.13 renamed the flat collectives (the old names warn); older releases have only the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_shards(x: torch.Tensor, group, world: int) -> list[torch.Tensor]:
    """Every rank's ``x`` (equal shapes), as a list indexed by rank."""
    x = x.contiguous()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _ALL_GATHER(out, x, group=group)
    return list(out.view(world, *x.shape).unbind(0))


def reduce_scatter_shards(shards: list[torch.Tensor], group) -> torch.Tensor:
    """``Σ over ranks of shards[r]`` arrives at rank ``r`` (each rank passes one tensor per rank)."""
    stacked = torch.stack(shards)
    out = torch.empty_like(shards[0])
    _REDUCE_SCATTER(out, stacked.view(-1, *shards[0].shape[1:]), group=group)
    return out


def all_to_all(chunks: torch.Tensor, group) -> torch.Tensor:
    """``chunks [R, ...]``: chunk ``r`` goes to rank ``r``; returns ``[R, ...]`` with chunk ``r`` from rank ``r``."""
    chunks = chunks.contiguous()
    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks, group=group)
    return out
