"""The ``triton_splitk`` operator: decoding attention with the key range split across programs.

For a few queries per sequence (``Mq <= 16``) against a long KV cache, a flash kernel that
parallelises over query tiles leaves most of the GPU idle at small batch. This operator packs the
query heads of a GQA group and the sequence's queries into one tile (each K/V tile is read once per
group), splits every sequence's visible keys across programs (:func:`~biasattn.ops.triton.splitk.choose_num_splits`),
and merges the partial results by log-sum-exp with the kernel behind ``ba.merge_attentions``.

Biases: padded keys (each sequence's own cache length; keys past it are never read), packed
sequences (``Mq <= 16`` per sequence), bands (bottom-right causal, sliding windows), ALiBi, and
additive tensors. Forward only. CUDA sm80+; on the CPU only under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import functools

import torch

from ..inputs import AttentionInputs
from .base import Operator
from .triton.environment import environment_reasons as triton_environment_reasons


@functools.cache  # an import statement per call costs several µs of host time
def _splitk():
    from .triton import splitk

    return splitk


class TritonSplitKOperator(Operator):
    """Split-KV Triton forward for small query counts: ``q [B, Hq, Mq<=16, D]`` against long ``k``/``v``."""

    NAME = "triton_splitk"
    DESCRIPTION = "Triton split-KV decoding: keys split across programs, merged by log-sum-exp; Mq <= 16 per sequence"
    DEVICES = frozenset({"cuda", "cpu"})
    MIN_CAPABILITY = (8, 0)
    DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
    MAX_HEAD_DIM = 256
    FEATURES = frozenset({"segments", "padded_keys", "band", "additive", "alibi"})
    SUPPORTS_GQA = True
    SUPPORTS_EMPTY = True
    MAX_MQ = 16
    POSITIVE_SCALE_ONLY = True  # row maxima are taken before scaling (the scale is applied inside exp2)

    def environment_reasons(self, device: torch.device | None = None) -> list[str]:
        """Triton must be installed; on the CPU the Triton interpreter must be on."""
        return triton_environment_reasons(device)

    def query_count_reasons(self, inp: AttentionInputs) -> list[str]:
        """``MAX_MQ`` for the call; with packed queries (segments) it applies per sequence, in :meth:`extra_reasons`."""
        if inp.spec.q_seqstart is not None:
            return []
        return super().query_count_reasons(inp)

    def extra_reasons(self, inp: AttentionInputs, *, backward: bool) -> list[str]:
        """Packed sequences of more than MAX_MQ queries; bfloat16 under the interpreter (its bf16 dot is inexact)."""
        reasons = []
        qs = inp.spec.host.q_seqstart
        if inp.spec.q_seqstart is not None and qs is not None:
            longest = max([b - a for a, b in zip(qs, qs[1:])], default=0)
            if longest > self.MAX_MQ:
                reasons.append(f"handles at most {self.MAX_MQ} queries per packed sequence, got a sequence of {longest}")
        if inp.device.type == "cpu" and inp.dtype == torch.bfloat16:
            reasons.append("does not run bfloat16 on the CPU: the Triton interpreter's bfloat16 matmul is inexact")
        return reasons

    def describe_launch(self, inp: AttentionInputs) -> str | None:
        """Row blocks, key tiles, pipeline and split count of the forward (:func:`~biasattn.ops.triton.splitk.launch_shape`)."""
        from .triton.splitk import launch_shape

        shape = launch_shape(inp)
        return None if shape is None else shape.describe()

    def fwd(self, inp: AttentionInputs):
        """``(out [B, Hq, Mq, Dv], lse [B, Hq, Mq] float32, None)``."""
        out, lse = _splitk().splitk_attention_fwd(inp)
        return out, lse, None
