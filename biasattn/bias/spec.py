"""Lowering: every bias, composed or not, becomes one frozen :class:`BiasSpec` for given q/k sizes.

Operators read only the spec. All coordinates in a spec are the call's own: query row ``i`` in
``[0, Mq)``, key column ``j`` in ``[0, Mk)``; slicing offsets are already folded in. A key is visible
to a query when every present field allows it:

- segments: ``i`` lies in segment ``s`` (``q_seqstart[s] <= i < q_seqstart[s+1]``) and
  ``k_seqstart[s] <= j < k_seqstart[s] + k_seqlen[s]``; rows outside every segment see nothing;
- padded keys: ``j < kv_seqlens[b]``;
- band: ``band_lo[s] <= j - i <= band_hi[s]`` (``s`` is the row's segment, or 0 when the band is
  uniform: ``band_lo`` has one element);
- block layout: ``layout[b, h, (i + layout_q_off) // block_q, (j + layout_k_off) // block_k]``.

Visible scores then get ``additive[b, h, i, j]`` and ``-alibi_slopes[b, h] * |j - i - alibi_shift|``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from ..errors import InputError
from ..memo import BoundedCache
from .atoms import faking, tensor_layout, tensor_version, to_device
from .band import segment_diagonals

BAND_UNBOUNDED = 2**30
_MISSING = object()  # a store's "no entry" (None may be an entry)
_INT_TENSORS = BoundedCache(256)


def _int_tensor(values, device) -> torch.Tensor:
    """int32 tensor of ``values`` on ``device``, made once per (values, device) and never written to:
    a fresh one per call would copy a host list to the GPU on every call."""
    device = torch.get_default_device() if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" means the current device, which may change
        device = torch.device("cuda", torch.cuda.current_device())
    if faking():
        return to_device(list(values), device, torch.int32)
    key = (tuple(values), str(device))
    t = _INT_TENSORS.get(key)
    if t is None:
        t = _INT_TENSORS[key] = to_device(list(values), device, torch.int32)
    return t


FEATURES = ("segments", "padded_keys", "band", "layout", "additive", "alibi")


@dataclass(frozen=True)
class SpecHost:
    """Host (CPU, Python) copies of the small metadata, so no decision needs a device sync.

    The block layout is kept as given (``layout_tensor``, on any device); its CPU copy
    :attr:`layout` is made on first use only, since copying a device tensor to the host waits for
    the GPU, and the GPU kernels never need it.
    """

    q_seqstart: tuple[int, ...] | None = None
    k_seqstart: tuple[int, ...] | None = None
    k_seqlen: tuple[int, ...] | None = None
    kv_seqlens: tuple[int, ...] | None = None
    band_lo: tuple[int, ...] | None = None
    band_hi: tuple[int, ...] | None = None
    layout_tensor: torch.Tensor | None = None

    @functools.cached_property
    def layout(self) -> torch.Tensor | None:
        """The block layout on the CPU (copied from the device on first use), or None."""
        t = self.layout_tensor
        if t is None or t.device.type == "cpu":
            return t
        return t.to("cpu")


@dataclass(frozen=True)
class BiasSpec:
    """Kernel-facing description of a bias for a call of size ``[B, H, Mq, Mk]`` (see module doc)."""

    B: int
    H: int
    Mq: int
    Mk: int
    q_seqstart: torch.Tensor | None = None
    k_seqstart: torch.Tensor | None = None
    k_seqlen: torch.Tensor | None = None
    kv_seqlens: torch.Tensor | None = None
    band_lo: torch.Tensor | None = None
    band_hi: torch.Tensor | None = None
    layout: torch.Tensor | None = None
    block_q: int = 0
    block_k: int = 0
    layout_q_off: int = 0
    layout_k_off: int = 0
    additive: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None
    alibi_shift: int = 0
    additive_is_mask: bool = False  # the additive tensor holds only 0 and -inf (bool masks): exact in every dtype
    host: SpecHost = field(default_factory=SpecHost)
    # What an operator derives from this spec for its launches (filled on first use, never copied by
    # dataclasses.replace): the backward of a call reuses what its forward built.
    derived: BoundedCache = field(default_factory=lambda: BoundedCache(64), init=False, repr=False, compare=False)
    # What follows from the structure alone (shapes, host copies, features), shared with every spec
    # :meth:`rebound` from this one: a mask built afresh every step derives it once.
    by_structure: BoundedCache = field(default_factory=lambda: BoundedCache(64), init=False, repr=False,
                                       compare=False)

    @functools.cached_property
    def features(self) -> frozenset[str]:
        """Names of the fields that are present (a subset of :data:`FEATURES`)."""
        present = {
            "segments": self.q_seqstart is not None,
            "padded_keys": self.kv_seqlens is not None,
            "band": self.band_lo is not None,
            "layout": self.layout is not None,
            "additive": self.additive is not None,
            "alibi": self.alibi_slopes is not None,
        }
        return frozenset(k for k, v in present.items() if v)

    def rebound(self, tensors: dict) -> BiasSpec:
        """This spec with the given tensor fields replaced (lengths of the same shape, dtype and device)
        and a store of its own: what an operator derived from this spec's tensors is not shared; what
        it derived from the structure (:meth:`cached_by_structure`) is."""
        new = object.__new__(BiasSpec)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(tensors)
        new.__dict__["derived"] = BoundedCache(64)
        return new

    @property
    def key_lengths_only(self) -> bool:
        """Whether the spec's only field is per-sequence key lengths (a cache-length mask, often built
        anew every decode step): operators read the length values on the device, and on the host
        only to tune a launch, so what is derived from one such spec may serve another of its kind."""
        return (self.kv_seqlens is not None and self.q_seqstart is None and self.band_lo is None
                and self.layout is None and self.additive is None and self.alibi_slopes is None)

    def cached(self, key, make):
        """``make()``, computed once per spec and ``key`` and kept in :attr:`derived`."""
        store = self.derived
        value = store.get(key, _MISSING)
        if value is _MISSING:
            value = store[key] = make()
        return value

    def cached_by_structure(self, key, make):
        """``make()`` for a value that depends on the spec's structure only (shapes, dtypes, host copies,
        features; never a tensor's values or identity), computed once for every spec rebound from one."""
        store = self.by_structure
        value = store.get(key, _MISSING)
        if value is _MISSING:
            value = store[key] = make()
        return value

    @property
    def num_segments(self) -> int:
        """Number of packed segments (0 without segments)."""
        return 0 if self.k_seqlen is None or self.q_seqstart is None else self.k_seqlen.shape[0]

    @property
    def band_uniform(self) -> bool:
        """True when one band applies to every row."""
        return self.host.band_lo is not None and len(self.host.band_lo) == 1

    def causal_kind(self) -> str | None:
        """``"top_left"``/``"bottom_right"`` when the band is plain causal with that alignment, else None.

        Alignment is relative to the call's Mq/Mk (or to each segment when segments are present).
        """
        if self.host.band_lo is None or any(lo > -BAND_UNBOUNDED for lo in self.host.band_lo):
            return None
        his = self.host.band_hi
        if self.q_seqstart is None:
            if len(his) != 1:
                return None
            if his[0] == 0:
                return "top_left"
            if his[0] == self.Mk - self.Mq:
                return "bottom_right"
            return None
        qs, ks, kl = self.host.q_seqstart, self.host.k_seqstart, self.host.k_seqlen
        hi = [his[0]] * len(kl) if len(his) == 1 else list(his)
        if all(h == ks[s] - qs[s] for s, h in enumerate(hi)):
            return "top_left"
        if all(h == ks[s] + kl[s] - qs[s + 1] for s, h in enumerate(hi)):
            return "bottom_right"
        return None

    def window(self) -> tuple[int | None, int | None]:
        """``(left, right)`` of a uniform band relative to its diagonal, None where unbounded."""
        if self.host.band_lo is None or len(self.host.band_lo) != 1:
            return (None, None)
        lo, hi = self.host.band_lo[0], self.host.band_hi[0]
        return (None if lo <= -BAND_UNBOUNDED else lo, None if hi >= BAND_UNBOUNDED else hi)


