"""The ``torch.Tensor`` protocol of biases: compile flattening, pickled state, torch-function routing.

:class:`~biasattn.bias.base.AttentionBias` keeps the algebra; its tensor-protocol methods delegate
here. This module knows no bias class by name: functions that must tell a bias from a plain tensor
take the bias base class as an argument.

Layers above the biases teach them about their own functions through two tables, so that a bias
never imports the code that consumes it:

- :func:`register_torch_function`: a torch function that takes a bias as it is (the attention API
  registers ``F.scaled_dot_product_attention``);
- :func:`register_torch_dispatch`: a custom op that unwraps a bias in ``__torch_dispatch__``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..errors import InputError
from .atoms import ATOM_CLASSES, class_name

MATERIALIZE_WARN_BYTES = 256 * 2**20
_warned_large_materialize = False

# ------------------------------------------------------------------------------- registration

#: Torch functions that take a bias as it is (function -> handler), checked first by ``__torch_function__``.
FUNCTION_HANDLERS: dict[Any, Callable] = {}
#: Custom ops (OpOverload -> handler) that take a bias argument and unwrap it in ``__torch_dispatch__``.
DISPATCH_HANDLERS: dict[Any, Callable] = {}


def register_torch_function(func, handler: Callable) -> None:
    """Send calls of the torch function ``func`` that meet a bias to ``handler(*args, **kwargs)`` unchanged."""
    FUNCTION_HANDLERS[func] = handler


def register_torch_dispatch(op, handler: Callable) -> None:
    """Send the custom op ``op`` to ``handler(*args, **kwargs)`` when it meets a bias below autograd."""
    DISPATCH_HANDLERS[op] = handler


# ------------------------------------------------------------------------------- torch function

_PASSTHROUGH = {
    torch.Tensor.dim,
    torch.Tensor.size,
    torch.Tensor.numel,
    torch.Tensor.__len__,
}
_PASSTHROUGH_NAMES = {
    "__get__", "dim", "size", "numel", "stride", "is_contiguous", "__len__",
    # metadata queries torch.compile makes on its inputs
    "requires_grad_", "storage_offset", "nelement", "element_size", "is_floating_point", "is_complex", "get_device",
    "_is_view", "untyped_storage", "_typed_storage", "storage", "data_ptr", "is_pinned", "is_shared",
    "is_inference", "is_conj", "is_neg", "_is_zerotensor", "dense_dim", "sparse_dim", "is_coalesced", "__format__",
}
_LAZY_FUNCTIONS = {torch.clone: "clone", torch.detach: "detach", torch.Tensor.clone: "clone", torch.Tensor.detach: "detach"}


def torch_function(bias_type: type, func, args: tuple, kwargs: dict) -> Any:
    """``__torch_function__`` of every bias: registered functions, metadata queries, lazy copies, else materialize."""
    handler = FUNCTION_HANDLERS.get(func)
    if handler is not None:
        return handler(*args, **kwargs)
    if (
        func in _PASSTHROUGH
        or getattr(func, "__name__", "") in _PASSTHROUGH_NAMES
        or getattr(func, "namespace", None) == "biasattn"  # our custom ops take biases as they are
    ):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if func in _LAZY_FUNCTIONS and isinstance(args[0], bias_type):
        # torch.clone(bias) / torch.detach(bias) (torch.compile clones its inputs) stay lazy.
        return getattr(args[0], _LAZY_FUNCTIONS[func])()
    return foreign(bias_type, func, args, kwargs)


def torch_dispatch(bias_type: type, func, args: tuple, kwargs: dict) -> Any:
    """``__torch_dispatch__`` of every bias: registered custom ops unwrap the bias, anything else materializes it."""
    handler = DISPATCH_HANDLERS.get(func)
    if handler is not None:  # our own custom ops (torch.compile path): the handler unwraps the bias
        return handler(*args, **kwargs)
    # Reached only below torch-function handling (autograd internals, tracing): same rule.
    return foreign(bias_type, func, args, kwargs)


def _flatten(obj, out: list):
    if isinstance(obj, (list, tuple)):
        for x in obj:
            _flatten(x, out)
    elif isinstance(obj, torch.Tensor):
        out.append(obj)


def foreign(bias_type: type, func, args, kwargs) -> Any:
    """Materialize every ``bias_type`` among ``args`` against the other tensors' shape, then call ``func``."""
    others: list[torch.Tensor] = []
    _flatten(list(args) + list(kwargs.values()), others)
    plain = [t for t in others if not isinstance(t, bias_type)]
    with torch._C.DisableTorchFunctionSubclass():
        target = torch.broadcast_shapes(*[t.shape for t in plain]) if plain else torch.Size()
    dtype = next((t.dtype for t in plain if t.is_floating_point()), torch.float32)

    def dense(x):
        if not isinstance(x, bias_type):
            if isinstance(x, (list, tuple)):
                return type(x)(dense(y) for y in x)
            return x
        B, H, Mq, Mk = x.sizes
        tail = list(target)[-4:]
        tail = [1] * (4 - len(tail)) + tail
        if len(target) >= 2:
            Mq, Mk = Mq or tail[2], Mk or tail[3]
        if Mq is None or Mk is None:
            raise InputError(
                f"{x._family()} is unsized and {getattr(func, '__name__', func)} gives no other tensor to size it; "
                "call bias.materialize((B, H, Mq, Mk)) explicitly"
            )
        B = B or (tail[0] if tail[0] != 1 else 1)
        H = H or (tail[1] if tail[1] != 1 else 1)
        nbytes = B * H * Mq * Mk * torch.finfo(dtype).bits // 8
        global _warned_large_materialize
        if nbytes > MATERIALIZE_WARN_BYTES and not _warned_large_materialize:
            _warned_large_materialize = True
            warnings.warn(
                f"{getattr(func, '__name__', func)} received a {x._family()} and materializes it as a dense "
                f"[{B}, {H}, {Mq}, {Mk}] tensor ({nbytes / 2**20:.0f} MiB); pass the bias to biasattn.attention "
                "or F.scaled_dot_product_attention to keep it lazy",
                stacklevel=3,
            )
        return x.materialize((B, H, Mq, Mk), dtype=dtype)

    args = tuple(dense(a) for a in args)
    kwargs = {k: dense(v) for k, v in kwargs.items()}
    return func(*args, **kwargs)


