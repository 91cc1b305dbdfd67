"""``MultiheadAttention``: the packed-QKV attention layer, a drop-in for ``torch.nn.MultiheadAttention``.

One ``[(H + 2·Hkv)·Dh, E]`` in-projection (``[3E, E]`` without GQA) computes q, k and v in a single
matmul for self-attention; attention runs through :func:`biasattn.attention`, so masks stay lazy:
a right-padding ``key_padding_mask`` becomes a :class:`~biasattn.PaddedKeysMask`, ``is_causal`` a
:class:`~biasattn.LowerTriangularMask`, and any biasattn bias can be passed as ``attn_mask``.
"""

from __future__ import annotations

import functools
import math
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..api import attention
from ..bias import AdditiveBias, AttentionBias, LowerTriangularMask, PaddedKeysMask
from ..errors import InputError, InputTypeError
from ..memo import BoundedCache


def right_padding_lengths(keep: Tensor) -> Tensor | None:
    """Per row, the number of kept keys when ``keep [B, S]`` (bool, True = key present) is right-padded, else None."""
    lengths = keep.sum(-1)
    prefix = torch.arange(keep.shape[-1], device=keep.device)[None, :] < lengths[:, None]
    return lengths if torch.equal(prefix, keep) else None


def key_padding_bias(keep: Tensor) -> AttentionBias:
    """A lazy bias hiding the keys where ``keep [B, S]`` (bool) is False.

    Right-padded masks become :class:`PaddedKeysMask` (key lengths only); other patterns, and any
    mask under ``torch.compile`` (where reading the lengths would break the graph), become a
    broadcast ``[B, 1, 1, S]`` :class:`AdditiveBias` — never an ``Mq × Mk`` tensor.
    """
    if not torch.compiler.is_compiling():
        lengths = right_padding_lengths(keep)
        if lengths is not None:  # the check has waited for the GPU already: the host keeps the lengths
            return PaddedKeysMask(lengths.tolist(), device=keep.device)
    return AdditiveBias(keep[:, None, None, :])


class BiasMemo:
    """Biases built from mask tensors, kept while those tensors are the same objects, unmodified.

    The layers of one model call receive the same mask tensors, so the bias built for the first
    layer can serve the others: one bias means one lowered spec, whose dispatch choice and launch
    plans the later layers reuse, and one read of the mask (a host sync on a GPU) per call rather
    than one per layer. A tensor is recognised by identity and version (an in-place edit moves the
    version on), never by value; writes that bypass the version counter (through ``.data`` or a
    NumPy view) are not seen. Under ``torch.compile`` every call builds its own.
    """

    def __init__(self, size: int = 8) -> None:
        self.size = size  # biases kept at once (models alternate sliding-window and full layers)
        self.held = BoundedCache(size)  # key -> (weak references to the source tensors, value)

    def get(self, sources: tuple, key: tuple, build):
        """``build()``, or what it returned for the same ``sources`` (tensors or None) and hashable ``key``."""
        held = tuple(t for t in sources if t is not None)
        if torch.compiler.is_compiling() or not all(isinstance(t, Tensor) for t in held):
            return build()
        full = key + tuple(None if t is None else (id(t), t._version) for t in sources)
        hit = self.held.get(full)
        if hit is not None and all(ref() is t for ref, t in zip(hit[0], held)):
            return hit[1]
        value = build()
        drop = functools.partial(_drop, weakref.ref(self), full)  # a bias lives no longer than its masks
        self.held[full] = (tuple(weakref.ref(t, drop) for t in held), value)
        return value


def _drop(memo_ref, key, _dead) -> None:
    """Weak-reference callback: a source tensor of ``key`` was freed, so its bias is dropped too."""
    memo = memo_ref()
    if memo is not None:
        memo.held.pop(key, None)


