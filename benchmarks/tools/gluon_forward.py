"""Warp-specialized Hopper attention forward in Gluon (``triton.experimental.gluon``, shipped with Triton 3.6).

Dense attention without a bias, sequence lengths a multiple of the tiles, ``[B, H, M, D]`` contiguous
fp16/bf16 inputs, sm_90: a measurement of what producer/consumer warp specialization gives on Hopper
against the ``triton`` forward, not an operator.

- ``attention_ws``: one loader warp feeds Q and a ring of K/V tiles through TMA and mbarriers; the
  default partition (two warpgroups, one 128-row query tile) issues the scores of key tile j before
  the value product of tile j-1 and runs the softmax of tile j while that product runs.
- ``attention_pingpong``: the same loop in two independent consumer warpgroups, each with its own
  64-row half of the query tile, sharing the K/V ring; with ``ALTERNATE`` they take turns issuing their
  products (mbarriers between them). Where a ring of ``STAGES`` K/V tiles leaves no room for output
  buffers (three 128-key stages at D=128, any ring at D=256), the output leaves through the query buffers.

    PYTHONPATH=. python benchmarks/tools/gluon_forward.py            # the fastest variants; --all for every one
"""
import functools

import torch
import triton
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

LOG2E = 1.4426950408889634


@gluon.jit
def _load(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bars, k_ready, v_ready, kv_empty, row_q, row_k, n_tiles):
    """The loader partition: the query tile's parts (one per consumer), then K/V tiles into the ring of
    ``STAGES`` buffers, each stage reused once every consumer released it."""
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    PARTS: gl.constexpr = q_smem.type.shape[0]
    for h in gl.static_range(PARTS):
        qb = q_bars.index(h)
        mbarrier.expect(qb, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row_q + h * ROWS, 0], qb, q_smem.index(h))
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        kr = k_ready.index(s)
        mbarrier.expect(kr, k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row_k + j * BLOCK_N, 0], kr, k_bufs.index(s))
        vr = v_ready.index(s)
        mbarrier.expect(vr, v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row_k + j * BLOCK_N, 0], vr, v_bufs.index(s))


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
    """Scores of keys past their row's position hidden (top-left causal); rows and keys from ``row0``, ``col0``."""
    rows = row0 + gl.arange(0, s.type.shape[0], layout=gl.SliceLayout(1, s_layout))
    cols = col0 + gl.arange(0, s.type.shape[1], layout=gl.SliceLayout(0, s_layout))
    return gl.where(cols[None, :] <= rows[:, None], s, float("-inf"))


