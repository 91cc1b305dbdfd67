"""Registers, spill stack and shared memory of the ``triton`` kernels, compiled for a GPU target on any machine.

Use it before timing a tile config or a kernel change on a GPU: a config that spills registers or
does not fit in shared memory shows here in seconds, with no device. It runs the launchers on small
CPU tensors with every kernel launch intercepted, compiles each launch for the target (default
sm_90) with the installed Triton, and reads the resource usage of the cubin with the ``cuobjdump`` that Triton
ships. The numbers are those of the installed Triton, which
may differ from the Triton on the GPU machine: treat them as leads, and confirm with a timing.
The forward compiles with pointer loads of K and V; a Hopper GPU runs a variant of its own, with
tensor descriptors, on every call above ``descriptors_min_scores``: ``--descriptors`` compiles that one.

    python benchmarks/tools/kernel_resources.py --case none --D 128
    python benchmarks/tools/kernel_resources.py --case causal --kernel dkdv --config 64,128,8,2 --config 32,128,4,3
    python benchmarks/tools/kernel_resources.py --case none varlen --dropout 0.1 --config 64,128,8,2
    python benchmarks/tools/kernel_resources.py --case none padded varlen window --sass-hash   # before and after a refactor
    python benchmarks/tools/kernel_resources.py --case window additive --kernel fwd fwd_exact   # the forward's exact pass too
    python benchmarks/tools/kernel_resources.py --case causal --D 256 --kernel fwd --descriptors   # as a Hopper GPU runs it
    python benchmarks/tools/kernel_resources.py --case block_sparse --kernel fwd --option list_in_registers=0   # other choices
    python benchmarks/tools/kernel_resources.py --case causal --kernel dkdv --kv-heads 1   # grouped-query variants
    python benchmarks/tools/kernel_resources.py --case none causal window padded --D 64 128 256 --kernel gluon_bwd --sass-hash

``--sass-hash`` adds a hash of each kernel's machine code: a change of the kernel sources that
leaves every hash as it was compiles to the same code, so it needs no new timing. ``gluon_fwd`` and
``gluon_bwd`` compile the Hopper kernels of ``gluon_forward.py`` and ``gluon_backward.py`` as their
launchers would launch them (tile configs do not apply; ``--arch 90`` only): their register counts are
those of the launch, which the consumer warps raise at run time, so read their spills (LDL/STL).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import biasattn as ba  # noqa: E402
from biasattn.bias.spec import lower  # noqa: E402
from biasattn.ops.triton import configs, flash, flash_bwd, options, tma  # noqa: E402


def _biases(M: int) -> dict:
    return {
        "none": None,
        "causal": ba.LowerTriangularMask(),
        "window": ba.LocalAttentionMask(window_left=64),
        "varlen": ba.BlockDiagonalMask.from_seqlens([M // 2, M // 4, M // 4]),
        "varlen_causal": ba.BlockDiagonalMask.from_seqlens([M // 2, M // 4, M // 4]).make_causal(),
        "padded": ba.PaddedKeysMask([M, M // 2]),
        "block_sparse": "block_sparse",
        "alibi": "alibi",
        "additive": "additive",
        "additive_own": "additive_own",  # a bias slice per (batch row, head): dQ is read back from dS
    }


def capture(case: str, D: int, dtype, kernel: str, cfg: configs.TileConfig, dropout_p: float = 0.0,
            descriptors: bool = False, choices: dict | None = None, kv_heads: int = 2) -> list[tuple]:
    """``[(jit function, args, kwargs)]`` of the launches of one forward or backward call; with
    ``descriptors`` the forward takes K/V tensor descriptors, as on a Hopper GPU (else pointer loads);
    ``kv_heads`` 1 compiles the grouped-query variants (two query heads per KV head)."""
    B, H, M = (1 if case.startswith("varlen") else 2), 2, 256
    q = torch.randn(B, H, M, D, dtype=dtype)
    k, v = (torch.randn(B, kv_heads, M, D, dtype=dtype) for _ in range(2))
    bias = _biases(M)[case]
    if isinstance(bias, str) and bias == "additive":
        bias = ba.AdditiveBias(torch.randn(1, H, M, M, dtype=dtype))
    elif isinstance(bias, str) and bias == "additive_own":
        bias = ba.AdditiveBias(torch.randn(B, H, M, M, dtype=dtype))
    elif isinstance(bias, str) and bias == "block_sparse":
        bias = ba.BlockSparseMask(torch.rand(1, H, M // 128, M // 128) < 0.5, 128)
    elif isinstance(bias, str) and bias == "alibi":
        bias = ba.ALiBi(torch.rand(H))
    spec = lower(bias, B, H, M, M)
    launches = []
    real_run = JITFunction.run

    def fake_run(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = fake_run
    available = tma.available
    if descriptors:
        tma.available = lambda device: True
    try:
        if kernel.startswith("gluon"):
            with options.use(**(choices or {})):
                _gluon_call(kernel, q, k, v, spec)
            return launches
        with configs.override(**{kernel: cfg}), options.use(**({"descriptors_min_scores": 0} if descriptors else {}),
                                                              **(choices or {})):
            if kernel == "fwd":
                flash.attn_fwd(q, k, v, spec, D ** -0.5, dropout_p, 2**40 + 1)
            else:
                out = torch.zeros_like(q)
                lse = torch.zeros(B, H, M)
                flash_bwd.attn_bwd(q, k, v, out, lse, torch.zeros_like(q), None, spec, D ** -0.5,
                                   isinstance(bias, ba.AdditiveBias), dropout_p, 2**40 + 1)
    finally:
        JITFunction.run = real_run
        tma.available = available
    return launches


def _gluon_call(kernel: str, q, k, v, spec) -> None:
    """Run the launcher of a Gluon kernel (``gluon_fwd`` or ``gluon_bwd``) on CPU tensors, past the checks of
    device and size that keep CPU calls off it."""
    B, H, M, D = q.shape
    lse = torch.zeros(B, H, M)
    no_plan = ({}, None, ())  # store, key and roles of a call that keeps no launch plan
    if kernel == "gluon_fwd":
        flash._gluon_fwd(q, k, v, torch.empty_like(q), lse, spec, D ** -0.5 * flash.LOG2E, 2**40 + 1, *no_plan)
    else:
        new = [torch.empty_like(t) for t in (k, v)]
        flash_bwd._gluon_bwd(q, k, v, torch.zeros_like(q), lse, torch.zeros_like(q), None, spec, D ** -0.5,
                             D ** -0.5 * flash.LOG2E, *new, *no_plan)


def _signature(fn: JITFunction, args, kwargs) -> tuple[dict, dict, dict, dict]:
    """Signature, constexprs, attributes and options as Triton's launcher would specialize them
    (an integer equal to 1 becomes a constant; pointers and integers divisible by 16 say so)."""
    sig, constexprs, attrs, options = {}, {}, {}, {}
    for key in ("num_warps", "num_stages"):
        if key in kwargs:
            options[key] = kwargs[key]
    bound = dict(zip(fn.arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    for i, name in enumerate(fn.arg_names):
        value, param = bound[name], fn.params[i]
        if param.is_constexpr:
            constexprs[name] = value
            sig[name] = "constexpr"
            continue
        sig[name] = _specialize(value, (i,), param, constexprs, attrs)
    return sig, constexprs, attrs, options


def _specialize(value, path: tuple, param, constexprs: dict, attrs: dict):
    """The signature kind of one argument at ``path``, a tuple of kinds for a tuple (strides), noting
    the constants and 16-divisible values it specializes on under their paths."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    if type(value) is tuple:
        return tuple(_specialize(x, path + (j,), param, constexprs, attrs) for j, x in enumerate(value))
    kind, attr = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                        not param.do_not_specialize_on_alignment)
    if kind == "constexpr":
        constexprs[path] = value
    elif attr == "D":
        attrs[path] = [["tt.divisibility", 16]]
    return kind


