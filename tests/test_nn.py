"""biasattn.nn.MultiheadAttention against torch.nn.MultiheadAttention, GQA, lazy masks, compile."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch.nn.functional as F
from torch import nn

import biasattn as ba
from biasattn.nn import MultiheadAttention, key_padding_bias, multihead

E, H, L, S, B = 16, 4, 7, 9, 3
TOL = dict(atol=2e-5, rtol=2e-5)


def pair(batch_first=False, kdim=None, vdim=None, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, H, dropout=dropout, kdim=kdim, vdim=vdim, batch_first=batch_first)
    with torch.no_grad():  # non-zero biases, so that copying them is tested too
        ref.in_proj_bias.normal_() if ref.in_proj_bias is not None else None
        ref.out_proj.bias.normal_()
    return ref, MultiheadAttention.from_torch(ref)


def inputs(L=L, S=S, batch_first=False, kdim=E, vdim=E, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (lambda n, d: (B, n, d)) if batch_first else (lambda n, d: (n, B, d))
    return tuple(torch.randn(shape(n, d), generator=g) for n, d in ((L, E), (S, kdim), (S, vdim)))


def right_padding(lengths, S=S):
    return torch.arange(S)[None, :] >= torch.tensor(lengths)[:, None]  # True = padding


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("kind", ["self", "cross", "separate"])
def test_matches_torch_eval(batch_first, kind):
    ref, mod = pair(batch_first=batch_first)
    ref.eval(), mod.eval()
    x, k, v = inputs(L=S, batch_first=batch_first)
    args = {"self": (x, x, x), "cross": (x, k, k), "separate": (x, k, v)}[kind]
    out, w = mod(*args)
    torch.testing.assert_close(out, ref(*args, need_weights=False)[0], **TOL)
    assert w is None


def test_matches_torch_train_without_dropout_with_gradients():
    ref, mod = pair(batch_first=True)
    ref.train(), mod.train()
    x, _, _ = inputs(L=S, batch_first=True)
    kpm = right_padding([9, 4, 6])
    out = mod(x, x, x, key_padding_mask=kpm)[0]
    expected = ref(x, x, x, key_padding_mask=kpm, need_weights=False)[0]
    torch.testing.assert_close(out, expected, **TOL)
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), (_, p_ref) in zip(mod.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, **TOL, msg=name)


def test_kdim_vdim_separate_projections():
    ref, mod = pair(kdim=5, vdim=3)
    assert mod.in_proj_weight is None and mod.k_proj_weight.shape == (E, 5)
    ref.eval(), mod.eval()
    q, k, v = inputs(kdim=5, vdim=3)
    kpm = right_padding([9, 2, 5])
    torch.testing.assert_close(mod(q, k, v, key_padding_mask=kpm)[0], ref(q, k, v, key_padding_mask=kpm)[0], **TOL)


@pytest.mark.parametrize(
    "masks",
    [
        lambda: {"key_padding_mask": right_padding([9, 4, 6])},
        lambda: {"key_padding_mask": torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1]] * B, dtype=torch.bool)},  # left padding
        lambda: {"key_padding_mask": torch.randn(B, S)},
        lambda: {"attn_mask": torch.rand(L, S) > 0.7},
        lambda: {"attn_mask": torch.randn(B * H, L, S)},
        lambda: {
            "attn_mask": torch.ones(L, S, dtype=torch.bool).triu(1),
            "is_causal": True,
            "key_padding_mask": right_padding([9, 8, 7]),
        },
    ],
    ids=["right-padding", "left-padding", "float-padding", "bool-mask", "float-mask-per-head", "causal-and-padding"],
)
def test_masks_match_torch(masks):
    ref, mod = pair()
    ref.eval(), mod.eval()
    q, k, v = inputs()
    kw = masks()
    torch.testing.assert_close(mod(q, k, v, **kw)[0], ref(q, k, v, **kw)[0], **TOL)


def test_need_weights_match_torch():
    ref, mod = pair()
    ref.eval(), mod.eval()
    q, k, v = inputs()
    kpm = right_padding([9, 4, 6])
    for average in (True, False):
        out, w = mod(q, k, v, key_padding_mask=kpm, need_weights=True, average_attn_weights=average)
        out_ref, w_ref = ref(q, k, v, key_padding_mask=kpm, need_weights=True, average_attn_weights=average)
        torch.testing.assert_close(w, w_ref, **TOL)
        torch.testing.assert_close(out, out_ref, **TOL)


def test_unbatched_input():
    ref, mod = pair()
    ref.eval(), mod.eval()
    x = torch.randn(L, E)
    torch.testing.assert_close(mod(x, x, x)[0], ref(x, x, x)[0], **TOL)


def test_right_padding_becomes_padded_keys_mask(attention_spy):
    """A right-padding key_padding_mask reaches attention as key lengths, not as a dense mask."""
    seen = attention_spy(multihead)
    mod = MultiheadAttention(E, H).eval()
    x = torch.randn(S, B, E)
    mod(x, x, x, key_padding_mask=right_padding([9, 4, 6]), is_causal=True)
    (bias,) = seen
    kinds = {a.kind for a in bias.atoms}
    assert kinds == {"padded_keys", "band"}
    assert isinstance(key_padding_bias(~right_padding([9, 4, 6])), ba.PaddedKeysMask)
    assert isinstance(key_padding_bias(torch.tensor([[False, True, True]])), ba.AdditiveBias)


def test_a_stack_shares_one_bias_per_mask(attention_spy):
    """Layers called with the same key_padding_mask tensor share one bias; an edited or another mask
    gets its own, and the outputs follow the mask's current values."""
    seen = attention_spy(multihead)
    layers = [MultiheadAttention(E, H).eval() for _ in range(3)]
    x = torch.randn(S, B, E)
    kpm = right_padding([9, 4, 6])
    for mod in layers:
        mod(x, x, x, key_padding_mask=kpm)
    assert seen[0] is seen[1] is seen[2]
    kpm[1, 2:] = True  # the same tensor, edited in place: row 1 keeps 2 keys
    edited = layers[0](x, x, x, key_padding_mask=kpm)[0]
    assert seen[3] is not seen[0] and seen[3].atoms[0].lengths() == (9, 2, 6)
    torch.testing.assert_close(edited, layers[0](x, x, x, key_padding_mask=right_padding([9, 2, 6]))[0])
    assert seen[4] is not seen[3]


