"""Recognising naive attention sites in an FX graph (used by :mod:`biasattn.integrations.fx`).

:class:`Matcher` walks back from a ``weights @ v`` product through casts and dropout to a softmax,
then through the mask terms and the scale to ``q @ kᵀ``. Walking back, an addition met *before*
the scale was applied *after* it (``q kᵀ · c + m``), which is exactly what the fused call computes;
an additive term met *after* the scale was scaled together with the scores and is refused.

Masks are described as terms ``(kind, nodes)`` for :func:`~biasattn.integrations.fx.fused_attention`.
A band kind is the tuple ``("band", lo, hi, align, fallback)``: key j is visible to query i iff
``lo <= j - i - shift <= hi`` (``None`` = unbounded; ``shift`` is 0 top-left, ``Mk - Mq``
bottom-right); ``fallback`` says what its nodes are: ``"visible"``/``"additive"`` (the mask tensor
as the code used it) or ``"size"`` (the rows and columns the code built it with).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

MATMUL = {operator.matmul, torch.matmul, torch.bmm}
SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax}
CASTS = {"float", "double", "to", "type", "type_as", "half", "bfloat16", "contiguous"}
LARGE_NEGATIVE = -1e4
_FULL = slice(None, None, None)


def is_call(node, targets) -> bool:
    """Whether ``node`` calls one of the functions ``targets``."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def method(node, *names) -> bool:
    """Whether ``node`` calls a tensor method named in ``names``."""
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target in names


def arg(node, i, name, default=None):
    """Argument ``i`` of ``node``, positional or by keyword ``name``."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def const(x) -> float | None:
    """``x`` as a float if it is a Python number."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def is_matmul(node) -> bool:
    """Whether ``node`` is a matrix product (``@``, ``torch.matmul``, ``bmm``)."""
    return is_call(node, MATMUL) or method(node, "matmul", "bmm")


def skip_casts(node):
    """``node`` with single-use dtype casts peeled off."""
    while method(node, *CASTS) and len(node.users) == 1:
        node = node.args[0]
    return node


def _op(node, *names) -> bool:
    """``torch.name(x, ...)`` or ``x.name(...)``."""
    return method(node, *names) or is_call(node, {getattr(torch, n) for n in names if hasattr(torch, n)})


def expanded_2d(node):
    """The 2-D node ``m`` if ``node`` is ``m[:, None, None, :]`` / ``m[:, None, None]`` / ``m.unsqueeze(1).unsqueeze(2)``."""
    node = skip_casts(node)
    if is_call(node, {operator.getitem}) and node.args[1] in ((_FULL, None, None, _FULL), (_FULL, None, None)):
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
            if idx and idx[0] is None and all(s == _FULL for s in rest):
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


@dataclass
class Site:
    """One recognised attention site: its inputs, mask terms, scale and dropout, and the nodes it replaces."""

    q: fx.Node
    k: Any  # kᵀ as written while ``k_transposed``
    v: Any
    terms: list
    scale: Any
    scale_text: str
    dropout: Any
    dropout_text: str
    chain: list
    notes: list[str] = field(default_factory=list)
    meta: list = field(default_factory=list)
    resized: list = field(default_factory=list)  # (``scores.size(d)`` node, the same size read from q or kᵀ)
    k_transposed: bool = True


