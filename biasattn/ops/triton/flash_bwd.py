"""Launcher of the Triton flash backward kernels: ``attn_bwd`` (dQ, dK/dV and the bias gradient; grids, order, streams).

It takes the tensors and a :class:`~biasattn.bias.spec.BiasSpec` and returns plain tensors, building its
arguments as the forward does (:mod:`biasattn.ops.triton.flash`); no autograd here (see
:mod:`biasattn.ops.triton_flash`).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ...bias.spec import BiasSpec
from ..common import cdiv, cuda_capability, head_tiles, reduce_to, slice_span
from . import configs, flash, options, plans, schedule
from .bwd_kernels import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_bwd_preprocess_kernel
from .dbias_kernels import _attn_bwd_dbias_kernel, _attn_bwd_dq_from_ds_kernel
from .flash import (
    _SEED,
    LOG2E,
    _bcast_strides,
    _dot_precision,
    _index_64,
    _list_tiles,
    _new,
    _plan_key,
    _span_features,
    _spec_args,
    computed_scores,
    dropout_args,
)
from .launch import direct

_dkdv, _dq, _dbias = (direct(k, _SEED) for k in (_attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_bwd_dbias_kernel))
_preprocess, _dq_ds = direct(_attn_bwd_preprocess_kernel), direct(_attn_bwd_dq_from_ds_kernel)


_side_streams: dict = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)
    return _side_streams[index]


def _mean_keys(spec: BiasSpec, Mq: int, Mk: int) -> float:
    """:func:`~.flash.mean_visible_keys`, kept by the spec's structure."""
    return spec.cached_by_structure(("mean_keys", Mq, Mk), lambda: flash.mean_visible_keys(spec, Mq, Mk))


def _long_backward(spec: BiasSpec, B: int, H: int, Mq: int, Mk: int, D: int) -> bool:
    """Whether a backward runs long enough on the GPU for the side stream to pay: the fork and join
    cost host time, which calls of about a millisecond cannot spare (measured on an H200: dQ beside
    dK/dV gains 1.4-2.9% from B·H·Mq·Mk·D = 2**36 without segments, and loses on packed varlen and
    on block-sparse at that size). The work counts twice the keys a row sees on average
    (:func:`~.flash.mean_visible_keys`), at most Mk: dense and causal calls keep their nominal size, and
    a 1k window over 8k keys counts a quarter of it (at head dim 64 a call of about a millisecond,
    which the side stream's host time made up to 1.33x slower, depending on the host)."""
    if spec.q_seqstart is not None:  # packed documents: the nominal size overstates the work
        return False
    work = B * H * Mq * min(Mk, 2 * _mean_keys(spec, Mq, Mk)) * D
    return work >= (2**38 if spec.layout is not None else 2**36)


def _dbias_reduction(add: torch.Tensor, B: int, H: int, Mq: int, Mk: int) -> str:
    """Where dS is reduced: ``"full"`` (dK/dV kernel, tile by tile), ``"col"`` (dK/dV kernel, sums over
    queries) or ``"row"`` (dQ kernel, sums over keys)."""
    am, an = add.shape[2], add.shape[3]
    if an == Mk or Mk == 1:
        return "full" if (am == Mq or Mq == 1) else "col"
    return "row"


def _shared_gradient(add: torch.Tensor, reduction: str | None, B: int, H: int) -> tuple[bool, bool]:
    """``(by batch rows, by heads)``: whether a full bias gradient is shared, i.e. sums ``dS`` over them."""
    return reduction == "full" and add.shape[0] == 1 and B > 1, reduction == "full" and add.shape[1] == 1 and H > 1