def resources(fn: JITFunction, args, kwargs, arch: int) -> dict:
    """``{"regs", "stack", "shared"}`` of one launch compiled for ``sm_<arch>``."""
    sig, constexprs, attrs, options = _signature(fn, args, kwargs)
    if fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    else:
        source = ASTSource
    compiled = triton.compile(source(fn, sig, constexprs, attrs), target=GPUTarget("cuda", arch, 32), options=options)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump, "--dump-sass", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", text))
    code = "\n".join(line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line))  # instructions only
    return {"regs": int(found.get("REG", 0)), "stack": int(found.get("STACK", 0)),
            "shared": compiled.metadata.shared, "spill_ops": len(re.findall(r"\b(?:LDL|STL)\b", sass)),
            "sass_hash": hashlib.sha1(code.encode()).hexdigest()[:12]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", nargs="+", default=["none"], choices=list(_biases(8)))
    p.add_argument("--D", type=int, nargs="+", default=[128])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kernel", nargs="+", default=["fwd", "dkdv", "dq"],
                   choices=["fwd", "fwd_exact", "dkdv", "dq", "dbias", "dq_ds", "gluon_fwd", "gluon_bwd"])
    p.add_argument("--config", action="append", help="block_m,block_n,num_warps,num_stages (default: the candidates)")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--dropout", type=float, default=0.0, help="compile the dropout variants (this drop probability)")
    p.add_argument("--sass-hash", action="store_true", help="also print a hash of each kernel's machine code")
    p.add_argument("--descriptors", action="store_true",
                   help="the forward with K/V tensor descriptors, as Hopper GPUs run it (default: pointer loads)")
    p.add_argument("--kv-heads", type=int, default=2, choices=[1, 2],
                   help="1: grouped-query attention (2 query heads per KV head)")
    p.add_argument("--option", action="append", default=[], metavar="NAME=INT",
                   help="compile under a launch choice of biasattn.ops.triton.options (e.g. list_in_registers=0)")
    args = p.parse_args(argv)
    choices = {name: int(value) for name, value in (o.split("=", 1) for o in args.option)}
    dtype = getattr(torch, args.dtype)
    names = {"fwd": "_attn_fwd_kernel", "fwd_exact": "_attn_fwd_exact_kernel", "dkdv": "_attn_bwd_dkdv_kernel",
             "dq": "_attn_bwd_dq_kernel", "dbias": "_attn_bwd_dbias_kernel", "dq_ds": "_attn_bwd_dq_from_ds_kernel",
             "gluon_fwd": "_attn_fwd_ws_kernel", "gluon_bwd": "_attn_bwd_ws_kernel"}
    for case in args.case:
        for D in args.D:
            for kernel in args.kernel:
                _report(case, D, kernel, names[kernel], dtype, args, choices)
    return 0


