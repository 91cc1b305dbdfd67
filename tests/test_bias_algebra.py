"""The composition algebra: every pair of families composes to the composition of its materialized
parts, ``&`` is commutative and idempotent, and impossible compositions name the pair."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import biasattn as ba
from biasattn.testing import assert_close_to_reference, reference_attention
from biasattn.testing import strategies as bst

PAIRS = list(itertools.combinations_with_replacement(bst.FAMILIES, 2))
SELF_EXCLUSIVE = {"block_diagonal", "block_sparse"}  # two of these compose only when their geometry agrees


def _materialize(bias, shape):
    return bias.materialize(shape.bias_shape, dtype=torch.float64)


@st.composite
def _pair(draw, a, b):
    shape = draw(bst.shapes(batch=1 if "block_diagonal" in (a, b) else None, max_seqlen=20, allow_empty=True))
    x = draw(bst.bias_of_family(a, shape))
    y = draw(bst.bias_of_family(b, shape))
    return shape, x, y


@pytest.mark.parametrize("a,b", PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
@settings(max_examples=8)
@given(data=st.data())
def test_every_pair_composes_to_the_sum_of_its_parts(a, b, data):
    shape, x, y = data.draw(_pair(a, b))
    if a == b and a in SELF_EXCLUSIVE:
        try:
            both = x + y
        except ba.BiasCompositionError as e:
            assert f"cannot compose {x._family()} with {y._family()}" in str(e)
            return
    else:
        both = x + y
    expected = _materialize(x, shape) + _materialize(y, shape)
    torch.testing.assert_close(_materialize(both, shape), expected, rtol=0, atol=1e-12)
    if x.is_mask and y.is_mask:
        assert torch.equal(_materialize(x & y, shape), _materialize(both, shape))
        assert (x & y).is_mask


@given(data=st.data())
def test_and_is_commutative_and_idempotent(data):
    masks = tuple(sorted(bst.MASK_FAMILIES))
    names = data.draw(bst.family_lists(masks, min_terms=2, max_terms=2))
    shape = data.draw(bst.shapes(batch=1 if "block_diagonal" in names else None, max_seqlen=20))
    x, y = (data.draw(bst.bias_of_family(n, shape)) for n in names)
    assert torch.equal(_materialize(x & y, shape), _materialize(y & x, shape))
    assert torch.equal(_materialize(x & x, shape), _materialize(x, shape))
    z = data.draw(bst.bias_of_family("causal", shape))
    assert torch.equal(_materialize((x & y) & z, shape), _materialize(x & (y & z), shape))


@given(data=st.data())
def test_three_terms_equal_the_sum_of_materialized_terms(data):
    names = data.draw(bst.family_lists(min_terms=3, max_terms=3))
    shape = data.draw(bst.shapes(batch=1 if "block_diagonal" in names else None, max_seqlen=20))
    terms = [data.draw(bst.bias_of_family(n, shape)) for n in names]
    bias = bst.compose(terms, ["+", "+"])
    expected = sum(_materialize(t, shape) for t in terms)
    torch.testing.assert_close(_materialize(bias, shape), expected, rtol=0, atol=1e-12)
    assert isinstance(bias, ba.ComposedBias) and len(bias.atoms) == 3


def test_and_with_an_additive_term_names_the_pair():
    with pytest.raises(ba.BiasCompositionError, match=r"cannot compose LowerTriangularMask & ALiBi: .*use '\+'"):
        ba.LowerTriangularMask() & ba.ALiBi(torch.ones(2))
    with pytest.raises(ba.BiasCompositionError, match="cannot compose AdditiveBias & PaddedKeysMask"):
        ba.AdditiveBias(torch.zeros(3)) & ba.PaddedKeysMask([2])


def test_union_has_no_lazy_form():
    with pytest.raises(ba.BiasCompositionError, match=r"cannot compose LowerTriangularMask \| LocalAttentionMask"):
        ba.LowerTriangularMask() | ba.LocalAttentionMask(2)


def test_block_diagonal_masks_of_different_lengths_name_the_pair():
    with pytest.raises(ba.BiasCompositionError, match="cannot compose BlockDiagonalMask with BlockDiagonalMask: .*different"):
        ba.BlockDiagonalMask.from_seqlens([2, 3]) & ba.BlockDiagonalMask.from_seqlens([3, 2])


def test_block_sparse_masks_of_different_block_sizes_name_the_pair():
    a = ba.BlockSparseMask(torch.ones(2, 2, dtype=torch.bool), 2)
    b = ba.BlockSparseMask(torch.ones(1, 1, dtype=torch.bool), 4)
    match = r"BlockSparseMask with BlockSparseMask: block sizes differ: \(2, 2\) and \(4, 4\)"
    with pytest.raises(ba.BiasCompositionError, match=match):
        a & b


def test_sizes_that_disagree_name_both_families():
    with pytest.raises(ba.InputError, match="ALiBi and PaddedKeysMask fix B=2 and B=3"):
        ba.PaddedKeysMask([1, 2]) + ba.ALiBi(torch.ones(3, 4))
    with pytest.raises(ba.InputError, match="AdditiveBias and BlockDiagonalMask fix Mq=5 and Mq=4"):
        ba.BlockDiagonalMask.from_seqlens([2, 3]) + ba.AdditiveBias(torch.zeros(4, 5))


def test_sliced_biases_do_not_compose():
    a = ba.LowerTriangularMask()[..., 2:, :]
    with pytest.raises(ba.BiasCompositionError, match="compose first, then slice"):
        a & ba.PaddedKeysMask([3])


def test_biases_on_different_devices_do_not_compose():
    """Biases whose devices were given do not compose across devices; one built from lists follows the other."""
    with pytest.raises(ba.InputError, match="different devices: cpu and meta"):
        ba.PaddedKeysMask([3], device="cpu") & ba.PaddedKeysMask([2], device="meta")
    both = ba.PaddedKeysMask([3]) & ba.PaddedKeysMask([2], device="meta")
    assert both.device.type == "meta" and all(t.device.type == "meta" for a in both.atoms for t in a.tensors().values())


@pytest.mark.gpu
def test_cuda_and_cuda_index_are_one_device():
    """A bias made with device="cuda" composes with one built on a tensor on the current device (cuda:N)."""
    layout = torch.ones(1, 1, 2, 2, dtype=torch.bool, device="cuda")
    both = ba.PaddedKeysMask([3, 4], device="cuda") & ba.BlockSparseMask(layout, 2)
    assert both.device == layout.device


def test_same_family_twice():
    a = ba.PaddedKeysMask([3, 5]) & ba.PaddedKeysMask([4, 2])
    got = a.materialize((2, 1, 1, 6), dtype=torch.float64)
    assert ((got == 0).sum(-1).flatten() == torch.tensor([3, 2])).all()
    b = ba.LocalAttentionMask(3) & ba.LowerTriangularMask()
    want = ba.LocalAttentionMask(3).materialize((1, 1, 5, 5)) + ba.LowerTriangularMask().materialize((1, 1, 5, 5))
    assert torch.equal(b.materialize((1, 1, 5, 5)), want)


def test_composition_keeps_the_additive_dtype():
    bias = ba.LowerTriangularMask() + ba.AdditiveBias(torch.zeros(3, 3, dtype=torch.float64))
    assert bias.dtype == torch.float64
    assert (ba.LowerTriangularMask() & ba.PaddedKeysMask([2])).dtype == torch.float32


def test_composed_family_names_read_as_the_expression():
    masks = ba.LowerTriangularMask() & ba.PaddedKeysMask([2])
    assert masks._family() == "ComposedBias(LowerTriangularMask & PaddedKeysMask)"
    assert (masks + ba.ALiBi(torch.ones(2)))._family() == "ComposedBias((LowerTriangularMask & PaddedKeysMask) + ALiBi)"
    assert (ba.PaddedKeysMask([2]) + ba.ALiBi(torch.ones(2)))._family() == "ComposedBias(PaddedKeysMask + ALiBi)"


@pytest.mark.parametrize("left", [True, False], ids=["mask&tensor", "tensor&mask"])
@pytest.mark.parametrize("dims", [2, 3, 4])
def test_and_with_a_bool_tensor_intersects_as_attn_bias_reads_it(left, dims):
    """bias & bool_tensor failed inside torch with "bitwise_and_cpu" not implemented for 'Float'."""
    visible = torch.rand((2, 1, 5, 6)[4 - dims :], generator=torch.Generator().manual_seed(0)) < 0.7
    mask = ba.LowerTriangularFromBottomRightMask()
    both = (mask & visible) if left else (visible & mask)
    assert isinstance(both, ba.ComposedBias) and both.is_mask
    shape = (2, 3, 5, 6)
    want = mask.materialize(shape, dtype=torch.float64) + ba.AdditiveBias(visible).materialize(shape, dtype=torch.float64)
    assert torch.equal(both.materialize(shape, dtype=torch.float64), want)
    q = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    k, v = torch.randn(2, 3, 6, 4, dtype=torch.float64), torch.randn(2, 3, 6, 4, dtype=torch.float64)
    ref, _ = reference_attention(q, k, v, both)
    assert_close_to_reference(ba.attention(q, k, v, both, op="reference"), ref, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_and_with_a_tensor_that_is_not_bool_says_what_to_write(dtype):
    t = torch.zeros(5, 6, dtype=dtype)
    for expr in (lambda: ba.LowerTriangularMask() & t, lambda: t & ba.LowerTriangularMask()):
        with pytest.raises(ba.BiasCompositionError, match=r"cannot compose LowerTriangularMask & a \w+ tensor: .*bool tensor"):
            expr()
    with pytest.raises(ba.BiasCompositionError, match=r"AdditiveBias\(t\)"):
        ba.LowerTriangularMask() & torch.zeros(5, 6)
