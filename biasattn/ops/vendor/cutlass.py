"""The ``cutlass`` operator: PyTorch's CUTLASS memory-efficient kernels (``aten._efficient_attention_*``).

Causal masks map to the kernel's ``custom_mask_type`` (top-left or bottom-right in each sequence);
packed segments and padded keys to ``cu_seqlens`` (padded keys gathered out); an additive bias is
handed over as a ``[B, H, Mq, Mk]`` view whose broadcast dims keep stride 0; the kernel's alignment
rule (strides a multiple of 8 elements) is met here, with a padded copy only when the user's tensor
breaks it. The kernel also returns the bias gradient. It needs as many key heads as query heads, so
GQA repeats K/V heads (and sums their gradients back); head dims are zero-padded to a multiple of 8.

Measured on the H200 (torch 2.11), and refused here: the bottom-right causal mask gives wrong rows
when a sequence has more queries than keys; dropout with ``cu_seqlens`` uses different masks in the
forward and the backward. Also measured and worked around: with a causal mask the bias gradient is
left unwritten where the mask hides keys (it is zeroed here; a bias broadcast over heads or queries is
also expanded for the backward); rows whose additive bias is all ``-inf`` get lse 0 from the kernel
(set to ``-inf`` here).
"""

from __future__ import annotations

import torch

from ...inputs import AttentionInputs
from ..common import reduce_to
from .base import VendorCtx, VendorOperator, aten_entry
from .layout import cu_seqlens, pack_keys, pack_queries, pad_head_dim, unpack_keys, unpack_queries
from .masks import CAUSAL_BOTTOM_RIGHT, CAUSAL_TOP_LEFT, NO_MASK, aligned_bias, cutlass_mask_type


