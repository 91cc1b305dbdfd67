"""Host time of one attention call, layer by layer, on shapes so small that the GPU never waits.

Each layer is timed as the mean over many back-to-back calls with one synchronization at the end;
with tiny tensors every kernel finishes before the host issues the next, so the figure is the host
cost of that layer and everything beneath it:

- ``launch fwd`` / ``launch bwd``: the Triton launchers (:mod:`biasattn.ops.triton.flash`,
  :mod:`biasattn.ops.triton.flash_bwd`);
- ``operator fwd``: the ``triton`` operator's ``fwd`` (eager: the launcher itself);
- ``attention fwd``: :func:`biasattn.attention` without gradients, forced and dispatched;
- ``attention fwd+bwd``: the same with ``torch.autograd.grad``;
- ``sdpa ...``: torch's SDPA flash backend on the same shapes, for scale.

    PYTHONPATH=. python benchmarks/host_overhead.py --cases none causal varlen --profile causal
    PYTHONPATH=. python benchmarks/host_overhead.py --targets   # the target rows against SDPA
    PYTHONPATH=. python benchmarks/host_overhead.py --launches  # each kernel launch against an empty one
    PYTHONPATH=. python benchmarks/host_overhead.py --masks     # building each mask afresh

``--threads`` splits a forward+backward call into the forward, the backward's body (timed and profiled
on whichever thread autograd runs it) and the rest (autograd's engine and its thread hand-off), with
autograd's device thread and with the backward on the caller's thread, next to an empty
``autograd.Function`` that measures the hand-off alone.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import biasattn as ba

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import CASE_NAMES, make_case  # noqa: E402
from tools.profile_kernels import host_profile  # noqa: E402


def per_call_us(call, iters: int) -> float:
    """Mean µs per call over ``iters`` back-to-back calls (after a warm-up)."""
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def layers(case) -> dict:
    """``{layer name: zero-argument call}`` for one case."""
    from biasattn.inputs import make_inputs
    from biasattn.ops.triton import flash, flash_bwd
    from biasattn.ops.triton_flash import TritonOperator

    q, k, v = case.q, case.k, case.v
    bias = case.bias.to(q.device) if case.bias is not None else None
    inp = make_inputs(q, k, v, bias, requires_grad=False)
    spec, scale = inp.spec, inp.scale
    out, lse = flash.attn_fwd(q, k, v, spec, scale)
    dout = torch.randn_like(out)
    op = TritonOperator()
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def fwd_bwd(**kw):
        o = ba.attention(qg, kg, vg, bias, **kw)
        return torch.autograd.grad(o, (qg, kg, vg), dout)

    calls = {
        "launch fwd": lambda: flash.attn_fwd(q, k, v, spec, scale),
        "launch bwd": lambda: flash_bwd.attn_bwd(q, k, v, out, lse, dout, None, spec, scale, False),
        "operator fwd": lambda: op.fwd(inp),
        "attention fwd (op=triton)": lambda: ba.attention(q, k, v, bias, op="triton"),
        "attention fwd (dispatched)": lambda: ba.attention(q, k, v, bias),
        "attention fwd+bwd (op=triton)": lambda: fwd_bwd(op="triton"),
        "attention fwd+bwd (dispatched)": lambda: fwd_bwd(),
    }
    def fwd_with_graph():
        return ba.attention(qg, kg, vg, bias, op="triton")

    def single_threaded():
        with torch.autograd.set_multithreading_enabled(False):
            return fwd_bwd(op="triton")

    calls["attention fwd with grad (op=triton)"] = fwd_with_graph
    calls["attention fwd+bwd, backward on the caller's thread"] = single_threaded
    if case.name in ("none", "causal"):
        def sdpa_fwd_bwd():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=case.is_causal)
            return torch.autograd.grad(o, (qg, kg, vg), dout)

        def sdpa_fwd():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=case.is_causal)

        calls["sdpa flash fwd"] = sdpa_fwd
        calls["sdpa flash fwd+bwd"] = sdpa_fwd_bwd
    return calls


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


def thread_split(case, iters: int, top: int) -> None:
    """Where a forward+backward call's host time goes, per thread mode (see the module docstring).

    Timings run without a profiler: ``before`` is from ``autograd.grad``'s call to the backward's first
    line (the engine and the hand-off to its thread), ``body`` the backward itself, ``after`` from its
    return to ``autograd.grad``'s. A profile of the backward body alone follows (cumulative time).
    """
    import cProfile
    import pstats

    from biasattn.ops import autograd as ag

    q, k, v = (t.detach().requires_grad_() for t in (case.q, case.k, case.v))
    bias = case.bias.to(q.device) if case.bias is not None else None
    dout = torch.randn_like(case.q)
    marks: list[float] = []
    state = {"prof": None}
    original = ag._AttentionFunction.backward

    def timed_backward(ctx, *grads):
        marks.append(time.perf_counter())
        prof = state["prof"]
        if prof is not None:
            prof.enable()
        try:
            return original(ctx, *grads)
        finally:
            if prof is not None:
                prof.disable()
            marks.append(time.perf_counter())

    def fwd():
        return ba.attention(q, k, v, bias, op="triton")

    x = torch.randn(16, device=q.device, requires_grad=True)

    def identity():
        return torch.autograd.grad(_Identity.apply(x), x, torch.ones_like(x))

    ag._AttentionFunction.backward = staticmethod(timed_backward)
    try:
        for threaded in (True, False):
            with torch.autograd.set_multithreading_enabled(threaded):
                where = "autograd's device thread" if threaded else "the caller's thread"
                t_fwd = per_call_us(fwd, iters)
                for _ in range(10):
                    torch.autograd.grad(fwd(), (q, k, v), dout)
                torch.cuda.synchronize()
                parts = []
                for _ in range(iters):
                    o = fwd()
                    marks.clear()
                    t0 = time.perf_counter()
                    torch.autograd.grad(o, (q, k, v), dout)
                    t1 = time.perf_counter()
                    parts.append((marks[0] - t0, marks[1] - marks[0], t1 - marks[1]))
                torch.cuda.synchronize()
                before, body, after = (sorted(p[i] for p in parts)[len(parts) // 2] * 1e6 for i in range(3))
                t_all = per_call_us(lambda: torch.autograd.grad(fwd(), (q, k, v), dout), iters)
                t_id = per_call_us(identity, iters)
                print(f"  backward on {where}: fwd+bwd {t_all:7.1f} µs; forward {t_fwd:6.1f}; backward (medians): "
                      f"before {before:6.1f} + body {body:6.1f} + after {after:6.1f}; empty Function fwd+bwd {t_id:6.1f}")
                state["prof"] = prof = cProfile.Profile()
                for _ in range(iters):
                    torch.autograd.grad(fwd(), (q, k, v), dout)
                torch.cuda.synchronize()
                state["prof"] = None
            pstats.Stats(prof).sort_stats("cumulative").print_stats(top)
    finally:
        ag._AttentionFunction.backward = original


def ab_option(calls: dict, option: str, rounds: int, iters: int) -> None:
    """Host µs of the forced-operator layers with a launcher option (``plans``, ``direct_launch``) on and off,
    alternating rounds (medians)."""
    from biasattn.ops.triton import options

    names = [n for n in calls if "op=triton" in n]
    times: dict = {(n, on): [] for n in names for on in (True, False)}
    for _ in range(rounds):
        for on in (True, False):
            with options.use(**{option: on}):
                for n in names:
                    times[(n, on)].append(per_call_us(calls[n], iters))
    for n in names:
        on, off = (sorted(times[(n, s)])[rounds // 2] for s in (True, False))
        print(f"  {option} on {on:8.1f}  off {off:8.1f}  ({off / on:.2f}x)  {n}")


def launch_costs(iters: int, D: int) -> None:
    """Host µs of each kernel launch a causal ``op="triton"`` forward+backward makes (M=256, B=1, H=2),
    replayed alone through its compiled entry, next to an empty Triton kernel of one argument: what a
    launch costs whatever it passes, and what our arguments add."""
    import triton

    from biasattn.ops.triton import launch

    @triton.jit
    def _empty(x):
        pass

    q, k, v = (torch.randn(1, 2, 256, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)

    def step():
        torch.autograd.grad(ba.attention(q, k, v, ba.LowerTriangularMask(), op="triton"), (q, k, v), dout)

    for _ in range(3):  # compiled, then recorded, then replayed from a plan
        step()
    run, seen = launch._Direct._run, []
    launch._Direct._run = staticmethod(lambda entry, grid, args: (seen.append((entry, grid, args)), run(entry, grid, args)))
    try:
        step()
    finally:
        launch._Direct._run = staticmethod(run)
    empty, x = launch.direct(_empty), torch.zeros(16, device="cuda")
    print("   host µs  launch")
    print(f"  {per_call_us(lambda: empty[(1,)](x), iters):8.1f}  empty kernel, 1 argument")
    for entry, grid, args in seen:
        us = per_call_us(functools.partial(run, entry, grid, args), iters)
        print(f"  {us:8.1f}  {entry[0].name}, {len(args)} arguments")


def mask_costs(iters: int, docs: int = 16) -> None:
    """Host µs to build each mask a training or decoding step builds afresh (``docs`` packed documents
    or batch rows, new lengths every call), the kernels' work left out."""
    dev = "cuda"
    rng = random.Random(0)
    lists = [[rng.randint(1, 512) for _ in range(docs)] for _ in range(64)]
    tensors = [torch.tensor(n, device=dev, dtype=torch.int32) for n in lists]
    it = itertools.cycle(range(64))
    rows = [
        ("BlockDiagonalMask.from_seqlens(list, device=).make_causal()",
         lambda: ba.BlockDiagonalMask.from_seqlens(lists[next(it)], device=dev).make_causal()),
        ("BlockDiagonalMask.from_seqlens(GPU tensor).make_causal()",
         lambda: ba.BlockDiagonalMask.from_seqlens(tensors[next(it)]).make_causal()),
        ("PaddedKeysMask(list, device=)", lambda: ba.PaddedKeysMask(lists[next(it)], device=dev)),
        ("PaddedKeysMask(GPU tensor)", lambda: ba.PaddedKeysMask(tensors[next(it)])),
        ("LowerTriangularMask()", ba.LowerTriangularMask),
    ]
    print(f"   host µs  mask ({docs} documents or rows, new lengths every call)")
    for name, build in rows:
        print(f"  {per_call_us(build, iters):8.1f}  {name}")


