"""Decode benchmark: ``triton_splitk`` against PyTorch SDPA flash and cuDNN, in GB/s of K+V read.

Each point times one decoding step (q ``[B, Hq, Mq, 128]`` against a cache of Mk keys, bf16) with
``triton.testing.do_bench`` (median). Calls are captured in a CUDA graph, several per graph over
distinct buffers when one set of K/V would fit in L2, so that launch overhead and cache hits stay
out of the numbers. The device-copy bandwidth is measured in the same process; the target is 90%
of it. With ``--floor`` every point also gets the GB/s of the fastest one-launch kernel that only
reads its K and V (``tools/read_floor.py``): what launch latency and size leave reachable at that point.
Writes ``decode.csv`` (long format), ``decode.md`` and ``decode.png`` into ``--out``.

    PYTHONPATH=. python benchmarks/bench_decode.py --floor    # into benchmarks/results/<device>, e.g. h100
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import biasattn as ba
from biasattn.inputs import make_inputs
from biasattn.ops.common import num_sms
from biasattn.ops.triton.splitk import SplitKConfig, splitk_attention_fwd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import git_commit, results_dir  # noqa: E402
from tools.read_floor import VARIANTS, read_floor_fn  # noqa: E402

D = 128
DTYPE = torch.bfloat16
L2_BYTES = 512 * 2**20  # rotate buffers until one graph touches this much
MAX_KV_BYTES = 40 * 2**30
GRID = dict(B=(1, 4, 16, 64), heads=((32, 32), (32, 8), (32, 1)), Mk=(1024, 8192, 32768, 131072), Mq=(1, 4))
PEERS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def copy_bandwidth() -> float:
    """Device-to-device copy, GB/s counting bytes read plus bytes written."""
    x = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=20, rep=200, return_mode="median")
    return 2 * x.numel() * x.element_size() / ms / 1e6


def graph_time(fn, sets) -> float:
    """Median ms of one call: ``fn`` on every buffer set, captured in one CUDA graph, divided by the sets."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in sets[:2]:
            fn(*s)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in sets:
            fn(*s)
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median")
    del graph
    return ms / len(sets)


def make_sets(B, Hq, Hkv, Mq, Mk):
    """Random q/k/v sets, enough of them that one graph over all touches more memory than L2 holds."""
    kv_bytes = 2 * B * Hkv * Mk * D * 2
    n = max(1, min(16, math.ceil(L2_BYTES / kv_bytes)))
    sets = []
    for _ in range(n):
        q = torch.randn(B, Hq, Mq, D, device="cuda", dtype=DTYPE)
        k = torch.randn(B, Hkv, Mk, D, device="cuda", dtype=DTYPE)
        v = torch.randn(B, Hkv, Mk, D, device="cuda", dtype=DTYPE)
        sets.append((q, k, v))
    return sets


FRESH_BIASES = {  # --bias: a bias built anew for every call, as a decode loop builds one per step
    "causal": lambda B, Mk: ba.LowerTriangularFromBottomRightMask(),
    "padded": lambda B, Mk: ba.PaddedKeysMask([Mk - 1 - (b % 3) for b in range(B)], device="cuda"),
}


def provider_fn(name, Hq, Hkv, bias=None):
    """One decoding call of provider ``name`` as ``fn(q, k, v)``; ``bias``: a key of
    :data:`FRESH_BIASES`, built anew in every call of our operators (peers get no mask)."""
    if name in ("triton_splitk", "cudnn", "dispatched"):  # our operators, forced, or the dispatcher's choice
        op = None if name == "dispatched" else name
        if bias is None:
            return lambda q, k, v: ba.attention(q, k, v, op=op)
        make = FRESH_BIASES[bias]
        return lambda q, k, v: ba.attention(q, k, v, make(q.shape[0], k.shape[2]), op=op)
    backend = PEERS[name]

    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=Hq != Hkv)

    return run