class SpecBuilder:
    """Collects atoms' contributions in the bias' global coordinates; :meth:`build` folds offsets."""

    def __init__(self, g, device, atoms: tuple = ()):
        self.g = g
        self.device = device
        self.atoms = atoms  # every term of the bias: an atom's lowering may depend on the others
        self.segments: tuple[list[int], list[int], list[int]] | None = None
        self.segment_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.segment_band: tuple[list[int], list[int]] | None = None
        self.device_segments: tuple | None = None  # (q_seqstart, k_seqstart, k_seqlen, band): lengths not read
        self.constant_band = True  # the band's tensors follow from the structure alone, not from lengths
        self.band = [-BAND_UNBOUNDED, BAND_UNBOUNDED]
        self.has_band = False
        self.kv_seqlens: list[int] | None = None
        self.kv_tensor: torch.Tensor | None = None
        self.layout = None
        self.additive: torch.Tensor | None = None
        self.additive_is_mask = True
        self.alibi: torch.Tensor | None = None
        self.alibi_shift = 0

    # Contributions, in global coordinates (d = j - i on the bias' own full grid).
    def add_band(self, lo: int | None, hi: int | None) -> None:
        self.has_band = True
        if lo is not None:
            self.band[0] = max(self.band[0], lo)
        if hi is not None:
            self.band[1] = min(self.band[1], hi)

    def add_segments(self, qs, ks, kl, tensors, band=None) -> None:
        if self.segments is not None:  # equal segments (checked when composing): intersect the bands
            if band is not None and self.segment_band is not None:
                lo, hi = self.segment_band
                band = ([max(a, b) for a, b in zip(lo, band[0])], [min(a, b) for a, b in zip(hi, band[1])])
            if band is not None:
                self.segment_band = (list(band[0]), list(band[1]))
            return
        self.segments = (list(qs), list(ks), list(kl))
        self.segment_tensors = tensors
        if band is not None:
            self.segment_band = (list(band[0]), list(band[1]))

    def add_device_segments(self, tensors, band) -> None:
        """Segments whose lengths only the device holds: ``(q_seqstart, k_seqstart, k_seqlen)`` and the
        band ``(alignment, left, right)`` local to each segment (or None); nothing is read."""
        if self.segments is not None or self.device_segments is not None:
            raise InputError("a BlockDiagonalMask on lengths that only the device holds cannot be combined with "
                             "another BlockDiagonalMask")
        self.device_segments = (*tensors, band)

    def add_kv_seqlens(self, lengths, tensor) -> None:
        """Key lengths: ``tensor`` on the device, ``lengths`` its values when the host has them (else None)."""
        if self.kv_tensor is None:
            self.kv_seqlens, self.kv_tensor = (None if lengths is None else list(lengths)), tensor
            return
        n, m = self.kv_tensor.shape[0], tensor.shape[0]
        if n != m and 1 not in (n, m):
            raise InputError(f"cannot compose PaddedKeysMask with {n} and {m} lengths")
        if self.kv_seqlens is not None and lengths is not None:
            a, b = list(self.kv_seqlens), list(lengths)
            a, b = a * (len(b) if len(a) == 1 else 1), b * (len(a) if len(b) == 1 else 1)
            self.kv_seqlens = [min(x, y) for x, y in zip(a, b)]
        else:
            self.kv_seqlens = None
        self.kv_tensor = torch.minimum(self.kv_tensor, tensor)

    def add_layout(self, layout: torch.Tensor, bq: int, bk: int) -> None:
        if self.layout is None:
            self.layout = (layout, bq, bk)
        else:
            self.layout = (self.layout[0] & layout, bq, bk)

    def add_additive(self, tensor: torch.Tensor, is_mask: bool = False) -> None:
        self.additive = tensor if self.additive is None else self.additive + tensor
        self.additive_is_mask = self.additive_is_mask and is_mask

    def add_alibi(self, slopes: torch.Tensor, shift: int) -> None:
        self.alibi = slopes if self.alibi is None else self.alibi + slopes
        self.alibi_shift = shift

    def _build_device_segments(self, kw: dict) -> None:
        """Segment tensors (and their band) shifted to the call's coordinates on the device, no value read:
        the kernels clip lines to the call, so lines no segment covers see nothing."""
        g = self.g
        if self.kv_tensor is not None:
            raise InputError("a BlockDiagonalMask on lengths that only the device holds cannot be combined with "
                             "PaddedKeysMask")
        qs, ks, kl, band = self.device_segments
        i32 = torch.int32
        n = kl.shape[0]
        if g.q_off or g.k_off or g.Mq != g.Mq_full or g.Mk != g.Mk_full:  # a slice: starts move with it, clipped to it
            end = (ks[:n] + kl - g.k_off).clamp(0, g.Mk)
            qs, ks = qs - g.q_off, ks - g.k_off  # the band's diagonals follow these, before clipping
            kw["q_seqstart"] = qs.clamp(0, g.Mq).to(i32)
            kw["k_seqstart"] = ks.clamp(0, g.Mk).to(i32)
            kw["k_seqlen"] = (end - kw["k_seqstart"][:n]).clamp(min=0).to(i32)
        else:
            kw["q_seqstart"], kw["k_seqstart"], kw["k_seqlen"] = qs, ks, kl
        if band is None and not self.has_band:
            return
        lo_g, hi_g = self.band
        shift = g.q_off - g.k_off  # local d = global d + shift
        if band is None:
            kw["band_lo"] = _int_tensor([lo_g if abs(lo_g) >= BAND_UNBOUNDED else lo_g + shift], self.device)
            kw["band_hi"] = _int_tensor([hi_g if abs(hi_g) >= BAND_UNBOUNDED else hi_g + shift], self.device)
            return
        alignment, left, right = band
        if self.device_segments[0] is self.device_segments[1]:  # one tensor of starts: every diagonal is `shift`
            lo = -BAND_UNBOUNDED if left is None else shift - left
            hi = BAND_UNBOUNDED if right is None else shift + right
            lo = lo if lo_g <= -BAND_UNBOUNDED else max(lo, lo_g + shift)
            hi = hi if hi_g >= BAND_UNBOUNDED else min(hi, hi_g + shift)
            kw["band_lo"], kw["band_hi"] = _int_tensor([lo], self.device), _int_tensor([hi], self.device)
            return
        self.constant_band = False
        diag = segment_diagonals(qs[: n + 1], ks[: n + 1], alignment)  # in the call's coordinates
        lo = diag - left if left is not None else torch.full_like(diag, -BAND_UNBOUNDED)
        hi = diag + right if right is not None else torch.full_like(diag, BAND_UNBOUNDED)
        if lo_g > -BAND_UNBOUNDED:
            lo = torch.clamp(lo, min=lo_g + shift)
        if hi_g < BAND_UNBOUNDED:
            hi = torch.clamp(hi, max=hi_g + shift)
        kw["band_lo"], kw["band_hi"] = lo.to(i32), hi.to(i32)

    def build(self) -> BiasSpec:
        g = self.g
        dev = self.device
        shift = g.q_off - g.k_off  # local d = global d + shift
        kw: dict = {}
        host: dict = {}

        if self.segments is not None:
            if self.kv_tensor is not None and self.kv_seqlens is None:  # packed segments are planned on the host
                self.kv_seqlens = self.kv_tensor.tolist()
            if self.kv_seqlens is not None and len(self.kv_seqlens) != 1:
                raise InputError(
                    f"packed (block-diagonal) biases need batch size 1, padded keys give {len(self.kv_seqlens)}"
                )
            sq, sks, skl = self.segments
            whole = (g.q_off, g.k_off, g.Mq, g.Mk) == (0, 0, g.Mq_full, g.Mk_full) and self.kv_seqlens is None
            if whole and 0 <= min(sq) and max(sq) <= g.Mq and 0 <= min(sks) and min(skl, default=0) >= 0 and all(
                    a + n <= g.Mk for a, n in zip(sks, skl)):  # the call covers the whole mask: nothing to clip
                lq, lks, lkl = sq, sks, skl
            else:
                qs, ks, kl = (np.asarray(x, dtype=np.int64) for x in self.segments)
                if self.kv_seqlens is not None:
                    kl = np.maximum(np.minimum(kl, self.kv_seqlens[0] - ks[: len(kl)]), 0)
                lq = np.clip(qs - g.q_off, 0, g.Mq)
                lks = np.clip(ks - g.k_off, 0, g.Mk)
                kend = np.clip(ks[: len(kl)] + kl - g.k_off, 0, g.Mk)
                lkl = np.maximum(kend - lks[: len(kl)], 0)
                lq, lks, lkl = lq.tolist(), lks.tolist(), lkl.tolist()
            unchanged = (lq, lks, lkl) == tuple(map(list, self.segments))
            if unchanged and self.segment_tensors is not None:
                kw["q_seqstart"], kw["k_seqstart"], kw["k_seqlen"] = self.segment_tensors
            else:
                kw["q_seqstart"] = _int_tensor(lq, dev)
                kw["k_seqstart"] = _int_tensor(lks, dev)
                kw["k_seqlen"] = _int_tensor(lkl, dev)
            host.update(q_seqstart=tuple(lq), k_seqstart=tuple(lks), k_seqlen=tuple(lkl))
        elif self.device_segments is not None:
            self._build_device_segments(kw)
        elif self.kv_tensor is not None:
            n = self.kv_tensor.shape[0]
            if n != g.B and n != 1:
                raise InputError(f"PaddedKeysMask has {n} lengths, q has batch size B={g.B}")
            if self.kv_seqlens is not None:
                kv = [min(max(x - g.k_off, 0), g.Mk) for x in self.kv_seqlens] * (g.B if n == 1 else 1)
                same = kv == self.kv_seqlens
                kw["kv_seqlens"] = self.kv_tensor if same else _int_tensor(kv, dev)
                host["kv_seqlens"] = tuple(kv)
            else:
                # Values only the device holds: shifted there, never read. Kernels hide key j >= length,
                # so a negative length hides every key and one above Mk none.
                t = self.kv_tensor if g.k_off == 0 else self.kv_tensor - g.k_off
                kw["kv_seqlens"] = t.expand(g.B).contiguous() if n != g.B else t

        if (self.has_band or self.segment_band is not None) and self.device_segments is None:
            lo_g, hi_g = self.band
            if self.segment_band is not None:
                los = np.maximum(np.asarray(self.segment_band[0], dtype=np.int64), lo_g)
                his = np.minimum(np.asarray(self.segment_band[1], dtype=np.int64), hi_g)
            else:
                los, his = np.array([lo_g], dtype=np.int64), np.array([hi_g], dtype=np.int64)
            # to the call's coordinates; an unbounded side stays unbounded
            los = np.where(np.abs(los) >= BAND_UNBOUNDED, los, los + shift).tolist()
            his = np.where(np.abs(his) >= BAND_UNBOUNDED, his, his + shift).tolist()
            if len(set(los)) == 1 and len(set(his)) == 1:
                los, his = los[:1], his[:1]
            # a uniform band around every (row, key) pair of the call hides nothing: no band
            # (bottom-right causal with one query per sequence, a window wider than the call)
            covers_all = self.segments is None and los[0] <= 1 - g.Mq and his[0] >= g.Mk - 1
            if not covers_all:
                kw["band_lo"] = _int_tensor(los, dev)
                kw["band_hi"] = _int_tensor(his, dev)
                host.update(band_lo=tuple(los), band_hi=tuple(his))

        if self.layout is not None:
            layout, bq, bk = self.layout
            kw.update(layout=layout, block_q=bq, block_k=bk, layout_q_off=g.q_off, layout_k_off=g.k_off)
            host["layout_tensor"] = layout

        if self.additive is not None:
            a = self.additive
            a = a.reshape((1,) * (4 - a.dim()) + tuple(a.shape)) if a.dim() < 4 else a
            if a.shape[2] != 1:
                a = a[:, :, g.q_off : g.q_off + g.Mq]
            if a.shape[3] != 1:
                a = a[:, :, :, g.k_off : g.k_off + g.Mk]
            if not all(n == 1 or n == m for n, m in zip(a.shape, (g.B, g.H, g.Mq, g.Mk))):
                raise InputError(
                    f"AdditiveBias of shape {list(self.additive.shape)} does not broadcast to "
                    f"[B, H, Mq, Mk] = {[g.B, g.H, g.Mq, g.Mk]}"
                )
            kw["additive"] = a
            kw["additive_is_mask"] = self.additive_is_mask

        if self.alibi is not None:
            kw["alibi_slopes"] = self.alibi
            kw["alibi_shift"] = self.alibi_shift + shift

        return BiasSpec(B=g.B, H=g.H, Mq=g.Mq, Mk=g.Mk, host=SpecHost(**host), **kw)


