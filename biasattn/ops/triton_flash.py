"""The ``triton`` operator: our flash-attention kernels, forward and backward, for every BiasSpec feature.

The kernels live in :mod:`biasattn.ops.triton` (imported on first use, so biasattn imports without
Triton). Traced code reaches them through two ``torch.library`` custom ops, ``biasattn::triton_flash_fwd``
and ``biasattn::triton_flash_bwd``, each with a fake implementation so ``torch.compile`` can trace
calls without running them; eager calls go straight to the launchers, which saves the custom-op
layer's host time on every call.

On CUDA it needs compute capability 8.0+. On the CPU it runs only under the Triton interpreter
(``TRITON_INTERPRET=1`` set before the kernels are first imported), which is how the CPU tests run.
float32 inputs are computed in full float32 (no tf32). Dropout draws its mask inside the kernels
from a Philox stream keyed by a per-call seed (from torch's default CPU generator, so
``torch.manual_seed`` reproduces it); the backward draws the same mask again, and
:func:`biasattn.ops.triton.flash.dropout_mask` writes it out. The drop probability is rounded to a
multiple of 2**-16, and kept probabilities are scaled by the inverse of the rounded keep rate.
"""

# ruff: noqa: UP045  (torch.library infers custom-op schemas from typing.Optional)
from __future__ import annotations

from typing import Optional

import torch

from ..bias.spec import FEATURES, BiasSpec, SpecHost
from ..inputs import AttentionInputs
from .base import Operator
from .common import new_seed
from .triton.environment import environment_reasons as triton_environment_reasons

_FLASH = "biasattn.ops.triton.flash"


def _launchers():
    from .triton import flash

    return flash


def _bwd_launchers():
    from .triton import flash_bwd

    return flash_bwd


def _spec_from_args(q, k, additive, qs, ks, kl, kv, band_lo, band_hi, layout, slopes,
                    host_qs, host_ks, host_kl, ints) -> BiasSpec:
    block_q, block_k, layout_q_off, layout_k_off, alibi_shift = ints
    host = SpecHost(
        q_seqstart=tuple(host_qs) if qs is not None else None,
        k_seqstart=tuple(host_ks) if qs is not None else None,
        k_seqlen=tuple(host_kl) if qs is not None else None,
    )
    return BiasSpec(
        B=q.shape[0], H=q.shape[1], Mq=q.shape[2], Mk=k.shape[2], q_seqstart=qs, k_seqstart=ks, k_seqlen=kl,
        kv_seqlens=kv, band_lo=band_lo, band_hi=band_hi, layout=layout, block_q=block_q, block_k=block_k,
        layout_q_off=layout_q_off, layout_k_off=layout_k_off, additive=additive, alibi_slopes=slopes,
        alibi_shift=alibi_shift, host=host,
    )


def _spec_to_args(spec: BiasSpec) -> tuple:
    h = spec.host
    segs = spec.q_seqstart is not None
    return (
        spec.additive, spec.q_seqstart, spec.k_seqstart, spec.k_seqlen, spec.kv_seqlens, spec.band_lo, spec.band_hi,
        spec.layout, spec.alibi_slopes,
        list(h.q_seqstart) if segs else [], list(h.k_seqstart) if segs else [], list(h.k_seqlen) if segs else [],
        [spec.block_q, spec.block_k, spec.layout_q_off, spec.layout_k_off, spec.alibi_shift],
    )


