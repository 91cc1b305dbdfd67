"""Each bias family materializes to the definition in DESIGN §2, written here element by element."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import biasattn as ba
from biasattn.testing import assert_close_to_reference, reference_attention
from biasattn.testing import strategies as bst

NEG = float("-inf")


def dense(bias, B, H, Mq, Mk):
    return bias.materialize((B, H, Mq, Mk), dtype=torch.float64)


def from_rule(B, H, Mq, Mk, visible, add=lambda b, h, i, j: 0.0):
    out = torch.empty(B, H, Mq, Mk, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(Mq):
                for j in range(Mk):
                    out[b, h, i, j] = add(b, h, i, j) if visible(b, h, i, j) else NEG
    return out


sizes = st.integers(0, 9)


@given(Mq=sizes, Mk=sizes)
def test_lower_triangular_top_left(Mq, Mk):
    got = dense(ba.LowerTriangularMask(), 1, 1, Mq, Mk)
    assert torch.equal(got, from_rule(1, 1, Mq, Mk, lambda b, h, i, j: j <= i))


@given(Mq=sizes, Mk=sizes)
def test_lower_triangular_bottom_right(Mq, Mk):
    got = dense(ba.LowerTriangularFromBottomRightMask(), 1, 1, Mq, Mk)
    assert torch.equal(got, from_rule(1, 1, Mq, Mk, lambda b, h, i, j: j <= i + (Mk - Mq)))


@given(Mq=sizes, Mk=sizes, left=st.integers(0, 10), right=st.integers(0, 4))
def test_local_attention_bottom_right_band(Mq, Mk, left, right):
    got = dense(ba.LocalAttentionMask(left, right), 1, 1, Mq, Mk)
    d = Mk - Mq
    assert torch.equal(got, from_rule(1, 1, Mq, Mk, lambda b, h, i, j: i + d - left <= j <= i + d + right))


def test_local_attention_window_counts_keys():
    got = dense(ba.LocalAttentionMask(2), 1, 1, 6, 6)
    assert ((got == 0).sum(-1) == torch.tensor([1, 2, 3, 3, 3, 3])).all()


@given(lengths=st.lists(st.integers(0, 7), min_size=1, max_size=3), Mq=st.integers(1, 4))
def test_padded_keys(lengths, Mq):
    B = len(lengths)
    got = dense(ba.PaddedKeysMask(lengths), B, 2, Mq, 7)
    assert torch.equal(got, from_rule(B, 2, Mq, 7, lambda b, h, i, j: j < lengths[b]))


def test_padded_keys_from_bool():
    mask = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    bias = ba.PaddedKeysMask.from_bool(mask)
    assert bias.kv_seqlens.tolist() == [2, 3, 0]
    assert torch.equal(dense(bias, 3, 1, 2, 3) == 0, mask[:, None, None, :].expand(3, 1, 2, 3))


def _segments(lengths):
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return starts


@given(seg=bst.segment_lengths(11, 13), variant=st.sampled_from(["plain", "causal", "causal_br", "local"]))
def test_block_diagonal_variants(seg, variant):
    ql, kl = seg
    qs, ks = _segments(ql), _segments(kl)
    bias = ba.BlockDiagonalMask.from_seqlens(ql, kl)
    left, right = 2, 1
    if variant == "causal":
        bias = bias.make_causal()
    elif variant == "causal_br":
        bias = bias.make_causal_from_bottom_right()
    elif variant == "local":
        bias = bias.make_local_attention(left, right)

    def visible(b, h, i, j):
        s = next((s for s in range(len(ql)) if qs[s] <= i < qs[s + 1]), None)
        if s is None or not ks[s] <= j < ks[s + 1]:
            return False
        il, jl, shift = i - qs[s], j - ks[s], kl[s] - ql[s]
        if variant == "causal":
            return jl <= il
        if variant == "causal_br":
            return jl <= il + shift
        if variant == "local":
            return il + shift - left <= jl <= il + shift + right
        return True

    assert torch.equal(dense(bias, 1, 1, 11, 13), from_rule(1, 1, 11, 13, visible))


def test_block_diagonal_helpers():
    xs = [torch.randn(1, 2, n, 4) for n in (3, 1, 5)]
    bias, packed = ba.BlockDiagonalMask.from_tensor_list(xs)
    assert packed.shape == (1, 2, 9, 4)
    assert bias.q_seqlens == [3, 1, 5] and bias.kv_seqlens == [3, 1, 5]
    parts = bias.split(packed)
    assert [p.shape[2] for p in parts] == [3, 1, 5]
    assert all(torch.equal(a, b) for a, b in zip(parts, xs))
    with pytest.raises(ba.InputError, match=r"x must be \[1, H, 9, \.\.\.\]"):
        bias.split(torch.randn(1, 2, 8, 4))
    kv = [torch.randn(1, 2, n, 4) for n in (4, 4, 4)]
    bias, _ = ba.BlockDiagonalMask.from_tensor_list(xs, kv)
    assert bias.kv_seqlens == [4, 4, 4]
    with pytest.raises(TypeError, match="from_seqlens"):
        ba.BlockDiagonalMask([1, 2])
    with pytest.raises(ba.InputError, match="already has a band"):
        ba.BlockDiagonalMask.from_seqlens([2]).make_causal().make_causal()


@given(
    bq=st.integers(1, 5), bk=st.integers(1, 5), Mq=st.integers(1, 11), Mk=st.integers(1, 11),
    seed=st.integers(0, 1000), heads=st.sampled_from([1, 2]),
)
def test_block_sparse(bq, bk, Mq, Mk, seed, heads):
    nq, nk = math.ceil(Mq / bq), math.ceil(Mk / bk)
    layout = torch.rand(1, heads, nq, nk, generator=torch.Generator().manual_seed(seed)) < 0.5
    got = dense(ba.BlockSparseMask(layout, (bq, bk)), 2, 2, Mq, Mk)
    assert torch.equal(got, from_rule(2, 2, Mq, Mk, lambda b, h, i, j: bool(layout[0, h % heads, i // bq, j // bk])))


def test_block_sparse_layout_ranks_and_int_layouts():
    two_d = ba.BlockSparseMask(torch.tensor([[1, 0], [1, 1]]), 2)
    assert two_d.layout.shape == (1, 1, 2, 2) and two_d.layout.dtype == torch.bool
    three_d = ba.BlockSparseMask(torch.ones(3, 2, 2, dtype=torch.bool), 2)
    assert three_d.layout.shape == (1, 3, 2, 2) and three_d.sizes[:2] == (None, 3)
    want = torch.tensor([[0, 0, NEG, NEG], [0, 0, NEG, NEG], [0, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    assert torch.equal(dense(two_d, 1, 1, 4, 4)[0, 0], want)


@pytest.mark.parametrize("shape", [(7,), (1,), (5, 7), (3, 1, 7), (2, 3, 5, 1), (2, 1, 5, 7)])
def test_additive_broadcasts_from_the_left(shape):
    t = torch.randn(shape, dtype=torch.float64)
    got = dense(ba.AdditiveBias(t), 2, 3, 5, 7)
    assert torch.equal(got, torch.broadcast_to(t, (2, 3, 5, 7)))


def test_additive_bool_means_visible():
    m = torch.rand(5, 7) < 0.5
    got = dense(ba.AdditiveBias(m), 1, 1, 5, 7)
    assert torch.equal(got[0, 0] == 0, m) and torch.isneginf(got[0, 0][~m]).all()
    assert ba.AdditiveBias(m).is_mask and not ba.AdditiveBias(m.double()).is_mask


def test_additive_keeps_broadcast_dims_unexpanded():
    t = torch.randn(1, 3, 1, 7)
    bias = ba.AdditiveBias(t)
    assert bias.tensor.data_ptr() == t.data_ptr() and bias.tensor.shape == (1, 3, 1, 7)
    assert bias.sizes == (None, 3, None, 7)


@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi(per_batch):
    slopes = torch.rand(2, 3) if per_batch else torch.rand(3)
    got = dense(ba.ALiBi(slopes), 2, 3, 4, 6)
    s = slopes if per_batch else slopes.expand(2, 3)
    want = from_rule(2, 3, 4, 6, lambda b, h, i, j: True, lambda b, h, i, j: -float(s[b, h]) * abs(i + 2 - j))
    torch.testing.assert_close(got, want)


def test_alibi_standard_slopes():
    s8 = ba.ALiBi.standard_slopes(8)
    torch.testing.assert_close(s8, torch.tensor([2.0 ** -(k + 1) for k in range(8)]))
    s6 = ba.ALiBi.standard_slopes(6)
    assert s6.shape == (6,) and torch.equal(s6[:4], ba.ALiBi.standard_slopes(4))


def test_families_hold_only_small_metadata():
    for bias in (
        ba.LowerTriangularMask(),
        ba.LocalAttentionMask(3),
        ba.PaddedKeysMask([3, 4]),
        ba.BlockDiagonalMask.from_seqlens([2, 3]),
        ba.ALiBi(torch.ones(4)),
    ):
        assert isinstance(bias, torch.Tensor) and isinstance(bias, ba.AttentionBias)
        numel = sum(t.numel() for a in bias.atoms for t in a.tensors().values())
        assert numel <= 8
        assert bias.shape[-2:] in ((1, 1), (5, 5))


def test_show_draws_the_pattern():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    ax = ba.BlockDiagonalMask.from_seqlens([2, 3]).make_causal().show()
    image = ax.get_images()[0].get_array()
    assert image.shape == (5, 5) and image[0, 1] == 0 and image[1, 0] == 1
    ax = (ba.LowerTriangularMask() + ba.ALiBi(torch.ones(1))).show(4, 6)
    assert ax.get_images()[0].get_array().shape == (4, 6)
    with pytest.raises(ba.InputError, match="unsized: pass Mq and Mk"):
        ba.LowerTriangularMask().show()


@pytest.mark.parametrize("op", ["chunked", "reference"])
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_additive_tensor_marked_requires_grad_after_construction_gets_its_gradient(op, ndim):
    """A 1-3-D tensor was stored as a view made at construction, so a later requires_grad_() never got t.grad."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    t = torch.randn((2, 5, 5)[3 - ndim :], generator=gen, dtype=torch.float64)
    bias = ba.AdditiveBias(t)
    t.requires_grad_()
    ba.attention(q, k, v, bias, op=op).sum().backward()
    leaf = t.detach().clone().requires_grad_()
    out, _ = reference_attention(q, k, v, ba.AdditiveBias(leaf))
    (want,) = torch.autograd.grad(out.sum(), leaf)
    assert t.grad is not None
    assert_close_to_reference(t.grad, want, name="dbias", atol=1e-10)
    assert bias.atoms[0].tensor is t and bias.tensor.shape == (1,) * (4 - ndim) + t.shape
