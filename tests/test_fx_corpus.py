"""The FX fusion pass on attention spelled the way well-known model families write it.

Each module below is written in the manner of one family (GPT-2, BERT, T5, Llama, ViT, timm, nanoGPT,
Whisper, Mistral, an ALiBi model, Swin, Meta's original Llama); every site must fuse, and the fused
graph must compute what the module computes, forward and backward.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import biasattn as ba
from biasattn.integrations import fx as bfx

E, H, HKV, T, B, N_CTX = 32, 4, 2, 7, 2, 16
Dh = E // H


def split_heads(x, n_heads):
    """[B, T, n·Dh] -> [B, n, T, Dh]."""
    b, t, _ = x.shape
    return x.view(b, t, n_heads, Dh).transpose(1, 2)


def merge_heads(x):
    """[B, n, T, Dh] -> [B, T, n·Dh]."""
    b, n, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, n * d)


class GPT2Attention(nn.Module):
    """A bool causal buffer sliced bottom-right, ``torch.where`` with a buffer fill, ``/ sqrt``, ``.type``."""

    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.register_buffer("bias", torch.tril(torch.ones(N_CTX, N_CTX, dtype=torch.bool)).view(1, 1, N_CTX, N_CTX))
        self.register_buffer("masked_bias", torch.tensor(-1e4))
        self.attn_dropout = nn.Dropout(0.1)

    def forward(self, x, attention_mask):
        query, key, value = self.c_attn(x).split(E, dim=2)
        query, key, value = split_heads(query, H), split_heads(key, H), split_heads(value, H)
        w = torch.matmul(query, key.transpose(-1, -2))
        w = w / math.sqrt(value.size(-1))
        nd, ns = w.size(-2), w.size(-1)
        causal = self.bias[:, :, ns - nd : ns, :ns]
        w = torch.where(causal, w.to(w.dtype), self.masked_bias.to(w.dtype))
        w = w + attention_mask
        w = nn.functional.softmax(w, dim=-1)
        w = w.type(value.dtype)
        w = self.attn_dropout(w)
        return self.c_proj(merge_heads(torch.matmul(w, value)))


class GPT2Model(nn.Module):
    """GPT-2's extended padding mask ``(1.0 - m) * -10000.0`` built outside the attention."""

    def __init__(self):
        super().__init__()
        self.attn = GPT2Attention()

    def forward(self, x, attention_mask):
        attention_mask = attention_mask[:, None, None, :].to(dtype=x.dtype)
        attention_mask = (1.0 - attention_mask) * -10000.0
        return self.attn(x, attention_mask)


class BertSelfAttention(nn.Module):
    """``/ math.sqrt(d) + extended_mask``, ``permute`` for heads, dropout on the probabilities."""

    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)
        self.dropout = nn.Dropout(0.1)
        self.attention_head_size = Dh

    def transpose_for_scores(self, x):
        b, t, _ = x.size()
        return x.view(b, t, H, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask):
        q = self.transpose_for_scores(self.query(hidden_states))
        k = self.transpose_for_scores(self.key(hidden_states))
        v = self.transpose_for_scores(self.value(hidden_states))
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores / math.sqrt(self.attention_head_size)
        scores = scores + attention_mask
        probs = nn.functional.softmax(scores, dim=-1)
        probs = self.dropout(probs)
        context = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return context.view(context.size(0), context.size(1), E)


class BertModel(nn.Module):
    """BERT's extended attention mask ``(1 - m) * finfo.min`` passed into the self-attention."""

    def __init__(self):
        super().__init__()
        self.attention = BertSelfAttention()

    def forward(self, x, attention_mask):
        extended = attention_mask[:, None, None, :].to(dtype=x.dtype)
        extended = (1.0 - extended) * torch.finfo(torch.float32).min
        return self.attention(x, extended)


