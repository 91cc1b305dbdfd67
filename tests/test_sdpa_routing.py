"""``F.scaled_dot_product_attention`` with a biasattn bias is routed to ``biasattn.attention``,
honouring ``scale``, ``dropout_p``, ``is_causal`` and ``enable_gqa``."""

import pytest
import torch
import torch.nn.functional as F

import biasattn as ba
from biasattn.testing import assert_close_to_reference, reference_attention


def qkv(B=2, Hq=2, Hkv=None, Mq=7, Mk=9, D=8, requires_grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    Hkv = Hkv or Hq
    shapes = [(B, Hq, Mq, D), (B, Hkv, Mk, D), (B, Hkv, Mk, D)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_(requires_grad) for s in shapes]


BIASES = [
    ("causal", lambda: ba.LowerTriangularMask()),
    ("padded", lambda: ba.PaddedKeysMask([5, 9])),
    ("local_alibi", lambda: ba.LocalAttentionMask(3, 1) + ba.ALiBi(torch.tensor([0.5, 0.25]))),
    ("block_sparse", lambda: ba.BlockSparseMask(torch.tensor([[True, False, True], [True, True, False]]), (4, 3))),
    ("additive", lambda: ba.AdditiveBias(torch.randn(2, 1, 7, 9, dtype=torch.float64))),
]


@pytest.mark.parametrize("name,make", BIASES, ids=[b[0] for b in BIASES])
def test_routed_equals_attention_and_reference(name, make):
    bias = make()
    q, k, v = qkv()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert type(out) is torch.Tensor
    assert_close_to_reference(out, ba.attention(q, k, v, bias))
    assert_close_to_reference(out, reference_attention(q, k, v, bias)[0])


def test_routed_equals_torch_on_the_dense_mask():
    q, k, v = qkv()
    bias = ba.PaddedKeysMask([5, 9]) & ba.LocalAttentionMask(4, 2)
    dense = bias.materialize((2, 2, 7, 9), dtype=torch.float64)
    assert not torch.isneginf(dense).all(-1).any()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    assert_close_to_reference(out, expected, atol=1e-12)


def test_positional_mask_and_scale():
    q, k, v = qkv()
    bias = ba.PaddedKeysMask([3, 6])
    out = F.scaled_dot_product_attention(q, k, v, bias, 0.0, False, scale=0.37)
    assert_close_to_reference(out, reference_attention(q, k, v, bias, scale=0.37)[0])


def test_is_causal_intersects_with_the_bias():
    q, k, v = qkv(Mq=9, Mk=9)
    bias = ba.PaddedKeysMask([5, 9])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=True)
    expected = reference_attention(q, k, v, bias & ba.LowerTriangularMask())[0]
    assert_close_to_reference(out, expected)


def test_enable_gqa():
    q, k, v = qkv(Hq=4, Hkv=2)
    bias = ba.LowerTriangularFromBottomRightMask()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    assert_close_to_reference(out, reference_attention(q, k, v, bias)[0])
    with pytest.raises(ba.InputError, match="query has 4 heads and key has 2; pass enable_gqa=True"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def test_unbatched_inputs():
    q, k, v = qkv(B=1)
    bias = ba.LowerTriangularMask()
    out = F.scaled_dot_product_attention(q[0], k[0], v[0], attn_mask=bias)
    assert out.shape == (2, 7, 8)
    assert_close_to_reference(out, reference_attention(q, k, v, bias)[0][0])


def test_dropout_p_is_honoured():
    q, k, v = qkv(Mq=16, Mk=16)
    bias = ba.LowerTriangularMask()
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.manual_seed(0)
    dropped = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=0.5)
    torch.manual_seed(0)
    again = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=0.5)
    assert not torch.allclose(plain, dropped)
    torch.testing.assert_close(dropped, again)


def test_gradients_flow_through_the_routed_call():
    q, k, v = qkv(requires_grad=True)
    add = torch.randn(1, 2, 1, 9, dtype=torch.float64, requires_grad=True)
    bias = ba.LowerTriangularMask() + ba.AdditiveBias(add)
    F.scaled_dot_product_attention(q, k, v, attn_mask=bias).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v, add)]
    for t in (q, k, v, add):
        t.grad = None
    reference_attention(q, k, v, bias)[0].sum().backward()
    for g, t in zip(grads, (q, k, v, add)):
        assert_close_to_reference(g, t.grad, atol=1e-10)


def test_plain_tensor_masks_stay_with_torch():
    q, k, v = qkv()
    mask = torch.rand(7, 9) < 0.7
    mask[:, 0] = True
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_close_to_reference(out, reference_attention(q, k, v, mask)[0], atol=1e-12)
