"""The ``cudnn`` operator: PyTorch's cuDNN attention (``aten._cudnn_attention_forward``/``_backward``).

Older torch builds only have ``aten._scaled_dot_product_cudnn_attention``; the operator uses
whichever the installed torch has. cuDNN's causal mask is top-left, so it is used only for
``Mq == Mk`` (where top-left and bottom-right agree). An additive bias must not require grad (cuDNN
computes no bias gradient), and with a bias the backward is refused at sequence lengths
``% 128 == 64``, where cuDNN's ``grad_q`` has returned NaN (PyTorch issue 196678), and at ``Mq = 1``,
where it returned NaN in 16 of 206 random cases with ``B = 1`` (H200, cuDNN 9.19). Grouped-query
attention is native: K/V keep their ``Hkv`` heads and so do their gradients. Head dims go to 256 on
Hopper and 128 elsewhere, as cuDNN's own checks allow. The backward is refused for ``Mq = Mk = 1``:
cuDNN rejects that graph, and a later call in the same process could find the rejected graph in
PyTorch's cache and crash, so the operator never asks for it.

Packed segments and padded keys are not declared: through the ragged (``cum_seq``) entry point of
torch 2.11 the forward took 45-60 ms where FlashAttention-2 takes 0.3-0.9 ms, and ``grad_q`` was
wrong (measured on the H200 with torch 2.11); as a ``-inf`` bias, padded keys
would still be read, and a cache slot past a sequence's length may hold anything (NaN included).
"""

from __future__ import annotations

import functools

import torch

from ...inputs import AttentionInputs
from ..common import cuda_capability
from .base import VendorCtx, VendorOperator, aten_entry
from .lse import lse_format, lse_to_kernel
from .masks import aligned_bias, cudnn_causal

RAGGED = ("_cudnn_attention_forward", "_cudnn_attention_backward")
DENSE = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")


@functools.cache
def _dense_entry():
    """SDPA's cuDNN forward entry (:func:`~biasattn.ops.vendor.base.aten_entry`), looked up once."""
    return aten_entry(DENSE[0])


@functools.cache
def _entry_points() -> tuple[str, str] | None:
    for names in (RAGGED, DENSE):
        if all(aten_entry(n) is not None for n in names):
            return names
    return None


@functools.cache
def _cudnn_version() -> int | None:
    return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None