_PLAIN_SPECS = BoundedCache(64)


def _plain_spec(B, H, Mq, Mk) -> BiasSpec:
    """The spec of a call without a bias, one per size: what operators derive from it (launch plans,
    say) then serves every call of that size."""
    key = (B, H, Mq, Mk)
    if not all(type(n) is int for n in key):  # symbolic sizes while tracing
        return BiasSpec(B=B, H=H, Mq=Mq, Mk=Mk)
    spec = _PLAIN_SPECS.get(key)
    if spec is None:
        spec = _PLAIN_SPECS[key] = BiasSpec(B=B, H=H, Mq=Mq, Mk=Mk)
    return spec


#: Specs shared by structure: ``structure key -> (spec, slots)``. Biases that hold no tensor share the
#: spec itself; biases whose tensors are lengths only the device holds get a copy of it with their own
#: tensors in the ``slots`` (spec field, index among the bias's tensors), since lowering passed them
#: through unread. A mask built afresh every step is then lowered by one lookup.
_STRUCTURAL_SPECS = BoundedCache(256)


def lower(bias, B: int, H: int, Mq: int, Mk: int, device=None, *, found: tuple | None = None) -> BiasSpec:
    """Lower ``bias`` (an AttentionBias or None) for a call with q ``[B, H, Mq, D]`` and k ``[B, *, Mk, D]``.

    Specs are kept per bias object and call size. Biases whose lowering reads no tensor value (causal
    masks and windows, lengths that only the device holds) share one spec per structure and size,
    and a bias that hides nothing in the call gets the plain spec of that size: what operators derive
    from a spec then serves biases built anew every step. ``found``: the ``(spec, slots)`` that
    :func:`lowered_before` found for the bias's atom tokens.
    """
    if bias is None:
        return _plain_spec(B, H, Mq, Mk)
    if faking():  # a spec of fake tensors serves this trace only
        return _build(bias, bias.geometry(B, H, Mq, Mk), device if device is not None else bias.device)[0]
    tensors, key = _spec_key(bias, B, H, Mq, Mk, device)
    cacheable = not any(t.requires_grad for t in tensors)
    cache = bias.__dict__.get("_spec_cache") if cacheable else {}
    if cache is None:
        cache = bias.__dict__["_spec_cache"] = BoundedCache(16)
    spec = cache.get(key)
    if spec is None:
        spec = cache[key] = _lower_new(bias, tensors, B, H, Mq, Mk, device, found)
    if not spec.features:  # hides nothing in this call: the plain spec lower(None) gives now (the one kept
        return _plain_spec(B, H, Mq, Mk)  # here, by tokens or by structure may have left _PLAIN_SPECS since)
    return spec


