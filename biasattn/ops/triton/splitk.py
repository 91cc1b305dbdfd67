"""Launchers of the split-KV kernels: ``splitk_attention_fwd``, ``merge_partials_triton``, and the split heuristic.

Everything here is host-side and free of device syncs: the grid, the split count and the buffer
sizes depend on shapes and on the spec's host metadata only, never on device values, so a call can
be captured in a CUDA graph and replayed with new cache lengths written into the same tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from ...inputs import AttentionInputs
from ...memo import BoundedCache
from ..common import cdiv, cuda_capability, head_tiles, next_power_of_2, num_sms, slice_span, tile_size
from . import configs, options, plans, splitk_kernels
from .launch import direct

_split, _merge = direct(splitk_kernels._splitk_fwd_kernel), direct(splitk_kernels._merge_partials_kernel)

LOG2E = 1.4426950408889634
MAX_SPLITS = 128
SPLIT_SLACK = 0.05
MERGE_BLOCK_S = 128  # splits one merge program loads at once (MAX_SPLITS: always one round of loads) ...
MERGE_TILE = 8192  # ... within a tile of this many partial elements (fewer columns per program as S grows)
MERGE_OVERHEAD_TILES = 4.0  # the merge launch, in one program's tile loads (fitted on an H200: bench_decode.py --splits)
# An eager call (no CUDA graph capture) splits no cache of at most this many keys: the merge launch
# and the partial buffers cost the host more (about 20 µs on an H200 host) than splitting saves the
# GPU there (at most 11 µs at 2k keys), and such a call waits on the host anyway.
EAGER_NO_SPLIT_KEYS = 2048


def pdl_available(device: torch.device) -> bool:
    """Whether the merge can start as a programmatic dependent launch of the split kernel: a CUDA
    device of compute capability 9.0 or later, a Triton with grid dependency control, and the
    ``split_kv_pdl`` option."""
    return (options.current().split_kv_pdl and device.type == "cuda" and not configs.interpreted()
            and splitk_kernels.gdc_wait is not None
            and cuda_capability(device) >= (9, 0))


def choose_num_splits(
    batch_heads: int, key_tiles: int, num_sms: int, *, programs_per_sm: int = 1,
    split_overhead_tiles: float = 1.0, merge_overhead_tiles: float = MERGE_OVERHEAD_TILES,
    max_splits: int = MAX_SPLITS, tiles_per_sequence: Sequence[int] | None = None, slack: float = SPLIT_SLACK,
) -> int:
    """Number of splits of ``key_tiles`` (the longest sequence's tiles); 1 means no split.

    ``batch_heads`` counts the (sequence, KV head, row block) triples; ``tiles_per_sequence`` gives
    each sequence's own tiles when they differ (padded keys), else every sequence has ``key_tiles``.
    Splitting into ``S`` pieces of ``p = ceil(key_tiles / S)`` tiles keeps ``busy(S)`` programs
    working (a sequence of ``t`` tiles fills ``ceil(t / p)`` pieces; the rest exit at once), and
    ``num_sms · programs_per_sm`` programs stream at full rate at a time (a wave; one per SM by
    default: on an H200 a second streaming program on an SM shares its bandwidth, so a split that
    needs two waves gains nothing there, 10-20% slower on 1k caches). When ``batch_heads`` alone fills
    a wave the grid is already full: no split. Otherwise the modelled time is
    ``ceil(busy(S) / wave) · (p + split_overhead_tiles) + merge_overhead_tiles``, the two overheads
    counted in one program's tile loads: a program's own fixed cost (its start, writing its partial
    output) and the merge launch, paid once by every split call. The answer is the fewest splits
    within ``slack`` (:data:`SPLIT_SLACK`) of the best time, so that near-ties buy no extra merge work. Never
    more splits than tiles.
    """
    if batch_heads <= 0 or key_tiles <= 1 or num_sms <= 0:
        return 1
    if batch_heads >= num_sms * max(1, programs_per_sm):
        return 1
    lengths = tuple(tiles_per_sequence) if tiles_per_sequence else (key_tiles,)
    return _modelled_best(batch_heads, key_tiles, num_sms, programs_per_sm, split_overhead_tiles, merge_overhead_tiles,
                          max_splits, lengths, slack)


@functools.lru_cache(maxsize=4096)  # decoding asks again on every step, and the tile counts move slowly
def _modelled_best(batch_heads: int, key_tiles: int, num_sms: int, programs_per_sm: int, split_overhead_tiles: float,
                   merge_overhead_tiles: float, max_splits: int, lengths: tuple[int, ...], slack: float) -> int:
    slots = num_sms * max(1, programs_per_sm)
    splits = np.arange(1, min(max_splits, key_tiles) + 1)
    piece = -(-key_tiles // splits)
    pieces = np.maximum(1, -(-np.asarray(lengths)[None, :] // piece[:, None])).sum(axis=1)  # per sequence, summed
    busy = batch_heads / len(lengths) * pieces
    waves = np.ceil(busy / slots - 1e-9)
    costs = waves * (piece + split_overhead_tiles) + np.where(splits > 1, merge_overhead_tiles, 0.0)
    return int(splits[np.argmax(costs <= costs.min() * (1 + slack))])


@dataclass(frozen=True)
class SplitKConfig:
    """Tile sizes and launch parameters of one call."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


LONG_CACHE_KEYS = 8192  # key bounds from which 128-key tiles stream faster than 64 (H200: +1-32%) ...
MID_CACHE_KEYS = 2048  # ... and from which they do on grids of fewer than FULL_GRID_PROGRAMS programs
FULL_GRID_PROGRAMS = 512


WARPGROUP_ROWS = 64  # rows of a warp-group MMA tile (sm90): smaller row groups are padded to it (option
WARPGROUP_MIN_KEYS = 8192  # pad_to_warpgroup) where the call's (sequence, KV head) pairs hold this many keys together
WARPGROUP_MERGE_ROW_TILES = 0.4  # a warp-group block's merge: tile loads more per wave of merged rows (fitted on an H100)
SHORT_PIECE_TILES = 1  # programs of at most this many key tiles run no more stages than tiles, at least 2 (+4-10%)


def default_config(rows: int, head_dim: int, head_dim_v: int, device: torch.device, keys: int = 0,
                   pairs: int = 0, queries: int = 1, capability: tuple[int, int] = (0, 0), sms: int = 0) -> SplitKConfig:
    """Tiles for ``rows`` packed query rows (group heads × ``queries`` queries per sequence) of
    ``pairs`` (sequence, KV head) pairs over at most ``keys`` keys per sequence on a device of
    compute ``capability`` with ``sms`` multiprocessors (0: not known); small key tiles under the
    interpreter."""
    widest = max(head_dim, head_dim_v)
    block_m = min(tile_size(rows), 128 if widest <= 128 else 64)
    if device.type != "cuda":
        return SplitKConfig(block_m, 16, 4, 1)
    if widest > 128:
        return SplitKConfig(block_m, 32, 4 if block_m <= 64 else 8, 4)
    opts = options.current()
    if (opts.short_row_blocks and 16 < rows <= 32 and capability[0] == 9 and keys < MID_CACHE_KEYS
            and sms < 3 * pairs and 2 * pairs <= sms):
        # Hopper, short caches: two 16-row blocks per pair (the second reads K/V from L2) fill more than
        # two thirds of a wave with no merge, where the padded 64-row block would leave a third of the
        # SMs idle or split the keys (H100: 1.00-1.10x on 20 shapes)
        return SplitKConfig(16, 128, 4, 3)
    if opts.pad_to_warpgroup and 16 < rows <= WARPGROUP_ROWS and capability[0] == 9 and pairs * keys >= WARPGROUP_MIN_KEYS:
        # Hopper: a 64-row block runs warp-group MMAs fed from shared memory, a shorter per-tile
        # chain than the 32-row block's mma.sync, though half its rows are padding; on smaller
        # calls, whose programs stream a tile or two, the 32-row block's shorter start wins (by 2-3%)
        return SplitKConfig(WARPGROUP_ROWS, 64, 4, 3)
    if (opts.many_rows_warpgroup and WARPGROUP_ROWS < rows <= 2 * WARPGROUP_ROWS and capability[0] == 9
            and keys >= LONG_CACHE_KEYS and 0 < 4 * pairs <= sms):
        # Hopper, 65-128 rows: two 64-row warp-group blocks per pair; the second reads the pair's
        # K/V tiles from L2. Only while the call still splits each pair in one wave: on grids that
        # the row blocks fill alone, the two blocks read K/V apart (6-11% slower)
        return SplitKConfig(WARPGROUP_ROWS, 128, 4, 3)
    if keys < MID_CACHE_KEYS:  # short caches: 64-row blocks, more programs (128 packed rows: +19-32%)
        block_m = min(block_m, 64)
    programs = pairs * cdiv(rows, block_m)  # before any split
    if keys >= LONG_CACHE_KEYS or (keys >= MID_CACHE_KEYS and programs < FULL_GRID_PROGRAMS):  # fewer, larger loads
        return SplitKConfig(block_m, 128, 4 if block_m <= 64 else 8, 3)
    if block_m > 64:
        return SplitKConfig(block_m, 64, 8, 4)
    # short caches: more key tiles to split, and a shallower pipeline: three stages stream
    # a split piece fastest; on a grid that is full without splitting, single queries go fastest
    # with two (more programs share an SM), several queries per sequence with four
    if programs < FULL_GRID_PROGRAMS:
        return SplitKConfig(block_m, 64, 4, 3)
    return SplitKConfig(block_m, 64, 4, 2 if keys < MID_CACHE_KEYS and queries == 1 else 4)


def _key_bounds(inp: AttentionInputs, mq_stride: int) -> tuple[int, list[int] | None]:
    """``(bound, lengths)``: keys a sequence's rows can see, and each sequence's own count if they differ.

    The bound sizes the grid and comes from shapes (and the bias' structure), never from cache
    lengths, so a captured graph stays valid when the lengths change; the host copies of the
    lengths only tune the split. Neither ever changes results: the last split takes any rest.
    """
    spec, h = inp.spec, inp.spec.host
    width = inp.Mk
    if h.band_lo is not None:
        width = max(max(hi - lo + mq_stride for lo, hi in zip(h.band_lo, h.band_hi)), 0)
    if spec.q_seqstart is not None:
        lengths = [min(n, width) for n in h.k_seqlen]
        return max(lengths, default=0), lengths
    bound = min(inp.Mk, width)
    if h.kv_seqlens is None:
        return bound, None
    return bound, [min(n, bound) for n in h.kv_seqlens]


def _strides4(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    """Strides of a broadcastable 4-D tensor, 0 on size-1 dims."""
    if t is None:
        return (0, 0, 0, 0)
    return tuple(0 if n == 1 else s for n, s in zip(t.shape, t.stride()))


def splitk_attention_fwd(
    inp: AttentionInputs, *, num_splits: int | None = None, config: SplitKConfig | None = None,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV attention forward: ``(out [B, Hq, Mq, Dv] in q's dtype, lse [B, Hq, Mq] float32)``.

    ``num_splits`` and ``config`` override the heuristic and the default tiles (tests, benchmarks).
    ``out``/``lse`` receive the result; ``partials`` (``[S, B, Hq, Mq, Dv]`` and ``[S, B, Hq, Mq]``
    float32) receive the per-split results when ``S > 1``. All are allocated when not given.
    Calls that give none of these replay a launch plan (:mod:`.plans`) once their signature has one.
    """
    q, k, v, spec = inp.q, inp.k, inp.v, inp.spec
    B, Hq, Mq, D = q.shape
    Hkv, Mk, Dv, G = k.shape[1], k.shape[2], v.shape[3], inp.groups
    dev = q.device
    plannable = num_splits is None and config is None and out is None and lse is None and partials is None
    key = _plan_key(q, k, v) if plannable else None
    qk_scale = inp.scale * LOG2E  # a role of the plan: one object in the launch and in the roles
    plan = plans.lookup(spec.derived, key)
    shared_key = shape = None
    if plan is None and key is not None and spec.key_lengths_only and min(B, Hq, Mq, Mk) > 0:
        lengths = spec.kv_seqlens
        if spec.host.kv_seqlens is None:  # lengths only the device holds: the launch follows from shapes alone
            shape = _shapes_only.get(key)
            if shape is None:
                shape = _shapes_only[key] = _launch_shape(inp, B, Mq, None, None)
        else:
            shape = _launch_shape(inp, B, Mq, None, None)  # one sequence per batch row
        shared_key = (key, lengths.dtype, lengths.data_ptr() & 15, shape)
        plan = plans.lookup(_shared_plans, shared_key)
    if plan is not None:
        out = q.new_empty((B, Hq, Mq, Dv))  # new_empty: less host time than torch.empty(..., device=)
        lse = q.new_empty((B, Hq, Mq), dtype=torch.float32)
        if plan.note > 1:  # the split count
            o_buf = q.new_empty((plan.note, B, Hq, Mq, Dv), dtype=torch.float32)
            l_buf = q.new_empty((plan.note, B, Hq, Mq), dtype=torch.float32)
        else:
            o_buf, l_buf = out, lse
        plan.run((q, k, v, out, lse, o_buf, l_buf, qk_scale, spec.kv_seqlens))
        return out, lse
    if out is None:
        out = torch.empty((B, Hq, Mq, Dv), dtype=q.dtype, device=dev)
    if lse is None:
        lse = torch.empty((B, Hq, Mq), dtype=torch.float32, device=dev)
    if B == 0 or Hq == 0 or Mq == 0:
        return out, lse
    segments, qs, Z, mq_stride = _sequences(inp)
    if Mk == 0 or Z == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse

    head_dim, head_dim_v = head_tiles(D, Dv)
    shape = shape or _launch_shape(inp, Z, mq_stride, num_splits, config)
    cfg, row_blocks, num_splits, tiles_per_split = shape.config, shape.row_blocks, shape.num_splits, shape.tiles_per_split

    if num_splits == 1:
        o_buf, l_buf = out, lse
        so, sl = (0,) + tuple(out.stride()), (0,) + tuple(lse.stride())
    else:
        if partials is None:
            partials = (
                torch.empty((num_splits, B, Hq, Mq, Dv), dtype=torch.float32, device=dev),
                torch.empty((num_splits, B, Hq, Mq), dtype=torch.float32, device=dev),
            )
        o_buf, l_buf = partials
        so, sl = o_buf.stride(), l_buf.stride()

    grid = (Z * Hkv * row_blocks, num_splits)
    pdl = num_splits > 1 and pdl_available(dev)
    add = spec.additive
    slopes = spec.alibi_slopes
    sa = _strides4(add)
    ss = (0, 0) if slopes is None else tuple(0 if n == 1 else s for n, s in zip(slopes.shape, slopes.stride()))
    band_per_segment = spec.band_lo is not None and spec.band_lo.numel() > 1
    placeholder = spec.kv_seqlens if spec.kv_seqlens is not None else q
    with plans.recording() as rec:
        _split[grid](
            q, k, v, o_buf, l_buf,
            placeholder, spec.q_seqstart if segments else q, spec.k_seqstart if segments else q,
            spec.k_seqlen if segments else q,
            spec.band_lo if spec.band_lo is not None else q, spec.band_hi if spec.band_hi is not None else q,
            add if add is not None else q, slopes if slopes is not None else q,
            qk_scale, spec.alibi_shift,
            q.stride(), k.stride(), v.stride(), so, sl, sa, ss,
            Hkv, Mq, Mk, D, Dv, G, row_blocks, num_splits, tiles_per_split, mq_stride,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
            HAS_KV_LEN=spec.kv_seqlens is not None and not segments, HAS_SEGMENTS=segments,
            HAS_BAND=spec.band_lo is not None, BAND_PER_SEGMENT=band_per_segment,
            HAS_ADDITIVE=add is not None, HAS_ALIBI=slopes is not None,
            EVEN_D=head_dim == D, EVEN_DV=head_dim_v == Dv,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            INDEX_64=options.current().force_index_64 or max(slice_span(k), slice_span(v)) >= 2**31, PDL=pdl,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if num_splits > 1:
            merge_partials_triton(o_buf, l_buf, out=out, lse=lse, after_split=pdl)
    if segments and (qs[0] > 0 or qs[-1] < Mq):  # rows outside every segment see nothing (not replayed)
        for rows_ in (slice(0, qs[0]), slice(qs[-1], Mq)):
            out[:, :, rows_] = 0
            lse[:, :, rows_] = float("-inf")
    else:
        plans.settle(spec.derived, key, rec, (q, k, v, out, lse, o_buf, l_buf, qk_scale), num_splits)
        if shared_key is not None:
            plans.settle(_shared_plans, shared_key, rec, (q, k, v, out, lse, o_buf, l_buf, qk_scale, spec.kv_seqlens),
                         num_splits)
    return out, lse


# Plans shared by the specs of cache-length masks (``PaddedKeysMask`` alone, or with a causal mask
# that hides nothing for the call): a decode loop that builds its mask anew every step gets a new
# spec every step, so a plan kept in the spec would never be replayed. Here the lengths tensor is a
# role of the plan, like q, k and v, and the key holds the launch shape the call's host lengths give
# (tiles, row blocks, split count): a plan is replayed only by calls that would launch the same.
_shared_plans = BoundedCache(256)
_shapes_only = BoundedCache(256)  # the launch shape of a plan key when no host length tunes it


@dataclass(frozen=True)
class LaunchShape:
    """What one split-KV call launches: its tiles, row blocks per (sequence, KV head) pair, and splits."""

    config: SplitKConfig
    row_blocks: int
    key_tiles: int
    num_splits: int

    @property
    def tiles_per_split(self) -> int:
        """Key tiles of one split (the last split takes any rest)."""
        return cdiv(self.key_tiles, self.num_splits)

    def describe(self) -> str:
        """One line for ``explain()``."""
        c = self.config
        split = (f"{self.num_splits} splits of {self.tiles_per_split} key tiles each, merged by log-sum-exp"
                 if self.num_splits > 1 else f"no split ({self.key_tiles} key tiles per program)")
        return (f"{self.row_blocks} block{'s' if self.row_blocks > 1 else ''} of {c.block_m} packed rows per "
                f"(sequence, KV head), {c.block_n}-key tiles, {c.num_warps} warps, {c.num_stages} pipeline "
                f"stage{'s' if c.num_stages > 1 else ''}; {split}")


def launch_shape(inp: AttentionInputs) -> LaunchShape | None:
    """The launch :func:`splitk_attention_fwd` makes for ``inp`` by default (None when it launches nothing)."""
    _, _, Z, mq_stride = _sequences(inp)
    if min(inp.B, inp.Hq, inp.Mq, inp.Mk, Z) == 0 or inp.q.device.type not in ("cuda", "cpu"):
        return None
    return _launch_shape(inp, Z, mq_stride, None, None)


def _sequences(inp: AttentionInputs) -> tuple[bool, tuple[int, ...], int, int]:
    """``(packed, query starts, sequences Z, most queries in one sequence)`` of a call: its packed
    segments, or one sequence per batch row."""
    segments = inp.spec.q_seqstart is not None
    qs = inp.spec.host.q_seqstart if segments else (0, inp.Mq)
    return segments, qs, len(qs) - 1 if segments else inp.B, max([b - a for a, b in zip(qs, qs[1:])] + [1])


def _launch_shape(inp: AttentionInputs, Z: int, mq_stride: int, num_splits: int | None,
                  config: SplitKConfig | None) -> LaunchShape:
    """Tiles, row blocks and split count of a call of ``Z`` sequences of at most ``mq_stride`` queries;
    ``num_splits`` and ``config`` override the heuristic and the default tiles."""
    q, spec, dev = inp.q, inp.spec, inp.q.device
    D, Dv, Hkv = inp.D, inp.Dv, inp.Hkv
    rows = inp.groups * mq_stride
    head_dim, head_dim_v = head_tiles(D, Dv)
    bound, lengths = _key_bounds(inp, mq_stride)
    sms = num_sms(dev)
    cfg = config or default_config(rows, head_dim, head_dim_v, dev, bound, Z * Hkv, mq_stride,
                                   cuda_capability(dev) if dev.type == "cuda" else (0, 0), sms)
    row_blocks = cdiv(rows, cfg.block_m)
    # a band or packed segments may start a sequence's keys inside a tile: one tile more to cover
    unaligned = int(spec.band_lo is not None or spec.q_seqstart is not None)
    key_tiles = cdiv(bound, cfg.block_n) + unaligned
    if num_splits is None and bound <= EAGER_NO_SPLIT_KEYS and _eager_on_gpu(dev):
        num_splits = 1
    if num_splits is None:
        tile_bytes = cfg.block_n * (head_dim + head_dim_v) * q.element_size()
        num_splits = choose_num_splits(
            Z * Hkv * row_blocks, key_tiles, sms,
            split_overhead_tiles=1.0 + min(rows, cfg.block_m) * Dv * 8 / tile_bytes,
            merge_overhead_tiles=merge_overhead(cfg, rows, Z * Hkv * rows, sms),
            tiles_per_sequence=None if lengths is None else [cdiv(n, cfg.block_n) + unaligned for n in lengths],
            slack=SPLIT_SLACK,
        )
        num_splits = cdiv(key_tiles, cdiv(key_tiles, num_splits))
    stages = piece_stages(cfg.num_stages, cdiv(key_tiles, num_splits))
    if config is None and stages != cfg.num_stages:
        cfg = replace(cfg, num_stages=stages)
    return LaunchShape(cfg, row_blocks, key_tiles, num_splits)


def piece_stages(stages: int, tiles: int, short_piece: int | None = None) -> int:
    """Pipeline stages for a program of ``tiles`` key tiles under a config of ``stages``: a short piece
    (at most ``short_piece`` tiles, :data:`SHORT_PIECE_TILES` by default) runs no more stages than it
    has tiles, and at least two; the stages it cannot fill only delay its first tile."""
    short_piece = SHORT_PIECE_TILES if short_piece is None else short_piece
    if tiles > short_piece or stages <= 2:
        return stages
    return min(stages, max(2, tiles))


def merge_overhead(cfg: SplitKConfig, rows: int, merged_rows: int, sms: int) -> float:
    """The merge of a split call in tile loads of one split program of ``cfg`` (``rows`` packed rows
    per (sequence, KV head) pair; ``merged_rows`` output rows in all; ``sms`` multiprocessors).
    A block taller than the pair's rows (Hopper's padded warp-group block) streams its tiles
    faster, so the merge, one program per output row, costs it more of its tiles per wave of rows."""
    if cfg.block_m <= tile_size(rows):
        return MERGE_OVERHEAD_TILES
    return MERGE_OVERHEAD_TILES + WARPGROUP_MERGE_ROW_TILES * merged_rows / max(1, sms)


def _eager_on_gpu(dev: torch.device) -> bool:
    """True for a GPU call outside CUDA graph capture (its launches cost host time on every call)."""
    return dev.type == "cuda" and not torch.cuda.is_current_stream_capturing()


def _plan_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The key of a call's launch plan in its spec's store: the tensors' signature, the launch
    :mod:`options` in force, the tuning constants the launches read (the scale is a role) and whether
    the call is eager on a GPU (see :data:`EAGER_NO_SPLIT_KEYS`)."""
    return ("split-KV plan", plans.tensor_key(q, k, v), options.current(), MERGE_BLOCK_S, MERGE_TILE,
            MERGE_OVERHEAD_TILES, WARPGROUP_MERGE_ROW_TILES, SPLIT_SLACK, SHORT_PIECE_TILES, EAGER_NO_SPLIT_KEYS,
            configs.interpreted(), _eager_on_gpu(q.device))


def _same_start(view: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """``base`` where ``view`` starts at the same address (a kernel reads only the start and the
    strides passed beside it), else ``view``: launch plans then find the call's own tensors."""
    return base if view.data_ptr() == base.data_ptr() and view.dtype == base.dtype else view


def merge_partials_triton(
    outs: torch.Tensor, lses: torch.Tensor, out_dtype: torch.dtype | None = None, *,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None, after_split: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path of :func:`biasattn.ops.merge.merge_partials` (forward only, no autograd).

    ``outs [S, ..., M, Dv]``, ``lses [S, ..., M]`` → ``(out [..., M, Dv], lse [..., M] float32)``.
    ``after_split``: launched right after a split kernel compiled with ``PDL`` (the ``split_kv_pdl`` option),
    as its programmatic dependent.
    """
    S, Dv = outs.shape[0], outs.shape[-1]
    lead = tuple(outs.shape[1:-1])
    if out is None:
        out = torch.empty(lead + (Dv,), dtype=out_dtype or outs.dtype, device=outs.device)
    if lse is None:
        lse = torch.empty(lead, dtype=torch.float32, device=outs.device)
    R = math.prod(lead)
    if R == 0 or Dv == 0:
        return out, lse
    parts = outs.reshape(S, R, Dv)
    part_lse = lses.reshape(S, R)
    out2, lse1 = out.view(R, Dv), lse.view(R)
    block_s = min(MERGE_BLOCK_S, next_power_of_2(S))
    block_d = min(128, next_power_of_2(Dv), max(16, MERGE_TILE // block_s))
    _merge[(R, cdiv(Dv, block_d))](
        _same_start(parts, outs), _same_start(part_lse, lses), _same_start(out2, out), _same_start(lse1, lse), S, Dv,
        *parts.stride(), *part_lse.stride(), *out2.stride(), lse1.stride(0),
        BLOCK_S=block_s, BLOCK_D=block_d, PDL=after_split,
        num_warps=4 if block_s * block_d >= 2048 else 2,
        **({"launch_pdl": True} if after_split else {}),
    )
    return out, lse
