"""Attention benchmark: the ``triton`` operator against SDPA (flash, cudnn, efficient, math) and FlexAttention.

For each case of :mod:`benchmarks.cases` (no bias, causal, a window of 1024 keys (--window), padded keys, packed varlen,
block-sparse 25%, additive ``[1, H, M, M]``, ALiBi), each sequence length (B·M = 16384 tokens), head
dim and mode (``fwd``, ``fwd+bwd``, or ``bwd``: the backward alone), every provider that can express the case runs in the same
process on the same inputs: ``triton_median_ms`` from ``triton.testing.do_bench``, TFLOP/s over the
visible pairs (4·D per pair forward, 2.5× that backward, 3.5× forward+backward), peak memory of one call above
the inputs, and the max difference of its output from the ``triton`` output (a harness check).

SDPA flash and cudnn get ``is_causal`` (they take no other mask); SDPA efficient and math get the
dense mask a user would build (math only where ``B·H·M²`` floats fit in 4 GiB); FlexAttention is
compiled, with a BlockMask from compiled ``create_block_mask`` (masks) or a ``score_mod`` (additive,
ALiBi). Writes ``attention.csv`` (long format, with device, versions, commit, date),
``attention.md`` and one PNG per head dim into ``--out``; ``--base CSV`` flags regressions of the
``triton`` rows against a stored run. ``--timing graph`` times CUDA-graph replays of each call
instead (GPU work only: no host time, no launch gaps; FlexAttention's packed documents there ended in an
illegal memory access on the H200 with torch 2.11, and a run of that point alone did not finish in four minutes:
time that point eager), and ``--point-rounds N`` times every
provider of a point in N rounds, each starting with the next provider, and keeps the median round, so that
a drift of the GPU's clocks (this H200 runs at its power cap on dense work) or the host's work after a
compilation does not favour or penalize whoever runs first.

    PYTHONPATH=. python benchmarks/bench_attention.py                  # into benchmarks/results/<device>, e.g. h100
    PYTHONPATH=. python benchmarks/bench_attention.py --quick          # a few rows, to check the harness
    PYTHONPATH=. python benchmarks/bench_attention.py --timing graph --point-rounds 3 --cases causal window \
        --seqlens 2048 8192 --head-dims 128 --out /tmp/masks_graph   # GPU time only, kept apart
    PYTHONPATH=. python benchmarks/bench_attention.py --tune           # time the tile configs of each kernel
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import CASE_NAMES, git_commit, make_case, results_dir  # noqa: E402

import biasattn as ba  # noqa: E402

TOKENS = 16384
HEADS = 16
CASE_ARGS: dict = {}  # make_case options set from the command line (--window, --docs)
SDPA = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa_math": SDPBackend.MATH}
PROVIDERS = ("triton", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "flex")
MATH_LIMIT_BYTES = 4 * 2**30


class Flex:
    """Compiled FlexAttention and compiled BlockMask construction, shared across cases."""

    def __init__(self):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch._dynamo.config.cache_size_limit = 256
        self.attn = torch.compile(flex_attention, dynamic=False)
        self.create_block_mask = create_block_mask

    def fn(self, case):
        q, k, v = case.q, case.k, case.v
        B, H, M = q.shape[0], q.shape[1], q.shape[2]
        block_mask = None
        if case.flex_mask_mod is not None:
            per_b = case.name == "padded"
            per_h = case.name == "block_sparse"
            sizes = (case.flex_mask_mod, B if per_b else None, H if per_h else None, M, k.shape[2])
            try:
                block_mask = self.create_block_mask(*sizes, device=q.device, _compile=True)
            except TypeError:  # newer torch: compile create_block_mask itself
                block_mask = torch.compile(self.create_block_mask)(*sizes, device=q.device)
        score_mod = case.flex_score_mod
        return lambda: self.attn(q, k, v, score_mod=score_mod, block_mask=block_mask)


def provider_fn(name: str, case, flex: Flex | None):
    """A zero-argument callable computing the case's attention output, or None if ``name`` cannot express it."""
    q, k, v = case.q, case.k, case.v
    if name == "triton":
        bias = case.bias.to(q.device) if case.bias is not None else None  # tensor-free masks are built on the CPU
        return lambda: ba.attention(q, k, v, bias, op="triton")
    if name == "flex":
        return flex.fn(case) if flex is not None else None
    if name in ("sdpa_flash", "sdpa_cudnn"):
        if case.name not in ("none", "causal"):
            return None
        backend = SDPA[name]

        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=case.is_causal)

        return run
    B, H, M, Mk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if name == "sdpa_math" and B * H * M * Mk * 4 > MATH_LIMIT_BYTES:
        return None
    mask = None if case.name in ("none", "causal") else case.dense_mask()
    backend = SDPA[name]

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=case.is_causal)

    return run


