"""CPU benchmark without a mask or with a causal one: ``ba.attention`` (which picks ``cpu_flash``), the
``chunked`` operator, and ``F.scaled_dot_product_attention``, forward and forward+backward, float32.

Providers alternate within each round and the table reports medians over rounds, with the time
ratios against SDPA measured in the same process.

    python benchmarks/bench_cpu_dense.py                  # writes benchmarks/results/cpu/cpu_dense.md
    python benchmarks/bench_cpu_dense.py --rounds 3 --out -
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import biasattn as ba  # noqa: E402
from benchmarks.bench_cpu import environment  # noqa: E402

PROVIDERS = ("auto", "chunked", "sdpa")


def call(provider: str, q, k, v, causal: bool):
    """The attention output of ``provider`` for these tensors."""
    if provider == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    bias = ba.LowerTriangularMask() if causal else None
    return ba.attention(q, k, v, bias, op=None if provider == "auto" else provider)


def seconds(provider: str, q, k, v, causal: bool, mode: str) -> float:
    """Wall time of one call (and its backward in ``fwd+bwd``)."""
    start = time.perf_counter()
    out = call(provider, q, k, v, causal)
    if mode == "fwd+bwd":
        out.sum().backward()
    return time.perf_counter() - start


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", nargs="+", type=int, default=[1024, 4096])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8192, help="B·M: the batch shrinks as M grows")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cpu" / "cpu_dense.md"))
    args = ap.parse_args(argv)
    lines = [
        "# CPU: `ba.attention` without a mask or causal, against `chunked` and SDPA", "",
        f"Command: `python benchmarks/bench_cpu_dense.py` (D={args.head_dim}, H={args.heads}, B·M={args.tokens}, "
        f"float32, median of {args.rounds} alternating rounds).", "",
        f"Machine: {environment()}.", "",
        "| case | M | mode | auto: chosen | auto ms | chunked ms | SDPA ms | SDPA / auto | SDPA / chunked |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for causal in (False, True):
        for M in args.seqlens:
            gen = torch.Generator().manual_seed(0)
            B = max(1, args.tokens // M)
            for mode in ("fwd", "fwd+bwd"):
                q, k, v = (torch.randn(B, args.heads, M, args.head_dim, generator=gen).requires_grad_(mode == "fwd+bwd")
                           for _ in range(3))
                chosen = ba.explain(q, k, v, ba.LowerTriangularMask() if causal else None).splitlines()
                chosen = next(line.split()[0] for line in chosen if line.strip().endswith("chosen"))
                times = {p: [] for p in PROVIDERS}
                for p in PROVIDERS:
                    seconds(p, q, k, v, causal, mode)  # warm-up
                for _ in range(args.rounds):
                    for p in PROVIDERS:
                        times[p].append(seconds(p, q, k, v, causal, mode))
                ms = {p: 1e3 * statistics.median(t) for p, t in times.items()}
                lines.append(f"| {'causal' if causal else 'none'} | {M} | {mode} | {chosen} | {ms['auto']:.1f} | "
                             f"{ms['chunked']:.1f} | {ms['sdpa']:.1f} | {ms['sdpa'] / ms['auto']:.2f} | "
                             f"{ms['sdpa'] / ms['chunked']:.2f} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
