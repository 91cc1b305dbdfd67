"""Dispatch benchmark: every operator of ours, automatic dispatch and torch SDPA's backends, per case.

For each case of :mod:`benchmarks.cases` (and each mode, forward or forward+backward) it times, in
one process, with the median of ``triton.testing.do_bench``:

- ``op:<name>``: ``ba.attention(..., op=name)`` for every registered operator that accepts the case
  (``chunked`` only where no compiled operator does; ``reference`` never);
- ``auto``: ``ba.attention`` with automatic dispatch (the chosen forward/backward operators are recorded);
- ``sdpa:<backend>``: ``F.scaled_dot_product_attention`` restricted to one backend (flash, efficient,
  cudnn), given ``is_causal`` or the dense mask a user would build; backends that refuse are skipped.

Results go to a long-format CSV (device, versions, commit, date) and a markdown table with the two
ratios of the dispatch criterion: auto vs the fastest of our operators (>= 0.95) and auto vs the
fastest SDPA backend (>= 1.0 within 3% noise).

    PYTHONPATH=. python benchmarks/bench_dispatch.py --sizes 2048   # into benchmarks/results/<device>/dispatch
    PYTHONPATH=. python benchmarks/bench_dispatch.py --sizes 2048,8192 --cases none,causal \
        --head-dims 64,80,96,128,192,256 --dtypes bf16,fp16             # the head-dim sweep: .../head_dims
    python benchmarks/bench_dispatch.py --render a.csv b.csv --out benchmarks/results/h200/head_dims
        # one table from the CSVs of several calls (a sweep longer than one call's time limit)
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import biasattn as ba  # noqa: E402
from benchmarks.cases import CASE_NAMES, make_case, results_dir  # noqa: E402
from biasattn import dispatch  # noqa: E402
from biasattn.inputs import make_inputs  # noqa: E402

MODES = ("fwd", "fwd+bwd")
# beyond benchmarks.cases: grouped-query prefill (16 query heads on 2 KV heads, causal) and decoding
# (B=16, one query per sequence, 32 query heads on 8 KV heads, a cache of S keys, full or padded)
EXTRA_CASES = ("gqa_causal", "decode", "decode_padded")
FORWARD_ONLY = ("decode", "decode_padded")
COMPILED = ("triton", "triton_splitk", "cutlass", "flash2", "cudnn")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _bench(fn, grads) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median"))


def _runner(call, case, mode):
    """A zero-argument callable running ``call()`` (and its backward in fwd+bwd mode)."""
    if mode == "fwd":
        return call
    dout = torch.randn_like(case.q)

    def run():
        call().backward(dout)

    return run


def _our_providers(case, mode):
    backward = mode == "fwd+bwd"
    inp = make_inputs(case.q, case.k, case.v, case.bias, requires_grad=backward)
    ok = [n for n in ba.ops.available() if n != "reference" and not ba.ops.get(n).not_supported_reasons(inp, backward=backward)]
    if any(n in COMPILED for n in ok):
        ok = [n for n in ok if n != "chunked"]
    fwd, bwd = dispatch.choose(inp)
    chosen = fwd.NAME + ("" if bwd is None or bwd is fwd else f"/{bwd.NAME}")
    return ok, chosen


def _sdpa_providers(case):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mask = case.dense_mask()
    backends = {
        "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
    }

    def make(backend):
        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(case.q, case.k, case.v, attn_mask=mask, is_causal=case.is_causal,
                                                      enable_gqa=case.q.shape[1] != case.k.shape[1])

        return call

    return {name: make(b) for name, b in backends.items()}


def _grads(case):
    out = [t for t in (case.q, case.k, case.v) if t.requires_grad]
    if case.name == "additive" and case.dense_mask().requires_grad:
        out.append(case.dense_mask())
    return out


def _extra_case(name, S, D, requires_grad, dtype=torch.bfloat16):
    """One of :data:`EXTRA_CASES` at sequence (or cache) length ``S``."""
    from benchmarks.cases import Case

    def make(B, H, M):
        t = torch.randn(B, H, M, D, dtype=dtype, device="cuda")
        return t.requires_grad_(requires_grad)

    if name == "gqa_causal":
        B = max(16384 // S, 1)
        q, k, v = make(B, 16, S), make(B, 2, S), make(B, 2, S)
        return Case(name, q, k, v, ba.LowerTriangularMask(), B * 16 * S * (S + 1) / 2, is_causal=True)
    B = 16
    q, k, v = make(B, 32, 1), make(B, 8, S), make(B, 8, S)
    if name == "decode":
        return Case(name, q, k, v, None, float(B * 32 * S))
    lens = torch.randint(S // 8, S + 1, (B,), generator=torch.Generator().manual_seed(0))
    bias = ba.PaddedKeysMask(lens.to("cuda"))
    return Case(name, q, k, v, bias, float(32 * int(lens.sum())),
                dense_mask=lambda: bias.materialize((B, 1, 1, S), device="cuda") == 0)


def _time_case(S, B, H, D, name, mode, meta, log, dtype=torch.bfloat16):
    if name in EXTRA_CASES:
        case = _extra_case(name, S, D, requires_grad=mode == "fwd+bwd", dtype=dtype)
        B, H = case.q.shape[:2]
    else:
        case = make_case(name, B=B, H=H, M=S, D=D, dtype=dtype, requires_grad=mode == "fwd+bwd")
    ours, chosen = _our_providers(case, mode)
    calls = {f"op:{n}": (lambda n=n: ba.attention(case.q, case.k, case.v, case.bias, op=n)) for n in ours}
    calls["auto"] = lambda: ba.attention(case.q, case.k, case.v, case.bias)
    calls.update({f"sdpa:{n}": c for n, c in _sdpa_providers(case).items()})
    times: dict[str, list[float]] = {}
    fns = {}
    for provider, call in calls.items():
        try:
            fns[provider] = _runner(call, case, mode)
            fns[provider]()
            torch.cuda.synchronize()
            times[provider] = [_bench(fns[provider], _grads(case))]
        except Exception as e:  # a provider that cannot run the case (or is broken) is reported and skipped
            if not provider.startswith("sdpa:"):
                log(f"  {provider} failed on {name} {mode}: {str(e).splitlines()[0][:200]}")
    # the three timings the criterion compares are repeated, interleaved, each round starting with
    # another of them (the GPU's clocks drift under its power cap), and their median kept
    ours = [p for p in times if p.startswith("op:")]
    sdpa = [p for p in times if p.startswith("sdpa:")]
    close = [p for p in ("auto", min(ours, key=times.get, default=None), min(sdpa, key=times.get, default=None)) if p in times]
    for r in range(4):
        r %= len(close)
        for p in close[r:] + close[:r]:
            times[p].append(_bench(fns[p], _grads(case)))
    host_us = _dispatch_us(case, mode)
    rows = []
    for provider, ts in times.items():
        ms = sorted(ts)[len(ts) // 2]
        tflops = case.flops(mode) / (ms * 1e-3) / 1e12
        rows.append(dict(meta, S=S, B=B, H=H, D=D, dtype=DTYPE_NAMES[dtype], case=name, mode=mode, provider=provider,
                         chosen=chosen if provider == "auto" else "", ms=f"{ms:.4f}", tflops=f"{tflops:.1f}"))
        extra = f"  chosen {chosen}, dispatch {host_us:.0f} us on the host" if provider == "auto" else ""
        log(f"{DTYPE_NAMES[dtype]} D={D} S={S} {name:<12} {mode:<8} {provider:<16} {ms:8.3f} ms {tflops:7.1f} TFLOP/s"
            f" ({', '.join(f'{t:.3f}' for t in ts)}){extra}")
    return rows


def _dispatch_us(case, mode) -> float:
    """Host time of ``make_inputs`` + ``choose`` per call (what automatic dispatch adds to a forced operator)."""
    t0 = time.perf_counter()
    for _ in range(50):
        inp = make_inputs(case.q, case.k, case.v, case.bias, requires_grad=mode == "fwd+bwd")
        dispatch.choose(inp)
    return (time.perf_counter() - t0) / 50 * 1e6


def run(sizes, modes, cases, H=16, D=128, tokens=16384, budget_s=1e9, log=print, head_dims=None, dtypes=None):
    """Time everything (no new case starts after ``budget_s`` seconds) for each head dim (default ``D``)
    and dtype (default bf16); returns the long-format rows."""
    start = time.time()
    meta = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
        commit=_commit(), date=datetime.date.today().isoformat(),
    )
    rows = []
    points = [(dt, d, S, name, mode) for dt in dtypes or [torch.bfloat16] for d in head_dims or [D] for S in sizes
              for name in cases for mode in modes if mode == "fwd" or name not in FORWARD_ONLY]
    for dt, d, S, name, mode in points:
        if time.time() - start > budget_s:
            log(f"time budget of {budget_s:.0f}s spent: skipping {DTYPE_NAMES[dt]} D={d} S={S} {name} {mode}")
            continue
        rows += _time_case(S, max(tokens // S, 1), H, d, name, mode, meta, log, dtype=dt)
        torch.cuda.empty_cache()
    return rows


def summarize(rows) -> str:
    """Markdown table: per point (dtype, head dim, S, case, mode), the fastest of ours, auto, the fastest SDPA
    backend, and the ratios."""
    groups: dict = {}
    for r in rows:
        key = (r.get("dtype", "bf16"), int(r.get("D", 128)), int(r["S"]), r["case"], r["mode"])
        groups.setdefault(key, []).append(r)
    meta = rows[0] if rows else {}
    runs: dict = {}  # (commit, date): head dims measured there, for tables merged from several runs
    for r in rows:
        runs.setdefault((r.get("commit"), r.get("date")), set()).add(int(r.get("D", 128)))
    when = f"commit {meta.get('commit')}, {meta.get('date')}" if len(runs) <= 1 else "; ".join(
        f"D={', '.join(map(str, sorted(dims)))} at commit {c}, {d}" for (c, d), dims in runs.items())
    lines = [
        f"Device {meta.get('device')}, torch {meta.get('torch')}, triton {meta.get('triton')}, {when}. "
        f"H={meta.get('H')}, B·S = 16384 tokens (gqa_causal: 16 query "
        "heads on 2 KV heads; decode: B=16, Mq=1, 32 query heads on 8 KV heads, a cache of S keys; decode_padded: "
        "cache lengths S/8..S). Median ms of "
        "triton.testing.do_bench; TFLOP/s count only visible pairs. auto/ours = fastest of our operators' time / auto's time "
        "(>= 0.95 passes); auto/SDPA = fastest SDPA backend's time / auto's time (>= 0.97 passes).",
        "",
        "| dtype | D | S | case | mode | our operators (ms) | auto: chosen | auto ms | best SDPA (ms) | auto/ours | "
        "auto/SDPA | pass |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = CASE_NAMES + EXTRA_CASES
    for (dt, D, S, case, mode), rs in sorted(groups.items(), key=lambda kv: (*kv[0][:3], order.index(kv[0][3]), kv[0][4])):
        ours = {r["provider"][3:]: float(r["ms"]) for r in rs if r["provider"].startswith("op:")}
        sdpa = {r["provider"][5:]: float(r["ms"]) for r in rs if r["provider"].startswith("sdpa:")}
        auto = next((r for r in rs if r["provider"] == "auto"), None)
        if auto is None:
            continue
        a = float(auto["ms"])
        best_ours = min(ours.values()) if ours else float("nan")
        best_sdpa_name = min(sdpa, key=sdpa.get) if sdpa else None
        r1 = best_ours / a if ours else float("nan")
        r2 = sdpa[best_sdpa_name] / a if sdpa else float("nan")
        ok = (not ours or r1 >= 0.95) and (not sdpa or r2 >= 0.97)
        ours_txt = ", ".join(f"{n} {t:.3f}" for n, t in sorted(ours.items(), key=lambda kv: kv[1]))
        sdpa_txt = f"{best_sdpa_name} {sdpa[best_sdpa_name]:.3f}" if sdpa else "none runs it"
        lines.append(
            f"| {dt} | {D} | {S} | {case} | {mode} | {ours_txt} | {auto['chosen']} | {a:.3f} | {sdpa_txt} | {r1:.2f} | "
            f"{'' if not sdpa else f'{r2:.2f}'} | {'yes' if ok else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def _commit() -> str:
    from cases import git_commit

    return git_commit()


def _read_csv(path: str) -> list[dict]:
    """The rows of a CSV this script wrote."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main(argv=None) -> None:
    """Command line: ``--sizes``, ``--modes``, ``--cases``, ``--head-dim``, ``--out`` (path prefix for .csv and .md)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="2048")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--cases", default=",".join(CASE_NAMES + EXTRA_CASES))
    p.add_argument("--out", default=None, help="path prefix (default: benchmarks/results/<device>/dispatch)")
    p.add_argument("--budget", type=float, default=1e9, help="stop starting new cases after this many seconds")
    p.add_argument("--head-dims", default="128",
                   help="comma-separated head dims (results go to dispatch_d<D> for one D other than 128, "
                        "head_dims for several)")
    p.add_argument("--dtypes", default="bf16", help="comma-separated, of " + ", ".join(DTYPES))
    p.add_argument("--render", nargs="+", metavar="CSV",
                   help="time nothing: write one CSV and table (--out, required) from these CSVs of earlier runs")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    if a.render:
        if not a.out:
            p.error("--render needs --out (the path prefix of the merged .csv and .md)")
        rows = [r for path in a.render for r in _read_csv(path)]
    else:
        dims = [int(d) for d in a.head_dims.split(",")]
        name = "dispatch" if dims == [128] else f"dispatch_d{dims[0]}" if len(dims) == 1 else "head_dims"
        a.out = a.out or results_dir(name)
        rows = run([int(s) for s in a.sizes.split(",")], a.modes.split(","), a.cases.split(","), head_dims=dims,
                   dtypes=[DTYPES[d] for d in a.dtypes.split(",")], budget_s=a.budget)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    md = summarize(rows)
    with open(a.out + ".md", "w") as f:
        f.write("# Dispatch benchmark\n\n" + md)
    print(md)


if __name__ == "__main__":
    main()
