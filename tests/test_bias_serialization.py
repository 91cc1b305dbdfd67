"""Every bias survives ``copy.copy``, ``copy.deepcopy``, ``pickle`` and ``torch.save``/``torch.load``
(default ``weights_only``) as the same lazy bias type with the same meaning; deepcopy copies its
small tensors; modules holding biases deepcopy."""

import copy
import io
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import biasattn as ba
from biasattn.bias import base, protocol
from biasattn.testing import strategies as bst

M = 7  # Mq = Mk of the sized kinds below


def _kinds() -> dict:
    gen = torch.Generator().manual_seed(0)
    pad = ba.PaddedKeysMask(torch.tensor([3, 7]))
    diag = ba.BlockDiagonalMask.from_seqlens([2, 3, 2], [3, 1, 3])
    layout = torch.rand((1, 2, 4, 3), generator=gen) < 0.6
    additive = ba.AdditiveBias(torch.randn(2, 1, M, M, generator=gen, dtype=torch.float64))
    return {
        "causal": ba.LowerTriangularMask(),
        "causal_bottom_right": ba.LowerTriangularFromBottomRightMask(),
        "local": ba.LocalAttentionMask(3, 1),
        "padded_list": ba.PaddedKeysMask([3, 7]),
        "padded_tensor": pad,
        "block_diagonal": diag,
        "block_diagonal_causal": diag.make_causal(),
        "block_diagonal_causal_bottom_right": diag.make_causal_from_bottom_right(),
        "block_diagonal_local": diag.make_local_attention(2, 1),
        "block_sparse": ba.BlockSparseMask(layout, (2, 3)),
        "additive_4d": additive,
        "additive_2d": ba.AdditiveBias(torch.randn(M, M, generator=gen)),
        "additive_bool": ba.AdditiveBias(torch.rand((M, M), generator=gen) < 0.7),
        "alibi": ba.ALiBi(ba.ALiBi.standard_slopes(2)),
        "alibi_per_batch": ba.ALiBi(torch.rand((2, 2), generator=gen)),
        "causal_and_padded": ba.LowerTriangularMask() & pad,
        "block_diagonal_plus_alibi": diag.make_causal() + ba.ALiBi(torch.rand(2, generator=gen)),
        "local_and_sparse_plus_additive": (ba.LocalAttentionMask(4) & ba.BlockSparseMask(layout, (2, 3))) + additive,
        "causal_sliced": ba.LowerTriangularMask()[..., 2:, 1:],
        "bound_bottom_right_sliced": ba.LowerTriangularFromBottomRightMask().bind(M, M)[..., 2:5, :6],
        "block_diagonal_sliced": diag.make_causal()[..., 3:, 1:6],
        "additive_sliced": additive[..., 1:4, 2:],
        "composed_sliced": (ba.LowerTriangularMask() & pad)[..., 3:, :],
    }


KINDS = _kinds()


def _shape(bias, full: tuple[int, int] = (M, M)) -> tuple[int, int, int, int]:
    """A shape to materialize at: the bias' own sizes, else those of a ``full``-sized call minus the slice offsets."""
    B, H, Mq, Mk = bias.sizes
    return (B or 2, H or 2, Mq or full[0] - bias._offsets[0], Mk or full[1] - bias._offsets[1])


def _torch_roundtrip(bias, **load_kwargs):
    buf = io.BytesIO()
    torch.save(bias, buf)
    buf.seek(0)
    return torch.load(buf, **load_kwargs)


ROUNDTRIPS = {
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
    "pickle": lambda b: pickle.loads(pickle.dumps(b)),
    "pickle_protocol_2": lambda b: pickle.loads(pickle.dumps(b, protocol=2)),
    "torch_save_default_load": _torch_roundtrip,
    "torch_save_weights_only": lambda b: _torch_roundtrip(b, weights_only=True),
    "torch_save_full_load": lambda b: _torch_roundtrip(b, weights_only=False),
}


def _tensors(bias) -> list[torch.Tensor]:
    return [t for a in bias.atoms for t in a.tensors().values()]


def assert_same_bias(got, bias, full: tuple[int, int] = (M, M)):
    """Same lazy type, sizes, slicing, dtype, device, structure and meaning."""
    assert type(got) is type(bias)
    assert got.sizes == bias.sizes and got.shape == bias.shape and got.dtype == bias.dtype
    assert got.device == bias.device
    assert (got._offsets, got._lengths, got._full) == (bias._offsets, bias._lengths, bias._full)
    assert repr(got) == repr(bias)
    assert [type(a) for a in got.atoms] == [type(a) for a in bias.atoms]
    for a, b in zip(_tensors(got), _tensors(bias)):
        assert a.dtype == b.dtype and a.requires_grad == b.requires_grad and torch.equal(a, b)
    shape = _shape(bias, full)
    assert torch.equal(got.materialize(shape, dtype=torch.float64), bias.materialize(shape, dtype=torch.float64))


