"""Lowering: every bias, lowered to a BiasSpec and run through ``reference`` and ``chunked``, equals
softmax over ``bias.materialize`` in float64 (the materialization never looks at the spec)."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import biasattn as ba
from biasattn.bias import lower
from biasattn.ops.chunked import ChunkedOperator
from biasattn.testing import assert_close_to_reference, reference_attention
from biasattn.testing import strategies as bst

# Small blocks so that tiling, tile skipping and boundary masks are all exercised at odd sizes.
CHUNKED_SMALL = ChunkedOperator(block_q=8, block_k=8)
OPS = [pytest.param(CHUNKED_SMALL, id="chunked"), pytest.param("reference", id="reference")]


def _check(case, op):
    ref, ref_lse = reference_attention(case.q, case.k, case.v, case.bias, scale=case.scale)
    out, lse = ba.attention_with_lse(case.q, case.k, case.v, case.bias, scale=case.scale, op=op)
    assert out.dtype == case.q.dtype and lse.shape == ref_lse.shape
    assert_close_to_reference(out, ref, name="out")
    assert_close_to_reference(lse, ref_lse, name="lse")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("family", bst.FAMILIES)
@given(data=st.data())
def test_every_family_matches_materialized_softmax(family, op, data):
    shape = data.draw(bst.shapes(batch=1 if family == "block_diagonal" else None, max_seqlen=40))
    bias = data.draw(bst.bias_of_family(family, shape))
    case = data.draw(_case_for(shape, bias))
    _check(case, op)


@pytest.mark.parametrize("op", OPS)
@settings(max_examples=3 * settings().max_examples)
@given(case=bst.attention_inputs(min_terms=2, max_terms=3))
def test_compositions_of_two_or_three_families_match_materialized_softmax(op, case):
    _check(case, op)


@given(case=bst.attention_inputs(min_terms=1, max_terms=2, max_seqlen=17, allow_empty=True))
def test_empty_shapes_and_segments(case):
    _check(case, CHUNKED_SMALL)
    _check(case, "reference")


@st.composite
def _case_for(draw, shape, bias):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def make(*dims):
        return torch.randn(dims, generator=gen, dtype=torch.float64)

    q = make(shape.B, shape.Hq, shape.Mq, shape.D)
    k = make(shape.B, shape.Hkv, shape.Mk, shape.D)
    v = make(shape.B, shape.Hkv, shape.Mk, shape.Dv)
    return bst.AttentionCase(shape, q, k, v, bias, draw(st.one_of(st.none(), st.floats(0.1, 2.0))), ())


def _qkv(B, Hq, Mq, Mk, D=8, Hkv=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    Hkv = Hkv or Hq
    q = torch.randn(B, Hq, Mq, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, Hkv, Mk, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hkv, Mk, D, generator=gen, dtype=torch.float64)
    return q, k, v


_GEN = torch.Generator().manual_seed(0)
PINNED = [
    # (name, B, H, Mq, Mk, bias)
    ("bottom_right_more_queries", 1, 2, 17, 3, ba.LowerTriangularFromBottomRightMask()),
    ("local_both_sides", 2, 1, 113, 113, ba.LocalAttentionMask(5, 3)),
    ("local_kv_cache", 1, 1, 3, 113, ba.LocalAttentionMask(17)),
    (
        "block_diagonal_empty_segments_bottom_right",
        1, 2, 20, 27,
        ba.BlockDiagonalMask.from_seqlens([3, 0, 17, 0], [0, 5, 17, 5]).make_causal_from_bottom_right(),
    ),
    (
        "block_diagonal_local_kv_longer",
        1, 1, 21, 33,
        ba.BlockDiagonalMask.from_seqlens([1, 3, 17], [5, 11, 17]).make_local_attention(2, 1),
    ),
    (
        "padded_and_block_diagonal",
        1, 1, 20, 20,
        ba.BlockDiagonalMask.from_seqlens([10, 10]) & ba.PaddedKeysMask([13]),
    ),
    ("block_sparse_broadcast_batch", 2, 3, 17, 33, ba.BlockSparseMask(torch.rand(1, 3, 3, 5, generator=_GEN) < 0.5, (8, 7))),
    ("block_sparse_broadcast_heads_2d", 1, 3, 17, 33, ba.BlockSparseMask(torch.rand(3, 5, generator=_GEN) < 0.5, (8, 7))),
    ("alibi_per_batch", 2, 3, 17, 17, ba.ALiBi(torch.rand(2, 3, generator=_GEN))),
    ("additive_1d", 2, 3, 5, 17, ba.AdditiveBias(torch.randn(17, dtype=torch.float64, generator=_GEN))),
    ("additive_3d", 2, 3, 5, 17, ba.AdditiveBias(torch.randn(3, 1, 17, dtype=torch.float64, generator=_GEN))),
    ("additive_bool", 2, 3, 5, 17, ba.AdditiveBias(torch.rand(2, 1, 5, 17, generator=_GEN) < 0.5)),
    ("causal_and_padded_zero_length", 2, 1, 17, 17, ba.LowerTriangularMask() & ba.PaddedKeysMask([0, 9])),
    (
        "two_block_diagonal_bands",
        1, 3, 23, 29,
        ba.BlockDiagonalMask.from_seqlens([5, 0, 18], [9, 3, 17]).make_causal()
        & ba.BlockDiagonalMask.from_seqlens([5, 0, 18], [9, 3, 17]).make_local_attention(4, 2),
    ),
    (
        "two_layouts_broadcast_differently",
        2, 3, 23, 29,
        ba.BlockSparseMask(torch.rand(1, 3, 5, 4, generator=_GEN) < 0.6, (5, 8))
        & ba.BlockSparseMask(torch.rand(2, 1, 5, 4, generator=_GEN) < 0.6, (5, 8)),
    ),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name,B,H,Mq,Mk,bias", PINNED, ids=[p[0] for p in PINNED])
def test_pinned_hard_cases(name, B, H, Mq, Mk, bias, op):
    q, k, v = _qkv(B, H, Mq, Mk)
    case = bst.AttentionCase(bst.Shape(B, H, H, Mq, Mk, 8, 8), q, k, v, bias, None, ())
    _check(case, op)


def test_plain_tensor_bias_is_wrapped():
    q, k, v = _qkv(2, 2, 5, 7)
    t = torch.randn(2, 1, 5, 7, dtype=torch.float64)
    ref, _ = reference_attention(q, k, v, t)
    assert_close_to_reference(ba.attention(q, k, v, t, op=CHUNKED_SMALL), ref)
    m = torch.rand(5, 7) < 0.6
    ref, _ = reference_attention(q, k, v, m)
    assert_close_to_reference(ba.attention(q, k, v, m, op=CHUNKED_SMALL), ref)


# ------------------------------------------------------------------------------------ spec fields
def test_spec_fields_of_composition():
    bias = (ba.LowerTriangularMask() & ba.PaddedKeysMask([3, 5])) + ba.ALiBi(torch.ones(2))
    spec = lower(bias, 2, 2, 6, 6)
    assert spec.features == {"band", "padded_keys", "alibi"}
    assert spec.causal_kind() == "top_left"
    assert spec.host.kv_seqlens == (3, 5)
    assert spec.window() == (None, 0)


def test_spec_causal_kind_bottom_right():
    spec = lower(ba.LowerTriangularFromBottomRightMask(), 1, 1, 3, 8)
    assert spec.causal_kind() == "bottom_right"
    spec = lower(ba.BlockDiagonalMask.from_seqlens([2, 3], [4, 4]).make_causal_from_bottom_right(), 1, 1, 5, 8)
    assert spec.causal_kind() == "bottom_right"
    assert spec.num_segments == 2


def test_spec_of_slice_folds_offsets():
    bias = ba.LocalAttentionMask(2).bind(10, 10)[..., 4:8, 2:10]
    spec = lower(bias, 1, 1, 4, 8)
    # global j - i in [-2, 0]; local d = (j + 2) - (i + 4) so band is [0, 2] in local coordinates
    assert spec.host.band_lo == (0,) and spec.host.band_hi == (2,)


def test_composed_padded_lengths_broadcast():
    """Regression: composing PaddedKeysMask([n]) with per-batch lengths zipped the lists and dropped rows."""
    bias = ba.PaddedKeysMask([1]) & ba.PaddedKeysMask([0, 1])
    spec = lower(bias, 2, 1, 1, 1)
    assert spec.host.kv_seqlens == (0, 1)
    assert spec.kv_seqlens.tolist() == [0, 1]


def test_spec_is_cached_per_shape():
    bias = ba.PaddedKeysMask([3])
    assert lower(bias, 1, 1, 4, 4) is lower(bias, 1, 1, 4, 4)
    assert lower(bias, 1, 1, 4, 5) is not lower(bias, 1, 1, 4, 4)


def test_tensor_free_biases_built_anew_share_one_spec():
    """A causal mask built per decode step lowers to the spec of the last step (and its plans)."""
    a = lower(ba.LowerTriangularFromBottomRightMask(), 2, 4, 3, 40)
    b = lower(ba.LowerTriangularFromBottomRightMask(), 2, 4, 3, 40)
    assert a is b and a.causal_kind() == "bottom_right"
    assert lower(ba.LowerTriangularFromBottomRightMask(), 2, 4, 3, 41) is not a
    five, six = (lower(ba.LocalAttentionMask(w), 2, 4, 3, 40) for w in (5, 6))
    assert five.host.band_lo != six.host.band_lo
    padded = ba.PaddedKeysMask([3, 5])
    assert lower(padded, 2, 4, 3, 40) is not lower(ba.PaddedKeysMask([3, 5]), 2, 4, 3, 40)


def test_masks_built_anew_are_found_by_their_atoms_without_lowering_them(monkeypatch):
    """A causal mask or a window built in every call holds the atom of the last one, and key lengths from a
    device tensor are passed through unread: either finds the spec of an earlier mask of the same atom
    tokens in one lookup (with its own length tensor); other sizes or tokens are checked and lowered."""
    from biasattn.bias import spec as spec_module
    from biasattn.errors import InputError
    from biasattn.inputs import make_inputs

    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 40, 8)
    assert ba.LocalAttentionMask(5).atoms[0] is ba.LocalAttentionMask(5).atoms[0]
    window = make_inputs(q, k, k, ba.LocalAttentionMask(5)).spec
    bound = make_inputs(q, k, k, ba.LowerTriangularMask().bind(3, 40)).spec
    mq, mk = (t.to("meta") for t in (q, k))  # lengths only a device holds: never read
    padded = make_inputs(mq, mk, mk, ba.PaddedKeysMask(torch.tensor([3, 40], device="meta"))).spec
    lowered = []
    real = spec_module._lower_by_structure
    monkeypatch.setattr(spec_module, "_lower_by_structure", lambda *a: lowered.append(a[0]) or real(*a))
    assert make_inputs(q, k, k, ba.LocalAttentionMask(5)).spec is window
    assert make_inputs(q, k, k, ba.LowerTriangularMask().bind(3, 40)).spec is bound
    lengths = torch.tensor([7, 9], dtype=torch.int32, device="meta")
    fresh = make_inputs(mq, mk, mk, ba.PaddedKeysMask(lengths)).spec
    assert fresh is not padded and fresh.kv_seqlens is lengths and fresh.host.kv_seqlens is None and not lowered
    assert make_inputs(q, k, k, ba.LocalAttentionMask(6)).spec.host.band_lo != window.host.band_lo
    assert len(lowered) == 1
    with pytest.raises(InputError, match="Mq 3, q has 4"):
        make_inputs(torch.randn(2, 4, 4, 8), k, k, ba.LowerTriangularMask().bind(3, 40))
    with pytest.raises(InputError, match="batch size 3, q has 2"):
        make_inputs(mq, mk, mk, ba.PaddedKeysMask(torch.tensor([1, 2, 3], device="meta")))


def test_packed_documents_built_anew_from_device_lengths_are_found_without_lowering(monkeypatch):
    """Documents whose lengths only a device holds lower to their tensors, unread: a mask built from the
    next batch's lengths finds that spec by its atom's token and carries its own tensors; a mask of
    another structure (a band, other shapes) or a call that breaks a rule is lowered and checked."""
    from biasattn.bias import spec as spec_module
    from biasattn.errors import InputError
    from biasattn.inputs import make_inputs

    q = torch.randn(1, 2, 24, 8, device="meta")

    def documents(lengths, causal=True):
        mask = ba.BlockDiagonalMask.from_seqlens(torch.tensor(lengths, dtype=torch.int32, device="meta"))
        return mask.make_causal() if causal else mask

    first = make_inputs(q, q, q, documents([5, 19])).spec
    lowered = []
    real = spec_module._lower_by_structure
    monkeypatch.setattr(spec_module, "_lower_by_structure", lambda *a: lowered.append(a[0]) or real(*a))
    mask = documents([20, 4])
    fresh = make_inputs(q, q, q, mask).spec
    starts = mask._segments.q_seqstart
    assert fresh is not first and fresh.q_seqstart is starts and fresh.k_seqstart is starts and not lowered
    assert fresh.features == first.features
    make_inputs(q, q, q, documents([20, 4], causal=False))
    make_inputs(q, q, q, documents([6, 6, 12]))
    assert len(lowered) == 2
    with pytest.raises(InputError, match="batch size B=1"):
        make_inputs(torch.randn(2, 2, 24, 8, device="meta"), q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1),
                    documents([12, 12]))


@pytest.mark.parametrize(
    "bias,Mq,Mk,hides",
    [
        (ba.LowerTriangularFromBottomRightMask(), 1, 9, False),  # one query sees the whole cache
        (ba.LowerTriangularFromBottomRightMask(), 2, 9, True),
        (ba.LocalAttentionMask(8, 3), 4, 9, False),  # a window as wide as the call
        (ba.LocalAttentionMask(7, 3), 4, 9, True),
        (ba.LocalAttentionMask(8, 2), 4, 9, True),
        (ba.LowerTriangularMask(), 1, 1, False),
    ],
)
def test_band_that_hides_nothing_lowers_to_no_mask(bias, Mq, Mk, hides):
    spec = lower(bias, 2, 2, Mq, Mk)
    assert ("band" in spec.features) == hides
    if not hides:
        assert spec is lower(None, 2, 2, Mq, Mk)
    q, k, v = _qkv(2, 2, Mq, Mk)
    ref, _ = reference_attention(q, k, v, bias)
    assert_close_to_reference(ba.attention(q, k, v, bias, op=CHUNKED_SMALL), ref)
    if not hides:
        assert_close_to_reference(ba.attention(q, k, v, op=CHUNKED_SMALL), ref)


def test_a_mask_that_hides_nothing_gets_the_plain_spec_after_the_plain_specs_were_evicted():
    """Causal masks share their specs by structure; once the kept plain specs of other sizes have pushed
    out this size's, a new mask that hides nothing still gets the spec that ``lower(None)`` gives."""
    lower(ba.LowerTriangularMask(), 3, 2, 1, 1)  # kept by structure and tokens: the plain spec of that size
    for m in range(2, 2 + 80):  # more sizes than the plain specs kept
        lower(None, 3, 2, m, m)
    assert lower(ba.LowerTriangularMask(), 3, 2, 1, 1) is lower(None, 3, 2, 1, 1)