def compose(parts: list[AttentionBias], device) -> AttentionBias | None:
    """The composition (``+``) of ``parts`` on ``device`` (unsized masks are created on the CPU), or None."""
    out = None
    for p in parts:
        if p.device != torch.device(device):
            p = p.to(device)
        out = p if out is None else out + p
    return out


_biases = BiasMemo()


class MultiheadAttention(nn.Module):
    """Multi-head (and grouped-query) attention with a packed QKV projection and lazy masks.

    Same constructor and ``forward`` as ``torch.nn.MultiheadAttention`` (and the same parameter
    names, so state dicts load both ways when ``num_kv_heads == num_heads``), plus:

    - ``num_kv_heads``: key/value heads for grouped-query attention (divides ``num_heads``);
    - ``attn_mask`` may be any biasattn bias; ``is_causal=True`` needs no mask;
    - attention weights are never formed unless ``need_weights=True`` asks for them (then they are
      computed densely, as a separate, slower step).

    Shapes (``batch_first=False``): query ``[L, B, E]``, key ``[S, B, kdim]``, value ``[S, B, vdim]``,
    output ``[L, B, E]``; with ``batch_first=True`` the batch comes first; unbatched ``[L, E]`` works too.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
        *,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        if add_bias_kv or add_zero_attn:
            raise NotImplementedError("biasattn.nn.MultiheadAttention does not support add_bias_kv / add_zero_attn")
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise InputError(
                f"embed_dim must be a positive multiple of num_heads, got embed_dim={embed_dim}, num_heads={num_heads}"
            )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise InputError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if not 0.0 <= dropout < 1.0:
            raise InputError(f"dropout must be in [0, 1), got {dropout}")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        kv_dim = num_kv_heads * self.head_dim
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(embed_dim + 2 * kv_dim, embed_dim, **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(kv_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(kv_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(embed_dim + 2 * kv_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiheadAttention:
        """A copy of a ``torch.nn.MultiheadAttention`` (weights, dropout, ``batch_first``, device, dtype)."""
        if not isinstance(module, nn.MultiheadAttention):
            raise InputTypeError(f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}")
        if module.bias_k is not None or module.add_zero_attn:
            raise NotImplementedError("biasattn.nn.MultiheadAttention does not support add_bias_kv / add_zero_attn")
        ref = module.out_proj.weight
        new = cls(
            module.embed_dim, module.num_heads, dropout=module.dropout, bias=module.in_proj_bias is not None,
            kdim=module.kdim, vdim=module.vdim, batch_first=module.batch_first, device=ref.device, dtype=ref.dtype,
        )
        new.load_state_dict(module.state_dict(), strict=False)
        missing = {n for n, _ in new.named_parameters()} - set(module.state_dict())
        if missing:  # pragma: no cover - both modules use the same names
            raise RuntimeError(f"parameters not copied: {sorted(missing)}")
        new.train(module.training)
        return new

    # ------------------------------------------------------------------------------ projections
    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        E, kv = self.embed_dim, self.num_kv_heads * self.head_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E : E + kv], b[E + kv :])
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            if query is key and key is value:  # self-attention: one packed matmul
                return F.linear(query, w, b).split([E, kv, kv], dim=-1)
            q = F.linear(query, w[:E], bq)
            if key is value:  # cross-attention: one matmul for k and v
                k, v = F.linear(key, w[E:], None if b is None else b[E:]).split([kv, kv], dim=-1)
                return q, k, v
            return q, F.linear(key, w[E : E + kv], bk), F.linear(value, w[E + kv :], bv)
        return (
            F.linear(query, self.q_proj_weight, bq),
            F.linear(key, self.k_proj_weight, bk),
            F.linear(value, self.v_proj_weight, bv),
        )

    def _bias(self, attn_mask, key_padding_mask, is_causal: bool, B: int, L: int, S: int, dtype, device):
        """The call's bias, built once for the layers of a stack that share their masks (:class:`BiasMemo`)."""
        key = (is_causal, B, L, S, self.num_heads, dtype, device)
        return _biases.get((attn_mask, key_padding_mask), key, lambda: self._build_bias(
            attn_mask, key_padding_mask, is_causal, B, L, S, dtype, device))

    def _build_bias(self, attn_mask, key_padding_mask, is_causal: bool, B: int, L: int, S: int, dtype, device):
        parts: list[AttentionBias] = []
        if attn_mask is not None:
            if isinstance(attn_mask, AttentionBias):
                parts.append(attn_mask)
            elif isinstance(attn_mask, Tensor):
                m = attn_mask
                if m.dim() == 3:  # [B * H, L, S]
                    m = m.reshape(B, self.num_heads, L, S)
                if m.dtype == torch.bool:  # torch's convention: True = not allowed
                    m = ~m
                elif not m.is_floating_point():
                    raise InputTypeError(f"attn_mask must be bool or floating point, got dtype {m.dtype}")
                parts.append(AdditiveBias(m if m.dtype == torch.bool else m.to(dtype)))
            else:
                raise InputTypeError(f"attn_mask must be a tensor or a biasattn bias, got {type(attn_mask).__name__}")
        if key_padding_mask is not None:
            kpm = key_padding_mask
            if kpm.dim() == 1:
                kpm = kpm[None]
            if kpm.dtype == torch.bool:  # True = padding
                parts.append(key_padding_bias(~kpm))
            elif kpm.is_floating_point():
                parts.append(AdditiveBias(kpm.to(dtype)[:, None, None, :]))
            else:
                raise InputTypeError(f"key_padding_mask must be bool or floating point, got dtype {kpm.dtype}")
        if is_causal:
            parts.append(LowerTriangularMask())
        return compose(parts, device)

    # ------------------------------------------------------------------------------ forward
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
        attn_mask: Tensor | AttentionBias | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Returns ``(output, weights or None)`` as ``torch.nn.MultiheadAttention`` does."""
        unbatched = query.dim() == 2
        same = (query is key, key is value)  # self-attention stays recognisable after the layout changes
        if unbatched:
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        elif self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        key = query if same[0] else key
        value = key if same[1] else value
        L, B, _ = query.shape
        S = key.shape[0]
        q, k, v = self._project(query, key, value)
        Dh, H, Hkv = self.head_dim, self.num_heads, self.num_kv_heads
        q = q.view(L, B, H, Dh).permute(1, 2, 0, 3)  # [B, H, L, Dh]
        k = k.view(S, B, Hkv, Dh).permute(1, 2, 0, 3)  # [B, Hkv, S, Dh]
        v = v.view(S, B, Hkv, Dh).permute(1, 2, 0, 3)
        bias = self._bias(attn_mask, key_padding_mask, is_causal, B, L, S, q.dtype, q.device)
        dropout_p = self.dropout if self.training else 0.0
        out = attention(q, k, v, bias, dropout_p=dropout_p)  # [B, H, L, Dh]
        out = self.out_proj(out.permute(2, 0, 1, 3).reshape(L, B, self.embed_dim))
        weights = self._weights(q, k, bias, average_attn_weights) if need_weights else None
        if unbatched:
            out = out.squeeze(1)
            weights = None if weights is None else weights.squeeze(0)
        elif self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _weights(self, q: Tensor, k: Tensor, bias: AttentionBias | None, average: bool) -> Tensor:
        """The dense attention weights ``[B, H, L, S]`` (or averaged over heads ``[B, L, S]``), without dropout."""
        g = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(g, dim=1)
        s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(self.head_dim)
        if bias is not None:
            s = s + bias.materialize(s.shape, device=s.device)
        w = torch.softmax(s, dim=-1).nan_to_num(0.0).to(q.dtype)
        return w.mean(1) if average else w

    def extra_repr(self) -> str:
        kv = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        heads = f"num_heads={self.num_heads}{kv}"
        return f"embed_dim={self.embed_dim}, {heads}, dropout={self.dropout}, batch_first={self.batch_first}"
