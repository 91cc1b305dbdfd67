"""The ``flash2`` operator: PyTorch's FlashAttention-2 kernels (``aten._flash_attention_forward``/``_backward``).

Causal masks and windows become FlashAttention's ``window_size_left/right`` (aligned bottom-right
in each sequence); packed segments and padded keys become ``cu_seqlens`` (padded keys are gathered
out, so forward and backward agree). GQA is native. Head dims that are not a multiple of 8 are
zero-padded here. Rows that see no key come back as 0 with lse ``-inf`` (the kernel writes ``+inf``).
ALiBi is not declared: the entry point takes slopes, but torch 2.11's build raises "This flash
attention build does not support alibi" (measured on the H200).
"""

from __future__ import annotations

import torch

from ...inputs import AttentionInputs
from .base import VendorCtx, VendorOperator, aten_entry
from .layout import cu_seqlens, pack_keys, pack_queries, pad_head_dim, unpack_keys, unpack_queries
from .lse import lse_format, lse_to_kernel
from .masks import flash_window


class Flash2Operator(VendorOperator):
    """FlashAttention-2 through PyTorch: causal, windows, varlen, padded keys, GQA, dropout."""

    NAME = "flash2"
    DESCRIPTION = "PyTorch's FlashAttention-2 kernels: causal, sliding window, varlen, padded keys, GQA, dropout"
    MIN_CAPABILITY = (8, 0)
    DTYPES = frozenset({torch.float16, torch.bfloat16})
    MAX_HEAD_DIM = 256
    REQUIRES_EQUAL_V_DIM = True
    FEATURES = frozenset({"segments", "padded_keys", "band"})
    SUPPORTS_DROPOUT = True
    SUPPORTS_BACKWARD = True
    SUPPORTS_GQA = True
    ENTRY_POINTS = ("_flash_attention_forward", "_flash_attention_backward")

    def probe_environment(self) -> list[str]:
        reasons = super().probe_environment()
        probe = getattr(torch.backends.cuda, "is_flash_attention_available", None)
        if not reasons and probe is not None and torch.cuda.is_available() and not probe():
            reasons.append(f"torch {torch.__version__} was built without FlashAttention kernels")
        return reasons

    def extra_reasons(self, inp: AttentionInputs, *, backward: bool) -> list[str]:
        layout = self.layout(inp)
        if layout.reason:
            return [layout.reason]
        if flash_window(layout) is None:
            return ["cannot express the band as FlashAttention's window (aligned bottom-right in every sequence)"]
        return []

    # ----------------------------------------------------------------------------- helpers
    def _window(self, inp: AttentionInputs, layout) -> tuple[int, int]:
        left, right = flash_window(layout)
        if layout.max_q <= 1 and right < 0:
            # Equal for single-query sequences, and keeps FlashAttention off its one-query GQA path,
            # which reshapes the packed queries as if no sequence were empty.
            right = 0
        return left, right

    def _args(self, inp: AttentionInputs, layout):
        q = pad_head_dim(pack_queries(inp.q, layout))
        k = pad_head_dim(pack_keys(inp.k, inp.spec, layout))
        v = pad_head_dim(pack_keys(inp.v, inp.spec, layout))
        if layout.varlen:
            cu_q, cu_k = cu_seqlens(inp.spec, layout, inp.device)
            return q, k, v, cu_q, cu_k, layout.max_q, layout.max_k
        return q, k, v, None, None, inp.Mq, inp.Mk

    # ----------------------------------------------------------------------------- compute
    def kernel_fwd(self, inp: AttentionInputs, layout):
        left, right = self._window(inp, layout)
        q, k, v, cu_q, cu_k, max_q, max_k = self._args(inp, layout)
        out, lse_raw, rng, unused, _ = aten_entry("_flash_attention_forward")(
            q, k, v, cu_q, cu_k, max_q, max_k, inp.dropout_p, False, False,
            scale=inp.scale, window_size_left=left, window_size_right=right,
        )
        out = unpack_queries(out[..., : inp.Dv], layout, inp.B)
        lse_fmt = lse_format(lse_raw, layout, inp.B, inp.Hq, inp.Mq)
        if layout.varlen:
            self._varlen_lse_format = lse_fmt
        lse = self.kernel_lse(lse_raw, inp, layout, lse_fmt)
        out = self.fix_empty_rows(inp, layout, out, lse)
        return out, lse, VendorCtx(self.NAME, lse_raw, lse_fmt, (rng, unused))

    def kernel_graph_out(self, inp: AttentionInputs, layout):
        left, right = self._window(inp, layout)
        q, k, v = (pack_queries(t, layout) for t in (inp.q, inp.k, inp.v))
        out = aten_entry("_flash_attention_forward")(
            q, k, v, None, None, inp.Mq, inp.Mk, inp.dropout_p, False, False,
            scale=inp.scale, window_size_left=left, window_size_right=right,
        )[0]
        return unpack_queries(out, layout, inp.B)

    def kernel_bwd(self, inp, layout, out, lse, ctx, dout):
        left, right = self._window(inp, layout)
        q, k, v, cu_q, cu_k, max_q, max_k = self._args(inp, layout)
        own = isinstance(ctx, VendorCtx) and ctx.op == self.NAME
        if own:
            lse_raw, (rng, unused) = ctx.lse_raw, ctx.rng
        else:
            lse_fmt = getattr(self, "_varlen_lse_format", "h_total") if layout.varlen else "bhm"
            lse_raw = lse_to_kernel(lse, layout, lse_fmt)
            rng = unused = torch.empty((), dtype=torch.int64, device=inp.device)
        o = pad_head_dim(pack_queries(out, layout))
        do = pad_head_dim(pack_queries(dout, layout))
        dq, dk, dv = aten_entry("_flash_attention_backward")(
            do.contiguous() if do.stride(-1) != 1 else do, q, k, v, o, lse_raw, cu_q, cu_k, max_q, max_k,
            inp.dropout_p, False, rng, unused, scale=inp.scale, window_size_left=left, window_size_right=right,
        )
        dq = unpack_queries(dq[..., : inp.D], layout, inp.B)
        dk = unpack_keys(dk[..., : inp.D], inp.spec, layout, inp.B, inp.Mk)
        dv = unpack_keys(dv[..., : inp.Dv], inp.spec, layout, inp.B, inp.Mk)
        return dq, dk, dv, None
