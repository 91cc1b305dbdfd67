"""The forward of dense and causal attention at head dim 128 on Hopper, warp-specialized in Gluon.

``triton.language`` cannot split a kernel into producer and consumer warps; Gluon
(``triton.experimental.gluon``, shipped with Triton) can. In this kernel one loader warp feeds Q and
a ring of three 128-key K/V stages through TMA copies and mbarriers. Two consumer warpgroups each
take a 64-row half of a 128-row query tile and take turns issuing their warpgroup MMAs. Each issues
the scores of key tile j before the value product of tile j-1, and runs the softmax of tile j while
that product runs. On the H200 it runs these forwards 1.10-1.15× faster than the ``triton.language``
kernel, at 0.97-1.04× cuDNN's time (``docs/design.md``, "Gluon's by hand reaches cuDNN").

:func:`eligible` says which calls take it: sm_90, fp16/bf16, D = Dv = 128, Mq = Mk a multiple of
128, contiguous ``[B, H, M, D]`` tensors, no bias or a causal mask, no dropout, and at least
``gluon_min_scores`` scores (its launch goes through Triton's own binding, tens of microseconds of
host time). Everything else, and every backward, runs the ``triton.language``
kernels. This module is imported on the first eligible call only.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROWS = 64  # query rows of each consumer warpgroup
BLOCK_N = 128  # keys per tile
STAGES = 3  # K/V tiles in flight
CONSUMER_REGS = 240  # registers per consumer thread (the loader warp takes 24)
LOG2E = 1.4426950408889634


@gluon.jit
def _load(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bars, k_ready, v_ready, kv_empty, row_q, row_k, n_tiles):
    """The loader partition: both halves of the query tile, then the K/V tiles into the ring, each stage
    refilled once both consumers released it."""
    HALF: gl.constexpr = q_desc.block_type.shape[0]
    TILE: gl.constexpr = k_desc.block_type.shape[0]
    RING: gl.constexpr = k_bufs.type.shape[0]
    for h in gl.static_range(2):
        qb = q_bars.index(h)
        mbarrier.expect(qb, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row_q + h * HALF, 0], qb, q_smem.index(h))
    for j in range(n_tiles):
        s = j % RING
        mbarrier.wait(kv_empty.index(s), ((j // RING) & 1) ^ 1)
        kr = k_ready.index(s)
        mbarrier.expect(kr, k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row_k + j * TILE, 0], kr, k_bufs.index(s))
        vr = v_ready.index(s)
        mbarrier.expect(vr, v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row_k + j * TILE, 0], vr, v_bufs.index(s))


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, row_o: gl.constexpr):
    """Online softmax of one score tile: ``(p, new row max, new row sum, rescale of the output rows)``."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, gl.convert_layout(alpha, row_o)


@gluon.jit
def _causal_mask(s, col0, row0, s_layout: gl.constexpr):
    """Scores of keys past their row's position hidden; rows from ``row0``, keys from ``col0``."""
    rows = row0 + gl.arange(0, s.type.shape[0], layout=gl.SliceLayout(1, s_layout))
    cols = col0 + gl.arange(0, s.type.shape[1], layout=gl.SliceLayout(0, s_layout))
    return gl.where(cols[None, :] <= rows[:, None], s, float("-inf"))