class Matcher:
    """Recognises attention sites in ``gm``; buffers are read to tell causal and banded masks."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.modules = dict(gm.named_modules())

    # -------------------------------------------------------------------------------- masks

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
        if not all(s == _FULL for s in idx[:-2]):
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

    # -------------------------------------------------------------------------------- keys

    def unrepeat(self, node):
        """``x`` if ``node`` is ``repeat_kv(x)``: ``x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)``."""
        if not method(node, "reshape", "view") or not method(node.args[0], "expand"):
            return None
        expand = node.args[0]
        sizes = list(node.args[1:]) if len(node.args) > 2 else list(node.args[1])
        grow = list(expand.args[1:]) if len(expand.args) > 2 else list(expand.args[1])
        inner = expand.args[0]
        new_axis = ((_FULL, _FULL, None, _FULL, _FULL), (_FULL, _FULL, None))
        if not is_call(inner, {operator.getitem}) or inner.args[1] not in new_axis:
            return None
        # [b, h, n, s, d] -> [b, ?, s, d] with b, s, d the same values: ? can only be h * n, heads repeated in groups
        if len(sizes) != 4 or len(grow) != 5 or sizes[0] is not grow[0] or sizes[2] is not grow[3] or sizes[3] is not grow[4]:
            return None
        return inner.args[0]

    # -------------------------------------------------------------------------------- sites

    def _softmax_dim(self, node):
        """The softmax dim if ``node`` is a softmax, else None."""
        if is_call(node, SOFTMAX) or method(node, "softmax"):
            return arg(node, 1, "dim")
        if node.op == "call_module" and isinstance(self.modules.get(node.target), nn.Softmax):
            return self.modules[node.target].dim
        return None

    def leads_to_matmul(self, node) -> bool:
        """Whether ``node`` is on the scores chain (reaches q @ kᵀ through scores-shaped ops)."""
        for _ in range(16):
            if not isinstance(node, fx.Node):
                return False
            if is_matmul(node):
                return True
            if node.op in ("call_function", "call_method") and node.args and isinstance(node.args[0], fx.Node):
                if is_call(node, {operator.add, torch.add, operator.mul, torch.mul}) and isinstance(node.args[1], fx.Node):
                    return self.leads_to_matmul(node.args[0]) or self.leads_to_matmul(node.args[1])
                node = node.args[0]
            else:
                return False
        return False

    def _weights(self, node):
        """Walk from the weights back to the softmax: ``(softmax, chain, dropout, dropout_text)``, a reason, or None."""
        chain, dropout, dropout_text = [], 0.0, "none"
        while isinstance(node, fx.Node):
            if method(node, *CASTS):
                chain.append(node)
                node = node.args[0]
            elif node.op == "call_module" and isinstance(self.modules.get(node.target), nn.Dropout):
                chain.append(node)
                dropout, dropout_text = ("module", node.target), f"module {node.target}"
                node = node.args[0]
            elif is_call(node, {F.dropout}):
                chain.append(node)
                prob, training = arg(node, 1, "p", 0.5), arg(node, 2, "training", True)
                if not isinstance(training, bool) or const(prob) is None:
                    return "dropout with a run-time training flag or probability"
                dropout = float(prob) if training else 0.0
                dropout_text = f"{dropout}"
                node = node.args[0]
            else:
                return node, chain, dropout, dropout_text
        return None

    def match(self, out: fx.Node):
        """Describe the site ending at matmul ``out`` as a :class:`Site`, a reason string, or None (not attention)."""
        if not is_matmul(out) or not all(isinstance(a, fx.Node) for a in out.args[:2]):
            return None
        walked = self._weights(out.args[0])
        if walked is None or isinstance(walked, str):
            return walked
        node, chain, dropout, dropout_text = walked
        dim = self._softmax_dim(node)
        if dim is None:
            return None
        if dim != -1:
            return f"softmax over dim {dim!r}, not -1 (the rank is unknown when tracing)"
        chain.append(node)
        site = self._scores(node.args[0], chain)
        if isinstance(site, str):
            return site
        site.v, site.dropout, site.dropout_text = out.args[1], dropout, dropout_text
        reason = self._private(site, out)
        if reason:
            return reason
        k, v = peel_transpose(site.k), self.unrepeat(site.v)
        if k is not None and v is not None and self.unrepeat(k) is not None:
            site.k, site.v, site.k_transposed = self.unrepeat(k), v, False
            site.notes.append("k and v heads repeated per group: passed as grouped-query heads")
        elif k is not None:
            site.k, site.k_transposed = k, False
        if is_call(site.q, {operator.mul, operator.truediv}) or method(site.q, "mul", "div"):
            site.notes.append("q scaled before the product (kept as written)")
        return site

    def _private(self, site: Site, out) -> str | None:
        """A reason if a node of the site is used outside it.

        Records the metadata reads (``scores.dtype``) erased with the site and the ``scores.size(-1)``
        reads used elsewhere, which then read q's or kᵀ's size.
        """
        inside = {*site.chain, out}
        for n in site.chain:
            for u in n.users:
                if u in inside:
                    continue
                meta = (is_call(u, {getattr}) and u.args[1] in ("dtype", "device", "shape")) or method(u, "size", "dim")
                # a cast of something else to the scores' dtype, used only inside (GPT-2's fill value)
                casts = [w for w in u.users if w not in inside and method(w, *CASTS) and all(x in inside for x in w.users)]
                if meta and all(w in inside or w in casts for w in u.users):
                    site.meta.extend([u, *casts])
                    continue
                if method(u, "size") and len(u.args) == 2 and u.args[1] in (-2, -1):  # GPT-2's ``w.size(-1)``
                    site.resized.append((u, (site.q, -2) if u.args[1] == -2 else (site.k, -1)))
                    continue
                return f"{n.name} is used outside the attention (e.g. the weights are returned)"
        return None

    def _scores(self, scores, chain):
        """Walk from the softmax input back to ``q @ kᵀ``: a :class:`Site` (without v and dropout) or a reason."""
        terms: list = []
        scale: Any = 1.0
        scale_text, scaled = "1", False
        while True:
            if not isinstance(scores, fx.Node):
                return "scores are not a graph value"
            chain.append(scores)
            if is_matmul(scores):
                break
            if method(scores, *CASTS):
                scores = scores.args[0]
            elif is_call(scores, {operator.add, torch.add}) or method(scores, "add"):
                a, b = scores.args[0], scores.args[1]
                if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
                    return "a number added to the scores"
                if scaled:  # met after the scale: the code computes (q kᵀ + mask) · scale
                    return "an additive mask added before the scale (the code scales the mask with the scores)"
                if self.leads_to_matmul(b) and not self.leads_to_matmul(a):
                    a, b = b, a
                terms.append(self.additive_term(b))
                scores = a
            elif method(scores, "masked_fill") or is_call(scores, {torch.masked_fill}):
                cond, value = scores.args[1], scores.args[2]
                fill = self.fill_value(value)
                if fill is None or (scaled and fill != float("-inf")):
                    return f"masked_fill with value {value!r}{' before the scale' if scaled else ''}: not a mask"
                terms.append(self.hidden_term(cond))
                scores = scores.args[0]
            elif is_call(scores, {torch.where}) and len(scores.args) == 3:
                cond, a, value = scores.args
                fill = self.fill_value(value)
                if fill is None or (scaled and fill != float("-inf")) or not isinstance(a, fx.Node):
                    return f"torch.where with fill value {value!r}{' before the scale' if scaled else ''}: not a mask"
                terms.append(self.visible_term(cond))
                scores = a
            elif is_call(scores, {operator.mul, torch.mul, operator.truediv, torch.div}) or method(scores, "mul", "div"):
                a, b = scores.args[0], scores.args[1]
                div = scores.target in (operator.truediv, torch.div, "div")
                if not div and not self.leads_to_matmul(a):
                    a, b = b, a
                if not isinstance(a, fx.Node) or (isinstance(b, fx.Node) and self.leads_to_matmul(b)) or scaled:
                    return "scores multiplied by something other than one scale"
                if const(b) is not None and const(b) <= 0:
                    return f"scores scaled by {b}, not a positive number"
                scaled = True
                if const(b) is not None:
                    scale = 1.0 / const(b) if div else const(b)
                    scale_text = f"{scale:.6g}"
                else:
                    scale, scale_text = (b, div), f"{'1/' if div else ''}{b}"
                scores = a
            else:
                return f"unrecognised op {scores.op} {getattr(scores.target, '__name__', scores.target)} in the scores"
        return Site(scores.args[0], scores.args[1], None, terms[::-1], scale, scale_text, 0.0, "none", chain)


def peel_transpose(kt):
    """``k`` if ``kt`` is spelled as ``k``'s transpose of the last two dims, else None."""
    if method(kt, "transpose") or is_call(kt, {torch.transpose}):
        if len(kt.args) >= 3 and {kt.args[1], kt.args[2]} in ({-2, -1}, {2, 3}):
            return kt.args[0]
    if method(kt, "permute") and tuple(kt.args[1:]) in ((0, 1, 3, 2),):
        return kt.args[0]
    if is_call(kt, {getattr}) and kt.args[1] == "mT":
        return kt.args[0]
    return None
