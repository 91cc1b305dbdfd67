"""The FX attention-fusion pass on a hand-written transformer block."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import biasattn as ba
from biasattn.integrations import fx as bfx

E, H, T, S, B = 32, 4, 11, 7, 3
Dh = E // H


def heads(x, n):
    return x.view(x.shape[0], n, H, Dh).transpose(1, 2)  # [B, n, E] -> [B, H, n, Dh]


class CausalSelfAttention(nn.Module):
    """GPT style: a lower-triangular buffer, masked_fill(== 0, -inf), a graph-valued scale, nn.Dropout."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.proj = nn.Linear(E, E)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("mask", torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16))

    def forward(self, x):
        n = x.shape[1]
        q, k, v = self.qkv(x).split(E, dim=2)
        q, k, v = heads(q, n), heads(k, n), heads(v, n)
        att = (q @ k.transpose(-2, -1)) * (k.size(-1) ** -0.5)
        att = att.masked_fill(self.mask[:, :, :n, :n] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.drop(att)
        return self.proj((att @ v).transpose(1, 2).reshape(x.shape))


class CrossAttention(nn.Module):
    """torch.matmul, transpose(2, 3), division by a constant, a [B, S] padding mask, F.dropout(training=...)."""

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(E, E), nn.Linear(E, 2 * E), nn.Linear(E, E)

    def forward(self, x, memory, memory_mask):
        q = heads(self.q(x), x.shape[1])
        k, v = self.kv(memory).chunk(2, dim=-1)
        k, v = heads(k, memory.shape[1]), heads(v, memory.shape[1])
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(Dh)
        scores = scores.masked_fill(memory_mask[:, None, None, :] == 0, float("-inf"))
        p = F.dropout(torch.softmax(scores, dim=-1), p=0.1, training=self.training)
        return self.o(torch.matmul(p, v).transpose(1, 2).reshape(x.shape))


class BertSelfAttention(nn.Module):
    """BERT's additive padding mask (1 - m) * -10000, a float scale, a cast to float32 and back."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = heads(q, x.shape[1]), heads(k, x.shape[1]), heads(v, x.shape[1])
        scores = (q @ k.transpose(-1, -2)).float() * (1 / math.sqrt(Dh)) + (1.0 - mask[:, None, None, :].float()) * -10000.0
        p = scores.softmax(-1).type_as(v)
        return (p @ v).transpose(1, 2).reshape(x.shape)


class RelativeBiasAttention(nn.Module):
    """No scale, k.mT, a learned additive bias (gets gradients), nn.Softmax."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.rel = nn.Parameter(0.1 * torch.randn(1, H, T, T))
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = heads(q, x.shape[1]), heads(k, x.shape[1]), heads(v, x.shape[1])
        return (self.softmax(q @ k.mT + self.rel) @ v).transpose(1, 2).reshape(x.shape)


class WeightsReturned(nn.Module):
    """The weights are used outside the attention: must be left alone."""

    def forward(self, x):
        q = heads(x, x.shape[1])
        w = torch.softmax(q @ q.transpose(-2, -1), dim=-1)
        return (w @ q).transpose(1, 2).reshape(x.shape) + w.mean()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(E)
        self.self_attn = CausalSelfAttention()
        self.cross = CrossAttention()
        self.bert = BertSelfAttention()
        self.rel = RelativeBiasAttention()
        self.other = WeightsReturned()

    def forward(self, x, memory, memory_mask, mask):
        x = x + self.self_attn(self.ln(x))
        x = x + self.cross(self.ln(x), memory, memory_mask)
        x = x + self.bert(x, mask)
        x = x + self.rel(x)
        return self.other(x)


def block_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x, memory = torch.randn(B, T, E, generator=g), torch.randn(B, S, E, generator=g)
    memory_mask = (torch.arange(S)[None] < torch.tensor([7, 3, 5])[:, None]).long()  # right padding
    mask = torch.ones(B, T)
    mask[1, :2] = 0  # left padding in one row
    return x, memory, memory_mask, mask


def test_block_outputs_and_report():
    torch.manual_seed(0)
    block = Block().eval()
    inputs = block_inputs()
    expected = block(*inputs)
    gm, report = bfx.fuse_attention(block)
    assert report.fused == 4, str(report)
    assert len(report.skipped) == 1 and "used outside" in report.skipped[0]
    kinds = [site.masks for site in report.sites]
    assert kinds == [["causal"], ["padding"], ["padding"], ["additive"]]
    softmaxes = [n for n in gm.graph.nodes if n.op != "get_attr" and "softmax" in str(n.target).lower()]
    assert len(softmaxes) == 1  # only the site whose weights are returned
    torch.testing.assert_close(gm(*inputs), expected, atol=1e-5, rtol=1e-5)


def test_gradients_flow_through_fused_sites():
    torch.manual_seed(0)
    block = Block().eval()
    inputs = block_inputs()
    gm, _ = bfx.fuse_attention(Block().eval())
    gm.load_state_dict(block.state_dict())
    g_fused = torch.autograd.grad(gm(*inputs).square().sum(), list(gm.parameters()))
    g_ref = torch.autograd.grad(block(*inputs).square().sum(), list(block.parameters()))
    for a, b in zip(g_fused, g_ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_lazy_biases_reach_attention(attention_spy):
    """Causal buffers and padding masks arrive as lazy biases, not as dense tensors."""
    seen = attention_spy(bfx)
    gm, _ = bfx.fuse_attention(Block().eval())
    gm(*block_inputs())
    causal, cross, bert, rel = seen
    assert isinstance(causal, ba.LowerTriangularMask)
    assert isinstance(cross, ba.PaddedKeysMask) and cross.atoms[0].lengths() == (7, 3, 5)
    assert isinstance(bert, ba.AdditiveBias) and list(bert.tensor.shape) == [B, 1, 1, T]  # left padding: broadcast
    assert isinstance(rel, ba.AdditiveBias)


def test_dropout_module_follows_train_mode():
    torch.manual_seed(0)
    attn = CausalSelfAttention().eval()
    gm, report = bfx.fuse_attention(attn)
    assert report.sites[0].dropout == "module drop"
    x = torch.randn(B, T, E)
    torch.testing.assert_close(gm(x), attn(x), atol=1e-5, rtol=1e-5)
    gm.train()
    assert not torch.allclose(gm(x), attn(x))  # the module's dropout applies again in training


def test_graph_module_in_place_and_no_sites():
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(E, E), nn.ReLU()))
    same, report = bfx.fuse_attention(gm)
    assert same is gm and report.fused == 0 and "fused 0" in str(report)


