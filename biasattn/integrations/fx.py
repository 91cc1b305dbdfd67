"""Attention fusion: rewrite naive attention in an FX graph into :func:`biasattn.attention`.

``fuse_attention(module)`` traces ``module`` with :func:`torch.fx.symbolic_trace` (or takes a
``GraphModule``), finds every site of the form

    softmax(mask_terms(scale(q @ kᵀ)), dim=-1)  [-> casts, dropout]  @ v

and replaces it with one call of :func:`fused_attention`. Recognised pieces:

- ``kᵀ`` as ``k.transpose(-2, -1)`` (any spelling of the last two dims), ``k.permute(0, 1, 3, 2)``,
  ``k.mT``, or any other tensor (transposed back at run time); k and v repeated per head group
  (``x[:, :, None].expand(...).reshape(...)``, as ``repeat_kv`` writes it) pass as grouped-query heads;
- the scale as ``* c``, ``c *``, ``/ c`` (a number or a graph value such as ``k.size(-1) ** 0.5``);
  without one the scale is 1 (q and k scaled beforehand stay scaled, exactly as written);
- mask terms in any order, applied after the scale: ``+ mask`` (a float tensor), ``masked_fill(cond, fill)``,
  ``torch.where(cond, scores, fill)`` with ``fill`` -inf or at most -1e4 (a number, a 0-d buffer,
  ``torch.tensor(c)``, ``torch.full((), c)``); masks applied before the scale fuse only when they fill
  with -inf (an added mask would be scaled with the scores and is refused); dtype casts
  (``.float()``, ``.to(...)``, ``.type(...)``, ``.type_as(...)``) around the scores and the weights are skipped;
- dropout on the weights: ``nn.Dropout`` (its ``p`` and ``training`` are read at run time) or
  ``F.dropout(..., training=...)`` as traced.

Masks that are recognisably structured become lazy biases: a 0/1 or 0/-inf buffer that is a band
``lo <= j - i <= hi`` sliced top-left (``b[..., :T, :T]``) or bottom-right (GPT-2's
``b[..., Mk - Mq:Mk, :Mk]``), or a band built in the graph (``torch.ones(T, T).tril()``,
``torch.full((T, T), -inf).triu(1)``, ``torch.log(ones.tril().triu(-w))``) becomes
:class:`~biasattn.LowerTriangularMask`, :class:`~biasattn.LowerTriangularFromBottomRightMask` or
:class:`~biasattn.LocalAttentionMask` (a dense mask when the shapes leave no lazy equivalent); a
key-padding mask (a 2-D ``[B, S]`` tensor expanded as ``m[:, None, None, :]``, in
``masked_fill(m == 0, ...)`` or BERT's ``(1 - m) * -10000`` form) becomes lengths
(:class:`~biasattn.PaddedKeysMask`) or a broadcast ``[B, 1, 1, S]`` bias. Other masks pass as dense
tensors, exactly as the original code used them.

The returned :class:`FusionReport` lists every fused site (scale, masks, dropout, notes) and every
softmax-weighted product left alone, with the reason.

Rows whose keys are all masked give 0 (biasattn's rule) where the naive code gives a uniform average
(finite fill values) or NaN (``-inf``); all other rows agree to rounding.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from ..api import attention
from ..bias import AdditiveBias, AttentionBias, LocalAttentionMask, LowerTriangularFromBottomRightMask, LowerTriangularMask
from ..nn.multihead import compose, key_padding_bias
from .fx_nodes import is_matmul
from .fx_patterns import Matcher

# ------------------------------------------------------------------------------------ report


@dataclass
class FusedSite:
    """One rewritten attention site."""

    node: str
    scale: str
    masks: list[str]
    dropout: str
    notes: list[str] = field(default_factory=list)


@dataclass
class FusionReport:
    """What :func:`fuse_attention` did: the fused ``sites`` (with details) and the ``skipped`` candidates.

    Each ``skipped`` entry reads ``"<node>: <reason>"``, naming the ``weights @ v`` product left alone.
    """

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
            notes = "".join(f"; {n}" for n in s.notes)
            lines.append(f"  {s.node}: scale={s.scale}, {masks}, dropout={s.dropout}{notes}")
        lines += [f"  skipped: {why}" for why in self.skipped]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------ run time


def band_bias(lo: int | None, hi: int | None, align: str, mq: int, mk: int, device=None) -> AttentionBias:
    """The bias letting query i see key j iff ``lo <= j - i - shift <= hi`` (``None``: unbounded).

    ``shift`` is 0 for ``align="top_left"`` and ``Mk - Mq`` for ``"bottom_right"``. Causal bands and
    windows around the bottom-right diagonal become lazy masks; any other band is built densely
    (``[Mq, Mk]`` bool), as the code that spelled it did.
    """
    shift = mk - mq if align == "bottom_right" else 0
    if lo is None and hi == 0:
        return LowerTriangularFromBottomRightMask() if align == "bottom_right" else LowerTriangularMask()
    lo_b, hi_b = (None if x is None else x + shift - (mk - mq) for x in (lo, hi))  # around the bottom-right diagonal
    if lo_b is not None and hi_b is not None and lo_b <= 0 <= hi_b:
        return LocalAttentionMask(-lo_b, hi_b)
    rel = torch.arange(mk, device=device)[None, :] - torch.arange(mq, device=device)[:, None] - shift
    visible = torch.ones(mq, mk, dtype=torch.bool, device=device)
    if lo is not None:
        visible &= rel >= lo
    if hi is not None:
        visible &= rel <= hi
    return AdditiveBias(visible)


def _band_term(kind: tuple, tensors: list, q, k) -> AttentionBias:
    """The bias of a ``("band", lo, hi, align, fallback)`` term (see :mod:`.fx_masks`)."""
    _, lo, hi, align, fallback = kind
    mq, mk = q.shape[-2], k.shape[-2]
    if fallback == "size":
        rows, cols = tensors
        if (rows, cols) != (mq, mk):  # the code's mask broadcasts over a size-1 dim: rebuild it as it was
            return AdditiveBias(band_bias(lo, hi, "top_left", rows, cols, q.device).tensor.expand(mq, mk))
        return band_bias(lo, hi, align, mq, mk, q.device)
    (t,) = tensors
    if tuple(t.shape[-2:]) != (mq, mk):
        return AdditiveBias(t.bool() if fallback == "visible" else t.to(q.dtype))
    return band_bias(lo, hi, align, mq, mk, q.device)


def fused_attention(q, k, v, *terms, kinds: tuple, scale=1.0, dropout=0.0):
    """What a fused site calls: ``softmax(q kᵀ · scale + terms) v`` through :func:`biasattn.attention`.

    ``terms`` come in groups described by ``kinds``: ``"additive"`` (one float tensor, added),
    ``"hidden"`` (one bool tensor, True = masked), ``"visible"`` (True = kept), ``"causal"`` (no
    tensor: a lazy top-left causal mask), ``"padding"`` (the original expanded mask and the 2-D
    ``[B, S]`` keep mask it came from), or a band tuple ``("band", lo, hi, align, fallback)`` with
    two nodes (``fallback="size"``: the rows and columns of the built mask) or one (the mask tensor).
    ``dropout`` is a probability or an ``nn.Dropout`` (read at call time). The result has v's dtype.
    """
    if isinstance(dropout, nn.Module):
        dropout = dropout.p if dropout.training else 0.0
    if isinstance(scale, torch.Tensor):
        scale = float(scale)
    out_dtype = v.dtype
    if q.dtype != v.dtype:  # e.g. q.float() @ k.float(): the scores' precision wins, the weights meet v in v's dtype
        v = v.to(q.dtype)
    squeeze = q.dim() == 3  # [N, L, D] (batched matmul over one merged batch-head dim)
    if squeeze:
        q, k, v = q[:, None], k[:, None], v[:, None]
    biases: list[AttentionBias] = []
    it = iter(terms)
    for kind in kinds:
        if isinstance(kind, tuple):
            biases.append(_band_term(kind, [next(it) for _ in range(2 if kind[4] == "size" else 1)], q, k))
            continue
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
    return (out[:, 0] if squeeze else out).to(out_dtype)


def _mask_label(kind) -> str:
    """How the report names a mask term."""
    if not isinstance(kind, tuple):
        return kind
    _, lo, hi, align, _ = kind
    if lo is None and hi == 0:
        return "causal" if align == "top_left" else "causal (bottom-right)"
    return f"band {'-inf' if lo is None else lo} <= j - i <= {'inf' if hi is None else hi} ({align.replace('_', '-')})"


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
    matcher = Matcher(gm)
    report = FusionReport()
    graph = gm.graph
    for out in list(graph.nodes):
        if out.graph is not graph or not is_matmul(out):
            continue
        site = matcher.match(out)
        if site is None:
            continue
        if isinstance(site, str):
            report.skipped.append(f"{out.name}: {site}")
            continue
        with graph.inserting_before(out):
            k = graph.call_method("transpose", (site.k, -2, -1)) if site.k_transposed else site.k
            dropout, scale = site.dropout, site.scale
            if isinstance(dropout, tuple):  # an nn.Dropout: its p and training flag are read at run time
                dropout = graph.get_attr(dropout[1])
            if isinstance(scale, tuple):  # a graph value: the scale itself, or what the scores were divided by
                scale = graph.call_function(operator.truediv, (1.0, scale[0])) if scale[1] else scale[0]
            args = [site.q, k, site.v]
            for _, nodes in site.terms:
                args.extend(nodes)
            kinds = tuple(kind for kind, _ in site.terms)
            fused = graph.call_function(fused_attention, tuple(args), {"kinds": kinds, "scale": scale, "dropout": dropout})
        out.replace_all_uses_with(fused)
        for read, args in site.resized:
            read.args = args
        _erase(graph, [out, *site.chain, *site.meta])
        labels = [_mask_label(kind) for kind, _ in site.terms]
        report.sites.append(FusedSite(fused.name, site.scale_text, labels, site.dropout_text, site.notes))
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return gm, report


def _erase(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase ``nodes`` (the naive computation, now unused), users first."""
    left = list(dict.fromkeys(nodes))
    while left:
        free = [n for n in left if not n.users]
        if not free:
            raise RuntimeError(f"fuse_attention: nodes {[n.name for n in left]} are still used")
        for n in free:
            graph.erase_node(n)
            left.remove(n)


__all__ = ["FusedSite", "FusionReport", "band_bias", "fuse_attention", "fused_attention"]