def _report(case: str, D: int, kernel: str, name: str, dtype, args, choices: dict) -> None:
    """Print the resources of each config's launches of ``kernel`` (one line per config; one for a Gluon kernel)."""
    launcher = "fwd" if kernel == "fwd_exact" else kernel  # the exact pass follows the forward's launch
    if kernel.startswith("gluon"):
        dims = flash.GLUON_HEAD_DIMS if kernel == "gluon_fwd" else flash_bwd.GLUON_HEAD_DIMS
        if D not in dims:
            print(f"{case:9s} D={D} {kernel:5s}: no such kernel at this head dim (only {sorted(dims)})")
            return
        cfgs = [None]
    elif args.config:
        cfgs = [configs.TileConfig(*map(int, c.split(","))) for c in args.config]
    else:
        cfgs = configs.candidates(launcher, D)
    for cfg in cfgs:
        launches = capture(case, D, dtype, launcher, cfg, args.dropout, args.descriptors, choices, args.kv_heads)
        for fn, fargs, fkwargs in launches:
            if fn.__name__ != name:
                continue
            if cfg is None:
                tile = "as launched"
            else:
                tile = f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}" + (
                    " descriptors" if args.descriptors and kernel == "fwd" else "")
            try:
                r = resources(fn, fargs, fkwargs, args.arch)
                print(f"{case:9s} D={D} {kernel:5s} {tile}: {r['regs']} regs, {r['stack']} B stack, "
                      f"{r['spill_ops']} LDL/STL, {r['shared'] // 1024} KiB shared"
                      + (f", SASS {r['sass_hash']}" if args.sass_hash else ""), flush=True)
            except Exception as e:  # a config that does not fit is reported, not fatal
                print(f"{case:9s} D={D} {kernel:5s} {tile}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")


if __name__ == "__main__":
    sys.exit(main())
