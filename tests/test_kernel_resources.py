"""The default tiles of the Triton forward compile for Hopper (sm_90) without spilling registers.

A spill does not change any result, so no correctness test sees one; it shows only as a slower
kernel on the GPU (an extra live ``[rows, dims]`` tile once spilled every forward and halved its
speed). Compiled here with the installed Triton and its ``cuobjdump``, no GPU needed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest
import torch

from biasattn.ops.triton import configs

pytestmark = pytest.mark.slow

TOOL = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "tools", "kernel_resources.py")


def _tool():
    triton = pytest.importorskip("triton")
    if not shutil.which("cuobjdump", path=os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")):
        pytest.skip("this Triton ships no cuobjdump")
    spec = importlib.util.spec_from_file_location("kernel_resources", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("case", "D"), [("padded", 128), ("varlen", 128), ("padded", 256)])
def test_the_forward_keeps_its_registers(case, D, monkeypatch):
    """Padded keys and packed documents (their programs' rows share what they see) at head dims 128 and 256."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tool = _tool()
    cfg = configs.candidates("fwd", D)[0]
    launches = [launch for launch in tool.capture(case, D, torch.bfloat16, "fwd", cfg)
                if launch[0].__name__ == "_attn_fwd_kernel"]
    assert launches, "the forward launched no kernel"
    for fn, args, kwargs in launches:
        used = tool.resources(fn, args, kwargs, 90)
        assert used["spill_ops"] == 0, f"{case}, D={D}, {cfg}: {used['spill_ops']} spill loads/stores, {used['stack']} B stack"