def eager_times(fns: dict, sets, calls: int = 200, rounds: int = 7, grow: int = 0) -> dict:
    """Median ms per call of each of ``fns`` over ``calls`` eager calls made back to back (host work
    included: a host-bound call is timed by its host, a GPU-bound one by its kernels), cycling
    through the buffer sets. Rounds alternate the functions (in a rotating order), so a host whose
    speed drifts slows them alike. A function that raises gets NaN.
    ``grow``: call ``i`` of a round sees the first ``Mk - grow + i % grow`` keys (views), as a decode
    loop sees a cache that grows by one key per step: every call has new sizes."""
    Mk = sets[0][1].shape[2]

    def loop(fn, n):
        for i in range(n):
            q, k, v = sets[i % len(sets)]
            if grow:
                m = Mk - grow + i % grow
                k, v = k[:, :, :m], v[:, :, :m]
            fn(q, k, v)
        torch.cuda.synchronize()

    live, times = {}, {name: [] for name in fns}
    for name, fn in fns.items():
        try:
            loop(fn, 20)
            live[name] = fn
        except Exception:  # a backend refusing these inputs
            torch.cuda.synchronize()
    names = list(live)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)] if names else []:
            t = time.perf_counter()
            loop(live[name], calls)
            times[name].append((time.perf_counter() - t) / calls * 1e3)
    return {name: statistics.median(ts) if ts else float("nan") for name, ts in times.items()}


_FLOORS: dict = {}  # (B, Hkv, Mk) -> ms: the read floor does not depend on the queries


def floor_time(sets, timer=graph_time) -> float:
    """Median ms of the fastest :mod:`read_floor` variant on these K/V sets."""
    sms = num_sms(sets[0][1].device)
    return min(timer(read_floor_fn(per_sm * sms, block), sets) for per_sm, block in VARIANTS)


def bench_point(B, Hq, Hkv, Mq, Mk, providers, timer=graph_time, bias=None):
    """``[(provider, ms, GB/s, note)]`` for one shape (``bias``: see :func:`provider_fn`)."""
    sets = make_sets(B, Hq, Hkv, Mq, Mk)
    kv_bytes = 2 * B * Hkv * Mk * D * 2
    rows = []
    for name in providers:
        try:
            if name == "read_floor":
                key = (B, Hkv, Mk, timer)
                ms = _FLOORS[key] = _FLOORS[key] if key in _FLOORS else floor_time(sets, timer)
            else:
                ms = timer(provider_fn(name, Hq, Hkv, bias), sets)
            rows.append((name, ms, kv_bytes / ms / 1e6, ""))
        except Exception as e:  # a backend refusing these inputs is a result too
            rows.append((name, float("nan"), float("nan"), type(e).__name__ + ": " + str(e).split("\n")[0][:120]))
            torch.cuda.synchronize()
    del sets
    return rows


