"""Recognising the mask terms of an attention site in an FX graph (used by :mod:`.fx_patterns`).

Masks are described as terms ``(kind, nodes)`` for :func:`~biasattn.integrations.fx.fused_attention`.
A band kind is the tuple ``("band", lo, hi, align, fallback)``: key j is visible to query i iff
``lo <= j - i - shift <= hi`` (``None`` = unbounded; ``shift`` is 0 top-left, ``Mk - Mq``
bottom-right); ``fallback`` says what its nodes are: ``"visible"``/``"additive"`` (the mask tensor
as the code used it) or ``"size"`` (the rows and columns the code built it with).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .fx_nodes import CASTS, FULL_SLICE, arg, const, is_call, method, skip_casts

LARGE_NEGATIVE = -1e4


def _op(node, *names) -> bool:
    """``torch.name(x, ...)`` or ``x.name(...)``."""
    return method(node, *names) or is_call(node, {getattr(torch, n) for n in names if hasattr(torch, n)})


def expanded_2d(node):
    """The 2-D node ``m`` if ``node`` is ``m[:, None, None, :]`` / ``m[:, None, None]`` / ``m.unsqueeze(1).unsqueeze(2)``."""
    node = skip_casts(node)
    if is_call(node, {operator.getitem}) and node.args[1] in ((FULL_SLICE, None, None, FULL_SLICE), (FULL_SLICE, None, None)):
        return node.args[0]
    if method(node, "unsqueeze") and node.args[1] == 2:
        inner = node.args[0]
        if method(inner, "unsqueeze") and inner.args[1] == 1:
            return inner.args[0]
    return None


def keep_from_condition(cond):
    """For ``masked_fill(cond, ...)``: the node meaning "key kept" when ``cond`` is ``x == 0`` / ``~x``, else None."""
    if is_call(cond, {operator.eq, torch.eq}) or method(cond, "eq"):
        if cond.args[1] == 0:
            return cond.args[0]
    if is_call(cond, {operator.invert, torch.logical_not}) or method(cond, "logical_not", "bitwise_not"):
        return cond.args[0]
    return None


def _leading_broadcast(node):
    """``node`` without ``m[None, None]``-style leading new axes or ``.unsqueeze(0)`` (the last two dims unchanged)."""
    while True:
        node = skip_casts(node)
        if is_call(node, {operator.getitem}):
            idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            rest = [s for s in idx if s is not None and s is not Ellipsis]
            if idx and idx[0] is None and all(s == FULL_SLICE for s in rest):
                node = node.args[0]
                continue
        if method(node, "unsqueeze") and node.args[1] == 0:
            node = node.args[0]
            continue
        return node


def _band_of_matrix(visible: torch.Tensor):
    """``(lo, hi)`` if every ``[N, N]`` matrix in ``visible [..., N, N]`` is the band ``lo <= j - i <= hi``."""
    if visible.dim() < 2 or visible.shape[-1] != visible.shape[-2] or visible.shape[-1] == 0:
        return None
    n = visible.shape[-1]
    rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    flat = visible.reshape(-1, n, n).cpu()
    if not flat.any():
        return None
    shown = rel.expand_as(flat)[flat]
    lo, hi = int(shown.min()), int(shown.max())
    if not bool((flat == ((rel >= lo) & (rel <= hi))).all()):
        return None
    return (None if lo == -(n - 1) else lo), hi


class MaskReader:
    """Reads the mask expressions of ``gm`` as terms; buffers are read to tell causal and banded masks."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm

    def _buffer(self, node):
        """The tensor behind a ``get_attr`` node, or None."""
        if not isinstance(node, fx.Node) or node.op != "get_attr":
            return None
        obj: Any = self.gm
        for part in node.target.split("."):
            obj = getattr(obj, part, None)
        return obj if isinstance(obj, torch.Tensor) else None

    def _sliced_buffer(self, node):
        """``(buffer, align)`` for a buffer, its top-left slice ``b[..., :Mq, :Mk]`` or GPT-2's ``b[..., Mk-Mq:Mk, :Mk]``."""
        node = _leading_broadcast(node)
        buf = self._buffer(node)
        if buf is not None:
            return buf, "top_left"
        if not is_call(node, {operator.getitem}) or not isinstance(node.args[1], tuple):
            return None
        buf, idx = self._buffer(_leading_broadcast(node.args[0])), node.args[1]
        if buf is None or len(idx) != buf.dim() or not all(isinstance(s, slice) and s.step is None for s in idx):
            return None
        if not all(s == FULL_SLICE for s in idx[:-2]):
            return None
        rows, cols = idx[-2:]
        if rows.start in (None, 0) and cols.start in (None, 0):
            return buf, "top_left"
        end = rows.stop
        if cols.start in (None, 0) and cols.stop is end and is_call(rows.start, {operator.sub}) and rows.start.args[0] is end:
            return buf, "bottom_right"
        return None

    def _buffer_band(self, node, additive: bool):
        """A band kind for a (sliced) 0/1 buffer, or an additive one (0 visible, <= -1e4 hidden), or None."""
        found = self._sliced_buffer(node)
        if found is None:
            return None
        buf, align = found
        if additive:
            if not buf.is_floating_point():
                return None
            visible = buf == 0
            if not bool((buf[~visible] <= LARGE_NEGATIVE).all()):
                return None
        else:
            visible = buf != 0
        band = _band_of_matrix(visible)
        if band is None:
            return None
        return ("band", *band, align, "additive" if additive else "visible"), [node]

    def _built_band(self, node):
        """``(lo, hi, rows, cols, fill)`` for ``torch.ones(r, c)`` / ``torch.full((r, c), fill)`` under tril/triu, or None.

        The band describes the entries equal to ``fill`` (the others are 0).
        """
        lo = hi = None
        node = skip_casts(node)
        while _op(node, "tril", "triu"):
            d = arg(node, 1, "diagonal", 0)
            if not isinstance(d, int):
                return None
            if node.target in ("tril", torch.tril):
                hi = d if hi is None else min(hi, d)
            else:
                lo = d if lo is None else max(lo, d)
            node = skip_casts(node.args[0])
        if is_call(node, {torch.ones}) and node.args:
            size, fill = (node.args[0] if isinstance(node.args[0], (tuple, list)) else node.args), 1.0
        elif is_call(node, {torch.full}) and node.args:
            size, fill = node.args[0], const(arg(node, 1, "fill_value"))
        else:
            return None
        if not isinstance(size, (tuple, list)) or len(size) != 2 or fill is None or (lo is None and hi is None):
            return None
        return lo, hi, size[0], size[1], fill

    def _band_from_built(self, node, meaning: str):
        """A band kind for a mask built in the graph with tril/triu; ``meaning`` is how the code uses it."""
        node = _leading_broadcast(node)
        if meaning == "additive" and _op(node, "log"):  # log of a 0/1 band: 0 visible, -inf hidden
            node, meaning = node.args[0], "visible"
        built = self._built_band(node)
        if built is None:
            return None
        lo, hi, rows, cols, fill = built
        if meaning == "visible" and fill != 0:
            band = lo, hi
        elif (meaning == "hidden" and fill != 0) or (meaning == "additive" and fill <= LARGE_NEGATIVE):
            if lo is not None and hi is None:  # hidden: j - i >= lo
                band = None, lo - 1
            elif hi is not None and lo is None:  # hidden: j - i <= hi
                band = hi + 1, None
            else:
                return None
        else:
            return None
        return ("band", *band, "top_left", "size"), [rows, cols]

    def padding_additive(self, node):
        """The 2-D keep mask of BERT's ``(1 - m[:, None, None, :]) * c`` with ``c <= -1e4``, or None."""
        node = skip_casts(node)
        if not (is_call(node, {operator.mul, torch.mul}) or method(node, "mul")):
            return None
        a, b = node.args[0], node.args[1]
        if const(a) is not None:
            a, b = b, a
        c = const(b)
        if c is None or c > LARGE_NEGATIVE or not isinstance(a, fx.Node):
            return None
        a = skip_casts(a)
        if is_call(a, {operator.sub, torch.sub}) and const(a.args[0]) == 1.0 and isinstance(a.args[1], fx.Node):
            return expanded_2d(a.args[1])
        return None

    def fill_value(self, value) -> float | None:
        """A masking fill value (a number, a 0-d buffer, ``torch.tensor(c)``, ``torch.full((), c)``) if <= -1e4, else None."""
        while method(value, *CASTS):
            value = value.args[0]
        c = const(value)
        buf = self._buffer(value)
        if buf is not None and buf.numel() == 1 and buf.is_floating_point():
            c = float(buf)
        elif is_call(value, {torch.tensor}) and value.args:
            c = const(value.args[0])
        elif is_call(value, {torch.full}) and value.args and tuple(value.args[0]) == ():
            c = const(arg(value, 1, "fill_value"))
        return c if c is not None and c <= LARGE_NEGATIVE else None

    def additive_term(self, mask):
        """The term for ``scores + mask``."""
        keep = self.padding_additive(mask)
        if keep is not None:
            return "padding", [mask, keep]
        return self._buffer_band(mask, additive=True) or self._band_from_built(mask, "additive") or ("additive", [mask])

    def hidden_term(self, cond):
        """The term for ``scores.masked_fill(cond, -inf)``."""
        keep = keep_from_condition(cond)
        if keep is not None:
            base = expanded_2d(keep)
            if base is not None:
                return "padding", [keep, base]
            band = self._buffer_band(keep, additive=False) or self._band_from_built(keep, "visible")
            if band is not None:
                return band
        return self._band_from_built(cond, "hidden") or ("hidden", [cond])

    def visible_term(self, cond):
        """The term for ``torch.where(cond, scores, -inf)``."""
        base = expanded_2d(cond)
        if base is not None:
            return "padding", [cond, base]
        return self._buffer_band(cond, additive=False) or self._band_from_built(cond, "visible") or ("visible", [cond])
