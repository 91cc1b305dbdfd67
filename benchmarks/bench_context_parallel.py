"""Context-parallel attention benchmark: ring, all-gather and Ulysses against one GPU and torch's context_parallel.

Launched with torchrun, one process per GPU. Causal attention in bfloat16, D=128, 32 query heads and
8 KV heads, forward+backward. Cases:

- ``causal``: ``--tokens-per-gpu`` tokens on each GPU (weak scaling), or ``--total`` tokens over all
  GPUs (strong scaling); single-GPU baselines at the local and at the total length.
- ``documents``: ``--docs`` packed documents (causal inside each, ``BlockDiagonalMask``) over
  ``--doc-tokens`` tokens; compared with the ideal time, the total visible work over the GPUs at the
  single-GPU rate on the same documents (skipping empty shard pairs is what makes it reachable).

Every rank runs the same fixed number of calls (collectives inside); a call's time is the slowest
rank's, the median over ``--reps``. Each method's output is compared once with one GPU's on the same
inputs (a harness check, printed in the note column; ``--no-check`` skips it). FLOPs count visible
(query, key) pairs: 4·D per pair forward, 3.5× that for forward+backward; the per-GPU effective rate
is that over the GPUs and the time. Peak memory is ``max_memory_allocated`` of one call on each GPU
(the largest is reported). Rank 0 prints a table and writes a long-format CSV.

    torchrun --nproc-per-node 4 benchmarks/bench_context_parallel.py                       # weak scaling, 32k per GPU
    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py --total 65536         # strong scaling at 64k
    torchrun --nproc-per-node 4 benchmarks/bench_context_parallel.py --cases documents     # 64 documents over 128k
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import biasattn as ba  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--cases", nargs="+", default=["causal"], choices=["causal", "documents"])
    p.add_argument("--methods", nargs="+", default=list(ba.distributed.METHODS), choices=list(ba.distributed.METHODS))
    p.add_argument("--layout", default="zigzag", choices=list(ba.distributed.LAYOUTS))
    p.add_argument("--tokens-per-gpu", type=int, default=32768, help="causal case, weak scaling (default 32768)")
    p.add_argument("--total", type=int, default=None, help="causal case, strong scaling: total tokens over all GPUs")
    p.add_argument("--docs", type=int, default=64, help="documents case: number of documents (default 64)")
    p.add_argument("--doc-tokens", type=int, default=131072, help="documents case: total tokens (default 131072)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-single", action="store_true", help="skip the single-GPU baselines")
    p.add_argument("--no-torch", action="store_true", help="skip torch's context_parallel")
    p.add_argument("--no-check", action="store_true", help="skip comparing each method's output with one GPU's")
    p.add_argument("--csv", default=None, help="CSV to write (default: benchmarks/results/<gpu>/context_parallel.csv)")
    return p.parse_args(argv)


def timed(fn, warmup: int, reps: int) -> float:
    """Median over ``reps`` of the slowest rank's time of ``fn()`` in ms (every rank calls it equally often)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        t = torch.tensor([start.elapsed_time(end)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return statistics.median(times)


