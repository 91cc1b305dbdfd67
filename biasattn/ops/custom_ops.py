"""``torch.library`` custom ops: how attention runs under ``torch.compile`` and ``torch.export``.

Under compilation, :func:`biasattn.attention` (and ``attention_with_lse``, and SDPA with a bias) call
:func:`attention`, which issues two layers of ops:

- ``biasattn::attention_fwd(q, k, v, bias, bias_tensors, ...)`` with a registered autograd formula
  whose backward is ``biasattn::attention_bwd``. ``bias`` is the lazy bias itself (a tensor
  subclass) and ``bias_tensors`` its inner tensors, passed again so that gradients reach an
  additive tensor.
- ``biasattn::attention_fwd_flat`` / ``attention_bwd_flat``: the same on plain tensors, the bias
  given by its inner tensors, its flatten metadata as a string and its shape (defined on a
  ``torch.library.Library``: a call costs less host time than through a ``custom_op`` wrapper).
  When a bias reaches ``attention_fwd``, ``AttentionBias.__torch_dispatch__`` sends it here; a call
  without a bias issues it directly. So the compiled graph holds only plain tensors, and the
  metadata string is computed outside Dynamo.

The flat ops run the ordinary eager path (validation, :mod:`biasattn.dispatch`, an operator's raw
``fwd``/``bwd``) at run time, so ``use_ops`` and ``op=`` work inside compiled code. Their fake
implementations give the output shapes without touching the bias, which keeps ``dynamic=True``
graphs free of per-length guards. The operators chosen in the forward (and the dropout seed) travel
to the backward on an empty ``state`` tensor (see :func:`_state`).

Under ``torch.compile(mode="reduce-overhead")`` the calls run inside torch's CUDA graph trees: while a
graph warms up or records, what a call derives (a mask's tile tables, launch plans) is dropped when the
call ends and only the outputs carry state, since the trees refuse live allocations of their pool that
no graph returns; replays then cost no host time, whatever lengths were written into the mask's
tensors. Dropout is refused there (the seed is drawn on the host).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import itertools
import math
import operator
import sys

import torch
from torch import Tensor

from .. import dispatch, memo
from ..bias import protocol
from ..bias.atoms import tensor_version
from ..bias.base import AttentionBias
from ..inputs import as_bias, make_inputs
from ..memo import BoundedCache
from .common import compute_dtype, in_layout_of_rows, new_like_rows

# ------------------------------------------------------------------------------- bias <-> strings


def bias_metadata(bias: AttentionBias) -> tuple[str, list]:
    """``(metadata string, shape)`` of ``bias``: with its inner tensors, enough to rebuild it."""
    _, ctx = bias.__tensor_flatten__()
    cls, device, dtype, atom_ctx, offsets, sized, full = _concrete(protocol.ctx_by_name(ctx))
    text = repr((cls, str(device), str(dtype).replace("torch.", ""), atom_ctx, offsets, sized, full))
    return text, list(bias.shape)


def _concrete(x):
    """``x`` with symbolic ints made concrete (host metadata such as sequence lengths specializes the graph)."""
    if isinstance(x, torch.SymInt):
        return int(x)
    if isinstance(x, tuple):
        return tuple(_concrete(y) for y in x)
    return x


@functools.lru_cache(maxsize=512)
def _parse_metadata(text: str) -> tuple:
    cls, device, dtype, atom_ctx, offsets, sized, full = ast.literal_eval(text)
    ctx = (cls, torch.device(device), getattr(torch, dtype), atom_ctx, offsets, sized, full)
    return protocol.ctx_by_class(ctx)


#: Biases rebuilt by the forward op, by metadata and the identity and version of their tensors: the
#: layers of a compiled model receive the same mask tensors, and share one bias (its spec, its tile
#: tables) as eager layers given one mask object do. An entry holds its tensors, so their ids stay
#: unique; only biases of integer tensors (lengths, layouts: small) are kept, never an additive tensor.
_REBUILT = BoundedCache(8)


def shared_bias(tensors: list[Tensor], text: str, shape: list[int]) -> AttentionBias | None:
    """:func:`rebuild_bias`, returning the bias rebuilt before from these very tensors, unmodified."""
    if not text or any(t.is_floating_point() for t in tensors):
        return rebuild_bias(tensors, text, shape)
    key = (text, tuple(shape), *[(id(t), tensor_version(t)) for t in tensors])
    bias = _REBUILT.get(key)
    if bias is None:
        bias = _REBUILT[key] = rebuild_bias(tensors, text, shape)
    return bias


def rebuild_bias(tensors: list[Tensor], text: str, shape: list[int]) -> AttentionBias | None:
    """Inverse of :func:`bias_metadata` (``text == ""`` means no bias)."""
    if not text:
        return None
    ctx = _parse_metadata(text)
    n = sum(len(names) for _, _, names in ctx[3])
    inner = {f"_t{i}": t for i, t in enumerate(tensors[:n])}
    if not inner:
        inner["_t0"] = tensors[0] if tensors else torch.empty(0, dtype=torch.int32, device=ctx[1])
    shape = tuple(int(s) for s in shape)
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(4))
    return AttentionBias.__tensor_unflatten__(inner, ctx, shape, stride)


def inner_tensors(bias: AttentionBias | None) -> list[Tensor]:
    """The bias' inner tensors ``_t0, _t1, ...`` (traceable by Dynamo: plain attribute reads)."""
    if bias is None:
        return []
    out = []
    for n in itertools.count():
        if not hasattr(bias, f"_t{n}"):
            return out
        out.append(getattr(bias, f"_t{n}"))
    return out  # pragma: no cover