def _dq_reads_dbias(spec: BiasSpec, reduction: str | None, B: int, H: int, dtype: torch.dtype) -> bool:
    """Whether dQ can be read back from the bias gradient: every (batch row, head) owns its slice
    (so the dK/dV kernel writes ``dS`` itself, once per element), the slice holds ``dS`` at least as
    precisely as the ``dS @ K`` product takes it (the bias in q's dtype or float32), and rows see
    plain key intervals (no packed segments, no block layout)."""
    add = spec.additive
    return (reduction == "full" and not any(_shared_gradient(add, reduction, B, H))
            and add.dtype in (dtype, torch.float32) and spec.q_seqstart is None and spec.layout is None)


def _tables(spec: BiasSpec, blocks: tuple[int, int], device, roles: tuple) -> tuple:
    """The tile tables a shared backward plan takes as roles: dQ's (query tiles) and dK/dV's (key tiles)."""
    if not roles:
        return ()
    bm, bn = blocks
    return ((schedule.query_schedule(spec, bm, device).table,) if bm else ()) + (
        (schedule.key_schedule(spec, bn, device).table,) if bn else ())


GLUON_FEATURES = frozenset({"segments", "padded_keys", "band", "layout"})  # the masks the Gluon backward takes
GLUON_HEAD_DIMS = frozenset({64, 128, 256})  # ... and its head dims (256: gluon_backward's wide kernel)
_gluon_failure: list[str] = []  # why the Gluon backward cannot run with the installed Triton, once known


def _gluon_runs(q, k, v, lse, spec: BiasSpec, need_dbias: bool, dropout_p: float) -> bool:
    """Whether the Gluon backward takes the call: the ``gluon_backward`` option, an sm_90 GPU, a Triton whose
    Gluon builds the kernel, a bias of :data:`GLUON_FEATURES` only, no dropout and no bias gradient, runs
    that need not be deterministic (its dQ adds tiles in any order), a call large enough (:func:`_gluon_size`),
    a block layout only as :func:`_gluon_lists` allows, and the kernel's tensors (:func:`.gluon_backward.eligible`).
    The module is imported on the first call that gets this far."""
    opts = options.current()
    if (not opts.gluon_backward or _gluon_failure or flash.INTERPRETED or q.device.type != "cuda" or dropout_p > 0
            or need_dbias or not spec.features <= GLUON_FEATURES or torch.are_deterministic_algorithms_enabled()
            or cuda_capability(q.device)[0] != 9):
        return False
    B, H, Mq, D = q.shape
    if not _gluon_size(spec, B, H, Mq, k.shape[2], D):
        return False
    if spec.layout is not None and not _gluon_lists(spec, q, k):
        return False
    try:
        from . import gluon_backward
    except Exception as e:  # a Triton without Gluon, or whose Gluon lacks what the kernel uses
        flash._gluon_fails(e, _gluon_failure, "backward")
        return False
    return gluon_backward.eligible(q, k, v, lse)


def _gluon_size(spec: BiasSpec, B: int, H: int, Mq: int, Mk: int, D: int) -> bool:
    """Whether a backward is large enough for the Gluon kernel: at least ``gluon_min_scores`` scores
    (:func:`~.flash.computed_scores`); at head dim 128 ``gluon_bwd_min_visible`` visible scores, B·H·Mq times the
    keys a row sees on average (its host path costs 0.1-0.2 ms more than the ``triton.language`` one, which
    shorter calls cannot hide); at 64 and 256 rows that see enough keys (:func:`~.flash._gluon_span`)."""
    opts = options.current()
    if computed_scores(spec, B, H, Mq, Mk) < opts.gluon_min_scores:
        return False
    if D == 128:
        return B * H * Mq * _mean_keys(spec, Mq, Mk) >= opts.gluon_bwd_min_visible
    return flash._gluon_span(spec, D, Mq, Mk)


