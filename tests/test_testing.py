"""The public testing package: the reference, the dtype-relative assertion, poison, and strategies
whose draws always fit together."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import biasattn as ba
from biasattn.inputs import make_inputs
from biasattn.testing import (
    assert_close_to_reference,
    dense_bias,
    poison_,
    poison_hidden_lines,
    poison_padding_,
    poisoned_allocations,
    reference_attention,
)
from biasattn.testing import strategies as bst


def qkv(B=2, Hq=4, Hkv=2, Mq=5, Mk=7, D=8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(B, Hq, Mq, D, generator=gen, dtype=dtype),
        torch.randn(B, Hkv, Mk, D, generator=gen, dtype=dtype),
        torch.randn(B, Hkv, Mk, D, generator=gen, dtype=dtype),
    )


# ------------------------------------------------------------------------------------ reference
def test_reference_is_textbook_softmax_attention():
    q, k, v = qkv()
    bias = torch.randn(2, 1, 5, 7, dtype=torch.float64)
    out, lse = reference_attention(q, k, v, bias, scale=0.3)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = q @ kr.transpose(-1, -2) * 0.3 + bias
    torch.testing.assert_close(out, torch.softmax(s, -1) @ vr, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=0, atol=1e-12)
    assert out.dtype == lse.dtype == torch.float64


def test_reference_default_scale_and_compute_dtype():
    q, k, v = qkv(dtype=torch.float16)
    out, _ = reference_attention(q, k, v)
    want, _ = reference_attention(q, k, v, scale=1 / math.sqrt(8))
    assert out.dtype == torch.float64 and torch.equal(out, want)
    low, low_lse = reference_attention(q, k, v, compute_dtype=torch.float16)
    assert low.dtype == low_lse.dtype == torch.float16


def test_reference_reads_materialize_not_the_lowering():
    q, k, v = qkv(B=1)
    bias = ba.BlockDiagonalMask.from_seqlens([2, 3], [3, 4]).make_causal()
    dense = bias.materialize((1, 4, 5, 7), dtype=torch.float64)
    torch.testing.assert_close(reference_attention(q, k, v, bias)[0], reference_attention(q, k, v, bias_dense=dense)[0])
    assert torch.equal(dense_bias(bias, (1, 4, 5, 7)), dense)
    assert dense_bias(None, (1, 4, 5, 7)) is None
    mask = torch.rand(5, 7) < 0.5
    assert torch.equal(dense_bias(mask, (1, 1, 5, 7))[0, 0] == 0, mask)


def test_reference_rows_without_keys():
    q, k, v = (t.requires_grad_() for t in qkv(Mk=3))
    out, lse = reference_attention(q, k, v, ba.PaddedKeysMask([0, 3]))
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()
    (out.sum() + lse[1].sum()).backward()
    assert not any(torch.isnan(t.grad).any() for t in (q, k, v))
    q, k, v = qkv(Mk=0)
    out, lse = reference_attention(q, k, v)
    assert out.shape == (2, 4, 5, 8) and (out == 0).all() and torch.isneginf(lse).all()


# ------------------------------------------------------------------------------------ assertion
def test_assert_close_bound_is_relative_to_the_low_precision_error():
    ref = torch.zeros(10, dtype=torch.float64)
    low = torch.full((10,), 0.01)
    assert_close_to_reference(torch.full((10,), 0.015), ref, low)  # 0.015 <= 2 * 0.01 + atol
    with pytest.raises(AssertionError, match=r"max\|out - ref\| = 0.025 exceeds 2.0 \* 0.01"):
        assert_close_to_reference(torch.full((10,), 0.025), ref, low)
    assert_close_to_reference(torch.full((10,), 0.025), ref, low, factor=3.0)
    with pytest.raises(AssertionError, match="exceeds"):
        assert_close_to_reference(torch.full((10,), 1e-6, dtype=torch.float64), ref)  # float64: atol only


def test_assert_close_nonfinite_entries():
    ref = torch.tensor([0.0, float("-inf")], dtype=torch.float64)
    assert_close_to_reference(torch.tensor([0.0, float("-inf")]), ref)
    with pytest.raises(AssertionError, match=r"\[1\] is -3.0, the reference is -inf"):
        assert_close_to_reference(torch.tensor([0.0, -3.0]), ref)
    with pytest.raises(AssertionError, match="1 NaN where the reference is finite"):
        assert_close_to_reference(torch.tensor([float("nan"), float("-inf")]), ref)
    with pytest.raises(AssertionError, match=r"shape \[3\], the reference has \[2\]"):
        assert_close_to_reference(torch.zeros(3), ref)


# ------------------------------------------------------------------------------------ poison
def test_poison_fills():
    assert torch.isnan(poison_(torch.zeros(3))).all()
    assert (poison_(torch.zeros(3, dtype=torch.int32)) == 2**31 - 1).all()
    x = poison_padding_(torch.zeros(2, 1, 5, 3), [2, 5])
    assert torch.isnan(x[0, :, 2:]).all() and not torch.isnan(x[0, :, :2]).any() and not torch.isnan(x[1]).any()


def test_poison_hidden_lines():
    """NaN exactly in the query rows and keys the bias hides everywhere; a key of a shared KV head stays
    clean while any of its query heads sees it; the inputs are untouched."""
    q, k, v = torch.zeros(2, 4, 3, 8), torch.zeros(2, 2, 5, 8), torch.zeros(2, 2, 5, 4)
    pq, pk, pv = poison_hidden_lines(q, k, v, ba.PaddedKeysMask([5, 2]))
    assert not torch.isnan(pq).any() and not torch.isnan(k).any()
    assert torch.isnan(pk[1, :, 2:]).all() and torch.isnan(pv[1, :, 2:]).all()
    assert not torch.isnan(pk[0]).any() and not torch.isnan(pk[1, :, :2]).any()
    seg = ba.BlockDiagonalMask.from_seqlens([1, 0, 2], [2, 2, 0])  # rows 1-2 see nothing; keys 2-3 are seen by none
    pq, pk, _ = poison_hidden_lines(torch.zeros(1, 2, 3, 8), torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8), seg)
    assert torch.isnan(pq[0, :, 1:]).all() and not torch.isnan(pq[0, :, 0]).any()
    assert torch.isnan(pk[0, 0, 2:]).all() and not torch.isnan(pk[0, 0, :2]).any()


def test_poisoned_allocations_catch_a_skipped_write():
    def kernel(x):  # writes only half of its output
        out = torch.empty_like(x)
        out[: len(x) // 2] = x[: len(x) // 2]
        return out

    x = torch.ones(4)
    empty = torch.empty
    with poisoned_allocations():
        out = kernel(x)
        assert torch.isnan(torch.empty(2)).all()
        assert torch.empty(2, dtype=torch.int64).dtype == torch.int64
    with pytest.raises(AssertionError, match="NaN where the reference is finite"):
        assert_close_to_reference(out, x.double())
    assert torch.empty is empty  # restored


def test_operators_write_every_output_under_poisoned_allocations():
    q, k, v = qkv()
    bias = ba.PaddedKeysMask([0, 7]) & ba.LowerTriangularMask()
    ref, ref_lse = reference_attention(q, k, v, bias)
    for op in ("chunked", "reference"):
        with poisoned_allocations():
            out, lse = ba.attention_with_lse(q, k, v, bias, op=op)
        assert_close_to_reference(out, ref)
        assert_close_to_reference(lse, ref_lse)


# ------------------------------------------------------------------------------------ strategies
@settings(max_examples=60)
@given(case=bst.attention_inputs(min_terms=0, max_terms=3, allow_empty=True, dtypes=bst.DTYPES))
def test_drawn_cases_fit_together(case):
    s = case.shape
    assert case.q.shape == (s.B, s.Hq, s.Mq, s.D) and case.k.shape == (s.B, s.Hkv, s.Mk, s.D)
    assert case.v.shape == (s.B, s.Hkv, s.Mk, s.Dv) and s.Hq % s.Hkv == 0
    inp = make_inputs(case.q, case.k, case.v, case.bias, scale=case.scale)  # validation accepts it
    if case.bias is not None:
        dense = case.bias.materialize(s.bias_shape)
        assert dense.shape == s.bias_shape
        assert inp.spec.features or not dense.any()  # only a bias that hides and adds nothing lowers to none


@given(data=st.data(), family=st.sampled_from(bst.FAMILIES))
def test_every_family_strategy_fits_its_shape(data, family):
    shape = data.draw(bst.shapes(batch=1 if family == "block_diagonal" else None, allow_empty=True))
    bias = data.draw(bst.bias_of_family(family, shape))
    q = torch.zeros(shape.B, shape.Hq, shape.Mq, shape.D)
    k = torch.zeros(shape.B, shape.Hkv, shape.Mk, shape.D)
    make_inputs(q, k, torch.zeros(shape.B, shape.Hkv, shape.Mk, shape.Dv), bias)


def test_max_queries_caps_mq_not_mk():
    seen = {"mk_above": False, "mq_at_cap": False}

    @settings(max_examples=80, database=None)
    @given(case=bst.attention_inputs(max_queries=3, max_seqlen=113, families=("padded", "causal_bottom_right")))
    def collect(case):
        assert case.shape.Mq <= 3 and case.shape.Mk <= 113
        seen["mk_above"] |= case.shape.Mk > 3
        seen["mq_at_cap"] |= case.shape.Mq == 3

    collect()
    assert seen["mk_above"] and seen["mq_at_cap"]


def test_strategies_reach_the_hard_cases():
    seen = {"odd": set(), "gqa": False, "rect": False, "empty_segment": False, "bool": False}

    @settings(max_examples=150, database=None)
    @given(data=st.data())
    def collect(data):
        shape = data.draw(bst.shapes(batch=1))
        seen["odd"].update({shape.Mq, shape.Mk} & {1, 3, 17, 113})
        seen["gqa"] |= shape.Hq != shape.Hkv
        seen["rect"] |= shape.Mq != shape.Mk
        bias = data.draw(bst.bias_of_family("block_diagonal", shape))
        seen["empty_segment"] |= 0 in bias.q_seqlens or 0 in bias.kv_seqlens
        seen["bool"] |= bool(data.draw(bst.additive_tensors(shape)).dtype == torch.bool)

    collect()
    assert seen["odd"] == {1, 3, 17, 113}
    assert seen["gqa"] and seen["rect"] and seen["empty_segment"] and seen["bool"]


def test_strategy_errors():
    @given(bst.bias_of_family("block_diagonal", bst.Shape(2, 1, 1, 3, 3, 4, 4)))
    def packed_with_two_rows(bias):
        pass

    with pytest.raises(ValueError, match=r"need B == 1"):
        packed_with_two_rows()

    @given(bst.bias_of_family("nope", bst.Shape(1, 1, 1, 1, 1, 1, 1)))
    def unknown(bias):
        pass

    with pytest.raises(ValueError, match="family must be one of"):
        unknown()
