"""Packed documents under ``torch.compile``: graphs compiled for new lengths, and a step's time against eager.

Each step builds ``BlockDiagonalMask.from_seqlens(lengths).make_causal()`` inside the compiled function
from a GPU tensor of document lengths (new lengths every step), runs the forward, then the backward
outside it, as a compiled model's training step does. Two tables:

- attention alone: the compiled function is one attention call, so torch's runtime around a compiled
  function (guards, the autograd wrapper) is paid by that one call;
- a model: a stack of pre-norm decoder layers (RMSNorm, fused QKV projection, attention, output
  projection, SiLU MLP) sharing the step's mask, compiled whole as a user compiles a model, also with
  ``mode="reduce-overhead"`` (the whole step replayed from CUDA graphs; one set of graphs per number
  of documents).

Functions are compiled with ``fullgraph=True, dynamic=True`` (the ``reduce-overhead`` model with
``fullgraph=True`` only); 10 steps warm up, then 30 steps are
timed with CUDA events (median of 3 loops), eager and compiled alternating. bf16, D=128. Prints ms per
step, compiled over eager, and the number of graphs Dynamo compiled (one per function for every case
and length together).

    PYTHONPATH=. python benchmarks/bench_compile.py
"""

from __future__ import annotations

import random
import statistics

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import biasattn as ba

#: attention alone: (tokens, documents, heads)
ATTENTION_CASES = ((16384, 14, 16), (16384, 64, 16), (4096, 16, 16))
#: a model: (tokens, documents, heads, layers); the width is heads * 128
MODEL_CASES = ((4096, 16, 8, 4), (16384, 64, 16, 4))


def _attention(q, k, v, lengths):
    return ba.attention(q, k, v, ba.BlockDiagonalMask.from_seqlens(lengths).make_causal())


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer on packed tokens ``[1, M, E]``."""

    def __init__(self, heads: int, head_dim: int = 128) -> None:
        super().__init__()
        width = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.norm1, self.norm2 = nn.RMSNorm(width), nn.RMSNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x, mask):
        B, M, E = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, M, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        x = x + self.out(ba.attention(q, k, v, mask).transpose(1, 2).reshape(B, M, E))
        return x + self.down(F.silu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    """Decoder layers sharing one packed-document causal mask, built from the step's lengths."""

    def __init__(self, heads: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(heads) for _ in range(layers))

    def forward(self, x, lengths):
        mask = ba.BlockDiagonalMask.from_seqlens(lengths).make_causal()
        for layer in self.layers:
            x = layer(x, mask)
        return x


def _split(rng: random.Random, total: int, parts: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, total), parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def _time(steps: dict, batches: list) -> dict[str, float]:
    """Median ms per step of each ``name -> step(lengths)``, loops of the variants alternating."""
    for step in steps.values():
        for lengths in batches[:10]:
            step(lengths)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(3):
        for name, step in steps.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for lengths in batches[10:]:
                step(lengths)
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / len(batches[10:]))
    return {name: statistics.median(t) for name, t in times.items()}


def _report(label: str, ms: dict[str, float]) -> None:
    others = ", ".join(f"{name} {t:.3f} ms ({name} / eager time {t / ms['eager']:.2f})"
                       for name, t in ms.items() if name != "eager")
    print(f"{label}: eager {ms['eager']:.3f} ms, {others}", flush=True)


def _attention_step(f, q, k, v, dout):
    return lambda lengths: torch.autograd.grad(f(q, k, v, lengths), (q, k, v), dout)


def _model_step(f, x, module, graphed: bool = False):
    def step(lengths):
        module.zero_grad(set_to_none=True)
        if graphed:  # a new step of CUDA-graph trees: the last step's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        f(x, lengths).float().square().mean().backward()

    return step


def attention_alone(dev, dt) -> None:
    compiled = torch.compile(_attention, fullgraph=True, dynamic=True)
    print("attention alone (fwd + bwd)")
    for M, docs, H in ATTENTION_CASES:
        rng = random.Random(0)
        q, k, v = (torch.randn(1, H, M, 128, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
        dout = torch.randn(1, H, M, 128, device=dev, dtype=dt)
        batches = [torch.tensor(_split(rng, M, docs), device=dev, dtype=torch.int32) for _ in range(40)]
        steps = {name: _attention_step(f, q, k, v, dout) for name, f in (("eager", _attention), ("compiled", compiled))}
        _report(f"  {M} tokens, {docs} documents, H={H}", _time(steps, batches))


def model(dev, dt) -> None:
    print("decoder model (fwd + bwd, weights and activations bf16)")
    for M, docs, H, layers in MODEL_CASES:
        rng = random.Random(0)
        decoder = Decoder(H, layers).to(dev, dt)
        compiled = torch.compile(decoder, fullgraph=True, dynamic=True)
        graphed = torch.compile(decoder, fullgraph=True, mode="reduce-overhead")
        x = torch.randn(1, M, H * 128, device=dev, dtype=dt, requires_grad=True)
        batches = [torch.tensor(_split(rng, M, docs), device=dev, dtype=torch.int32) for _ in range(40)]
        steps = {"eager": _model_step(decoder, x, decoder), "compiled": _model_step(compiled, x, decoder),
                 "reduce-overhead": _model_step(graphed, x, decoder, graphed=True)}
        _report(f"  {M} tokens, {docs} documents, H={H}, {layers} layers", _time(steps, batches))


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    torch._dynamo.utils.counters.clear()
    attention_alone(dev, dt)
    model(dev, dt)
    print(f"graphs compiled: {torch._dynamo.utils.counters['stats']['unique_graphs']}")


if __name__ == "__main__":
    main()