def test_bias_memo_keys_on_identity_version_and_key():
    memo, built = multihead.BiasMemo(size=2), []

    def build(tag):
        built.append(tag)
        return tag

    a, b = torch.ones(3), torch.ones(3)
    assert memo.get((a, None), ("k",), lambda: build(1)) == 1
    assert memo.get((a, None), ("k",), lambda: build(2)) == 1  # kept
    assert memo.get((b, None), ("k",), lambda: build(3)) == 3  # equal values, another tensor
    assert memo.get((a, None), ("other",), lambda: build(4)) == 4  # another key
    a.add_(1)
    assert memo.get((a, None), ("k",), lambda: build(5)) == 5  # edited in place
    assert memo.get(([1, 2], None), ("k",), lambda: build(6)) == 6  # not a tensor: never kept
    assert memo.get(([1, 2], None), ("k",), lambda: build(7)) == 7
    assert len(memo.held) <= 2 and built == [1, 3, 4, 5, 6, 7]


def test_bias_memo_drops_a_bias_with_its_mask():
    """A kept bias (which may hold a converted copy of a large mask) is freed when its mask is."""
    import gc
    import weakref

    memo = multihead.BiasMemo()
    mask = torch.ones(2, 5, dtype=torch.bool)
    bias = memo.get((mask,), (), lambda: ba.AdditiveBias(torch.zeros(2, 1, 1, 5)))
    alive = weakref.ref(bias)
    del bias
    assert alive() is not None and len(memo.held) == 1
    del mask
    gc.collect()
    assert alive() is None and not memo.held


def test_lazy_bias_as_attn_mask():
    mod = MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(B, L, E)
    out = mod(x, x, x, attn_mask=ba.LocalAttentionMask(2))[0]
    dense = ba.LocalAttentionMask(2).materialize((1, 1, L, L))[0, 0]
    ref = nn.MultiheadAttention(E, H, batch_first=True).eval()
    ref.load_state_dict(mod.state_dict())
    torch.testing.assert_close(out, ref(x, x, x, attn_mask=dense)[0], **TOL)


def test_grouped_query_attention():
    mod = MultiheadAttention(E, H, num_kv_heads=2, batch_first=True).eval()
    assert mod.in_proj_weight.shape == (E + 2 * 2 * (E // H), E)
    x = torch.randn(B, L, E)
    out = mod(x, x, x, is_causal=True)[0]
    Dh = E // H
    qkv = F.linear(x, mod.in_proj_weight, mod.in_proj_bias)
    q, k, v = qkv.split([E, 2 * Dh, 2 * Dh], dim=-1)
    q = q.view(B, L, H, Dh).transpose(1, 2)
    k, v = (t.view(B, L, 2, Dh).transpose(1, 2).repeat_interleave(2, dim=1) for t in (k, v))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, E)
    torch.testing.assert_close(out, mod.out_proj(ref), **TOL)


def test_dropout_in_training_only():
    mod = MultiheadAttention(E, H, dropout=0.5)
    x = torch.randn(L, B, E)
    torch.manual_seed(3)
    a = mod(x, x, x)[0]
    torch.manual_seed(3)
    torch.testing.assert_close(mod(x, x, x)[0], a)  # reproducible under a seed
    mod.eval()
    assert not torch.allclose(mod(x, x, x)[0], a)


def test_state_dict_interchange_and_errors():
    ref, mod = pair()
    back = nn.MultiheadAttention(E, H)
    back.load_state_dict(mod.state_dict())
    with pytest.raises(ba.InputError, match="multiple of num_kv_heads"):
        MultiheadAttention(E, H, num_kv_heads=3)
    with pytest.raises(NotImplementedError):
        MultiheadAttention.from_torch(nn.MultiheadAttention(E, H, add_bias_kv=True))


def test_compiled_training_step_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    mod = MultiheadAttention(E, H, num_kv_heads=2, batch_first=True)
    x = torch.randn(B, L, E, requires_grad=True)
    kpm = right_padding([7, 3, 5], S=L)

    def step(m, x):
        return m(x, x, x, key_padding_mask=kpm, is_causal=True)[0].square().sum()

    cnt = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    loss = torch.compile(step, fullgraph=True, backend=cnt)(mod, x)
    grads = torch.autograd.grad(loss, [x, *mod.parameters()])
    ref_loss = step(mod, x)
    ref_grads = torch.autograd.grad(ref_loss, [x, *mod.parameters()])
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **TOL)
    assert cnt.frame_count == 1
    torch._dynamo.reset()
