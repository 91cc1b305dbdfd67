"""The ``triton`` operator: our flash-attention kernels, forward and backward, for every BiasSpec feature.

The kernels live in :mod:`biasattn.ops.triton` (imported on first use, so biasattn imports without
Triton). Traced code reaches this operator through :mod:`biasattn.ops.custom_ops`, whose ops run it
eagerly; the operator itself calls the launchers directly.

On CUDA it needs compute capability 8.0+. On the CPU it runs only under the Triton interpreter
(``TRITON_INTERPRET=1`` set before the kernels are first imported), which is how the CPU tests run.
float32 inputs are computed in full float32 (no tf32). Dropout draws its mask inside the kernels
from a Philox stream keyed by a per-call seed (from torch's default CPU generator, so
``torch.manual_seed`` reproduces it); the backward draws the same mask again, and
:func:`biasattn.ops.triton.flash.dropout_mask` writes it out. The drop probability is rounded to a
multiple of 2**-16, and kept probabilities are scaled by the inverse of the rounded keep rate.
"""

from __future__ import annotations

import functools

import torch

from ..bias.spec import FEATURES
from ..inputs import AttentionInputs
from .base import Operator
from .common import new_seed
from .triton.environment import environment_reasons as triton_environment_reasons


@functools.cache  # an import statement per call costs several µs of host time
def _launchers():
    from .triton import flash

    return flash


@functools.cache
def _bwd_launchers():
    from .triton import flash_bwd

    return flash_bwd


class TritonOperator(Operator):
    """Flash attention in Triton: every bias feature, forward and backward, GQA, head dims up to 256."""

    NAME = "triton"
    DESCRIPTION = "Triton flash kernels: every spec feature with tile skipping, GQA, dropout, backward with bias gradient"
    DEVICES = frozenset({"cuda", "cpu"})
    MIN_CAPABILITY = (8, 0)
    DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
    MIN_HEAD_DIM = 1
    MAX_HEAD_DIM = 256
    FEATURES = frozenset(FEATURES)
    SUPPORTS_DROPOUT = True
    SUPPORTS_BACKWARD = True
    SUPPORTS_BIAS_GRAD = True
    SUPPORTS_GQA = True
    SUPPORTS_LSE = True
    DETERMINISTIC = True  # under torch.use_deterministic_algorithms(True); the Gluon backward yields then
    POSITIVE_SCALE_ONLY = True  # row maxima are taken before scaling (the scale is applied inside exp2)
    SUPPORTS_EMPTY = True
    DEVICE_SEGMENTS = True

    def environment_reasons(self, device: torch.device | None = None) -> list[str]:
        """Triton must be installed; on the CPU the Triton interpreter must be on."""
        return triton_environment_reasons(device)

    def extra_reasons(self, inp: AttentionInputs, *, backward: bool) -> list[str]:
        """Key segments must be ordered and disjoint (always true for BlockDiagonalMask); B·Hq fits the grid."""
        from .triton.schedule import segments_disjoint

        reasons = []
        if inp.spec.q_seqstart is not None and not segments_disjoint(inp.spec):
            reasons.append("needs ordered, non-overlapping key segments, got overlapping ones")
        if inp.B * inp.Hq > 65535:
            reasons.append(f"launches one program row per (batch, head): B·Hq must be at most 65535, got {inp.B * inp.Hq}")
        return reasons

    def fwd(self, inp: AttentionInputs):
        """Raw forward: ``(out, lse float32, seed)``; the seed (0 without dropout) is the backward's ``ctx``."""
        p = inp.dropout_p
        seed = new_seed() if p > 0 else 0
        out, lse = _launchers().attn_fwd(inp.q, inp.k, inp.v, inp.spec, inp.scale, p, seed)
        return out, lse, seed

    def bwd(self, inp: AttentionInputs, out, lse, ctx, dout, dlse):
        """Raw backward: ``(dq, dk, dv, dadditive or None)``."""
        add = inp.additive
        need = add is not None and add.requires_grad
        lse = lse.to(torch.float32).contiguous()
        # with dropout the seed is this operator's own forward's; without, ctx may be another operator's
        seed = ctx if inp.dropout_p > 0 else 0
        dq, dk, dv, dadd = _bwd_launchers().attn_bwd(
            inp.q, inp.k, inp.v, out, lse, dout, dlse, inp.spec, inp.scale, need, inp.dropout_p, seed
        )
        return dq, dk, dv, (dadd if need else None)
