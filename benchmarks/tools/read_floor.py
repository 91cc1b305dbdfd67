"""A one-launch read of a K/V cache: how fast any kernel that reads every key and value once can be.

Use it when a decoding point misses its bandwidth target, to tell a kernel that could do better from
a point that no kernel can reach (too few bytes for the launch and the first loads' latency to hide).
``read_floor_fn(programs, block)`` returns ``fn(q, k, v)`` that launches one Triton kernel of
``programs`` programs, each summing a contiguous share of K and V (``block`` elements per load), and
writing one float. It does no attention: its time is the launch, the first loads' latency and the
bytes streamed, the part of a decoding step that no decoding kernel avoids. ``bench_decode.py
--floor`` times the fastest of :data:`VARIANTS` at every point, in the same process as the operators;
run alone, this module times one cache size (needs a CUDA device; ``--help`` works anywhere):

    PYTHONPATH=. python benchmarks/tools/read_floor.py --batch 4 --kv-heads 8 --keys 32768 --head-dim 128
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

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


def main(argv=None) -> int:
    """Time every variant on one K/V cache ``[batch, kv_heads, keys, head_dim]`` and print its GB/s."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--keys", type=int, default=32768)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("the read floor is a GPU measurement: no CUDA device found")
    shape = (args.batch, args.kv_heads, args.keys, args.head_dim)
    k = torch.randn(shape, dtype=getattr(torch, args.dtype), device="cuda")
    v = torch.randn_like(k)
    sms = torch.cuda.get_device_properties(k.device).multi_processor_count
    gbytes = 2 * k.numel() * k.element_size() / 1e9
    for per_sm, block in VARIANTS:
        fn = read_floor_fn(per_sm * sms, block)
        ms = do_bench(lambda fn=fn: fn(None, k, v))
        print(f"{per_sm:2d} programs per SM, {block:5d} elements per load: {ms * 1e3:8.1f} us, {gbytes / ms * 1e3:7.0f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
