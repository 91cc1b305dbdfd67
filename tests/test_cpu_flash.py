"""The ``cpu_flash`` operator (PyTorch's fused CPU attention): the reference's function on the calls
it declares, a hidden NaN or inf value kept out of the rows that cannot see it, and its refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given

import biasattn as ba
from biasattn.inputs import make_inputs
from biasattn.testing import assert_close_to_reference, reference_attention
from biasattn.testing import strategies as bst

OP = ba.ops.get("cpu_flash")


def _detached(args):
    return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in args)


def _runs(case, **kw) -> bool:
    inp = make_inputs(case.q, case.k, case.v, case.bias, scale=case.scale)
    return OP.supports(inp, **kw)


@given(case=bst.attention_inputs(families=("causal",), max_terms=1, max_seqlen=70, requires_grad=True))
def test_float64_out_lse_and_gradients_match_the_reference(case):
    assume(_runs(case, backward=True))
    args = (case.q, case.k, case.v, case.bias)
    ref, ref_lse = reference_attention(*args, scale=case.scale)
    out, lse = ba.attention_with_lse(*_detached(args), scale=case.scale, op="cpu_flash")
    assert_close_to_reference(out, ref, atol=1e-10)
    assert_close_to_reference(lse, ref_lse, atol=1e-10, name="lse")
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    wrt = (case.q, case.k, case.v)
    want = torch.autograd.grad((ref * dout).sum(), wrt)
    got = torch.autograd.grad((ba.attention(*args, scale=case.scale, op="cpu_flash") * dout).sum(), wrt)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close_to_reference(g, w, atol=1e-10, name=name)


@given(case=bst.attention_inputs(dtypes=(torch.float32,), families=("causal",), max_terms=1, max_seqlen=70,
                                 requires_grad=True))
def test_float32_within_twice_the_dtype_error(case):
    """out and lse within 2x, dk and dv within 2x and dq within 3x the error of the same math in the dtype."""
    assume(_runs(case, backward=True))
    args = (case.q, case.k, case.v, case.bias)
    ref, ref_lse = reference_attention(*args, scale=case.scale)
    low, low_lse = reference_attention(*args, scale=case.scale, compute_dtype=case.q.dtype)
    out, lse = ba.attention_with_lse(*_detached(args), scale=case.scale, op="cpu_flash")
    assert out.dtype == case.q.dtype
    assert_close_to_reference(out, ref, low)
    assert_close_to_reference(lse, ref_lse, low_lse, name="lse")
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2)).to(case.q.dtype)
    wrt = (case.q, case.k, case.v)
    want = torch.autograd.grad((ref * dout.double()).sum(), wrt)
    lows = torch.autograd.grad((low * dout).sum(), wrt)
    got = torch.autograd.grad((ba.attention(*args, scale=case.scale, op="cpu_flash") * dout).sum(), wrt)
    for name, g, w, lo in zip(("dq", "dk", "dv"), got, want, lows):
        assert g.dtype == case.q.dtype
        assert_close_to_reference(g, w, lo, factor=3.0 if name == "dq" else 2.0, name=name)


@pytest.mark.parametrize("which", ["key", "value"])
@pytest.mark.parametrize("path", ["forward", "forward again", "gradients"])
def test_a_nan_hidden_by_the_causal_mask_reaches_no_row_that_cannot_see_it(which, path):
    """The fused kernel multiplies a hidden value by 0; with a NaN in k or v the pass runs ``chunked``
    instead: rows before the poisoned key keep the clean output and query gradients, in the first
    forward-only call, the prepared one that follows, and a call with gradients."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 48, 16, generator=gen) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # grouped heads
    j = 30
    pk, pv = k.clone(), v.clone()
    (pk if which == "key" else pv)[0, 0, j] = float("nan")
    bias = ba.LowerTriangularMask()
    assert ba.explain(q, pk, pv, bias).splitlines()[2].split()[:2] == ["cpu_flash", "chosen"]
    if path == "gradients":
        def run(kk, vv):
            leaf = q.clone().requires_grad_()
            out = ba.attention(leaf, kk, vv, bias)
            return torch.autograd.grad(torch.where(torch.isfinite(out), out, 0.0).sum(), leaf)[0]
    else:
        def run(kk, vv):
            if path == "forward again":
                ba.attention(q, kk, vv, bias)
            return ba.attention(q, kk, vv, bias)
    clean, got = run(k, v), run(pk, pv)
    torch.testing.assert_close(got[:, :2, :j], clean[:, :2, :j])  # heads of the poisoned KV head, rows before j
    torch.testing.assert_close(got[:, 2:], clean[:, 2:])
    if path != "gradients":
        assert torch.isnan(got[:, :2, j:]).all()


def test_refusals_name_the_band_the_scale_and_the_lse_gradient():
    q = torch.randn(1, 2, 9, 8, requires_grad=True)
    reasons = OP.not_supported_reasons(make_inputs(q, q, q, ba.LocalAttentionMask(2)))
    assert "supports only a top-left causal band, not this band" in reasons
    reasons = OP.not_supported_reasons(make_inputs(q, q, q, ba.LowerTriangularMask(), scale=-0.5))
    assert "needs a positive scale, got scale=-0.5" in reasons
    reasons = OP.not_supported_reasons(make_inputs(q, q, q), need_lse=True)
    assert "its backward kernel cannot take a gradient through the log-sum-exp" in reasons
    reasons = OP.not_supported_reasons(make_inputs(q, q, q[..., :4]))
    assert "needs Dv == D, got Dv=4, D=8" in reasons
    half = q.detach().to(torch.bfloat16)
    assert "supports dtypes float32, float64, got bfloat16" in OP.not_supported_reasons(make_inputs(half, half, half))
    assert not OP.not_supported_reasons(make_inputs(q, q, q, ba.LowerTriangularFromBottomRightMask()))
    short = q[:, :, :4].detach()
    assert "supports only a top-left causal band, not this band" in OP.not_supported_reasons(
        make_inputs(short, q.detach(), q.detach(), ba.LowerTriangularFromBottomRightMask()))
