"""How a vendor kernel sees the inputs: sequences, ``cu_seqlens`` and the packed q/k/v.

The vendor operators (``cutlass``, ``flash2``, ``cudnn``) call kernels that think in *sequences*: a
batch row, or one packed segment, with ``Lq`` queries and ``Lk`` keys, a mask aligned to that
rectangle and ``cu_seqlens`` offsets. :func:`sequence_layout` turns a
:class:`~biasattn.bias.spec.BiasSpec` into that description with plain Python on host metadata, so
every decision is unit-testable without a GPU: batched, packed (segments) or padded-keys layout;
``cu_seqlens``; which keys must be gathered; each sequence's band in its own coordinates. The
packing helpers put q/k/v into the kernels' layout and gradients back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...bias.atoms import to_device
from ...bias.spec import BAND_UNBOUNDED, BiasSpec


def round_up(x: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``x``."""
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class Seq:
    """One kernel sequence: rows ``[q_start, q_start + Lq)`` see keys ``[k_start, k_start + Lk)``.

    ``q_start``/``k_start`` are in the call's coordinates (within batch row ``b``). ``lo``/``hi`` bound
    ``d' = (j - k_start) - (i - q_start)`` on this rectangle, None where the bound hides nothing.
    ``alibi_shift`` is the spec's ALiBi shift in the same local coordinates (None without ALiBi).
    """

    b: int
    q_start: int
    Lq: int
    k_start: int
    Lk: int
    lo: int | None
    hi: int | None
    alibi_shift: int | None = None

    @property
    def hides_all(self) -> bool:
        """True when the band hides every key of this sequence (rows present, none visible)."""
        if self.Lq == 0 or self.Lk == 0:
            return self.Lq > 0
        lo = -(self.Lq - 1) if self.lo is None else self.lo
        hi = self.Lk - 1 if self.hi is None else self.hi
        return lo > hi or lo > self.Lk - 1 or hi < -(self.Lq - 1)


def effective_band(lo: int | None, hi: int | None, Lq: int, Lk: int) -> tuple[int | None, int | None]:
    """``(lo, hi)`` with None where the bound hides nothing on an ``Lq × Lk`` rectangle (d = j - i)."""
    if lo is not None and (lo <= -BAND_UNBOUNDED or lo <= -(Lq - 1)):
        lo = None
    if hi is not None and (hi >= BAND_UNBOUNDED or hi >= Lk - 1):
        hi = None
    return lo, hi


@dataclass(frozen=True)
class SequenceLayout:
    """How the kernel sees the inputs.

    ``kind``: ``"batched"`` (q/k as ``[B, M, H, D]``, one sequence shape for every row),
    ``"segments"`` (B = 1, packed segments) or ``"padded"`` (B rows packed, padded keys dropped).
    ``cu_q``/``cu_k``: offsets into the packed q and k (empty when batched). ``gather``: ``(b, start,
    length)`` key slices to concatenate into the packed k/v, or None when keys are used in place.
    ``reason``: why the inputs cannot be expressed this way (None when they can).
    """

    kind: str
    seqs: tuple[Seq, ...]
    cu_q: tuple[int, ...] = ()
    cu_k: tuple[int, ...] = ()
    gather: tuple[tuple[int, int, int], ...] | None = None
    reason: str | None = None

    @functools.cached_property
    def max_q(self) -> int:
        return max((s.Lq for s in self.seqs), default=0)

    @functools.cached_property
    def max_k(self) -> int:
        return max((s.Lk for s in self.seqs), default=0)

    @property
    def varlen(self) -> bool:
        return self.kind != "batched"

    @functools.cached_property
    def has_work(self) -> bool:
        """True when some sequence has both queries and keys (the kernels fail on a launch without any)."""
        return any(s.Lq > 0 and s.Lk > 0 for s in self.seqs)

    @functools.cached_property
    def keyless(self) -> tuple[tuple[int, int, int], ...]:
        """``(b, first row, end row)`` of the sequences that have queries but no key: their rows see nothing,
        and the kernels leave them undefined (NaN seen from CUTLASS with ``cu_seqlens``)."""
        return tuple((s.b, s.q_start, s.q_start + s.Lq) for s in self.seqs if s.Lq > 0 and s.Lk == 0)

    @functools.cached_property
    def memo(self) -> dict:
        """Values computed from this layout, by key (see :meth:`cached`)."""
        return {}

    def cached(self, key, make, *args):
        """``make(*args)``, computed once per layout and ``key`` (the layout is immutable and reused within
        a call); passing ``args`` spares a hot caller a closure per call."""
        store = self.memo
        value = store.get(key, store)  # the store itself is never a value
        if value is store:
            value = store[key] = make(*args)
        return value


