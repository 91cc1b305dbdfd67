"""The ``cutlass`` operator: PyTorch's CUTLASS memory-efficient kernels (``aten._efficient_attention_*``).

Causal masks map to the kernel's ``custom_mask_type`` (top-left or bottom-right in each sequence);
packed segments and padded keys to ``cu_seqlens`` (padded keys gathered out); an additive bias is
handed over as a ``[B, H, Mq, Mk]`` view whose broadcast dims keep stride 0; the kernel's alignment
rule (strides a multiple of 8 elements) is met here, with a padded copy only when the user's tensor
breaks it. The kernel also returns the bias gradient. It needs as many key heads as query heads, so
GQA repeats K/V heads (and sums their gradients back).
"""

from __future__ import annotations

import torch

from ..inputs import AttentionInputs
from .common import reduce_to
from .vendor_mapping import (
    VendorCtx,
    VendorOperator,
    aligned_bias,
    aten_entry,
    cu_seqlens,
    cutlass_mask_type,
    lse_from_kernel,
    lse_to_kernel,
    pack_keys,
    pack_queries,
    unpack_keys,
    unpack_queries,
)

LSE_ALIGN = 32  # the kernel pads its lse rows to a multiple of this (and reads that far in backward)


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
        plan = self.plan(inp)
        if plan.reason:
            return [plan.reason]
        reasons = []
        if cutlass_mask_type(plan) is None:
            reasons.append("supports only causal bands (top-left or bottom-right in every sequence), not this band")
        if inp.additive is not None and plan.varlen:
            reasons.append("takes an additive bias only without segments or padded keys")
        return reasons

    # ----------------------------------------------------------------------------- helpers
    def _args(self, inp: AttentionInputs, plan):
        k, v = inp.k, inp.v
        if inp.groups > 1:  # the kernel needs one key head per query head
            k = k.repeat_interleave(inp.groups, dim=1)
            v = v.repeat_interleave(inp.groups, dim=1)
        q, k, v = pack_queries(inp.q, plan), pack_keys(k, inp.spec, plan), pack_keys(v, inp.spec, plan)
        bias = None
        if inp.additive is not None:
            bias = aligned_bias(inp.additive.detach(), (inp.B, inp.Hq, inp.Mq, inp.Mk), inp.dtype)
        if plan.varlen:
            cu_q, cu_k = cu_seqlens(inp.spec, plan, inp.device)
            return q[None], k[None], v[None], bias, cu_q, cu_k, plan.max_q, plan.max_k
        return q, k, v, bias, None, None, None, None

    def _unpack_out(self, x, plan, B):
        return unpack_queries(x[0] if plan.varlen else x, plan, B)

    # ----------------------------------------------------------------------------- compute
    def fwd(self, inp: AttentionInputs):
        plan = self.plan(inp)
        q, k, v, bias, cu_q, cu_k, max_q, max_k = self._args(inp, plan)
        out, lse_raw, seed, offset, *_ = aten_entry("_efficient_attention_forward")(
            q, k, v, bias, cu_q, cu_k, max_q, max_k, inp.dropout_p, cutlass_mask_type(plan), True, scale=inp.scale,
        )
        layout = "seq_h_m" if plan.varlen else "bhm"
        lse = lse_from_kernel(lse_raw, plan, inp.B, inp.Hq, inp.Mq, layout)
        out = self.fix_empty_rows(inp, plan, self._unpack_out(out, plan, inp.B), lse)
        return out, lse, VendorCtx(self.NAME, lse_raw, layout, (seed, offset))

    def bwd(self, inp, out, lse, ctx, dout, dlse):
        plan = self.plan(inp)
        q, k, v, bias, cu_q, cu_k, max_q, max_k = self._args(inp, plan)
        if isinstance(ctx, VendorCtx) and ctx.op == self.NAME:
            lse_raw, (seed, offset) = ctx.lse_raw, ctx.rng
        else:
            lse_raw = lse_to_kernel(lse, plan, "seq_h_m" if plan.varlen else "bhm", pad=LSE_ALIGN)
            seed = offset = torch.empty((), dtype=torch.int64)
        o, do = pack_queries(out, plan), pack_queries(dout, plan)
        if plan.varlen:
            o, do = o[None], do[None]
        add = inp.additive
        bias_grad = add is not None and add.requires_grad
        dq, dk, dv, dbias = aten_entry("_efficient_attention_backward")(
            do, q, k, v, bias, o, cu_q, cu_k, max_q if plan.varlen else inp.Mq, max_k if plan.varlen else inp.Mk,
            lse_raw, inp.dropout_p, seed, offset, cutlass_mask_type(plan), bias_grad, scale=inp.scale,
        )
        dq = self._unpack_out(dq, plan, inp.B)
        if plan.varlen:
            dk, dv = dk[0], dv[0]
        dk = unpack_keys(dk, inp.spec, plan, inp.B, inp.Mk)
        dv = unpack_keys(dv, inp.spec, plan, inp.B, inp.Mk)
        if inp.groups > 1:
            dk = dk.reshape(inp.B, inp.Hkv, inp.groups, inp.Mk, inp.D).sum(2)
            dv = dv.reshape(inp.B, inp.Hkv, inp.groups, inp.Mk, inp.Dv).sum(2)
        dadd = reduce_to(dbias, add.shape).to(add.dtype) if bias_grad else None
        return dq, dk, dv, dadd