@example(seed=0)
@given(seed=st.integers(0, 2**16))
def test_two_alibi_terms_add(seed):
    """Two ALiBi terms add their slopes (summed in float32 in the spec)."""
    q, k, v = _qkv(1, 2, 9, 9, seed=seed)
    s1, s2 = torch.rand(2), torch.rand(2)
    bias = ba.ALiBi(s1) + ba.ALiBi(s2)
    ref, _ = reference_attention(q, k, v, ba.ALiBi(s1 + s2))
    for op in (CHUNKED_SMALL, "reference"):
        assert_close_to_reference(ba.attention(q, k, v, bias, op=op), ref, atol=1e-6)


@pytest.mark.parametrize("make, B", [(lambda: ba.PaddedKeysMask([9, 13]), 2),
                                     (lambda: ba.BlockDiagonalMask.from_seqlens([5, 11]).make_causal(), 1)],
                         ids=["padded", "documents"])
def test_lengths_in_a_traces_fake_cpu_tensors_are_never_read(make, B):
    """A trace outside Dynamo (``make_fx``, AOTAutograd) rebuilds a bias around fake tensors, on the CPU and
    without the host copies: lowering passes them on unread instead of asking a fake tensor for values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from biasattn.bias.base import AttentionBias

    bias, mode = make(), FakeTensorMode()
    names, ctx = bias.__tensor_flatten__()
    fake = AttentionBias.__tensor_unflatten__({n: mode.from_tensor(getattr(bias, n)) for n in names}, ctx,
                                              bias.shape, bias.stride())
    with mode:
        spec = lower(fake, B, 4, 16, 16)
    lengths = spec.kv_seqlens if B == 2 else spec.q_seqstart
    assert lengths is not None and spec.host.kv_seqlens is None and spec.host.q_seqstart is None
    assert spec.features == lower(bias, B, 4, 16, 16).features
