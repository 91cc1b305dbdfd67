"""Where the time of one call goes: GPU time per kernel for ``triton`` and its peers, from the profiler.

Use it when a benchmark row is slower than expected and you need to know whether the kernels or the
host are the cause. For each case and provider it runs the call (forward, or forward+backward)
``--iters`` times under ``torch.profiler`` and prints every GPU kernel's time per call, largest first,
with the call's total GPU time, its wall time in a loop without the profiler (the difference is host time the GPU
waited for) and its host time
alone (calls issued behind a sleep kernel, as ``host_time.py`` measures them).
``--host-profile`` adds cProfile's top host functions, ``--sync-check`` the operations that wait for
the GPU, ``--timeline`` (``triton`` only) when each of the call's launches leaves the host, measured from the
call's start, with the call's time as ``do_bench`` takes it (caches flushed, the GPU idle before the call):
a call whose time exceeds its GPU time by the host time before its last long kernel's launch is paced by
the host. Needs a CUDA device to measure; ``--help`` works anywhere.

    PYTHONPATH=. python benchmarks/tools/profile_kernels.py --cases none varlen --M 2048 --modes fwd+bwd
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from bench_attention import HEADS, TOKENS, Flex, provider_fn  # noqa: E402
from cases import CASE_NAMES, make_case  # noqa: E402
from tools.host_time import host_us  # noqa: E402


def _call(fn, inputs, mode):
    if mode == "fwd":
        return fn
    dout = torch.randn_like(fn())

    def call():
        return torch.autograd.grad(fn(), inputs, dout)

    return call


def profile_call(call, iters: int) -> tuple[list[tuple[str, float, int]], float]:
    """``([(kernel, µs per call, launches per call)], wall µs per call)``; the wall time is that of a loop run
    without the profiler, whose own host work per launch would count as the call's."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((e.key, t / iters, round(e.count / iters)))
    return sorted(rows, key=lambda r: -r[1]), wall


def host_profile(call, iters: int = 30, top: int = 25) -> None:
    """Print the functions with the most host time over ``iters`` calls (``cProfile``)."""
    import cProfile
    import pstats

    call()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        call()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


@contextlib.contextmanager
def host_marks(marks: list):
    """Append ``(label, perf_counter())`` to ``marks`` at each launch of the ``triton`` operator's launcher
    (``launch <kernel>``) and at the entry and exit of the autograd function's forward and backward."""
    from biasattn.ops import autograd
    from biasattn.ops.triton import launch

    fn = autograd._AttentionFunction
    saved = (launch._Direct._run, fn.forward, fn.backward)
    run, forward, backward = saved

    def marked_run(entry, grid, args):
        marks.append((f"launch {entry[0].name}", time.perf_counter()))
        return run(entry, grid, args)

    def around(f, name):
        def marked(*args, **kwargs):
            marks.append((f"{name} in", time.perf_counter()))
            out = f(*args, **kwargs)
            marks.append((f"{name} out", time.perf_counter()))
            return out
        return staticmethod(marked)

    launch._Direct._run = staticmethod(marked_run)
    fn.forward, fn.backward = around(forward, "forward"), around(backward, "backward")
    try:
        yield marks
    finally:
        launch._Direct._run, fn.forward, fn.backward = (staticmethod(f) for f in saved)


def timeline(call, iters: int = 30, flush_bytes: int = 256 * 2**20) -> tuple[float, list[tuple[str, float]]]:
    """``(µs per call, [(mark, µs after the call's start)])``: each call is issued right behind a cache flush on a
    GPU that has finished everything else and timed by CUDA events around it, as one repetition of
    ``triton.testing.do_bench`` is when the host paces the calls; with the median offset of each
    :func:`host_marks` mark."""
    for _ in range(3):
        call()
    cache = torch.empty(flush_bytes, dtype=torch.int8, device="cuda")
    times, offsets, marks = [], collections.defaultdict(list), []
    with host_marks(marks):
        for _ in range(iters):
            cache.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            marks.clear()
            start.record()
            t0 = time.perf_counter()
            call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
            for i, (label, t) in enumerate(marks):
                offsets[i, label].append((t - t0) * 1e6)
    return statistics.median(times), [(label, statistics.median(v)) for (_, label), v in sorted(offsets.items())]


def sync_check(call) -> int:
    """Run ``call`` twice with CUDA's sync debug mode on; print each synchronizing operation with its stack."""
    import traceback
    import warnings

    call()
    torch.cuda.synchronize()
    seen = []

    def show(message, category, filename, lineno, file=None, line=None):
        seen.append(f"{message}\n" + "".join(traceback.format_stack(limit=14)[:-2]))

    torch.cuda.set_sync_debug_mode("warn")  # before the hook: its own notice (a prototype feature) is no sync
    saved = warnings.showwarning
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            for _ in range(2):
                call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = saved
    torch.cuda.synchronize()
    for s in seen:
        print("SYNC", s)
    return len(seen)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["none", "causal", "varlen", "block_sparse"], choices=CASE_NAMES)
    p.add_argument("--providers", nargs="+", default=["triton", "flex"])
    p.add_argument("--M", type=int, default=2048)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--modes", nargs="+", default=["fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--host-profile", action="store_true", help="also print cProfile's top host functions per call")
    p.add_argument("--sync-check", action="store_true", help="also report operations that synchronize with the GPU")
    p.add_argument("--no-plans", action="store_true", help="run the triton operator without launch plans")
    p.add_argument("--timeline", action="store_true",
                   help="triton: also print when each launch leaves the host, from the call's start")
    args = p.parse_args(argv)
    from biasattn.ops.triton import options

    with options.use(plans=not args.no_plans):
        flex = Flex() if "flex" in args.providers else None
        for case_name, mode in itertools.product(args.cases, args.modes):
            case = make_case(case_name, B=max(1, TOKENS // args.M), H=HEADS, M=args.M, D=args.D, requires_grad=mode != "fwd")
            inputs = [case.q, case.k, case.v]
            if case.name == "additive" and mode != "fwd":
                inputs.append(case.dense_mask())
            for name in args.providers:
                fn = provider_fn(name, case, flex)
                if fn is None:
                    continue
                call = _call(fn, inputs, mode)
                rows, wall = profile_call(call, args.iters)
                total = sum(r[1] for r in rows)
                host = host_us(call, iters=30, rounds=5)
                print(f"\n== {case_name} M={args.M} D={args.D} {mode} {name}: GPU {total:.0f} µs, "
                      f"wall {wall:.0f} µs, host {host:.0f} µs per call")
                if args.host_profile:
                    host_profile(call)
                if args.sync_check:
                    print(f"   synchronizing operations in two calls: {sync_check(call)}")
                if args.timeline and name == "triton":
                    event_us, marks = timeline(call)
                    print(f"   one call after a cache flush: {event_us:.0f} µs; host marks, µs from its start:")
                    for label, us in marks:
                        print(f"  {us:9.1f} µs  {label}")
                for key, us, count in rows[:12]:
                    print(f"  {us:9.1f} µs  x{count:<3d} {key[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
