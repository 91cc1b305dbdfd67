"""Attention fusion: rewrite naive attention in an FX graph into :func:`biasattn.attention`.

``fuse_attention(module)`` traces ``module`` with :func:`torch.fx.symbolic_trace` (or takes a
``GraphModule``), finds every site of the form

    softmax(mask_terms(scale(q @ kᵀ)), dim=-1)  [-> eval-mode dropout]  @ v

and replaces it with one call of :func:`fused_attention`. Recognised pieces:

- ``kᵀ`` as ``k.transpose(-2, -1)`` (any spelling of the last two dims), ``k.permute(0, 1, 3, 2)``,
  ``k.mT``, or any other tensor (transposed back at run time);
- the scale as ``* c``, ``c *``, ``/ c`` (a number or a graph value such as ``k.size(-1) ** 0.5``);
  without one the scale is 1 (a ``q`` scaled beforehand stays scaled);
- mask terms in any order: ``+ mask`` (a float tensor), ``masked_fill(cond, -inf or a large negative)``,
  ``torch.where(cond, scores, -inf)``; dtype casts (``.float()``, ``.to(...)``, ``.type_as(...)``)
  around the scores and the weights are skipped;
- dropout on the weights: ``nn.Dropout`` (its ``p`` and ``training`` are read at run time) or
  ``F.dropout(..., training=...)`` as traced.

A mask that is recognisably causal — a buffer whose top-left ``[:T, :T]`` slice is lower-triangular,
as in GPT-style modules — becomes :class:`~biasattn.LowerTriangularMask`; a key-padding mask (a 2-D
``[B, S]`` tensor expanded as ``m[:, None, None, :]``, in ``masked_fill(m == 0, ...)`` or BERT's
``(1 - m) * -10000`` form) becomes lengths (:class:`~biasattn.PaddedKeysMask`) or a broadcast
``[B, 1, 1, S]`` bias. Other masks pass as dense tensors, exactly as the original code used them.

Rows whose keys are all masked give 0 (biasattn's rule) where the naive code gives a uniform average
(finite fill values) or NaN (``-inf``); all other rows agree to rounding.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..api import attention
from ..bias import AdditiveBias, AttentionBias, LowerTriangularMask
from ..nn.multihead import compose, key_padding_bias

_MATMUL = {operator.matmul, torch.matmul, torch.bmm}
_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax}
_CASTS = {"float", "to", "type_as", "half", "bfloat16"}
_LARGE_NEGATIVE = -1e4


# ------------------------------------------------------------------------------------ report


@dataclass
class FusedSite:
    """One rewritten attention site."""

    node: str
    scale: str
    masks: list[str]
    dropout: str


@dataclass
class FusionReport:
    """What :func:`fuse_attention` did: ``fused`` sites (with details) and ``skipped`` candidates (with reasons)."""

    sites: list[FusedSite] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def fused(self) -> int:
        """Number of attention sites replaced by biasattn.attention."""
        return len(self.sites)

    def __str__(self) -> str:
        lines = [f"fused {self.fused} attention site(s)"]
        for s in self.sites:
            masks = ", ".join(s.masks) or "no mask"
            lines.append(f"  {s.node}: scale={s.scale}, {masks}, dropout={s.dropout}")
        lines += [f"  skipped: {why}" for why in self.skipped]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------ run time


def fused_attention(q, k, v, *terms, kinds: tuple[str, ...], scale=1.0, dropout=0.0):
    """What a fused site calls: ``softmax(q kᵀ · scale + terms) v`` through :func:`biasattn.attention`.

    ``terms`` come in groups described by ``kinds``: ``"additive"`` (one float tensor, added),
    ``"hidden"`` (one bool tensor, True = masked), ``"visible"`` (True = kept), ``"causal"`` (no
    tensor: a lazy top-left causal mask), ``"padding"`` (the original expanded mask and the 2-D
    ``[B, S]`` keep mask it came from). ``dropout`` is a probability or an
    ``nn.Dropout`` (read at call time).
    """
    if isinstance(dropout, nn.Module):
        dropout = dropout.p if dropout.training else 0.0
    if isinstance(scale, torch.Tensor):
        scale = float(scale)
    squeeze = q.dim() == 3  # [N, L, D] (batched matmul over one merged batch-head dim)
    if squeeze:
        q, k, v = q[:, None], k[:, None], v[:, None]
    biases: list[AttentionBias] = []
    it = iter(terms)
    for kind in kinds:
        if kind == "causal":
            biases.append(LowerTriangularMask())
            continue
        if kind == "padding":
            expanded, keep = next(it), next(it)
            if keep.dim() == 2 and keep.shape[0] in (1, q.shape[0]) and not squeeze:
                biases.append(key_padding_bias(keep != 0))
                continue
            kind, t = "additive", expanded  # not the expected layout: use the mask as the code did
            if t.dtype == torch.bool:
                kind = "visible"
        else:
            t = next(it)
        if squeeze and t.dim() == 3:
            t = t[:, None]
        if kind == "additive":
            biases.append(AdditiveBias(t if t.dtype == torch.bool else t.to(q.dtype) if t.is_floating_point() else t.float()))
        elif kind == "hidden":
            biases.append(AdditiveBias(~t.bool()))
        elif kind == "visible":
            biases.append(AdditiveBias(t.bool()))
    bias = compose(biases, q.device)
    out = attention(q, k, v, bias, scale=float(scale), dropout_p=float(dropout))
    return out[:, 0] if squeeze else out


# ------------------------------------------------------------------------------------ matching


def _is_call(node, targets) -> bool:
    return node.op == "call_function" and node.target in targets


def _method(node, *names) -> bool:
    return node.op == "call_method" and node.target in names


def _arg(node, i, name, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _skip_casts(node):
    while isinstance(node, fx.Node) and _method(node, *_CASTS) and len(node.users) == 1:
        node = node.args[0]
    return node


def _is_softmax(node, modules) -> bool:
    if _is_call(node, _SOFTMAX) or _method(node, "softmax"):
        dim = _arg(node, 1, "dim")
        return dim == -1
    if node.op == "call_module" and isinstance(modules.get(node.target), nn.Softmax):
        return modules[node.target].dim == -1
    return False


def _is_matmul(node) -> bool:
    return isinstance(node, fx.Node) and (_is_call(node, _MATMUL) or _method(node, "matmul", "bmm"))


def _const(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _untranspose(kt, graph: fx.Graph):
    """``k`` such that ``kt == k.transpose(-2, -1)``: peel an explicit transpose, or add one."""
    if _method(kt, "transpose") or _is_call(kt, {torch.transpose}):
        dims = {d for d in kt.args[1:3]} if len(kt.args) >= 3 else set()
        if dims in ({-2, -1}, {2, 3}):
            return kt.args[0]
    if _method(kt, "permute") and tuple(kt.args[1:]) in ((0, 1, 3, 2),):
        return kt.args[0]
    if _is_call(kt, {getattr}) and kt.args[1] == "mT":
        return kt.args[0]
    with graph.inserting_after(kt):
        return graph.call_method("transpose", (kt, -2, -1))


def _expanded_2d(node):
    """The 2-D node ``m`` if ``node`` is ``m[:, None, None, :]`` / ``m[:, None, None]`` / ``m.unsqueeze(1).unsqueeze(2)``."""
    node = _skip_casts(node)
    if _is_call(node, {operator.getitem}) and isinstance(node.args[1], tuple):
        idx = node.args[1]
        full = slice(None, None, None)
        if idx in ((full, None, None, full), (full, None, None)):
            return node.args[0]
    if _method(node, "unsqueeze") and node.args[1] == 2:
        inner = node.args[0]
        if _method(inner, "unsqueeze") and inner.args[1] == 1:
            return inner.args[0]
    return None


def _keep_from_condition(cond):
    """For ``masked_fill(cond, ...)``: the node meaning "key kept" when ``cond`` is ``x == 0`` / ``~x``, else None."""
    if _is_call(cond, {operator.eq, torch.eq}) or _method(cond, "eq"):
        if cond.args[1] == 0:
            return cond.args[0]
    if _is_call(cond, {operator.invert, torch.logical_not}) or _method(cond, "logical_not", "bitwise_not"):
        return cond.args[0]
    return None


class _Matcher:
    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.modules = dict(gm.named_modules())

    def _buffer(self, node):
        """The tensor behind a ``get_attr`` node, or None."""
        if node.op != "get_attr":
            return None
        obj: Any = self.gm
        for part in node.target.split("."):
            obj = getattr(obj, part, None)
        return obj if isinstance(obj, torch.Tensor) else None

    def _top_left_slice(self, node):
        """``(buffer, node)`` if ``node`` is a buffer or a slice of it starting at 0 in its last two dims."""
        node = _skip_casts(node)
        buf = self._buffer(node)
        if buf is not None:
            return buf
        if _is_call(node, {operator.getitem}) and isinstance(node.args[1], tuple):
            buf = self._buffer(_skip_casts(node.args[0]))
            idx = node.args[1]
            if buf is not None and len(idx) == buf.dim() and all(isinstance(s, slice) and s.step is None for s in idx):
                if all(s.start in (None, 0) for s in idx[-2:]) and all(s == slice(None, None, None) for s in idx[:-2]):
                    return buf
        return None

    def _causal_visible(self, node) -> bool:
        """True if ``node`` (1 = kept) is a top-left slice of a lower-triangular 0/1 buffer."""
        buf = self._top_left_slice(node)
        if buf is None or buf.dim() < 2 or buf.shape[-1] != buf.shape[-2]:
            return False
        b = buf.reshape(-1, *buf.shape[-2:])
        tril = torch.ones(buf.shape[-2:], dtype=torch.bool, device=buf.device).tril()
        return bool(((b != 0) == tril).all())

    def _causal_additive(self, node) -> bool:
        buf = self._top_left_slice(node)
        if buf is None or buf.dim() < 2 or buf.shape[-1] != buf.shape[-2] or not buf.is_floating_point():
            return False
        b = buf.reshape(-1, *buf.shape[-2:])
        tril = torch.ones(buf.shape[-2:], dtype=torch.bool, device=buf.device).tril()
        return bool(((b == 0) == tril).all() and (b[:, ~tril] <= _LARGE_NEGATIVE).all())

    def _padding_additive(self, node):
        """The 2-D keep mask of BERT's ``(1 - m[:, None, None, :]) * c`` with ``c <= -1e4``, or None."""
        node = _skip_casts(node)
        if not (_is_call(node, {operator.mul, torch.mul}) or _method(node, "mul")):
            return None
        a, b = node.args[0], node.args[1]
        if _const(a) is not None:
            a, b = b, a
        c = _const(b)
        if c is None or c > _LARGE_NEGATIVE or not isinstance(a, fx.Node):
            return None
        a = _skip_casts(a)
        if _is_call(a, {operator.sub, torch.sub}) and _const(a.args[0]) == 1.0 and isinstance(a.args[1], fx.Node):
            return _expanded_2d(a.args[1])
        return None

    def match(self, out: fx.Node):
        """Describe the site ending at matmul ``out`` or return a reason string."""
        if not _is_matmul(out):
            return None
        p, v = out.args[0], out.args[1]
        if not isinstance(p, fx.Node) or not isinstance(v, fx.Node):
            return None
        chain = []  # intermediate nodes that must have no other users
        dropout: Any = 0.0
        dropout_text = "none"
        node = p
        while True:
            if _method(node, *_CASTS):
                chain.append(node)
                node = node.args[0]
            elif node.op == "call_module" and isinstance(self.modules.get(node.target), nn.Dropout):
                chain.append(node)
                dropout, dropout_text = ("module", node.target), f"module {node.target}"
                node = node.args[0]
            elif _is_call(node, {F.dropout}):
                chain.append(node)
                prob, training = _arg(node, 1, "p", 0.5), _arg(node, 2, "training", True)
                if not isinstance(training, bool) or _const(prob) is None:
                    return "dropout with a run-time training flag"
                dropout = float(prob) if training else 0.0
                dropout_text = f"{dropout}"
                node = node.args[0]
            else:
                break
        if not _is_softmax(node, self.modules):
            return None
        chain.append(node)
        scores = node.args[0]
        terms: list[tuple[str, list]] = []
        scale: Any = 1.0
        scale_text = "1"
        scaled = False
        while True:
            if not isinstance(scores, fx.Node):
                return "scores are not a graph value"
            chain.append(scores)
            if _is_matmul(scores):
                q, kt = scores.args[0], scores.args[1]
                break
            if _method(scores, *_CASTS):
                scores = scores.args[0]
            elif _is_call(scores, {operator.add, torch.add}) or _method(scores, "add"):
                a, b = scores.args[0], scores.args[1]
                if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
                    return "a number added to the scores"
                if self._leads_to_matmul(b) and not self._leads_to_matmul(a):
                    a, b = b, a
                if scaled:
                    return "a mask added before the scale"
                terms.append(self._additive_term(b))
                scores = a
            elif _method(scores, "masked_fill") or _is_call(scores, {torch.masked_fill}):
                cond, value = scores.args[1], scores.args[2]
                if _const(value) is None or _const(value) > _LARGE_NEGATIVE:
                    return f"masked_fill with value {value!r}"
                terms.append(self._hidden_term(cond))
                scores = scores.args[0]
            elif _is_call(scores, {torch.where}) and len(scores.args) == 3:
                cond, a, value = scores.args
                if _const(value) is None or _const(value) > _LARGE_NEGATIVE or not isinstance(a, fx.Node):
                    return "torch.where with a non-masking value"
                terms.append(self._visible_term(cond))
                scores = a
            elif _is_call(scores, {operator.mul, torch.mul, operator.truediv, torch.div}) or _method(scores, "mul", "div"):
                a, b = scores.args[0], scores.args[1]
                div = scores.target in (operator.truediv, torch.div, "div")
                if not div and not self._leads_to_matmul(a):
                    a, b = b, a
                if not isinstance(a, fx.Node) or (isinstance(b, fx.Node) and self._leads_to_matmul(b)) or scaled:
                    return "scores multiplied by something other than a scale"
                if any(kind == "additive" for kind, _ in terms):
                    return "an additive mask scaled with the scores"
                scaled = True
                if _const(b) is not None:
                    scale = 1.0 / _const(b) if div else _const(b)
                    scale_text = f"{scale:.6g}"
                else:
                    scale, scale_text = (b, "1/" if div else "") , f"{'1/' if div else ''}{b}"
                scores = a
            else:
                return f"unrecognised op {scores.op} {getattr(scores.target, '__name__', scores.target)} in the scores"
        for n in chain:
            if len(n.users) != 1:
                return f"{n.name} is used outside the attention (e.g. the weights are returned)"
        return q, kt, v, terms[::-1], scale, scale_text, dropout, dropout_text, chain

    def _leads_to_matmul(self, node) -> bool:
        """Whether ``node`` is on the scores chain (reaches q @ kᵀ through scores-shaped ops)."""
        for _ in range(16):
            if not isinstance(node, fx.Node):
                return False
            if _is_matmul(node):
                return True
            if node.op in ("call_function", "call_method") and node.args and isinstance(node.args[0], fx.Node):
                if _is_call(node, {operator.add, torch.add, operator.mul, torch.mul}) and isinstance(node.args[1], fx.Node):
                    return self._leads_to_matmul(node.args[0]) or self._leads_to_matmul(node.args[1])
                node = node.args[0]
            else:
                return False
        return False

    def _additive_term(self, mask):
        keep = self._padding_additive(mask)
        if keep is not None:
            return "padding", [mask, keep]
        if self._causal_additive(mask):
            return "causal", []
        return "additive", [mask]

    def _hidden_term(self, cond):
        keep = _keep_from_condition(cond)
        if keep is not None:
            base = _expanded_2d(keep)
            if base is not None:
                return "padding", [keep, base]
            if self._causal_visible(keep):
                return "causal", []
        return "hidden", [cond]

    def _visible_term(self, cond):
        base = _expanded_2d(cond)
        if base is not None:
            return "padding", [cond, base]
        if self._causal_visible(cond):
            return "causal", []
        return "visible", [cond]


