"""The chunked operator: online softmax over key blocks in pure PyTorch, on any device.

Memory is O(B·H·Mq·D) for the output plus one ``[B, H, block_q, block_k]`` score tile (capped at
:data:`TILE_ELEMENTS`); no ``Mq × Mk`` tensor is ever allocated. Key blocks that the spec hides
entirely (band, segments, padded keys, block layout) are skipped using host metadata; when the
layout or the padded lengths differ between heads or batch rows, each of them is its own
sub-problem, so that it skips exactly its own blocks. Unmasked blocks are gathered into wide
tiles, masks are evaluated only on boundary tiles, and queries or keys that a boundary tile hides
entirely are zeroed there (NaN padding stays out). On tiles where the bias hides some scores (masked
tiles, additive terms that may hold -inf) hidden scores are masked with ``where`` and ``p @ v`` skips
hidden values (:func:`~biasattn.ops.tiles.visible_matmul`): a hidden position never affects a row.
GQA reads each K/V block once per group (no repeat in memory). Backward recomputes the scores tile by tile.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from ..bias.spec import FEATURES
from ..inputs import AttentionInputs
from .base import Operator
from .common import compute_dtype, dropout_keep, group_heads, may_hold_nonfinite, new_seed, reduce_to
from .tiles import key_range, layout_allows, tile_bias, tile_fully_visible, visible_matmul

TILE_ELEMENTS = 2**19  # 2 MiB of float32 scores per [B, H, rows, block_k] tile


class KeyTile(NamedTuple):
    """The keys of one score tile: ranges ``[j0, j1)`` taken in order (gathered when more than one)."""

    ranges: tuple[tuple[int, int], ...]
    full: bool  # no mask hides any element of the tile

    @property
    def j0(self) -> int:
        return self.ranges[0][0]

    @property
    def width(self) -> int:
        return sum(j1 - j0 for j0, j1 in self.ranges)


@dataclass(frozen=True)
class ChunkedSaved:
    """What the chunked forward keeps for its backward: the dropout seed and the output before rounding."""

    seed: int
    out: torch.Tensor  # [B, Hq, Mq, Dv] in the compute dtype


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
        """Yield ``(i0, i1, [KeyTile, ...])``: every query block and the key tiles it must visit.

        With a block layout, tiles follow the layout's blocks so that hidden blocks are skipped one
        by one. Blocks that no mask touches (and, without additive terms, need no bias at all) are
        gathered into wide tiles: one matmul instead of one per block.
        """
        spec = inp.spec
        plain = spec.additive is None and spec.alibi_slopes is None
        for i0, i1 in self._row_blocks(inp):
            lo, hi = key_range(spec, i0, i1)
            keys, gather = [], []
            cap = max(self.block_k, TILE_ELEMENTS // max(1, inp.B * inp.Hq * (i1 - i0)))
            for j0, j1 in self._key_blocks(spec, i0, i1, lo, hi):
                full = tile_fully_visible(spec, i0, i1, j0, j1)
                if not (full and plain):
                    keys.append(KeyTile(((j0, j1),), full))
                    continue
                if gather and sum(b - a for a, b in gather) + (j1 - j0) > cap:
                    keys.append(KeyTile(tuple(gather), True))
                    gather = []
                if gather and gather[-1][1] == j0:
                    gather[-1] = (gather[-1][0], j1)
                else:
                    gather.append((j0, j1))
            if gather:
                keys.append(KeyTile(tuple(gather), True))
            yield i0, i1, keys

    def _row_blocks(self, inp: AttentionInputs):
        """Query blocks ``(i0, i1)``; with a layout, aligned to its row blocks (about 64 rows or one block)."""
        # Score tiles of at most TILE_ELEMENTS: they stay in cache and the allocator reuses them.
        rows = max(16, TILE_ELEMENTS // max(1, inp.B * inp.Hq * self.block_k))
        spec, step, first = inp.spec, min(self.block_q, rows), 0
        if spec.host.layout is not None:
            step = spec.block_q * max(1, min(step, 64) // spec.block_q)
            first = (-spec.layout_q_off) % step
        starts = ([0] if first else []) + list(range(first, inp.Mq, step))
        for i0, i1 in zip(starts, starts[1:] + [inp.Mq]):
            if i0 < i1:
                yield i0, i1

    def _key_blocks(self, spec, i0: int, i1: int, lo: int, hi: int):
        """Key blocks ``(j0, j1)`` within ``[lo, hi)``: runs of visible layout blocks cut at ``block_k``."""
        if lo >= hi:
            return
        if spec.host.layout is None:
            for j0 in range(lo, hi, self.block_k):
                j1 = min(j0 + self.block_k, hi)
                if layout_allows(spec, i0, i1, j0, j1):
                    yield j0, j1
            return
        lbk, koff = spec.block_k, spec.layout_k_off
        qb0 = (i0 + spec.layout_q_off) // spec.block_q
        qb1 = (i1 - 1 + spec.layout_q_off) // spec.block_q + 1
        kb0, kb1 = (lo + koff) // lbk, (hi - 1 + koff) // lbk + 1
        visible = spec.host.layout[:, :, qb0:qb1, kb0:kb1].flatten(0, 2).any(0).tolist()
        runs: list[list[int]] = []
        for n, ok in enumerate(visible):
            if ok:
                b0, b1 = max(lo, (kb0 + n) * lbk - koff), min(hi, (kb0 + n + 1) * lbk - koff)
                if runs and runs[-1][1] == b0:
                    runs[-1][1] = b1
                else:
                    runs.append([b0, b1])
        for r0, r1 in runs:
            for j0 in range(r0, r1, self.block_k):
                yield j0, min(j0 + self.block_k, r1)

    def _layout_parts(self, inp: AttentionInputs):
        """``[(b, h, kv_h, sub_inputs)]``: one sub-problem per batch row and head that skip different keys.

        Batch rows are split when the block layout or the padded lengths differ between them, heads
        when the layout does; each part then skips exactly its own hidden blocks. None when nothing
        differs (or with dropout, whose mask is drawn per tile of the whole problem).
        """
        spec = inp.spec
        if inp.dropout_p > 0 or inp.B * inp.Hq == 0:
            return None
        Bl, Hl = spec.layout.shape[:2] if spec.layout is not None else (1, 1)
        if spec.host.kv_seqlens is not None and len(set(spec.host.kv_seqlens)) > 1:
            Bl = inp.B
        if Bl * Hl == 1:
            return None
        parts = []
        for b in range(Bl):
            for h in range(Hl):
                bs = slice(b, b + 1) if Bl > 1 else slice(None)
                hs = slice(h, h + 1) if Hl > 1 else slice(None)
                hk = slice(h // inp.groups, h // inp.groups + 1) if Hl > 1 else slice(None)
                parts.append((bs, hs, hk, _sub_inputs(inp, bs, hs, hk)))
        return parts

    def _tile(self, inp, qs, i0, i1, kt: KeyTile, dtype, nonfinite: bool = False):
        """``(s, qs, k, v, visible)`` of one tile: scores ``[B, Hkv, G·bq, bk]`` plus bias, the operands used,
        and, when ``nonfinite`` (k or v holds NaN or inf), which scores the bias leaves visible (bool,
        broadcastable to ``s``; None when all are or when k and v are finite).

        ``qs``: scaled queries ``[B, Hkv, G·bq, D]``. On masked tiles, queries that see no key of the
        tile and keys that no query of it sees are zeroed, so that garbage (NaN in an uninitialized
        KV cache or packed padding) reaches neither the output nor the gradients; hidden scores are
        set to -inf with a mask, not by adding -inf, when k or v holds a non-finite value, so a NaN
        key hidden from only some rows of the tile (a causal diagonal) stays out of theirs.
        """
        if len(kt.ranges) > 1:  # gathered unmasked blocks: no bias
            k = torch.cat([inp.k[:, :, a:b] for a, b in kt.ranges], 2).to(dtype)
            v = torch.cat([inp.v[:, :, a:b] for a, b in kt.ranges], 2).to(dtype)
            return qs @ k.transpose(-1, -2), qs, k, v, None
        (j0, j1), full = kt.ranges[0], kt.full
        k = inp.k[:, :, j0:j1].to(dtype)
        v = inp.v[:, :, j0:j1].to(dtype)
        tb = tile_bias(inp.spec, i0, i1, j0, j1, dtype, inp.device, masks=not full)
        seen = None
        if tb is not None:
            tb = group_heads(tb, inp.Hkv)  # [B|1, Hkv|1, G|1, bq, bk]
            if not full or (nonfinite and inp.spec.additive is not None):  # an additive -inf hides as a mask does
                seen = ~torch.isneginf(tb)
            if not full:
                keys = seen.any(-2).any(2)[..., None]  # [B|1, Hkv|1, bk, 1]
                rows = seen.any(-1).expand(-1, -1, inp.groups, i1 - i0).reshape(*seen.shape[:2], inp.groups * (i1 - i0), 1)
                k, v, qs = torch.where(keys, k, 0.0), torch.where(keys, v, 0.0), torch.where(rows, qs, 0.0)
        s = qs @ k.transpose(-1, -2)
        if tb is None:
            return s, qs, k, v, None
        s5 = s.view(inp.B, inp.Hkv, inp.groups, i1 - i0, j1 - j0)
        s5.add_(tb)
        if seen is None or not nonfinite:
            return s, qs, k, v, None
        s5.masked_fill_(~seen, float("-inf"))
        lead = seen.shape[:2]
        seen = seen.expand(*lead, inp.groups, i1 - i0, j1 - j0).reshape(*lead, inp.groups * (i1 - i0), j1 - j0)
        return s, qs, k, v, seen

    def _queries(self, q5, i0, i1, scale, dtype):
        """Scaled queries of rows ``[i0, i1)``: contiguous ``[B, Hkv, G·bq, D]`` in ``dtype``."""
        B, Hkv, G, _, D = q5.shape
        qs = q5[:, :, :, i0:i1].to(dtype) * scale
        return qs.reshape(B, Hkv, G * (i1 - i0), D)

    def fwd(self, inp: AttentionInputs):
        parts = self._layout_parts(inp)
        if parts is None:
            return self._fwd(inp)
        dtype = compute_dtype(inp.dtype)
        out = torch.empty((inp.B, inp.Hq, inp.Mq, inp.Dv), dtype=inp.dtype, device=inp.device)
        lse = torch.empty((inp.B, inp.Hq, inp.Mq), dtype=dtype, device=inp.device)
        out_acc = None
        for bs, hs, _, sub in parts:
            _, _, saved = self._fwd(sub, out[bs, hs], lse[bs, hs])
            if isinstance(saved, ChunkedSaved):
                if out_acc is None:
                    out_acc = torch.empty(out.shape, dtype=dtype, device=inp.device)
                out_acc[bs, hs] = saved.out
        return out, lse, 0 if out_acc is None else ChunkedSaved(0, out_acc)

    def _fwd(self, inp: AttentionInputs, out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
        """Forward of one (sub-)problem, written into ``out``/``lse`` (views of the caller's) when given."""
        dtype = compute_dtype(inp.dtype)
        B, Hkv, G, Dv = inp.B, inp.Hkv, inp.groups, inp.Dv
        q = group_heads(inp.q, Hkv)  # [B, Hkv, G, Mq, D]
        if out is None:
            out = torch.empty((B, inp.Hq, inp.Mq, Dv), dtype=inp.dtype, device=inp.device)
            lse = torch.empty((B, inp.Hq, inp.Mq), dtype=dtype, device=inp.device)
        out = out.view(B, Hkv, G, inp.Mq, Dv).zero_()  # rows that see no key stay 0
        lse = lse.view(B, Hkv, G, inp.Mq).fill_(float("-inf"))
        seed = new_seed() if inp.dropout_p > 0 else 0
        # Low-precision outputs: keep the unrounded output for the backward's rowsum(dout * out).
        exact = inp.requires_grad and dtype != inp.dtype
        out_acc = torch.zeros((B, Hkv, G, inp.Mq, Dv), dtype=dtype, device=inp.device) if exact else None
        nonfinite = may_hold_nonfinite(inp.k) or may_hold_nonfinite(inp.v)
        for i0, i1, keys in self._tiles(inp):
            if not keys:
                continue
            bq = i1 - i0
            qs = self._queries(q, i0, i1, inp.scale, dtype)  # [B, Hkv, G·bq, D]
            m = torch.full(qs.shape[:-1], float("-inf"), dtype=dtype, device=inp.device)  # running max
            l = torch.zeros_like(m)  # running sum of exp
            acc = torch.zeros((B, Hkv, G * bq, Dv), dtype=dtype, device=inp.device)
            for kt in keys:
                s, _, _, v, seen = self._tile(inp, qs, i0, i1, kt, dtype, nonfinite)  # s: [B, Hkv, G·bq, bk]
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
                p = s.sub_(m_safe[..., None]).exp_()
                alpha = torch.exp(m - m_safe)
                l.mul_(alpha).add_(p.sum(-1))
                if inp.dropout_p > 0:
                    keep = dropout_keep(seed, (i0, kt.j0), (B, Hkv, G, bq, kt.width), inp.dropout_p, inp.device)
                    p.mul_(keep.to(dtype).view(p.shape))
                acc.mul_(alpha[..., None]).add_(p @ v if seen is None else visible_matmul(p, seen, v))
                m = m_new
            pos = l > 0
            safe_l = torch.where(pos, l, 1.0)
            o = (acc / safe_l[..., None]).view(B, Hkv, G, bq, Dv)
            out[:, :, :, i0:i1] = o.to(inp.dtype)
            if out_acc is not None:
                out_acc[:, :, :, i0:i1] = o
            m_safe = torch.where(torch.isneginf(m), 0.0, m)
            lse[:, :, :, i0:i1] = torch.where(pos, m_safe + torch.log(safe_l), float("-inf")).view(B, Hkv, G, bq)
        saved = seed if out_acc is None else ChunkedSaved(seed, out_acc.reshape(B, inp.Hq, inp.Mq, Dv))
        return out.reshape(B, inp.Hq, inp.Mq, Dv), lse.reshape(B, inp.Hq, inp.Mq), saved

    def bwd(self, inp, out, lse, ctx, dout, dlse):
        if isinstance(ctx, ChunkedSaved):  # our own forward: the unrounded output
            ctx, out = ctx.seed, ctx.out
        add = inp.additive
        need_dadd = add is not None and add.requires_grad
        parts = self._layout_parts(inp)
        if parts is None:
            dq, dk, dv, dadd = self._bwd(inp, out, lse, ctx, dout, dlse, need_dadd)
        else:
            dtype = compute_dtype(inp.dtype)
            dq = torch.zeros(inp.q.shape, dtype=dtype, device=inp.device)
            dk = torch.zeros(inp.k.shape, dtype=dtype, device=inp.device)
            dv = torch.zeros(inp.v.shape, dtype=dtype, device=inp.device)
            dadd = torch.zeros(add.shape, dtype=dtype, device=inp.device) if need_dadd else None
            for bs, hs, hk, sub in parts:
                sub_dlse = None if dlse is None else dlse[bs, hs]
                gq, gk, gv, ga = self._bwd(sub, out[bs, hs], lse[bs, hs], ctx, dout[bs, hs], sub_dlse, need_dadd)
                dq[bs, hs] = gq
                dk[bs, hk] += gk
                dv[bs, hk] += gv
                if dadd is not None:
                    dadd[_lead(add, bs, hs)] += ga
        return (
            dq.to(inp.q.dtype), dk.to(inp.k.dtype), dv.to(inp.v.dtype),
            None if dadd is None else dadd.to(add.dtype),
        )

    def _bwd(self, inp, out, lse, ctx, dout, dlse, need_dadd: bool):
        """Gradients in the compute dtype: ``(dq, dk, dv, dadditive or None)``."""
        dtype = compute_dtype(inp.dtype)
        B, Hkv, G = inp.B, inp.Hkv, inp.groups
        delta = (dout.to(dtype) * out.to(dtype)).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(dtype)
        delta = group_heads(delta, Hkv)  # [B, Hkv, G, Mq]
        lse = group_heads(lse.to(dtype), Hkv)
        lse = torch.where(torch.isneginf(lse), 0.0, lse)
        q = group_heads(inp.q, Hkv)
        do = group_heads(dout, Hkv)
        dq = torch.zeros(q.shape, dtype=dtype, device=inp.device)
        dk = torch.zeros(inp.k.shape, dtype=dtype, device=inp.device)
        dv = torch.zeros(inp.v.shape, dtype=dtype, device=inp.device)
        add = inp.additive
        dadd = torch.zeros(add.shape, dtype=dtype, device=inp.device) if need_dadd else None
        nonfinite = may_hold_nonfinite(inp.k) or may_hold_nonfinite(inp.v)
        for i0, i1, keys in self._tiles(inp):
            if not keys:
                continue
            bq = i1 - i0
            qs = self._queries(q, i0, i1, inp.scale, dtype)  # [B, Hkv, G·bq, D], scaled
            dot = do[:, :, :, i0:i1].to(dtype).reshape(B, Hkv, G * bq, inp.Dv)
            lse_t = lse[:, :, :, i0:i1].reshape(B, Hkv, G * bq, 1)
            delta_t = delta[:, :, :, i0:i1].reshape(B, Hkv, G * bq, 1)
            dq_t = torch.zeros_like(qs)
            for kt in keys:
                s, qt, k, v, seen = self._tile(inp, qs, i0, i1, kt, dtype, nonfinite)
                if seen is not None:  # a non-finite key or value hidden from some rows: 0 · NaN stays out of dq
                    k, v = torch.where(torch.isfinite(k), k, 0.0), torch.where(torch.isfinite(v), v, 0.0)
                p = s.sub_(lse_t).exp_()  # [B, Hkv, G·bq, bk]
                dp = dot @ v.transpose(-1, -2)
                if inp.dropout_p > 0:
                    keep = dropout_keep(ctx, (i0, kt.j0), (B, Hkv, G, bq, kt.width), inp.dropout_p, inp.device)
                    keep = keep.to(dtype).view(p.shape)
                    _add_to_keys(dv, kt, (p * keep).transpose(-1, -2) @ dot)
                    dp.mul_(keep)
                else:
                    _add_to_keys(dv, kt, p.transpose(-1, -2) @ dot)
                ds = dp.sub_(delta_t).mul_(p)  # dS of the scaled scores
                dq_t += ds @ k
                _add_to_keys(dk, kt, ds.transpose(-1, -2) @ qt)
                if dadd is not None:  # additive terms: never gathered, one range
                    (j0, j1), = kt.ranges
                    ds_h = ds.view(B, inp.Hq, bq, j1 - j0)
                    rows = slice(i0, i1) if add.shape[2] != 1 else slice(None)
                    cols = slice(j0, j1) if add.shape[3] != 1 else slice(None)
                    dadd[:, :, rows, cols] += reduce_to(ds_h, add.shape)
            dq[:, :, :, i0:i1] = (dq_t * inp.scale).view(B, Hkv, G, bq, inp.D)
        return dq.reshape(inp.q.shape), dk, dv, dadd


def _add_to_keys(dst: torch.Tensor, kt: KeyTile, grad: torch.Tensor) -> None:
    """``dst[:, :, keys of kt] += grad`` for ``grad: [B, Hkv, kt.width, ...]``."""
    if len(kt.ranges) == 1:
        dst[:, :, kt.ranges[0][0] : kt.ranges[0][1]] += grad
        return
    for (j0, j1), part in zip(kt.ranges, grad.split([j1 - j0 for j0, j1 in kt.ranges], dim=2)):
        dst[:, :, j0:j1] += part


def _lead(t: torch.Tensor, bs: slice, hs: slice) -> tuple[slice, slice]:
    """Index of a ``[B or 1, H or 1, ...]`` tensor's part for batch rows ``bs`` and heads ``hs``."""
    return (bs if t.shape[0] > 1 else slice(None), hs if t.shape[1] > 1 else slice(None))


def _sub_inputs(inp: AttentionInputs, bs: slice, hs: slice, hk: slice) -> AttentionInputs:
    """The inputs restricted to batch rows ``bs``, query heads ``hs`` and their KV heads ``hk``."""
    spec, host = inp.spec, inp.spec.host
    q = inp.q[bs, hs]
    kv_seqlens, host_kv = spec.kv_seqlens, host.kv_seqlens
    if kv_seqlens is not None and bs != slice(None):
        kv_seqlens, host_kv = kv_seqlens[bs], (None if host_kv is None else host_kv[bs])

    def part(t):
        return None if t is None else t[_lead(t, bs, hs)]

    sub = replace(
        spec, B=q.shape[0], H=q.shape[1], layout=part(spec.layout), kv_seqlens=kv_seqlens, additive=part(spec.additive),
        alibi_slopes=part(spec.alibi_slopes), host=replace(host, layout_tensor=part(host.layout), kv_seqlens=host_kv),
    )
    return replace(inp, q=q, k=inp.k[bs, hk], v=inp.v[bs, hk], spec=sub)
