"""A/B of two tile configs of one ``triton`` kernel, in one process, rounds alternated.

    PYTHONPATH=. python benchmarks/ab_tiles.py --kernel fwd --a 64,64,4,3 --b 128,128,8,3 \\
        --cases causal window varlen --seqlens 1024 2048 4096 8192

Prints the median of ``--rounds`` (3) rounds per config and ``B/A`` (> 1: config A is faster). The forward is timed
alone for ``--kernel fwd``; the other kernels are timed inside a forward+backward call.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import HEADS, TOKENS, measure, provider_fn  # noqa: E402
from cases import CASE_NAMES, make_case  # noqa: E402

from biasattn.ops.triton import configs  # noqa: E402


def tile(text: str) -> configs.TileConfig:
    """``"block_m,block_n,num_warps,num_stages"`` as a :class:`~biasattn.ops.triton.configs.TileConfig`."""
    return configs.TileConfig(*map(int, text.split(",")))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", default="fwd", choices=["fwd", "dkdv", "dq", "dbias", "dq_ds"])
    p.add_argument("--a", type=tile, required=True)
    p.add_argument("--b", type=tile, required=True)
    p.add_argument("--cases", nargs="+", default=["causal", "window", "varlen"], choices=CASE_NAMES)
    p.add_argument("--seqlens", nargs="+", type=int, default=[2048, 8192])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (medians reported)")
    args = p.parse_args(argv)
    mode = "fwd" if args.kernel == "fwd" else "fwd+bwd"
    for case_name in args.cases:
        for M in args.seqlens:
            case = make_case(case_name, B=max(1, TOKENS // M), H=HEADS, M=M, D=args.head_dim, requires_grad=mode != "fwd")
            inputs = [case.q, case.k, case.v] + ([case.dense_mask()] if case.name == "additive" and mode != "fwd" else [])
            fn = provider_fn("triton", case, None)
            ms = {args.a: [], args.b: []}
            for _ in range(args.rounds):
                for cfg in (args.a, args.b):
                    with configs.override(**{args.kernel: cfg}):
                        ms[cfg].append(measure(fn, inputs, mode)[0])
            ta, tb = sorted(ms[args.a])[args.rounds // 2], sorted(ms[args.b])[args.rounds // 2]
            print(f"{args.kernel} {case_name} M={M} {mode}: A {ta:.3f} ms, B {tb:.3f} ms, B/A {tb / ta:.3f}", flush=True)
            del case
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
