"""The default tiles of the Triton forward compile for Hopper (sm_90) without spilling registers.

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


@pytest.mark.parametrize(("case", "D"), [("padded", 128), ("varlen", 128), ("padded", 256)])
def test_the_forward_keeps_its_registers(case, D):
    """Padded keys and packed documents (their programs' rows share what they see) at head dims 128 and 256."""
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton ships no cuobjdump")
    c = configs.candidates("fwd", D)[0]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, TOOL, "--case", case, "--D", str(D), "--kernel", "fwd",
         "--config", f"{c.block_m},{c.block_n},{c.num_warps},{c.num_stages}"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    found = re.findall(r"(\d+) B stack, (\d+) LDL/STL", run.stdout)
    assert run.returncode == 0 and found, f"the tool failed:\n{run.stdout}\n{run.stderr[-2000:]}"
    for stack, spills in found:
        assert int(spills) == 0, f"{case}, D={D}, {c}: {spills} spill loads/stores, {stack} B stack"


def test_descriptors_compile_the_forward_a_hopper_gpu_runs():
    """``--descriptors`` compiles the forward with K/V tensor descriptors: other machine code than the
    pointer loads (the variant that runs on the GPU for every call above ``descriptors_min_scores``)."""
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton ships no cuobjdump")
    c = configs.candidates("fwd", 128)[0]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    hashes = {}
    for extra in ([], ["--descriptors"]):
        run = subprocess.run(
            [sys.executable, TOOL, "--case", "causal", "--D", "128", "--kernel", "fwd", "--sass-hash",
             "--config", f"{c.block_m},{c.block_n},{c.num_warps},{c.num_stages}", *extra],
            capture_output=True, text=True, env=env, timeout=600,
        )
        found = re.findall(r"fwd +\S+ \S+ \S+( descriptors)?: .*SASS (\w+)", run.stdout)
        assert run.returncode == 0 and len(found) == 1, f"the tool failed:\n{run.stdout}\n{run.stderr[-2000:]}"
        assert bool(found[0][0]) == bool(extra)
        hashes[bool(extra)] = found[0][1]
    assert hashes[True] != hashes[False]
