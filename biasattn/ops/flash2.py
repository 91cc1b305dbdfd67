"""The ``flash2`` operator: PyTorch's FlashAttention-2 kernels (``aten._flash_attention_forward``/``_backward``).

Causal masks and windows become FlashAttention's ``window_size_left/right`` (aligned bottom-right
in each sequence); packed segments and padded keys become ``cu_seqlens`` (padded keys are gathered
out, so forward and backward agree); ALiBi slopes pass through (forward only: the backward entry
point takes none). GQA is native. Head dims that are not a multiple of 8 are zero-padded here.
Rows that see no key come back as 0 with lse ``-inf`` (the kernel writes ``+inf``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..inputs import AttentionInputs
from .vendor_mapping import (
    VendorCtx,
    VendorOperator,
    alibi_matches,
    aten_entry,
    cu_seqlens,
    flash_window,
    lse_from_kernel,
    lse_layout,
    lse_to_kernel,
    pack_keys,
    pack_queries,
    unpack_keys,
    unpack_queries,
)


def _pad8(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    return x if d % 8 == 0 else F.pad(x, (0, 8 - d % 8))


class Flash2Operator(VendorOperator):
    """FlashAttention-2 through PyTorch: causal, windows, varlen, padded keys, ALiBi (forward), GQA, dropout."""

    NAME = "flash2"
    DESCRIPTION = "PyTorch's FlashAttention-2 kernels: causal, sliding window, varlen, padded keys, GQA, dropout"
    MIN_CAPABILITY = (8, 0)
    DTYPES = frozenset({torch.float16, torch.bfloat16})
    MAX_HEAD_DIM = 256
    REQUIRES_EQUAL_V_DIM = True
    FEATURES = frozenset({"segments", "padded_keys", "band", "alibi"})
    SUPPORTS_DROPOUT = True
    SUPPORTS_BACKWARD = True
    SUPPORTS_GQA = True
    ENTRY_POINTS = ("_flash_attention_forward", "_flash_attention_backward")

    def environment_reasons(self, device=None) -> list[str]:
        reasons = super().environment_reasons(device)
        probe = getattr(torch.backends.cuda, "is_flash_attention_available", None)
        if not reasons and probe is not None and torch.cuda.is_available() and not probe():
            reasons.append(f"torch {torch.__version__} was built without FlashAttention kernels")
        return reasons

    def extra_reasons(self, inp: AttentionInputs, *, backward: bool) -> list[str]:
        spec = inp.spec
        plan = self.plan(inp)
        if plan.reason:
            return [plan.reason]
        reasons = []
        if flash_window(plan) is None:
            reasons.append("cannot express the band as FlashAttention's window (aligned bottom-right in every sequence)")
        if spec.alibi_slopes is not None:
            if backward:
                reasons.append("takes no ALiBi slopes in its backward entry point and gradients are required")
            if not alibi_matches(plan):
                reasons.append("ALiBi is not aligned bottom-right in every sequence, as FlashAttention's is")
        return reasons

    # ----------------------------------------------------------------------------- helpers
    def _window(self, inp: AttentionInputs, plan) -> tuple[int, int]:
        left, right = flash_window(plan)
        if inp.spec.alibi_slopes is not None and left < 0 and right == 0:
            left = max(plan.max_k - 1, 0)  # same keys, but keeps the kernel off its causal ALiBi form (shifted lse)
        return left, right

    def _args(self, inp: AttentionInputs, plan):
        q = _pad8(pack_queries(inp.q, plan))
        k = _pad8(pack_keys(inp.k, inp.spec, plan))
        v = _pad8(pack_keys(inp.v, inp.spec, plan))
        if plan.varlen:
            cu_q, cu_k = cu_seqlens(inp.spec, plan, inp.device)
            return q, k, v, cu_q, cu_k, plan.max_q, plan.max_k
        return q, k, v, None, None, inp.Mq, inp.Mk

    # ----------------------------------------------------------------------------- compute
    def fwd(self, inp: AttentionInputs):
        plan = self.plan(inp)
        left, right = self._window(inp, plan)
        q, k, v, cu_q, cu_k, max_q, max_k = self._args(inp, plan)
        slopes = inp.spec.alibi_slopes
        if slopes is not None:
            slopes = (slopes[0] if slopes.shape[0] == 1 else slopes).float().contiguous()
        out, lse_raw, rng, unused, _ = aten_entry("_flash_attention_forward")(
            q, k, v, cu_q, cu_k, max_q, max_k, inp.dropout_p, False, False,
            scale=inp.scale, window_size_left=left, window_size_right=right, alibi_slopes=slopes,
        )
        out = unpack_queries(out[..., : inp.Dv], plan, inp.B)
        layout = lse_layout(lse_raw, plan, inp.B, inp.Hq, inp.Mq)
        if plan.varlen:
            self._varlen_lse_layout = layout
        lse = lse_from_kernel(lse_raw, plan, inp.B, inp.Hq, inp.Mq, layout)
        out = self.fix_empty_rows(inp, plan, out, lse)
        return out, lse, VendorCtx(self.NAME, lse_raw, layout, (rng, unused))

    def bwd(self, inp, out, lse, ctx, dout, dlse):
        plan = self.plan(inp)
        left, right = self._window(inp, plan)
        q, k, v, cu_q, cu_k, max_q, max_k = self._args(inp, plan)
        own = isinstance(ctx, VendorCtx) and ctx.op == self.NAME
        if own:
            lse_raw, (rng, unused) = ctx.lse_raw, ctx.rng
        else:
            layout = getattr(self, "_varlen_lse_layout", "h_total") if plan.varlen else "bhm"
            lse_raw = lse_to_kernel(lse, plan, layout)
            rng = unused = torch.empty((), dtype=torch.int64, device=inp.device)
        o = _pad8(pack_queries(out, plan))
        do = _pad8(pack_queries(dout, plan))
        dq, dk, dv = aten_entry("_flash_attention_backward")(
            do.contiguous() if do.stride(-1) != 1 else do, q, k, v, o, lse_raw, cu_q, cu_k, max_q, max_k,
            inp.dropout_p, False, rng, unused, scale=inp.scale, window_size_left=left, window_size_right=right,
        )
        dq = unpack_queries(dq[..., : inp.D], plan, inp.B)
        dk = unpack_keys(dk[..., : inp.D], inp.spec, plan, inp.B, inp.Mk)
        dv = unpack_keys(dv[..., : inp.Dv], inp.spec, plan, inp.B, inp.Mk)
        return dq, dk, dv, None