def _band_of(spec: BiasSpec, s: int) -> tuple[int | None, int | None]:
    h = spec.host
    if h.band_lo is None:
        return None, None
    k = 0 if len(h.band_lo) == 1 else s
    return h.band_lo[k], h.band_hi[k]


def _seq(spec: BiasSpec, b: int, q0: int, Lq: int, k0: int, Lk: int, band_index: int) -> Seq:
    lo, hi = _band_of(spec, band_index)
    shift = k0 - q0  # local d' = d - shift
    lo = None if lo is None or lo <= -BAND_UNBOUNDED else lo - shift
    hi = None if hi is None or hi >= BAND_UNBOUNDED else hi - shift
    lo, hi = effective_band(lo, hi, Lq, Lk)
    alibi = None if spec.alibi_slopes is None else spec.alibi_shift - shift
    return Seq(b, q0, Lq, k0, Lk, lo, hi, alibi)


def sequence_layout(spec: BiasSpec) -> SequenceLayout:
    """The kernel layout for ``spec`` (see :class:`SequenceLayout`); pure Python on host metadata."""
    h = spec.host
    if spec.q_seqstart is None and spec.kv_seqlens is not None and h.kv_seqlens is None:
        return SequenceLayout("padded", (), reason="needs the key lengths on the host; these live on the device only")
    if spec.q_seqstart is None and h.kv_seqlens is None:
        return SequenceLayout("batched", (_seq(spec, 0, 0, spec.Mq, 0, spec.Mk, 0),))
    if spec.q_seqstart is None:  # padded keys: B sequences of Mq queries and kv_seqlens[b] keys
        seqs = tuple(_seq(spec, b, 0, spec.Mq, 0, n, 0) for b, n in enumerate(h.kv_seqlens))
        cu_q = tuple(b * spec.Mq for b in range(spec.B + 1))
        cu_k = _cumsum(h.kv_seqlens)
        gather = tuple((b, 0, n) for b, n in enumerate(h.kv_seqlens))
        if spec.B == 1 and h.kv_seqlens[0] == spec.Mk:
            gather = None
        return SequenceLayout("padded", seqs, cu_q, cu_k, gather)
    qs, ks, kl = h.q_seqstart, h.k_seqstart, h.k_seqlen
    if qs is None:
        return SequenceLayout("segments", (), reason="needs the packed sequences' lengths on the host; calls read "
                                                     "them on the device only (lengths on a GPU tensor, or "
                                                     "self-attention documents built on a GPU)")
    n = len(kl)
    if qs[0] != 0 or qs[n] != spec.Mq:
        return SequenceLayout(
            "segments", (), reason=f"segments cover query rows [{qs[0]}, {qs[n]}), not every row [0, {spec.Mq})"
        )
    seqs = tuple(_seq(spec, 0, qs[s], qs[s + 1] - qs[s], ks[s], kl[s], s) for s in range(n))
    cu_q = tuple(qs[: n + 1])
    contiguous = all(ks[s] + kl[s] == ks[s + 1] for s in range(n - 1)) and ks[0] == 0
    if contiguous:
        return SequenceLayout("segments", seqs, cu_q, (0, *(ks[s] + kl[s] for s in range(n))), None)
    return SequenceLayout("segments", seqs, cu_q, _cumsum(kl), tuple((0, ks[s], kl[s]) for s in range(n)))


