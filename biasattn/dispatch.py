"""Choosing operators: priority lists per device kind, explanations, and ``use_ops``.

The CUDA list is ordered by measured speed (``benchmarks/results/``); the dispatcher picks the
first operator with no reasons to refuse, separately for the forward and the backward pass.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import torch

from . import ops
from .bias import AttentionBias
from .bias.spec import kept_by_tokens, rebind, structure_token
from .errors import NotSupportedError
from .inputs import AttentionInputs, make_inputs
from .memo import BoundedCache
from .ops import autograd
from .ops.base import Operator
from .ops.common import interpreted

# Measured on the H200 (benchmarks/results/h200/dispatch.md, bf16, D=128, B·S=16384, S=2048 and 8192,
# commit 64158e0; earlier runs 0b2626b, 99b0abf, 2fd2e30, cd6c481 agree): cudnn is fastest wherever it
# runs (no mask, causal, additive bias forward, grouped heads: 0.28 vs triton's 0.39 ms forward and 1.19
# vs 2.02 ms forward+backward at 2k); triton beats flash2 everywhere both run (window 0.33 vs 0.46 ms
# forward, 1.29 vs 1.78 ms forward+backward; packed varlen 0.28 vs 0.31 ms and 1.00 vs 1.23 ms), and its
# backward beats cutlass's with a bias gradient. ``priority`` keeps triton_splitk for decode shapes, but
# for eager single queries cudnn (see CUDNN_DECODE_MAX_GROUPS); with padded caches triton_splitk reads
# only the keys present (S=8192: 0.121 ms against flash2's 1.306).
PRIORITY: dict[str, tuple[str, ...]] = {
    "cuda": ("triton_splitk", "cudnn", "triton", "flash2", "cutlass", "chunked", "reference"),
    "cpu": ("cpu_flash", "chunked", "reference"),
}
DEFAULT_PRIORITY: tuple[str, ...] = ("chunked", "reference")
SPLITK_MAX_MQ = 16  # triton_splitk is a decode kernel: only tried first for sequences of at most this many queries
# Single-query decoding with at most this many query heads per KV head, called eagerly: such steps are
# mostly host time, and the cudnn operator spends less of it than triton_splitk's split and merge
# launches (H200, eager calls back to back, B = 1, 4, 16, caches 1k, 8k and 32k: 0.98-1.53x
# triton_splitk's GB/s with 32 query heads per KV head, 1.0-1.63x with 4; against a cache that grows
# by one key per step, where triton_splitk has no launch plan, 1.13-1.64x). While a graph is being
# captured only GPU time counts, and there triton_splitk streams as fast or faster (cudnn at
# 0.82-1.016x its GB/s, CUDA-graph timed). With several queries per sequence triton_splitk is faster
# either way. Command: ``bench_decode.py --operators --eager --heads 32/1 32/8 --mq 1 --batch 1 4 16
# --mk 1024 8192 32768``.
CUDNN_DECODE_MAX_GROUPS = 32
# A few queries per sequence without grouped heads, on a batch of at least 512 (sequence, head) pairs
# and a cache of at most 8k keys: the cudnn operator streams faster too (H200, CUDA-graph timed, 32/32
# heads, 2 and 4 queries, B = 16 and 64, caches 1k and 8k: 1.008-1.032x triton_splitk's GB/s); at B = 4
# it loses at 1k (0.96-0.97x), from 16k keys the two tie within 2.5% either way, and at B = 1
# triton_splitk is 1.3-2.7x faster (``bench_decode.py --operators --heads 32/32 --mq 2 4``).
CUDNN_DECODE_UNGROUPED_MAX_MQ = 4
CUDNN_DECODE_UNGROUPED_MIN_PAIRS = 512
CUDNN_DECODE_UNGROUPED_MAX_MK = 8192
# Head-dim ranges where FlashAttention-2 goes before triton, per pass: (pass, lowest D, highest D, why).
# Measured on the H200 (benchmarks/results/h200/head_dims.md, bf16 and fp16, no bias and causal, S=2k and 8k):
#   PYTHONPATH=. python benchmarks/bench_dispatch.py --sizes 2048,8192 --cases none,causal \
#       --head-dims 64,80,96,128,192,256 --dtypes bf16,fp16
# The triton forward is ahead of flash2 at every head dim (D=192: 0.77-0.86x its time, D=256: 0.49-0.55x).
# At D=256 the triton backward is ahead too: forward+backward in 0.68-0.71x flash2's time with the Gluon kernel
# (Hopper), 0.93-0.95x with the triton.language kernels (gluon_backward=False).
HEAD_DIM_ORDER: tuple[tuple[str, int, int, str], ...] = (
    ("backward", 129, 255, "the triton backward takes 1.39-1.44x flash2's forward+backward time (D=192)"),
)
# With dropout, FlashAttention-2 goes before triton: drawing the mask costs our kernels 1.60-1.95x their
# time without dropout against FA2's 1.09-1.25x, which leaves triton at 0.84-1.00x flash2 on no bias,
# causal and window 1024 (results/h200/dropout.md at cac0379; cudnn, where it runs, beats both).


def priority(device_type: str, inp: AttentionInputs | None = None, *, backward: bool = False) -> tuple[str, ...]:
    """``PRIORITY[device_type]`` adjusted to the inputs and the pass: ``triton_splitk`` is tried first only
    for decode shapes; in the head-dim ranges of :data:`HEAD_DIM_ORDER` ``flash2`` goes before ``triton``."""
    return _ordered(device_type, inp, None, backward)


def priority_notes(device_type: str, inp: AttentionInputs) -> list[str]:
    """Why :func:`priority` moved operators for these inputs, one line per rule applied (both passes)."""
    notes: list[str] = []
    _ordered(device_type, inp, notes, False)
    if inp.requires_grad:
        backward: list[str] = []
        _ordered(device_type, inp, backward, True)
        notes += [n for n in backward if n not in notes]
    return notes


def _ordered(device_type: str, inp: AttentionInputs | None, notes: list[str] | None, backward: bool) -> tuple[str, ...]:
    order = list(PRIORITY.get(device_type, DEFAULT_PRIORITY))
    if inp is None or device_type != "cuda":
        return tuple(order)
    qs = inp.spec.host.q_seqstart
    longest = max((b - a for a, b in zip(qs, qs[1:])), default=0) if qs is not None else inp.Mq
    if longest > SPLITK_MAX_MQ and "triton_splitk" in order:  # not a decode shape: try it last of the compiled ops
        order.remove("triton_splitk")
        order.insert(order.index("cutlass") + 1 if "cutlass" in order else len(order), "triton_splitk")
        if notes is not None:
            notes.append(f"triton_splitk tried late: a sequence has {longest} queries, more than the "
                         f"{SPLITK_MAX_MQ} of a decode step")
    elif "cudnn" in order and "triton_splitk" in order and _cudnn_decodes_faster(inp, longest):
        order.remove("cudnn")
        order.insert(order.index("triton_splitk"), "cudnn")
        if notes is not None:
            notes.append(_cudnn_first_note(inp, longest))
    elif notes is not None and "triton_splitk" in order:
        where = "inside a CUDA graph capture (only GPU time counts)" if graph_capturing() else "called eagerly"
        notes.append(f"triton_splitk first: a decode step of {longest} {'query' if longest == 1 else 'queries'} per "
                     f"sequence with {inp.groups} query heads per KV head, {where}")
    if inp.dropout_p > 0 and "flash2" in order and "triton" in order:
        order.remove("flash2")
        order.insert(order.index("triton"), "flash2")
        if notes is not None:
            notes.append(f"flash2 before triton: dropout (p={inp.dropout_p:g}) costs flash2 less")
    elif (rule := _head_dim_rule(inp, backward)) is not None and "flash2" in order and "triton" in order:
        order.remove("flash2")
        order.insert(order.index("triton"), "flash2")
        if notes is not None:
            pass_, lo, hi, why = rule
            notes.append(f"flash2 before triton for the {pass_}: head dim {max(inp.D, inp.Dv)} is in {lo}..{hi}, where {why}")
    return tuple(order)


def _head_dim_rule(inp: AttentionInputs, backward: bool) -> tuple[str, int, int, str] | None:
    """The :data:`HEAD_DIM_ORDER` rule for this pass and head dim, or None."""
    d, pass_ = max(inp.D, inp.Dv), "backward" if backward else "forward"
    return next((r for r in HEAD_DIM_ORDER if r[0] == pass_ and r[1] <= d <= r[2]), None)


def _cudnn_first_note(inp: AttentionInputs, longest: int) -> str:
    if longest == 1:
        return (f"cudnn before triton_splitk: one query per sequence with {inp.groups} query heads per KV head "
                f"(at most {CUDNN_DECODE_MAX_GROUPS}), called eagerly, where host time decides; inside a CUDA "
                "graph capture triton_splitk goes first")
    return (f"cudnn before triton_splitk: {longest} queries per sequence without grouped heads, "
            f"{inp.B * inp.Hkv} (sequence, KV head) pairs (at least {CUDNN_DECODE_UNGROUPED_MIN_PAIRS}) and "
            f"{inp.Mk} keys (at most {CUDNN_DECODE_UNGROUPED_MAX_MK})")


def _cudnn_decodes_faster(inp: AttentionInputs, longest: int) -> bool:
    """Whether cuDNN beats ``triton_splitk`` on this decode step (see ``CUDNN_DECODE_MAX_GROUPS`` and
    ``CUDNN_DECODE_UNGROUPED_MAX_MQ``)."""
    if longest == 1:
        return inp.groups <= CUDNN_DECODE_MAX_GROUPS and not graph_capturing()
    return (longest <= CUDNN_DECODE_UNGROUPED_MAX_MQ and inp.groups == 1 and inp.Mk <= CUDNN_DECODE_UNGROUPED_MAX_MK
            and inp.B * inp.Hkv >= CUDNN_DECODE_UNGROUPED_MIN_PAIRS)


def graph_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_allowed: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("biasattn_allowed_ops", default=None)


@contextlib.contextmanager
def use_ops(*names: str) -> Iterator[None]:
    """Restrict the dispatcher to the named operators inside the block (like torch's ``sdpa_kernel``).

    Operators missing from the device's priority list (``triton`` on the CPU, under the Triton
    interpreter) are tried after it, in the order given.

    The restriction is held in a :mod:`contextvars` variable: it applies to the code of this thread
    (and to asyncio tasks created inside the block), but not to threads started inside the block,
    which begin with no restriction. Enter ``use_ops`` inside the thread's function, or run the
    function in a copy of this context (``contextvars.copy_context().run(fn)``).
    """
    for n in names:
        ops.get(n)
    token = _allowed.set(tuple(names))
    try:
        yield
    finally:
        _allowed.reset(token)


def candidates(device_type: str, inp: AttentionInputs | None = None, *, backward: bool = False) -> list[Operator]:
    """Operators the dispatcher will try for a device kind (and these inputs, and pass), in order."""
    order = list(priority(device_type, inp, backward=backward))
    allowed = _allowed.get()
    if allowed is not None:
        order = [n for n in order if n in allowed] + [n for n in allowed if n not in order]
    registered = set(ops.available())
    return [ops.get(n) for n in order if n in registered]


def _reasons(inp: AttentionInputs, need_lse: bool, backward: bool) -> dict[str, list[str]]:
    return {
        op.NAME: op.not_supported_reasons(inp, need_lse=need_lse, backward=backward)
        for op in candidates(inp.device.type, inp, backward=backward)
    }


def _first(inp: AttentionInputs, need_lse: bool, backward: bool) -> Operator | None:
    """The first candidate with no reasons (later candidates are not asked: a walk is part of a first call's host time)."""
    for op in candidates(inp.device.type, inp, backward=backward):
        if op.supports(inp, need_lse=need_lse, backward=backward):
            return op
    return None


def _first_pair(inp: AttentionInputs, need_lse: bool) -> tuple[Operator | None, Operator | None]:
    """``(first candidate that runs the forward, first that runs the backward)`` in one walk.

    An operator that can run the backward can run the forward (the backward only adds reasons), so
    the walk stops at the first backward-capable one, asking each operator at most twice. Where the
    backward has an order of its own (:func:`priority`), each pass walks its own.
    """
    order = candidates(inp.device.type, inp)
    if [op.NAME for op in order] != [op.NAME for op in candidates(inp.device.type, inp, backward=True)]:
        return _first(inp, need_lse, backward=False), _first(inp, need_lse, backward=True)
    fwd = None
    for op in order:
        if op.supports(inp, need_lse=need_lse, backward=True):
            return fwd or op, op
        if fwd is None and op.supports(inp, need_lse=need_lse, backward=False):
            fwd = op
    return fwd, None


def choose(inp: AttentionInputs, *, need_lse: bool = False, op=None) -> tuple[Operator, Operator | None]:
    """``(forward operator, backward operator or None)`` for ``inp``; raises NotSupportedError.

    A choice is kept in the spec's store under :func:`_decision_key`, so a call like an earlier one
    (the same spec: a bias reused, or a shared one) skips the walk; refusals are never kept. A
    cache-length mask alone (``PaddedKeysMask``, often built anew every decode step) keeps its choice
    in one store for all such specs: no operator's verdict reads the length values, only whether the
    host has them. So do packed documents whose lengths only the device holds (built every step from
    a data loader's tensor), per number of documents and band shape.
    """
    key = _decision_key(inp, need_lse, op)
    store = inp.spec.derived
    spec = inp.spec
    if spec.key_lengths_only:  # vendor kernels refuse lengths that only the device holds
        store, key = _length_mask_choices, (*key, spec.host.kv_seqlens is None)
    elif spec.q_seqstart is not None and spec.host.q_seqstart is None and spec.additive is None and (
            spec.alibi_slopes is None and spec.layout is None):  # packed lengths no operator can read
        bands = None if spec.band_lo is None else spec.band_lo.shape
        store, key = _length_mask_choices, (*key, "device segments", spec.features, spec.k_seqlen.shape, bands)
    try:
        decision = store.get(key)
    except TypeError:  # symbolic sizes (tracing) are unhashable: no caching
        return _choose(inp, need_lse, op)
    if decision is None:
        decision = store[key] = _choose(inp, need_lse, op)
    return decision


_length_mask_choices = BoundedCache(1024)

#: Calls prepared before, by :func:`_call_key`: ``(spec, slots, scale, requires_grad, forward, backward, direct)``,
#: ``direct`` the forward operator's :meth:`~biasattn.ops.base.Operator.direct_out` for a forward-only call
#: whose bias holds no tensor, else None.
_CALLS = BoundedCache(256)


def prepare(q, k, v, attn_bias=None, *, scale=None, dropout_p=0.0, need_lse=False, op=None, requires_grad=None):
    """``(inputs, forward operator, backward operator or None)``: :func:`~biasattn.inputs.make_inputs`
    then :func:`choose`, with their errors.

    A call on plain tensors without a bias, or with one whose spec follows from its structure (causal
    masks and windows; lengths only the device holds, as in a mask built every step from a GPU
    tensor), is prepared once per signature (:func:`_call_key`): a later call with that signature
    passed the same checks and gets the same choice, so it costs a lookup, and the kept spec takes
    the new bias's tensors (:func:`~biasattn.bias.spec.rebind`). ``requires_grad`` as in make_inputs.
    """
    key = _call_key(q, k, v, attn_bias, scale, dropout_p, need_lse, op, requires_grad)
    hit = _CALLS.get(key) if key is not None else None
    return _prepared(key, hit, q, k, v, attn_bias, scale, dropout_p, need_lse, op, requires_grad)


def attention_out(q, k, v, attn_bias=None, *, scale=None, dropout_p=0.0, op=None) -> torch.Tensor:
    """The output of :func:`biasattn.attention`, prepared as :func:`prepare` does. A forward-only call
    prepared before without a bias, or with one that holds no tensor, goes straight to the function
    its operator kept (:meth:`~biasattn.ops.base.Operator.direct_out`)."""
    key = _call_key(q, k, v, attn_bias, scale, dropout_p, False, op)
    hit = _CALLS.get(key) if key is not None else None
    if hit is not None and hit[6] is not None:
        return hit[6](q, k, v, hit[2] if scale is None else float(scale), float(dropout_p))
    inp, fwd, bwd = _prepared(key, hit, q, k, v, attn_bias, scale, dropout_p, False, op, None)
    return autograd.run(inp, fwd, bwd, need_lse=False)[0]


def _prepared(key, hit, q, k, v, attn_bias, scale, dropout_p, need_lse, op, requires_grad):
    """:func:`prepare` once the call's key and its entry in :data:`_CALLS` (or None) are known."""
    if hit is not None:
        spec, slots, kept_scale, requires_grad, fwd, bwd, _ = hit
        spec = rebind(spec, slots, attn_bias)
        scale = kept_scale if scale is None else float(scale)
        return AttentionInputs(q, k, v, attn_bias, spec, scale, float(dropout_p), requires_grad), fwd, bwd
    inp = make_inputs(q, k, v, attn_bias, scale=scale, dropout_p=dropout_p, requires_grad=requires_grad)
    fwd, bwd = choose(inp, need_lse=need_lse, op=op)
    if key is not None:
        kept = (inp.spec, ()) if attn_bias is None else kept_by_tokens(attn_bias, inp.B, inp.Hq, inp.Mq, inp.Mk, q.device)
        if kept is not None:
            direct = None
            if not (kept[1] or need_lse or inp.requires_grad):  # no tensor of the bias in the spec, forward only
                direct = fwd.direct_out(inp)
            _CALLS[key] = (*kept, inp.scale, inp.requires_grad, fwd, bwd, direct)
    return inp, fwd, bwd


def _call_key(q, k, v, bias, scale, dropout_p, need_lse, op, requires_grad=None) -> tuple | None:
    """What make_inputs and choose read for a call, where that is cheap to tell: the tensors' sizes,
    dtypes and devices, the bias's structure token, the sign of an explicit scale, whether dropout is
    on, the gradient mode and everything :func:`_decision_key` keys; None for other calls (a bias
    whose lowering reads a value, tensor subclasses, a value make_inputs must reject)."""
    T = torch.Tensor
    if type(q) is not T or type(k) is not T or type(v) is not T:
        return None
    if scale is not None and (type(scale) not in (float, int) or not math.isfinite(scale)):
        return None
    if type(dropout_p) not in (float, int) or not 0.0 <= dropout_p < 1.0:
        return None
    structure = None
    if bias is not None:
        structure = structure_token(bias) if isinstance(bias, AttentionBias) else None
        if structure is None:
            return None
    if requires_grad is None:
        requires_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    cuda = q.is_cuda
    return (
        q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, structure,
        None if scale is None else scale > 0, dropout_p > 0, need_lse, None if op is None else _op_key(op),
        bool(requires_grad), *_dispatch_state(cuda, "cuda" if cuda else q.device.type),
    )


def _decision_key(inp: AttentionInputs, need_lse: bool, op) -> tuple:
    """Everything a choice reads besides the spec: sizes, dtype, device, flags, the priority list,
    ``use_ops``, graph capture, the interpreter switch (CPU) and the registry. The thresholds and
    :data:`HEAD_DIM_ORDER` are constants of this module and not keyed."""
    q, k, v = inp.q, inp.k, inp.v
    dev = q.device
    add = inp.spec.additive
    return (
        q.shape, k.shape, v.shape[3], q.dtype, dev, None if op is None else _op_key(op), need_lse, inp.requires_grad,
        inp.dropout_p > 0,
        inp.scale > 0,
        add is not None and add.requires_grad, *_dispatch_state(dev.type == "cuda", dev.type), "dispatch",
    )


def _dispatch_state(cuda: bool, device_type: str) -> tuple:
    """What a choice reads besides the call: the deterministic switch, ``use_ops``, the priority list,
    graph capture (CUDA), the interpreter switch (CPU) and the registry (both kept choices key it)."""
    return (
        torch.are_deterministic_algorithms_enabled(), _allowed.get(), PRIORITY.get(device_type),
        cuda and torch.cuda.is_current_stream_capturing(), not cuda and interpreted(), ops.generation(),
    )


def _op_key(op):
    """A forced operator as a key: a registered operator object by its name, so the object and the name
    share one entry."""
    if isinstance(op, Operator) and op.NAME in ops.available() and ops.get(op.NAME) is op:
        return op.NAME
    return op


def _choose(inp: AttentionInputs, need_lse: bool, op) -> tuple[Operator, Operator | None]:
    """The walk behind :func:`choose`."""
    backward = inp.requires_grad
    if op is not None:
        forced = ops.get(op)
        why = forced.not_supported_reasons(inp, need_lse=need_lse, backward=backward)
        if why:
            raise NotSupportedError(f"operator {forced.NAME!r} was forced but cannot run {inp.describe()}", {forced.NAME: why})
        return forced, forced if backward else None
    same_op = backward and inp.dropout_p > 0  # the dropout mask lives in the forward operator
    if backward and not same_op:
        fwd, bwd = _first_pair(inp, need_lse)
    else:
        fwd = _first(inp, need_lse, backward=same_op)
        bwd = fwd if same_op else None
    if fwd is None:
        raise NotSupportedError(f"no operator can run {inp.describe()}", _reasons(inp, need_lse, backward=same_op))
    if not backward or same_op:
        return fwd, bwd
    if bwd is None:
        why = _reasons(inp, need_lse, backward=True)
        raise NotSupportedError(f"no operator can compute gradients for {inp.describe()}", why)
    return fwd, bwd


def explanation(inp: AttentionInputs, *, need_lse: bool = False, fold_unavailable: bool = False) -> str:
    """Human-readable report: every registered operator with 'chosen' or its reasons, in priority order.

    With ``fold_unavailable``, operators that cannot run on this device at all (GPU-only ones on a
    CPU machine) share one line per pass instead of one line each.
    """
    lines = [f"inputs: {inp.describe()}"]
    try:
        fwd, bwd = choose(inp, need_lse=need_lse)
    except NotSupportedError:
        fwd = bwd = None
    lines += [f"order: {note}" for note in priority_notes(inp.device.type, inp)]
    passes = [("forward", False)] + ([("backward", True)] if inp.requires_grad else [])
    for title, backward in passes:
        chosen = fwd if not backward else bwd
        lines.append(f"{title}:")
        same_op = inp.requires_grad and inp.dropout_p > 0
        reasons = _reasons(inp, need_lse, backward=backward or same_op)
        for name in ops.available():  # operators outside this device's priority list, with their reasons
            if name not in reasons:
                why = ops.get(name).not_supported_reasons(inp, need_lse=need_lse, backward=backward or same_op)
                reasons[name] = why or [_not_tried(name)]
        folded = _unavailable_here(inp.device) if fold_unavailable else {}
        for name, why in reasons.items():
            if name in folded:
                continue
            if chosen is not None and name == chosen.NAME:
                launch = chosen.describe_launch(inp) if not backward else None
                lines.append(f"  {name:<14} chosen" + (f": {launch}" if launch else ""))
            elif not why:
                lines.append(f"  {name:<14} available (lower priority)")
            else:
                lines.append(f"  {name:<14} " + "; ".join(why))
        if folded:
            groups: dict[str, list[str]] = {}
            for name, why in folded.items():
                groups.setdefault(why, []).append(name)
            text = "; ".join(f"{', '.join(names)} ({why})" for why, names in groups.items())
            lines.append(f"  {'not on ' + inp.device.type:<14} {text}")
        if chosen is None:
            lines.append("  -> no operator can run these inputs")
    return "\n".join(lines)


def _unavailable_here(device: torch.device) -> dict[str, str]:
    """Registered operators that cannot run on ``device`` whatever the inputs, with the reason in a few words."""
    out = {}
    for name in ops.available():
        op = ops.get(name)
        if device.type not in op.DEVICES:
            out[name] = f"{'/'.join(sorted(op.DEVICES))} only"
        elif why := op.environment_reasons(device):
            out[name] = "; ".join(why)
    return out


def _not_tried(name: str) -> str:
    """Why an operator that could run the inputs is not a candidate: ``use_ops`` left it out, or the
    device's priority list has no place for it."""
    allowed = _allowed.get()
    if allowed is not None and name not in allowed:
        return f"excluded by use_ops({', '.join(map(repr, allowed))})"
    return "not in this device's priority list; force it with op= or use_ops()"