class T5Attention(nn.Module):
    """No scale; a learned relative position bias plus the extended mask, ``+=``, float softmax, ``F.dropout``."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(E, E, bias=False) for _ in range(4))
        self.max_distance = 4
        self.relative_attention_bias = nn.Embedding(2 * self.max_distance + 1, H)

    def compute_bias(self, query_length, key_length, device):
        context_position = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
        memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        relative_position = memory_position - context_position
        buckets = relative_position.clamp(-self.max_distance, self.max_distance) + self.max_distance
        values = self.relative_attention_bias(buckets)  # [q, k, H]
        return values.permute([2, 0, 1]).unsqueeze(0)  # [1, H, q, k]

    def forward(self, hidden_states, mask):
        t = hidden_states.size(1)
        q, k, v = (split_heads(p(hidden_states), H) for p in (self.q, self.k, self.v))
        scores = torch.matmul(q, k.transpose(3, 2))
        position_bias = self.compute_bias(t, t, hidden_states.device)
        position_bias = position_bias + mask
        scores += position_bias
        attn_weights = nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
        attn_weights = nn.functional.dropout(attn_weights, p=0.1, training=self.training)
        return self.o(merge_heads(torch.matmul(attn_weights, v)))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states, n_rep: int):
    """[B, Hkv, S, D] -> [B, Hkv·n_rep, S, D], each key/value head repeated for its group."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaAttention(nn.Module):
    """Eager Llama: rotary embeddings, grouped k/v through ``repeat_kv``, ``* scaling + causal_mask``."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.o_proj = nn.Linear(E, E, bias=False), nn.Linear(E, E, bias=False)
        self.k_proj, self.v_proj = nn.Linear(E, HKV * Dh, bias=False), nn.Linear(E, HKV * Dh, bias=False)
        self.scaling = Dh**-0.5
        self.num_key_value_groups = H // HKV
        inv_freq = 1.0 / (10000 ** (torch.arange(0, Dh, 2).float() / Dh))
        freqs = torch.outer(torch.arange(N_CTX).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, hidden_states, attention_mask):
        t = hidden_states.shape[1]
        query_states = split_heads(self.q_proj(hidden_states), H)
        key_states = split_heads(self.k_proj(hidden_states), HKV)
        value_states = split_heads(self.v_proj(hidden_states), HKV)
        cos, sin = self.cos_cached[:t].to(query_states.dtype), self.sin_cached[:t].to(query_states.dtype)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = attn_weights + causal_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_weights = nn.functional.dropout(attn_weights, p=0.0, training=self.training)
        return self.o_proj(merge_heads(torch.matmul(attn_weights, value_states)))


class ViTAttention(nn.Module):
    """ViT: one qkv projection unbound into heads, ``(q @ kᵀ) * self.scale``, ``.softmax(dim=-1)``."""

    def __init__(self):
        super().__init__()
        self.scale = Dh**-0.5
        self.qkv, self.proj = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.attn_drop = nn.Dropout(0.0)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, H, c // H).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class TimmAttention(nn.Module):
    """timm: q/k norms, ``q = q * self.scale`` before the product, then ``.softmax(dim=-1)``."""

    def __init__(self):
        super().__init__()
        self.scale = Dh**-0.5
        self.qkv, self.proj = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.q_norm, self.k_norm = nn.LayerNorm(Dh), nn.LayerNorm(Dh)
        self.attn_drop = nn.Dropout(0.0)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, H, Dh).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class NanoGPTAttention(nn.Module):
    """nanoGPT: ``masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))``, ``* (1.0 / math.sqrt(k.size(-1)))``."""

    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.attn_dropout = nn.Dropout(0.1)
        self.register_buffer("bias", torch.tril(torch.ones(N_CTX, N_CTX)).view(1, 1, N_CTX, N_CTX))

    def forward(self, x):
        B_, T_, C = x.size()
        q, k, v = self.c_attn(x).split(E, dim=2)
        k = k.view(B_, T_, H, C // H).transpose(1, 2)
        q = q.view(B_, T_, H, C // H).transpose(1, 2)
        v = v.view(B_, T_, H, C // H).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T_, :T_] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B_, T_, C))


class WhisperAttention(nn.Module):
    """Whisper: the scale split over q and k (``d ** -0.25`` each), k permuted to ``[B, H, D, T]``, an additive -inf buffer."""

    def __init__(self):
        super().__init__()
        self.query, self.key, self.value, self.out = (
            nn.Linear(E, E),
            nn.Linear(E, E, bias=False),
            nn.Linear(E, E),
            nn.Linear(E, E),
        )
        self.register_buffer("mask", torch.empty(N_CTX, N_CTX).fill_(-math.inf).triu_(1), persistent=False)

    def forward(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        n_batch, n_ctx, n_state = q.shape
        scale = (n_state // H) ** -0.25
        q = q.view(n_batch, n_ctx, H, -1).permute(0, 2, 1, 3) * scale
        k = k.view(n_batch, n_ctx, H, -1).permute(0, 2, 3, 1) * scale
        v = v.view(n_batch, n_ctx, H, -1).permute(0, 2, 1, 3)
        qk = q @ k
        qk = qk + self.mask[:n_ctx, :n_ctx]
        qk = qk.float()
        w = F.softmax(qk, dim=-1).to(q.dtype)
        return self.out((w @ v).permute(0, 2, 1, 3).flatten(start_dim=2))


class MistralAttention(nn.Module):
    """Mistral's reference code: a sliding-window mask ``log(triu(tril(ones), -window))`` added with ``+=``."""

    def __init__(self, window=3):
        super().__init__()
        self.window = window
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(E, E, bias=False) for _ in range(4))

    def forward(self, x):
        seqlen = x.shape[1]
        mask = torch.full((seqlen, seqlen), fill_value=1, dtype=x.dtype, device=x.device)
        mask = torch.tril(mask, diagonal=0)
        mask = torch.triu(mask, diagonal=-self.window)
        mask = torch.log(mask)
        xq, xk, xv = (split_heads(p(x), H) for p in (self.wq, self.wk, self.wv))
        scores = torch.matmul(xq, xk.transpose(2, 3)) * Dh**-0.5
        scores += mask[None, None, ...]
        scores = nn.functional.softmax(scores.float(), dim=-1).type_as(xq)
        return self.wo(merge_heads(torch.matmul(scores, xv)))