#: ``(spec, slots)`` as in :data:`_STRUCTURAL_SPECS`, by the tokens of a bias's atoms
#: (:meth:`~biasattn.bias.atoms.Atom.spec_token`), its slicing and the call size: a mask built afresh
#: every call (a causal mask, a window, key lengths from a GPU tensor) finds its spec in one lookup.
_SPECS_BY_TOKENS = BoundedCache(256)


def _token_key(bias, B: int, H: int, Mq: int, Mk: int, device) -> tuple | None:
    """The key of ``bias`` in :data:`_SPECS_BY_TOKENS`, or None (an atom without a token, symbolic sizes)."""
    if not (type(B) is int and type(H) is int and type(Mq) is int and type(Mk) is int):
        return None
    token = structure_token(bias)
    return None if token is None else (*token, B, H, Mq, Mk, device)


def structure_token(bias) -> tuple | None:
    """What fixes the spec of ``bias`` for a call size and device, where that is cheap to tell: its type,
    its atoms' tokens (:meth:`~biasattn.bias.atoms.Atom.spec_token`) and its slicing; None where
    lowering must read a value."""
    atoms = bias._atoms
    tokens = (atoms[0].spec_token(),) if len(atoms) == 1 else tuple([atom.spec_token() for atom in atoms])
    if None in tokens:
        return None
    return (type(bias), tokens, bias._offsets, bias._lengths, bias._full)


