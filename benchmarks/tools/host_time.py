"""Host time per eager call of the ``triton`` operator at benchmark shapes, with the GPU kept busy; two trees compared.

Each round first queues a sleep kernel of about 60 ms, so the calls that follow never wait for the GPU: the time
per call is the host's alone (Python, allocations, launches), not the kernels'. A figure is the minimum over
``--rounds`` rounds of ``--iters`` calls (the host's noise only ever adds time).

With ``--against TREE`` (a folder holding another ``biasattn`` package, e.g. ``git worktree add /tmp/base f1c02f8``),
the script runs itself ``--runs`` times for each tree, alternating, each in a fresh process, and prints the median of
each tree's figures and their ratio. Needs a CUDA device to measure; ``--help`` works anywhere.

    PYTHONPATH=. python benchmarks/tools/host_time.py --cases none causal padded --against /tmp/base
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from bench_attention import HEADS, TOKENS, provider_fn  # noqa: E402
from cases import CASE_NAMES, make_case  # noqa: E402

SLEEP_CYCLES = 120_000_000  # about 60 ms of GPU time on a ~2 GHz clock: longer than any round's calls take to issue


def host_us(call, iters: int, rounds: int) -> float:
    """µs of host time per ``call``: the minimum over ``rounds`` rounds of ``iters`` calls issued behind a sleep kernel."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        times.append((time.perf_counter() - t0) / iters * 1e6)
        torch.cuda.synchronize()
    return min(times)


def measure(cases, modes, M: int, D: int, iters: int, rounds: int) -> list[tuple[str, str, float]]:
    """``[(case, mode, µs)]`` of the ``triton`` operator's eager calls (forward, or forward+backward with autograd)."""
    rows = []
    for name in cases:
        for mode in modes:
            case = make_case(name, B=max(1, TOKENS // M), H=HEADS, M=M, D=D, requires_grad=mode != "fwd")
            fn = provider_fn("triton", case, None)
            if mode == "fwd":
                call = fn
            else:
                inputs, dout = (case.q, case.k, case.v), torch.randn_like(fn())

                def call(fn=fn, inputs=inputs, dout=dout):
                    return torch.autograd.grad(fn(), inputs, dout)

            rows.append((name, mode, host_us(call, iters, rounds)))
    return rows


def summary(figures: dict[tuple[str, str, str], list[float]]) -> list[str]:
    """Lines of ``case mode base new new/base`` from each tree's figures (``(case, mode, "base" or "new") -> µs``),
    medians over the runs."""
    lines = []
    for (case, mode, tree) in sorted(figures):
        if tree != "base" or (case, mode, "new") not in figures:
            continue
        base = statistics.median(figures[(case, mode, "base")])
        new = statistics.median(figures[(case, mode, "new")])
        lines.append(f"{case:13s} {mode:8s} base {base:7.1f} µs  new {new:7.1f} µs  new/base {new / base:.2f}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["none", "causal", "window", "padded"], choices=CASE_NAMES)
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--M", type=int, default=2048)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--against", help="a folder holding the biasattn package to compare with (the base)")
    p.add_argument("--runs", type=int, default=3, help="with --against: alternating runs of each tree")
    args = p.parse_args(argv)
    if not args.against:
        for case, mode, us in measure(args.cases, args.modes, args.M, args.D, args.iters, args.rounds):
            print(f"HOST {case} {mode} {us:.1f}", flush=True)
        return 0
    here = list(argv if argv is not None else sys.argv[1:])
    at = here.index("--against")
    del here[at:at + 2]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    figures: dict = {}
    for _ in range(args.runs):
        for tree, path in (("base", os.path.abspath(args.against)), ("new", root)):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, root]))
            out = subprocess.run([sys.executable, os.path.abspath(__file__), *here], env=env, capture_output=True,
                                 text=True, check=True).stdout
            for line in out.splitlines():
                if line.startswith("HOST "):
                    _, case, mode, us = line.split()
                    figures.setdefault((case, mode, tree), []).append(float(us))
    print("\n".join(summary(figures)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
