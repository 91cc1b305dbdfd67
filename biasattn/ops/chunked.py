"""The chunked operator: online softmax over key blocks in pure PyTorch, on any device.

Memory is O(B·H·Mq·D) for the output plus one ``[B, H, block_q, block_k]`` score tile; no
``Mq × Mk`` tensor is ever allocated. Key blocks that the spec hides entirely (band, segments,
padded keys, block layout) are skipped using host metadata. GQA reads each K/V block once per
group (no repeat in memory). Backward recomputes the scores tile by tile.
"""

from __future__ import annotations

import torch

from ..bias.spec import FEATURES
from ..inputs import AttentionInputs
from .base import Operator
from .common import compute_dtype, dropout_keep, group_heads, new_seed, reduce_to
from .tiles import key_range, layout_allows, tile_bias


class ChunkedOperator(Operator):
    """Pure-PyTorch flash-style attention: every feature, forward and backward, any device."""

    NAME = "chunked"
    DESCRIPTION = "pure PyTorch online softmax over key blocks; O(M·D) memory; every feature"
    FEATURES = frozenset(FEATURES)
    SUPPORTS_DROPOUT = True
    SUPPORTS_BACKWARD = True
    SUPPORTS_BIAS_GRAD = True
    SUPPORTS_GQA = True
    SUPPORTS_EMPTY = True

    def __init__(self, block_q: int = 256, block_k: int = 512):
        self.block_q = block_q
        self.block_k = block_k

    def _tiles(self, inp: AttentionInputs):
        """Yield ``(i0, i1, [(j0, j1), ...])`` for every query block and its visible key blocks."""
        spec = inp.spec
        for i0 in range(0, inp.Mq, self.block_q):
            i1 = min(i0 + self.block_q, inp.Mq)
            lo, hi = key_range(spec, i0, i1)
            keys = [
                (j0, min(j0 + self.block_k, hi))
                for j0 in range(lo, hi, self.block_k)
                if layout_allows(spec, i0, i1, j0, min(j0 + self.block_k, hi))
            ]
            yield i0, i1, keys

    def _scores(self, inp, qt, i0, i1, j0, j1, dtype):
        k = inp.k[:, :, None, j0:j1].to(dtype)  # [B, Hkv, 1, bk, D]
        s = (qt @ k.transpose(-1, -2)) * inp.scale  # [B, Hkv, G, bq, bk]
        tb = tile_bias(inp.spec, i0, i1, j0, j1, dtype, inp.device)
        return s if tb is None else s + group_heads(tb, inp.Hkv)

    def fwd(self, inp: AttentionInputs):
        dtype = compute_dtype(inp.dtype)
        B, Hkv, G, Dv = inp.B, inp.Hkv, inp.groups, inp.Dv
        q = group_heads(inp.q, Hkv)  # [B, Hkv, G, Mq, D]
        out = torch.zeros((B, Hkv, G, inp.Mq, Dv), dtype=inp.dtype, device=inp.device)
        lse = torch.full((B, Hkv, G, inp.Mq), float("-inf"), dtype=dtype, device=inp.device)
        seed = new_seed() if inp.dropout_p > 0 else 0
        for i0, i1, keys in self._tiles(inp):
            if not keys:
                continue
            qt = q[:, :, :, i0:i1].to(dtype)
            m = torch.full(qt.shape[:-1], float("-inf"), dtype=dtype, device=inp.device)
            l = torch.zeros_like(m)
            acc = torch.zeros((*qt.shape[:-1], Dv), dtype=dtype, device=inp.device)
            for j0, j1 in keys:
                s = self._scores(inp, qt, i0, i1, j0, j1, dtype)
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
                p = torch.exp(s - m_safe[..., None])
                alpha = torch.exp(m - m_safe)
                l = l * alpha + p.sum(-1)
                if inp.dropout_p > 0:
                    p = p * dropout_keep(seed, (i0, j0), p.shape, inp.dropout_p, inp.device).to(dtype)
                acc = acc * alpha[..., None] + p @ inp.v[:, :, None, j0:j1].to(dtype)
                m = m_new
            pos = l > 0
            safe_l = torch.where(pos, l, torch.ones_like(l))
            out[:, :, :, i0:i1] = (acc / safe_l[..., None]).to(inp.dtype)
            m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
            lse[:, :, :, i0:i1] = torch.where(pos, m_safe + torch.log(safe_l), torch.full_like(l, float("-inf")))
        return out.reshape(B, inp.Hq, inp.Mq, Dv), lse.reshape(B, inp.Hq, inp.Mq), seed

    def bwd(self, inp, out, lse, ctx, dout, dlse):
        dtype = compute_dtype(inp.dtype)
        Hkv = inp.Hkv
        delta = (dout.to(dtype) * out.to(dtype)).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(dtype)
        delta = group_heads(delta, Hkv)
        lse = group_heads(lse.to(dtype), Hkv)
        lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        q = group_heads(inp.q, Hkv)
        do = group_heads(dout, Hkv)
        dq = torch.zeros(q.shape, dtype=dtype, device=inp.device)
        dk = torch.zeros(inp.k.shape, dtype=dtype, device=inp.device)
        dv = torch.zeros(inp.v.shape, dtype=dtype, device=inp.device)
        add = inp.additive
        dadd = torch.zeros(add.shape, dtype=dtype, device=inp.device) if add is not None and add.requires_grad else None
        for i0, i1, keys in self._tiles(inp):
            qt = q[:, :, :, i0:i1].to(dtype)
            dot = do[:, :, :, i0:i1].to(dtype)
            for j0, j1 in keys:
                s = self._scores(inp, qt, i0, i1, j0, j1, dtype)
                p = torch.exp(s - lse[:, :, :, i0:i1, None])  # [B, Hkv, G, bq, bk]
                v = inp.v[:, :, None, j0:j1].to(dtype)
                dp = dot @ v.transpose(-1, -2)
                if inp.dropout_p > 0:
                    keep = dropout_keep(ctx, (i0, j0), p.shape, inp.dropout_p, inp.device).to(dtype)
                    dv[:, :, j0:j1] += ((p * keep).transpose(-1, -2) @ dot).sum(2)
                    dp = dp * keep
                else:
                    dv[:, :, j0:j1] += (p.transpose(-1, -2) @ dot).sum(2)
                ds = p * (dp - delta[:, :, :, i0:i1, None])
                k = inp.k[:, :, None, j0:j1].to(dtype)
                dq[:, :, :, i0:i1] += (ds @ k) * inp.scale
                dk[:, :, j0:j1] += (ds.transpose(-1, -2) @ qt).sum(2) * inp.scale
                if dadd is not None:
                    ds_h = ds.reshape(inp.B, inp.Hq, i1 - i0, j1 - j0)
                    rows = slice(i0, i1) if add.shape[2] != 1 else slice(None)
                    cols = slice(j0, j1) if add.shape[3] != 1 else slice(None)
                    dadd[:, :, rows, cols] += reduce_to(ds_h, add.shape)
        dq = dq.reshape(inp.q.shape).to(inp.q.dtype)
        return dq, dk.to(inp.k.dtype), dv.to(inp.v.dtype), None if dadd is None else dadd.to(add.dtype)
