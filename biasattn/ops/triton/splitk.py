"""Launchers of the split-KV kernels: ``splitk_attention_fwd``, ``merge_partials_triton``, and the split heuristic.

Everything here is host-side and free of device syncs: the grid, the split count and the buffer
sizes depend on shapes and on the spec's host metadata only, never on device values, so a call can
be captured in a CUDA graph and replayed with new cache lengths written into the same tensors.

A call split in ``S > 1`` pieces merges them in the split kernel's epilogue (``FUSED_MERGE``): the
last program of each (sequence, KV head, row block) to finish, told by an arrival counter, merges
the pieces of its rows, which saves the merge launch. The counters live in
:class:`_ArrivalCounters`; calls whose merge is too large for one program
(``FUSED_MERGE_MAX_STEPS``) and ``FUSED_MERGE = False`` merge in a second launch instead.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...inputs import AttentionInputs
from ..common import cdiv, next_power_of_2, tile_size
from .launch import current_stream, direct
from .splitk_kernels import _merge_partials_kernel, _splitk_fwd_kernel

_split, _merge = direct(_splitk_fwd_kernel), direct(_merge_partials_kernel)

LOG2E = 1.4426950408889634
MAX_SPLITS = 128
SPLIT_SLACK = 0.05
MERGE_OVERHEAD_TILES = 8.0  # the merge launch, in one program's tile loads (fitted on an H200, benchmarks/NOTES.md)

FUSED_MERGE = True
"""Merge the partial results in the split kernel's epilogue; False merges them in a second launch (A/B runs).

Both paths run the same merge code (``_lse_merge``); results differ at most in the order of the sums."""
FUSED_MERGE_MAX_STEPS = 2
"""Most load steps of the epilogue's merge, one after another, each of as many splits as fit in
``MERGE_TILE_ELEMENTS_PER_THREAD`` values per thread (none fitting: no epilogue merge).

