"""GPU: for every benchmark case, ``explain()`` and automatic dispatch name the operator measured fastest.

The expected choices are those of ``benchmarks/results/h200/dispatch.md`` (bf16, D=128, sm90): the
test fails when a declaration or the priority list drifts from the measured table.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import biasattn as ba
from biasattn import api

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from cases import CASE_NAMES, make_case  # noqa: E402

pytestmark = pytest.mark.gpu

# case -> (forward operator, backward operator), as measured fastest on the H200
EXPECTED = {
    "none": ("cudnn", "cudnn"),
    "causal": ("cudnn", "cudnn"),
    "window": ("triton", "triton"),
    "padded": ("triton", "triton"),
    "varlen": ("triton", "triton"),
    "block_sparse": ("triton", "triton"),
    "additive": ("cudnn", "triton"),
    "alibi": ("triton", "triton"),
}


def _section(text: str, title: str) -> str:
    part = text.split(f"\n{title}:\n", 1)[1]
    return part.split("\nbackward:\n", 1)[0]


@pytest.fixture(scope="module", autouse=True)
def _sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the expected choices are the ones measured on sm90 (H100/H200)")


def test_every_benchmark_case_has_an_expectation():
    assert set(EXPECTED) == set(CASE_NAMES)


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
def test_explain_and_dispatch_pick_the_measured_fastest(name, backward, monkeypatch):
    case = make_case(name, B=1, H=4, M=2048, D=128, requires_grad=backward)  # the window (1024) must be narrower than M
    bias = case.bias.to("cuda") if case.bias is not None else None
    want_fwd, want_bwd = EXPECTED[name]
    text = ba.explain(case.q, case.k, case.v, bias, requires_grad=backward)
    assert f"  {want_fwd:<14} chosen" in _section(text, "forward"), text
    if backward:
        assert f"  {want_bwd:<14} chosen" in _section(text, "backward"), text

    used = []
    real = api.autograd.run

    def spy(inp, fwd, bwd, **kw):
        used.append((fwd.NAME, bwd.NAME if bwd is not None else None))
        return real(inp, fwd, bwd, **kw)

    monkeypatch.setattr(api.autograd, "run", spy)
    out = ba.attention(case.q, case.k, case.v, bias)
    assert used == [(want_fwd, want_bwd if backward else None)]
    assert torch.isfinite(out).all()
    if backward:
        grads = torch.autograd.grad(out, (case.q, case.k, case.v), torch.randn_like(out))
        assert all(torch.isfinite(g).all() for g in grads)