# ------------------------------------------------------------------------------- torch.compile
# The flatten protocol of traceable wrapper subclasses: the atoms' small tensors are the inner
# tensors (attributes ``_t0``, ``_t1``, ...); everything else is hashable metadata that
# torch.compile guards on. Sizes that follow from the wrapper's shape are stored as "outer", so
# a bias whose Mq/Mk change (an AdditiveBias under ``dynamic=True``) keeps the same metadata.


def flatten_ctx(cls, device, dtype, atoms, offsets, lengths, full) -> tuple:
    """The hashable metadata of ``AttentionBias.__tensor_flatten__`` (see the comment above)."""
    atom_ctx = []
    for a in atoms:
        tensors = a.tensors()
        fields = tuple((f.name, getattr(a, f.name)) for f in dataclasses.fields(a)
                       if f.name not in tensors and f.name not in a.HOST_FIELDS)
        atom_ctx.append((type(a), fields, tuple(tensors)))
    sized = tuple(n is not None for n in lengths)
    full = tuple("outer" if sized[d] and full[d] == offsets[d] + lengths[d] else full[d] for d in range(2))
    return (cls, device, dtype, tuple(atom_ctx), tuple(offsets), sized, full)


def ctx_by_name(ctx) -> tuple:
    """``ctx`` with classes replaced by ``"module:qualname"`` strings (graphs hold no classes)."""
    cls, device, dtype, atom_ctx, offsets, sized, full = ctx
    atom_ctx = tuple((f"{a.__module__}:{a.__qualname__}", fields, names) for a, fields, names in atom_ctx)
    return (f"{cls.__module__}:{cls.__qualname__}", device, dtype, atom_ctx, offsets, sized, full)


def ctx_by_class(ctx) -> tuple:
    """Inverse of :func:`ctx_by_name`."""
    cls, device, dtype, atom_ctx, offsets, sized, full = ctx
    atom_ctx = tuple((_class(a), fields, names) for a, fields, names in atom_ctx)
    return (_class(cls), device, dtype, atom_ctx, offsets, sized, full)


def _class(name: str) -> type:
    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def set_inner_tensors(bias, tensors: list | None = None) -> None:
    """Attach the atoms' tensors (``tensors`` where the caller listed them already) to ``bias`` as ``_t0``,
    ``_t1``, ... (an empty tensor when it has none)."""
    if tensors is None:
        tensors = [t for a in bias._atoms for t in a.tensors().values()]
    for n, t in enumerate(tensors):
        setattr(bias, f"_t{n}", t)
    if not tensors:  # fake-tensor conversion needs at least one inner tensor: an empty one
        with torch._C.DisableTorchFunctionSubclass():
            bias._t0 = torch.empty(0, dtype=torch.int32, device=bias.device)


