"""A one-launch read of a K/V cache: how fast any kernel that reads every key and value once can be.

``read_floor_fn(programs, block)`` returns ``fn(q, k, v)`` that launches one Triton kernel of
``programs`` programs, each summing a contiguous share of K and V (``block`` elements per load), and
writing one float. It does no attention: its time is the launch, the first loads' latency and the
bytes streamed, the part of a decoding step that no decoding kernel avoids. ``bench_decode.py
--floor`` times the fastest of a few grid sizes at every point, in the same process as the
operators, so each point gets the GB/s a single streaming kernel reaches at its size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

VARIANTS = ((1, 8192), (2, 8192), (4, 4096), (8, 4096), (16, 2048))  # (programs per SM, elements per load)


@triton.jit
def _read_kernel(K, V, Out, N, per_program, BLOCK: tl.constexpr):
    """Program ``p`` sums K and V over ``[p * per_program, (p + 1) * per_program)`` (flat, 64-bit)."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * per_program
    end = tl.minimum(start + per_program, N)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(start, end, BLOCK):
        mask = i + offs < end
        acc += tl.load(K + i + offs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.load(V + i + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + pid, tl.sum(acc, 0))


def read_floor_fn(programs: int, block: int):
    """``fn(q, k, v) -> per-program sums``: one launch reading all of ``k`` and ``v`` (contiguous, same size)."""

    def fn(q, k, v):
        n = k.numel()
        assert v.numel() == n and k.is_contiguous() and v.is_contiguous()
        per_program = triton.cdiv(triton.cdiv(n, programs), block) * block
        grid = triton.cdiv(n, per_program)
        out = torch.empty(grid, dtype=torch.float32, device=k.device)
        _read_kernel[(grid,)](k, v, out, n, per_program, BLOCK=block, num_warps=8)
        return out

    return fn
