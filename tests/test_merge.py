"""``merge_attentions`` over disjoint key sets equals attention over their union (values, lse and
gradients), with key sets taken as lazy slices of one bias."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import biasattn as ba
from biasattn.ops.chunked import ChunkedOperator
from biasattn.testing import assert_close_to_reference, reference_attention
from biasattn.testing import strategies as bst

CHUNKED_SMALL = ChunkedOperator(block_q=8, block_k=8)
MERGE_ATOL = 1e-10  # float64 inputs merge in float64


@st.composite
def split_case(draw):
    case = draw(bst.attention_inputs(min_terms=0, max_terms=2, max_seqlen=40, requires_grad=True))
    Mk = case.shape.Mk
    cuts = sorted(draw(st.lists(st.integers(0, Mk), min_size=0, max_size=2)))
    return case, [0, *cuts, Mk]


@given(split=split_case())
def test_merge_of_key_slices_equals_attention_over_all_keys(split):
    case, bounds = split
    s = case.shape
    bias = case.bias.bind(s.Mq, s.Mk) if case.bias is not None and None in case.bias.sizes[2:] else case.bias
    outs, lses = [], []
    for c0, c1 in zip(bounds, bounds[1:]):
        part = None if bias is None else bias[..., :, c0:c1]
        k, v = case.k[:, :, c0:c1], case.v[:, :, c0:c1]
        o, l = ba.attention_with_lse(case.q, k, v, part, scale=case.scale, op=CHUNKED_SMALL)
        outs.append(o)
        lses.append(l)
    out, lse = ba.merge_attentions(outs, lses)
    ref, ref_lse = reference_attention(case.q, case.k, case.v, case.bias, scale=case.scale)
    assert_close_to_reference(out, ref, atol=MERGE_ATOL, name="merged out")
    assert_close_to_reference(lse, ref_lse, atol=MERGE_ATOL, name="merged lse")
    wrt = [case.q, case.k, case.v]
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got = torch.autograd.grad((out * dout).sum(), wrt, allow_unused=True)
    expected = torch.autograd.grad((ref * dout).sum(), wrt, allow_unused=True)
    for name, g, e, w in zip("qkv", got, expected, wrt):
        g = torch.zeros_like(w) if g is None else g
        e = torch.zeros_like(w) if e is None else e
        assert_close_to_reference(g, e, atol=10 * MERGE_ATOL, name=f"d{name}")


def test_rows_hidden_in_every_part_give_zero_and_neg_inf():
    outs = [torch.zeros(1, 1, 2, 3), torch.ones(1, 1, 2, 3)]
    lses = [torch.full((1, 1, 2), float("-inf")), torch.tensor([[[float("-inf"), 0.5]]])]
    out, lse = ba.merge_attentions(outs, lses)
    assert (out[0, 0, 0] == 0).all() and torch.isneginf(lse[0, 0, 0])
    torch.testing.assert_close(out[0, 0, 1], torch.ones(3))
    assert lse[0, 0, 1].item() == pytest.approx(0.5)


def test_merge_of_one_part_is_identity():
    o = torch.randn(2, 3, 4, 5)
    l = torch.randn(2, 3, 4)
    out, lse = ba.merge_attentions([o], [l])
    torch.testing.assert_close(out, o)
    torch.testing.assert_close(lse, l)


def test_merge_argument_errors():
    o, l = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3)
    with pytest.raises(ba.InputError, match="equal length, got 2 and 1"):
        ba.merge_attentions([o, o], [l])
    with pytest.raises(ba.InputError, match=r"outs\[1\] has shape \[1, 2, 3, 5\], outs\[0\] has \[1, 2, 3, 4\]"):
        ba.merge_attentions([o, torch.randn(1, 2, 3, 5)], [l, l])
    with pytest.raises(ba.InputError, match=r"lses\[0\] must have shape \[1, 2, 3\], got \[1, 2, 4\]"):
        ba.merge_attentions([o], [torch.randn(1, 2, 4)])


def test_merge_keeps_float64():
    """Regression: merge_attentions combined float64 partial results in float32 (errors near 1e-7)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 7, 8, dtype=torch.float64, generator=gen)
    k = torch.randn(1, 2, 40, 8, dtype=torch.float64, generator=gen)
    v = torch.randn(1, 2, 40, 8, dtype=torch.float64, generator=gen)
    parts = [ba.attention_with_lse(q, k[:, :, a:b], v[:, :, a:b]) for a, b in ((0, 13), (13, 40))]
    out, lse = ba.merge_attentions([p[0] for p in parts], [p[1] for p in parts])
    assert out.dtype == lse.dtype == torch.float64
    assert (out - ba.attention(q, k, v)).abs().max() < 1e-13
