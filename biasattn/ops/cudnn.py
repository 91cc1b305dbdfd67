"""The ``cudnn`` operator: PyTorch's cuDNN attention (``aten._cudnn_attention_forward``/``_backward``).

Older torch builds only have ``aten._scaled_dot_product_cudnn_attention`` (no ragged batches); the
operator uses whichever the installed torch has. cuDNN's causal mask is top-left, so it is used
only where top-left and bottom-right agree (``Lq == Lk`` in every sequence). Packed segments and
padded keys use the ragged (``cum_seq``) entry point on contiguous ``[total, H, D]`` copies. An
additive bias must not require grad (cuDNN computes no bias gradient), and with a bias the backward
is refused at sequence lengths ``% 128 == 64``, where cuDNN's ``grad_q`` has returned NaN (PyTorch
issue 196678).
"""

from __future__ import annotations

import torch

from ..inputs import AttentionInputs
from .vendor_mapping import (
    VendorCtx,
    VendorOperator,
    aligned_bias,
    aten_entry,
    cu_seqlens,
    cudnn_causal,
    lse_from_kernel,
    lse_layout,
    lse_to_kernel,
    pack_keys,
    pack_queries,
    unpack_keys,
    unpack_queries,
)

RAGGED = ("_cudnn_attention_forward", "_cudnn_attention_backward")
DENSE = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")


def _entry_points() -> tuple[str, str] | None:
    for names in (RAGGED, DENSE):
        if all(aten_entry(n) is not None for n in names):
            return names
    return None


class CudnnOperator(VendorOperator):
    """cuDNN attention through PyTorch: causal (Lq == Lk), additive bias (no gradient), varlen, padded keys, dropout."""

    NAME = "cudnn"
    DESCRIPTION = "PyTorch's cuDNN attention: causal, additive bias (no bias gradient), varlen, padded keys, dropout"
    MIN_CAPABILITY = (8, 0)
    DTYPES = frozenset({torch.float16, torch.bfloat16})
    MIN_HEAD_DIM = 8
    MAX_HEAD_DIM = 128
    REQUIRES_EQUAL_V_DIM = True
    FEATURES = frozenset({"segments", "padded_keys", "band", "additive"})
    SUPPORTS_DROPOUT = True
    SUPPORTS_BACKWARD = True
    ENTRY_POINTS = RAGGED

    def environment_reasons(self, device=None) -> list[str]:
        if _entry_points() is None:
            names = ", ".join(f"torch.ops.aten.{n}" for n in RAGGED + DENSE)
            return [f"needs cuDNN attention entry points ({names}), which torch {torch.__version__} lacks"]
        version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if torch.cuda.is_available() and (version is None or version < 90000):
            return [f"needs cuDNN 9 or newer, torch {torch.__version__} has {version or 'no cuDNN'}"]
        return []

    def extra_reasons(self, inp: AttentionInputs, *, backward: bool) -> list[str]:
        plan = self.plan(inp)
        if plan.reason:
            return [plan.reason]
        reasons = []
        if inp.D % 8:
            reasons.append(f"needs a head dim that is a multiple of 8, got D={inp.D}")
        causal = cudnn_causal(plan)
        if causal is None:
            reasons.append("supports only a top-left causal band, not this band")
        elif causal and any(s.Lq != s.Lk for s in plan.seqs):
            reasons.append("uses its top-left causal mask only where Lq == Lk in every sequence")
        if plan.varlen:
            if _entry_points() != RAGGED:
                reasons.append(f"ragged batches need torch.ops.aten.{RAGGED[0]}, which torch {torch.__version__} lacks")
            if inp.additive is not None:
                reasons.append("takes an additive bias only without segments or padded keys")
        if backward and inp.additive is not None and (inp.Mq % 128 == 64 or inp.Mk % 128 == 64):
            reasons.append(
                f"gives NaN grad_q with a bias when a sequence length % 128 == 64 "
                f"(Mq={inp.Mq}, Mk={inp.Mk}; PyTorch issue 196678)"
            )
        return reasons

    # ----------------------------------------------------------------------------- helpers
    def _args(self, inp: AttentionInputs, plan):
        bias = None
        if inp.additive is not None:
            bias = aligned_bias(inp.additive.detach(), (inp.B, inp.Hq, inp.Mq, inp.Mk), inp.dtype)
        if not plan.varlen:
            return inp.q, inp.k, inp.v, bias, None, None, inp.Mq, inp.Mk
        cu_q, cu_k = cu_seqlens(inp.spec, plan, inp.device)
        q = pack_queries(inp.q, plan).contiguous()
        k = pack_keys(inp.k, inp.spec, plan).contiguous()
        v = pack_keys(inp.v, inp.spec, plan).contiguous()
        return q, k, v, bias, cu_q, cu_k, plan.max_q, plan.max_k

    # ----------------------------------------------------------------------------- compute
    def fwd(self, inp: AttentionInputs):
        plan = self.plan(inp)
        q, k, v, bias, cu_q, cu_k, max_q, max_k = self._args(inp, plan)
        causal = bool(cudnn_causal(plan))
        if _entry_points() == RAGGED:
            res = aten_entry(RAGGED[0])(
                q, k, v, bias, cu_q, cu_k, max_q, max_k, True, inp.dropout_p, causal, False, scale=inp.scale
            )
        else:
            res = aten_entry(DENSE[0])(q, k, v, bias, True, inp.dropout_p, causal, False, scale=inp.scale)
        out, lse_raw, seed, offset = res[0], res[1], res[6], res[7]
        layout = lse_layout(lse_raw, plan, inp.B, inp.Hq, inp.Mq)
        if plan.varlen:
            self._varlen_lse_layout = layout
            out = unpack_queries(out, plan, inp.B)
        lse = lse_from_kernel(lse_raw, plan, inp.B, inp.Hq, inp.Mq, layout)
        out = self.fix_empty_rows(inp, plan, out, lse)
        return out, lse, VendorCtx(self.NAME, lse_raw, layout, (seed, offset))

    def bwd(self, inp, out, lse, ctx, dout, dlse):
        plan = self.plan(inp)
        q, k, v, bias, cu_q, cu_k, max_q, max_k = self._args(inp, plan)
        if isinstance(ctx, VendorCtx) and ctx.op == self.NAME:
            lse_raw, (seed, offset) = ctx.lse_raw, ctx.rng
        else:
            layout = getattr(self, "_varlen_lse_layout", "total_h1") if plan.varlen else "bhm1"
            lse_raw = lse_to_kernel(lse, plan, layout)
            seed = offset = torch.empty((), dtype=torch.int64, device=inp.device)
        if plan.varlen:
            out, dout = pack_queries(out, plan).contiguous(), pack_queries(dout, plan).contiguous()
        elif dout.stride() != out.stride():  # cuDNN wants grad_out laid out like out
            dout = torch.empty_strided(out.shape, out.stride(), dtype=dout.dtype, device=dout.device).copy_(dout)
        causal = bool(cudnn_causal(plan))
        name = RAGGED[1] if _entry_points() == RAGGED else DENSE[1]
        dq, dk, dv = aten_entry(name)(
            dout, q, k, v, out, lse_raw, seed, offset, bias, cu_q, cu_k, max_q, max_k, inp.dropout_p, causal, scale=inp.scale,
        )
        if plan.varlen:
            dq = unpack_queries(dq, plan, inp.B)
            dk = unpack_keys(dk, inp.spec, plan, inp.B, inp.Mk)
            dv = unpack_keys(dv, inp.spec, plan, inp.B, inp.Mk)
        return dq, dk, dv, None
