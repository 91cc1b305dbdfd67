"""Microseconds per eager decode step (one query per sequence, bf16, D=128), host work included.

Each step is called back to back, synchronized once per batch of calls; five rounds alternate the
providers (SDPA, the dispatched call, forced operators, a bias built per step, a reused bias) and
the medians are printed on one line per shape, tagged with the first argument. On short caches the
figures are host time. For an A/B of two commits, run each from its own checkout in alternating
processes, since a host's speed drifts between processes:

    git worktree add build/old <commit>
    for i in 1 2 3; do PYTHONPATH=build/old python benchmarks/eager_decode_steps.py old
                       PYTHONPATH=. python benchmarks/eager_decode_steps.py new; done
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

import biasattn as ba

SHAPES = ((1, 32, 8, 1024), (4, 32, 1, 1024), (16, 32, 32, 1024))  # B, Hq, Hkv, Mk


def loop(f, n: int) -> float:
    """Mean microseconds per call of ``n`` calls of ``f``, one synchronization at the end."""
    t = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main(tag: str) -> None:
    dev, dt = "cuda", torch.bfloat16
    for B, Hq, Hkv, Mk in SHAPES:
        step(tag, dev, dt, B, Hq, Hkv, Mk)


def step(tag, dev, dt, B, Hq, Hkv, Mk):
    """Time every provider on one shape and print the medians."""
    q = torch.randn(B, Hq, 1, 128, device=dev, dtype=dt)
    k = torch.randn(B, Hkv, Mk, 128, device=dev, dtype=dt)
    v = torch.randn_like(k)
    lengths = [Mk - 3 - b % 5 for b in range(B)]
    padded = ba.PaddedKeysMask(lengths, device=dev)
    rows = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=Hq != Hkv),
        "dispatched": lambda: ba.attention(q, k, v),
        "op=cudnn": lambda: ba.attention(q, k, v, op="cudnn"),
        "op=triton_splitk": lambda: ba.attention(q, k, v, op="triton_splitk"),
        "causal-br fresh": lambda: ba.attention(q, k, v, ba.LowerTriangularFromBottomRightMask()),
        "padded reused": lambda: ba.attention(q, k, v, padded),
        "padded fresh": lambda: ba.attention(q, k, v, ba.PaddedKeysMask(lengths, device=dev)),
    }
    res = {n: [] for n in rows}
    with torch.no_grad():
        for f in rows.values():
            loop(f, 100)
        names = list(rows)
        for r in range(5):
            for n in names[r % len(names):] + names[:r % len(names)]:
                res[n].append(loop(rows[n], 600))
    medians = ", ".join(f"{n} {statistics.median(t):.1f}" for n, t in res.items())
    print(f"{tag} B={B} {Hq}/{Hkv} Mk={Mk}: {medians}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