def peak_gib(fn) -> float:
    """The largest peak (over ranks) of memory allocated during one ``fn()``, GiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    t = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def visible_pairs(lens: list[int]) -> int:
    """Visible (query, key) pairs of causal attention within each of ``lens`` sequences."""
    return sum(n * (n + 1) // 2 for n in lens)


def doc_lengths(total: int, n: int) -> list[int]:
    """``n`` document lengths (a fixed draw, between about 0.25× and 1.75× the mean) summing to ``total``."""
    w = torch.rand(n, generator=torch.Generator().manual_seed(0)) * 1.5 + 0.25
    lens = (w / w.sum() * total).floor().long().tolist()
    lens[-1] += total - sum(lens)
    return lens


def fwd_bwd(attend, q, k, v, dout):
    """A closure running ``attend(q, k, v)`` forward and backward (gradients dropped each call)."""
    def run():
        for t in (q, k, v):
            t.grad = None
        attend(q, k, v).backward(dout)
    return run


def inputs(B, H, Hkv, M, D, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = ((B, H, M, D), (B, Hkv, M, D), (B, Hkv, M, D), (B, H, M, D))
    return [torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) for s in shapes]


def torch_context_parallel(args, M: int, rotate: str | None):
    """torch's ``context_parallel`` on SDPA (causal), or None with the reason it is unavailable."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import _attention as cp_attention
        from torch.distributed.tensor.experimental import context_parallel
    except ImportError as e:
        return None, f"not importable: {e}"
    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    if rotate is not None:
        if not hasattr(cp_attention, "set_rotate_method"):
            return None, "set_rotate_method is not available"
        cp_attention.set_rotate_method(rotate)
    q, k, v, dout = (t.detach() for t in inputs(1, args.heads, args.kv_heads, M, args.head_dim, "cuda"))
    rep = args.heads // args.kv_heads  # KV heads repeated: SDPA under context_parallel takes no enable_gqa
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    # context_parallel shards its buffers in place (a resize, undone on exit), which torch refuses for
    # tensors that require grad: the timed leaves are copies of the sharded buffers
    try:
        with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2]):
            leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
            run = fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), *leaves, dout)
            return (timed(run, args.warmup, args.reps), peak_gib(run)), ""
    except Exception as e:  # noqa: BLE001 - an experimental API: report, do not stop the other rows
        return None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def main(argv=None) -> None:
    args = parse_args(argv)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    B, H, Hkv, D = 1, args.heads, args.kv_heads, args.head_dim
    rows = []

    def report(case, provider, M, gpus, pairs, ms, peak, note=""):
        tflops = 3.5 * 4 * D * H * B * pairs / (ms * 1e-3) / 1e12 / gpus if ms else float("nan")
        rows.append(dict(case=case, provider=provider, tokens=M, gpus=gpus, ms=ms, tflops_per_gpu=tflops,
                         peak_gib=peak, note=note))
        if rank == 0:
            print(f"{case:10s} {provider:22s} M={M:7d} gpus={gpus} {ms:9.2f} ms {tflops:7.1f} TFLOP/s/GPU "
                  f"peak {peak:6.2f} GiB {note}", flush=True)

    for case in args.cases:
        if case == "causal":
            M = args.total or args.tokens_per_gpu * world
            lens, bias = [M], ba.LowerTriangularMask()
        else:
            M = args.doc_tokens
            lens = doc_lengths(M, args.docs)
            bias = ba.BlockDiagonalMask.from_seqlens(lens, device="cuda").make_causal()
        pairs = visible_pairs(lens)
        q, k, v, dout = inputs(B, H, Hkv, M, D, "cuda")
        local = [ba.distributed.shard_sequence(t, layout=args.layout) for t in (q, k, v, dout)]
        with torch.no_grad():  # a harness check: the same output as one GPU's (every rank has the full inputs)
            ref = None if args.no_check else ba.attention(q, k, v, bias).float()
        del q, k, v, dout
        for method in args.methods:
            ql, kl, vl, dl = (t.clone().requires_grad_(i < 3) for i, t in enumerate(local))
            run = fwd_bwd(lambda a, b, c, m=method, bias=bias: ba.distributed.context_parallel_attention(
                a, b, c, bias, layout=args.layout, method=m), ql, kl, vl, dl)
            note = ""
            if ref is not None:
                with torch.no_grad():
                    out = ba.distributed.context_parallel_attention(ql, kl, vl, bias, layout=args.layout, method=method)
                    diff = float((ba.distributed.gather_sequence(out, layout=args.layout).float() - ref).abs().max())
                note = f"max |out - one GPU's| = {diff:.2e}"
            report(case, f"{method}/{args.layout}", M, world, pairs, timed(run, args.warmup, args.reps), peak_gib(run),
                   note)
        del ref
        del local
        single_ms = None
        if not args.no_single:  # every GPU runs the baseline at once, as under the same load
            for Ms in sorted({M // world, M}) if case == "causal" else [M]:
                s_lens = [Ms] if case == "causal" else lens
                s_bias = bias if case == "documents" else ba.LowerTriangularMask()
                q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(inputs(B, H, Hkv, Ms, D, "cuda")))
                run = fwd_bwd(lambda a, b, c, sb=s_bias: ba.attention(a, b, c, sb), q, k, v, dout)
                ms = timed(run, args.warmup, args.reps)
                single_ms = ms if Ms == M else single_ms
                report(case, "single_gpu", Ms, 1, visible_pairs(s_lens), ms, peak_gib(run))
                del q, k, v, dout
        if case == "documents" and single_ms is not None and rank == 0:
            ideal = single_ms / world
            for row in rows:
                if row["case"] == "documents" and row["gpus"] == world:
                    row["note"] = "; ".join(n for n in (f"time / ideal = {row['ms'] / ideal:.2f}", row["note"]) if n)
                    print(f"documents  {row['provider']:22s} time / ideal ({ideal:.2f} ms) = {row['ms'] / ideal:.2f}")
        if case == "causal" and not args.no_torch:
            for rotate in ("allgather", "alltoall"):
                got, why = torch_context_parallel(args, M, rotate)
                if got is None:
                    if rank == 0:
                        print(f"causal     torch_cp/{rotate:13s} unavailable: {why}")
                    continue
                report(case, f"torch_cp/{rotate}", M, world, pairs, *got, note="KV heads repeated")

    if rank == 0 and rows:
        path = args.csv or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                        torch.cuda.get_device_name().split()[-1].lower(), "context_parallel.csv")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        meta = dict(device=torch.cuda.get_device_name(), world=world, torch=torch.__version__,
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) + list(meta))
            w.writeheader()
            for row in rows:
                w.writerow({**row, **meta})
        print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