@gluon.jit
def _attend(q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, n_tiles, qk_scale, my_turn, their_turn,
            causal, row0, WARPS: gl.constexpr, ALTERNATE: gl.constexpr):
    """One consumer's rows against every key tile: ``(out, row max, row sum)``, out normalized. The scores of
    tile j are issued before the value product of tile j-1, and the softmax of tile j runs while that
    product does; with ``ALTERNATE`` the consumer issues its products only on its turn. With ``causal``
    the last key tile is the diagonal one, its scores masked (rows from ``row0``)."""
    ROWS: gl.constexpr = q_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
    HEAD_DIM: gl.constexpr = k_bufs.type.shape[2]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    if ALTERNATE:
        mbarrier.wait(my_turn, 0)
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if ALTERNATE:
        mbarrier.arrive(their_turn, count=1)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    if causal:
        if n_tiles == 1:
            s = _causal_mask(s, 0, row0, s_layout)
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, row_o)
    for j in range(1, n_tiles):
        st = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        if ALTERNATE:
            mbarrier.wait(my_turn, j & 1)
        s = warpgroup_mma(q_smem, k_bufs.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_bufs.index(prev), acc, is_async=True)
        if ALTERNATE:
            mbarrier.arrive(their_turn, count=1)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        if causal:
            if j == n_tiles - 1:
                s = _causal_mask(s, j * BLOCK_N, row0, s_layout)
        p, m_new, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, row_o)
        m_i = m_new
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(kv_empty.index(prev), count=1)
        acc = acc * alpha[:, None]
    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    if ALTERNATE:
        mbarrier.wait(my_turn, n_tiles & 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_bufs.index(last), acc, is_async=True)
    if ALTERNATE:
        mbarrier.arrive(their_turn, count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    l_o = gl.convert_layout(l_i, row_o)
    return acc / l_o[:, None], gl.convert_layout(m_i, row_o), l_o


@gluon.jit
def _write(out, m_o, l_o, o_desc, o_buf, Lse, row):
    """Store one consumer's rows: ``out`` through TMA, the natural-log lse by pointers."""
    o_buf.store(out.to(o_buf.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row, 0], o_buf)
    rows = row + gl.arange(0, o_buf.type.shape[0], layout=m_o.type.layout)
    gl.store(Lse + rows, (m_o + gl.log2(l_o)) * 0.6931471805599453)
    tma.store_wait(0)


@gluon.jit
def _buffers(q_desc, k_desc, STAGES: gl.constexpr, PARTS: gl.constexpr):
    """Shared buffers and barriers: ``PARTS`` query parts, a ring of ``STAGES`` K/V tiles, and the barriers
    ``(query parts loaded, K ready, V ready, K/V stage free, consumers' turns)``."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [PARTS] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [PARTS, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [PARTS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(PARTS):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(turns.index(i), count=1)
    mbarrier.arrive(turns.index(0), count=1)  # the first part issues first
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=PARTS)
    return q_smem, k_bufs, v_bufs, (q_bars, k_ready, v_ready, kv_empty, turns)


@gluon.jit
def _ws_loader(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, bars, row_q, row_k, n_tiles):
    q_bars, k_ready, v_ready, kv_empty, turns = bars
    _load(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bars, k_ready, v_ready, kv_empty, row_q, row_k, n_tiles)


@gluon.jit
def _ws_consumer(q_smem, k_bufs, v_bufs, bars, n_tiles, qk_scale, WARPS: gl.constexpr):
    q_bars, k_ready, v_ready, kv_empty, turns = bars
    return _attend(q_smem.index(0), k_bufs, v_bufs, q_bars.index(0), k_ready, v_ready, kv_empty, n_tiles, qk_scale,
                   turns.index(0), turns.index(0), False, 0, WARPS, False)


@gluon.jit
def _attn_fwd_ws(q_desc, k_desc, v_desc, o_desc, Lse, M, qk_scale, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Grid ``(M / BLOCK_M, B * H)``: one query tile per program, in the default partition."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    row_q = gl.program_id(1) * M + gl.program_id(0) * BLOCK_M
    row_k = gl.program_id(1) * M
    n_tiles = M // k_desc.block_type.shape[0]
    q_smem, k_bufs, v_bufs, bars = _buffers(q_desc, k_desc, STAGES, 1)
    out, m_o, l_o = gl.warp_specialize([
        (_ws_consumer, (q_smem, k_bufs, v_bufs, bars, n_tiles, qk_scale, num_warps)),
        (_ws_loader, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, bars, row_q, row_k, n_tiles)),
    ], [1], [24])
    o_buf = gl.allocate_shared_memory(o_desc.dtype, o_desc.block_type.shape, o_desc.layout)
    _write(out, m_o, l_o, o_desc, o_buf, Lse, row_q)


@gluon.jit
def _pp_part(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, o_smem, bars, Lse, row_q, row_k, n_tiles,
             qk_scale, flags, PART: gl.constexpr):
    """Consumer ``PART`` (0 or 1): its 64-row part of the query tile, then its output."""
    q_bars, k_ready, v_ready, kv_empty, turns = bars
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    if o_smem.type.shape[0] == 2:
        o_buf = o_smem.index(PART)
    else:  # the output goes through the part's query buffer, free once its last score product has run
        o_buf = q_smem.index(PART)
    alternate, causal = flags
    row0 = row_q - row_k + PART * ROWS  # the part's first row in its sequence
    if alternate:
        out, m_o, l_o = _attend(q_smem.index(PART), k_bufs, v_bufs, q_bars.index(PART), k_ready, v_ready, kv_empty,
                                n_tiles, qk_scale, turns.index(PART), turns.index(1 - PART), causal, row0, 4, True)
    else:
        out, m_o, l_o = _attend(q_smem.index(PART), k_bufs, v_bufs, q_bars.index(PART), k_ready, v_ready, kv_empty,
                                n_tiles, qk_scale, turns.index(PART), turns.index(1 - PART), causal, row0, 4, False)
    _write(out, m_o, l_o, o_desc, o_buf, Lse, row_q + PART * ROWS)


@gluon.jit
def _pp_first(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, o_smem, bars, Lse, row_q, row_k, n_tiles,
              qk_scale, flags):
    _pp_part(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, o_smem, bars, Lse, row_q, row_k, n_tiles,
             qk_scale, flags, 0)


@gluon.jit
def _pp_second(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, o_smem, bars, Lse, row_q, row_k, n_tiles,
               qk_scale, flags):
    _pp_part(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, o_smem, bars, Lse, row_q, row_k, n_tiles,
             qk_scale, flags, 1)


@gluon.jit
def _pp_loader(q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, o_smem, bars, Lse, row_q, row_k, n_tiles,
               qk_scale, flags):
    q_bars, k_ready, v_ready, kv_empty, turns = bars
    _load(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bars, k_ready, v_ready, kv_empty, row_q, row_k, n_tiles)


@gluon.jit
def _attn_fwd_pingpong(q_desc, k_desc, v_desc, o_desc, Lse, M, qk_scale, STAGES: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, ALTERNATE: gl.constexpr, CAUSAL: gl.constexpr):
    """Grid ``(M / 128, B * H)``: two consumer warpgroups (default partition and a worker) on 64-row parts."""
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    if CAUSAL:  # the longest rows first; their last key tile is the diagonal one (128-key tiles)
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
        n_tiles = pid_m + 1
    else:
        pid_m = gl.program_id(0)
        n_tiles = M // k_desc.block_type.shape[0]
    row_q = gl.program_id(1) * M + pid_m * 2 * ROWS
    row_k = gl.program_id(1) * M
    q_smem, k_bufs, v_bufs, bars = _buffers(q_desc, k_desc, STAGES, 2)
    # the output reuses Q's buffers where a buffer of its own would not fit beside the K/V ring
    O_BUFS: gl.constexpr = 2 if q_desc.block_type.shape[1] <= 128 and STAGES * k_desc.block_type.shape[0] <= 256 else 1
    o_smem = gl.allocate_shared_memory(o_desc.dtype, [O_BUFS] + o_desc.block_type.shape, o_desc.layout)
    args = (q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, o_smem, bars, Lse, row_q, row_k, n_tiles, qk_scale,
            (ALTERNATE, CAUSAL))
    gl.warp_specialize([(_pp_first, args), (_pp_second, args), (_pp_loader, args)], [4, 1], [CONSUMER_REGS, 24])


def _descriptors(q, k, v, out, rows: int, block_n: int):
    B, H, M, D = q.shape
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    lay_m = gl.NVMMASharedLayout.get_default_for([rows, D], gdt)
    lay_n = gl.NVMMASharedLayout.get_default_for([block_n, D], gdt)
    descs = []
    for t, block, lay in ((q, rows, lay_m), (k, block_n, lay_n), (v, block_n, lay_n), (out, rows, lay_m)):
        t2 = t.view(B * H * M, D)
        descs.append(TensorDescriptor(t2, list(t2.shape), list(t2.stride()), [block, D], lay))
    return descs


def _check(q, k, v, rows: int, block_n: int) -> None:
    M = q.shape[2]
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and M % rows == 0 and M % block_n == 0):
        raise ValueError(f"q, k, v must be contiguous [B, H, M, D] with M a multiple of {rows} and {block_n}, "
                         f"got M={M}")


def attention_ws(q, k, v, BLOCK_M=128, BLOCK_N=128, STAGES=2, num_warps=8):
    """``(out, lse)`` of dense attention, one consumer partition of ``num_warps`` warps per query tile."""
    _check(q, k, v, BLOCK_M, BLOCK_N)
    B, H, M, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((B, H, M), device=q.device, dtype=torch.float32)
    qd, kd, vd, od = _descriptors(q, k, v, out, BLOCK_M, BLOCK_N)
    _attn_fwd_ws[(M // BLOCK_M, B * H)](qd, kd, vd, od, lse, M, D ** -0.5 * LOG2E, STAGES, num_warps=num_warps)
    return out, lse


def attention_pingpong(q, k, v, BLOCK_N=128, STAGES=2, CONSUMER_REGS=240, ALTERNATE=False, CAUSAL=False):
    """``(out, lse)`` of dense (or top-left causal, square) attention, two consumer warpgroups on 64-row parts
    of each 128-row query tile."""
    _check(q, k, v, 128, BLOCK_N)
    if CAUSAL and BLOCK_N != 128:
        raise ValueError(f"the causal variant takes 128-key tiles, got BLOCK_N={BLOCK_N}")
    B, H, M, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((B, H, M), device=q.device, dtype=torch.float32)
    qd, kd, vd, od = _descriptors(q, k, v, out, 64, BLOCK_N)
    _attn_fwd_pingpong[(M // 128, B * H)](qd, kd, vd, od, lse, M, D ** -0.5 * LOG2E, STAGES, CONSUMER_REGS, ALTERNATE,
                                         CAUSAL, num_warps=4)
    return out, lse


def _point(D: int, M: int, causal: bool, variants: dict, rounds: int) -> None:
    """One head dim, sequence length and mask: each variant's error against float64, then forward times."""
    import statistics

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import biasattn as ba

    H, B = 16, 16384 // M
    q, k, v = (torch.randn(B, H, M, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qr, kr, vr = (t[:1, :2].double() for t in (q, k, v))
    s = qr @ kr.transpose(-1, -2) * D ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(M, M, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    ref, ref_lse = torch.softmax(s, -1) @ vr, torch.logsumexp(s, -1)

    def sdpa(backend):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    case = "causal" if causal else "no bias"
    e_cudnn = (sdpa(SDPBackend.CUDNN_ATTENTION)[:1, :2].double() - ref).abs().max().item()
    for name, f in variants.items():
        out, lse = f(q, k, v)
        e = (out[:1, :2].double() - ref).abs().max().item()
        e_lse = (lse[:1, :2].double() - ref_lse).abs().max().item()
        print(f"D={D} M={M} {case} {name}: max error {e:.2e} (cuDNN {e_cudnn:.2e}), lse {e_lse:.1e}")
    fns = {name: functools.partial(f, q, k, v) for name, f in variants.items()}
    fns["triton (biasattn)"] = functools.partial(ba.attention, q, k, v, ba.LowerTriangularMask() if causal else None,
                                                 op="triton")
    fns["sdpa cudnn"] = functools.partial(sdpa, SDPBackend.CUDNN_ATTENTION)
    fns["sdpa flash"] = functools.partial(sdpa, SDPBackend.FLASH_ATTENTION)
    times = {}
    for _ in range(rounds):
        for name, f in fns.items():
            times.setdefault(name, []).append(triton.testing.do_bench(f, warmup=50, rep=300))
    ref_t = statistics.median(times["triton (biasattn)"])
    flops = 4 * B * H * D * (M * (M + 1) // 2 if causal else M * M)
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"  D={D} M={M} {case} {name:30s} {t:7.3f} ms {flops / t / 1e9:5.0f} TFLOP/s "
              f"triton time / this {ref_t / t:.3f}")


def main(argv=None) -> int:
    """Errors against float64 and forward TFLOP/s beside the ``triton`` operator and SDPA's cuDNN and flash."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", type=int, nargs="+", default=[128, 256])
    p.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--cases", nargs="+", default=["none", "causal"], choices=["none", "causal"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--all", action="store_true", help="every variant, not only the fastest at each head dim")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "bf16, H=16, B*M=16k, forward")
    for D in args.head_dims:
        for case in args.cases:
            causal = case == "causal"
            variants = {}
            if D <= 128 and not causal and args.all:
                variants["ws 128x128 s2"] = functools.partial(attention_ws, BLOCK_M=128, BLOCK_N=128, STAGES=2, num_warps=8)
            rings = ((64, 4), (128, 2), (128, 3)) if args.all else ((128, 3),)
            for BN, ST in rings if D <= 128 else ((64, 2),):
                if causal and BN != 128:
                    continue
                for alt in (False, True) if args.all else (True,):
                    variants[f"pingpong n{BN} s{ST}{' alternate' if alt else ''}"] = functools.partial(
                        attention_pingpong, BLOCK_N=BN, STAGES=ST, CONSUMER_REGS=240, ALTERNATE=alt, CAUSAL=causal)
            if not variants:
                continue
            for M in args.seqlens:
                _point(D, M, causal, variants, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
