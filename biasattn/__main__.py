"""Command line: ``python -m biasattn info | explain | demo | bench``."""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time

import torch

import biasattn as ba

from .errors import InputError

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def _ints(text: str, name: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise InputError(f"{name} must be comma-separated integers, got {text!r}") from None


def parse_bias(text: str | None, B: int, H: int, Mq: int, Mk: int, device, dtype) -> ba.AttentionBias | None:
    """Build a bias from a description such as ``causal & padded:100,200 + alibi``.

    Terms: ``causal``, ``causal-br``, ``local:LEFT[:RIGHT]``, ``padded:L1,L2,..``, ``varlen:L1,L2,..``
    (packed, causal with ``varlen-causal:..``), ``block_sparse:BLOCK:DENSITY``, ``alibi``, ``additive``.
    Masks join with ``&``, additive terms with ``+``.
    """
    if not text or text == "none":
        return None
    bias = None
    for plus_part in text.split("+"):
        for term in plus_part.split("&"):
            term = term.strip()
            name, _, arg = term.partition(":")
            if name == "causal":
                b = ba.LowerTriangularMask()
            elif name == "causal-br":
                b = ba.LowerTriangularFromBottomRightMask()
            elif name == "local":
                parts = _ints(arg.replace(":", ","), "local window")
                b = ba.LocalAttentionMask(*parts)
            elif name == "padded":
                b = ba.PaddedKeysMask(_ints(arg, "padded lengths"))
            elif name in ("varlen", "varlen-causal"):
                b = ba.BlockDiagonalMask.from_seqlens(_ints(arg, "varlen lengths"))
                b = b.make_causal() if name == "varlen-causal" else b
            elif name == "block_sparse":
                block, _, density = arg.partition(":")
                block = int(block or 64)
                gen = torch.Generator().manual_seed(0)
                layout = torch.rand(1, H, math.ceil(Mq / block), math.ceil(Mk / block), generator=gen) < float(density or 0.25)
                b = ba.BlockSparseMask(layout, block)
            elif name == "alibi":
                b = ba.ALiBi(ba.ALiBi.standard_slopes(H))
            elif name == "additive":
                b = ba.AdditiveBias(torch.randn(1, H, Mq, Mk, dtype=dtype))
            else:
                raise InputError(f"unknown bias term {term!r}; see `python -m biasattn explain --help`")
            b = b.to(device)
            bias = b if bias is None else (bias + b if (not b.is_mask or not bias.is_mask) else bias & b)
    return bias


def _inputs(args):
    B, Hq, Mq, D = _ints(args.shape, "--shape")
    Hkv = args.kv_heads or Hq
    Mk = args.mk or Mq
    dtype = DTYPES[args.dtype]
    device = torch.device(args.device)
    grad = getattr(args, "grad", False)
    q = torch.randn(B, Hq, Mq, D, dtype=dtype, device=device, requires_grad=grad)
    k = torch.randn(B, Hkv, Mk, D, dtype=dtype, device=device, requires_grad=grad)
    v = torch.randn(B, Hkv, Mk, D, dtype=dtype, device=device, requires_grad=grad)
    bias = parse_bias(args.bias, B, Hq, Mq, Mk, device, dtype)
    return q, k, v, bias


def cmd_info(args) -> int:
    """Versions, devices, and every operator: available or why not."""
    print(f"biasattn {ba.__version__}  python {platform.python_version()}  torch {torch.__version__}")
    try:
        import triton

        print(f"triton {triton.__version__}")
    except ImportError:
        print("triton: not installed")
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
    q, k, v, bias = _inputs(args)
    print(ba.explain(q, k, v, bias, dropout_p=args.dropout, requires_grad=args.grad))
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
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cmd_bench(args) -> int:
    """Time biasattn against torch SDPA with the dense mask on one input (median)."""
    q, k, v, bias = _inputs(args)
    device = q.device
    B, Hq, Mq, D = q.shape
    Mk = k.shape[2]
    rows = []
    rows.append(("biasattn (" + ba.dispatch.choose(ba.inputs.make_inputs(q, k, v, bias))[0].NAME + ")",
                 _time_ms(lambda: ba.attention(q, k, v, bias), device, args.reps)))
    dense = None if bias is None else bias.materialize((B, Hq, Mq, Mk), dtype=q.dtype, device=device)
    kk, vv = k, v
    if Hq != k.shape[1]:
        kk, vv = k.repeat_interleave(Hq // k.shape[1], 1), v.repeat_interleave(Hq // k.shape[1], 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows.append(("torch SDPA, dense mask", _time_ms(lambda: sdpa(q, kk, vv, attn_mask=dense), device, args.reps)))
    base = rows[0][1]
    print(f"q {list(q.shape)}, k {list(k.shape)}, {args.dtype} on {device}, bias: {args.bias or 'none'}")
    for name, ms in rows:
        print(f"  {name:<28} {ms:9.3f} ms   ({ms / base:.2f}x biasattn's time)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m biasattn``."""
    parser = argparse.ArgumentParser(prog="python -m biasattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices and operator availability")
    sub.add_parser("demo", help="composed biases on the CPU, checked against the reference")
    for name, helptext in (("explain", "which operator runs these inputs and why"), ("bench", "time against torch SDPA")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--shape", required=True, help="B,Hq,Mq,D of q")
        p.add_argument("--kv-heads", type=int, default=None, help="Hkv (default Hq)")
        p.add_argument("--mk", type=int, default=None, help="number of keys Mk (default Mq)")
        p.add_argument("--bias", default=None, help=parse_bias.__doc__.split("\n")[0])
        p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        p.add_argument("--dropout", type=float, default=0.0)
        p.add_argument("--grad", action="store_true", help="gradients are needed")
        p.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    handler = {"info": cmd_info, "explain": cmd_explain, "demo": cmd_demo, "bench": cmd_bench}[args.command]
    try:
        return handler(args)
    except ba.errors.BiasattnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
