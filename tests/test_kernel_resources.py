"""The default tiles of the Triton kernels compile for Hopper (sm_90) without spilling registers, or for
dK/dV with grouped heads no more than without groups.

A spill does not change any result, so no correctness test sees one; it shows only as a slower
kernel on the GPU (an extra live ``[rows, dims]`` tile once spilled every forward and halved its
speed). ``benchmarks/tools/kernel_resources.py`` compiles the kernels with the installed Triton and
reads its ``cuobjdump``, no GPU needed; it runs in a process of its own, since this suite loads the
kernels under the Triton interpreter.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from biasattn.ops.triton import configs

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "benchmarks", "tools", "kernel_resources.py")


def _tool(*args: str) -> str:
    """Stdout of ``kernel_resources.py`` run with ``args`` in a process of its own (skips where the
    installed Triton ships no ``cuobjdump``)."""
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton ships no cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, f"the tool failed:\n{run.stdout}\n{run.stderr[-2000:]}"
    return run.stdout


def _config(kernel: str, D: int) -> str:
    c = configs.candidates(kernel, D)[0]
    return f"{c.block_m},{c.block_n},{c.num_warps},{c.num_stages}"


@pytest.mark.parametrize(("case", "D"), [("padded", 128), ("varlen", 128), ("padded", 256)])
def test_the_forward_keeps_its_registers(case, D):
    """Padded keys and packed documents (their programs' rows share what they see) at head dims 128 and 256."""
    out = _tool("--case", case, "--D", str(D), "--kernel", "fwd", "--config", _config("fwd", D))
    found = re.findall(r"(\d+) B stack, (\d+) LDL/STL", out)
    assert found, out
    for stack, spills in found:
        assert int(spills) == 0, f"{case}, D={D}, {_config('fwd', D)}: {spills} spill loads/stores, {stack} B stack"


def test_descriptors_compile_the_forward_a_hopper_gpu_runs():
    """``--descriptors`` compiles the forward with K/V tensor descriptors: other machine code than the
    pointer loads (the variant that runs on the GPU for every call above ``descriptors_min_scores``)."""
    hashes = {}
    for extra in ([], ["--descriptors"]):
        out = _tool("--case", "causal", "--D", "128", "--kernel", "fwd", "--sass-hash", "--config", _config("fwd", 128), *extra)
        found = re.findall(r"fwd +\S+ \S+ \S+( descriptors)?: .*SASS (\w+)", out)
        assert len(found) == 1, out
        assert bool(found[0][0]) == bool(extra)
        hashes[bool(extra)] = found[0][1]
    assert hashes[True] != hashes[False]


@pytest.mark.parametrize("case", ["causal", "additive"])
def test_grouped_query_dkdv_spills_no_more_than_without_groups(case):
    """dK/dV with two query heads per KV head walks the heads and tiles in one loop per kind of tile; a
    loop over the heads around the tile loops made Triton spill the accumulators (4-8x the local loads
    and stores of the kernel without groups). An additive bias prefetches each (head, tile)'s bias tile
    one step ahead in that loop, with the tiles its launches run (three stages)."""
    import torch

    c = configs._candidates_for("dkdv", 128, torch.bfloat16, ("additive",) if case == "additive" else ())[0]
    spills = {}
    for kv_heads in ("2", "1"):
        out = _tool("--case", case, "--D", "128", "--kernel", "dkdv", "--kv-heads", kv_heads,
                    "--config", f"{c.block_m},{c.block_n},{c.num_warps},{c.num_stages}")
        found = re.findall(r"(\d+) LDL/STL", out)
        assert len(found) == 1, out
        spills[kv_heads] = int(found[0])
    assert spills["1"] <= 1.25 * spills["2"] + 16, f"{spills['1']} spill loads/stores with groups, {spills['2']} without"


@pytest.mark.parametrize("kernel", ["gluon_fwd", "gluon_bwd"])
def test_the_hopper_kernels_compile_without_spills_as_launched(kernel):
    """The Gluon kernels, compiled for sm_90 with the arguments their launchers pass: without a mask neither
    spills an accumulator at head dims 128 and 256 (the consumer warps' register budget holds them). One spilled
    accumulator costs dozens of local loads and stores; the backward at D=128 keeps one scalar of its dK/dV
    stores in local memory (one store and one load a program, outside the tile loop), which is allowed. Gluon's API
    moves between Triton versions: where the installed Triton cannot build them, the operator runs the
    ``triton.language`` kernels instead, and this test skips."""
    out = _tool("--case", "none", "--D", "128", "256", "--kernel", kernel)
    if "CompilationError" in out:
        pytest.skip("the installed Triton's Gluon does not build these kernels")
    found = re.findall(r"D=(\d+) \w+ as launched: .* (\d+) LDL/STL", out)
    assert sorted(int(d) for d, _ in found) == [128, 256], out
    assert all(int(spills) <= (2 if kernel == "gluon_bwd" and d == "128" else 0) for d, spills in found), out