def _gluon_lists(spec: BiasSpec, q, k) -> bool:
    """Whether the Gluon backward can walk a block layout's tile lists: the layout is the only mask, its blocks
    hold whole tiles (64 rows by the program's keys), the shapes divide into them, and a KV head's query heads
    share one list (one query head per KV head, or one layout for every head), in calls of at least
    ``gluon_layout_min_scores`` scores (an option, the forward's bound)."""
    B, H, Mq, D = q.shape
    Mk = k.shape[2]
    keys = 128 if D < 256 else 64  # gluon_backward.program_keys, without importing the module
    if spec.features != {"layout"} or Mq % 64 or Mk % keys or (H != k.shape[1] and spec.layout.shape[1] != 1):
        return False
    if B * H * Mq * Mk < options.current().gluon_layout_min_scores:
        return False
    return schedule.layout_exact(spec, schedule.key_schedule(spec, keys, q.device), 64, False)


def _delta(out, dout, dlse: torch.Tensor | None, delta: torch.Tensor, f32: torch.Tensor, hdv: int,
           lse: torch.Tensor | None = None, guarded: torch.Tensor | None = None, dq32: torch.Tensor | None = None) -> None:
    """``delta = rowsum(dout * out) - dlse`` (float32 ``[B, H, Mq]``); ``f32`` a dummy for an absent ``dlse``,
    ``hdv`` the kernels' tile of value rows. Given ``lse``, ``guarded`` and ``dq32`` (the Gluon backward), also
    ``guarded = lse`` with +inf where ``lse`` is -inf and NaN where it is +inf, and ``dq32`` (float32, contiguous,
    ``out``'s shape) zeroed."""
    B, H, Mq, Dv = out.shape
    pre_bm = 16 if flash.INTERPRETED else 64
    guard = guarded is not None
    _preprocess[(cdiv(Mq, pre_bm), B * H)](
        out, dout, dlse if dlse is not None else f32, delta, lse if guard else f32, guarded if guard else f32,
        dq32 if guard else f32, out.stride(), dout.stride(), H, Mq, Dv, BLOCK_M=pre_bm, HEAD_DIM_V=hdv,
        HAS_DLSE=dlse is not None, WRITE_GUARDED=guard,
    )