Past it the second launch's programs, one per row, merge faster than one program per row block
(grouped heads with many splits: benchmarks/NOTES.md, note 12)."""
MERGE_TILE_ELEMENTS_PER_THREAD = 32  # per step of the epilogue's merge; 64 takes the kernel to 255 registers (sm_90)
COUNTER_ARENA_SLOTS = 1 << 16  # arrival counters zeroed at once per device (256 KiB)
COUNTER_REGION_SLOTS = 1 << 10  # the fewest counters a stream is given


def choose_num_splits(
    batch_heads: int, key_tiles: int, num_sms: int, *, programs_per_sm: int = 2,
    split_overhead_tiles: float = 1.0, merge_overhead_tiles: float = MERGE_OVERHEAD_TILES,
    max_splits: int = MAX_SPLITS, tiles_per_sequence: Sequence[int] | None = None,
) -> int:
    """Number of splits of ``key_tiles`` (the longest sequence's tiles); 1 means no split.

    ``batch_heads`` counts the (sequence, KV head, row block) triples; ``tiles_per_sequence`` gives
    each sequence's own tiles when they differ (padded keys), else every sequence has ``key_tiles``.
    Splitting into ``S`` pieces of ``p = ceil(key_tiles / S)`` tiles keeps ``busy(S)`` programs
    working (a sequence of ``t`` tiles fills ``ceil(t / p)`` pieces; the rest exit at once), and
    ``num_sms · programs_per_sm`` programs run at a time (a wave). When ``batch_heads`` alone fills
    a wave the grid is already full: no split. Otherwise the modelled time is
    ``ceil(busy(S) / wave) · (p + split_overhead_tiles) + merge_overhead_tiles``, the two overheads
    counted in one program's tile loads: a program's own fixed cost (its start, writing its partial
    output) and the merge launch, paid once by every split call. The answer is the fewest splits
    within ``SPLIT_SLACK`` (5%) of the best time, so that near-ties buy no extra merge work. Never
    more splits than tiles.
    """
    if batch_heads <= 0 or key_tiles <= 1 or num_sms <= 0:
        return 1
    if batch_heads >= num_sms * max(1, programs_per_sm):
        return 1
    lengths = tuple(tiles_per_sequence) if tiles_per_sequence else (key_tiles,)
    return _modelled_best(batch_heads, key_tiles, num_sms, programs_per_sm, split_overhead_tiles, merge_overhead_tiles,
                          max_splits, lengths)


@functools.lru_cache(maxsize=4096)  # decoding asks again on every step, and the tile counts move slowly
def _modelled_best(batch_heads: int, key_tiles: int, num_sms: int, programs_per_sm: int, split_overhead_tiles: float,
                   merge_overhead_tiles: float, max_splits: int, lengths: tuple[int, ...]) -> int:
    slots = num_sms * max(1, programs_per_sm)
    splits = np.arange(1, min(max_splits, key_tiles) + 1)
    piece = -(-key_tiles // splits)
    pieces = np.maximum(1, -(-np.asarray(lengths)[None, :] // piece[:, None])).sum(axis=1)  # per sequence, summed
    busy = batch_heads / len(lengths) * pieces
    waves = np.ceil(busy / slots - 1e-9)
    costs = waves * (piece + split_overhead_tiles) + np.where(splits > 1, merge_overhead_tiles, 0.0)
    return int(splits[np.argmax(costs <= costs.min() * (1 + SPLIT_SLACK))])


@dataclass(frozen=True)
class SplitKConfig:
    """Tile sizes and launch parameters of one call."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (4 for the CPU, where kernels run under the interpreter)."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def default_config(rows: int, head_dim: int, head_dim_v: int, device: torch.device) -> SplitKConfig:
    """Tiles for ``rows`` packed query rows (group heads × queries); small key tiles under the interpreter."""
    widest = max(head_dim, head_dim_v)
    block_m = min(tile_size(rows), 128 if widest <= 128 else 64)
    if device.type != "cuda":
        return SplitKConfig(block_m, 16, 4, 1)
    block_n = 64 if widest <= 128 else 32
    return SplitKConfig(block_m, block_n, 4 if block_m <= 64 else 8, 4)  # 4 stages: measured best on H200


class _ArrivalCounters:
    """Int32 arrival counters of the fused merge: a launch uses one per (sequence, KV head, row block).

    A counter is 0 between launches: the last program to arrive sets it back (self-resetting), so
    nothing ever clears them, and eager calls and calls captured in CUDA graphs on one stream share
    them safely, their kernels running one after another. Each (device, stream) has its own
    counters, so launches on concurrent streams never meet (graphs captured on one stream share
    its counters: replay them one at a time). Counters come from per-device arenas zeroed outside
    any capture; the stream of a capture gets zeroed ones too (``torch.cuda.graph`` synchronizes
    the device before it captures, so the zeroing is done). A stream that needs more counters gets a
    new, larger region; no counter is freed or handed out twice, since a captured graph may still
    use it. No allocation depends on data and nothing syncs with the host.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._regions: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._arenas: dict[torch.device, list[_Arena]] = {}  # every arena stays alive

    def get(self, device: torch.device, slots: int) -> torch.Tensor | None:
        """``slots`` zero counters for the current stream of ``device``; None in a capture that finds none free."""
        stream = current_stream(device) if device.type == "cuda" else 0
        region = self._regions.get((device, stream))
        if region is not None and region.numel() >= slots:
            return region
        grown = max(slots, COUNTER_REGION_SLOTS, 2 * region.numel() if region is not None else 0)
        with self._lock:
            return self._new_region(device, stream, grown)

    def _new_region(self, device: torch.device, stream: int, slots: int) -> torch.Tensor | None:
        capturing = False
        if device.type == "cuda":
            with torch.cuda.device(device):
                capturing = torch.cuda.is_current_stream_capturing()
        arenas = self._arenas.setdefault(device, [])
        if not arenas or arenas[-1].used + slots > arenas[-1].zeros.numel():
            if capturing:  # zeros made now would be written only when the graph replays
                return None
            arenas.append(_Arena(device, stream, max(COUNTER_ARENA_SLOTS, 4 * slots)))
        arena = arenas[-1]
        if arena.zeroed is not None and arena.stream != stream and not capturing:
            torch.cuda.current_stream(device).wait_event(arena.zeroed)
        region = arena.zeros[arena.used:arena.used + slots]
        arena.used += slots
        self._regions[(device, stream)] = region
        return region


class _Arena:
    """Zeroed int32 counters of one device, handed out to streams in regions from ``used`` on."""

    def __init__(self, device: torch.device, stream: int, slots: int):
        self.zeros = torch.zeros(slots, dtype=torch.int32, device=device)
        self.stream, self.used, self.zeroed = stream, 0, None
        if device.type == "cuda":  # other streams wait for the zeroing
            self.zeroed = torch.cuda.Event()
            self.zeroed.record(torch.cuda.current_stream(device))


_COUNTERS = _ArrivalCounters()


def arrival_counters(device: torch.device, slots: int) -> torch.Tensor | None:
    """The fused merge's arrival counters for the current stream of ``device`` (see :class:`_ArrivalCounters`)."""
    return _COUNTERS.get(device, slots)


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
    float32) receive the per-split results when ``S > 1``. All are allocated when not given. The
    split kernel merges the per-split results itself when ``FUSED_MERGE`` allows, else a second
    launch does (:func:`merge_partials_triton`).
    """
    q, k, v, spec = inp.q, inp.k, inp.v, inp.spec
    B, Hq, Mq, D = q.shape
    Hkv, Mk, Dv, G = k.shape[1], k.shape[2], v.shape[3], inp.groups
    dev = q.device
    if out is None:
        out = torch.empty((B, Hq, Mq, Dv), dtype=q.dtype, device=dev)
    if lse is None:
        lse = torch.empty((B, Hq, Mq), dtype=torch.float32, device=dev)
    if B == 0 or Hq == 0 or Mq == 0:
        return out, lse
    segments = spec.q_seqstart is not None
    qs = spec.host.q_seqstart if segments else (0, Mq)
    Z = len(qs) - 1 if segments else B
    if Mk == 0 or Z == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse

    mq_stride = max([b - a for a, b in zip(qs, qs[1:])] + [1])
    rows = G * mq_stride
    head_dim, head_dim_v = tile_size(D), tile_size(Dv)
    cfg = config or default_config(rows, head_dim, head_dim_v, dev)
    row_blocks = cdiv(rows, cfg.block_m)
    bound, lengths = _key_bounds(inp, mq_stride)
    key_tiles = cdiv(bound, cfg.block_n) + 1  # + 1: a range need not start on a tile boundary
    if num_splits is None:
        tile_bytes = cfg.block_n * (head_dim + head_dim_v) * q.element_size()
        smem = max(cfg.num_stages - 1, 1) * tile_bytes  # tiles in flight while one is consumed
        num_splits = choose_num_splits(
            Z * Hkv * row_blocks, key_tiles, num_sms(dev),
            programs_per_sm=max(1, min(4, (200 * 1024) // smem)),
            split_overhead_tiles=1.0 + min(rows, cfg.block_m) * Dv * 8 / tile_bytes,
            tiles_per_sequence=None if lengths is None else [cdiv(n, cfg.block_n) + 1 for n in lengths],
        )
        num_splits = cdiv(key_tiles, cdiv(key_tiles, num_splits))
    tiles_per_split = cdiv(key_tiles, num_splits)

    grid = (Z * Hkv * row_blocks, num_splits)
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
    merge_rows = min(cfg.block_m, next_power_of_2(rows))  # the rows of a row block that can be valid
    per_step = MERGE_TILE_ELEMENTS_PER_THREAD * 32 * cfg.num_warps // (merge_rows * head_dim_v)  # splits
    merge_block_s = min(next_power_of_2(num_splits), max(1, per_step))
    counters = None
    if FUSED_MERGE and num_splits > 1 and per_step >= 1 and cdiv(num_splits, merge_block_s) <= FUSED_MERGE_MAX_STEPS:
        counters = arrival_counters(dev, grid[0])
    if counters is not None:
        final, sf, sg = (out, lse, counters), tuple(out.stride()), tuple(lse.stride())
    else:
        final, sf, sg = (q, q, q), (0, 0, 0, 0), (0, 0, 0)
        merge_rows = merge_block_s = 1

    add = spec.additive
    slopes = spec.alibi_slopes
    sa = _strides4(add)
    ss = (0, 0) if slopes is None else tuple(0 if n == 1 else s for n, s in zip(slopes.shape, slopes.stride()))
    band_per_segment = spec.band_lo is not None and spec.band_lo.numel() > 1
    placeholder = spec.kv_seqlens if spec.kv_seqlens is not None else q
    _split[grid](
        q, k, v, o_buf, l_buf,
        placeholder, spec.q_seqstart if segments else q, spec.k_seqstart if segments else q,
        spec.k_seqlen if segments else q,
        spec.band_lo if spec.band_lo is not None else q, spec.band_hi if spec.band_hi is not None else q,
        add if add is not None else q, slopes if slopes is not None else q, *final,
        inp.scale * LOG2E, spec.alibi_shift,
        *q.stride(), *k.stride(), *v.stride(), *so, *sl, *sa, *ss, *sf, *sg,
        Hkv, Mq, Mk, D, Dv, G, row_blocks, num_splits, tiles_per_split, mq_stride,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
        HAS_KV_LEN=spec.kv_seqlens is not None and not segments, HAS_SEGMENTS=segments,
        HAS_BAND=spec.band_lo is not None, BAND_PER_SEGMENT=band_per_segment,
        HAS_ADDITIVE=add is not None, HAS_ALIBI=slopes is not None,
        EVEN_D=head_dim == D, EVEN_DV=head_dim_v == Dv,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FUSED_MERGE=counters is not None, MERGE_ROWS=merge_rows, MERGE_BLOCK_S=merge_block_s,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1 and counters is None:
        merge_partials_triton(o_buf, l_buf, out=out, lse=lse)
    if segments and (qs[0] > 0 or qs[-1] < Mq):  # rows outside every segment see nothing
        for rows_ in (slice(0, qs[0]), slice(qs[-1], Mq)):
            out[:, :, rows_] = 0
            lse[:, :, rows_] = float("-inf")
    return out, lse


def merge_partials_triton(
    outs: torch.Tensor, lses: torch.Tensor, out_dtype: torch.dtype | None = None, *,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path of :func:`biasattn.ops.merge.merge_partials` (forward only, no autograd).

    ``outs [S, ..., M, Dv]``, ``lses [S, ..., M]`` → ``(out [..., M, Dv], lse [..., M] float32)``.
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
    block_d = min(128, next_power_of_2(Dv))
    block_s = min(32, next_power_of_2(S))
    _merge[(R, cdiv(Dv, block_d))](
        parts, part_lse, out2, lse1, S, Dv,
        *parts.stride(), *part_lse.stride(), *out2.stride(), lse1.stride(0),
        BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4 if block_s * block_d >= 2048 else 2,
    )
    return out, lse
