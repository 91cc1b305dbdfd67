"""Command line: ``python -m biasattn info | explain | demo | bench`` (also installed as ``biasattn``)."""

from __future__ import annotations

import argparse
import math
import platform
import re
import statistics
import sys
import time

import torch

import biasattn as ba

from .errors import InputError
from .ops.triton import environment

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}

BIAS_GRAMMAR = """\
--bias terms:
  causal                      causal mask aligned top-left: query i sees keys 0..i
  causal-br                   causal mask aligned bottom-right (queries are the last keys: KV cache)
  local:LEFT[:RIGHT]          sliding window: LEFT keys before, RIGHT after the bottom-right diagonal
  padded:L1,L2,..             keys past each batch row's length are hidden (one length per batch row)
  varlen:L1,L2,..             packed sequences of these lengths (batch size 1); varlen-causal:.. is causal
  block_sparse:BLOCK:DENSITY  random block layout (seed 0): BLOCK-sized blocks, DENSITY of them visible
  alibi                       ALiBi with the standard slopes
  additive                    a random float bias [1, H, Mq, Mk]
  none                        no bias
'&' intersects masks and '+' adds terms, by the library's rules and with Python's precedence ('+'
binds tighter than '&'): add a term to a parenthesized mask, as in "(causal & padded:100) + alibi".
"""

_TOKEN = re.compile(r"\s*(?:([()&+])|([^\s()&+]+))")