# ------------------------------------------------------------------------------------ the pass


def _trace(module: nn.Module, concrete_args: dict | None) -> fx.GraphModule:
    """``symbolic_trace`` with buffers as graph values (so ``self.mask[:, :, :T, :T]`` traces and is recognised)."""
    tracer = fx.Tracer()
    tracer.proxy_buffer_attributes = True
    graph = tracer.trace(module, concrete_args=concrete_args)
    return fx.GraphModule(tracer.root, graph, type(module).__name__)


def fuse_attention(
    module: nn.Module | fx.GraphModule, *, concrete_args: dict | None = None
) -> tuple[fx.GraphModule, FusionReport]:
    """Rewrite every naive attention site of ``module`` into :func:`fused_attention` (biasattn.attention).

    ``module`` is traced as :func:`torch.fx.symbolic_trace` does (buffers become graph values;
    ``concrete_args`` is passed on) unless it is already a ``GraphModule``, which is then rewritten
    in place. Returns ``(graph module, report)``.
    """
    gm = module if isinstance(module, fx.GraphModule) else _trace(module, concrete_args)
    matcher = _Matcher(gm)
    report = FusionReport()
    graph = gm.graph
    for out in list(graph.nodes):
        if out.graph is not graph or not _is_matmul(out):
            continue
        found = matcher.match(out)
        if found is None:
            continue
        if isinstance(found, str):
            report.skipped.append(f"{out.name}: {found}")
            continue
        q, kt, v, terms, scale, scale_text, dropout, dropout_text, chain = found
        k = _untranspose(kt, graph)
        if isinstance(dropout, tuple):  # an nn.Dropout: its p and training flag are read at run time
            with graph.inserting_before(out):
                dropout = graph.get_attr(dropout[1])
        if isinstance(scale, tuple):  # a graph value: the scale itself, or what the scores were divided by
            value, div = scale[0], scale[1] == "1/"
            with graph.inserting_before(out):
                scale = graph.call_function(operator.truediv, (1.0, value)) if div else value
        args = [q, k, v]
        kinds = []
        for kind, nodes in terms:
            kinds.append(kind)
            args.extend(nodes)
        with graph.inserting_before(out):
            fused = graph.call_function(
                fused_attention, tuple(args), {"kinds": tuple(kinds), "scale": scale, "dropout": dropout}
            )
        out.replace_all_uses_with(fused)
        for n in [out, *chain]:  # the naive computation, now unused
            graph.erase_node(n)
        report.sites.append(FusedSite(fused.name, scale_text, [k_ for k_, _ in terms], dropout_text))
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return gm, report


__all__ = ["FusedSite", "FusionReport", "fuse_attention", "fused_attention"]
