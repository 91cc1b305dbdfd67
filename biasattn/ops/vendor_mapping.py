"""From a :class:`~biasattn.bias.spec.BiasSpec` to the arguments of PyTorch's fused attention kernels.

The vendor operators (``cutlass``, ``flash2``, ``cudnn``) call kernels that think in *sequences*: a
batch row, or one packed segment, with ``Lq`` queries and ``Lk`` keys, a mask aligned to that
rectangle (causal from the top-left or the bottom-right corner, a window around the bottom-right
diagonal) and ``cu_seqlens`` offsets. This module turns the spec into that description with plain
Python on host metadata, so every decision is unit-testable without a GPU:

- :func:`plan_sequences`: batched, packed (segments) or padded-keys layout; ``cu_seqlens``; which
  keys must be gathered; each sequence's band in its own coordinates.
- :func:`cutlass_mask_type`, :func:`flash_window`, :func:`cudnn_causal`: the kernel's mask argument
  that reproduces the spec's band exactly on every sequence, or None.
- :func:`alibi_matches`: whether the kernel's ALiBi alignment equals the spec's.
- :func:`aligned_bias`: the additive tensor with the kernel's alignment (a padded copy only if needed).
- :func:`lse_from_kernel` / :func:`lse_to_kernel`: the kernels' log-sum-exp layouts to and from
  ``[B, H, Mq]`` float32 with ``-inf`` on rows that see no key.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..bias.spec import BAND_UNBOUNDED, BiasSpec
from ..inputs import AttentionInputs
from .base import Operator, _dtype_name

NO_MASK, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = 0, 1, 2  # aten._efficient_attention_forward custom_mask_type


def round_up(x: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``x``."""
    return -(-x // multiple) * multiple


# --------------------------------------------------------------------------------------- sequences
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
class SeqPlan:
    """How the kernel sees the inputs.

    ``layout``: ``"batched"`` (q/k as ``[B, M, H, D]``, one sequence shape for every row),
    ``"segments"`` (B = 1, packed segments) or ``"padded"`` (B rows packed, padded keys dropped).
    ``cu_q``/``cu_k``: offsets into the packed q and k (empty when batched). ``gather``: ``(b, start,
    length)`` key slices to concatenate into the packed k/v, or None when keys are used in place.
    ``reason``: why the inputs cannot be expressed this way (None when they can).
    """

    layout: str
    seqs: tuple[Seq, ...]
    cu_q: tuple[int, ...] = ()
    cu_k: tuple[int, ...] = ()
    gather: tuple[tuple[int, int, int], ...] | None = None
    reason: str | None = None

    @property
    def max_q(self) -> int:
        return max((s.Lq for s in self.seqs), default=0)

    @property
    def max_k(self) -> int:
        return max((s.Lk for s in self.seqs), default=0)

    @property
    def varlen(self) -> bool:
        return self.layout != "batched"

    @property
    def has_work(self) -> bool:
        """True when some sequence has both queries and keys (the kernels fail on a launch without any)."""
        return any(s.Lq > 0 and s.Lk > 0 for s in self.seqs)

    @property
    def keyless(self) -> tuple[tuple[int, int, int], ...]:
        """``(b, first row, end row)`` of the sequences that have queries but no key: their rows see nothing,
        and the kernels leave them undefined (NaN seen from CUTLASS with ``cu_seqlens``)."""
        return tuple((s.b, s.q_start, s.q_start + s.Lq) for s in self.seqs if s.Lq > 0 and s.Lk == 0)

    def cached(self, key, make):
        """``make()``, computed once per plan and ``key`` (the plan is immutable and reused within a call)."""
        store = self.__dict__.setdefault("_memo", {})
        if key not in store:
            store[key] = make()
        return store[key]


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


def plan_sequences(spec: BiasSpec) -> SeqPlan:
    """The kernel layout for ``spec`` (see :class:`SeqPlan`); pure Python on host metadata."""
    h = spec.host
    if spec.q_seqstart is None and h.kv_seqlens is None:
        return SeqPlan("batched", (_seq(spec, 0, 0, spec.Mq, 0, spec.Mk, 0),))
    if spec.q_seqstart is None:  # padded keys: B sequences of Mq queries and kv_seqlens[b] keys
        seqs = tuple(_seq(spec, b, 0, spec.Mq, 0, n, 0) for b, n in enumerate(h.kv_seqlens))
        cu_q = tuple(b * spec.Mq for b in range(spec.B + 1))
        cu_k = _cumsum(h.kv_seqlens)
        gather = tuple((b, 0, n) for b, n in enumerate(h.kv_seqlens))
        if spec.B == 1 and h.kv_seqlens[0] == spec.Mk:
            gather = None
        return SeqPlan("padded", seqs, cu_q, cu_k, gather)
    qs, ks, kl = h.q_seqstart, h.k_seqstart, h.k_seqlen
    n = len(kl)
    if qs[0] != 0 or qs[n] != spec.Mq:
        return SeqPlan(
            "segments", (), reason=f"segments cover query rows [{qs[0]}, {qs[n]}), not every row [0, {spec.Mq})"
        )
    seqs = tuple(_seq(spec, 0, qs[s], qs[s + 1] - qs[s], ks[s], kl[s], s) for s in range(n))
    cu_q = tuple(qs[: n + 1])
    contiguous = all(ks[s] + kl[s] == ks[s + 1] for s in range(n - 1)) and ks[0] == 0
    if contiguous:
        return SeqPlan("segments", seqs, cu_q, (0, *(ks[s] + kl[s] for s in range(n))), None)
    return SeqPlan("segments", seqs, cu_q, _cumsum(kl), tuple((0, ks[s], kl[s]) for s in range(n)))


def _cumsum(lengths) -> tuple[int, ...]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


def rows_may_be_empty(spec: BiasSpec, plan: SeqPlan) -> bool:
    """True unless host metadata proves every query row sees at least one key (ignores additive -inf)."""
    if plan.reason is not None or spec.layout is not None:
        return True
    for s in plan.seqs:
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


# --------------------------------------------------------------------------------------- masks
def _per_plan(fn):
    """Memoize ``fn(plan)`` on the plan: dispatch asks each question several times per call."""

    @functools.wraps(fn)
    def memoized(plan: SeqPlan):
        return plan.cached(fn.__name__, lambda: fn(plan))

    return memoized


def _matches(plan: SeqPlan, kernel_band) -> bool:
    """True when ``kernel_band(seq) -> (lo, hi)`` equals every sequence's band on its rectangle."""
    for s in plan.seqs:
        if s.Lq == 0 or s.Lk == 0:
            continue
        lo, hi = kernel_band(s)
        if effective_band(lo, hi, s.Lq, s.Lk) != (s.lo, s.hi):
            return False
    return True


@_per_plan
def cutlass_mask_type(plan: SeqPlan) -> int | None:
    """``custom_mask_type`` (0 none, 1 causal top-left, 2 causal bottom-right) matching the plan, or None."""
    for mask_type, band in (
        (NO_MASK, lambda s: (None, None)),
        (CAUSAL_TOP_LEFT, lambda s: (None, 0)),
        (CAUSAL_BOTTOM_RIGHT, lambda s: (None, s.Lk - s.Lq)),
    ):
        if _matches(plan, band):
            return mask_type
    return None


@_per_plan
def cudnn_causal(plan: SeqPlan) -> bool | None:
    """``is_causal`` for cuDNN (top-left causal), or None when the band is neither none nor that."""
    if _matches(plan, lambda s: (None, None)):
        return False
    if _matches(plan, lambda s: (None, 0)):
        return True
    return None


@_per_plan
def flash_window(plan: SeqPlan) -> tuple[int, int] | None:
    """``(window_size_left, window_size_right)`` for FlashAttention (-1 = unbounded), or None.

    FlashAttention keeps key ``j`` of row ``i`` when ``i + Lk - Lq - left <= j <= i + Lk - Lq + right``
    in each sequence; a window of at least ``max_k`` keys counts as unbounded.
    """
    max_k = plan.max_k
    result = []
    for side in ("left", "right"):
        exact: set[int] = set()
        floor = 0  # an exact value must be >= floor to stay harmless on unbounded sequences
        for s in plan.seqs:
            if s.Lq == 0 or s.Lk == 0:
                continue
            bound = s.lo if side == "left" else s.hi
            if bound is None:
                floor = max(floor, s.Lk - 1 if side == "left" else s.Lq - 1)
            else:
                w = (s.Lk - s.Lq) - bound if side == "left" else bound - (s.Lk - s.Lq)
                if w < 0:
                    return None
                exact.add(w)
        if not exact:
            result.append(-1)
            continue
        if len(exact) > 1:
            return None
        w = exact.pop()
        if w < floor or w >= max_k:  # would hide keys elsewhere, or the kernel would read it as unbounded
            return None
        result.append(w)
    return result[0], result[1]


def alibi_matches(plan: SeqPlan) -> bool:
    """True when each sequence's ALiBi shift is the kernels' bottom-right one, ``Lk - Lq``."""
    return all(s.alibi_shift == s.Lk - s.Lq for s in plan.seqs if s.Lq and s.Lk)


# --------------------------------------------------------------------------------------- tensors
def bias_is_aligned(t: torch.Tensor, Mk: int, dtype: torch.dtype, align: int = 8) -> bool:
    """True when ``t`` (4-D) can be handed to the kernels as is: dtype, contiguous last dim of size
    ``Mk``, strides of dims 0-2 multiples of ``align`` elements (or of size 1), 16-byte aligned start."""
    if t.dtype != dtype or t.dim() != 4 or t.shape[-1] != Mk or (Mk > 1 and t.stride(-1) != 1):
        return False
    if any(t.shape[d] > 1 and t.stride(d) % align for d in range(3)):
        return False
    return t.data_ptr() % (align * t.element_size()) == 0


def aligned_bias(t: torch.Tensor, shape: tuple[int, int, int, int], dtype: torch.dtype, align: int = 8) -> torch.Tensor:
    """``t`` (4-D, broadcastable to ``shape = [B, H, Mq, Mk]``) as an aligned ``[B, H, Mq, Mk]`` view.

    Copies only when :func:`bias_is_aligned` fails: into a buffer whose last dim is padded to a
    multiple of ``align``, keeping broadcast dims of size 1 (expanded with stride 0, never copied).
    """
    Mk = shape[3]
    if not bias_is_aligned(t, Mk, dtype, align):
        lead = tuple(t.shape[:3])
        buf = torch.empty((*lead, round_up(Mk, align)), dtype=dtype, device=t.device)[..., :Mk]
        buf.copy_(t.expand(*lead, Mk))
        t = buf
    return t.expand(shape)


LSE_LAYOUTS = ("bhm", "bhm1", "h_total", "total_h1", "seq_h_m")


def lse_layout(raw: torch.Tensor, plan: SeqPlan, B: int, H: int, Mq: int) -> str:
    """Recognize a kernel's log-sum-exp layout (one of :data:`LSE_LAYOUTS`) from its shape."""
    shape, total = tuple(raw.shape), B * Mq
    if raw.dim() == 4 and shape[:3] == (B, H, Mq) and shape[3] == 1:
        return "bhm1"
    if plan.varlen and len(plan.seqs) > 1 and raw.dim() in (3, 4) and shape[:2] == (len(plan.seqs), H):
        if shape[2] >= plan.max_q and (raw.dim() == 3 or shape[3] == 1):
            return "seq_h_m"
    if raw.dim() == 3 and shape[:2] == (B, H) and shape[2] >= Mq:
        return "bhm"
    if raw.dim() == 2 and shape == (H, total):
        return "h_total"
    if raw.dim() in (2, 3) and shape[:2] == (total, H) and raw.numel() == total * H:
        return "total_h1"
    raise RuntimeError(f"unexpected log-sum-exp layout {list(shape)} for B={B}, H={H}, Mq={Mq}")


def lse_from_kernel(
    raw: torch.Tensor, plan: SeqPlan, B: int, H: int, Mq: int, layout: str, *, rows_may_be_hidden: bool = True,
) -> torch.Tensor:
    """A kernel's log-sum-exp (``layout``, see :func:`lse_to_kernel`) as ``[B, H, Mq]`` float32,
    ``-inf`` where a row sees no key (kernels write ``+inf``, ``-inf`` or NaN there). With
    ``rows_may_be_hidden=False`` (every row sees a key) the values are taken as they are."""
    if layout == "bhm":
        lse = raw[:, :, :Mq]
    elif layout == "bhm1":
        lse = raw[..., 0]
    elif layout == "h_total":
        lse = raw.reshape(H, B, Mq).transpose(0, 1)
    elif layout == "total_h1":
        lse = raw.reshape(B, Mq, H).transpose(1, 2)
    elif layout == "seq_h_m":
        seg, pos = packed_row_index(plan, raw.device)
        raw = raw[..., 0] if raw.dim() == 4 else raw
        lse = raw[seg, :, pos].reshape(B, Mq, H).transpose(1, 2)
    else:
        raise ValueError(f"layout must be one of {LSE_LAYOUTS}, got {layout!r}")
    if not rows_may_be_hidden:
        return lse.float().contiguous()
    inf = float("inf")
    return torch.nan_to_num(lse.float(), nan=-inf, posinf=-inf, neginf=-inf).contiguous()


def lse_to_kernel(lse: torch.Tensor, plan: SeqPlan, layout: str, pad: int = 1) -> torch.Tensor:
    """``lse [B, H, Mq]`` (ours) in a kernel's layout, ``+inf`` on empty rows (so their weights are 0).

    ``layout``: ``"bhm"`` (``[B, H, round_up(Mq, pad)]``), ``"bhm1"`` (``[B, H, Mq, 1]``), ``"h_total"``,
    ``"total_h1"`` or ``"seq_h_m"`` (``[nseq, H, round_up(max_q, pad)]``).
    """
    B, H, Mq = lse.shape
    lse = torch.where(torch.isneginf(lse), float("inf"), lse.float())
    if layout == "bhm":
        out = torch.full((B, H, round_up(Mq, pad)), float("inf"), dtype=torch.float32, device=lse.device)
        out[:, :, :Mq] = lse
        return out
    if layout == "bhm1":
        return lse[..., None].contiguous()
    if layout == "h_total":
        return lse.transpose(0, 1).reshape(H, B * Mq).contiguous()
    if layout == "total_h1":
        return lse.transpose(1, 2).reshape(B * Mq, H, 1).contiguous()
    if layout == "seq_h_m":
        n = len(plan.seqs)
        out = torch.full((n, H, round_up(max(plan.max_q, 1), pad)), float("inf"), dtype=torch.float32, device=lse.device)
        seg, pos = packed_row_index(plan, lse.device)
        out[seg, :, pos] = lse.transpose(0, 1).reshape(H, B * Mq).transpose(0, 1)
        return out
    raise ValueError(f"layout must be bhm, bhm1, h_total, total_h1 or seq_h_m, got {layout!r}")


def packed_row_index(plan: SeqPlan, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For every packed query row, its sequence index and its position in the sequence (int64; cached on the plan)."""
    return plan.cached(("rows", str(device)), lambda: _packed_row_index(plan, device))


def _packed_row_index(plan: SeqPlan, device) -> tuple[torch.Tensor, torch.Tensor]:
    seg, pos = [], []
    for n, s in enumerate(plan.seqs):
        seg.extend([n] * s.Lq)
        pos.extend(range(s.Lq))
    return to_device(seg, device), to_device(pos, device)


def key_index(plan: SeqPlan, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(batch, key)`` int64 indices of the gathered keys, in packed order (``plan.gather`` set)."""
    bs, js = [], []
    for b, start, n in plan.gather:
        bs.extend([b] * n)
        js.extend(range(start, start + n))
    return to_device(bs, device), to_device(js, device)


def to_device(values, device, dtype=torch.int64) -> torch.Tensor:
    """A host list on ``device`` without a host sync (pinned, non-blocking copy on CUDA)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# --------------------------------------------------------------------------------------- operators
def exact_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """True when every ``src`` value converts to ``dst`` unchanged (the same dtype, or a wider float32/float64)."""
    return src == dst or (dst in (torch.float32, torch.float64) and src.itemsize < dst.itemsize)


def aten_entry(name: str):
    """``torch.ops.aten.<name>`` or None when the installed torch lacks it."""
    return getattr(torch.ops.aten, name) if hasattr(torch.ops.aten, name) else None


@dataclass
class VendorCtx:
    """What a vendor forward keeps for its backward: the kernel's own lse and dropout state."""

    op: str
    lse_raw: torch.Tensor
    lse_layout: str
    rng: tuple = ()


class VendorOperator(Operator):
    """Shared declarations and checks of the operators that call PyTorch's fused CUDA kernels.

    Shared rules: an additive bias is handed over in q's dtype, so one that would be rounded (a
    float32 bias with bfloat16 q) is refused, bool masks excepted (0 and -inf are exact); a call in
    which no sequence has both queries and keys launches nothing; rows of sequences without keys
    get 0 and lse ``-inf`` whatever the kernel wrote, and 0 query gradients.
    """

    DEVICES = frozenset({"cuda"})
    DETERMINISTIC = False
    POSITIVE_SCALE_ONLY = True  # FlashAttention-2 takes row maxima of unscaled scores; the others are unverified
    ENTRY_POINTS: ClassVar[tuple[str, ...]] = ()

    def environment_reasons(self, device=None) -> list[str]:
        """The installed torch's missing entry points (probed once: dispatch asks on every call)."""
        cache = type(self).__dict__.get("_environment_cache")
        if cache is None:
            cache = self.probe_environment()
            type(self)._environment_cache = cache
        return list(cache)

    def probe_environment(self) -> list[str]:
        """Reasons from the installed torch and CUDA build (entry points, kernel availability)."""
        missing = [n for n in self.ENTRY_POINTS if aten_entry(n) is None]
        if missing:
            names = ", ".join(f"torch.ops.aten.{n}" for n in missing)
            return [f"needs {names}, which torch {torch.__version__} lacks"]
        return []

    def _reasons(self, inp: AttentionInputs, need_lse: bool, backward: bool) -> Iterator[str]:
        yield from super()._reasons(inp, need_lse, backward)
        if need_lse and backward:
            yield "its backward kernel cannot take a gradient through the log-sum-exp"
        add = inp.additive
        if add is not None and not inp.spec.additive_is_mask and not exact_cast(add.dtype, inp.dtype):
            yield (f"takes the additive bias in q's dtype and would round the {_dtype_name(add.dtype)} bias given to "
                   f"{_dtype_name(inp.dtype)}")

    def plan(self, inp: AttentionInputs) -> SeqPlan:
        """The :class:`SeqPlan` of ``inp.spec`` (cached on the spec)."""
        return inp.spec.cached("plan", lambda: plan_sequences(inp.spec))

    def _rows_may_be_empty(self, inp: AttentionInputs, plan: SeqPlan) -> bool:
        """:func:`rows_may_be_empty`, asked once per plan."""
        return plan.cached("rows_may_be_empty", lambda: rows_may_be_empty(inp.spec, plan))

    def rows_may_be_hidden(self, inp: AttentionInputs, plan: SeqPlan) -> bool:
        """Whether some query row may see no key: host metadata cannot rule it out, or an additive
        bias may hide a whole row."""
        return inp.additive is not None or self._rows_may_be_empty(inp, plan)

    def kernel_lse(self, raw: torch.Tensor, inp: AttentionInputs, plan: SeqPlan, layout: str) -> torch.Tensor:
        """:func:`lse_from_kernel` of the call, rows without keys fixed only where some may exist."""
        hidden = self.rows_may_be_hidden(inp, plan)
        lse = lse_from_kernel(raw, plan, inp.B, inp.Hq, inp.Mq, layout, rows_may_be_hidden=hidden)
        keyless = self.keyless_rows(inp, plan)
        return lse if keyless is None else lse.masked_fill(keyless, float("-inf"))

    def keyless_rows(self, inp: AttentionInputs, plan: SeqPlan) -> torch.Tensor | None:
        """Bool ``[B, 1, Mq]`` on the device: rows of sequences with no key (:attr:`SeqPlan.keyless`), or None."""
        if not plan.keyless:
            return None

        def make():
            mask = torch.zeros((inp.B, 1, inp.Mq), dtype=torch.bool)
            for b, a, e in plan.keyless:
                mask[b, :, a:e] = True
            return mask.to(inp.device, non_blocking=True)

        return plan.cached(("keyless", str(inp.device)), make)

    def zero_keyless_rows(self, inp: AttentionInputs, plan: SeqPlan, t: torch.Tensor) -> torch.Tensor:
        """``t [B, H, Mq, *]`` with 0 on :meth:`keyless_rows` (a query gradient, say)."""
        keyless = self.keyless_rows(inp, plan)
        return t if keyless is None else t.masked_fill(keyless[..., None], 0)

    def fwd(self, inp: AttentionInputs):
        plan = self.plan(inp)
        if not plan.has_work:  # every row sees nothing: no launch
            out = inp.q.new_zeros((inp.B, inp.Hq, inp.Mq, inp.Dv))
            return out, torch.full((inp.B, inp.Hq, inp.Mq), float("-inf"), device=inp.device), None
        return self.kernel_fwd(inp, plan)

    def bwd(self, inp, out, lse, ctx, dout, dlse):
        plan = self.plan(inp)
        add = inp.additive
        dadd = torch.zeros_like(add) if add is not None and add.requires_grad else None
        if not plan.has_work:
            return torch.zeros_like(inp.q), torch.zeros_like(inp.k), torch.zeros_like(inp.v), dadd
        dq, dk, dv, dadd = self.kernel_bwd(inp, plan, out, lse, ctx, dout)
        return self.zero_keyless_rows(inp, plan, dq), dk, dv, dadd

    def kernel_fwd(self, inp: AttentionInputs, plan: SeqPlan):
        """:meth:`fwd` for a plan with work: ``(out, lse, ctx)``."""
        raise NotImplementedError

    def kernel_bwd(self, inp: AttentionInputs, plan: SeqPlan, out, lse, ctx, dout):
        """:meth:`bwd` for a plan with work: ``(dq, dk, dv, dadditive)``."""
        raise NotImplementedError

    def fix_empty_rows(self, inp: AttentionInputs, plan: SeqPlan, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """``out`` with 0 on rows that see no key, when host metadata says such rows may exist."""
        if self._rows_may_be_empty(inp, plan):
            out = torch.where(torch.isneginf(lse)[..., None], torch.zeros((), dtype=out.dtype, device=out.device), out)
        return out


def cu_seqlens(spec: BiasSpec, plan: SeqPlan, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens_q, cu_seqlens_k)`` int32 on ``device`` (cached on the spec)."""
    return spec.cached(("cu", str(device)), lambda: (
        to_device(plan.cu_q, device, torch.int32), to_device(plan.cu_k, device, torch.int32)))


def pack_queries(x: torch.Tensor, plan: SeqPlan) -> torch.Tensor:
    """``[B, H, M, D]`` as the kernel wants it: ``[B, M, H, D]`` (batched) or ``[B*M, H, D]`` (varlen)."""
    x = x.transpose(1, 2)
    return x.reshape(-1, *x.shape[2:]) if plan.varlen else x


def unpack_queries(x: torch.Tensor, plan: SeqPlan, B: int) -> torch.Tensor:
    """Inverse of :func:`pack_queries`: back to ``[B, H, M, D]`` (a view)."""
    if plan.varlen:
        x = x.reshape(B, -1, *x.shape[1:])
    return x.transpose(1, 2)


def pack_keys(x: torch.Tensor, spec: BiasSpec, plan: SeqPlan) -> torch.Tensor:
    """Keys/values ``[B, Hkv, Mk, D]`` in kernel layout; packed varlen gathers only the used keys."""
    if not plan.varlen or plan.gather is None:
        return pack_queries(x, plan)
    bi, ji = spec.cached(("keys", str(x.device)), lambda: key_index(plan, x.device))
    return x.transpose(1, 2)[bi, ji]


def unpack_keys(g: torch.Tensor, spec: BiasSpec, plan: SeqPlan, B: int, Mk: int) -> torch.Tensor:
    """Key/value gradients from kernel layout back to ``[B, Hkv, Mk, D]``, 0 for keys no sequence used."""
    if plan.varlen and plan.gather is not None:
        full = torch.zeros((B, Mk, *g.shape[1:]), dtype=g.dtype, device=g.device)
        bi, ji = spec.cached(("keys", str(g.device)), lambda: key_index(plan, g.device))
        full[bi, ji] = g
        return full.transpose(1, 2)
    if plan.varlen and plan.cu_k[-1] < g.shape[0]:
        g[plan.cu_k[-1]:] = 0  # keys after the last sequence: the kernels leave them unwritten
    return unpack_queries(g, plan, B)


def pad_head_dim(x: torch.Tensor, multiple: int = 8) -> torch.Tensor:
    """Zero-pad the last dim to a multiple of ``multiple`` (a copy only when needed); q·k and p·v are unchanged."""
    d = x.shape[-1]
    return x if d % multiple == 0 else torch.nn.functional.pad(x, (0, multiple - d % multiple))