def kept_by_tokens(bias, B: int, H: int, Mq: int, Mk: int, device) -> tuple | None:
    """``(spec, slots)`` kept for the atom tokens of ``bias`` at this call size: the spec as lowered (never
    used by a call itself) and where it holds the bias's own tensors (``()`` for none; see
    :func:`rebind`); None when none is kept."""
    key = _token_key(bias, B, H, Mq, Mk, device)
    return _SPECS_BY_TOKENS.get(key) if key is not None else None


def rebind(spec: BiasSpec, slots: tuple, bias) -> BiasSpec:
    """``spec`` holding the tensors of ``bias`` in its ``slots`` (:func:`kept_by_tokens`); ``spec`` itself without
    slots. A bias used again gets the same copy (what operators derived from it, tile tables say, is
    kept) until an in-place write to one of its tensors."""
    if not slots:
        return spec
    tensors = _bias_tensors(bias)
    versions = tuple([tensor_version(t) for t in tensors])
    kept = bias.__dict__.get("_rebound")
    if kept is not None and kept[0] is spec and kept[1] == versions:
        return kept[2]
    new = spec.rebound({name: tensors[i] for name, i in slots})
    bias.__dict__["_rebound"] = (spec, versions, new)
    return new


def lowered_before(bias, B: int, H: int, Mq: int, Mk: int, device=None) -> BiasSpec | None:
    """The spec :func:`lower` keeps for this bias and call size, or None. A bias not lowered before also
    finds the spec of an earlier bias of the same atom tokens (whose checks against this call size
    passed then)."""
    cache = bias.__dict__.get("_spec_cache")
    try:
        if cache is not None:
            return cache.get(_spec_key(bias, B, H, Mq, Mk, device)[1])
        key = _token_key(bias, B, H, Mq, Mk, device)
        hit = _SPECS_BY_TOKENS.get(key) if key is not None else None
    except TypeError:  # symbolic sizes (tracing) are unhashable
        return None
    if hit is None:
        return None
    return hit[0] if not hit[1] else lower(bias, B, H, Mq, Mk, device, found=hit)  # rebinds the bias's tensors, once


