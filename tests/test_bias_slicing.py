"""Lazy slicing: ``bias[..., a:b, c:d].materialize() == bias.materialize()[..., a:b, c:d]``, and a
sliced bias gives the same attention as the sliced dense mask."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import biasattn as ba
from biasattn.ops.chunked import ChunkedOperator
from biasattn.testing import assert_close_to_reference, reference_attention
from biasattn.testing import strategies as bst

CHUNKED_SMALL = ChunkedOperator(block_q=8, block_k=8)


@st.composite
def sliced_case(draw, max_seqlen=40):
    names = draw(bst.family_lists(min_terms=1, max_terms=3))
    shape = draw(bst.shapes(batch=1 if "block_diagonal" in names else None, max_seqlen=max_seqlen))
    bias = draw(bst._compose_families(names, shape))
    bottom_right = any(a.needs_full_size for a in bias.atoms)
    if (bottom_right and None in bias.sizes[2:]) or draw(st.booleans()):
        bias = bias.bind(shape.Mq, shape.Mk)
    a = draw(st.integers(0, shape.Mq))
    b = draw(st.integers(a, shape.Mq))
    c = draw(st.integers(0, shape.Mk))
    d = draw(st.integers(c, shape.Mk))
    return shape, bias, (a, b, c, d)


@settings(max_examples=3 * settings().max_examples)
@given(case=sliced_case())
def test_slicing_commutes_with_materialize(case):
    shape, bias, (a, b, c, d) = case
    full = bias.materialize(shape.bias_shape, dtype=torch.float64)
    part = bias[..., a:b, c:d]
    assert isinstance(part, ba.AttentionBias)
    got = part.materialize((shape.B, shape.Hq, b - a, d - c), dtype=torch.float64)
    assert torch.equal(got, full[..., a:b, c:d])


@given(case=sliced_case(), inner=st.tuples(st.integers(0, 5), st.integers(0, 5)))
def test_slice_of_a_slice(case, inner):
    shape, bias, (a, b, c, d) = case
    x, y = min(inner[0], b - a), min(inner[1], d - c)
    full = bias.materialize(shape.bias_shape, dtype=torch.float64)
    twice = bias[..., a:b, c:d][..., x:, y:]
    got = twice.materialize((shape.B, shape.Hq, b - a - x, d - c - y), dtype=torch.float64)
    assert torch.equal(got, full[..., a + x : b, c + y : d])


@given(case=sliced_case(max_seqlen=30))
def test_sliced_bias_gives_the_attention_of_the_sliced_dense_mask(case):
    shape, bias, (a, b, c, d) = case
    dense = bias.materialize(shape.bias_shape, dtype=torch.float64)[..., a:b, c:d]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(shape.B, shape.Hq, b - a, shape.D, generator=gen, dtype=torch.float64)
    k = torch.randn(shape.B, shape.Hkv, d - c, shape.D, generator=gen, dtype=torch.float64)
    v = torch.randn(shape.B, shape.Hkv, d - c, shape.Dv, generator=gen, dtype=torch.float64)
    ref, ref_lse = reference_attention(q, k, v, bias_dense=dense)
    for op in (CHUNKED_SMALL, "reference"):
        out, lse = ba.attention_with_lse(q, k, v, bias[..., a:b, c:d], op=op)
        assert_close_to_reference(out, ref, name=f"{op} out")
        assert_close_to_reference(lse, ref_lse, name=f"{op} lse")


def test_bind_survives_slicing():
    """Regression: slicing a bound bias dropped the bound sizes, so bottom-right alignment moved."""
    bias = ba.LowerTriangularFromBottomRightMask().bind(3, 3)
    full = bias.materialize((1, 1, 3, 3))
    part = bias[..., 0:2, 0:1]
    assert part._full == (3, 3)
    assert torch.equal(part.materialize((1, 1, 2, 1)), full[..., 0:2, 0:1])
    assert bias.to("cpu")._full == (3, 3) and bias.clone()._full == (3, 3)


def test_bottom_right_kv_cache_chunked_prefill():
    """Queries 4..7 of an 8 × 12 bottom-right causal bias see keys up to i + 4."""
    bias = ba.LowerTriangularFromBottomRightMask().bind(8, 12)[..., 4:8, :]
    got = bias.materialize((1, 1, 4, 12))
    assert ((got == 0).sum(-1).flatten() == torch.tensor([9, 10, 11, 12])).all()


def test_unsized_bottom_right_slice_needs_bind():
    with pytest.raises(ba.InputError, match=r"bottom-right corner.*bias.bind\(Mq, Mk\)"):
        ba.LowerTriangularFromBottomRightMask()[..., 0:2, :]
    tail = ba.LocalAttentionMask(2)[..., 3:, :]  # open-ended: the call supplies the full size
    got = tail.materialize((1, 1, 2, 5))
    assert torch.equal(got, ba.LocalAttentionMask(2).materialize((1, 1, 5, 5))[..., 3:, :])


def test_unsized_top_left_slice():
    got = ba.LowerTriangularMask()[..., 4:8, 0:6].materialize((1, 1, 4, 6))
    assert torch.equal(got, ba.LowerTriangularMask().materialize((1, 1, 8, 6))[..., 4:8, :])


def test_unsized_layout_slice_only_needs_coverage():
    """Regression: a slice of an unbound BlockSparseMask demanded a layout of exactly the slice's size."""
    layout = torch.tensor([[True, False, True], [False, True, True]])
    bias = ba.BlockSparseMask(layout, 2)
    full = bias.materialize((1, 1, 4, 6))
    assert torch.equal(bias[..., 0:3, 1:4].materialize((1, 1, 3, 3)), full[..., 0:3, 1:4])
    assert torch.equal(bias[..., 0:0, 0:0].materialize((1, 1, 0, 0)), full[..., 0:0, 0:0])
    with pytest.raises(ba.InputError, match="got 2 x 3"):
        bias.materialize((1, 1, 4, 8))


