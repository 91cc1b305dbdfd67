"""Launcher of the Triton flash forward kernel, ``attn_fwd`` (grids, strides, configs), and the launch
arguments it shares with the backward's launcher (:mod:`biasattn.ops.triton.flash_bwd`).

Both launchers take the tensors and a :class:`~biasattn.bias.spec.BiasSpec` and return plain tensors; no
autograd here (see :mod:`biasattn.ops.triton_flash`). The Triton interpreter decides at decoration
time, so :data:`INTERPRETED` records whether these kernels run on the CPU.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ...bias.spec import BAND_UNBOUNDED, BiasSpec
from ...memo import BoundedCache
from ..common import cdiv, cuda_capability, head_tiles, int32_on, new_like_rows, next_power_of_2, num_sms, slice_span
from . import configs, options, plans, schedule, tma
from .dropout_kernels import _dropout_mask_kernel
from .fwd_kernels import _attn_fwd_exact_kernel, _attn_fwd_kernel
from .launch import direct

_SEED = ("seed_lo", "seed_hi")  # a new dropout seed per call must not miss the table of compiled launches
_fwd = direct(_attn_fwd_kernel, _SEED)
_fwd_exact = direct(_attn_fwd_exact_kernel, _SEED)
EXACT_TILES = 16  # query tiles whose marks one program of the exact pass checks

INTERPRETED = configs.interpreted()
LOG2E = 1.4426950408889634

_dummies = BoundedCache(16)  # (device, dtype) -> a small zero tensor standing for an absent operand


def _plan_key(kind: str, tensors: tuple, spec: BiasSpec, *extra):
    """The key of a call's launch plan in its spec's store: the tensors' signature, the block layout's
    version (its tile lists follow it when it is changed in place), the launch :mod:`options` in force
    and the tuning constants a launch reads. The scale is a role of the plan, not part of its key.
    Everything that picks the kernels (Gluon or ``triton.language``) follows from the key, with the
    launcher's ``extra`` items."""
    layout = spec.layout._version if spec.layout is not None else -1
    return ("launch plan", kind, plans.tensor_key(*tensors), layout, options.current(),
            SHORT_SPAN_KEYS, SHORT_SPAN_KEYS_DKDV, NARROW_SPAN_KEYS, INTERPRETED,
            bool(configs._overrides), *extra)


_SHARED_PLANS = BoundedCache(256)  # launch plans that every spec of one structure shares


def plan_home(spec: BiasSpec, device, key) -> tuple[dict, object, tuple]:
    """``(store, key, roles)``: where a call's launch plan lives, and the spec's tensors a replay fills in.

    A spec whose only tensors are lengths (segments, padded keys, a band), already int32 on ``device``,
    shares its plans with every spec of the same structure: the lengths and the tile tables are roles
    of the plan, and the key holds every decision a launch takes from the spec (features, span
    buckets, the tensors' shapes). So a mask built fresh every step replays a plan. Other
    specs (an additive bias, ALiBi slopes, a block layout) keep their plans on themselves."""
    if key is None:
        return spec.derived, None, ()
    shared = spec.cached(("plan home", str(device)), lambda: _shared_structure(spec, device))
    if shared is None:
        return spec.derived, key, ()
    structure, roles = shared
    return _SHARED_PLANS, (key, structure), roles


def _shared_structure(spec: BiasSpec, device) -> tuple[tuple, tuple] | None:
    """``(structure key, roles)`` of a spec whose plans are shared (see :func:`plan_home`), or None."""
    lengths = (spec.q_seqstart, spec.k_seqstart, spec.k_seqlen, spec.kv_seqlens, spec.band_lo, spec.band_hi)
    if (spec.additive is not None or spec.alibi_slopes is not None or spec.layout is not None
            or any(t is not None and (t.dtype != torch.int32 or t.device != device) for t in lengths)):
        return None
    d32 = _dummy(device)
    roles = tuple(d32 if t is None else t for t in lengths)
    structure = spec.cached_by_structure("plan structure", lambda: (
        spec.features, _span_features(spec, spec.Mq, spec.Mk),
        spec.block_q, spec.block_k, spec.layout_q_off, spec.layout_k_off, spec.alibi_shift))
    return (*structure, plans.tensor_key(*roles)), roles