def _spec_key(bias, B: int, H: int, Mq: int, Mk: int, device) -> tuple[tuple, tuple]:
    """``(the bias's tensors, the key of its spec for this call size)``."""
    tensors = _bias_tensors(bias)
    # an in-place write to a length tensor makes a new spec (its host copies are read again)
    key = (B, H, Mq, Mk, device, *(tensor_version(t) for t in tensors)) if tensors else (B, H, Mq, Mk, device)
    return tensors, key


def _bias_tensors(bias) -> tuple:
    """The tensors of the bias's atoms, in order (listed once: a bias's terms never change)."""
    tensors = bias.__dict__.get("_lowered_tensors")
    if tensors is None:
        tensors = bias.__dict__["_lowered_tensors"] = tuple(t for a in bias.atoms for t in a.tensors().values())
    return tensors


def _lower_new(bias, tensors: tuple, B: int, H: int, Mq: int, Mk: int, device, found: tuple | None = None) -> BiasSpec:
    """The spec of a bias not lowered for this call size before: by its atoms' tokens (``found``: already
    looked up) or its structure where it has them."""
    token_key, hit = None, found
    if hit is None:
        token_key = _token_key(bias, B, H, Mq, Mk, device)
        hit = _SPECS_BY_TOKENS.get(token_key) if token_key is not None else None
    if hit is None:
        hit = _lower_by_structure(bias, tensors, B, H, Mq, Mk, device)
        if token_key is not None and hit[1] is not None:
            _SPECS_BY_TOKENS[token_key] = hit
    spec, slots = hit
    return spec.rebound({name: tensors[i] for name, i in slots}) if slots else spec