class CudnnOperator(VendorOperator):
    """cuDNN attention through PyTorch: causal (Mq == Mk), additive bias (no gradient), GQA, dropout."""

    NAME = "cudnn"
    DESCRIPTION = "PyTorch's cuDNN attention: causal (Mq == Mk), additive bias (no bias gradient), GQA, dropout"
    MIN_CAPABILITY = (8, 0)
    DTYPES = frozenset({torch.float16, torch.bfloat16})
    MIN_HEAD_DIM = 8
    MAX_HEAD_DIM = 256  # on Hopper; 128 elsewhere (see extra_reasons)
    REQUIRES_EQUAL_V_DIM = True
    FEATURES = frozenset({"band", "additive"})
    SUPPORTS_DROPOUT = True
    SUPPORTS_BACKWARD = True
    SUPPORTS_GQA = True
    ENTRY_POINTS = RAGGED

    def probe_environment(self) -> list[str]:
        if _entry_points() is None:
            names = ", ".join(f"torch.ops.aten.{n}" for n in RAGGED + DENSE)
            return [f"needs cuDNN attention entry points ({names}), which torch {torch.__version__} lacks"]
        version = _cudnn_version()
        if torch.cuda.is_available() and (version is None or version < 90000):
            return [f"needs cuDNN 9 or newer, torch {torch.__version__} has {version or 'no cuDNN'}"]
        return []

    def extra_reasons(self, inp: AttentionInputs, *, backward: bool) -> list[str]:
        layout = self.layout(inp)
        if layout.reason:
            return [layout.reason]
        reasons = []
        if inp.groups > 1 and _entry_points() != RAGGED:
            reasons.append(
                f"takes grouped-query heads only through torch.ops.aten.{RAGGED[0]}, which torch {torch.__version__} lacks"
            )
        if inp.D % 8:
            reasons.append(f"needs a head dim that is a multiple of 8, got D={inp.D}")
        if inp.D > 128 and inp.device.type == "cuda" and cuda_capability(inp.device)[0] != 9:
            reasons.append(f"runs head dims above 128 only on Hopper (compute capability 9.x), got D={inp.D}")
        causal = cudnn_causal(layout)
        if causal is None:
            reasons.append("supports only a top-left causal band, not this band")
        elif causal and inp.Mq != inp.Mk:
            reasons.append(f"uses its top-left causal mask only for Mq == Mk, got Mq={inp.Mq}, Mk={inp.Mk}")
        if backward and inp.Mq == 1 and inp.Mk == 1:
            # cuDNN refuses this graph, and a later call can find the failed graph cached and crash
            reasons.append("has no backward for Mq = Mk = 1")
        if backward and _cudnn_version() in (91000, 91001):
            reasons.append("has a known-bad backward in cuDNN 9.10.0 and 9.10.1; 9.10.2 or newer works")
        if backward and inp.additive is not None and (inp.Mq % 128 == 64 or inp.Mk % 128 == 64):
            reasons.append(
                f"gives NaN grad_q with a bias when a sequence length % 128 == 64 "
                f"(Mq={inp.Mq}, Mk={inp.Mk}; PyTorch issue 196678)"
            )
        if backward and inp.additive is not None and inp.Mq == 1:
            reasons.append("gives NaN grad_q with a bias at Mq = 1 (in some calls, depending on memory contents)")
        return reasons

    # ----------------------------------------------------------------------------- helpers
    def _bias(self, inp: AttentionInputs):
        if inp.additive is None:
            return None
        return aligned_bias(inp.additive.detach(), (inp.B, inp.Hq, inp.Mq, inp.Mk), inp.dtype)

    # ----------------------------------------------------------------------------- compute
    def kernel_fwd(self, inp: AttentionInputs, layout):
        out, lse_raw, seed, offset = self._launch_fwd(inp, layout, compute_lse=True)
        lse_fmt = lse_format(lse_raw, layout, inp.B, inp.Hq, inp.Mq)
        lse = self.kernel_lse(lse_raw, inp, layout, lse_fmt)
        out = self.fix_empty_rows(inp, layout, out, lse)
        return out, lse, VendorCtx(self.NAME, lse_raw, lse_fmt, (seed, offset))

    def kernel_out(self, inp: AttentionInputs, layout):
        dense = _dense_entry()
        q, k = inp.q, inp.k
        if dense is not None and q.shape[1] == k.shape[1]:  # SDPA's entry has torch's own binding: less host time
            return _dense_out(dense, bool(cudnn_causal(layout)), self._bias(inp), q, k, inp.v, inp.scale, inp.dropout_p)
        return self._launch_fwd(inp, layout, compute_lse=False)[0]

    def direct_out(self, inp: AttentionInputs):
        layout = self.layout(inp)
        dense = _dense_entry()
        if dense is None or inp.groups > 1 or inp.additive is not None or not layout.has_work:
            return None
        if self.rows_may_be_hidden(inp, layout):  # rows that see no key are fixed up from the lse
            return None
        return functools.partial(_dense_out, dense, bool(cudnn_causal(layout)), None)

    def kernel_graph_out(self, inp: AttentionInputs, layout):
        # SDPA's own entry point (only the ragged one takes grouped-query heads). Its gradient is wrong
        # for a dout laid out unlike out (H200, torch 2.11, SDPA included), so the hook lays it out like out.
        dense = aten_entry(DENSE[0])
        if inp.groups > 1 or dense is None:
            return None
        out = dense(
            inp.q, inp.k, inp.v, None, True, inp.dropout_p, bool(cudnn_causal(layout)), False, scale=inp.scale
        )[0]
        out.register_hook(functools.partial(_like, out.shape, out.stride()))
        return out

    def _launch_fwd(self, inp: AttentionInputs, layout, compute_lse: bool):
        """``(out, raw lse, dropout seed, offset)`` of cuDNN's forward (the lse only with ``compute_lse``)."""
        q, k, v, bias = inp.q, inp.k, inp.v, self._bias(inp)
        causal = bool(cudnn_causal(layout))
        if _entry_points() == RAGGED:
            res = aten_entry(RAGGED[0])(
                q, k, v, bias, None, None, inp.Mq, inp.Mk, compute_lse, inp.dropout_p, causal, False, scale=inp.scale
            )
        else:
            res = aten_entry(DENSE[0])(q, k, v, bias, compute_lse, inp.dropout_p, causal, False, scale=inp.scale)
        return res[0], res[1], res[6], res[7]

    def kernel_bwd(self, inp, layout, out, lse, ctx, dout):
        q, k, v, bias = inp.q, inp.k, inp.v, self._bias(inp)
        if isinstance(ctx, VendorCtx) and ctx.op == self.NAME:
            lse_raw, (seed, offset) = ctx.lse_raw, ctx.rng
        else:
            lse_raw = lse_to_kernel(lse, layout, "bhm1")
            seed = offset = torch.empty((), dtype=torch.int64, device=inp.device)
        # cuDNN's gradients are wrong for an out laid out unlike q (H200, torch 2.11: relative errors
        # above 1 with q a view of a fused projection and out contiguous, as a compiled forward or
        # another operator's hands it over) and for a grad_out laid out unlike out
        out = _in_order_of(q, out)
        dout = _like(out.shape, out.stride(), dout)
        causal = bool(cudnn_causal(layout))
        name = RAGGED[1] if _entry_points() == RAGGED else DENSE[1]
        dq, dk, dv = aten_entry(name)(
            dout, q, k, v, out, lse_raw, seed, offset, bias, None, None, inp.Mq, inp.Mk, inp.dropout_p, causal, scale=inp.scale,
        )
        return dq, dk, dv, None


def _dense_out(dense, causal: bool, bias, q, k, v, scale: float, dropout_p: float) -> torch.Tensor:
    """The output of SDPA's cuDNN forward entry ``dense`` (no log-sum-exp)."""
    return dense(q, k, v, bias, False, dropout_p, causal, False, scale=scale)[0]


def _in_order_of(ref: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` with its dims in memory in the order of ``ref``'s (a copy only where the orders differ)."""
    order = sorted(range(ref.dim()), key=lambda d: (-ref.stride(d), d))
    if order == sorted(range(t.dim()), key=lambda d: (-t.stride(d), d)):
        return t
    back = sorted(range(t.dim()), key=order.__getitem__)
    return t.permute(order).contiguous().permute(back)


def _like(shape, stride, t: torch.Tensor) -> torch.Tensor:
    """``t`` laid out with ``stride`` (a copy only where its own strides differ)."""
    if t.stride() == stride:
        return t
    return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device).copy_(t)