def _ints(text: str, name: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise InputError(f"{name} must be comma-separated integers, got {text!r}") from None


def _number(text: str, name: str, default: float) -> float:
    try:
        return float(text) if text else default
    except ValueError:
        raise InputError(f"{name} must be a number, got {text!r}") from None


def _term(term: str, H: int, Mq: int, Mk: int, device, dtype) -> ba.AttentionBias:
    """One term of the ``--bias`` grammar as a library bias."""
    name, _, arg = term.partition(":")
    if name == "causal":
        b = ba.LowerTriangularMask()
    elif name == "causal-br":
        b = ba.LowerTriangularFromBottomRightMask()
    elif name == "local":
        b = ba.LocalAttentionMask(*_ints(arg.replace(":", ","), "local window"))
    elif name == "padded":
        b = ba.PaddedKeysMask(_ints(arg, "padded lengths"))
    elif name in ("varlen", "varlen-causal"):
        b = ba.BlockDiagonalMask.from_seqlens(_ints(arg, "varlen lengths"))
        b = b.make_causal() if name == "varlen-causal" else b
    elif name == "block_sparse":
        block, _, density = arg.partition(":")
        block = int(_number(block, "block_sparse block size", 64))
        gen = torch.Generator().manual_seed(0)
        shape = (1, H, math.ceil(Mq / max(block, 1)), math.ceil(Mk / max(block, 1)))
        b = ba.BlockSparseMask(torch.rand(shape, generator=gen) < _number(density, "block_sparse density", 0.25), block)
    elif name == "alibi":
        b = ba.ALiBi(ba.ALiBi.standard_slopes(H))
    elif name == "additive":
        b = ba.AdditiveBias(torch.randn(1, H, Mq, Mk, dtype=dtype))
    else:
        raise InputError(f"unknown bias term {term!r}\n{BIAS_GRAMMAR}")
    return b.to(device)


class _BiasParser:
    """``--bias`` text to a bias, combining terms with the library's own ``&`` and ``+`` (Python's precedence).

    expr := sum ('&' sum)* ;  sum := atom ('+' atom)* ;  atom := TERM | '(' expr ')'
    """

    def __init__(self, text: str, make):
        self.text, self.make, self.pos = text, make, 0
        self.tokens = [m.group(1) or m.group(2) for m in _TOKEN.finditer(text) if m.group(1) or m.group(2)]
        self.parts: list[tuple[str, ba.AttentionBias]] = []

    def fail(self, what: str):
        raise InputError(f"cannot read --bias {self.text!r}: {what}\n{BIAS_GRAMMAR}")

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str | None:
        tok = self.peek()
        self.pos += 1
        return tok

    def parse(self) -> ba.AttentionBias:
        bias = self.expr()
        if self.peek() is not None:
            self.fail(f"unexpected {self.peek()!r}")
        return bias

    def expr(self) -> ba.AttentionBias:
        bias = self.sum()
        while self.peek() == "&":
            self.take()
            bias = bias & self.sum()
        return bias

    def sum(self) -> ba.AttentionBias:
        bias = self.atom()
        while self.peek() == "+":
            self.take()
            bias = bias + self.atom()
        return bias

    def atom(self) -> ba.AttentionBias:
        tok = self.take()
        if tok == "(":
            bias = self.expr()
            if self.take() != ")":
                self.fail("a '(' is not closed")
            return bias
        if tok is None or tok in ")&+":
            self.fail("expected a term " + (f"before {tok!r}" if tok else "at the end"))
        bias = self.make(tok)
        self.parts.append((tok, bias))
        return bias


def parse_bias(text: str | None, B: int, H: int, Mq: int, Mk: int, device, dtype) -> ba.AttentionBias | None:
    """Build a bias from a description such as ``(causal & padded:100,200) + alibi`` (grammar: ``BIAS_GRAMMAR``).

    Terms are combined with the library's ``&`` and ``+``, so a combination the library refuses is
    refused here with the library's own error.
    """
    return _parse(text, H, Mq, Mk, device, dtype)[0]


def _parse(text, H, Mq, Mk, device, dtype) -> tuple[ba.AttentionBias | None, list[tuple[str, ba.AttentionBias]]]:
    if not text or text.strip() == "none":
        return None, []
    parser = _BiasParser(text, lambda term: _term(term, H, Mq, Mk, device, dtype))
    return parser.parse(), parser.parts


def bias_notes(parts: list[tuple[str, ba.AttentionBias]], Mq: int, Mk: int) -> list[str]:
    """One line for each ``--bias`` term that has no effect for these shapes, or that is often a mistake."""
    notes = []
    for text, part in parts:
        bB, bH = part.sizes[:2]
        shape = (bB or 1, bH or 1, Mq, Mk)
        if math.prod(shape) > 1 << 22:
            continue  # too large to check cheaply
        dense = part.materialize(shape)
        if not dense.any():
            what = "every query sees every key" if part.is_mask else "it adds zero everywhere"
            notes.append(f"note: {text} has no effect for Mq={Mq}, Mk={Mk}: {what}")
        elif text == "causal" and Mq < Mk:
            queries, keys = _count(Mq, "query", "queries"), _count(Mq, "key", "keys")
            notes.append(f"note: causal is aligned top-left (query i sees keys 0..i): with {queries} and {Mk} keys, "
                         f"the last query sees {keys}; for queries at the end of a KV cache use causal-br")
    return notes


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _inputs(args):
    shape = _ints(args.shape, "--shape")
    if len(shape) != 4 or min(shape) < 1:
        raise InputError(f"--shape must be four positive integers B,Hq,Mq,D (e.g. 1,8,1024,64), got {args.shape!r}")
    B, Hq, Mq, D = shape
    Hkv = args.kv_heads or Hq
    Mk = args.mk or Mq
    if Hkv < 1 or Mk < 1:
        raise InputError(f"--kv-heads and --mk must be positive, got {Hkv} and {Mk}")
    dtype = DTYPES[args.dtype]
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise InputError(f"--device must be a torch device such as cpu or cuda:0, got {args.device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {args.device} asked for, but CUDA is not available here; use --device cpu")
    grad = getattr(args, "grad", False)
    q = torch.randn(B, Hq, Mq, D, dtype=dtype, device=device, requires_grad=grad)
    k = torch.randn(B, Hkv, Mk, D, dtype=dtype, device=device, requires_grad=grad)
    v = torch.randn(B, Hkv, Mk, D, dtype=dtype, device=device, requires_grad=grad)
    bias, parts = _parse(args.bias, Hq, Mq, Mk, device, dtype)
    return q, k, v, bias, parts


def cmd_info(args) -> int:
    """Versions, devices, and every operator: available or why not."""
    print(f"biasattn {ba.__version__}  python {platform.python_version()}  torch {torch.__version__}")
    if environment.triton_installed():
        import triton

        print(f"triton {triton.__version__}")
    else:
        print("triton: not installed; the CPU operators do not need it, the Triton kernels (GPU) do: "
              "CUDA builds of torch bring it, or add it with pip install -e \".[triton]\"")
    if torch.cuda.is_available():
        for n in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(n)
            print(f"cuda:{n} {torch.cuda.get_device_name(n)} (sm{cap[0]}{cap[1]}), CUDA {torch.version.cuda}")
    else:
        print("CUDA: not available")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print("\noperators:")
    for name in ba.ops.available():
        op = ba.ops.get(name)
        for dev in devices:
            if dev not in op.DEVICES:
                continue
            why = op.environment_reasons(torch.device(dev))
            status = "available" if not why else "unavailable: " + "; ".join(why)
            print(f"  {name:<14} {dev:<5} {status}")
        if not any(d in op.DEVICES for d in devices):
            print(f"  {name:<14} needs {'/'.join(sorted(op.DEVICES))}")
    return 0


def cmd_explain(args) -> int:
    """Print which operator runs the described inputs, and why the others refuse."""
    q, k, v, bias, parts = _inputs(args)
    inp = ba.inputs.make_inputs(q, k, v, bias, dropout_p=args.dropout, requires_grad=args.grad)
    print(ba.dispatch.explanation(inp, fold_unavailable=True))
    for note in bias_notes(parts, inp.Mq, inp.Mk):
        print(note)
    return 0


def cmd_demo(args) -> int:
    """Run a few composed biases on the CPU and compare with the float64 reference."""
    torch.manual_seed(0)
    B, H, M, D = 2, 4, 77, 32
    q = torch.randn(B, H, M, D, requires_grad=True)
    k = torch.randn(B, H // 2, M, D, requires_grad=True)
    v = torch.randn(B, H // 2, M, D, requires_grad=True)
    cases = {
        "causal & padded keys": ba.LowerTriangularMask() & ba.PaddedKeysMask([60, 77]),
        "sliding window 16 + ALiBi": ba.LocalAttentionMask(16) + ba.ALiBi(ba.ALiBi.standard_slopes(H)),
        "block-sparse & causal": ba.BlockSparseMask(torch.rand(1, H, 5, 5) < 0.5, 16) & ba.LowerTriangularMask(),
    }
    print(f"q [{B}, {H}, {M}, {D}], k/v [{B}, {H // 2}, {M}, {D}] (grouped-query), float32 on cpu\n")
    worst = 0.0
    for title, bias in cases.items():
        fwd, _ = ba.dispatch.choose(ba.inputs.make_inputs(q, k, v, bias))
        out = ba.attention(q, k, v, bias)
        dense = bias.materialize((B, H, M, M), dtype=torch.float64)
        kk = k.detach().double().repeat_interleave(2, 1)
        vv = v.detach().double().repeat_interleave(2, 1)
        p = torch.softmax(q.detach().double() @ kk.transpose(-1, -2) / math.sqrt(D) + dense, -1).nan_to_num(0.0)
        err = (out.detach().double() - p @ vv).abs().max().item()
        out.sum().backward()
        worst = max(worst, err)
        print(f"  {title:<28} operator={fwd.NAME:<10} max |out - reference| = {err:.2e}")
    print(f"\nall within float32 rounding: {'yes' if worst < 1e-4 else 'NO'}")
    return 0 if worst < 1e-4 else 1


def _time_ms(fn, device: torch.device, reps: int) -> float:
    if device.type == "cuda" and environment.triton_installed():
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def verdict(ours_ms: float, theirs_ms: float, theirs: str) -> str:
    """``"biasattn 2.10× faster than <theirs>"`` or ``"... slower ..."`` from two median times."""
    if math.isclose(ours_ms, theirs_ms, rel_tol=0.02):
        return f"biasattn and {theirs} take the same time (within 2%)"
    if ours_ms < theirs_ms:
        return f"biasattn {theirs_ms / ours_ms:.2f}× faster than {theirs}"
    return f"biasattn {ours_ms / theirs_ms:.2f}× slower than {theirs}"


def cmd_bench(args) -> int:
    """Time biasattn against torch SDPA with the dense mask on one input (median)."""
    q, k, v, bias, _ = _inputs(args)
    op = ba.dispatch.choose(ba.inputs.make_inputs(q, k, v, bias))[0].NAME  # the library's checks, its messages
    device = q.device
    B, Hq, Mq, D = q.shape
    Mk = k.shape[2]
    ours = _time_ms(lambda: ba.attention(q, k, v, bias), device, args.reps)
    dense = None if bias is None else bias.materialize((B, Hq, Mq, Mk), dtype=q.dtype, device=device)
    kk, vv = k, v
    if Hq != k.shape[1]:
        kk, vv = k.repeat_interleave(Hq // k.shape[1], 1), v.repeat_interleave(Hq // k.shape[1], 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    theirs = _time_ms(lambda: sdpa(q, kk, vv, attn_mask=dense), device, args.reps)
    peer = "torch SDPA with a dense mask" if bias is not None else "torch SDPA without a mask"
    print(f"q {list(q.shape)}, k {list(k.shape)}, {args.dtype} on {device}, bias: {args.bias or 'none'}, "
          f"median of {args.reps} runs")
    print(f"  {'biasattn (' + op + ')':<30} {ours:9.3f} ms")
    print(f"  {peer:<30} {theirs:9.3f} ms")
    print(verdict(ours, theirs, peer))
    if device.type == "cpu":
        print(f"(on the CPU biasattn runs {op}, plain PyTorch; its fused kernels need a CUDA GPU)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m biasattn`` and of the ``biasattn`` command."""
    parser = argparse.ArgumentParser(prog="python -m biasattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices and operator availability")
    sub.add_parser("demo", help="composed biases on the CPU, checked against the reference")
    for name, helptext in (("explain", "which operator runs these inputs and why"), ("bench", "time against torch SDPA")):
        p = sub.add_parser(name, help=helptext, description=helptext, epilog=BIAS_GRAMMAR,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--shape", required=True, help="B,Hq,Mq,D of q, e.g. 1,8,1024,64")
        p.add_argument("--kv-heads", type=int, default=None, help="Hkv (default Hq)")
        p.add_argument("--mk", type=int, default=None, help="number of keys Mk (default Mq)")
        p.add_argument("--bias", default=None, help='e.g. "causal & padded:100,200"; terms listed below')
        p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        p.add_argument("--dropout", type=float, default=0.0)
        p.add_argument("--grad", action="store_true", help="gradients are needed")
        p.add_argument("--reps", type=int, default=10, help="timed runs on the CPU (bench)")
    args = parser.parse_args(argv)
    handler = {"info": cmd_info, "explain": cmd_explain, "demo": cmd_demo, "bench": cmd_bench}[args.command]
    try:
        return handler(args)
    except ba.errors.BiasattnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
