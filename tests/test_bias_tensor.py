"""The tensor-subclass behaviour: foreign torch ops materialize (warning once above 256 MB),
``.to/.cpu/.clone/.detach`` stay lazy, and metadata calls answer without materializing."""

import warnings

import pytest
import torch

import biasattn as ba
from biasattn.bias import protocol


def test_scores_plus_bias_materializes_against_the_scores():
    scores = torch.randn(2, 3, 5, 7, dtype=torch.float64)
    bias = ba.LowerTriangularMask()
    want = scores + bias.materialize((2, 3, 5, 7), dtype=torch.float64)
    for got in (scores + bias, bias + scores, torch.add(scores, bias)):
        assert type(got) is torch.Tensor and got.dtype == torch.float64
        assert torch.equal(got, want)


def test_softmax_of_scores_plus_padding():
    scores = torch.randn(2, 1, 3, 6)
    p = torch.softmax(scores + ba.PaddedKeysMask([2, 6]), dim=-1)
    assert torch.equal(p[0, ..., 2:], torch.zeros(1, 3, 4))
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 1, 3))


def test_torch_where_materializes():
    scores = torch.randn(1, 2, 4, 4)
    bias = ba.LowerTriangularMask()
    got = torch.where(scores > 0, bias, scores)
    want = torch.where(scores > 0, bias.materialize((1, 2, 4, 4)), scores)
    assert type(got) is torch.Tensor and torch.equal(got, want)


def test_sized_bias_materializes_alone():
    bias = ba.BlockDiagonalMask.from_seqlens([1, 2])
    got = torch.exp(bias)
    assert got.shape == (1, 1, 3, 3) and got.sum() == 5


def test_unsized_bias_alone_explains_how_to_size_it():
    with pytest.raises(ba.InputError, match=r"unsized and isinf gives no other tensor.*materialize\(\(B, H, Mq, Mk\)\)"):
        torch.isinf(ba.LowerTriangularMask())


def test_large_materialization_warns_once(monkeypatch):
    monkeypatch.setattr(protocol, "MATERIALIZE_WARN_BYTES", 1000)
    monkeypatch.setattr(protocol, "_warned_large_materialize", False)
    scores = torch.zeros(1, 1, 20, 20)  # 1600 bytes in float32
    bias = ba.LowerTriangularMask()
    with pytest.warns(UserWarning, match=r"add received a LowerTriangularMask .* \[1, 1, 20, 20\] .*keep it lazy"):
        scores + bias
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores + bias
        torch.zeros(1, 1, 2, 2) + bias


def test_warning_threshold_is_256_mib():
    assert protocol.MATERIALIZE_WARN_BYTES == 256 * 2**20


def test_to_clone_detach_cpu_stay_lazy():
    t = torch.randn(1, 2, 1, 5, requires_grad=True)
    bias = (ba.LowerTriangularMask() & ba.PaddedKeysMask([4])) + ba.AdditiveBias(t)
    moves = (bias.to("cpu"), bias.cpu(), bias.clone(), bias.detach(), bias.to(torch.float64), bias.to("cpu", torch.float16))
    for moved in moves:
        assert isinstance(moved, ba.ComposedBias)
        assert [a.kind for a in moved.atoms] == [a.kind for a in bias.atoms]
        got, want = moved.materialize((1, 2, 3, 5)).float(), bias.materialize((1, 2, 3, 5)).detach()
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    assert bias.to(torch.float64).dtype == torch.float64
    assert bias.to(torch.float64).atoms[-1].tensor.dtype == torch.float64
    assert bias.to(torch.float64).atoms[1].kv_seqlens.dtype == torch.int32  # integer metadata is not cast
    assert not bias.detach().atoms[-1].tensor.requires_grad
    assert bias.clone().atoms[-1].tensor.data_ptr() != t.data_ptr()


def test_to_meta_moves_the_small_tensors():
    bias = ba.PaddedKeysMask([3, 4]).to("meta")
    assert bias.device.type == "meta" and bias.kv_seqlens.device.type == "meta"
    assert isinstance(bias, ba.PaddedKeysMask)


def test_metadata_queries_do_not_materialize(monkeypatch):
    bias = ba.BlockDiagonalMask.from_seqlens([2, 3])

    def boom(*a, **k):
        raise AssertionError("materialized")

    monkeypatch.setattr(type(bias), "materialize", boom)
    assert bias.shape == (1, 1, 5, 5) and bias.dim() == 4 and bias.size(-1) == 5 and bias.numel() == 25
    assert isinstance(bias, torch.Tensor)
    assert "BlockDiagonalMask(q_seqlens=[2, 3]" in repr(bias)


def test_sliced_repr_shows_offsets():
    assert "offsets=(1, 0)" in repr(ba.LowerTriangularMask()[..., 1:, :])


def test_direct_construction_is_refused():
    with pytest.raises(TypeError, match="cannot be constructed directly"):
        ba.AttentionBias()
    with pytest.raises(ba.InputTypeError, match="compose biases with '\\+'"):
        ba.AdditiveBias(ba.LowerTriangularMask())


def test_block_sparse_repr_on_meta_reads_no_values():
    """repr of a BlockSparseMask with its layout on the meta device raised (it read the density with .item())."""
    layout = torch.ones(1, 2, 3, 3, dtype=torch.bool)
    assert "density=1.00" in repr(ba.BlockSparseMask(layout, 4))
    text = repr(ba.BlockSparseMask(layout.to("meta"), 4) & ba.PaddedKeysMask([5]).to("meta"))
    assert "layout=[1, 2, 3, 3], block=(4, 4)" in text and "density" not in text


def test_a_bias_made_under_a_fake_trace_holds_a_tensor_of_that_trace():
    """A mask moved to a device inside a trace (Dynamo runs ``.to`` of a bias under its fake mode) gets an
    inner tensor of that trace, never one made eagerly, which a trace cannot take as an input."""
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    eager = ba.LowerTriangularMask().to("cpu")
    with FakeTensorMode():
        traced = ba.LowerTriangularMask().to("cpu")
    assert is_fake(traced._t0) and not is_fake(eager._t0) and traced._t0 is not eager._t0


def test_a_causal_mask_built_every_call_is_one_object():
    """``LowerTriangularMask()`` in every call (as SDPA users write ``is_causal=True``) returns one shared
    bias, and its moves to a device are kept per device and dtype; a bias holding tensors is moved anew,
    and a trace builds its own."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert ba.LowerTriangularMask() is ba.LowerTriangularMask()
    assert ba.LowerTriangularFromBottomRightMask() is ba.LowerTriangularFromBottomRightMask()
    assert ba.LowerTriangularMask() is not ba.LowerTriangularFromBottomRightMask()
    causal = ba.LowerTriangularMask()
    assert causal.to("meta") is causal.to("meta") and causal.to("meta").device.type == "meta"
    assert causal.to("meta") is not causal.to("meta", torch.float16)
    padded = ba.PaddedKeysMask([3, 5])
    assert padded.to("meta") is not padded.to("meta")
    with torch.inference_mode():
        inside = ba.LowerTriangularMask()
        moved = ba.LocalAttentionMask(3).to("meta")
    assert inside is causal and not inside.is_inference() and not moved._t0.is_inference()
    with FakeTensorMode():
        assert ba.LowerTriangularMask() is not causal