def target_rows(iters: int, D: int, rounds: int = 7) -> None:
    """Host µs per call of the rows the host-path targets name, each next to SDPA on the same tensors:
    tiny prefill (causal, the mask reused and built per call), decode at B=1 and B=8, and a padded-key
    mask reused, built per call from a device tensor of lengths, and as SDPA's dense bool mask."""
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, grad=False):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g).requires_grad_(grad)

    q, k, v = rand(1, 2, 128, D), rand(1, 2, 128, D), rand(1, 2, 128, D)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    causal = ba.LowerTriangularMask()

    def ours_fb():
        return torch.autograd.grad(ba.attention(qg, kg, vg, causal), (qg, kg, vg), dout)

    def sdpa_fb():
        return torch.autograd.grad(F.scaled_dot_product_attention(qg, kg, vg, is_causal=True), (qg, kg, vg), dout)

    rows = [("prefill fwd, causal, M=128", lambda: ba.attention(q, k, v, causal),
             lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
            ("prefill fwd, causal mask built per call, M=128", lambda: ba.attention(q, k, v, ba.LowerTriangularMask()),
             lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
            ("prefill fwd+bwd, causal, M=128", ours_fb, sdpa_fb)]
    for B in (1, 8):
        dq, dk, dv = rand(B, 8, 1, D), rand(B, 8, 512, D), rand(B, 8, 512, D)
        lengths = torch.randint(1, 513, (B,), device=dev, dtype=torch.int32, generator=g)
        reused = ba.PaddedKeysMask(lengths)
        dense = torch.arange(512, device=dev)[None, None, None, :] < lengths[:, None, None, None]
        rows += [
            (f"decode fwd, B={B}, 512 keys", lambda dq=dq, dk=dk, dv=dv: ba.attention(dq, dk, dv),
             lambda dq=dq, dk=dk, dv=dv: F.scaled_dot_product_attention(dq, dk, dv)),
            (f"decode fwd, B={B}, padded keys, mask reused", lambda dq=dq, dk=dk, dv=dv, m=reused: ba.attention(dq, dk, dv, m),
             lambda dq=dq, dk=dk, dv=dv, m=dense: F.scaled_dot_product_attention(dq, dk, dv, attn_mask=m)),
            (f"decode fwd, B={B}, padded keys, mask built per call from device lengths",
             lambda dq=dq, dk=dk, dv=dv, n=lengths: ba.attention(dq, dk, dv, ba.PaddedKeysMask(n)),
             lambda dq=dq, dk=dk, dv=dv, n=lengths: F.scaled_dot_product_attention(
                 dq, dk, dv, attn_mask=torch.arange(512, device=dev)[None, None, None, :] < n[:, None, None, None])),
        ]
    print(f"\n== host µs per call (D={D}, bf16; SDPA with its own backend choice, a bool mask where ours has one;"
          f" medians of {rounds} rounds that alternate ours and SDPA, {iters} calls each)")
    print(f"  {'ours':>8} {'sdpa':>8} {'ratio':>6}  row")
    for name, ours, sdpa in rows:
        times = [(per_call_us(ours, iters), per_call_us(sdpa, iters)) for _ in range(rounds)]
        a, b = (statistics.median(t[i] for t in times) for i in (0, 1))
        ratio = statistics.median(x / y for x, y in times)
        print(f"  {a:8.1f} {b:8.1f} {ratio:6.2f}  {name}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["none", "causal", "varlen", "block_sparse", "additive"], choices=CASE_NAMES)
    p.add_argument("--M", type=int, default=256)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--profile", nargs="*", default=[], choices=CASE_NAMES, help="cases to also profile (fwd+bwd)")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--threads", action="store_true", help="split fwd+bwd host time by thread (see above)")
    p.add_argument("--ab-plans", type=int, default=0, metavar="ROUNDS",
                   help="time the forced-operator layers with launch plans on and off in ROUNDS alternating rounds")
    p.add_argument("--ab-direct", type=int, default=0, metavar="ROUNDS",
                   help="the same with direct launches (launch.direct) on and off")
    p.add_argument("--gluon", action="store_true",
                   help="let the Gluon kernels (sm_90, D=128) take these small calls: their host cost (use --M 1024 or more)")
    p.add_argument("--targets", action="store_true", help="only the target rows against SDPA (prefill, decode, padded masks)")
    p.add_argument("--launches", action="store_true", help="only the host cost of each kernel launch, against an empty kernel")
    p.add_argument("--masks", action="store_true", help="only the host cost of building each mask afresh")
    args = p.parse_args(argv)
    if args.masks:
        mask_costs(args.iters)
        return 0
    if args.launches:
        launch_costs(args.iters, args.D)
        return 0
    if args.targets:
        target_rows(args.iters, args.D)
        return 0
    from biasattn.ops.triton import options

    sizes = dict(gluon_min_scores=0, gluon_bwd_min_visible=0) if args.gluon else {}
    with options.use(**sizes):
        for name in args.cases:
            per_case(name, args)
    return 0


def per_case(name: str, args) -> None:
    """The rows of one case: every layer, or the thread split, or an option's A/B."""
    case = make_case(name, B=1, H=2, M=args.M, D=args.D, docs=(2, 4))
    print(f"\n== {name}, B=1 H=2 M={args.M} D={args.D} bf16: host µs per call")
    if args.threads:
        thread_split(case, args.iters, args.top)
        return
    if args.ab_plans or args.ab_direct:
        ab_option(layers(case), "plans" if args.ab_plans else "direct_launch", args.ab_plans or args.ab_direct, args.iters)
        return
    calls = layers(case)
    for layer, call in calls.items():
        print(f"  {per_call_us(call, args.iters):8.1f}  {layer}")
    if name in args.profile:
        host_profile(calls["attention fwd+bwd (op=triton)"], args.iters // 4, args.top)


if __name__ == "__main__":
    raise SystemExit(main())