# ------------------------------------------------------------------------------- forward state
# The forward's ``state`` output is an empty tensor on q's device (nothing to copy, nothing that makes
# torch split a CUDA graph); what the backward needs rides on it as a Python attribute: the forward and
# backward operators, the forward operator's ctx (a dropout seed, a vendor kernel's raw lse), and the
# validated inputs of a forward run with gradients in mind (a backward that receives that very tensor
# lowers nothing again). Everything goes with the state tensor. A backward given a state without the
# attribute (a graph replayed from its recorded outputs) dispatches again: dispatch depends on shapes,
# dtypes and the bias's structure only, so it chooses as the forward did.
_STATE = "_biasattn_forward_state"


def _state(device: torch.device, fwd_op, bwd_op, saved, inp=None) -> Tensor:
    state = torch.empty(0, dtype=torch.int64, device=device)
    setattr(state, _STATE, (fwd_op, bwd_op, saved, inp))
    return state


# ------------------------------------------------------------------------------- flat ops


def _in_graph_trees(device: torch.device) -> bool:
    """Whether torch's CUDA-graph trees (``torch.compile(mode="reduce-overhead")``) are warming up or
    recording a graph on ``device`` in this very call: what the call derives must then die with it.
    The trees warm up and record on a stream of their own; a call on another stream (a default-mode
    compiled call while a tree sits in warm-up, a graph captured by hand) is not theirs."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None or device.type != "cuda":
        return False
    manager = trees.get_manager(device.index, create_if_none_exists=False)
    # while recording, the tree's state says so only afterwards: the capture itself tells
    if manager is None or not (manager.in_warmup or torch.cuda.is_current_stream_capturing()):
        return False
    stream = getattr(manager, "stream", None)
    return stream is None or torch.cuda.current_stream(device) == stream


def _call_context(graphed: bool):
    """The context of a flat op's call: :func:`biasattn.memo.transient` inside CUDA-graph trees."""
    return memo.transient() if graphed else contextlib.nullcontext()


@contextlib.contextmanager
def _autograd_available():
    """Undo the exclusion of the autograd dispatch keys that custom-op kernels run under."""
    exclude = torch._C._dispatch_tls_local_exclude_set() - _AUTOGRAD_KEYS
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


_AUTOGRAD_KEYS = functools.reduce(operator.or_, (torch._C.DispatchKeySet(k) for name, k in
                                                 torch._C.DispatchKey.__members__.items() if name.startswith("Autograd")))


def _fake_outputs(q: Tensor, k: Tensor, v: Tensor, scale, dropout_p) -> tuple[Tensor, Tensor, Tensor]:
    make_inputs(q, k, v, None, scale=scale, dropout_p=dropout_p, requires_grad=False)  # shape/dtype checks
    B, H, M = q.shape[0], q.shape[1], q.shape[2]
    out = new_like_rows(q, (B, H, M, v.shape[3]))
    lse = q.new_empty((B, H, M), dtype=compute_dtype(q.dtype))
    return out, lse, q.new_empty(0, dtype=torch.int64)


def _contiguous_like(t: Tensor) -> Tensor:
    return t.new_empty(t.shape)  # gradients come back contiguous, whatever the inputs' strides