@gluon.jit
def _attend(q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, n_tiles, qk_scale, my_turn, their_turn,
            row0, CAUSAL: gl.constexpr):
    """One consumer's rows against its key tiles: ``(out, row max, row sum)``, out normalized. With
    ``CAUSAL`` the last key tile is the diagonal one and its scores are masked (rows from ``row0``)."""
    HALF: gl.constexpr = q_smem.type.shape[0]
    TILE: gl.constexpr = k_bufs.type.shape[1]
    HEAD_DIM: gl.constexpr = k_bufs.type.shape[2]
    RING: gl.constexpr = k_bufs.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype
    m_i = gl.full([HALF], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.full([HALF], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([HALF, HEAD_DIM], gl.float32, layout=o_layout)
    zero_s = gl.zeros([HALF, TILE], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    mbarrier.wait(my_turn, 0)
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.arrive(their_turn, count=1)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    if CAUSAL:
        if n_tiles == 1:
            s = _causal_mask(s, 0, row0, s_layout)
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, row_o)
    for j in range(1, n_tiles):
        st = j % RING
        prev = (j - 1) % RING
        mbarrier.wait(k_ready.index(st), (j // RING) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // RING) & 1)
        mbarrier.wait(my_turn, j & 1)
        s = warpgroup_mma(q_smem, k_bufs.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_bufs.index(prev), acc, is_async=True)
        mbarrier.arrive(their_turn, count=1)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        if CAUSAL:
            if j == n_tiles - 1:
                s = _causal_mask(s, j * TILE, row0, s_layout)
        p, m_new, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, row_o)
        m_i = m_new
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(kv_empty.index(prev), count=1)
        acc = acc * alpha[:, None]
    last = (n_tiles - 1) % RING
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // RING) & 1)
    mbarrier.wait(my_turn, n_tiles & 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_bufs.index(last), acc, is_async=True)
    mbarrier.arrive(their_turn, count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    l_o = gl.convert_layout(l_i, row_o)
    return acc / l_o[:, None], gl.convert_layout(m_i, row_o), l_o


@gluon.jit
def _write(out, m_o, l_o, o_desc, o_buf, Lse, row):
    """Store one consumer's rows: ``out`` through TMA and the natural-log lse, NaN for a row whose output
    holds a NaN or inf (the exact pass of the ``triton`` forward computes such rows again)."""
    o_buf.store(out.to(o_buf.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row, 0], o_buf)
    lse = (m_o + gl.log2(l_o)) * 0.6931471805599453
    lse = gl.where(gl.abs(gl.sum(out, 1)) < float("inf"), lse, float("nan"))
    gl.store(Lse + row + gl.arange(0, o_buf.type.shape[0], layout=m_o.type.layout), lse)
    tma.store_wait(0)


@gluon.jit
def _consume(q_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Lse, row_q, row0, n_tiles, qk_scale,
             CAUSAL: gl.constexpr, PART: gl.constexpr):
    """Consumer ``PART`` (0 or 1): its half of the query tile, written out through its query buffer, free
    once its last score product has run."""
    q_bars, k_ready, v_ready, kv_empty, turns = bars
    HALF: gl.constexpr = q_desc.block_type.shape[0]
    out, m_o, l_o = _attend(q_smem.index(PART), k_bufs, v_bufs, q_bars.index(PART), k_ready, v_ready, kv_empty,
                            n_tiles, qk_scale, turns.index(PART), turns.index(1 - PART), row0 + PART * HALF, CAUSAL)
    _write(out, m_o, l_o, o_desc, q_smem.index(PART), Lse, row_q + PART * HALF)


# The partitions: worker partitions take the same arguments and no constexpr, so each mask and half has its own.
@gluon.jit
def _first(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Lse, row_q, row_k, row0, n_tiles, qk_scale):
    _consume(q_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Lse, row_q, row0, n_tiles, qk_scale, False, 0)


@gluon.jit
def _second(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Lse, row_q, row_k, row0, n_tiles, qk_scale):
    _consume(q_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Lse, row_q, row0, n_tiles, qk_scale, False, 1)


@gluon.jit
def _first_causal(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Lse, row_q, row_k, row0, n_tiles,
                  qk_scale):
    _consume(q_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Lse, row_q, row0, n_tiles, qk_scale, True, 0)


@gluon.jit
def _second_causal(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Lse, row_q, row_k, row0, n_tiles,
                   qk_scale):
    _consume(q_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Lse, row_q, row0, n_tiles, qk_scale, True, 1)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Lse, row_q, row_k, row0, n_tiles, qk_scale):
    q_bars, k_ready, v_ready, kv_empty, turns = bars
    _load(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bars, k_ready, v_ready, kv_empty, row_q, row_k, n_tiles)


@gluon.jit
def _attn_fwd_ws_kernel(q_desc, k_desc, v_desc, o_desc, Lse, M, H, G, qk_scale, RING: gl.constexpr,
                        REGS: gl.constexpr, CAUSAL: gl.constexpr):
    """Grid ``(M / 128, B * H)``. Q/out are ``[B·H·M, D]`` views and K/V ``[B·Hkv·M, D]`` (``G`` query heads
    per KV head); writes out and ``Lse [B·H·M]``. Causal programs start from the longest rows."""
    HALF: gl.constexpr = q_desc.block_type.shape[0]
    TILE: gl.constexpr = k_desc.block_type.shape[0]
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
        n_tiles = pid_m + 1
    else:
        pid_m = gl.program_id(0)
        n_tiles = M // TILE
    bh = gl.program_id(1)
    row0 = pid_m * 2 * HALF
    row_q = bh * M + row0
    row_k = ((bh // H) * (H // G) + (bh % H) // G) * M
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [RING] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [RING] + k_desc.block_type.shape, k_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(turns.index(i), count=1)
    mbarrier.arrive(turns.index(0), count=1)  # the first half issues first
    for i in gl.static_range(RING):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    bars = (q_bars, k_ready, v_ready, kv_empty, turns)
    args = (q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, bars, Lse, row_q, row_k, row0, n_tiles, qk_scale)
    if CAUSAL:
        gl.warp_specialize([(_first_causal, args), (_second_causal, args), (_loader, args)], [4, 1], [REGS, 24])
    else:
        gl.warp_specialize([(_first, args), (_second, args), (_loader, args)], [4, 1], [REGS, 24])


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scores: int, min_scores: int) -> bool:
    """Whether this kernel can run a forward on these tensors (see the module doc; the caller checks the
    device and the bias): ``scores``, what the call computes, at least the option's ``min_scores``."""
    B, H, M, D = q.shape
    if D != 128 or k.shape[2] != M or k.shape[3] != 128 or v.shape[3] != 128 or M % (2 * ROWS) or scores < min_scores:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()) or B * H * M >= 2**31:
        return False
    return all(t.data_ptr() % 16 == 0 for t in (q, k, v))


def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, qk_scale: float,
             causal: bool) -> None:
    """Write ``out [B, H, M, 128]`` (contiguous) and ``lse [B, H, M]`` (float32, natural log; NaN where a row's
    output is not finite) of an :func:`eligible` call; ``qk_scale`` is the softmax scale times log2(e)."""
    B, H, M, D = q.shape
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    half = gl.NVMMASharedLayout.get_default_for([ROWS, D], gdt)
    tile = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gdt)
    descs = []
    for t, block, layout in ((q, ROWS, half), (k, BLOCK_N, tile), (v, BLOCK_N, tile), (out, ROWS, half)):
        rows = t.view(-1, D)
        descs.append(TensorDescriptor(rows, list(rows.shape), [D, 1], [block, D], layout))
    _attn_fwd_ws_kernel[(M // (2 * ROWS), B * H)](*descs, lse, M, H, H // k.shape[1], qk_scale, STAGES, CONSUMER_REGS,
                                                  causal, num_warps=4)
