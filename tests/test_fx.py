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
    assert isinstance(cross, ba.PaddedKeysMask) and cross.atoms[0].host == (7, 3, 5)
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