_LIB = torch.library.Library("biasattn", "FRAGMENT")  # the flat ops: defined directly (less host time per call)
_LIB.define(
    "attention_fwd_flat(Tensor q, Tensor k, Tensor v, Tensor[] bias_tensors, str bias_metadata, SymInt[] bias_shape, "
    "float? scale, float dropout_p, bool requires_grad, bool need_lse, str op) -> (Tensor, Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_LIB.define(
    "attention_bwd_flat(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor state, "
    "Tensor[] bias_tensors, str bias_metadata, SymInt[] bias_shape, float? scale, float dropout_p, bool[] bias_grad, "
    "str op=\"\") "
    "-> (Tensor, Tensor, Tensor, Tensor[])",
    tags=(torch.Tag.pt2_compliant_tag,),
)
attention_fwd_flat = torch.ops.biasattn.attention_fwd_flat.default
attention_bwd_flat = torch.ops.biasattn.attention_bwd_flat.default


def _attention_fwd_flat(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias_tensors: list[Tensor],
    bias_metadata: str,
    bias_shape: list[int],
    scale: float | None,
    dropout_p: float,
    requires_grad: bool,
    need_lse: bool,
    op: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``biasattn::attention_fwd_flat``, attention forward on plain tensors:
    ``(out [B, Hq, Mq, Dv], lse [B, Hq, Mq], state)`` (``state``: see :func:`_state`)."""
    graphed = _in_graph_trees(q.device)
    with _call_context(graphed):
        bias = shared_bias(bias_tensors, bias_metadata, bias_shape)
        inp, fwd_op, bwd_op = dispatch.prepare(q, k, v, bias, scale=scale, dropout_p=dropout_p, need_lse=need_lse,
                                               op=op or None, requires_grad=requires_grad)
        if graphed and dropout_p > 0:
            raise RuntimeError(
                "biasattn: dropout inside CUDA graph trees (torch.compile(mode='reduce-overhead')) is not supported: "
                "the triton operator draws its seed on the host, so every replay would drop the same weights, and "
                f"the vendor kernels' random state outlives the graph; got dropout_p={dropout_p}. Compile without "
                "CUDA graphs, or use dropout_p=0 there")
        with torch.no_grad():
            out, lse, saved = fwd_op.fwd(inp)
        if graphed:  # the backward rebuilds what it needs from the outputs: nothing else may outlive the graph
            keep, saved = None, saved if isinstance(saved, int) else None
        else:
            keep = inp if requires_grad and bwd_op is not None else None
        state = _state(q.device, fwd_op, bwd_op, saved, keep)
        return in_layout_of_rows(q, out), lse.to(compute_dtype(q.dtype)).contiguous(), state


_LIB.impl("attention_fwd_flat", _attention_fwd_flat, "CompositeExplicitAutograd")


@torch.library.register_fake("biasattn::attention_fwd_flat")
def _(q, k, v, bias_tensors, bias_metadata, bias_shape, scale, dropout_p, requires_grad, need_lse, op):
    return _fake_outputs(q, k, v, scale, dropout_p)


def _dispatch_again(q, k, v, bias_tensors, text, shape, scale, dropout_p, need_lse, op) -> tuple:
    """The forward state of a backward whose state tensor lost it (see :func:`_state`): the operators
    chosen again, no ctx (a dropout seed cannot be recovered)."""
    if dropout_p > 0:
        raise RuntimeError("biasattn: the forward's dropout seed did not reach the backward (a graph replayed from its "
                           f"recorded outputs); dropout_p={dropout_p} needs eager calls or compiled ones without CUDA graphs")
    bias = rebuild_bias(bias_tensors, text, shape)
    _, fwd_op, bwd_op = dispatch.prepare(q, k, v, bias, scale=scale, dropout_p=dropout_p, need_lse=need_lse,
                                         op=op or None, requires_grad=True)
    return fwd_op, bwd_op, None, None


def _attention_bwd_flat(
    dout: Tensor,
    dlse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    state: Tensor,
    bias_tensors: list[Tensor],
    bias_metadata: str,
    bias_shape: list[int],
    scale: float | None,
    dropout_p: float,
    bias_grad: list[bool],
    op: str = "",
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """``biasattn::attention_bwd_flat``, attention backward on plain tensors: ``(dq, dk, dv, dbias)``;
    ``dbias[i]`` is empty unless ``bias_grad[i]``; ``op`` is the forward's forced operator, if any."""
    # operators may use autograd inside (reference), and so does dbias below
    with _autograd_available(), _call_context(_in_graph_trees(q.device)):
        _, bwd_op, saved, fwd_inp = getattr(state, _STATE, None) or _dispatch_again(
            q, k, v, bias_tensors, bias_metadata, bias_shape, scale, dropout_p, dlse is not None, op)
        if bwd_op is None:
            raise RuntimeError("biasattn: the forward was run without gradients in mind; call it again with requires_grad "
                               "inputs")
        wanted = [t.detach().requires_grad_() if need else t for t, need in zip(bias_tensors, bias_grad)]
        if fwd_inp is not None and not any(bias_grad):  # the forward's bias, lowered once (tile tables and all)
            inp = fwd_inp.with_tensors(q, k, v, fwd_inp.spec.additive)
        else:
            with torch.enable_grad():
                bias = rebuild_bias(wanted, bias_metadata, bias_shape)
                inp = make_inputs(q, k, v, bias, scale=scale, dropout_p=dropout_p, requires_grad=True)
        with torch.no_grad():
            dout = dout if dout.stride(-1) == 1 else dout.contiguous()
            dq, dk, dv, dadd = bwd_op.bwd(inp, out, lse, saved, dout, dlse)
        leaves = [t for t, need in zip(wanted, bias_grad) if need]
        grads: list[Tensor | None] = [None] * len(leaves)
        if leaves and dadd is not None and inp.additive is not None and inp.additive.requires_grad:
            grads = list(torch.autograd.grad(inp.additive, leaves, dadd, allow_unused=True))
    it = iter(grads)
    dbias = []
    for t, need in zip(bias_tensors, bias_grad):
        if need:
            g = next(it)
            dbias.append(torch.zeros_like(t) if g is None else g.contiguous())
        else:
            dbias.append(t.new_empty(0))
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dbias


_LIB.impl("attention_bwd_flat", _attention_bwd_flat, "CompositeExplicitAutograd")


@torch.library.register_fake("biasattn::attention_bwd_flat")
def _(dout, dlse, q, k, v, out, lse, state, bias_tensors, bias_metadata, bias_shape, scale, dropout_p, bias_grad, op=""):
    dbias = [t.new_empty(t.shape) if need else t.new_empty(0) for t, need in zip(bias_tensors, bias_grad)]
    return _contiguous_like(q), _contiguous_like(k), _contiguous_like(v), dbias


# ------------------------------------------------------------------------------- ops taking the bias


@torch.library.custom_op("biasattn::attention_fwd", mutates_args=())
def attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    bias_tensors: list[Tensor],
    scale: float | None,
    dropout_p: float,
    requires_grad: bool,
    need_lse: bool,
    op: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention forward with the lazy ``bias`` (None here; a bias is routed to the flat op by dispatch)."""
    if bias is not None:  # a plain tensor: AttentionBias subclasses never get here
        raise TypeError("biasattn::attention_fwd takes an AttentionBias or None as bias")
    return attention_fwd_flat(q, k, v, [], "", [], scale, dropout_p, requires_grad, need_lse, op)


@attention_fwd.register_fake
def _(q, k, v, bias, bias_tensors, scale, dropout_p, requires_grad, need_lse, op):
    return _fake_outputs(q, k, v, scale, dropout_p)


@torch.library.custom_op("biasattn::attention_bwd", mutates_args=())
def attention_bwd(
    dout: Tensor,
    dlse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    bias_tensors: list[Tensor],
    out: Tensor,
    lse: Tensor,
    state: Tensor,
    scale: float | None,
    dropout_p: float,
    bias_grad: list[bool],
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """Attention backward with the lazy ``bias`` (None here, as for :func:`attention_fwd`)."""
    if bias is not None:
        raise TypeError("biasattn::attention_bwd takes an AttentionBias or None as bias")
    return attention_bwd_flat(dout, dlse, q, k, v, out, lse, state, [], "", [], scale, dropout_p, [])


@attention_bwd.register_fake
def _(dout, dlse, q, k, v, bias, bias_tensors, out, lse, state, scale, dropout_p, bias_grad):
    return _contiguous_like(q), _contiguous_like(k), _contiguous_like(v), []


def _fwd_with_bias(q, k, v, bias, bias_tensors, scale, dropout_p, requires_grad, need_lse, op):
    text, shape = bias_metadata(bias)
    return attention_fwd_flat(q, k, v, list(bias_tensors), text, shape, scale, dropout_p, requires_grad, need_lse, op)


def _bwd_with_bias(dout, dlse, q, k, v, bias, bias_tensors, out, lse, state, scale, dropout_p, bias_grad):
    text, shape = bias_metadata(bias)
    return attention_bwd_flat(
        dout, dlse, q, k, v, out, lse, state, list(bias_tensors), text, shape, scale, dropout_p, list(bias_grad)
    )


protocol.register_torch_dispatch(torch.ops.biasattn.attention_fwd.default, _fwd_with_bias)
protocol.register_torch_dispatch(torch.ops.biasattn.attention_bwd.default, _bwd_with_bias)


def _save(ctx, q, k, v, bias_tensors, out, lse, state, scale, dropout_p, need_lse) -> None:
    ctx.save_for_backward(q, k, v, out, lse, state, *bias_tensors)
    ctx.scale, ctx.dropout_p, ctx.need_lse = scale, dropout_p, need_lse
    ctx.bias_grad = [t.requires_grad and t.is_floating_point() for t in bias_tensors]


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, bias, bias_tensors, scale, dropout_p, requires_grad, need_lse, op = inputs
    _save(ctx, q, k, v, bias_tensors, *output, scale, dropout_p, need_lse)
    ctx.bias = bias


def _lse_grad(ctx, dlse):
    """``dlse`` when the caller asked for lse, else None: traced backward graphs fill the gradient of an
    output nobody saw with zeros, and a zero ``dlse`` would cost the backward its launch plan."""
    return dlse if ctx.need_lse else None


def _backward(ctx, dout, dlse, dstate):
    q, k, v, out, lse, state, *bias_tensors = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dlse = _lse_grad(ctx, dlse)
    dq, dk, dv, dbias = attention_bwd(
        dout, dlse, q, k, v, ctx.bias, bias_tensors, out, lse, state, ctx.scale, ctx.dropout_p, ctx.bias_grad
    )
    grads = [d if need else None for d, need in zip(dbias, ctx.bias_grad)]
    return dq, dk, dv, None, grads, None, None, None, None, None


def _setup_context_flat(ctx, inputs, output) -> None:
    q, k, v, bias_tensors, text, shape, scale, dropout_p, requires_grad, need_lse, op = inputs
    _save(ctx, q, k, v, bias_tensors, *output, scale, dropout_p, need_lse)
    ctx.text, ctx.shape, ctx.op = text, shape, op


def _backward_flat(ctx, dout, dlse, dstate):
    q, k, v, out, lse, state, *bias_tensors = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dlse = _lse_grad(ctx, dlse)
    dq, dk, dv, dbias = attention_bwd_flat(
        dout, dlse, q, k, v, out, lse, state, bias_tensors, ctx.text, ctx.shape, ctx.scale, ctx.dropout_p, ctx.bias_grad,
        ctx.op,
    )
    grads = [d if need else None for d, need in zip(dbias, ctx.bias_grad)]
    shape_grad = None if len(ctx.shape) else []  # the input's structure: an empty list counts as a tensor list
    return dq, dk, dv, grads, None, shape_grad, None, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)
torch.library.register_autograd("biasattn::attention_fwd_flat", _backward_flat, setup_context=_setup_context_flat)


# ------------------------------------------------------------------------------- public entry


def attention(q, k, v, attn_bias=None, *, scale=None, dropout_p: float = 0.0, op=None, need_lse: bool = False):
    """``(out, lse)`` through the custom ops (what :func:`biasattn.attention` calls when compiling)."""
    bias = as_bias(attn_bias)
    tensors = inner_tensors(bias)
    requires_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or any(t.requires_grad for t in tensors)
    )
    name = "" if op is None else op if isinstance(op, str) else op.NAME
    # Under dynamic=True Dynamo makes Python floats (even the default dropout_p=0.0) symbolic, and a
    # symbolic float argument restarts the analysis; the comparisons pin the common values instead.
    dropout_p = 0.0 if dropout_p == 0 else dropout_p if isinstance(dropout_p, float) else float(dropout_p)
    scale = scale if scale is None or isinstance(scale, float) else float(scale)
    if bias is None:  # the flat op itself: one op fewer at run time
        out, lse, _ = attention_fwd_flat(q, k, v, [], "", [], scale, dropout_p, requires_grad, need_lse, name)
    else:
        out, lse, _ = attention_fwd(q, k, v, bias, tensors, scale, dropout_p, requires_grad, need_lse, name)
    return out, lse


__all__ = [
    "attention", "attention_bwd", "attention_bwd_flat", "attention_fwd", "attention_fwd_flat", "bias_metadata", "rebuild_bias",
]