class ALiBiAttention(nn.Module):
    """ALiBi: ``-slope[h] · |i - j|`` from ``arange``, a causal ``ones((t, t), dtype=bool).triu(1)`` via ``masked_fill``."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.register_buffer("slopes", torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)]))

    def forward(self, x):
        t = x.size(1)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = split_heads(q, H), split_heads(k, H), split_heads(v, H)
        pos = torch.arange(t, device=x.device)
        distance = (pos[None, :] - pos[:, None]).abs()
        alibi = -self.slopes[:, None, None] * distance  # [H, T, T]
        causal = torch.ones((t, t), dtype=torch.bool, device=x.device).triu(1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(Dh)
        scores = scores + alibi
        scores = scores.masked_fill(causal, float("-inf"))
        return self.out(merge_heads(scores.softmax(dim=-1) @ v))


class SwinWindowAttention(nn.Module):
    """Swin: an ``nn.Softmax`` module, a relative-position bias gathered from a learned table."""

    def __init__(self):
        super().__init__()
        self.scale = Dh**-0.5
        self.qkv, self.proj = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.relative_position_bias_table = nn.Parameter(0.1 * torch.randn(2 * T - 1, H))
        coords = torch.arange(T)
        self.register_buffer("relative_position_index", coords[:, None] - coords[None, :] + T - 1)
        self.softmax = nn.Softmax(dim=-1)
        self.attn_drop = nn.Dropout(0.0)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, H, c // H).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        attn = attn + bias.permute(2, 0, 1).contiguous().unsqueeze(0)
        attn = self.softmax(attn)
        attn = self.attn_drop(attn)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class MetaLlamaAttention(nn.Module):
    """Meta's original Llama: ``/ math.sqrt(head_dim) + mask``, ``F.softmax(scores.float(), dim=-1).type_as(xq)``."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(E, E, bias=False) for _ in range(4))
        self.head_dim = Dh

    def forward(self, x, mask):
        xq, keys, values = (split_heads(p(x), H) for p in (self.wq, self.wk, self.wv))
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        return self.wo(merge_heads(torch.matmul(scores, values)))


class MetaLlamaBlock(nn.Module):
    """The causal mask as Meta's ``Transformer.forward`` builds it: ``torch.full(-inf)``, ``torch.triu(mask, diagonal=1)``."""

    def __init__(self):
        super().__init__()
        self.attention = MetaLlamaAttention()

    def forward(self, x):
        seqlen = x.shape[1]
        mask = torch.full((seqlen, seqlen), float("-inf"), device=x.device)
        mask = torch.triu(mask, diagonal=1)
        return x + self.attention(x, mask)


