"""The base of the operators that call PyTorch's fused CUDA kernels, and their shared checks."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...bias.atoms import to_device
from ...inputs import AttentionInputs
from ..base import Operator, _dtype_name
from .layout import SequenceLayout, rows_may_be_empty, sequence_layout
from .lse import lse_from_kernel


def exact_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """True when every ``src`` value converts to ``dst`` unchanged (the same dtype, or a wider float32/float64)."""
    return src == dst or (dst in (torch.float32, torch.float64) and src.itemsize < dst.itemsize)


@functools.cache
def aten_entry(name: str):
    """The installed torch's ``aten.<name>``, or None when it lacks it: through torch's own binding
    ``torch.<name>`` where there is one (SDPA's backend entries; 3.5-4.5 µs less host time per call than
    ``torch.ops.aten.<name>`` on an H200's host), else ``torch.ops.aten.<name>``."""
    if not hasattr(torch.ops.aten, name):
        return None
    return getattr(torch._C._VariableFunctions, name, None) or getattr(torch.ops.aten, name)


LSE_GRADIENT = "its backward kernel cannot take a gradient through the log-sum-exp"


def missing_entries(names) -> list[str]:
    """A reason naming the entry points among ``names`` that the installed torch lacks, or none."""
    missing = [n for n in names if aten_entry(n) is None]
    if missing:
        return [f"needs {', '.join(f'torch.ops.aten.{n}' for n in missing)}, which torch {torch.__version__} lacks"]
    return []


@dataclass
class VendorCtx:
    """What a vendor forward keeps for its backward: the kernel's own lse and dropout state."""

    op: str
    lse_raw: torch.Tensor
    lse_format: str
    rng: tuple = ()


class VendorOperator(Operator):
    """Shared declarations and checks of the operators that call PyTorch's fused CUDA kernels.

    Shared rules: an additive bias is handed over in q's dtype, so one that would be rounded (a
    float32 bias with bfloat16 q) is refused, bool masks excepted (0 and -inf are exact); a call in
    which no sequence has both queries and keys launches nothing; rows of sequences without keys
    get 0 and lse ``-inf`` whatever the kernel wrote, and 0 query gradients.
    """

    DEVICES = frozenset({"cuda"})
    DETERMINISTIC = False
    POSITIVE_SCALE_ONLY = True  # FlashAttention-2 takes row maxima of unscaled scores; the others are unverified
    ENTRY_POINTS: ClassVar[tuple[str, ...]] = ()

    def environment_reasons(self, device=None) -> list[str]:
        """The installed torch's missing entry points (probed once: dispatch asks on every call)."""
        cache = type(self).__dict__.get("_environment_cache")
        if cache is None:
            cache = self.probe_environment()
            type(self)._environment_cache = cache
        return list(cache)

    def probe_environment(self) -> list[str]:
        """Reasons from the installed torch and CUDA build (entry points, kernel availability)."""
        return missing_entries(self.ENTRY_POINTS)

    def _reasons(self, inp: AttentionInputs, need_lse: bool, backward: bool) -> Iterator[str]:
        yield from super()._reasons(inp, need_lse, backward)
        if need_lse and backward:
            yield LSE_GRADIENT
        add = inp.additive
        if add is not None and not inp.spec.additive_is_mask and not exact_cast(add.dtype, inp.dtype):
            yield (f"takes the additive bias in q's dtype and would round the {_dtype_name(add.dtype)} bias given to "
                   f"{_dtype_name(inp.dtype)}")

    def layout(self, inp: AttentionInputs) -> SequenceLayout:
        """The :class:`SequenceLayout` of ``inp.spec`` (cached on the spec)."""
        return inp.spec.cached("sequence layout", lambda: sequence_layout(inp.spec))

    def _rows_may_be_empty(self, inp: AttentionInputs, layout: SequenceLayout) -> bool:
        """:func:`rows_may_be_empty`, asked once per layout."""
        return layout.cached("rows_may_be_empty", lambda: rows_may_be_empty(inp.spec, layout))

    def rows_may_be_hidden(self, inp: AttentionInputs, layout: SequenceLayout) -> bool:
        """Whether some query row may see no key: host metadata cannot rule it out, or an additive
        bias may hide a whole row."""
        return inp.additive is not None or self._rows_may_be_empty(inp, layout)

    def kernel_lse(self, raw: torch.Tensor, inp: AttentionInputs, layout: SequenceLayout, fmt: str) -> torch.Tensor:
        """:func:`lse_from_kernel` of the call, rows without keys fixed only where some may exist."""
        hidden = self.rows_may_be_hidden(inp, layout)
        lse = lse_from_kernel(raw, layout, inp.B, inp.Hq, inp.Mq, fmt, rows_may_be_hidden=hidden)
        keyless = self.keyless_rows(inp, layout)
        return lse if keyless is None else lse.masked_fill(keyless, float("-inf"))

    def keyless_rows(self, inp: AttentionInputs, layout: SequenceLayout) -> torch.Tensor | None:
        """Bool ``[B, 1, Mq]`` on the device: rows of sequences with no key (:attr:`SequenceLayout.keyless`), or None."""
        if not layout.keyless:
            return None

        def make():
            mask = torch.zeros((inp.B, 1, inp.Mq), dtype=torch.bool)
            for b, a, e in layout.keyless:
                mask[b, :, a:e] = True
            return to_device(mask, inp.device)

        return layout.cached(("keyless", str(inp.device)), make)

    def zero_keyless_rows(self, inp: AttentionInputs, layout: SequenceLayout, t: torch.Tensor) -> torch.Tensor:
        """``t [B, H, Mq, *]`` with 0 on :meth:`keyless_rows` (a query gradient, say)."""
        keyless = self.keyless_rows(inp, layout)
        return t if keyless is None else t.masked_fill(keyless[..., None], 0)

    def fwd(self, inp: AttentionInputs):
        layout = self.layout(inp)
        if not layout.has_work:  # every row sees nothing: no launch
            out = inp.q.new_zeros((inp.B, inp.Hq, inp.Mq, inp.Dv))
            return out, torch.full((inp.B, inp.Hq, inp.Mq), float("-inf"), device=inp.device), None
        return self.kernel_fwd(inp, layout)

    def fwd_out(self, inp: AttentionInputs) -> torch.Tensor:
        layout = self.layout(inp)
        if layout.cached("out from the lse", lambda: not layout.has_work or self.rows_may_be_hidden(inp, layout)):
            return self.fwd(inp)[0]  # no work, or rows that may see no key: fixed up from the lse
        return self.kernel_out(inp, layout)

    def graph_out(self, inp: AttentionInputs) -> torch.Tensor | None:
        """:meth:`kernel_graph_out` where no fix-up of ours is needed: every row sees a key, no
        additive bias, keys used in place (not packed) and a head dim the kernel takes as it is."""
        layout = self.layout(inp)
        if not layout.has_work or layout.varlen or inp.additive is not None or inp.D % 8 or inp.Dv % 8:
            return None
        if self.rows_may_be_hidden(inp, layout):
            return None
        return self.kernel_graph_out(inp, layout)

    def kernel_graph_out(self, inp: AttentionInputs, layout: SequenceLayout) -> torch.Tensor | None:
        """:meth:`graph_out` once its conditions hold; None when the kernel's entry point has no gradient."""
        return None

    def bwd(self, inp, out, lse, ctx, dout, dlse):
        layout = self.layout(inp)
        if not layout.has_work:
            add = inp.additive
            dadd = torch.zeros_like(add) if add is not None and add.requires_grad else None
            return torch.zeros_like(inp.q), torch.zeros_like(inp.k), torch.zeros_like(inp.v), dadd
        dq, dk, dv, dadd = self.kernel_bwd(inp, layout, out, lse, ctx, dout)
        return self.zero_keyless_rows(inp, layout, dq), dk, dv, dadd

    def kernel_fwd(self, inp: AttentionInputs, layout: SequenceLayout):
        """:meth:`fwd` for a layout with work: ``(out, lse, ctx)``."""
        raise NotImplementedError

    def kernel_out(self, inp: AttentionInputs, layout: SequenceLayout) -> torch.Tensor:
        """:meth:`fwd_out` for a layout with work in which every row sees a key."""
        return self.kernel_fwd(inp, layout)[0]

    def kernel_bwd(self, inp: AttentionInputs, layout: SequenceLayout, out, lse, ctx, dout):
        """:meth:`bwd` for a layout with work: ``(dq, dk, dv, dadditive)``."""
        raise NotImplementedError

    def fix_empty_rows(
        self, inp: AttentionInputs, layout: SequenceLayout, out: torch.Tensor, lse: torch.Tensor
    ) -> torch.Tensor:
        """``out`` with 0 on rows that see no key, when host metadata says such rows may exist."""
        if self._rows_may_be_empty(inp, layout):
            out = torch.where(torch.isneginf(lse)[..., None], torch.zeros((), dtype=out.dtype, device=out.device), out)
        return out
