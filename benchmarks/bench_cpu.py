"""CPU benchmark: the ``chunked`` operator against PyTorch SDPA given the dense mask a user would build.

Cases (from :mod:`benchmarks.cases`) at M = 4096, D = 64, float32: padded keys, packed varlen with
8 causal documents, and a 25%-dense block-sparse layout (128 × 128 blocks, one layout per head).
For each case and provider it reports the median forward time and the peak memory of the call.

Peak memory is the rise of the process' resident high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs``) during one call, measured in a fresh subprocess per (case, provider) so
that allocator caches of earlier calls cannot hide allocations (after a tiny warm-up call, so that
thread pools and one-time set-up are not counted). The SDPA column adds the dense
mask itself, which a user has to build and keep (it is listed separately too).

    python benchmarks/bench_cpu.py                    # writes benchmarks/results/cpu/cpu.md
    python benchmarks/bench_cpu.py --reps 3 --out -   # quicker, prints the table
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import biasattn as ba  # noqa: E402
from benchmarks.cases import git_commit, make_case  # noqa: E402

CASES = {
    # name: make_case arguments besides M, D
    "padded": dict(B=2, H=8),
    "varlen": dict(B=1, H=8, docs=(8, 8)),
    "block_sparse": dict(B=1, H=8, block=128, density=0.25),
}
PROVIDERS = ("chunked", "sdpa_dense_mask")
TARGET_SPEEDUP, TARGET_MEMORY = 2.0, 4.0


def build(name: str, M: int, D: int, seed: int = 0):
    """The case, and the dense bool mask SDPA needs (None for chunked)."""
    return make_case(name, M=M, D=D, dtype=torch.float32, device="cpu", seed=seed, **CASES[name])


def runner(case, provider: str, mask):
    if provider == "chunked":
        return lambda: ba.attention(case.q, case.k, case.v, case.bias, op="chunked")
    return lambda: F.scaled_dot_product_attention(case.q, case.k, case.v, attn_mask=mask)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1))


def _warm_up(provider: str) -> None:
    """A tiny call first, so that thread pools and kernels' one-time set-up are not counted."""
    x = torch.randn(1, 2, 64, 16)
    if provider == "chunked":
        ba.attention(x, x, x, ba.PaddedKeysMask([40]), op="chunked")
    else:
        F.scaled_dot_product_attention(x, x, x, attn_mask=torch.rand(1, 1, 64, 64) < 0.5)


def measure_memory(name: str, provider: str, M: int, D: int) -> dict:
    """Run in a fresh process: peak resident bytes added by one call (and the mask's bytes)."""
    case = build(name, M, D)
    mask = case.dense_mask() if provider != "chunked" else None
    fn = runner(case, provider, mask)
    _warm_up(provider)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    out = fn()
    peak = _status_kib("VmHWM")
    del out
    mask_bytes = 0 if mask is None else mask.numel() * mask.element_size()
    return {"call_bytes": (peak - before) * 1024, "mask_bytes": mask_bytes}


def memory_in_subprocess(name: str, provider: str, M: int, D: int) -> dict:
    cmd = [sys.executable, __file__, "--measure-memory", name, provider, "--M", str(M), "--D", str(D)]
    cmd += ["--threads", str(torch.get_num_threads())]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def time_case(name: str, M: int, D: int, reps: int) -> tuple[dict, object]:
    """Median seconds per provider; the providers alternate so that machine noise hits both alike."""
    case = build(name, M, D)
    mask = case.dense_mask()
    fns = {p: runner(case, p, mask) for p in PROVIDERS}
    ref = fns["sdpa_dense_mask"]()
    got = fns["chunked"]()
    err = float((got - ref).abs().max())
    times: dict[str, list[float]] = {p: [] for p in PROVIDERS}
    for _ in range(reps):
        for p, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[p].append(time.perf_counter() - t0)
    return {p: statistics.median(ts) for p, ts in times.items()} | {"max_abs_diff": err}, case