@pytest.mark.parametrize("fill", [float("-inf"), -1e9, torch.finfo(torch.float32).min])
def test_masked_fill_values_and_bool_masks(fill):
    class Plain(nn.Module):
        def forward(self, q, k, v, hidden):
            s = (q @ k.transpose(-2, -1)).masked_fill(hidden, fill)
            return torch.softmax(s, dim=-1) @ v

    q, k, v = (torch.randn(2, H, 5, Dh) for _ in range(3))
    hidden = torch.rand(2, 1, 5, 5) > 0.6
    hidden[..., 0] = False  # every row keeps a key
    gm, report = bfx.fuse_attention(Plain())
    assert report.fused == 1 and report.sites[0].masks == ["hidden"]
    torch.testing.assert_close(gm(q, k, v, hidden), Plain()(q, k, v, hidden), atol=1e-5, rtol=1e-5)


class ScaledThenMasked(nn.Module):
    """``softmax(q @ kᵀ * scale + mask) @ v`` or, with ``divide``, ``/ math.sqrt(d) + mask``."""

    def __init__(self, divide: bool):
        super().__init__()
        self.divide = divide

    def forward(self, q, k, v, mask):
        s = q @ k.transpose(-2, -1) / math.sqrt(Dh) if self.divide else q @ k.transpose(-2, -1) * Dh**-0.5
        return torch.softmax(s + mask, dim=-1) @ v


def _qkv_mask(dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, H, 5, Dh, generator=g, dtype=dtype) for _ in range(3))
    return q, k, v, torch.randn(2, 1, 5, 5, generator=g, dtype=dtype)


@pytest.mark.parametrize("divide", [False, True])
def test_float_mask_added_after_the_scale_fuses(divide):
    """Regression: an additive mask added after the scale was refused as "an additive mask scaled with the scores"."""
    module = ScaledThenMasked(divide)
    gm, report = bfx.fuse_attention(module)
    assert report.fused == 1 and not report.skipped, str(report)
    assert report.sites[0].masks == ["additive"] and report.sites[0].scale == f"{Dh**-0.5:.6g}"
    inputs = _qkv_mask()
    torch.testing.assert_close(gm(*inputs), module(*inputs), rtol=1e-12, atol=1e-12)