def _gluon_chunk(q, k, spec: BiasSpec, tiles: int) -> int:
    """The :func:`.flash.program_chunk` of the Gluon backward's ``tiles`` key-tile programs: at head dim 64 under a
    causal band its last pairs start their key tiles rank by rank (heaviest first); at 128 the plain order was
    faster, at 256 as fast."""
    B, H, Mq, D = q.shape
    if D != 64 or not flash.growing_spans(spec):
        return 1
    Hkv = k.shape[1]
    return flash.program_chunk(B * Hkv, tiles, flash.num_sms(q.device), Mq * D * 8 * (H // Hkv))


@functools.cache  # replays reach the module through this: an import statement per call costs several µs
def _gluon_backward():
    from . import gluon_backward

    return gluon_backward


def _gluon_roles(q, k, v, out, lse, dout, dk, dv, spec: BiasSpec, roles: tuple, qk_scale: float, scale: float) -> tuple:
    """The roles of a Gluon backward's launch plan: the call's tensors (dO contiguous and aligned: the kernel reads
    it through a per-head descriptor), its scratch (``delta``, ``guarded`` and the zeroed float32 dQ it adds into),
    the descriptors (built per call), the spec's shared roles with the key tiles' table, and the scales."""
    gluon_backward = _gluon_backward()
    if not dout.is_contiguous() or dout.data_ptr() % 16:
        dout = dout.clone(memory_format=torch.contiguous_format)
    delta, guarded = torch.empty((2, *lse.shape), dtype=torch.float32, device=q.device)
    dq32 = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # zeroed by the preprocessing (_delta)
    descs = gluon_backward.descriptors(q, k, v, dout, guarded, delta, dq32, dk, dv, spec.q_seqstart is not None)
    table = schedule.key_schedule(spec, gluon_backward.program_keys(q.shape[3]), q.device).table if roles else None
    return (q, k, v, out, lse, dout, delta, guarded, dq32, dk, dv, *descs, *roles,
            *((table,) if table is not None else ()), qk_scale, scale)


def _gluon_bwd(q, k, v, out, lse, dout, dlse, spec: BiasSpec, scale: float, qk_scale: float, dk, dv, store: dict,
               key, roles: tuple) -> torch.Tensor | None:
    """Write ``dk`` and ``dv`` with the Gluon backward and return dQ; None (nothing written) when the installed
    Triton cannot build the kernel. The launches are recorded for the launch plan of ``key`` in ``store``
    (:func:`attn_bwd` replays it); the copy out of the float32 dQ stays outside the plan."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from . import gluon_backward

    plan_roles = _gluon_roles(q, k, v, out, lse, dout, dk, dv, spec, roles, qk_scale, scale)
    dout, delta, guarded, dq32 = plan_roles[5:9]
    descs = plan_roles[11:18]
    outs = plan_roles[18:20] if gluon_backward.tma_outputs(q.shape[3], spec.q_seqstart is not None) else (dk, dv)
    sched = schedule.key_schedule(spec, gluon_backward.program_keys(q.shape[3]), q.device)
    args = _spec_args(spec, q.device)
    lists = None
    if args.has_layout:  # count, index and their strides; the layout is exact and alone (_gluon_lists)
        lists = args.tile_lists(spec, sched, gluon_backward.ROWS, False, q.device)[:4]
    with plans.recording() as rec:
        _delta(out, dout, dlse.to(torch.float32).contiguous() if dlse is not None else None, delta, args.f32,
               q.shape[3], lse, guarded, dq32)
        try:
            gluon_backward.attn_bwd(
                q, k, *outs, descs, qk_scale, scale, sched.n,
                sched.table if sched.table is not None else args.d32,
                (args.qs, args.ks, args.kl, args.kv, args.band_lo, args.band_hi),
                dict(SCHEDULED=sched.table is not None, HAS_SEGMENTS=args.has_segments, HAS_PADDED=args.has_padded,
                     HAS_BAND=args.has_band, BAND_PER_SEGMENT=args.band_per_segment),
                _gluon_chunk(q, k, spec, sched.n), lists)
        except (CompilationError, OutOfResources) as e:
            flash._gluon_fails(e, _gluon_failure, "backward")
            return None
    plans.settle(store, key, rec, plan_roles, flash.GLUON_NOTE)
    return dq32.to(q.dtype)


def attn_bwd(q, k, v, out, lse, dout, dlse, spec: BiasSpec, scale: float, need_dbias: bool,
             dropout_p: float = 0.0, seed: int = 0):
    """``(dq, dk, dv, dadditive or None)``; ``dlse`` (or None) enters as ``delta = rowsum(dout * out) - dlse``.

    ``dropout_p`` and ``seed`` must be the forward's: the kernels draw the same mask again."""
    B, H, Mq, D = q.shape
    Hkv, Mk, Dv = k.shape[1], k.shape[2], v.shape[3]
    dev = q.device
    add = spec.additive
    need_dbias = need_dbias and add is not None
    # gradients contiguous (docs/design.md: "Outputs laid out like q, gradients contiguous")
    dk = _new(q, k.shape, k.dtype)
    dv = _new(q, v.shape, v.dtype)
    if B * H * Mq == 0 or Mk == 0:
        dk.zero_(), dv.zero_()
        return q.new_zeros(q.shape), dk, dv, (torch.zeros_like(add) if need_dbias else None)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    # one plan per call signature, on whichever kernels its first calls took: a replay asks nothing again
    plannable = dlse is None and not need_dbias and dropout_p == 0
    key = _plan_key("bwd", (q, k, v, out, lse, dout), spec, torch.are_deterministic_algorithms_enabled()) if plannable else None
    store, key, roles = flash.plan_home(spec, dev, key)
    planned = plans.lookup(store, key)
    scale = float(scale)  # the scales are roles of the plan: these objects go into every launch
    qk_scale = scale * LOG2E
    if planned is not None and planned.note == flash.GLUON_NOTE:
        plan_roles = _gluon_roles(q, k, v, out, lse, dout, dk, dv, spec, roles, qk_scale, scale)
        planned.run(plan_roles)
        return plan_roles[8].to(q.dtype), dk, dv, None  # dQ out of its float32 sums
    if planned is None and D == Dv and D in GLUON_HEAD_DIMS and _gluon_runs(q, k, v, lse, spec, need_dbias, dropout_p):
        dq = _gluon_bwd(q, k, v, out, lse, dout, dlse, spec, scale, qk_scale, dk, dv, store, key, roles)
        if dq is not None:
            return dq, dk, dv, None
    dq = _new(q, q.shape, q.dtype)
    delta = q.new_empty((B, H, Mq), dtype=torch.float32)
    if planned is not None:
        planned.run((q, k, v, out, lse, dout, delta, dq, dk, dv, *roles, *_tables(spec, planned.note, dev, roles),
                     qk_scale, scale))
        return dq, dk, dv, None
    args = _spec_args(spec, dev)
    hd, hdv = head_tiles(D, Dv)
    even = D == hd and Dv == hdv
    batch_inner = args.batch_shared_bias and B > 1
    dlse_t = dlse.to(torch.float32).contiguous() if dlse is not None else args.f32
    reduction = _dbias_reduction(add, B, H, Mq, Mk) if need_dbias else None
    opts = options.current()
    dq_from_ds = opts.dq_from_ds and _dq_reads_dbias(spec, reduction, B, H, q.dtype)  # dK/dV first, then dQ from dS
    concurrent = (opts.concurrent_bwd and dev.type == "cuda" and not flash.INTERPRETED and not dq_from_ds
                  and _long_backward(spec, B, H, Mq, Mk, max(D, Dv)))
    fused_delta = opts.fused_delta and not concurrent and not dq_from_ds  # dQ first, writing delta for dK/dV
    if concurrent:  # a replay would put both launches on one stream
        key = None
    d32 = args.f32
    b_bcast, h_bcast = _shared_gradient(add, reduction, B, H)
    # a full gradient shared by batch rows or heads: its own kernel sums each tile over the sharers,
    # except with packed segments, where the dK/dV programs accumulate it tile by tile
    shared_dbias = (b_bcast or h_bcast) and not args.has_segments
    kv_reduction = None if shared_dbias else reduction  # the dK/dV kernel's part of the bias gradient
    nb_loop = B if b_bcast and not shared_dbias else 1
    nhk_loop = Hkv if h_bcast and not shared_dbias else 1
    dbias_accum = kv_reduction == "full" and (nb_loop > 1 or h_bcast)
    # dK/dV accumulates a gradient tile shared by its (batch, head) loop in float32; every other
    # element is written once, in the bias' dtype. Tiles that no program visits must read 0.
    g_dtype = torch.float32 if dbias_accum or add is None else add.dtype
    every_tile = not (args.has_segments or args.has_padded or args.has_band or args.has_layout)
    g_zero = kv_reduction == "full" and (dbias_accum or not every_tile)
    dbias = _new(q, add.shape, g_dtype, zero=g_zero) if reduction == "full" else d32
    dcol = torch.zeros((B, H, Mk), dtype=torch.float32, device=dev) if reduction == "col" else d32
    drow = torch.zeros((B, H, Mq), dtype=torch.float32, device=dev) if reduction == "row" else d32
    g_strides = _bcast_strides(dbias, (B, H, Mq, Mk)) if reduction == "full" else (0, 0, 0, 0)
    common = (args.add_strides, args.slope_strides, args.layout_strides)
    g_span = (Mq - 1) * abs(g_strides[2]) + (Mk - 1) * abs(g_strides[3])
    index_64 = _index_64(
        slice_span(q), slice_span(k), slice_span(v), slice_span(out), slice_span(dout), slice_span(dq),
        slice_span(dk), slice_span(dv), args.add_span, g_span,
    )
    feats = args.features + ((reduction,) if reduction else ()) + (("dropout",) if dropout_p > 0 else ())
    feats += _span_features(spec, Mq, Mk)
    drop = dropout_args(dropout_p, seed)
    has_dropout = dropout_p > 0

    blocks = [0, 0]  # the tiles of the tables dQ and dK/dV ran with: (query tile, key tile)

    def run_dkdv(cfg: configs.TileConfig) -> None:
        if kv_reduction == "full" and nb_loop * nhk_loop > 1:
            dbias.zero_()
        sched = schedule.key_schedule(spec, cfg.block_n, dev)
        blocks[1] = cfg.block_n if sched.table is not None else 0
        count, index, cs, ts, exact, list_only = args.tile_lists(spec, sched, cfg.block_m, False, dev)
        grid = (sched.n, (B // nb_loop) * (Hkv // nhk_loop))
        _dkdv[grid](
            q, k, v, dout, lse, delta, dk, dv, dbias, dcol,
            args.add, args.slopes, args.layout, args.qs, args.kv, args.band_lo, args.band_hi,
            sched.table if sched.table is not None else args.d32, count, index,
            qk_scale, scale,
            q.stride(), k.stride(), v.stride(), dout.stride(), dk.stride(), dv.stride(), g_strides, *common, cs, ts,
            H, H // Hkv, Hkv, Mq, Mk, D, Dv, nb_loop, nhk_loop,
            spec.layout_q_off, spec.layout_k_off, args.block_q, args.block_k, spec.alibi_shift, *drop,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=hd, HEAD_DIM_V=hdv, EVEN_D=even,
            SCHEDULED=sched.table is not None, LAYOUT_EXACT=exact, LIST_ONLY=list_only,
            LIST_TILES=_list_tiles(index, list_only), FULL_DBIAS=kv_reduction == "full",
            DBIAS_ACCUM=dbias_accum, COL_DBIAS=reduction == "col",
            DOT_PRECISION=_dot_precision(q.dtype),
            INDEX_64=index_64, GQA=H != Hkv, OUTER_LOOPS=nb_loop * nhk_loop > 1,
            HAS_DROPOUT=has_dropout, DROP_ALIGNED=sched.table is None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **args.switches,
        )

    def run_dq(cfg: configs.TileConfig) -> None:
        sched = schedule.query_schedule(spec, cfg.block_m, dev)
        blocks[0] = cfg.block_m if sched.table is not None else 0
        count, index, cs, ts, exact, list_only = args.tile_lists(spec, sched, cfg.block_n, True, dev)
        grid = (sched.n * B, H) if batch_inner else (sched.n, B * H)
        _dq[grid](
            q, k, v, dout, lse, delta, dq, drow, out, dlse_t,
            args.add, args.slopes, args.layout, args.ks, args.kl, args.kv, args.band_lo, args.band_hi,
            sched.table if sched.table is not None else args.d32, count, index,
            qk_scale, scale,
            q.stride(), k.stride(), v.stride(), dout.stride(), dq.stride(), out.stride(), *common, cs, ts,
            B, H, H // Hkv, Mq, Mk, D, Dv, sched.n,
            spec.layout_q_off, spec.layout_k_off, args.block_q, args.block_k, spec.alibi_shift, *drop,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=hd, HEAD_DIM_V=hdv, EVEN_D=even, BATCH_INNER=batch_inner,
            HAS_DROPOUT=has_dropout, FUSED_DELTA=fused_delta, HAS_DLSE=dlse is not None,
            SCHEDULED=sched.table is not None, LAYOUT_EXACT=exact, LIST_ONLY=list_only,
            LIST_TILES=_list_tiles(index, list_only), ROW_DBIAS=reduction == "row",
            DOT_PRECISION=_dot_precision(q.dtype), INDEX_64=index_64,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **args.switches,
        )

    def run_dq_ds(cfg: configs.TileConfig) -> None:
        _dq_ds[(cdiv(Mq, cfg.block_m), B * H)](
            k, dbias, dq, args.kv, args.band_lo, args.band_hi, scale,
            k.stride(), g_strides, dq.stride(), H, H // Hkv, Mq, Mk, D,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=hd, EVEN_D=even,
            HAS_PADDED=args.has_padded, HAS_BAND=args.has_band, DOT_PRECISION=_dot_precision(q.dtype),
            INDEX_64=index_64, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    def run_dbias(cfg: configs.TileConfig) -> None:
        n_tiles_n = cdiv(Mk, cfg.block_n)
        bb, hb = add.shape[0], add.shape[1]
        heads_shared = H if h_bcast else 1
        n_sharers = (B if b_bcast else 1) * heads_shared
        _dbias[(cdiv(Mq, cfg.block_m) * n_tiles_n, bb * hb)](
            q, k, v, dout, lse, delta, dbias,
            args.add, args.slopes, args.layout, args.kv, args.band_lo, args.band_hi,
            qk_scale,
            q.stride(), k.stride(), v.stride(), dout.stride(), dbias.stride(), *common,
            H, H // Hkv, hb, Mq, Mk, D, Dv, n_tiles_n, n_sharers, heads_shared,
            spec.layout_q_off, spec.layout_k_off, args.block_q, args.block_k, spec.alibi_shift, *drop,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=hd, HEAD_DIM_V=hdv, EVEN_D=even,
            HAS_PADDED=args.has_padded, HAS_BAND=args.has_band, HAS_LAYOUT=args.has_layout, HAS_ALIBI=args.has_alibi,
            DOT_PRECISION=_dot_precision(q.dtype), INDEX_64=index_64, HAS_DROPOUT=has_dropout,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    with plans.recording() as rec:
        if not fused_delta:
            _delta(out, dout, dlse_t if dlse is not None else None, delta, args.f32, hdv)
        hmax = max(hd, hdv)
        if concurrent:
            # dK/dV and dQ depend only on what is queued so far: fork dQ to a side stream and join it
            # back, so every later use on the caller's stream (and any reuse of these buffers) waits for it
            main, side = torch.cuda.current_stream(dev), _side_stream(dev)
            side.wait_stream(main)
        if fused_delta:
            configs.launch("dq", hmax, q.dtype, dev, feats, run_dq)
            configs.launch("dkdv", hmax, q.dtype, dev, feats, run_dkdv)
        elif dq_from_ds:
            configs.launch("dkdv", hmax, q.dtype, dev, feats, run_dkdv)
            configs.launch("dq_ds", hmax, q.dtype, dev, feats, run_dq_ds)
        else:
            configs.launch("dkdv", hmax, q.dtype, dev, feats, run_dkdv)
            with torch.cuda.stream(side) if concurrent else contextlib.nullcontext():
                configs.launch("dq", hmax, q.dtype, dev, feats, run_dq)
        if shared_dbias:
            configs.launch("dbias", hmax, q.dtype, dev, feats, run_dbias)
        if concurrent:
            main.wait_stream(side)
    note = tuple(blocks)
    plans.settle(store, key, rec, (q, k, v, out, lse, dout, delta, dq, dk, dv, *roles, *_tables(spec, note, dev, roles),
                                   qk_scale, scale), note)
    dadd = None
    if reduction == "full":
        dadd = dbias
    elif reduction == "col":
        dadd = reduce_to(dcol[:, :, None, :], add.shape)
    elif reduction == "row":
        dadd = reduce_to(drow[:, :, :, None], add.shape)
    if dadd is not None:
        dadd = dadd.to(add.dtype)
    return dq, dk, dv, dadd
