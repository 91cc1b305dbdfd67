"""Sequence layouts: which rows of the full sequence each rank of a process group holds.

With ``R`` ranks the sequence is cut into equal chunks:

- ``"zigzag"``: ``2R`` chunks; rank ``r`` holds chunks ``r`` and ``2R - 1 - r`` (in that order), so
  that under a causal mask every rank has the same amount of visible work;
- ``"contiguous"``: ``R`` chunks; rank ``r`` holds chunk ``r``.

A rank's shard is the concatenation of its :class:`Piece` s along the sequence dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import InputError

LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous")


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, start + length)`` of the full sequence, held at row ``local`` of a rank's shard."""

    start: int
    length: int
    local: int

    @property
    def rows(self) -> slice:
        """The piece's rows in the full sequence."""
        return slice(self.start, self.start + self.length)

    @property
    def local_rows(self) -> slice:
        """The piece's rows in the rank's shard."""
        return slice(self.local, self.local + self.length)


def check_layout(layout: str) -> None:
    """Raise :class:`~biasattn.InputError` unless ``layout`` is one of :data:`LAYOUTS`."""
    if layout not in LAYOUTS:
        raise InputError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def num_chunks(layout: str, world: int) -> int:
    """How many equal chunks the full sequence is cut into (``2R`` for zigzag, ``R`` for contiguous)."""
    check_layout(layout)
    return 2 * world if layout == "zigzag" else world


def check_full_length(name: str, full: int, layout: str, world: int) -> None:
    """Raise a clear error when a full sequence of ``full`` rows cannot be cut into equal chunks."""
    n = num_chunks(layout, world)
    if full % n:
        raise InputError(
            f"{name} has {full} rows along the sequence dim, not a multiple of {n}: the {layout!r} layout over "
            f"{world} ranks cuts the sequence into {n} equal chunks; pad it to {-(-full // n) * n} rows "
            "(hide the padding with PaddedKeysMask or BlockDiagonalMask)"
        )


def check_local_length(name: str, local: int, layout: str, world: int) -> None:
    """Raise a clear error when a shard of ``local`` rows is not made of equal chunks."""
    per_rank = num_chunks(layout, world) // world
    if local % per_rank:
        raise InputError(
            f"{name} holds {local} rows along the sequence dim; a {layout!r} shard is {per_rank} equal chunks, "
            f"so it must be a multiple of {per_rank} (shard the full sequence with shard_sequence)"
        )


def pieces(layout: str, world: int, rank: int, full: int) -> tuple[Piece, ...]:
    """The pieces of the full sequence (``full`` rows) that ``rank`` of ``world`` holds, in shard order."""
    check_full_length("the sequence", full, layout, world)
    if layout == "zigzag":
        c = full // (2 * world)
        return (Piece(rank * c, c, 0), Piece((2 * world - 1 - rank) * c, c, c))
    n = full // world
    return (Piece(rank * n, n, 0),)


def group_rank(group) -> tuple[int, int]:
    """``(world size, rank)`` of this process in ``group`` (None: the default group)."""
    if not dist.is_available() or not dist.is_initialized():
        raise InputError("context parallelism needs torch.distributed initialized: call torch.distributed.init_process_group")
    return dist.get_world_size(group), dist.get_rank(group)


def global_rank(group, rank: int) -> int:
    """The global rank of ``rank`` in ``group`` (what point-to-point calls take)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise InputError(f"dim must be in [{-x.dim()}, {x.dim()}) for a {x.dim()}-D tensor, got {dim}")
    return dim % x.dim()


def assemble(shards: list[torch.Tensor], dim: int, layout: str) -> torch.Tensor:
    """The full sequence in order from every rank's shard (``shards[r]`` is rank r's); differentiable."""
    world = len(shards)
    full = shards[0].shape[dim] * world
    parts = []
    for r, shard in enumerate(shards):
        parts += [(p.start, shard.narrow(dim, p.local, p.length)) for p in pieces(layout, world, r, full)]
    parts.sort(key=lambda sp: sp[0])
    return torch.cat([t for _, t in parts], dim)


def split(x: torch.Tensor, dim: int, layout: str, world: int) -> list[torch.Tensor]:
    """Every rank's shard of the full sequence ``x`` (the inverse of :func:`assemble`); differentiable."""
    full = x.shape[dim]
    out = []
    for r in range(world):
        ps = pieces(layout, world, r, full)
        out.append(torch.cat([x.narrow(dim, p.start, p.length) for p in ps], dim))
    return out


def shard_sequence(x: torch.Tensor, *, dim: int = 2, group=None, layout: str = "zigzag") -> torch.Tensor:
    """This rank's piece of a full sequence ``x`` (every rank passes the same ``x``).

    Args:
        x: the full tensor, e.g. q ``[B, H, M, D]`` with the sequence on ``dim``.
        dim: the sequence dim (2 for ``[B, H, M, D]``).
        group: the process group (None: the default group).
        layout: ``"zigzag"`` (rank r holds chunks r and 2R−1−r of 2R) or ``"contiguous"`` (chunk r of R).

    Returns:
        ``x`` restricted to this rank's rows along ``dim`` (a copy), ``M / R`` rows. Differentiable.

    Raises:
        InputError: when ``M`` is not a multiple of ``2R`` (zigzag) or ``R`` (contiguous).
    """
    check_layout(layout)
    dim = _dim(x, dim)
    world, rank = group_rank(group)
    check_full_length("x", x.shape[dim], layout, world)
    return torch.cat([x.narrow(dim, p.start, p.length) for p in pieces(layout, world, rank, x.shape[dim])], dim)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, dim, group, layout):
        world, rank = group_rank(group)
        ctx.dim, ctx.layout, ctx.world, ctx.rank = dim, layout, world, rank
        x_local = x_local.contiguous()
        shards = [torch.empty_like(x_local) for _ in range(world)]
        dist.all_gather(shards, x_local, group=group)
        return assemble(shards, dim, layout)

    @staticmethod
    def backward(ctx, grad):
        return split(grad, ctx.dim, ctx.layout, ctx.world)[ctx.rank], None, None, None


def gather_sequence(x_local: torch.Tensor, *, dim: int = 2, group=None, layout: str = "zigzag") -> torch.Tensor:
    """The full sequence from every rank's shard: the inverse of :func:`shard_sequence` (a collective).

    Args:
        x_local: this rank's shard, as :func:`shard_sequence` returns it.
        dim, group, layout: as given to :func:`shard_sequence`.

    Returns:
        The full tensor, ``R`` times ``x_local``'s rows along ``dim``, on every rank. Its gradient is
        taken as that of a replicated value (every rank computes the same loss from it): ``x_local``
        receives this rank's rows of the incoming gradient.
    """
    check_layout(layout)
    dim = _dim(x_local, dim)
    world, _ = group_rank(group)
    check_local_length("x_local", x_local.shape[dim], layout, world)
    return _Gather.apply(x_local, dim, group, layout)
