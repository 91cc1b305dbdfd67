"""Operator declarations: what each operator supports, stated as data and checked in one place.

An operator implements two raw (autograd-free) functions:

- ``fwd(inp) -> (out [B, Hq, Mq, Dv] in q's dtype, lse [B, Hq, Mq] float32 (float64 for float64 inputs), ctx)``
- ``bwd(inp, out, lse, ctx, dout, dlse) -> (dq, dk, dv, dadditive)``

``ctx`` is whatever the operator needs to replay its forward (a dropout seed, say). The autograd
function in :mod:`biasattn.ops.autograd` joins a forward operator with a backward operator.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from ..inputs import AttentionInputs
from .common import cuda_capability


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


class Operator:
    """Base class: subclasses fill in the declarations and ``fwd``/``bwd``."""

    NAME: ClassVar[str] = ""
    DESCRIPTION: ClassVar[str] = ""
    DEVICES: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    MIN_CAPABILITY: ClassVar[tuple[int, int]] = (0, 0)
    DTYPES: ClassVar[frozenset[torch.dtype]] = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
    MIN_HEAD_DIM: ClassVar[int] = 1
    MAX_HEAD_DIM: ClassVar[int | None] = None
    REQUIRES_EQUAL_V_DIM: ClassVar[bool] = False
    FEATURES: ClassVar[frozenset[str]] = frozenset()
    SUPPORTS_DROPOUT: ClassVar[bool] = False
    SUPPORTS_BACKWARD: ClassVar[bool] = False
    SUPPORTS_BIAS_GRAD: ClassVar[bool] = False
    SUPPORTS_GQA: ClassVar[bool] = False
    SUPPORTS_LSE: ClassVar[bool] = True
    DETERMINISTIC: ClassVar[bool] = True
    MAX_MQ: ClassVar[int | None] = None
    SUPPORTS_EMPTY: ClassVar[bool] = False
    POSITIVE_SCALE_ONLY: ClassVar[bool] = False  # kernels that take row maxima before scaling, or are unverified otherwise
    DEVICE_SEGMENTS: ClassVar[bool] = False  # runs packed segments whose lengths only the device holds

    @property
    def name(self) -> str:
        return self.NAME

    # ----------------------------------------------------------------------------- checks
    def environment_reasons(self, device: torch.device | None = None) -> list[str]:
        """Reasons that do not depend on the inputs (missing entry point, interpreter off, ...)."""
        return []

    def not_supported_reasons(self, inp: AttentionInputs, *, need_lse: bool = False, backward: bool | None = None) -> list[str]:
        """Every reason this operator cannot run ``inp``, one sentence each; empty when it can.

        ``backward`` defaults to ``inp.requires_grad``.
        """
        return list(self._reasons(inp, need_lse, inp.requires_grad if backward is None else backward))

    def supports(self, inp: AttentionInputs, *, need_lse: bool = False, backward: bool | None = None) -> bool:
        """True when :meth:`not_supported_reasons` is empty; stops at the first reason (the dispatcher's check)."""
        return next(self._reasons(inp, need_lse, inp.requires_grad if backward is None else backward), None) is None

    def _reasons(self, inp: AttentionInputs, need_lse: bool, backward: bool) -> Iterator[str]:
        """The reasons, declarations first, so that a refusal found early skips the costlier checks."""
        yield from self.environment_reasons(inp.device)
        dev = inp.device
        if dev.type not in self.DEVICES:
            yield f"runs on {'/'.join(sorted(self.DEVICES))} tensors, the inputs are on {dev}"
        elif dev.type == "cuda" and self.MIN_CAPABILITY > (0, 0):
            cap = cuda_capability(dev)
            if cap < self.MIN_CAPABILITY:
                need = ".".join(map(str, self.MIN_CAPABILITY))
                yield f"needs compute capability {need}+, the device has {cap[0]}.{cap[1]}"
        if inp.dtype not in self.DTYPES:
            names = ", ".join(sorted(_dtype_name(d) for d in self.DTYPES))
            yield f"supports dtypes {names}, got {_dtype_name(inp.dtype)}"
        if inp.D < self.MIN_HEAD_DIM or (self.MAX_HEAD_DIM is not None and max(inp.D, inp.Dv) > self.MAX_HEAD_DIM):
            yield f"supports head dims {self.MIN_HEAD_DIM}..{self.MAX_HEAD_DIM}, got D={inp.D}, Dv={inp.Dv}"
        if self.REQUIRES_EQUAL_V_DIM and inp.Dv != inp.D:
            yield f"needs Dv == D, got Dv={inp.Dv}, D={inp.D}"
        missing = inp.spec.features - self.FEATURES
        if missing:
            yield f"does not support bias features {sorted(missing)} (from {type(inp.bias).__name__})"
        if inp.dropout_p > 0 and not self.SUPPORTS_DROPOUT:
            yield f"does not support dropout (dropout_p={inp.dropout_p})"
        if backward and not self.SUPPORTS_BACKWARD:
            yield "has no backward pass and gradients are required"
        if backward and inp.additive is not None and inp.additive.requires_grad and not self.SUPPORTS_BIAS_GRAD:
            yield "cannot compute the gradient of the additive bias, which requires grad"
        if inp.groups > 1 and not self.SUPPORTS_GQA:
            yield f"does not support grouped-query attention (Hq={inp.Hq}, Hkv={inp.Hkv})"
        if need_lse and not self.SUPPORTS_LSE:
            yield "does not return the log-sum-exp"
        if inp.spec.q_seqstart is not None and inp.spec.host.q_seqstart is None and not self.DEVICE_SEGMENTS:
            yield "needs the packed sequences' lengths on the host; these live on the device only"
        yield from self.query_count_reasons(inp)
        if backward and torch.are_deterministic_algorithms_enabled() and not self.DETERMINISTIC:
            yield "is not deterministic and torch.use_deterministic_algorithms(True) is set"
        if self.POSITIVE_SCALE_ONLY and not inp.scale > 0:
            yield f"needs a positive scale, got scale={inp.scale}"
        if min(inp.B, inp.Mq, inp.Mk) == 0 and not self.SUPPORTS_EMPTY:
            yield f"does not handle empty inputs (B={inp.B}, Mq={inp.Mq}, Mk={inp.Mk})"
        yield from self.extra_reasons(inp, backward=backward)

    def extra_reasons(self, inp: AttentionInputs, *, backward: bool) -> list[str]:
        """Operator-specific limits beyond the declarations."""
        return []

    def query_count_reasons(self, inp: AttentionInputs) -> list[str]:
        """``MAX_MQ`` applied to the call's query count (an operator that counts per packed sequence overrides it)."""
        if self.MAX_MQ is not None and inp.Mq > self.MAX_MQ:
            return [f"handles at most Mq={self.MAX_MQ} queries, got Mq={inp.Mq}"]
        return []

    def describe_launch(self, inp: AttentionInputs) -> str | None:
        """What the forward would launch for these inputs (tiles, splits), for ``explain()``; None when
        the operator has nothing to tell."""
        return None

    # ----------------------------------------------------------------------------- compute
    def fwd(self, inp: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor, Any]:
        raise NotImplementedError

    def fwd_out(self, inp: AttentionInputs) -> torch.Tensor:
        """The forward's output alone, for a call that needs neither the log-sum-exp nor gradients
        (operators whose kernel can skip the log-sum-exp override it)."""
        return self.fwd(inp)[0]

    def direct_out(self, inp: AttentionInputs):
        """A function ``(q, k, v, scale, dropout_p) -> out`` that computes :meth:`fwd_out` for every
        later call of this call's signature (sizes, dtypes, devices, the bias's structure), given that
        the bias holds no tensor; None where the forward needs more of the call than that. A prepared
        forward-only call (:func:`biasattn.dispatch.attention_out`) then costs a lookup and this
        function."""
        return None

    def graph_out(self, inp: AttentionInputs) -> torch.Tensor | None:
        """The output through kernels whose gradients PyTorch's autograd already knows, for a call
        that needs gradients but no log-sum-exp and runs forward and backward on this operator; None
        where the operator's own backward is needed. Such a call skips the Python autograd function
        and its backward: the host cost of a training step's attention is then close to SDPA's."""
        return None

    def bwd(self, inp, out, lse, ctx, dout, dlse):
        raise NotImplementedError

    def declarations(self) -> dict[str, Any]:
        """The declarations as a plain dict (docs tables and `python -m biasattn info` read it)."""
        return {
            "name": self.NAME,
            "description": self.DESCRIPTION,
            "devices": sorted(self.DEVICES),
            "min_capability": ".".join(map(str, self.MIN_CAPABILITY)),
            "dtypes": sorted(_dtype_name(d) for d in self.DTYPES),
            "head_dims": f"{self.MIN_HEAD_DIM}..{self.MAX_HEAD_DIM or 'any'}",
            "features": sorted(self.FEATURES),
            "dropout": self.SUPPORTS_DROPOUT,
            "backward": self.SUPPORTS_BACKWARD,
            "bias_grad": self.SUPPORTS_BIAS_GRAD,
            "gqa": self.SUPPORTS_GQA,
            "lse": self.SUPPORTS_LSE,
            "deterministic": self.DETERMINISTIC,
            "max_mq": self.MAX_MQ,
            "scale": "> 0" if self.POSITIVE_SCALE_ONLY else "any",
        }

    def __repr__(self) -> str:
        return f"<biasattn operator {self.NAME!r}>"