def _call(fn, inputs, mode: str):
    """``(call, out)``: the timed call (forward; forward+backward with a fixed random dout; or the backward
    alone, on the graph of one forward kept for every call) and one output."""
    if mode == "bwd":
        kept = fn()
        dout = torch.randn_like(kept)
        return (lambda: torch.autograd.grad(kept, inputs, dout, retain_graph=True)), kept.detach()
    out = fn().detach()  # no autograd graph kept alive: a CUDA-graph capture of the call needs none around
    if mode == "fwd":
        return fn, out
    dout = torch.randn_like(out)

    def call():
        o = fn()
        return torch.autograd.grad(o, inputs, dout)

    return call, out


def _graphed(call):
    """``call`` captured in a CUDA graph (after warm-up calls on a side stream); returns the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    torch.cuda.synchronize()
    return graph


def prepare(fn, inputs, mode: str, timing: str = "eager"):
    """``(timer, peak MiB above the inputs, output)``; ``timer()`` returns ``(median ms, 20% ms, 80% ms)``.

    ``timing="eager"`` times the eager call with ``triton.testing.do_bench`` (host work included, as a training
    loop pays it); ``"graph"`` times replays of the call captured in a CUDA graph (GPU work only)."""
    call, out = _call(fn, inputs, mode)
    call()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    target = call if timing == "eager" else _graphed(call).replay
    # 100 ms of warm-up: an idle GPU (after building the case, compiling) needs time to reach its clocks
    return (lambda: tuple(triton.testing.do_bench(target, warmup=100, rep=50, quantiles=[0.5, 0.2, 0.8]))), peak, out


def _warm(job) -> str:
    """Run one case's forward and backward at a small size, so its kernels land in Triton's disk cache.

    ``job`` is ``(case, D, B[, index_64[, {kernel: TileConfig}]])``."""
    case_name, D, B, *rest = job
    index_64 = bool(rest and rest[0])
    forced = rest[1] if len(rest) > 1 else {}
    try:
        from biasattn.ops.triton import configs, options

        case = make_case(case_name, B=B, H=2, M=512, D=D, requires_grad=True)
        bias = case.bias.to(case.q.device) if case.bias is not None else None
        with configs.override(**forced), options.use(force_index_64=index_64):
            out = ba.attention(case.q, case.k, case.v, bias, op="triton")
            out.sum().backward()
        torch.cuda.synchronize()
    except Exception as e:  # reported; the sweep records the error where it matters
        return f"{case_name} D={D} B={B} {forced}: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
    return f"{case_name} D={D} B={B}: ok"


def _pool_map(jobs, workers: int) -> None:
    import concurrent.futures
    import multiprocessing

    t0 = time.time()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for line in pool.map(_warm, jobs):
            if not line.endswith(": ok"):
                print("precompile", line, flush=True)
    print(f"precompiled {len(jobs)} kernel sets in {time.time() - t0:.0f} s", flush=True)


def precompile(cases, head_dims, workers: int, index_64=(False,)) -> None:
    """Compile every (case, head dim) kernel set in parallel processes (Triton compiles one kernel at a time)."""
    jobs = [(c, D, B, i) for c in cases for D in head_dims for B in ((1, 2) if c == "additive" else (2,)) for i in index_64]
    _pool_map(jobs, workers)


def time_rounds(timed: list, rounds: int) -> None:
    """Run every ``(row, timer, times)`` of a point's providers ``rounds`` times, appending each timer's result to
    its ``times``; round ``r`` starts at the ``r``-th provider, so that no provider always runs first (right after
    another one's compilation, or on clocks that have just ramped). A timer that raises marks its row."""
    for r in range(rounds if timed else 0):
        for row, timer, times in timed[r % len(timed):] + timed[:r % len(timed)]:
            try:
                times.append(timer())
            except Exception as e:
                row.update(status=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")


def run_sweep(args) -> list[dict]:
    device = torch.cuda.get_device_name()
    meta = dict(device=device, torch=torch.__version__, triton=triton.__version__, commit=git_commit(),
                date=datetime.date.today().isoformat(), dtype="bfloat16")
    flex = Flex() if "flex" in args.providers else None
    def seqlens(D):
        return args.seqlens_64 if D == 64 and args.seqlens_64 else args.seqlens

    points = [(c, M, D, mode) for D in args.head_dims for M in seqlens(D) for c in args.cases for mode in args.modes]
    # the points FlexAttention runs at first, so a run cut short still holds the headline comparisons
    points.sort(key=lambda p: (p[2] not in args.flex_head_dims, p[1] not in args.flex_seqlens))
    try:
        from tqdm import tqdm

        bar = tqdm(points, desc="attention", file=sys.stdout, mininterval=5)
    except ImportError:
        bar = points
    rows, kept = [], []
    for case_name, M, D, mode in bar:
        B = max(1, TOKENS // M)
        grad = mode != "fwd"
        case = make_case(case_name, B=B, H=HEADS, M=M, D=D, requires_grad=grad, **CASE_ARGS)
        inputs = [case.q, case.k, case.v]
        if case.name == "additive" and grad:
            inputs.append(case.dense_mask())  # the additive tensor itself: its gradient is part of the work
        ref = None
        timed = []  # (row, timer, times): every provider of the point, timed in alternating rounds
        for name in args.providers:
            if name == "flex" and (M not in args.flex_seqlens or D not in args.flex_head_dims):
                continue
            row = dict(meta, case=case_name, B=case.q.shape[0], H=HEADS, M=M, D=D, mode=mode, provider=name,
                       timing=args.timing)
            try:
                fn = provider_fn(name, case, flex)
                if fn is None:
                    continue
                timer, peak, out = prepare(fn, inputs, mode, args.timing)
                if ref is None and name == "triton":
                    ref = out
                diff = float((out.float() - ref.float()).abs().max()) if ref is not None else float("nan")
                row.update(peak_mib=peak, maxdiff_vs_triton=diff, status="ok")
                timed.append((row, timer, []))
            except Exception as e:  # a provider that refuses the inputs or runs out of memory
                row.update(ms=float("nan"), status=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            rows.append(row)
        time_rounds(timed, args.point_rounds)
        for row, _, times in timed:
            if times and row["status"] == "ok":
                ms, lo, hi = sorted(times)[len(times) // 2]  # the round with the median time
                row.update(ms=ms, ms_q20=lo, ms_q80=hi, tflops=case.flops(mode) / ms / 1e9)
            else:
                row.setdefault("ms", float("nan"))
        if args.timing == "graph":  # graphs live to the end: freeing several providers' graphs and their
            kept.append(timed)      # pools mid-run made the next CUDA call fail on the H200 (torch 2.11)
        else:
            del timed
            torch.cuda.empty_cache()
        del case
        if args.csv_path:
            write_csv(rows, args.csv_path)  # after every point: a run stopped early keeps what it measured
    return rows


def write_csv(rows: list[dict], path: str) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def markdown(rows: list[dict]) -> str:
    """One table per mode: TFLOP/s per provider, then triton's speed over each peer (time ratio)."""
    runs = dict.fromkeys((r["commit"], r["date"]) for r in rows)  # tables joined from runs of several commits
    dims = {run: ", ".join(dict.fromkeys(str(r["D"]) for r in rows if (r["commit"], r["date"]) == run)) for run in runs}
    measured = "; ".join(f"commit {c}, {d}" + (f" (D={dims[c, d]})" if len(runs) > 1 else "") for c, d in runs)
    lines = [f"# Attention benchmark ({rows[0]['device']}, torch {rows[0]['torch']}, triton {rows[0]['triton']}, "
             f"{measured}, bf16, H={HEADS}, B·M={TOKENS})", "",
             "TFLOP/s over visible pairs (median of do_bench over "
             + ("CUDA-graph replays: GPU work only" if rows[0].get("timing") == "graph" else "eager calls: host work included")
             + "); `x peer` = peer time / triton time; peak MiB of triton.", ""]
    keys = list(dict.fromkeys((r["mode"], r["D"], r["M"], r["case"]) for r in rows))
    for mode in dict.fromkeys(k[0] for k in keys):
        peers = [p for p in PROVIDERS if any(r["provider"] == p and r["mode"] == mode for r in rows)]
        head = ["D", "M", "case"] + peers + [f"x {p}" for p in peers if p != "triton"] + ["triton MiB"]
        lines += [f"## {mode}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for _, D, M, case in [k for k in keys if k[0] == mode]:
            got = {r["provider"]: r for r in rows if (r["mode"], r["D"], r["M"], r["case"]) == (mode, D, M, case)}
            ok = {p: r for p, r in got.items() if r.get("status") == "ok"}
            cells = [str(D), str(M), case]
            cells += [f"{ok[p]['tflops']:.0f}" if p in ok else ("err" if p in got else "") for p in peers]
            t = ok.get("triton")
            cells += [f"{ok[p]['ms'] / t['ms']:.2f}" if (t and p in ok) else "" for p in peers if p != "triton"]
            cells.append(f"{t['peak_mib']:.0f}" if t else "")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    errors = [r for r in rows if r.get("status") != "ok"]
    if errors:
        lines += ["## Errors", ""]
        lines += [f"- {r['provider']} {r['case']} M={r['M']} D={r['D']} {r['mode']}: {r['status']}" for r in errors]
    return "\n".join(lines) + "\n"


def plots(rows: list[dict], out_dir: str) -> list[str]:
    """One PNG per head dim: a grid of cases × modes, TFLOP/s against sequence length per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for D in sorted({r["D"] for r in rows}):
        sub = [r for r in rows if r["D"] == D and r.get("status") == "ok"]
        cases = list(dict.fromkeys(r["case"] for r in sub))
        modes = list(dict.fromkeys(r["mode"] for r in sub))
        fig, axes = plt.subplots(len(modes), len(cases), figsize=(3.2 * len(cases), 3 * len(modes)), squeeze=False)
        for i, mode in enumerate(modes):
            for j, case in enumerate(cases):
                ax = axes[i][j]
                for p in PROVIDERS:
                    pts = sorted((r["M"], r["tflops"]) for r in sub
                                 if r["case"] == case and r["mode"] == mode and r["provider"] == p)
                    if pts:
                        ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=p, lw=2 if p == "triton" else 1)
                ax.set_xscale("log", base=2)
                ax.set_title(f"{case} {mode}", fontsize=9)
                ax.set_xlabel("M")
                if j == 0:
                    ax.set_ylabel("TFLOP/s")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{rows[0]['device']}, bf16, D={D}, H={HEADS}, B·M={TOKENS}")
        fig.tight_layout()
        path = os.path.join(out_dir, f"attention_d{D}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def compare(rows: list[dict], base_path: str, threshold: float = 0.9) -> list[str]:
    """Lines naming triton rows slower than ``threshold`` × the stored run's speed."""
    with open(base_path) as f:
        base = {(r["case"], r["M"], r["D"], r["mode"]): r for r in csv.DictReader(f) if r["provider"] == "triton"}
    out = []
    for r in rows:
        b = base.get((r["case"], str(r["M"]), str(r["D"]), r["mode"]))
        if r["provider"] == "triton" and b and r.get("status") == "ok" and b.get("status") == "ok":
            ratio = float(b["ms"]) / r["ms"]
            if ratio < threshold:
                out.append(f"REGRESSION {r['case']} M={r['M']} D={r['D']} {r['mode']}: {ratio:.2f}x of the stored speed")
    return out


def tune(args) -> None:
    """Time every candidate tile config of each kernel on the first case, alternated over ``--rounds``,
    and print the medians (``--dropout``: the candidates in the order dropout tries them, every call
    with that dropout probability; ``--timing graph``: CUDA-graph replays, the GPU's time alone)."""
    from biasattn.ops.triton import configs

    feats = ("dropout",) if args.dropout else ()

    def cands(kernel, D):  # the list, then the first tile where rows see few keys if it is not in it
        short = configs._candidates_for(kernel, D, torch.bfloat16, feats + ("short_span", "short_span_dkdv"))
        return tuple(dict.fromkeys(configs._candidates_for(kernel, D, torch.bfloat16, feats) + short))

    jobs = [(c, D, 1 if c == "additive" else 2, False, {kernel: cfg}) for c in args.cases for D in args.head_dims
            for kernel in args.kernels for cfg in cands(kernel, D)]
    _pool_map(jobs, args.precompile or 8)
    graphs = {}  # with --timing graph, every graph lives to the end (see run_sweep)
    for case_name in args.cases:
        for D in args.head_dims:
            M = args.seqlens[0]
            case = make_case(case_name, B=max(1, TOKENS // M), H=HEADS, M=M, D=D, requires_grad=True, **CASE_ARGS)
            if case.bias is not None:
                case.bias = case.bias.to(case.q.device)
            q, k, v = case.q, case.k, case.v
            with torch.no_grad():  # no autograd graph kept alive: a CUDA-graph capture needs none around
                dout = torch.randn_like(ba.attention(q, k, v, case.bias, op="triton"))
            for kernel in args.kernels:
                times = {cfg: [] for cfg in cands(kernel, D)}
                for _ in range(args.rounds):  # candidates alternated, so that drift spreads over all of them
                    for cfg, ms in times.items():
                        with configs.override(**{kernel: cfg}):
                            try:
                                call = _tune_call(case, dout, kernel == "fwd", args.dropout)
                                if args.timing == "graph":
                                    key = (case_name, D, kernel, cfg)
                                    if key not in graphs:
                                        graphs[key] = _graphed(call)
                                    call = graphs[key].replay
                                ms.append(triton.testing.do_bench(call, warmup=10, rep=50))
                            except Exception as e:
                                ms.append(type(e).__name__)
                for cfg, ms in times.items():
                    failed = next((m for m in ms if isinstance(m, str)), None)
                    shown = failed or f"{statistics.median(ms):.3f} ms"
                    print(f"tune {case_name} M={M} D={D} {kernel} {cfg}: {shown}", flush=True)


def _tune_call(case, dout, fwd_only: bool, dropout_p: float = 0.0):
    q, k, v = case.q, case.k, case.v
    if fwd_only:
        return lambda: ba.attention(q, k, v, case.bias, dropout_p=dropout_p, op="triton")
    wrt = (q, k, v, case.dense_mask()) if case.name == "additive" else (q, k, v)  # the bias gradient too
    return lambda: torch.autograd.grad(ba.attention(q, k, v, case.bias, dropout_p=dropout_p, op="triton"), wrt, dout)


AB_SWITCHES = {  # name: (launch option, state A, state B, value A, value B)
    "offsets": ("force_index_64", "32-bit in-slice offsets", "64-bit in-slice offsets", False, True),
    "concurrent": ("concurrent_bwd", "dQ beside dK/dV on a side stream", "dQ after dK/dV", True, False),
    "direct": ("direct_launch", "direct launches of compiled kernels", "Triton's kernel[grid] launches", True, False),
    "delta": ("fused_delta", "delta computed by dQ", "delta preprocessing launch", True, False),
    "tma": ("descriptors", "forward K/V tiles through tensor descriptors", "forward K/V through pointer loads", True, False),
    "order": ("order_tail_waves", "last pairs started rank by rank", "plain order", 4, 0),
    "dq_from_ds": ("dq_from_ds", "dQ read back from a per-(batch, head) bias gradient", "dQ recomputing S and dP",
                   True, False),
    "gluon": ("gluon_forward", "forwards at D=128 and 256 (no bias, interval masks, block layouts) in Gluon",
              "in the triton.language kernel", True, False),
    "gluon_min": ("gluon_min_scores", "Gluon kernels from any number of scores (the D=128 backward: see gluon_bwd_min)",
                  "from 2^26 scores", 0, 2**26),
    "gluon_layout": ("gluon_layout_min_scores", "block layouts in Gluon from 2^29 scores", "from 2^30 scores",
                     2**29, 2**30),
    "gluon_bwd_min": ("gluon_bwd_min_visible", "the Gluon backward at D=128 on calls of any size",
                      "from 110M visible scores", 0, 110_000_000),
    "gluon_bwd": ("gluon_backward", "backwards at D=64, 128 and 256 (no bias, interval masks, block layouts) in Gluon",
                  "in the triton.language kernels", True, False),
}


def ab_switch(args) -> None:
    """``triton`` with a launcher switch in state A against state B, same process, same inputs, rounds alternated:
    eager calls (host work included) or, with ``--timing graph``, CUDA-graph replays of calls captured in each
    state (GPU work alone)."""
    from biasattn.ops.triton import options

    field, name_a, name_b, a, b = AB_SWITCHES[args.ab]
    kept = []
    precompile(args.cases, args.head_dims, args.precompile or 8, index_64=(False, True) if args.ab == "offsets" else (False,))
    for D in args.head_dims:
        for M in args.seqlens:
            for case_name in args.cases:
                for mode in args.modes:
                    case = make_case(case_name, B=max(1, args.tokens // M), H=HEADS, M=M, D=D, requires_grad=mode != "fwd",
                                     **CASE_ARGS)
                    inputs = [case.q, case.k, case.v]
                    if case.name == "additive" and mode != "fwd":
                        inputs.append(case.dense_mask())
                    fn = provider_fn("triton", case, None)
                    timers, ms = {}, {a: [], b: []}
                    for flag in (a, b):
                        with options.use(**{field: flag}):
                            timers[flag] = prepare(fn, inputs, mode, args.timing)[0]
                    for _ in range(args.rounds):
                        for flag in (a, b):
                            with options.use(**{field: flag}):  # eager calls read the switch as they run
                                ms[flag].append(timers[flag]()[0])
                    ta, tb = sorted(ms[a])[args.rounds // 2], sorted(ms[b])[args.rounds // 2]
                    print(f"ab D={D} M={M} {case_name} {mode} ({args.timing}): {name_a} {ta:.3f} ms, {name_b} {tb:.3f} ms, "
                          f"B/A time {tb / ta:.3f}", flush=True)
                    if args.timing == "graph":
                        kept.append(timers)  # graphs live to the end, as in run_sweep
                    del case, timers


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="output folder (default: benchmarks/results/<device>, e.g. h100)")
    p.add_argument("--cases", nargs="+", default=list(CASE_NAMES), choices=CASE_NAMES)
    p.add_argument("--seqlens", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "bwd", "fwd+bwd"])
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    p.add_argument("--flex-seqlens", nargs="+", type=int, default=[2048, 8192],
                   help="sequence lengths at which FlexAttention runs (each costs a compile)")
    p.add_argument("--flex-head-dims", nargs="+", type=int, default=[128])
    p.add_argument("--precompile", type=int, default=8, help="processes that compile the triton kernels first (0: none)")
    p.add_argument("--seqlens-64", nargs="+", type=int, default=[2048, 8192], help="sequence lengths for D=64")
    p.add_argument("--base", help="a stored attention.csv to compare triton rows against")
    p.add_argument("--render", help="only write attention.md and the PNGs from this attention.csv (into its folder "
                                     "unless --out names another)")
    p.add_argument("--quick", action="store_true", help="causal and no bias at M=2048, D=128")
    p.add_argument("--tune", action="store_true", help="time each kernel's candidate tile configs")
    p.add_argument("--dropout", type=float, default=0.0, help="with --tune: the dropout probability of every call")
    p.add_argument("--tokens", type=int, default=TOKENS, help="with --ab: B·M of every case")
    p.add_argument("--window", type=int, default=1024, help="keys left of the diagonal that the window case sees")
    p.add_argument("--docs", nargs=2, type=int, default=[8, 32], metavar=("MIN", "MAX"),
                   help="the varlen case packs between MIN and MAX causal documents into each B·M tokens")
    p.add_argument("--kernels", nargs="+", default=["fwd", "dkdv", "dq"], choices=["fwd", "dkdv", "dq", "dbias", "dq_ds"],
                   help="kernels whose configs --tune times")
    p.add_argument("--ab", choices=list(AB_SWITCHES), help="A/B of a launcher switch (triton only): " + "; ".join(
        f"{k}: {v[1]} vs {v[2]}" for k, v in AB_SWITCHES.items()))
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of --ab and --tune (medians reported)")
    p.add_argument("--point-rounds", type=int, default=1,
                   help="sweep: time each point's providers in this many alternating rounds (the median round is kept)")
    p.add_argument("--timing", default="eager", choices=["eager", "graph"],
                   help="sweep, --ab and --tune: time eager calls (host work included) or CUDA-graph replays (GPU work only)")
    args = p.parse_args(argv)
    CASE_ARGS["window"] = args.window
    CASE_ARGS["docs"] = tuple(args.docs)
    if args.quick:
        args.cases, args.seqlens, args.head_dims = ["none", "causal"], [2048], [128]
    args.out = args.out or (os.path.dirname(os.path.abspath(args.render)) if args.render else results_dir())
    os.makedirs(args.out, exist_ok=True)
    args.csv_path = os.path.join(args.out, "attention.csv")
    if args.render:
        with open(args.render) as f:
            rows = [_typed(r) for r in csv.DictReader(f)]
        return _report(rows, args)
    if args.ab:
        ab_switch(args)
        return 0
    if args.tune:
        tune(args)
        return 0
    if args.precompile:
        precompile(args.cases, args.head_dims, args.precompile)
    if args.timing == "graph" and set(args.providers) - {"triton", "flex"}:
        # graphs of SDPA's flash/cuDNN calls beside the others left a CUDA error behind (torch 2.11, H200)
        print("--timing graph times triton and flex only; SDPA backends run with --timing eager")
        args.providers = [p for p in args.providers if p in ("triton", "flex")]
    t0 = time.time()
    rows = run_sweep(args)
    write_csv(rows, args.csv_path)
    _report(rows, args)
    print(f"sweep took {time.time() - t0:.0f} s")
    return 0


def _typed(r: dict) -> dict:
    out = dict(r)
    for k in ("B", "H", "M", "D"):
        out[k] = int(r[k])
    for k in ("ms", "ms_q20", "ms_q80", "tflops", "peak_mib", "maxdiff_vs_triton"):
        if r.get(k) not in (None, ""):
            out[k] = float(r[k])
    return out


def _report(rows: list[dict], args) -> int:
    md = markdown(rows)
    with open(os.path.join(args.out, "attention.md"), "w") as f:
        f.write(md)
    plots(rows, args.out)
    print(md)
    if args.base:
        print("\n".join(compare(rows, args.base)) or "no regressions against the stored run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
