"""Packed documents with a mask built fresh every step, against the same mask reused and FlashAttention-2 varlen.

Training on packed documents builds ``BlockDiagonalMask.from_seqlens(lengths, device=...).make_causal()``
from each batch's lengths. This times causal forward+backward per step, bf16, three ways on the same
tensors, every step with new random document lengths (none repeats; 12 other batches warm up first):

- ``fresh``: the mask built from the step's Python list of lengths inside the timed step;
- ``tensor``: the mask built inside the timed step from the step's lengths as a GPU tensor (as a data
  loader hands them over, made before timing): nothing is read back;
- ``prebuilt``: one mask object per step, built before timing (new lengths, the mask's cost left out);
- ``graphed``: the step captured once in a CUDA graph that builds the mask from a device tensor of
  lengths; each step writes its lengths into that tensor and replays the graph (no host work left);
- ``same``: one mask object and the same lengths every step (the mask reused);
- ``flash2 varlen``: ``aten._flash_attention_forward/backward`` with ``cu_seqlens`` made from the same
  lengths each step (``torch.tensor(..., device=...)``), as FlashAttention-2 users write it.

    PYTHONPATH=. python benchmarks/bench_fresh_masks.py            # 16k/14 docs, 16k/64 docs, 4k/16 docs

Every variant runs in each of ``--rounds`` rounds, back to back; the table prints medians over the
rounds, and each ratio is the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
from bench_attention import _graphed

import biasattn as ba

CASES = ((16384, 14), (16384, 64), (4096, 16))
WARMUP = 12  # batches run before timing, with lengths of their own


def _split(rng: random.Random, total: int, parts: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, total), parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def _timed(step, batches, warmup) -> float:
    """Mean ms per step over ``batches`` (one step per batch), CUDA events around the whole loop, after
    steps on the ``warmup`` batches (other lengths: every kernel variant the lengths select is compiled)."""
    for b in warmup:
        step(b)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for b in batches:
        step(b)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / len(batches)


def run(M: int, docs: int, H: int, D: int, steps: int, seed: int, num_rounds: int) -> list[dict[str, float]]:
    """TFLOP/s of every variant in each of ``num_rounds`` rounds."""
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    q, k, v = (torch.randn(1, H, M, D, device=dev, dtype=dt, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(1, H, M, D, device=dev, dtype=dt, generator=g)
    rng = random.Random(seed)
    batches = [_split(rng, M, docs) for _ in range(steps + WARMUP)]
    reused = ba.BlockDiagonalMask.from_seqlens(batches[0], device=dev).make_causal()
    by_id = {}  # the prebuilt masks, built anew before each round: a mask keeps what its first call made
    on_device = {id(lens): torch.tensor(lens, device=dev, dtype=torch.int32) for lens in batches}

    def ours(mask):
        out = ba.attention(q, k, v, mask)
        torch.autograd.grad(out, (q, k, v), dout)

    def fresh(lens):
        ours(ba.BlockDiagonalMask.from_seqlens(lens, device=dev).make_causal())

    def tensor(lens):
        ours(ba.BlockDiagonalMask.from_seqlens(on_device[id(lens)]).make_causal())

    def prebuilt(lens):
        ours(by_id[id(lens)])

    def same(lens):
        ours(reused)

    written = on_device[id(batches[0])].clone()
    graph = _graphed(lambda: ours(ba.BlockDiagonalMask.from_seqlens(written).make_causal()))

    def graphed(lens):
        written.copy_(on_device[id(lens)])
        graph.replay()

    qf, kf, vf, df = (t.detach()[0].transpose(0, 1).contiguous() for t in (q, k, v, dout))  # [M, H, D]

    def flash2(lens):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev, dtype=torch.int32)
        longest = max(lens)
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            qf, kf, vf, cu, cu, longest, longest, 0.0, True, False)
        torch.ops.aten._flash_attention_backward(df, qf, kf, vf, out, lse, cu, cu, longest, longest, 0.0, True,
                                                 rng_state, unused)

    flops = 3.5 * 4 * H * D * sum(n * (n + 1) / 2 for lens in batches[WARMUP:] for n in lens) / steps
    same_flops = 3.5 * 4 * H * D * sum(n * (n + 1) / 2 for n in batches[0])
    variants = (("fresh", fresh), ("tensor", tensor), ("prebuilt", prebuilt), ("same", same), ("graphed", graphed),
                ("flash2 varlen", flash2))
    rounds = []  # the variants back to back in each round: the host's drift moves a round's ratios less
    for _ in range(num_rounds):
        by_id.clear()
        by_id.update({id(lens): ba.BlockDiagonalMask.from_seqlens(lens, device=dev).make_causal() for lens in batches})
        rounds.append({name: (same_flops if name == "same" else flops) / (_timed(step, batches[WARMUP:], batches[:WARMUP])
                                                                           * 1e-3) / 1e12
                       for name, step in variants})
    return rounds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=5, help="rounds of every variant back to back; medians are printed")
    args = p.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, bf16, H={args.H}, D={args.D}, causal fwd+bwd, TFLOP/s "
          f"(new document lengths every step, {args.steps} steps; medians of {args.rounds} rounds, ratios per round)")
    print(f"{'tokens':>7} {'docs':>5} {'fresh':>7} {'tensor':>7} {'prebuilt':>8} {'same':>7} {'graphed':>7} {'flash2':>7}"
          f"  fresh/same  fresh/flash2  tensor/same  graphed/same  graphed/flash2")
    for M, docs in CASES:
        rounds = run(M, docs, args.H, args.D, args.steps, seed=M + docs, num_rounds=args.rounds)
        cols = [statistics.median(r[n] for r in rounds)
                for n in ("fresh", "tensor", "prebuilt", "same", "graphed", "flash2 varlen")]
        ratios = [statistics.median(r[a] / r[b] for r in rounds)
                  for a, b in (("fresh", "same"), ("fresh", "flash2 varlen"), ("tensor", "same"), ("graphed", "same"),
                               ("graphed", "flash2 varlen"))]
        print(f"{M:7d} {docs:5d} {cols[0]:7.1f} {cols[1]:7.1f} {cols[2]:8.1f} {cols[3]:7.1f} {cols[4]:7.1f} {cols[5]:7.1f}"
              f"  {ratios[0]:10.2f}  {ratios[1]:12.2f}  {ratios[2]:11.2f}  {ratios[3]:12.2f}  {ratios[4]:14.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