@torch.library.custom_op("biasattn::triton_flash_fwd", mutates_args=())
def triton_flash_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, additive: Optional[torch.Tensor], q_seqstart: Optional[torch.Tensor],
    k_seqstart: Optional[torch.Tensor], k_seqlen: Optional[torch.Tensor], kv_seqlens: Optional[torch.Tensor],
    band_lo: Optional[torch.Tensor], band_hi: Optional[torch.Tensor], layout: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor], host_q_seqstart: list[int], host_k_seqstart: list[int], host_k_seqlen: list[int],
    ints: list[int], scale: float, dropout_p: float = 0.0, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, Mq, Dv], lse [B, Hq, Mq] float32)``.

    q ``[B, Hq, Mq, D]``, k/v ``[B, Hkv, Mk, D|Dv]``, then the fields of a BiasSpec, the scale, and
    the dropout probability with its seed.
    """
    spec = _spec_from_args(q, k, additive, q_seqstart, k_seqstart, k_seqlen, kv_seqlens, band_lo, band_hi, layout,
                           alibi_slopes, host_q_seqstart, host_k_seqstart, host_k_seqlen, ints)
    return _launchers().attn_fwd(q, k, v, spec, scale, dropout_p, seed)


@triton_flash_fwd.register_fake
def _(q, k, v, *args):
    B, H, Mq, _ = q.shape
    return q.new_empty((B, H, Mq, v.shape[3])), q.new_empty((B, H, Mq), dtype=torch.float32)


@torch.library.custom_op("biasattn::triton_flash_bwd", mutates_args=())
def triton_flash_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
    dlse: Optional[torch.Tensor], additive: Optional[torch.Tensor], q_seqstart: Optional[torch.Tensor],
    k_seqstart: Optional[torch.Tensor], k_seqlen: Optional[torch.Tensor], kv_seqlens: Optional[torch.Tensor],
    band_lo: Optional[torch.Tensor], band_hi: Optional[torch.Tensor], layout: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor], host_q_seqstart: list[int], host_k_seqstart: list[int], host_k_seqlen: list[int],
    ints: list[int], scale: float, need_dbias: bool, dropout_p: float = 0.0, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dadditive)``; ``dadditive`` is empty (shape ``[0]``) when not requested."""
    spec = _spec_from_args(q, k, additive, q_seqstart, k_seqstart, k_seqlen, kv_seqlens, band_lo, band_hi, layout,
                           alibi_slopes, host_q_seqstart, host_k_seqstart, host_k_seqlen, ints)
    dq, dk, dv, dadd = _bwd_launchers().attn_bwd(q, k, v, out, lse, dout, dlse, spec, scale, need_dbias, dropout_p, seed)
    return dq, dk, dv, (dadd if dadd is not None else q.new_empty((0,)))


@triton_flash_bwd.register_fake
def _(q, k, v, out, lse, dout, dlse, additive, q_seqstart, k_seqstart, k_seqlen, kv_seqlens, band_lo, band_hi,
      layout, alibi_slopes, host_q_seqstart, host_k_seqstart, host_k_seqlen, ints, scale, need_dbias,
      dropout_p=0.0, seed=0):
    need = need_dbias and additive is not None
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(additive) if need else q.new_empty((0,)))


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
    DETERMINISTIC = True
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
        if torch.compiler.is_compiling():
            out, lse = triton_flash_fwd(inp.q, inp.k, inp.v, *_spec_to_args(inp.spec), inp.scale, p, seed)
        else:  # eager: straight to the launcher, without the custom op's Python layer
            out, lse = _launchers().attn_fwd(inp.q, inp.k, inp.v, inp.spec, inp.scale, p, seed)
        return out, lse, seed

    def bwd(self, inp: AttentionInputs, out, lse, ctx, dout, dlse):
        """Raw backward: ``(dq, dk, dv, dadditive or None)``."""
        add = inp.additive
        need = add is not None and add.requires_grad
        lse = lse.to(torch.float32).contiguous()
        # with dropout the seed is this operator's own forward's; without, ctx may be another operator's
        seed = ctx if inp.dropout_p > 0 else 0
        if torch.compiler.is_compiling():
            dq, dk, dv, dadd = triton_flash_bwd(
                inp.q, inp.k, inp.v, out, lse, dout, dlse, *_spec_to_args(inp.spec), inp.scale, need, inp.dropout_p, seed
            )
        else:
            dq, dk, dv, dadd = _bwd_launchers().attn_bwd(
                inp.q, inp.k, inp.v, out, lse, dout, dlse, inp.spec, inp.scale, need, inp.dropout_p, seed
            )
        return dq, dk, dv, (dadd if need else None)
