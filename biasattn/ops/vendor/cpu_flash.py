"""The ``cpu_flash`` operator: PyTorch's fused CPU attention
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward), the kernel behind
``F.scaled_dot_product_attention`` on CPU tensors.

It runs no bias and a top-left causal mask (the kernel's ``is_causal``) in float32 and float64,
with grouped-query heads natively (K/V keep their ``Hkv`` heads and so do their gradients), Dv == D
and a positive scale: with a causal mask and a negative scale the kernel returns NaN (torch 2.13).
In bfloat16 its gradients miss the criterion every operator meets (within twice the error of the
reference computed in that dtype: dV at 8 times it in a drawn case with D = 1), so bfloat16 and
float16 stay on ``chunked``, as does every other bias: ``chunked`` skips the keys a bias hides
instead of reading a mask.

The kernel multiplies a value that its causal mask hides by 0, so a NaN or inf there would reach
rows that cannot see it; where k or v holds one under a causal mask (one scan of each per pass),
the pass runs ``chunked``'s, which keeps it out. No gradient flows through the log-sum-exp.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ...inputs import AttentionInputs
from ..base import Operator
from ..chunked import ChunkedOperator
from ..common import may_hold_nonfinite
from .base import LSE_GRADIENT, aten_entry, missing_entries

FORWARD, BACKWARD = "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"
_EXACT = ChunkedOperator()


class CpuFlashOperator(Operator):
    """PyTorch's fused CPU attention: no bias or top-left causal, GQA, forward and backward."""

    NAME = "cpu_flash"
    DESCRIPTION = "PyTorch's fused CPU attention (SDPA's CPU kernel): no bias or top-left causal, GQA, float32/64"
    DEVICES = frozenset({"cpu"})
    DTYPES = frozenset({torch.float32, torch.float64})
    REQUIRES_EQUAL_V_DIM = True
    FEATURES = frozenset({"band"})
    SUPPORTS_BACKWARD = True
    SUPPORTS_GQA = True
    DETERMINISTIC = False  # its backward has not been shown to repeat bit for bit
    POSITIVE_SCALE_ONLY = True

    def environment_reasons(self, device=None) -> list[str]:
        return missing_entries((FORWARD, BACKWARD))

    def _reasons(self, inp: AttentionInputs, need_lse: bool, backward: bool) -> Iterator[str]:
        yield from super()._reasons(inp, need_lse, backward)
        if need_lse and backward:
            yield LSE_GRADIENT

    def extra_reasons(self, inp: AttentionInputs, *, backward: bool) -> list[str]:
        if inp.spec.band_lo is not None and inp.spec.causal_kind() != "top_left":
            return ["supports only a top-left causal band, not this band"]
        return []

    def _causal(self, inp: AttentionInputs) -> bool:
        return inp.spec.band_lo is not None

    def _hidden_values_may_be_nonfinite(self, inp: AttentionInputs) -> bool:
        return self._causal(inp) and (may_hold_nonfinite(inp.k) or may_hold_nonfinite(inp.v))

    def fwd(self, inp: AttentionInputs):
        if self._hidden_values_may_be_nonfinite(inp):
            return _EXACT.fwd(inp)
        out, lse = aten_entry(FORWARD)(inp.q, inp.k, inp.v, 0.0, self._causal(inp), scale=inp.scale)
        return out, lse, 0

    def direct_out(self, inp: AttentionInputs):
        fwd, causal, bias, spec = aten_entry(FORWARD), self._causal(inp), inp.bias, inp.spec

        def out(q, k, v, scale, dropout_p):
            if causal and (may_hold_nonfinite(k) or may_hold_nonfinite(v)):
                return _EXACT.fwd_out(AttentionInputs(q, k, v, bias, spec, scale, dropout_p))
            return fwd(q, k, v, 0.0, causal, scale=scale)[0]

        return out

    def graph_out(self, inp: AttentionInputs) -> torch.Tensor | None:
        if self._hidden_values_may_be_nonfinite(inp):
            return None
        return aten_entry(FORWARD)(inp.q, inp.k, inp.v, 0.0, self._causal(inp), scale=inp.scale)[0]

    def bwd(self, inp, out, lse, ctx, dout, dlse):
        if dlse is not None or self._hidden_values_may_be_nonfinite(inp):
            return _EXACT.bwd(inp, out, lse, ctx, dout, dlse)
        dq, dk, dv = aten_entry(BACKWARD)(
            dout, inp.q, inp.k, inp.v, out, lse, 0.0, self._causal(inp), scale=inp.scale
        )
        return dq, dk, dv, None