# ------------------------------------------------------------------------------------ inputs


def _x(dtype, g):
    return torch.randn(B, T, E, generator=g, dtype=torch.float64).to(dtype)


def _keep(left_padded=False):
    keep = torch.ones(B, T)
    if left_padded:
        keep[1, :3] = 0
    else:
        keep[1, 4:] = 0
    return keep


def _extended(dtype, left_padded=False):
    return (1.0 - _keep(left_padded)[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def _llama_mask(dtype):
    causal = torch.full((T, T), torch.finfo(dtype).min, dtype=dtype).triu(1)
    return (causal[None, None] + _extended(dtype)).clamp(min=torch.finfo(dtype).min)


@dataclass
class Spelling:
    """One corpus entry: the module, its inputs, the masks the report must name, and whether it computes in float32."""

    name: str
    make: Callable[[], nn.Module]
    inputs: Callable[[torch.dtype, torch.Generator], tuple]
    masks: list[str]
    float32_inside: bool = False
    notes: list[str] = field(default_factory=list)


CORPUS = [
    Spelling("gpt2", GPT2Model, lambda dt, g: (_x(dt, g), _keep()), ["causal (bottom-right)", "padding"]),
    Spelling("bert", BertModel, lambda dt, g: (_x(dt, g), _keep(left_padded=True)), ["padding"]),
    Spelling("bert_self_attention", BertSelfAttention, lambda dt, g: (_x(dt, g), _extended(dt)), ["additive"]),
    Spelling("t5", T5Attention, lambda dt, g: (_x(dt, g), _extended(dt)), ["additive"], float32_inside=True),
    Spelling(
        "llama_eager",
        LlamaAttention,
        lambda dt, g: (_x(dt, g), _llama_mask(dt)),
        ["additive"],
        float32_inside=True,  # softmax(..., dtype=torch.float32)
        notes=["k and v heads repeated per group: passed as grouped-query heads"],
    ),
    Spelling("vit", ViTAttention, lambda dt, g: (_x(dt, g),), []),
    Spelling("timm", TimmAttention, lambda dt, g: (_x(dt, g),), [], notes=["q scaled before the product (kept as written)"]),
    Spelling("nanogpt", NanoGPTAttention, lambda dt, g: (_x(dt, g),), ["causal"]),
    Spelling(
        "whisper",
        WhisperAttention,
        lambda dt, g: (_x(dt, g),),
        ["causal"],
        float32_inside=True,
        notes=["q scaled before the product (kept as written)"],
    ),
    Spelling(
        "mistral_sliding_window", MistralAttention, lambda dt, g: (_x(dt, g),), ["band -3 <= j - i <= 0 (top-left)"], True
    ),
    Spelling("alibi", ALiBiAttention, lambda dt, g: (_x(dt, g),), ["additive", "causal"]),
    Spelling(
        "swin_nn_softmax",
        SwinWindowAttention,
        lambda dt, g: (_x(dt, g),),
        ["additive"],
        notes=["q scaled before the product (kept as written)"],
    ),
    Spelling("meta_llama_fp32_upcast", MetaLlamaBlock, lambda dt, g: (_x(dt, g),), ["causal"], float32_inside=True),
]
IDS = [s.name for s in CORPUS]


def _pair(spelling: Spelling, dtype=torch.float64, seed=0):
    """``(module, fused graph module, report, inputs)`` with the module in ``dtype`` and eval mode."""
    torch.manual_seed(seed)
    module = spelling.make().to(dtype).eval()
    gm, report = bfx.fuse_attention(copy.deepcopy(module))
    return module, gm, report, spelling.inputs(dtype, torch.Generator().manual_seed(seed))


def _error(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("spelling", CORPUS, ids=IDS)
def test_every_spelling_fuses_with_its_masks_named(spelling):
    """Each canonical spelling fuses into one site, the report names its masks, no softmax is left."""
    _, gm, report, _ = _pair(spelling)
    assert report.fused == 1 and not report.skipped, str(report)
    site = report.sites[0]
    assert site.masks == spelling.masks, str(report)
    assert site.notes == spelling.notes, str(report)
    assert not [n for n in gm.graph.nodes if n.op != "get_attr" and "softmax" in str(n.target).lower()]
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"].count(bfx.fused_attention) == 1


@pytest.mark.parametrize("spelling", CORPUS, ids=IDS)
def test_fused_forward_and_backward_equal_the_module_in_float64(spelling):
    module, gm, _, inputs = _pair(spelling)
    x = inputs[0].requires_grad_()
    expected, got = module(x, *inputs[1:]), gm(x, *inputs[1:])
    g = torch.randn_like(expected)
    names = [name for name, _ in module.named_parameters()]
    fused_params = dict(gm.named_parameters())
    grads_ref = torch.autograd.grad(expected, [x, *module.parameters()], g)
    grads = torch.autograd.grad(got, [x, *(fused_params[name] for name in names)], g)
    if spelling.float32_inside:  # the module rounds to float32 inside: allow what its float32 steps cost
        m32, _, _, in32 = _pair(spelling, torch.float32)
        budget = _error(m32(*in32), expected)
        assert 0 < budget < 1e-4
        assert _error(got, expected) <= 4 * budget
    else:
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
        for a, b in zip(grads, grads_ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("spelling", CORPUS, ids=IDS)
def test_fused_float32_error_is_within_the_module_float32_error(spelling):
    ref_module, _, _, ref_inputs = _pair(spelling)
    module, gm, _, inputs = _pair(spelling, torch.float32)
    reference = ref_module(*ref_inputs)
    own_error = _error(module(*inputs), reference)
    assert _error(gm(*inputs), reference) <= 2 * own_error + 4 * torch.finfo(torch.float32).eps * reference.abs().max().item()


def test_float32_upcast_entries_backward_within_float32_error():
    """The spellings that round to float32 inside still get gradients of the module's accuracy."""
    for spelling in [s for s in CORPUS if s.float32_inside]:
        module, gm, _, inputs = _pair(spelling)
        m32, _, _, in32 = _pair(spelling, torch.float32)
        x, x32 = inputs[0].requires_grad_(), in32[0].requires_grad_()
        (ref,) = torch.autograd.grad(module(x, *inputs[1:]).sum(), x)
        (own,) = torch.autograd.grad(m32(x32, *in32[1:]).sum(), x32)
        (got,) = torch.autograd.grad(gm(x, *inputs[1:]).sum(), x)
        assert _error(got, ref) <= 4 * _error(own, ref), spelling.name


def test_grouped_keys_reach_attention_unrepeated(monkeypatch):
    """repeat_kv is undone: the attention call sees the Hkv key and value heads, not H."""
    heads = []
    real = bfx.attention

    def spy(q, k, v, bias=None, **kw):
        heads.append((q.shape[1], k.shape[1], v.shape[1]))
        return real(q, k, v, bias, **kw)

    monkeypatch.setattr(bfx, "attention", spy)
    _, gm, _, inputs = _pair(CORPUS[IDS.index("llama_eager")])
    gm(*inputs)
    assert heads == [(H, HKV, HKV)]


def test_structured_masks_arrive_lazy(attention_spy):
    """Causal buffers, built bands and GPT-2's bottom-right slice arrive as lazy biases."""
    seen = attention_spy(bfx)
    for name in ("gpt2", "nanogpt", "whisper", "mistral_sliding_window", "meta_llama_fp32_upcast"):
        _, gm, _, inputs = _pair(CORPUS[IDS.index(name)])
        gm(*inputs)
    gpt2, nanogpt, whisper, mistral, meta = seen
    assert isinstance(gpt2, ba.AttentionBias) and not isinstance(gpt2, ba.AdditiveBias)
    visible = torch.ones(T, T, dtype=torch.bool).tril() & _keep().bool()[:, None, None, :]
    expected = torch.zeros(B, H, T, T, dtype=torch.float64).masked_fill(~visible, float("-inf"))
    torch.testing.assert_close(gpt2.materialize((B, H, T, T), dtype=torch.float64), expected)
    assert isinstance(nanogpt, ba.LowerTriangularMask) and isinstance(whisper, ba.LowerTriangularMask)
    assert isinstance(meta, ba.LowerTriangularMask)
    assert isinstance(mistral, ba.LocalAttentionMask)