class CutlassOperator(VendorOperator):
    """Memory-efficient attention through PyTorch: additive bias (+ gradient), causal, varlen, padded keys, dropout."""

    NAME = "cutlass"
    DESCRIPTION = "PyTorch's CUTLASS memory-efficient kernels: additive bias (+ gradient), causal, varlen, padded keys, dropout"
    MIN_CAPABILITY = (5, 0)
    DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
    MAX_HEAD_DIM = 256
    FEATURES = frozenset({"segments", "padded_keys", "band", "additive"})
    SUPPORTS_DROPOUT = True
    SUPPORTS_BACKWARD = True
    SUPPORTS_BIAS_GRAD = True
    SUPPORTS_GQA = True
    ENTRY_POINTS = ("_efficient_attention_forward", "_efficient_attention_backward")

    def extra_reasons(self, inp: AttentionInputs, *, backward: bool) -> list[str]:
        layout = self.layout(inp)
        if layout.reason:
            return [layout.reason]
        reasons = []
        mask_type = cutlass_mask_type(layout)
        if mask_type is None:
            reasons.append("supports only causal bands (top-left or bottom-right in every sequence), not this band")
        elif mask_type == CAUSAL_BOTTOM_RIGHT and any(s.Lq > s.Lk for s in layout.seqs):
            reasons.append("gives wrong rows with a bottom-right causal mask when a sequence has more queries than keys")
        if layout.varlen and layout.keyless:
            reasons.append("gives wrong query gradients in other sequences when a sequence has queries but no keys")
        if inp.additive is not None and layout.varlen:
            reasons.append("takes an additive bias only without segments or padded keys")
        if inp.dropout_p > 0 and layout.varlen:
            reasons.append("does not replay its dropout mask in the backward with segments or padded keys")
        return reasons

    # ----------------------------------------------------------------------------- helpers
    def _args(self, inp: AttentionInputs, layout, bias_grad: bool = False):
        k, v = inp.k, inp.v
        if inp.groups > 1:  # the kernel needs one key head per query head
            k = k.repeat_interleave(inp.groups, dim=1)
            v = v.repeat_interleave(inp.groups, dim=1)
        q = pad_head_dim(pack_queries(inp.q, layout))
        k, v = pad_head_dim(pack_keys(k, inp.spec, layout)), pad_head_dim(pack_keys(v, inp.spec, layout))
        bias = None
        if inp.additive is not None:
            add = inp.additive.detach()
            if bias_grad and (add.shape[1] < inp.Hq or add.shape[2] < inp.Mq):
                add = add.expand(add.shape[0], inp.Hq, inp.Mq, add.shape[3]).contiguous()
            bias = aligned_bias(add, (inp.B, inp.Hq, inp.Mq, inp.Mk), inp.dtype)
        if layout.varlen:
            cu_q, cu_k = cu_seqlens(inp.spec, layout, inp.device)
            return q[None], k[None], v[None], bias, cu_q, cu_k, layout.max_q, layout.max_k
        return q, k, v, bias, None, None, None, None

    def _unpack_out(self, x, layout, B, d):
        return unpack_queries((x[0] if layout.varlen else x)[..., :d], layout, B)

    def _empty_additive_rows(self, inp: AttentionInputs, lse: torch.Tensor) -> torch.Tensor:
        """lse ``-inf`` on rows whose additive bias is ``-inf`` everywhere (the kernel writes 0 there)."""
        add = inp.additive
        if add is None:
            return lse
        hidden = torch.isneginf(add.detach()).all(-1)  # [B|1, H|1, Mq|1]
        return torch.where(hidden, float("-inf"), lse)

    # ----------------------------------------------------------------------------- compute
    def kernel_fwd(self, inp: AttentionInputs, layout):
        q, k, v, bias, cu_q, cu_k, max_q, max_k = self._args(inp, layout)
        out, lse_raw, seed, offset, *_ = aten_entry("_efficient_attention_forward")(
            q, k, v, bias, cu_q, cu_k, max_q, max_k, inp.dropout_p, cutlass_mask_type(layout), True, scale=inp.scale,
        )
        lse_fmt = "seq_h_m" if layout.varlen else "bhm"
        lse = self._empty_additive_rows(inp, self.kernel_lse(lse_raw, inp, layout, lse_fmt))
        out = self.fix_empty_rows(inp, layout, self._unpack_out(out, layout, inp.B, inp.Dv), lse)
        return out, lse, VendorCtx(self.NAME, lse_raw, lse_fmt, (seed, offset))

    def kernel_bwd(self, inp, layout, out, lse, ctx, dout):
        add = inp.additive
        bias_grad = add is not None and add.requires_grad
        q, k, v, bias, cu_q, cu_k, max_q, max_k = self._args(inp, layout, bias_grad)
        if not (isinstance(ctx, VendorCtx) and ctx.op == self.NAME):
            # another operator ran the forward: replay ours for the kernel's own lse (rebuilding it
            # from ours gave wrong gradients with cu_seqlens)
            with torch.no_grad():
                out, _, ctx = self.kernel_fwd(inp, layout)
        lse_raw, (seed, offset) = ctx.lse_raw, ctx.rng
        o, do = pad_head_dim(pack_queries(out, layout)), pad_head_dim(pack_queries(dout, layout))
        if layout.varlen:
            o, do = o[None], do[None]
        dq, dk, dv, dbias = aten_entry("_efficient_attention_backward")(
            do, q, k, v, bias, o, cu_q, cu_k, max_q if layout.varlen else inp.Mq, max_k if layout.varlen else inp.Mk,
            lse_raw, inp.dropout_p, seed, offset, cutlass_mask_type(layout), bias_grad, scale=inp.scale,
        )
        dq = self._unpack_out(dq, layout, inp.B, inp.D)
        if layout.varlen:
            dk, dv = dk[0], dv[0]
        dk = unpack_keys(dk[..., : inp.D], inp.spec, layout, inp.B, inp.Mk)
        dv = unpack_keys(dv[..., : inp.Dv], inp.spec, layout, inp.B, inp.Mk)
        if inp.groups > 1:
            dk = dk.reshape(inp.B, inp.Hkv, inp.groups, inp.Mk, inp.D).sum(2)
            dv = dv.reshape(inp.B, inp.Hkv, inp.groups, inp.Mk, inp.Dv).sum(2)
        dadd = None
        if bias_grad:
            mask_type = cutlass_mask_type(layout)
            if mask_type != NO_MASK:  # the kernel leaves the gradient unwritten where the mask hides keys
                shift = 0 if mask_type == CAUSAL_TOP_LEFT else inp.Mk - inp.Mq
                i = torch.arange(inp.Mq, device=inp.device)[:, None]
                j = torch.arange(inp.Mk, device=inp.device)[None, :]
                dbias = dbias.masked_fill(j > i + shift, 0)
            dadd = reduce_to(dbias, add.shape).to(add.dtype)
        return dq, dk, dv, dadd
