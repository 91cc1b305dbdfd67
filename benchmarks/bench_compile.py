"""Packed documents under ``torch.compile``: graphs compiled for new lengths, and a step's time against eager.

Each step builds ``BlockDiagonalMask.from_seqlens(lengths).make_causal()`` inside the function from a
GPU tensor of document lengths (new lengths every step) and runs attention forward, then the
backward outside it, as a compiled model's training step does. The function is compiled with
``fullgraph=True, dynamic=True``; 10 steps warm up, then 30 steps are timed with CUDA events (median
of 3 loops). bf16, H=16, D=128. Prints ms per step, compiled over eager, and the number of graphs
Dynamo compiled (one for every case and length together).

    PYTHONPATH=. python benchmarks/bench_compile.py
"""

from __future__ import annotations

import random
import statistics

import torch
import torch._dynamo

import biasattn as ba

CASES = ((16384, 14), (16384, 64), (4096, 16))


def _fwd(q, k, v, lengths):
    return ba.attention(q, k, v, ba.BlockDiagonalMask.from_seqlens(lengths).make_causal())


def _split(rng: random.Random, total: int, parts: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, total), parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def main() -> None:
    dev, dt, H, D = "cuda", torch.bfloat16, 16, 128
    compiled_fwd = torch.compile(_fwd, fullgraph=True, dynamic=True)
    torch._dynamo.utils.counters.clear()
    for M, docs in CASES:
        rng = random.Random(0)
        q, k, v = (torch.randn(1, H, M, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
        dout = torch.randn(1, H, M, D, device=dev, dtype=dt)
        batches = [torch.tensor(_split(rng, M, docs), device=dev, dtype=torch.int32) for _ in range(40)]
        ms = {}
        for name, fwd in (("eager", _fwd), ("compiled", compiled_fwd)):
            def step(lengths, fwd=fwd, q=q, k=k, v=v, dout=dout):
                return torch.autograd.grad(fwd(q, k, v, lengths), (q, k, v), dout)

            for lengths in batches[:10]:
                step(lengths)
            times = []
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for lengths in batches[10:]:
                    step(lengths)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / len(batches[10:]))
            ms[name] = statistics.median(times)
        print(f"{M} tokens, {docs} documents: eager {ms['eager']:.3f} ms, compiled {ms['compiled']:.3f} ms, "
              f"compiled / eager time {ms['compiled'] / ms['eager']:.2f}")
    print(f"graphs compiled: {torch._dynamo.utils.counters['stats']['unique_graphs']}")


if __name__ == "__main__":
    main()