def _lower_by_structure(bias, tensors: tuple, B: int, H: int, Mq: int, Mk: int, device) -> tuple[BiasSpec, tuple | None]:
    """``(spec, slots)``: the spec kept for the bias's structure, or a new one (slots None where it cannot be shared)."""
    g = bias.geometry(B, H, Mq, Mk)
    dev = device if device is not None else bias.device
    shared = _structure_key(bias, tensors, g, dev)
    hit = _STRUCTURAL_SPECS.get(shared) if shared is not None else None
    if hit is not None:
        return hit
    spec, constant_band = _build(bias, g, dev)
    slots = _slots(spec, tensors, constant_band=constant_band) if shared is not None else None
    if slots is not None:
        _STRUCTURAL_SPECS[shared] = (spec, slots)
    return spec, slots


def _build(bias, g, device) -> tuple[BiasSpec, bool]:
    """``(a new spec of bias for the call geometry g, lowered atom by atom; whether its band follows from
    the structure alone)``."""
    builder = SpecBuilder(g, device, bias.atoms)
    for atom in bias.atoms:
        atom.lower(builder)
    spec = builder.build()
    if not spec.features and all(type(n) is int for n in (g.B, g.H, g.Mq, g.Mk)):
        spec = _plain_spec(g.B, g.H, g.Mq, g.Mk)
    return spec, builder.constant_band


