"""``benchmarks/tools/profile_kernels.py``: its host marks on any machine, and its help."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import biasattn as ba
from biasattn.ops import autograd
from biasattn.ops.triton import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "benchmarks", "tools", "profile_kernels.py")
sys.path.insert(0, os.path.dirname(TOOL))
from profile_kernels import host_marks  # noqa: E402


def test_host_marks_follow_a_training_call_and_leave_the_operator_as_it_was():
    saved = (launch._Direct._run, autograd._AttentionFunction.forward, autograd._AttentionFunction.backward)
    q, k, v = (torch.randn(1, 2, 24, 16, requires_grad=True) for _ in range(3))
    marks = []
    with host_marks(marks):
        out = ba.attention(q, k, v, attn_bias=ba.LocalAttentionMask(window_left=5))
        torch.autograd.grad(out.sum(), (q, k, v))
    assert [label for label, _ in marks] == ["forward in", "forward out", "backward in", "backward out"]
    assert [t for _, t in marks] == sorted(t for _, t in marks)
    assert (launch._Direct._run, autograd._AttentionFunction.forward, autograd._AttentionFunction.backward) == saved
    marks.clear()
    out = ba.attention(q, k, v, attn_bias=ba.LocalAttentionMask(window_left=5))
    torch.autograd.grad(out.sum(), (q, k, v))
    assert marks == []


def test_help_runs_without_a_gpu_and_offers_the_timeline():
    env = dict(os.environ, PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, TOOL, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0 and "--timeline" in run.stdout