def test_unsized_padded_slice_before_the_lengths_end():
    """Regression: a key slice of an unbound PaddedKeysMask ending before a length was rejected."""
    bias = ba.PaddedKeysMask([5])[..., :, 0:3]
    q = torch.randn(1, 1, 2, 4)
    k = v = torch.randn(1, 1, 3, 4)
    torch.testing.assert_close(ba.attention(q, k, v, bias), ba.attention(q, k, v))


def test_sized_slices_accept_negative_bounds():
    bias = ba.BlockDiagonalMask.from_seqlens([3, 4])
    full = bias.materialize((1, 1, 7, 7))
    assert torch.equal(bias[..., -3:, :-2].materialize((1, 1, 3, 5)), full[..., -3:, :-2])
    assert torch.equal(bias[2:5].materialize((1, 1, 3, 7)), full[..., 2:5, :])


def test_bad_slices():
    bias = ba.LowerTriangularMask()
    with pytest.raises(ba.InputError, match="step 1, got step 2"):
        bias[..., ::2, :]
    with pytest.raises(ba.InputError, match=r"bias\[\.\.\., q0:q1, k0:k1\]"):
        bias[..., 3, :]
    with pytest.raises(ba.InputError, match="non-negative bounds"):
        bias[..., -2:, :]


def test_slice_too_short_for_the_call():
    bias = ba.PaddedKeysMask([6]).bind(6, 6)[..., 2:, :]
    q = torch.randn(1, 1, 5, 4)
    k = torch.randn(1, 1, 6, 4)
    with pytest.raises(ba.InputError, match="attn_bias .* has Mq 4, q has 5"):
        ba.attention(q, k, k, bias)


def test_bind_errors():
    with pytest.raises(ba.InputError, match="already sized Mq=5, cannot bind to 4"):
        ba.BlockDiagonalMask.from_seqlens([2, 3]).bind(4, 5)
    with pytest.raises(ba.InputError, match="before slicing it"):
        ba.LowerTriangularMask()[..., 1:, :].bind(4, 4)