TENSOR_FIELDS = ("q_seqstart", "k_seqstart", "k_seqlen", "kv_seqlens", "band_lo", "band_hi", "layout", "additive",
                 "alibi_slopes")


def _slots(spec: BiasSpec, tensors: tuple, constant_band: bool) -> tuple[tuple[str, int], ...] | None:
    """Where ``spec`` holds the bias's own tensors, as ``(field, index in tensors)``; None when some field
    was computed from them (a slice's shifted lengths, a band per packed segment), so that the spec
    cannot serve another bias of the structure. A band made from the structure alone is a constant."""
    slots = []
    for name in TENSOR_FIELDS:
        t = getattr(spec, name)
        if t is None:
            continue
        index = next((i for i, own in enumerate(tensors) if t is own), None)
        if index is not None:
            slots.append((name, index))
        elif not (constant_band and name in ("band_lo", "band_hi")):
            return None
    return tuple(slots)


def _structure_key(bias, tensors: tuple, g, device):
    """The key that biases of one structure share for one geometry, or None: a bias with a tensor whose
    values lowering reads (host-known lengths, an additive bias), symbolic sizes, tracing."""
    if not all(type(n) is int for n in (g.B, g.H, g.Mq, g.Mk, g.q_off, g.k_off, g.Mq_full, g.Mk_full)):
        return None
    if tensors and torch.compiler.is_compiling():
        return None
    parts = []
    for atom in bias.atoms:
        if atom.tensors() and not atom.lowers_unread(g, device, bias.atoms):
            return None
        parts.append((type(atom), tuple(getattr(atom, name) for name in _structure_fields(type(atom)))))
    metas = tuple(map(tensor_layout, tensors))
    aliases = tuple(next(i for i, u in enumerate(tensors) if u is t) for t in tensors)  # one tensor in two roles
    return (type(bias), tuple(parts), metas, aliases, g, str(device))


@functools.cache
def _structure_fields(atom_type: type) -> tuple[str, ...]:
    """The dataclass fields of an atom type that are neither tensors nor host copies of them."""
    return tuple(f.name for f in fields(atom_type) if f.name not in atom_type.HOST_FIELDS and "Tensor" not in str(f.type))