@pytest.mark.parametrize("how", ROUNDTRIPS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_round_trips_as_the_same_lazy_bias(kind, how):
    """Unsized biases used to raise a misleading InputError, sized ones came back as dense tensors."""
    bias = KINDS[kind]
    assert_same_bias(ROUNDTRIPS[how](bias), bias)


@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy_copies_the_small_tensors_and_copy_shares_them(kind):
    bias = KINDS[kind]
    deep, shallow = copy.deepcopy(bias), copy.copy(bias)
    for d, s, t in zip(_tensors(deep), _tensors(shallow), _tensors(bias)):
        assert s is t
        assert d is not t and (t.numel() == 0 or d.data_ptr() != t.data_ptr())


def test_deepcopy_keeps_requires_grad_of_the_additive_tensor():
    t = torch.randn(3, 4, requires_grad=True)
    bias = ba.LowerTriangularMask() + ba.AdditiveBias(t)
    for got in (copy.deepcopy(bias), pickle.loads(pickle.dumps(bias)), _torch_roundtrip(bias)):
        (u,) = [a.tensor for a in got.atoms if a.kind == "additive"]
        assert u.requires_grad and u.is_leaf and u is not t
        assert torch.equal(u, t)


def test_deepcopy_of_a_module_holding_biases():
    """deepcopy of an nn.Module storing ``self.mask = LowerTriangularMask()`` raised."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.mask = ba.LowerTriangularMask()
            self.pad = ba.PaddedKeysMask(torch.tensor([2, 5]))
            self.rel = torch.nn.Parameter(torch.randn(5, 5))
            self.rel_bias = ba.AdditiveBias(self.rel)

        def forward(self, x):
            q = self.proj(x)
            return ba.attention(q, q, q, (self.mask & self.pad) + self.rel_bias, op="reference")

    block = Block()
    twin = copy.deepcopy(block)
    assert type(twin.mask) is ba.LowerTriangularMask and type(twin.pad) is ba.PaddedKeysMask
    assert twin.pad.kv_seqlens.data_ptr() != block.pad.kv_seqlens.data_ptr()
    assert twin.rel_bias.atoms[0].tensor is twin.rel  # the module's own parameter, not a second copy
    x = torch.randn(2, 1, 5, 4)
    torch.testing.assert_close(twin(x), block(x), rtol=0, atol=0)
    twin.pad.kv_seqlens.fill_(1)
    assert block.pad.kv_seqlens.tolist() == [2, 5]


def test_checkpoint_dict_loads_with_the_default_weights_only():
    ckpt = {"step": 3, "weight": torch.randn(2), "mask": ba.BlockDiagonalMask.from_seqlens([2, 3]).make_causal()}
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    buf.seek(0)
    got = torch.load(buf)
    assert got["step"] == 3 and torch.equal(got["weight"], ckpt["weight"])
    assert_same_bias(got["mask"], ckpt["mask"])
    assert base._rebuild_bias in torch.serialization.get_safe_globals()


def test_torch_load_map_location_moves_the_bias():
    bias = ba.PaddedKeysMask([2, 5]) & ba.BlockSparseMask(torch.ones(1, 1, 2, 2, dtype=torch.bool), 4)
    buf = io.BytesIO()
    torch.save(bias, buf)
    buf.seek(0)
    got = torch.load(buf, map_location="meta")
    assert got.device.type == "meta" and all(t.device.type == "meta" for t in _tensors(got))
    assert "ComposedBias" in repr(got)


def test_unknown_classes_in_a_pickle_are_refused():
    state = (protocol._STATE_VERSION, "os:system", "cpu", (), (0, 0), (None, None), (None, None))
    with pytest.raises(ba.InputError, match="bias class 'os:system'"):
        base._rebuild_bias(state)
    with pytest.raises(ba.InputError, match="state version 99"):
        base._rebuild_bias((99,) + state[1:])


@settings(max_examples=25)
@given(data=st.data())
def test_drawn_compositions_and_slices_round_trip(data):
    shape = data.draw(bst.shapes(max_seqlen=20))
    allowed = bst.FAMILIES if shape.B == 1 else tuple(f for f in bst.FAMILIES if f != "block_diagonal")
    bias = data.draw(bst.biases(shape, allowed))
    if data.draw(st.booleans()):
        q0, k0 = data.draw(st.integers(0, shape.Mq)), data.draw(st.integers(0, shape.Mk))
        bias = bias.bind(shape.Mq, shape.Mk)[..., q0:, k0:] if bias._full == (None, None) else bias[..., q0:, k0:]
    how = data.draw(st.sampled_from(sorted(ROUNDTRIPS)))
    assert_same_bias(ROUNDTRIPS[how](bias), bias, (shape.Mq, shape.Mk))
