"""Dropout benchmark: the ``triton`` operator with dropout against FlashAttention-2, cuDNN and CUTLASS.

For no bias, causal and a causal window of 1024 keys, bf16, H=16, B·M = 16384 tokens, each provider
runs forward and forward+backward with ``dropout_p`` 0 and ``--p`` in one process (median of
``triton.testing.do_bench``). ``flash2`` is our operator over PyTorch's FlashAttention-2 (it takes
the window); ``sdpa_*`` are SDPA's backends (no window). The table gives each time with dropout, the
cost of dropout for ``triton`` (time with dropout / time without) and each peer's time over ours with
dropout (> 1: we are faster). ``auto`` is ``ba.attention`` without ``op``: the operator the
dispatcher picks for a dropout call.

    PYTHONPATH=. python benchmarks/bench_dropout.py    # into benchmarks/results/<device>, e.g. h200
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import git_commit, results_dir  # noqa: E402

import biasattn as ba  # noqa: E402

_DEV = "cuda" if torch.cuda.is_available() else "cpu"
BIASES = {"none": None, "causal": ba.LowerTriangularMask().to(_DEV), "window": ba.LocalAttentionMask(1023, 0).to(_DEV)}
PEERS = {"flash2": None, "sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
         "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def provider(name: str, case: str, p: float):
    """``fn(q, k, v) -> out`` for one provider, or None when it cannot run."""
    if name in ("triton", "auto", "flash2"):
        bias = BIASES[case]
        op = None if name == "auto" else name
        return lambda q, k, v: ba.attention(q, k, v, bias, dropout_p=p, op=op)
    if case == "window":
        return None
    causal = case == "causal"

    def sdpa(q, k, v):
        with sdpa_kernel(PEERS[name]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)

    return sdpa


def time_ms(fn, q, k, v, mode: str) -> float | None:
    dout = torch.randn_like(q)

    def call():
        out = fn(q, k, v)
        if mode == "fwd+bwd":
            torch.autograd.grad(out, (q, k, v), dout)

    try:
        call()
    except RuntimeError as e:  # a backend that refuses these inputs
        print(f"  skipped: {str(e).splitlines()[0][:120]}")
        return None
    torch.cuda.synchronize()
    return triton.testing.do_bench(call, warmup=100, rep=300, return_mode="median")


def run(sizes, p: float, D: int = 128, H: int = 16, tokens: int = 16384) -> list[dict]:
    rows = []
    for M in sizes:
        B = max(1, tokens // M)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, M, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for _ in range(3))
        for case in BIASES:
            for mode in ("fwd", "fwd+bwd"):
                for name in ("triton", "auto", *PEERS):
                    for prob in (0.0, p):
                        fn = provider(name, case, prob)
                        if fn is None:
                            continue
                        ms = time_ms(fn, q, k, v, mode)
                        rows.append(dict(case=case, M=M, B=B, H=H, D=D, mode=mode, provider=name, dropout_p=prob,
                                         median_ms=ms, commit=git_commit(), device=torch.cuda.get_device_name()))
                        print(f"{case:7s} M={M:5d} {mode:7s} {name:15s} p={prob:.2f}: "
                              + (f"{ms:.3f} ms" if ms is not None else "n/a"), flush=True)
    return rows


def markdown(rows: list[dict], p: float) -> str:
    t = {(r["case"], r["M"], r["mode"], r["provider"], r["dropout_p"]): r["median_ms"] for r in rows}
    keys = sorted({(r["case"], r["M"], r["mode"]) for r in rows}, key=lambda x: (x[0], x[1], x[2]))
    names = ["triton", "auto", *PEERS]
    head = ("| case | M | mode | " + " | ".join(f"{n} p={p} (ms)" for n in names)
            + " | triton cost of dropout | " + " | ".join(f"{n} / triton" for n in names[2:]) + " |")
    lines = [head, "|" + "---|" * (3 + len(names) + 1 + len(names) - 2)]

    def f(x):
        return f"{x:.3f}" if x is not None else "n/a"

    for case, M, mode in keys:
        ours, ours0 = t.get((case, M, mode, "triton", p)), t.get((case, M, mode, "triton", 0.0))
        cost = f"{ours / ours0:.2f}x" if ours and ours0 else "n/a"
        ratios = []
        for n in names[2:]:
            peer = t.get((case, M, mode, n, p))
            ratios.append(f"{peer / ours:.2f}" if peer and ours else "n/a")
        lines.append(f"| {case} | {M} | {mode} | " + " | ".join(f(t.get((case, M, mode, n, p))) for n in names)
                     + f" | {cost} | " + " | ".join(ratios) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2048,8192", help="sequence lengths, comma-separated")
    ap.add_argument("--p", type=float, default=0.1, help="dropout probability")
    ap.add_argument("--out", default=None, help="folder for dropout.csv and dropout.md (default: benchmarks/results/<device>)")
    args = ap.parse_args(argv)
    args.out = args.out or results_dir()
    rows = run([int(s) for s in args.sizes.split(",")], args.p)
    table = markdown(rows, args.p)
    print(table)
    from biasattn.ops.triton import configs

    for key, cfg in configs._tuned.items():  # with BIASATTN_TRITON_TUNE=1: the fastest tiles per kernel
        print("tile config", key[0], key[1], key[4], cfg)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "dropout.csv"), "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        with open(os.path.join(args.out, "dropout.md"), "w") as fh:
            fh.write(f"# Dropout (p = {args.p}), bf16, D=128, H=16, B·M=16384\n\n"
                     f"`PYTHONPATH=. python benchmarks/bench_dropout.py --out DIR`, commit {rows[0]['commit']}, "
                     f"{rows[0]['device']}. Times are medians of `triton.testing.do_bench`.\n\n" + table)


if __name__ == "__main__":
    main()