def padded_experiment(out_rows, meta):
    """Mixed cache lengths: time should follow the keys present, not the padded maximum."""
    B, Hq, Hkv, Mk = 16, 32, 8, 32768
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(Mk // 8, Mk + 1, (B,), generator=gen).tolist()
    sets = make_sets(B, Hq, Hkv, 1, Mk)
    full = graph_time(provider_fn("triton_splitk", Hq, Hkv), sets)
    bias = ba.PaddedKeysMask(lens, device=sets[0][0].device)
    mixed = graph_time(lambda q, k, v: ba.attention(q, k, v, bias, op="triton_splitk"), sets)
    present = sum(lens) / (B * Mk)
    for name, ms, frac in (("triton_splitk", full, 1.0), ("triton_splitk_padded", mixed, present)):
        gbps = 2 * Hkv * sum(lens if frac < 1 else [Mk] * B) * D * 2 / ms / 1e6
        note = f"keys present {frac:.3f}"
        out_rows.append(dict(meta, provider=name, B=B, Hq=Hq, Hkv=Hkv, Mq=1, Mk=Mk, ms=ms, GBps=gbps, note=note))
    print(f"padded keys: {present:.3f} of the keys present; time ratio {mixed / full:.3f}")


def sweep(meta):
    """Tile-config variants on a few shapes (launcher called directly, graph-timed)."""
    shapes = [(1, 32, 8, 1, 32768), (1, 32, 32, 1, 131072), (16, 32, 32, 1, 8192), (4, 32, 1, 4, 32768),
              (64, 32, 1, 4, 32768), (16, 32, 1, 4, 131072), (64, 32, 8, 4, 8192)]
    configs = [(64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (128, 8, 2), (32, 4, 4), (64, 4, 2)]
    for B, Hq, Hkv, Mq, Mk in shapes:
        sets = make_sets(B, Hq, Hkv, Mq, Mk)
        kv_bytes = 2 * B * Hkv * Mk * D * 2
        line = []
        for bn, w, st in configs:
            rows = Hq // Hkv * Mq
            bm = min(max(16, triton.next_power_of_2(rows)), 128)
            cfg = SplitKConfig(bm, bn, 8 if bm > 64 else w, st)

            def fn(q, k, v, cfg=cfg):
                return splitk_attention_fwd(make_inputs(q, k, v), config=cfg)

            try:
                ms = graph_time(fn, sets)
                line.append(f"N{bn}w{w}s{st}={kv_bytes / ms / 1e6:.0f}")
            except Exception as e:
                line.append(f"N{bn}w{w}s{st}=ERR({type(e).__name__})")
        print(f"sweep B={B} {Hq}/{Hkv} Mq={Mq} Mk={Mk}: " + " ".join(line), flush=True)
        del sets


SPLIT_SHAPES = [(1, 32, 32, 1, 1024), (4, 32, 32, 1, 1024), (1, 32, 32, 1, 8192), (1, 32, 8, 1, 1024),
                (1, 32, 8, 1, 8192), (4, 32, 8, 1, 1024), (16, 32, 8, 1, 1024), (1, 32, 1, 1, 8192),
                (1, 32, 1, 1, 32768), (4, 32, 1, 1, 8192), (16, 32, 1, 1, 1024), (64, 32, 1, 1, 1024)]


def split_counts(meta):
    """Every split count on the small caches where launches weigh most, next to the heuristic's choice and cuDNN."""
    from biasattn.ops.triton import splitk

    for B, Hq, Hkv, Mq, Mk in SPLIT_SHAPES:
        sets = make_sets(B, Hq, Hkv, Mq, Mk)
        kv_bytes = 2 * B * Hkv * Mk * D * 2
        chosen = []
        original = splitk.choose_num_splits

        def spy(*a, chosen=chosen, original=original, **kw):
            chosen.append(original(*a, **kw))
            return chosen[-1]

        splitk.choose_num_splits = spy
        try:
            auto = graph_time(lambda q, k, v: splitk_attention_fwd(make_inputs(q, k, v)), sets)
        finally:
            splitk.choose_num_splits = original
        cudnn = graph_time(provider_fn("sdpa_cudnn", Hq, Hkv), sets)
        line = [f"auto(S={chosen[0]})={kv_bytes / auto / 1e6:.0f}", f"cudnn={kv_bytes / cudnn / 1e6:.0f}"]
        default = splitk.launch_shape(make_inputs(*sets[0])).config  # the row block the launcher picks here
        bm = default.block_m
        variants = ((64, 4, 4), (128, 8, 3), (32, 4, 6))
        configs = [default] + [SplitKConfig(bm, bn, 8 if bm > 64 else w, st) for bn, w, st in variants]
        for cfg in dict.fromkeys(configs):
            tag = " (default)" if cfg == default else ""
            line.append(f"| M{cfg.block_m}N{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}{tag}")
            for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
                fn = lambda q, k, v, s=s, cfg=cfg: splitk_attention_fwd(make_inputs(q, k, v), num_splits=s, config=cfg)  # noqa: E731
                ms = graph_time(fn, sets)
                line.append(f"S{s}={kv_bytes / ms / 1e6:.0f}")
        print(f"splits B={B} {Hq}/{Hkv} Mq={Mq} Mk={Mk}: " + " ".join(line), flush=True)
        del sets


def write_markdown(rows, path, copy_gbps):
    target = 0.9 * copy_gbps
    lines = [
        f"# Decode, {rows[0]['device']}, bf16, D=128 (GB/s of K+V read; CUDA-graph timed, median)",
        "",
        f"Device copy: {copy_gbps:.0f} GB/s (read+write); target = 90% = {target:.0f} GB/s.",
        f"torch {rows[0]['torch']}, triton {rows[0]['triton']}, commit {rows[0]['commit']}, {rows[0]['date']}.",
        "",
    ]
    floors = any(r["provider"] == "read_floor" for r in rows)
    head = "| B | Hq/Hkv | Mq | Mk | triton_splitk | sdpa_flash | sdpa_cudnn | vs best SDPA | % of copy |"
    if floors:
        head += " read floor | % of floor |"
        lines[2] += (" Read floor: the fastest one-launch kernel that only reads the point's K and V"
                     " (`tools/read_floor.py`), in the same process.")
    lines += [head, "|---" * (head.count("|") - 1) + "|"]
    keyed = {}
    for r in rows:
        keyed.setdefault((r["B"], r["Hq"], r["Hkv"], r["Mq"], r["Mk"]), {})[r["provider"]] = r
    for (B, Hq, Hkv, Mq, Mk), p in keyed.items():
        if "sdpa_flash" not in p:
            continue
        ours = p["triton_splitk"]["GBps"]
        peers = [p[n]["GBps"] for n in PEERS if n in p and not math.isnan(p[n]["GBps"])]
        best = max(peers) if peers else float("nan")
        cells = [f"{p[n]['GBps']:.0f}" if n in p and not math.isnan(p[n]["GBps"]) else "n/a" for n in ("triton_splitk", *PEERS)]
        tail = f" | {ours / best:.2f}x | {100 * ours / copy_gbps:.0f}% |"
        if floors:
            floor = p["read_floor"]["GBps"] if "read_floor" in p else float("nan")
            tail += f" {floor:.0f} | {100 * ours / floor:.0f}% |"
        lines.append(f"| {B} | {Hq}/{Hkv} | {Mq} | {Mk} | " + " | ".join(cells) + tail)
    notes = [r for r in rows if r.get("note")]
    if notes:
        lines += ["", "Notes:"] + [f"- {r['provider']} B={r['B']} {r['Hq']}/{r['Hkv']} Mq={r['Mq']} Mk={r['Mk']}: {r['note']} "
                                   f"({r['ms']:.4f} ms)" for r in notes]
    open(path, "w").write("\n".join(lines) + "\n")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(GRID["Mq"]), len(GRID["heads"]), figsize=(15, 8), sharey=True)
    for a, Mq in enumerate(GRID["Mq"]):
        for c, (Hq, Hkv) in enumerate(GRID["heads"]):
            ax = axes[a][c]
            for prov in ("triton_splitk", *PEERS):
                for B, style in zip(GRID["B"], ("-", "--", ":", "-.")):
                    key = (prov, B, Hq, Hkv, Mq)
                    pts = [(r["Mk"], r["GBps"]) for r in rows if (r["provider"], r["B"], r["Hq"], r["Hkv"], r["Mq"]) == key]
                    pts = [p for p in pts if not math.isnan(p[1])]
                    if pts:
                        color = {"triton_splitk": "C0", "sdpa_flash": "C1", "sdpa_cudnn": "C2"}[prov]
                        ax.plot(*zip(*pts), style, color=color, label=f"{prov} B={B}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"Hq/Hkv={Hq}/{Hkv}, Mq={Mq}")
            ax.set_xlabel("Mk")
            if c == 0:
                ax.set_ylabel("GB/s of K+V")
    axes[0][-1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def grid_points(grid):
    """``(Mq, Hq, Hkv, B, Mk)`` of every grid point whose K/V cache fits ``MAX_KV_BYTES``."""
    for Mq in grid["Mq"]:
        for Hq, Hkv in grid["heads"]:
            for B in grid["B"]:
                for Mk in grid["Mk"]:
                    if 2 * B * Hkv * Mk * D * 2 <= MAX_KV_BYTES:
                        yield Mq, Hq, Hkv, B, Mk


def operators(grid, eager: bool = False, bias: str | None = None, grow: int = 0) -> None:
    """Print GB/s of the dispatched call, forced ``triton_splitk`` and forced ``cudnn`` at every grid
    point, and SDPA's best; ``eager``: calls timed back to back with their host work instead of
    replayed in a graph; ``bias``: a :data:`FRESH_BIASES` bias built in every call of ours;
    ``grow``: eager calls against a growing cache (:func:`eager_times`)."""
    names = ["dispatched", "triton_splitk", "cudnn", *PEERS]
    for Mq, Hq, Hkv, B, Mk in grid_points(grid):
        if eager:
            sets = make_sets(B, Hq, Hkv, Mq, Mk)
            ms = eager_times({n: provider_fn(n, Hq, Hkv, bias) for n in names}, sets, grow=grow)
            kv_bytes = 2 * B * Hkv * (Mk - (grow + 1) / 2 if grow else Mk) * D * 2  # mean cache length
            r = {n: kv_bytes / ms[n] / 1e6 for n in names}
            del sets
        else:
            r = {n: g for n, _, g, _ in bench_point(B, Hq, Hkv, Mq, Mk, names, graph_time, bias)}
        sdpa = max(r[n] for n in PEERS)
        print(f"B={B:<3} {Hq}/{Hkv:<3} Mq={Mq} Mk={Mk:<7} GB/s: "
              + ", ".join(f"{n} {r[n]:.0f}" for n in names[:3]) + f", best SDPA {sdpa:.0f}"
              + f"; cudnn / triton_splitk {r['cudnn'] / r['triton_splitk']:.3f}"
              + f"; dispatched / best SDPA {r['dispatched'] / sdpa:.3f}", flush=True)


# --ab name -> (setting of biasattn.ops.triton.splitk, its default "on", the variant "off", whether it
# acts only through the launch shape: points where both values launch the same are then skipped)
AB_SWITCHES = {"pdl": ("split_kv_pdl", True, False, False), "warpgroup": ("pad_to_warpgroup", True, False, False),
               "merge8": ("MERGE_OVERHEAD_TILES", 4.0, 8.0, True),
               "warpgroup_merge": ("WARPGROUP_MERGE_ROW_TILES", 0.4, 0.0, True),
               "rows64": ("many_rows_warpgroup", True, False, True),
               "slack1": ("SPLIT_SLACK", 0.05, 0.01, True),
               "rows16": ("short_row_blocks", True, False, True),
               "one_tile_stages": ("SHORT_PIECE_TILES", 1, 0, True),
               "piece_stages3": ("SHORT_PIECE_TILES", 1, 3, True)}


@contextlib.contextmanager
def _setting(name: str, value):
    """A ``triton_splitk`` setting for the block: a launch option (lower case) or a tuning constant of the module."""
    from biasattn.ops.triton import options, splitk

    if name.islower():
        with options.use(**{name: value}):
            yield
        return
    saved = getattr(splitk, name)
    setattr(splitk, name, value)
    try:
        yield
    finally:
        setattr(splitk, name, saved)


def ab_switch(grid, name: str, rounds: int) -> None:
    """Same-process A/B of a ``triton_splitk`` launcher setting (on: its default, off: the variant),
    alternating for ``rounds`` rounds per point, next to SDPA's cuDNN; prints GB/s and off/on time ratios."""
    from biasattn.ops.triton import splitk

    attr, on, off, shape_only = AB_SWITCHES[name]
    ratios = []
    for Mq, Hq, Hkv, B, Mk in grid_points(grid):
        sets = make_sets(B, Hq, Hkv, Mq, Mk)
        if shape_only:
            shapes = []
            for value in (on, off):
                with _setting(attr, value):
                    shapes.append(splitk.launch_shape(make_inputs(*sets[0])))
            if shapes[0] == shapes[1]:
                print(f"B={B:<3} {Hq}/{Hkv:<3} Mq={Mq} Mk={Mk:<7} same launch either way: {shapes[0].describe()}")
                continue
            print(f"B={B:<3} {Hq}/{Hkv:<3} Mq={Mq} Mk={Mk:<7} on: {shapes[0].describe()}; off: {shapes[1].describe()}")
        kv_bytes = 2 * B * Hkv * Mk * D * 2
        times = {"on": [], "off": [], "sdpa_cudnn": []}
        for _ in range(rounds):
            for variant in times:
                with _setting(attr, off if variant == "off" else on):
                    fn = provider_fn("sdpa_cudnn" if variant == "sdpa_cudnn" else "triton_splitk", Hq, Hkv)
                    times[variant].append(graph_time(fn, sets))
        med = {n: statistics.median(t) for n, t in times.items()}
        ratios.append(med["off"] / med["on"])
        print(f"B={B:<3} {Hq}/{Hkv:<3} Mq={Mq} Mk={Mk:<7} GB/s: {name} on {kv_bytes / med['on'] / 1e6:6.0f}  "
              f"off {kv_bytes / med['off'] / 1e6:6.0f}  cudnn {kv_bytes / med['sdpa_cudnn'] / 1e6:6.0f}  "
              f"off/on time {med['off'] / med['on']:.3f}  cudnn/on time {med['sdpa_cudnn'] / med['on']:.3f}", flush=True)
        del sets
    print(f"{name}: off/on time median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default: benchmarks/results/<device>, e.g. h100)")
    ap.add_argument("--sweep", action="store_true", help="also time tile-config variants")
    ap.add_argument("--splits", action="store_true", help="only time every split count on small caches")
    ap.add_argument("--quick", action="store_true", help="B in {1, 16}, Mk in {8k, 128k} only")
    ap.add_argument("--heads", nargs="+", default=None, help="head layouts Hq/Hkv instead of 32/32 32/8 32/1")
    ap.add_argument("--mq", nargs="+", type=int, default=None, help="queries per sequence instead of 1 and 4")
    ap.add_argument("--mk", nargs="+", type=int, default=None, help="cache lengths instead of 1k 8k 32k 128k")
    ap.add_argument("--batch", nargs="+", type=int, default=None, help="batch sizes instead of 1 4 16 64")
    ap.add_argument("--commit", default=None, help="commit to record (default: git describe --dirty, where git works)")
    ap.add_argument("--operators", action="store_true",
                    help="only print the dispatched call against forced triton_splitk and cudnn (our operators)")
    ap.add_argument("--eager", action="store_true", help="with --operators: time eager calls, host work included")
    ap.add_argument("--bias", choices=list(FRESH_BIASES), default=None,
                    help="with --operators: a bias built anew in every call of our operators")
    ap.add_argument("--growing", type=int, default=0, metavar="N",
                    help="with --operators --eager: each call sees up to N keys fewer, cycling (a cache "
                         "growing by one key per step: new sizes on every call)")
    ap.add_argument("--ab", choices=list(AB_SWITCHES), help="only A/B a triton_splitk setting: " + ", ".join(
        f"{k} ({a} {on} against {off})" for k, (a, on, off, _) in AB_SWITCHES.items()))
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of --ab (medians reported)")
    ap.add_argument("--floor", action="store_true", help="also time the read floor of every point (tools/read_floor.py)")
    args = ap.parse_args(argv)
    if args.growing and not args.eager:
        ap.error("--growing needs --eager (a CUDA graph replays fixed sizes)")
    if args.bias and not args.eager:
        ap.error("--bias needs --eager (a bias built per call copies its lengths to the GPU, which a graph cannot capture)")
    args.out = args.out or results_dir()
    os.makedirs(args.out, exist_ok=True)
    commit = args.commit or git_commit()
    meta = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, commit=commit,
        date=datetime.date.today().isoformat(), D=D, dtype="bf16", note="",
    )
    copy_gbps = copy_bandwidth()
    print(f"copy bandwidth {copy_gbps:.0f} GB/s; target {0.9 * copy_gbps:.0f} GB/s", flush=True)
    if args.splits:
        split_counts(meta)
        return 0
    if args.sweep:
        sweep(meta)
    grid = dict(GRID)
    if args.quick:
        grid.update(B=(1, 16), Mk=(8192, 131072))
    if args.heads:
        grid.update(heads=tuple(tuple(int(x) for x in h.split("/")) for h in args.heads))
    if args.mq:
        grid.update(Mq=tuple(args.mq))
    if args.mk:
        grid.update(Mk=tuple(args.mk))
    if args.batch:
        grid.update(B=tuple(args.batch))
    if args.operators:
        operators(grid, args.eager, args.bias, args.growing)
        return 0
    if args.ab:
        ab_switch(grid, args.ab, args.rounds)
        return 0
    rows = []
    t0 = time.time()
    providers = ["triton_splitk", *PEERS] + (["read_floor"] if args.floor else [])
    for Mq, Hq, Hkv, B, Mk in grid_points(grid):
        point = bench_point(B, Hq, Hkv, Mq, Mk, providers)
        for name, ms, gbps, note in point:
            rows.append(dict(meta, provider=name, B=B, Hq=Hq, Hkv=Hkv, Mq=Mq, Mk=Mk, ms=ms, GBps=gbps, note=note))
        r = {name: gbps for name, _, gbps, _ in point}
        floor = f"  floor {r['read_floor']:7.0f}" if args.floor else ""
        print(f"B={B:<3} {Hq}/{Hkv:<3} Mq={Mq} Mk={Mk:<7} ours {r['triton_splitk']:7.0f}  "
              f"flash {r['sdpa_flash']:7.0f}  cudnn {r['sdpa_cudnn']:7.0f}{floor}  [{time.time() - t0:.0f}s]", flush=True)
    padded_experiment(rows, meta)
    for B, Hq, Hkv, Mq, Mk in ((1, 32, 8, 1, 32768), (16, 32, 1, 1, 131072)):  # spread: the same point again
        key = ("triton_splitk", B, Hkv, Mq, Mk)
        first = next((r["GBps"] for r in rows if (r["provider"], r["B"], r["Hkv"], r["Mq"], r["Mk"]) == key), None)
        if first is None:  # not in this run's grid
            continue
        again = bench_point(B, Hq, Hkv, Mq, Mk, ["triton_splitk"])[0][2]
        print(f"spread: B={B} {Hq}/{Hkv} Mq={Mq} Mk={Mk}: {first:.0f} then {again:.0f} GB/s", flush=True)
    for r in rows:
        r["copy_GBps"] = round(copy_gbps, 1)
    with open(os.path.join(args.out, "decode.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    write_markdown(rows, os.path.join(args.out, "decode.md"), copy_gbps)
    with contextlib.suppress(Exception):
        plot(rows, os.path.join(args.out, "decode.png"))
    print(open(os.path.join(args.out, "decode.md")).read())


if __name__ == "__main__":
    sys.exit(main())