def test_additive_mask_inside_the_scale_is_refused_with_the_reason():
    """``(q kᵀ + mask) * scale`` scales the mask too: left alone, and the report says why."""

    class MaskThenScale(nn.Module):
        def forward(self, q, k, v, mask):
            return torch.softmax((q @ k.transpose(-2, -1) + mask) * 0.5, dim=-1) @ v

    gm, report = bfx.fuse_attention(MaskThenScale())
    assert report.fused == 0 and len(report.skipped) == 1
    assert "added before the scale" in report.skipped[0]
    inputs = _qkv_mask()
    torch.testing.assert_close(gm(*inputs), MaskThenScale()(*inputs))


def test_minus_inf_fill_inside_the_scale_fuses():
    """A -inf fill stays -inf when scaled, so ``masked_fill`` before the scale fuses."""

    class FillThenScale(nn.Module):
        def forward(self, q, k, v, hidden):
            return torch.softmax((q @ k.transpose(-2, -1)).masked_fill(hidden, float("-inf")) * 0.5, dim=-1) @ v

    q, k, v, _ = _qkv_mask()
    hidden = torch.ones(5, 5, dtype=torch.bool).triu(1)
    gm, report = bfx.fuse_attention(FillThenScale())
    assert report.fused == 1, str(report)
    torch.testing.assert_close(gm(q, k, v, hidden), FillThenScale()(q, k, v, hidden), rtol=1e-12, atol=1e-12)


def test_unfused_spellings_are_reported_with_their_reason():
    """Every softmax-weighted product left alone appears in the report with a reason."""

    class BartStyle(nn.Module):  # scores viewed to [B, H, T, S] for the mask and back to [B·H, T, S]
        def forward(self, q, k, v, mask):
            w = torch.bmm(q, k.transpose(1, 2))
            w = (w.view(2, H, 5, 5) + mask).view(2 * H, 5, 5)
            return torch.bmm(w.softmax(dim=-1), v)

    class OtherDim(nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(-2, -1), dim=3) @ v

    _, report = bfx.fuse_attention(BartStyle())
    assert report.fused == 0 and "unrecognised op call_method view" in report.skipped[0], str(report)
    _, report = bfx.fuse_attention(OtherDim())
    assert report.fused == 0 and "softmax over dim 3" in report.skipped[0], str(report)


@pytest.mark.parametrize("mq, mk", [(5, 5), (3, 7), (7, 3), (1, 4)])
@pytest.mark.parametrize("lo, hi", [(None, 0), (-2, 0), (-1, 2), (None, 1), (1, 3), (-3, None)])
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_band_bias_is_the_band_it_names(mq, mk, lo, hi, align):
    rel = torch.arange(mk)[None, :] - torch.arange(mq)[:, None] - (mk - mq if align == "bottom_right" else 0)
    visible = (rel >= (-mq - mk if lo is None else lo)) & (rel <= (mq + mk if hi is None else hi))
    expected = torch.zeros(1, 1, mq, mk, dtype=torch.float64).masked_fill(~visible, float("-inf"))
    got = bfx.band_bias(lo, hi, align, mq, mk).materialize((1, 1, mq, mk), dtype=torch.float64)
    torch.testing.assert_close(got, expected)


class BufferBand(nn.Module):
    """A 0/1 band buffer (window 2) sliced top-left or bottom-right (a query block after cached keys)."""

    def __init__(self, bottom_right: bool):
        super().__init__()
        self.bottom_right = bottom_right
        self.register_buffer("band", torch.ones(16, 16, dtype=torch.bool).tril().triu(-2)[None, None])

    def forward(self, q, k, v):
        mq, mk = q.size(-2), k.size(-2)
        band = self.band[:, :, mk - mq : mk, :mk] if self.bottom_right else self.band[:, :, :mq, :mk]
        s = torch.where(band, q @ k.transpose(-2, -1), float("-inf"))
        return s.softmax(dim=-1) @ v


@pytest.mark.parametrize("bottom_right", [False, True])
@pytest.mark.parametrize("mq, mk", [(6, 6), (3, 6)])
def test_band_buffers_fuse_in_both_alignments(bottom_right, mq, mk):
    """Sliced band buffers become band terms; shapes with no lazy equivalent use the buffer as written."""
    if not bottom_right and mq != mk:
        mk = mq + 1  # top-left, wider than tall: every row still sees a key
    module = BufferBand(bottom_right)
    gm, report = bfx.fuse_attention(module)
    align = "bottom-right" if bottom_right else "top-left"
    assert report.fused == 1 and report.sites[0].masks == [f"band -2 <= j - i <= 0 ({align})"], str(report)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, H, mq, Dh, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, H, mk, Dh, generator=g, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(gm(q, k, v), module(q, k, v), rtol=1e-12, atol=1e-12)