def computed_scores(spec: BiasSpec, B: int, H: int, Mq: int, Mk: int) -> int:
    """The scores a forward computes as far as shapes tell (what ``descriptors_min_scores`` is compared
    with): ``B·H·Mq·Mk`` over the number of packed segments (equal documents hold the fewest), halved
    by a band on a square call (causal). Packed short documents are host-bound calls that the nominal
    size would send through descriptors."""
    n = B * H * Mq * Mk
    if spec.q_seqstart is not None:
        n //= max(1, spec.q_seqstart.shape[0] - 1)
    if spec.band_lo is not None and Mq == Mk:
        n //= 2
    return n


def _new(like: torch.Tensor, shape, dtype, zero: bool = False, rows_of: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` on ``like``'s device (``new_empty``: less host time than
    ``torch.empty(..., device=)``), NaN-filled under the ``poison_outputs`` option; laid out like the
    rows of ``rows_of`` where given (:func:`~biasattn.ops.common.new_like_rows`; not with ``zero``)."""
    if zero:
        return like.new_zeros(shape, dtype=dtype)
    poison = options.current().poison_outputs and dtype.is_floating_point
    if rows_of is not None:
        t = new_like_rows(rows_of, shape, dtype)
        return t.fill_(float("nan")) if poison else t
    return like.new_full(shape, float("nan"), dtype=dtype) if poison else like.new_empty(shape, dtype=dtype)


def _dummy(device, dtype=torch.int32) -> torch.Tensor:
    key = (str(device), dtype)
    dummy = _dummies.get(key)
    if dummy is None:
        dummy = _dummies[key] = torch.zeros(2, dtype=dtype, device=device)
    return dummy


def _bcast_strides(t: torch.Tensor | None, shape) -> tuple[int, ...]:
    """Strides of ``t`` expanded to ``shape`` (0 on broadcast dims), or zeros when ``t`` is None."""
    if t is None:
        return (0,) * len(shape)
    return t.expand(*shape).stride()


def marked_rows(args: _SpecArgs, layout_exact: bool, list_only: bool) -> bool:
    """Whether rows of one forward program see different keys of its span (a band, a block layout finer
    than the tile, an additive term): then a row whose output a hidden NaN or inf value reached is
    marked (a NaN lse) and :func:`_exact_pass` computes it again."""
    return args.has_band or (args.has_layout and not layout_exact and not list_only) or args.has_additive


class _SpecArgs:
    """The spec's device tensors (dummies where absent) and constexpr switches, shared by every kernel."""

    def __init__(self, spec: BiasSpec, device):
        B, H = spec.B, spec.H
        d32 = _dummy(device)
        self.d32 = d32
        self.f32 = _dummy(device, torch.float32)
        self.features = tuple(sorted(spec.features))
        self.has_segments = spec.q_seqstart is not None
        self.qs = int32_on(spec.q_seqstart, device) if self.has_segments else d32
        self.ks = int32_on(spec.k_seqstart, device) if self.has_segments else d32
        self.kl = int32_on(spec.k_seqlen, device) if self.has_segments else d32
        self.has_padded = spec.kv_seqlens is not None
        self.kv = int32_on(spec.kv_seqlens, device) if self.has_padded else d32
        self.has_band = spec.band_lo is not None
        self.band_lo = int32_on(spec.band_lo, device) if self.has_band else d32
        self.band_hi = int32_on(spec.band_hi, device) if self.has_band else d32
        self.band_per_segment = self.has_band and spec.band_lo.numel() > 1
        self.has_layout = spec.layout is not None
        if self.has_layout:
            lay = spec.layout.to(device)
            lay = lay.view(torch.uint8) if lay.dtype == torch.bool else (lay != 0).view(torch.uint8)
            self.layout = lay
            self.layout_strides = _bcast_strides(lay, (B, H, lay.shape[2], lay.shape[3]))
        else:
            self.layout = _dummy(device, torch.uint8)
            self.layout_strides = (0, 0, 0, 0)
        self.has_additive = spec.additive is not None
        self.add = spec.additive if self.has_additive else self.f32
        self.add_strides = _bcast_strides(spec.additive, (B, H, spec.Mq, spec.Mk))
        # a bias tile that every batch row reads (stride 0 over the batch): programs run batch-innermost
        self.batch_shared_bias = self.has_additive and self.add_strides[0] == 0
        self.add_span = (spec.Mq - 1) * abs(self.add_strides[2]) + (spec.Mk - 1) * abs(self.add_strides[3])
        self.has_alibi = spec.alibi_slopes is not None
        f32 = torch.float32
        self.slopes = spec.alibi_slopes.to(device=device, dtype=f32) if self.has_alibi else self.f32
        self.slope_strides = _bcast_strides(spec.alibi_slopes, (B, H)) if self.has_alibi else (0, 0)
        self.block_q = spec.block_q or 1
        self.block_k = spec.block_k or 1
        self.switches = dict(
            HAS_SEGMENTS=self.has_segments, HAS_PADDED=self.has_padded, HAS_BAND=self.has_band,
            BAND_PER_SEGMENT=self.band_per_segment, HAS_LAYOUT=self.has_layout,
            HAS_ADDITIVE=self.has_additive, HAS_ALIBI=self.has_alibi,
            HIDDEN_LINES=self.has_segments or self.has_padded,  # masked tiles load only the lines their span sees
        )

    def tile_lists(self, spec: BiasSpec, sched, block_other: int, along_keys: bool, device):
        """``(count, index, count strides (b, h), index strides (b, h, program), exact, list only)`` for the layout.

        ``list only``: the layout is the only mask, its blocks hold whole kernel tiles and the other
        axis divides into tiles, so every listed tile is visible in every element.
        """
        if not self.has_layout:
            return self.d32, self.d32, (0, 0), (0, 0, 0), True, False
        B, H = spec.B, spec.H
        count, index = schedule.layout_tile_lists(spec, sched, block_other, along_keys, device)
        cs = _bcast_strides(count, (B, H, count.shape[2]))[:2]
        ts = _bcast_strides(index, (B, H, index.shape[2], index.shape[3]))[:3]
        exact = schedule.layout_exact(spec, sched, block_other, along_keys)
        other = spec.Mk if along_keys else spec.Mq
        alone = not (self.has_segments or self.has_padded or self.has_band)
        return count, index, cs, ts, exact, exact and alone and other % block_other == 0


def _spec_args(spec: BiasSpec, device) -> _SpecArgs:
    """The launch arguments of ``spec``, built once per spec and device (a backward reuses its forward's).

    They are kept in ``spec.derived`` and hold no reference to the spec, so no cycle keeps the spec's
    tensors (a large additive bias, say) alive after the call."""
    return spec.cached(("triton", str(device)), lambda: _SpecArgs(spec, device))


def _list_tiles(index: torch.Tensor, list_only: bool) -> int:
    """Register slots for a program's tile list in the branch-free list loops (0: read from memory)."""
    return max(16, next_power_of_2(index.shape[-1])) if list_only and options.current().list_in_registers else 0


L2_CHUNK_BYTES = 16 << 20  # the pairs started rank by rank share this many bytes of the operand at most


def program_chunk(pairs: int, tiles: int, sms: int, bytes_per_pair: int, banded: bool = True) -> int:
    """How many (batch, head) pairs at the end of a grid start their programs rank by rank.

    Only ``banded`` work needs it (1 otherwise): each pair's tiles are ordered heaviest first, and
    a causal or banded span shrinks along them, so when the last pairs start rank by rank the
    lightest tiles of several pairs end the kernel instead of one pair's heaviest tile
    (``_chunked_ids`` in the kernels). Enough pairs to fill
    ``options.current().order_tail_waves`` waves of one program per multiprocessor, at most as many as keep the
    operand their programs share (K/V in a forward, Q, dO and dQ in a backward) within ``L2_CHUNK_BYTES``.
    The forwards take it, and the Gluon backward at head dim 64 (``flash_bwd._gluon_chunk``); the
    ``triton.language`` backward kernels keep the plain order: the mapping cost them more than the shorter tail
    gave (causal forward+backward 2.4-2.6% slower on an H200).
    """
    waves = options.current().order_tail_waves
    if not banded or waves <= 0 or pairs <= 1 or tiles <= 1:
        return 1
    fill = cdiv(waves * sms, tiles)
    return max(1, min(pairs, fill, L2_CHUNK_BYTES // max(1, bytes_per_pair)))


def kv_bytes_per_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Bytes of K and V one query head's programs read: what :func:`program_chunk` keeps within the L2 cache."""
    return cdiv(k.shape[2] * (k.shape[3] + v.shape[3]) * k.element_size(), q.shape[1] // k.shape[1])


def growing_spans(spec: BiasSpec) -> bool:
    """Whether the spec's band is bounded on the right only (causal), so that the keys a row sees grow with the
    row and tiles differ in work; the Gluon kernels order their tails only then (a window's tiles are alike)."""
    los = spec.host.band_lo
    return spec.band_lo is not None and (los is None or all(lo <= -BAND_UNBOUNDED for lo in los))


SHORT_SPAN_KEYS = 1000  # mean visible keys per query row at or under which the forward takes short tiles
SHORT_SPAN_KEYS_DKDV = 800  # ... and at or under which dK/dV does too
NARROW_SPAN_KEYS = 640  # ... and under which the Gluon forward at head dim 128 leaves the call to triton.language's


def mean_visible_keys(spec: BiasSpec, Mq: int, Mk: int) -> float:
    """Mean number of keys a query row sees under the spec's segments, padded keys and band.

    Packed segments count by shape alone: S segments over Mq queries and Mk keys are taken as equal
    ones of twice the mean length (the document a random row belongs to, when documents are cut at
    random points, is twice as long as the mean one), and a band per segment as causal; so a new set
    of lengths never changes the estimate. Padded lengths count where the host holds them. 64 rows
    are sampled per sequence; the block layout and an additive bias are not counted. An estimate for
    choosing tiles and launches, never used for results."""
    h = spec.host
    band_lo, band_hi = h.band_lo, h.band_hi
    if spec.q_seqstart is not None:
        S = max(spec.k_seqlen.numel(), 1)
        if spec.band_lo is not None and (band_lo is None or len(band_lo) != 1):
            band_lo, band_hi = (-(2**31),), (0,)
        return _mean_visible_keys((0, min(Mq, cdiv(2 * Mq, S))), (min(Mk, cdiv(2 * Mk, S)),), None, band_lo, band_hi,
                                  Mq, Mk)
    return _mean_visible_keys(None, None, h.kv_seqlens, band_lo, band_hi, Mq, Mk)


@functools.lru_cache(maxsize=256)
def _mean_visible_keys(q_seqstart, k_seqlen, kv_seqlens, band_lo, band_hi, Mq: int, Mk: int) -> float:
    if q_seqstart is not None:
        nq, nk = np.diff(np.asarray(q_seqstart)), np.asarray(k_seqlen)
    elif kv_seqlens is not None:
        nk = np.minimum(np.asarray(kv_seqlens), Mk)
        nq = np.full(len(nk), Mq)
    else:
        nq, nk = np.array([Mq]), np.array([Mk])
    if band_lo is not None:
        lo = np.broadcast_to(np.asarray(band_lo, dtype=np.float64), nq.shape)
        hi = np.broadcast_to(np.asarray(band_hi, dtype=np.float64), nq.shape)
    else:
        lo, hi = np.full(nq.shape, -np.inf), np.full(nq.shape, np.inf)
    rows = np.linspace(0.0, 1.0, 64)[None, :] * np.maximum(nq - 1, 0)[:, None]
    first = np.clip(rows + lo[:, None], 0, nk[:, None])
    last = np.clip(rows + hi[:, None] + 1, 0, nk[:, None])
    per_sequence = np.maximum(last - first, 0).mean(axis=1)
    total = nq.sum()
    return float((per_sequence * nq).sum() / total) if total > 0 else 0.0


def _span_features(spec: BiasSpec, Mq: int, Mk: int) -> tuple[str, ...]:
    """``("short_span",)`` when query rows see few keys on average (packed documents, a 1k window, short caches),
    plus ``"short_span_dkdv"`` when they see fewer still and ``"narrow_span"`` when fewer still (:func:`_gluon_span`).

    A tile then meets few tiles of the other side, and shorter tiles (more programs, each shorter)
    finish sooner (tiles per head dim: ``configs.SHORT_ROWS``): on an H200 at head dim 128 the forward's
    64x64 tiles gain 25% on packed documents and 4-10% on a 1k window or 1k-key rows, and lose 2-7% once
    rows see 2k keys or more; the dK/dV kernel's 32x64 tiles gain 17% on packed documents but lose 1.7%
    on a 1k window at 8k (961 keys per row on average) and tie at 2k (769). Packed segments enter by
    their number only, so a new set of document lengths never changes the tiles. Block layouts keep
    their tiles."""
    if spec.layout is not None:
        return ()

    def buckets() -> tuple[str, ...]:
        mean = mean_visible_keys(spec, Mq, Mk)
        return (("short_span",) if mean <= SHORT_SPAN_KEYS else ()) + (
            ("short_span_dkdv",) if mean <= SHORT_SPAN_KEYS_DKDV else ()) + (
            ("narrow_span",) if mean < NARROW_SPAN_KEYS else ())

    return spec.cached_by_structure(("short_span", Mq, Mk), buckets)


def _index_64(*spans: int) -> bool:
    """Offsets inside a slice need 64 bits when any slice spans 2**31 elements (base offsets always have them)."""
    return options.current().force_index_64 or max(spans, default=0) >= 2**31


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


DROPOUT_BITS = 16  # random bits per score: the drop probability is a multiple of 2**-16


def dropout_args(dropout_p: float, seed: int) -> tuple[int, int, int, float]:
    """``(seed_lo, seed_hi, threshold, keep_scale)`` the kernels take for ``dropout_p`` and a seed < 2**62.

    A score is kept when its 16 random bits are at least ``threshold = round(dropout_p · 2**16)``, so
    the probability actually used is ``threshold / 2**16`` (within 2**-17 of ``dropout_p``), and kept
    probabilities are scaled by ``2**16 / (2**16 - threshold)``, which keeps the output unbiased."""
    levels = 1 << DROPOUT_BITS
    threshold = min(round(dropout_p * levels), levels - 1)
    return seed & 0x7FFFFFFF, (seed >> 31) & 0x7FFFFFFF, threshold, levels / (levels - threshold)


def dropout_mask(seed: int, dropout_p: float, B: int, H: int, Mq: int, Mk: int, device, *,
                 aligned: bool = True) -> torch.Tensor:
    """The dropout mask the kernels apply for ``seed``: float32 ``[B, H, Mq, Mk]``, 0 where a
    probability is dropped and ``keep_scale`` (see :func:`dropout_args`) where it is kept.

    ``aligned=False`` draws element by element, as the dK/dV kernel does for key tiles off the
    8-key grid; both ways must give the same mask."""
    out = torch.empty((B, H, Mq, Mk), dtype=torch.float32, device=device)
    if out.numel() == 0:
        return out
    lo, hi, threshold, keep_scale = dropout_args(dropout_p, seed)
    bm, bn = (16, 16) if INTERPRETED else (64, 64)
    _dropout_mask_kernel[(cdiv(Mq, bm), cdiv(Mk, bn), B * H)](
        out, lo, hi, threshold, keep_scale, Mq, Mk, cdiv(Mk, 8), BLOCK_M=bm, BLOCK_N=bn, ALIGNED=aligned,
    )
    return out


def _exact_pass(q, k, v, out, lse, spec: BiasSpec, args, sched, drop, qk_scale, block_m: int, hd: int, even_d: bool,
                dropout: bool) -> None:
    """The forward again, exactly, for the query tiles whose rows hold a NaN lse (a hidden NaN or inf
    value may have reached them); a program checks ``EXACT_TILES`` tiles with one load and returns
    at once when none is marked."""
    B, H, Mq, D = q.shape
    Hkv, Mk, Dv = k.shape[1], k.shape[2], v.shape[3]
    _fwd_exact[(cdiv(sched.n, EXACT_TILES), B * H)](
        q, k, v, out, lse, args.add, args.slopes, args.layout, args.qs, args.ks, args.kl, args.kv,
        args.band_lo, args.band_hi, sched.table if sched.table is not None else args.d32, qk_scale,
        q.stride(), k.stride(), v.stride(), out.stride(), args.add_strides, args.slope_strides,
        args.layout_strides, H, H // Hkv, Mq, Mk, D, Dv, sched.n,
        spec.layout_q_off, spec.layout_k_off, args.block_q, args.block_k, spec.alibi_shift, *drop,
        BLOCK_M=block_m, HEAD_DIM=hd, EVEN_D=even_d, SCHEDULED=sched.table is not None,
        DOT_PRECISION=_dot_precision(q.dtype), HAS_DROPOUT=dropout,
        SUB_M=32, TILES=EXACT_TILES, num_warps=2, num_stages=1, **args.switches,
    )


GLUON_FEATURES = frozenset({"segments", "padded_keys", "band", "layout"})  # the masks the Gluon forward takes
GLUON_HEAD_DIMS = frozenset({128, 256})  # ... and its head dims (gluon_forward.TILES)


_gluon_failure: list[str] = []  # why the Gluon forward cannot run with the installed Triton, once known


def _gluon_runs(q, k, v, out, spec: BiasSpec, dropout_p: float) -> bool:
    """Whether the Gluon forward takes the call: the ``gluon_forward`` option, an sm_90 GPU, a Triton whose
    Gluon builds the kernel, a bias of :data:`GLUON_FEATURES` only, no dropout, at least
    ``gluon_min_scores`` scores, rows that see enough keys for the head dim (:func:`_gluon_span`), a block layout
    only as :func:`_gluon_lists` allows, and the kernel's tensors (:func:`.gluon_forward.eligible`). The module is
    imported on the first call that gets this far."""
    opts = options.current()
    if (not opts.gluon_forward or _gluon_failure or INTERPRETED or q.device.type != "cuda" or dropout_p > 0
            or not spec.features <= GLUON_FEATURES or cuda_capability(q.device)[0] != 9):
        return False
    B, H, Mq, _ = q.shape
    if (computed_scores(spec, B, H, Mq, k.shape[2]) < opts.gluon_min_scores
            or not _gluon_span(spec, q.shape[3], Mq, k.shape[2])):
        return False
    if spec.layout is not None and not _gluon_lists(spec, q, k):
        return False
    try:
        from . import gluon_forward
    except Exception as e:  # a Triton without Gluon, or whose Gluon lacks what the kernel uses
        _gluon_fails(e)
        return False
    return gluon_forward.eligible(q, k, v, out)


GLUON_KEY_TILES = {128: 128, 256: 64}  # gluon_forward.TILES' keys per tile, known without importing the module


def _gluon_lists(spec: BiasSpec, q, k) -> bool:
    """Whether the Gluon forward can read a block layout's tile lists: the layout is the only mask, its blocks
    hold whole tiles (128 rows by the key tile), the shapes divide into them, and the call is large enough
    (the ``gluon_layout_min_scores`` option: below it, the Gluon launches' host work outweighs their faster tiles)."""
    B, H, Mq, D = q.shape
    Mk = k.shape[2]
    tile = GLUON_KEY_TILES[D]
    if (spec.features != {"layout"} or Mq % 128 or Mk % tile
            or B * H * Mq * Mk < options.current().gluon_layout_min_scores):
        return False
    return schedule.layout_exact(spec, schedule.query_schedule(spec, 128, q.device), tile, True)


def _gluon_span(spec: BiasSpec, D: int, Mq: int, Mk: int) -> bool:
    """Whether rows see enough keys (:func:`_span_features`) for the Gluon kernels at head dim ``D``: at 64 (the
    backward) more than :data:`SHORT_SPAN_KEYS`, at 128 (the forward) :data:`NARROW_SPAN_KEYS` or more, at 256 any
    number. Below that the ``triton.language`` kernels' short tiles finish sooner (``docs/design.md``, "Gluon
    kernels on rows that see few keys"). The backward at 128 goes by the call's work instead
    (:func:`.flash_bwd._gluon_size`)."""
    if D >= 256:
        return True
    return ("short_span" if D != 128 else "narrow_span") not in _span_features(spec, Mq, Mk)


def _gluon_fails(error: Exception, failures: list[str] | None = None, what: str = "forward") -> None:
    """Keep every later ``what`` (forward or backward) on the ``triton.language`` kernels by noting the
    error in ``failures`` (the forward's list by default), and say why once."""
    import warnings

    import triton

    failures = _gluon_failure if failures is None else failures
    text = str(error).strip().splitlines()
    failures.append(f"{type(error).__name__}: {text[-1][:300] if text else ''}")
    warnings.warn(f"biasattn: the Gluon {what} does not build with triton {triton.__version__} ({failures[0]}); "
                  f"every {what} runs the triton.language kernels instead", RuntimeWarning, stacklevel=3)


GLUON_NOTE = "gluon"  # the note of a launch plan recorded on the Gluon kernels


@functools.cache  # replays reach the module through this: an import statement per call costs several µs
def _gluon_forward():
    from . import gluon_forward

    return gluon_forward


def _gluon_roles(q, k, v, out, lse, spec: BiasSpec, roles: tuple, qk_scale: float) -> tuple:
    """The roles of a Gluon forward's launch plan: the call's tensors, its descriptors (built per call), the spec's
    shared roles with the segments' table, and the scale."""
    gluon_forward = _gluon_forward()
    table = schedule.query_schedule(spec, gluon_forward.BLOCK_M, q.device).table if roles else None
    return (q, k, v, out, lse, *gluon_forward.descriptors(q, k, v, out), *roles,
            *((table,) if table is not None else ()), qk_scale)


def _gluon_fwd(q, k, v, out, lse, spec: BiasSpec, qk_scale: float, seed: int, store: dict, key, roles: tuple) -> bool:
    """Write ``out`` and ``lse`` with the Gluon forward, masked rows that a hidden NaN or inf value may have
    reached (a NaN lse) computed again by the exact pass; False (nothing launched) when the installed
    Triton cannot build the kernel. The launches are recorded for the launch plan of ``key`` in ``store``
    (:func:`attn_fwd` replays it)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from . import gluon_forward

    B, H, Mq, D = q.shape
    sched = schedule.query_schedule(spec, gluon_forward.BLOCK_M, q.device)
    plan_roles = _gluon_roles(q, k, v, out, lse, spec, roles, qk_scale)
    descs = plan_roles[5:9]
    args = _spec_args(spec, q.device)
    table = sched.table if sched.table is not None else args.d32
    switches = dict(SCHEDULED=sched.table is not None, HAS_SEGMENTS=args.has_segments, HAS_PADDED=args.has_padded,
                    HAS_BAND=args.has_band, BAND_PER_SEGMENT=args.band_per_segment)
    chunk = program_chunk(B * H, sched.n, num_sms(q.device), kv_bytes_per_head(q, k, v), growing_spans(spec))
    lists = None
    if args.has_layout:  # count, index and their strides; the layout is exact and alone (_gluon_lists)
        lists = args.tile_lists(spec, sched, GLUON_KEY_TILES[D], True, q.device)[:4]
    with plans.recording() as rec:
        try:
            masked = gluon_forward.attn_fwd(q, k, v, out, lse, qk_scale, sched.n, table,
                                            (args.ks, args.kl, args.kv, args.band_lo, args.band_hi), switches, descs,
                                            chunk, lists)
        except (CompilationError, OutOfResources) as e:
            _gluon_fails(e)
            return False
        if masked:
            _exact_pass(q, k, v, out, lse, spec, args, sched, dropout_args(0.0, seed), qk_scale,
                        gluon_forward.BLOCK_M, D, True, False)
    plans.settle(store, key, rec, plan_roles, GLUON_NOTE)
    return True


def _replay_fwd(plan: plans.Plan, q, k, v, out, lse, spec: BiasSpec, roles: tuple, qk_scale: float) -> bool:
    """Replay a forward's launch plan; False (nothing launched) when its K/V descriptors no longer apply."""
    if plan.note == GLUON_NOTE:
        plan.run(_gluon_roles(q, k, v, out, lse, spec, roles, qk_scale))
        return True
    block_n, block_m = plan.note
    B, H, Mq, D = q.shape
    hd, hdv = head_tiles(D, v.shape[3])
    descs = tma.kv_descriptors(k, v, block_n, hd, hdv, computed_scores(spec, B, H, Mq, k.shape[2])) if block_n else ()
    if descs is None:
        return False
    table = schedule.query_schedule(spec, block_m, q.device).table if block_m else None
    plan.run((q, k, v, out, lse, *descs, *roles, *((table,) if roles and table is not None else ()), qk_scale))
    return True


def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: BiasSpec, scale: float,
             dropout_p: float = 0.0, seed: int = 0):
    """``(out [B, Hq, Mq, Dv] in q's dtype, lse [B, Hq, Mq] float32)`` of attention with ``spec``.

    With ``dropout_p > 0`` the probabilities are dropped by the mask of ``seed`` (:func:`dropout_mask`);
    ``lse`` is that of the undropped softmax."""
    B, H, Mq, D = q.shape
    Hkv, Mk, Dv = k.shape[1], k.shape[2], v.shape[3]
    out = _new(q, (B, H, Mq, Dv), q.dtype, rows_of=q)  # laid out like q: see new_like_rows
    lse = _new(q, (B, H, Mq), torch.float32)
    if B * H * Mq == 0:
        return out, lse
    if Mk == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    hd, hdv = head_tiles(D, Dv)
    qk_scale = scale * LOG2E  # a role of the plan: one object in the launch and in the roles
    # one plan per call signature, on whichever kernels its first calls took: a replay asks nothing again
    store, key, roles = plan_home(spec, q.device, _plan_key("fwd", (q, k, v), spec) if dropout_p == 0 else None)
    plan = plans.lookup(store, key)
    if plan is not None and _replay_fwd(plan, q, k, v, out, lse, spec, roles, qk_scale):
        return out, lse
    if D == Dv and D in GLUON_HEAD_DIMS and _gluon_runs(q, k, v, out, spec, dropout_p):
        if _gluon_fwd(q, k, v, out, lse, spec, qk_scale, seed, store, key, roles):
            return out, lse
    args = _spec_args(spec, q.device)
    batch_inner = args.batch_shared_bias and B > 1
    index_64 = _index_64(slice_span(q), slice_span(k), slice_span(v), slice_span(out), args.add_span)
    drop = dropout_args(dropout_p, seed)
    made = []  # the descriptors of the launch that ran, with their tile length

    def run(cfg: configs.TileConfig) -> None:
        sched = schedule.query_schedule(spec, cfg.block_m, q.device)
        count, index, cs, ts, exact, list_only = args.tile_lists(spec, sched, cfg.block_n, True, q.device)
        marked = marked_rows(args, exact, list_only)
        grid = (sched.n * B, H) if batch_inner else (sched.n, B * H)
        chunk = program_chunk(B * H, sched.n, num_sms(q.device), kv_bytes_per_head(q, k, v), args.has_band)
        descs = tma.kv_descriptors(k, v, cfg.block_n, hd, hdv, computed_scores(spec, B, H, Mq, Mk))
        made[:] = [descs or (), (cfg.block_n if descs else 0, cfg.block_m if sched.table is not None else 0), sched.table]
        _fwd[grid](
            q, *(descs or (k, v)), k, v, out, lse,
            args.add, args.slopes, args.layout, args.qs, args.ks, args.kl, args.kv, args.band_lo, args.band_hi,
            sched.table if sched.table is not None else args.d32, count, index,
            qk_scale,
            q.stride(), k.stride(), v.stride(), out.stride(), args.add_strides, args.slope_strides,
            args.layout_strides, cs, ts,
            B, H, H // Hkv, Mq, Mk, D, Dv, sched.n, chunk,
            spec.layout_q_off, spec.layout_k_off, args.block_q, args.block_k, spec.alibi_shift, *drop,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=hd, HEAD_DIM_V=hdv, EVEN_D=(D == hd and Dv == hdv),
            BATCH_INNER=batch_inner, HAS_DROPOUT=dropout_p > 0, TAIL_ORDER=chunk > 1,
            LIST_TILES=_list_tiles(index, list_only),
            SCHEDULED=sched.table is not None, LAYOUT_EXACT=exact, LIST_ONLY=list_only, DOT_PRECISION=_dot_precision(q.dtype),
            INDEX_64=index_64, TMA_KV=descs is not None, TMA_EDGES=descs is not None and not args.has_padded,
            MARKED=marked, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **args.switches,
        )
        if marked:  # programs that a hidden NaN or inf value may have reached (a NaN lse) run again exactly
            _exact_pass(q, k, v, out, lse, spec, args, sched, drop, qk_scale, cfg.block_m, hd, D == hd and Dv == hdv,
                        dropout_p > 0)

    feats = args.features + (("dropout",) if dropout_p > 0 else ()) + _span_features(spec, Mq, Mk)
    with plans.recording() as rec:
        configs.launch("fwd", max(hd, hdv), q.dtype, q.device, feats, run)
    table = (made[2],) if roles and made[2] is not None else ()
    plans.settle(store, key, rec, (q, k, v, out, lse, *made[0], *roles, *table, qk_scale), made[1])
    return out, lse
