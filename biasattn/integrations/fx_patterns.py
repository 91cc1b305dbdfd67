"""Recognising naive attention sites in an FX graph (used by :mod:`biasattn.integrations.fx`).

:class:`Matcher` walks back from a ``weights @ v`` product through casts and dropout to a softmax,
then through the mask terms and the scale to ``q @ kᵀ``. Walking back, an addition met *before*
the scale was applied *after* it (``q kᵀ · c + m``), which is exactly what the fused call computes;
an additive term met *after* the scale was scaled together with the scores and is refused.

Mask terms are recognised by :class:`~biasattn.integrations.fx_masks.MaskReader`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .fx_masks import MaskReader
from .fx_nodes import CASTS, FULL_SLICE, SOFTMAX, arg, const, is_call, is_matmul, method


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
    """Recognises attention sites in ``gm``; their mask terms are read by a :class:`MaskReader`."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.modules = dict(gm.named_modules())
        self.masks = MaskReader(gm)

    # -------------------------------------------------------------------------------- keys

    def unrepeat(self, node):
        """``x`` if ``node`` is ``repeat_kv(x)``: ``x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)``."""
        if not method(node, "reshape", "view") or not method(node.args[0], "expand"):
            return None
        expand = node.args[0]
        sizes = list(node.args[1:]) if len(node.args) > 2 else list(node.args[1])
        grow = list(expand.args[1:]) if len(expand.args) > 2 else list(expand.args[1])
        inner = expand.args[0]
        new_axis = ((FULL_SLICE, FULL_SLICE, None, FULL_SLICE, FULL_SLICE), (FULL_SLICE, FULL_SLICE, None))
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
                terms.append(self.masks.additive_term(b))
                scores = a
            elif method(scores, "masked_fill") or is_call(scores, {torch.masked_fill}):
                cond, value = scores.args[1], scores.args[2]
                fill = self.masks.fill_value(value)
                if fill is None or (scaled and fill != float("-inf")):
                    return f"masked_fill with value {value!r}{' before the scale' if scaled else ''}: not a mask"
                terms.append(self.masks.hidden_term(cond))
                scores = scores.args[0]
            elif is_call(scores, {torch.where}) and len(scores.args) == 3:
                cond, a, value = scores.args
                fill = self.masks.fill_value(value)
                if fill is None or (scaled and fill != float("-inf")) or not isinstance(a, fx.Node):
                    return f"torch.where with fill value {value!r}{' before the scale' if scaled else ''}: not a mask"
                terms.append(self.masks.visible_term(cond))
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