def _cumsum(lengths) -> tuple[int, ...]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


def rows_may_be_empty(spec: BiasSpec, layout: SequenceLayout) -> bool:
    """True unless host metadata proves every query row sees at least one key (ignores additive -inf)."""
    if layout.reason is not None or spec.layout is not None:
        return True
    for s in layout.seqs:
        if s.Lq == 0:
            continue
        if s.Lk == 0 or s.hides_all:
            return True
        lo = -(s.Lq - 1) if s.lo is None else s.lo
        hi = s.Lk - 1 if s.hi is None else s.hi
        # row r sees keys [max(0, r + lo), min(Lk, r + hi + 1)); empty for some r iff one end crosses
        if hi < 0 or (s.Lq - 1) + lo > s.Lk - 1:
            return True
    return False


def cu_seqlens(spec: BiasSpec, layout: SequenceLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens_q, cu_seqlens_k)`` int32 on ``device`` (cached on the spec)."""
    return spec.cached(("cu", str(device)), lambda: (
        to_device(layout.cu_q, device, torch.int32), to_device(layout.cu_k, device, torch.int32)))


def pack_queries(x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """``[B, H, M, D]`` as the kernel wants it: ``[B, M, H, D]`` (batched) or ``[B*M, H, D]`` (varlen)."""
    x = x.transpose(1, 2)
    return x.reshape(-1, *x.shape[2:]) if layout.varlen else x


def unpack_queries(x: torch.Tensor, layout: SequenceLayout, B: int) -> torch.Tensor:
    """Inverse of :func:`pack_queries`: back to ``[B, H, M, D]`` (a view)."""
    if layout.varlen:
        x = x.reshape(B, -1, *x.shape[1:])
    return x.transpose(1, 2)


def pack_keys(x: torch.Tensor, spec: BiasSpec, layout: SequenceLayout) -> torch.Tensor:
    """Keys/values ``[B, Hkv, Mk, D]`` in kernel layout; packed varlen gathers only the used keys."""
    if not layout.varlen or layout.gather is None:
        return pack_queries(x, layout)
    bi, ji = spec.cached(("keys", str(x.device)), lambda: key_index(layout, x.device))
    return x.transpose(1, 2)[bi, ji]


def unpack_keys(g: torch.Tensor, spec: BiasSpec, layout: SequenceLayout, B: int, Mk: int) -> torch.Tensor:
    """Key/value gradients from kernel layout back to ``[B, Hkv, Mk, D]``, 0 for keys no sequence used."""
    if layout.varlen and layout.gather is not None:
        full = torch.zeros((B, Mk, *g.shape[1:]), dtype=g.dtype, device=g.device)
        bi, ji = spec.cached(("keys", str(g.device)), lambda: key_index(layout, g.device))
        full[bi, ji] = g
        return full.transpose(1, 2)
    if layout.varlen and layout.cu_k[-1] < g.shape[0]:
        g[layout.cu_k[-1]:] = 0  # keys after the last sequence: the kernels leave them unwritten
    return unpack_queries(g, layout, B)


def pad_head_dim(x: torch.Tensor, multiple: int = 8) -> torch.Tensor:
    """Zero-pad the last dim to a multiple of ``multiple`` (a copy only when needed); q·k and p·v are unchanged."""
    d = x.shape[-1]
    return x if d % multiple == 0 else torch.nn.functional.pad(x, (0, multiple - d % multiple))


def key_index(layout: SequenceLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(batch, key)`` int64 indices of the gathered keys, in packed order (``layout.gather`` set)."""
    bs, js = [], []
    for b, start, n in layout.gather:
        bs.extend([b] * n)
        js.extend(range(start, start + n))
    return to_device(bs, device, torch.int64), to_device(js, device, torch.int64)