def tensor_flatten(bias) -> tuple[list[str], tuple]:
    """``__tensor_flatten__``: the inner tensors' attribute names and the metadata, made once per bias (a
    bias never changes; torch.compile's guards flatten every bias argument on every call)."""
    flat = bias.__dict__.get("_flat")
    if flat is None:
        with torch._C.DisableTorchFunctionSubclass():
            device, dtype = bias.device, bias.dtype
        ctx = flatten_ctx(type(bias), device, dtype, bias._atoms, bias._offsets, bias._lengths, bias._full)
        n = sum(len(names) for _, _, names in ctx[3])
        flat = bias.__dict__["_flat"] = (tuple(f"_t{i}" for i in range(max(n, 1))), ctx)
    return list(flat[0]), flat[1]


def stable_hash(bias) -> str:
    """Deterministic key of the metadata and inner-tensor layout (torch.compile's graph caches)."""
    names, ctx = bias.__tensor_flatten__()
    with torch._C.DisableTorchFunctionSubclass():
        shape = tuple(bias.shape)
    inner = [(tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device)) for t in (getattr(bias, n) for n in names)]
    return hashlib.blake2b(repr((ctx_by_name(ctx), shape, inner)).encode(), digest_size=16).hexdigest()


def tensor_unflatten(inner: dict, ctx, outer_size, outer_stride):
    """``__tensor_unflatten__``: the bias that ``ctx`` describes, on the inner tensors ``inner``."""
    cls, device, dtype, atom_ctx, offsets, sized, full = ctx
    inner_list = [inner[f"_t{n}"] for n in range(len(inner))]
    anchor = inner_list[0] if not any(names for _, _, names in atom_ctx) else None
    atoms = []
    for atom_cls, fields, tensor_names in atom_ctx:
        kwargs = dict(fields)
        for name in tensor_names:
            kwargs[name] = inner_list.pop(0)
        atoms.append(atom_cls(**kwargs))
    self = torch.Tensor._make_wrapper_subclass(
        cls, outer_size, strides=outer_stride, dtype=dtype, device=device, requires_grad=False
    )
    lengths = tuple(outer_size[2 + d] if sized[d] else None for d in range(2))
    self._atoms = tuple(atoms)
    self._offsets = offsets
    self._lengths = lengths
    self._full = tuple(offsets[d] + lengths[d] if full[d] == "outer" else full[d] for d in range(2))
    if anchor is not None:
        self._t0 = anchor
    else:
        set_inner_tensors(self)
    return self


# ------------------------------------------------------------------------------- pickling

#: Every bias class by :func:`~.atoms.class_name`; unpickling builds biases from this table only.
BIAS_CLASSES: dict[str, type] = {}
_STATE_VERSION = 1


def pickled_state(bias) -> tuple:
    """The state ``AttentionBias.__reduce_ex__`` writes: class names, atom fields and tensors, geometry."""
    atoms = tuple(
        (
            class_name(type(a)),
            tuple((f.name, getattr(a, f.name)) for f in dataclasses.fields(a) if f.name not in a.tensors()),
            tuple(a.tensors().items()),
        )
        for a in bias._atoms
    )
    return (_STATE_VERSION, class_name(type(bias)), str(bias.device), atoms, bias._offsets, bias._lengths, bias._full)


def read_state(state: tuple) -> tuple:
    """Inverse of :func:`pickled_state`: ``(cls, atoms, offsets, lengths, device, full)``.

    Classes are looked up among the registered bias and atom classes only (never imported by name),
    so loading a file with ``torch.load(weights_only=True)`` runs no other code.
    """
    version, cls_name, device, atom_states, offsets, lengths, full = state
    if version != _STATE_VERSION:
        raise InputError(f"a pickled bias has state version {version!r}, this biasattn reads version {_STATE_VERSION}")
    cls = _registered(BIAS_CLASSES, cls_name, "bias class")
    atoms = []
    for atom_name, fields, tensors in atom_states:
        atoms.append(_registered(ATOM_CLASSES, atom_name, "bias atom")(**dict(fields), **dict(tensors)))
    if any(a.tensors() for a in atoms):
        device = None  # the tensors' device: torch.load's map_location has moved them
    elif torch.device(device).type == "cuda" and not torch.cuda.is_available():
        device = "cpu"  # a bias of sizes only follows q's device anyway
    return cls, atoms, tuple(offsets), tuple(lengths), device, tuple(full)


def _registered(table: dict[str, type], name: str, what: str) -> type:
    try:
        return table[name]
    except KeyError:
        raise InputError(f"a pickled bias names the {what} {name!r}, which this biasattn does not define") from None