def describe(case) -> str:
    B, H, M, D = case.q.shape
    extra = ""
    if case.name == "padded":
        extra = f", kv_seqlens {case.extra['kv_seqlens']}"
    elif case.name == "varlen":
        extra = f", {len(case.extra['seqlens'])} causal docs"
    elif case.name == "block_sparse":
        extra = f", density {case.extra['density']:.2f}"
    return f"[{B}, {H}, {M}, {D}]{extra}"


def environment() -> str:
    commit = git_commit()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = re.search(r"model name\s*:\s*(.*)", f.read()).group(1)
    except (OSError, AttributeError):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"biasattn {ba.__version__} @ {commit}, {datetime.date.today().isoformat()}"
    )


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--M", type=int, default=4096)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--append", action="store_true", help="add the table to the markdown file instead of replacing it")
    default_out = Path(__file__).parent / "results" / "cpu" / "cpu.md"
    ap.add_argument("--out", default=str(default_out), help="markdown file, or - for stdout")
    ap.add_argument("--measure-memory", nargs=2, metavar=("CASE", "PROVIDER"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure_memory:
        print(json.dumps(measure_memory(*args.measure_memory, args.M, args.D)))
        return

    rows = []
    for name in args.cases:
        t, case = time_case(name, args.M, args.D, args.reps)
        mem = {p: memory_in_subprocess(name, p, args.M, args.D) for p in PROVIDERS}
        chunk_mem = mem["chunked"]["call_bytes"]
        sdpa_mem = mem["sdpa_dense_mask"]["call_bytes"] + mem["sdpa_dense_mask"]["mask_bytes"]
        speedup = t["sdpa_dense_mask"] / t["chunked"]
        mem_ratio = sdpa_mem / max(chunk_mem, 1)
        met = speedup >= TARGET_SPEEDUP or mem_ratio >= TARGET_MEMORY
        gflops = case.flops("fwd") / 1e9
        rows.append(
            f"| {name} | {describe(case)} | {t['chunked'] * 1e3:.0f} ({gflops / t['chunked']:.1f}) "
            f"| {t['sdpa_dense_mask'] * 1e3:.0f} ({gflops / t['sdpa_dense_mask']:.1f}) | {speedup:.2f}× "
            f"| {mib(chunk_mem)} | {mib(mem['sdpa_dense_mask']['call_bytes'])} + {mib(mem['sdpa_dense_mask']['mask_bytes'])} "
            f"| {mem_ratio:.1f}× | {'yes' if met else 'no'} | {t['max_abs_diff']:.1e} |"
        )
        print(rows[-1], flush=True)

    cmd = "python benchmarks/bench_cpu.py" + ("" if argv is None else " " + " ".join(argv))
    title = "# CPU: `chunked` vs `F.scaled_dot_product_attention` with a dense mask"
    text = "\n".join(
        [
            *([] if args.append else [title, ""]),
            f"## {torch.get_num_threads()} thread(s)",
            "",
            f"Command: `{cmd}` (M={args.M}, D={args.D}, float32, forward, median of {args.reps} alternating runs).",
            "",
            f"Machine: {environment()}.",
            "",
            "Time in ms (effective GFLOP/s: FLOPs of the visible pairs only). Memory in MiB: the rise of the "
            "resident high-water mark during one call, in a fresh process; for SDPA the call plus the dense bool "
            "mask that the user builds and keeps. Target: ≥ 2× faster or ≥ 4× less memory. Times on a 2-core machine "
            "shared with other jobs vary by about ±20% between runs; the memory figures are stable. With more than one "
            "thread, another busy process on the machine stalls each of chunked's many small parallel regions (they "
            "wait for the descheduled thread), so multi-thread timings are only meaningful on an idle machine.",
            "",
            "| case | q [B, H, M, D] | chunked ms (GFLOP/s) | SDPA + mask ms (GFLOP/s) | speed-up "
            "| chunked MiB | SDPA MiB (call + mask) | memory ratio | target met | max abs diff |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    if args.out == "-":
        print(text)
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        if args.append and Path(args.out).exists():
            text = Path(args.out).read_text() + "\n" + text
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main(None if len(sys.argv) == 1 else sys.argv[1:])
