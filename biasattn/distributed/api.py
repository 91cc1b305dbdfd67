"""``context_parallel_attention``: one attention over a sequence sharded across the ranks of a group."""

from __future__ import annotations

import torch

from ..bias import lower
from ..errors import InputError, NotSupportedError
from ..inputs import as_bias, make_inputs
from . import documents, sparse
from .layout import check_layout, check_local_length, group_rank
from .pairs import default_scale
from .ring import AllGatherAttention, Call, RingAttention
from .ulysses import ulysses_attention

METHODS: tuple[str, ...] = ("ring", "allgather", "ulysses")


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_bias=None,
    *,
    group=None,
    layout: str = "zigzag",
    method: str = "ring",
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention of this rank's query shard over the whole sharded sequence, with a bias of the full sequence.

    Every rank of ``group`` calls this with its shards (from :func:`shard_sequence` with the same
    ``layout``); the result is this rank's shard of ``biasattn.attention(q, k, v, attn_bias)`` on the
    gathered tensors. Differentiable in q, k, v and the tensor of an additive bias.

    Args:
        q: ``[B, Hq, Mq_local, D]``, this rank's query rows. k: ``[B, Hkv, Mk_local, D]``;
            v: ``[B, Hkv, Mk_local, Dv]`` with ``Hq % Hkv == 0``.
        attn_bias: any biasattn bias or composition (or a float / bool tensor) describing the FULL
            ``[B, Hq, R·Mq_local, R·Mk_local]`` attention; unsized masks are sized to it.
        group: the process group (None: the default group), NCCL on GPUs or gloo on the CPU.
        layout: ``"zigzag"`` (rank r holds chunks r and 2R−1−r of 2R: balanced under causal masks)
            or ``"contiguous"`` (chunk r of R).
        method: ``"ring"`` (K/V passed around the ring, overlapped with the attention), ``"allgather"``
            (K/V gathered once), or ``"ulysses"`` (all-to-all to a head split; ``Hq`` must be a
            multiple of the group size). Where the bias hides from the queries at least three
            quarters of the rows an all-gather would move (packed documents, a window, padded
            keys), ``"ring"`` and ``"allgather"`` both exchange only the key rows that some query
            can see, in one all-to-all; packed documents then run as one local attention call.
        scale: defaults to ``1 / sqrt(D)``.
        dropout_p: supported by ``"ulysses"`` only (ring and all-gather raise NotSupportedError).

    Returns:
        ``[B, Hq, Mq_local, Dv]``, this rank's output rows. The gradient of an additive bias tensor
        (the same on every rank) is this rank's share of it: sum it over the group, as data
        parallelism does for parameters.

    Raises:
        InputError: a bad layout or method, shards that are not whole chunks, a bias that does
            not describe the full sequence, or (ulysses) heads that do not divide by the group size.
        NotSupportedError: dropout with ring or all-gather.
    """
    check_layout(layout)
    if method not in METHODS:
        raise InputError(f"method must be one of {METHODS}, got {method!r}")
    world, rank = group_rank(group)
    make_inputs(q, k, v, None, scale=scale, dropout_p=dropout_p)  # shapes, dtypes, devices, scale, dropout_p
    check_local_length("q", q.shape[2], layout, world)
    check_local_length("k", k.shape[2], layout, world)
    Mq_full, Mk_full = q.shape[2] * world, k.shape[2] * world
    bias = _full_bias(as_bias(attn_bias), Mq_full, Mk_full, world)
    if method == "ulysses":
        return ulysses_attention(q, k, v, bias, group=group, world=world, rank=rank, layout=layout, scale=scale,
                                 dropout_p=dropout_p)
    if dropout_p > 0:
        raise NotSupportedError(
            f"method={method!r} does not support dropout (dropout_p={dropout_p}): each (query, key) shard pair "
            "would draw its own mask; use method='ulysses' or dropout_p=0"
        )
    grad = torch.is_grad_enabled()
    additive = None
    if grad and bias is not None and any(t.requires_grad for a in bias.atoms for t in a.tensors().values()):
        additive = lower(bias, q.shape[0], q.shape[1], Mq_full, Mk_full, q.device).additive
        additive = additive if additive is not None and additive.requires_grad else None
    requires_grad = grad and (q.requires_grad or k.requires_grad or v.requires_grad or additive is not None)
    call = Call(group, world, rank, layout, default_scale(q, scale), bias, Mq_full, Mk_full, requires_grad)
    if bias is not None:
        reads, packed = documents.reads_and_documents(call, q.shape[0], q.shape[1], q.device)
        if sparse.worth_it(reads, k.shape[2]):
            exchange = sparse.Exchange(call, reads)
            if packed is not None:
                return documents.documents_attention(q, k, v, scale, exchange, packed)
            return sparse.SparseAttention.apply(q, k, v, additive, call, exchange)
    fn = RingAttention if method == "ring" else AllGatherAttention
    return fn.apply(q, k, v, additive, call)


def _full_bias(bias, Mq_full: int, Mk_full: int, world: int):
    """``bias`` sized to the full sequence (unsized masks are bound to it); a clear error if it is sized otherwise."""
    if bias is None:
        return None
    _, _, bMq, bMk = bias.sizes
    for name, got, want in (("Mq", bMq, Mq_full), ("Mk", bMk, Mk_full)):
        if got is not None and got != want:
            raise InputError(
                f"attn_bias describes the full sequence: it has {name}={got}, the {world} shards together have "
                f"{name}={want}"
            )
    return bias if bMq is not None and bMk is not None else bias.bind(Mq_full, Mk_full)
