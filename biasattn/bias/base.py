"""The tensor-subclass machinery shared by every bias family.

An :class:`AttentionBias` is a ``torch.Tensor`` wrapper subclass: it has a shape, dtype and device,
but no storage of its own. Its meaning is a tuple of *atoms* (a band, segments, padded keys, a block
layout, an additive tensor, ALiBi slopes), each of which knows how to materialize itself and how to
lower itself into a :class:`~biasattn.bias.spec.BiasSpec`. Composition concatenates atoms; slicing
records offsets. All ``__torch_function__`` handling lives here, so ``torch.compile`` support,
``.to()``, copying, pickling and foreign-op materialization are solved once for every family.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import BiasCompositionError, InputError
from .atoms import (  # noqa: F401  (as_lengths, visible_to_additive kept importable from here)
    ATOM_CLASSES,
    Atom,
    Geometry,
    as_lengths,
    class_name,
    visible_to_additive,
)

MATERIALIZE_WARN_BYTES = 256 * 2**20
_warned_large_materialize = False


def _merge_size(name: str, a: int | None, b: int | None, who: str) -> int | None:
    if a is None:
        return b
    if b is None or a == b:
        return a
    raise InputError(f"cannot compose biases: {who} fix {name}={a} and {name}={b}")


def _check_pairs(atoms: Sequence[Atom]) -> None:
    """Reject compositions that have no lowering, naming the pair of families."""
    seen: dict[str, Atom] = {}
    for atom in atoms:
        other = seen.get(atom.kind)
        if other is not None and not other.combinable_with(atom):  # type: ignore[attr-defined]
            raise BiasCompositionError(
                f"cannot compose {other.family} with {atom.family}: {other.incompatibility(atom)}"  # type: ignore[attr-defined]
            )
        seen.setdefault(atom.kind, atom)
    kinds = {a.kind for a in atoms}
    if "segments" in kinds:
        seg = seen["segments"]
        b = seg.sizes()[0]
        for a in atoms:
            ab = a.sizes()[0]
            if ab not in (None, 1) and a is not seg:
                raise BiasCompositionError(
                    f"cannot compose {seg.family} with {a.family}: a packed (block-diagonal) batch "
                    f"has batch size 1, {a.family} has batch size {ab}"
                )
        del b


class AttentionBias(torch.Tensor):
    """Base class of every biasattn bias: a lazy, broadcastable ``[B, H, Mq, Mk]`` additive bias.

    Shape dims that a bias does not fix are 1 (it broadcasts there); unsized masks take Mq and Mk
    from q and k at call time. Compose with ``&`` (masks) and ``+`` (masks and additive terms);
    slice lazily with ``bias[..., q0:q1, k0:k1]``; ``materialize(shape)`` gives the dense tensor.

    Every bias survives ``copy.copy`` (shares its small tensors), ``copy.deepcopy`` (copies them,
    keeping ``requires_grad``), ``pickle`` and ``torch.save``/``torch.load`` as the same lazy bias.
    ``torch.load`` works with its default ``weights_only=True`` once ``biasattn`` is imported: the
    library registers its rebuild function with ``torch.serialization.add_safe_globals``.
    """

    _atoms: tuple[Atom, ...]
    _offsets: tuple[int, int]
    _lengths: tuple[int | None, int | None]
    _full: tuple[int | None, int | None]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        BIAS_CLASSES[class_name(cls)] = cls

    @staticmethod
    def __new__(cls, *args, **kwargs):  # families define their own constructors
        raise TypeError(f"{cls.__name__} cannot be constructed directly; use a bias family such as LowerTriangularMask()")

    @classmethod
    def _create(
        cls,
        atoms: Sequence[Atom],
        offsets: tuple[int, int] = (0, 0),
        lengths: tuple[int | None, int | None] | None = None,
        device=None,
        full: tuple[int | None, int | None] | None = None,
    ) -> AttentionBias:
        atoms = tuple(atoms)
        _check_pairs(atoms)
        B = H = Mq = Mk = None
        who = " and ".join(sorted({a.family for a in atoms})) or "bias"
        for a in atoms:
            b, h, mq, mk = a.sizes()
            B = _merge_size("B", B, b, who)
            H = _merge_size("H", H, h, who)
            Mq = _merge_size("Mq", Mq, mq, who)
            Mk = _merge_size("Mk", Mk, mk, who)
        if full is not None:  # sizes fixed by bind()
            Mq = Mq if full[0] is None else full[0]
            Mk = Mk if full[1] is None else full[1]
        if lengths is None:
            lengths = (None if Mq is None else Mq - offsets[0], None if Mk is None else Mk - offsets[1])
        dtype = torch.float32
        for a in atoms:
            for t in a.tensors().values():
                if device is None:
                    device = t.device
                if t.is_floating_point() and not a.is_mask:
                    dtype = t.dtype
        shape = (B or 1, H or 1, lengths[0] if lengths[0] is not None else 1, lengths[1] if lengths[1] is not None else 1)
        if torch.compiler.is_dynamo_compiling():
            # Dynamo cannot trace _make_wrapper_subclass; a constructor call is placed in the graph instead.
            dev = torch.device(device if device is not None else "cpu")
            ctx = _flatten_ctx(cls, dev, dtype, atoms, offsets, lengths, (Mq, Mk))
            tensors = [t for a in atoms for t in a.tensors().values()]
            return _BiasConstructor(_ctx_by_name(ctx), shape, *tensors)
        device = _resolved(device)
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=device if device is not None else "cpu", requires_grad=False
        )
        self._atoms = atoms
        self._offsets = offsets
        self._lengths = lengths
        self._full = (Mq, Mk)
        self._set_inner_tensors()
        return self

    def _derive(self, atoms=None, offsets=None, lengths=None, cls=None, device=None, full=None) -> AttentionBias:
        return AttentionBias._create.__func__(  # type: ignore[attr-defined]
            cls or type(self),
            self._atoms if atoms is None else atoms,
            self._offsets if offsets is None else offsets,
            self._lengths if lengths is None else lengths,
            device=device if device is not None else self.device,
            full=self._full if full is None else full,  # sizes fixed by bind() survive slicing, .to(), clone()
        )

    # ----------------------------------------------------------------------------- metadata
    @property
    def atoms(self) -> tuple[Atom, ...]:
        """The terms this bias is made of."""
        return self._atoms

    @property
    def follows_q(self) -> bool:
        """True when the bias holds no tensor, or only tensors built from Python lists with no device given:
        it then runs on q's device (its small tensors are copied there once per device)."""
        return all(a.follows_q for a in self._atoms if a.tensors())

    @property
    def is_mask(self) -> bool:
        """True when the bias only hides keys (values are 0 or -inf)."""
        return all(a.is_mask for a in self._atoms)

    @property
    def sizes(self) -> tuple[int | None, int | None, int | None, int | None]:
        """``(B, H, Mq, Mk)`` the bias fixes, None where it broadcasts or takes the size from q/k."""
        return (self._batch(), self._heads(), self._lengths[0], self._lengths[1])

    def _batch(self):
        for a in self._atoms:
            if a.sizes()[0] is not None:
                return a.sizes()[0]
        return None

    def _heads(self):
        for a in self._atoms:
            if a.sizes()[1] is not None:
                return a.sizes()[1]
        return None

    def geometry(self, B: int, H: int, Mq: int, Mk: int) -> Geometry:
        """Resolve the bias' offsets and alignment sizes against a call of size ``[B, H, Mq, Mk]``."""
        fq, fk = self._full
        q_off, k_off = self._offsets
        if fq is not None and q_off + Mq > fq:
            raise InputError(f"attn_bias covers {fq - q_off} query rows, q has Mq={Mq}")
        if fk is not None and k_off + Mk > fk:
            raise InputError(f"attn_bias covers {fk - k_off} key columns, k has Mk={Mk}")
        return Geometry(
            B, H, Mq, Mk, q_off, k_off,
            fq if fq is not None else q_off + Mq,
            fk if fk is not None else k_off + Mk,
            (fq is not None or self._lengths[0] is None, fk is not None or self._lengths[1] is None),
        )

    # ----------------------------------------------------------------------------- meaning
    def materialize(self, shape: Sequence[int], dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """Dense additive tensor of ``shape = [B, H, Mq, Mk]``: 0 visible, -inf hidden, plus additive terms.

        This is the single definition of what a bias means; every operator is tested against it.
        """
        shape = tuple(int(s) for s in shape)
        if len(shape) != 4:
            raise InputError(f"materialize shape must be [B, H, Mq, Mk], got {list(shape)}")
        device = torch.device(device) if device is not None else self.device
        g = self.geometry(*shape)
        out = torch.zeros((1, 1, g.Mq, g.Mk), dtype=dtype, device=device)
        for a in self._atoms:
            out = out + a.dense(g, dtype, device)
        return out.expand(shape).contiguous()

    # ----------------------------------------------------------------------------- algebra
    def __and__(self, other):
        if not isinstance(other, AttentionBias):
            if not isinstance(other, torch.Tensor):
                return NotImplemented
            other = _mask_operand(self, other)
        for x in (self, other):
            if not x.is_mask:
                raise BiasCompositionError(
                    f"cannot compose {self._family()} & {other._family()}: '&' intersects masks and "
                    f"{x._family()} is additive; use '+' to add it ('+' binds tighter than '&': write (a & b) + c)"
                )
        return _compose(self, other)

    def __rand__(self, other):
        if isinstance(other, torch.Tensor) and not isinstance(other, AttentionBias):
            return _mask_operand(self, other) & self
        return NotImplemented

    def __add__(self, other):
        if isinstance(other, AttentionBias):
            return _compose(self, other)
        if isinstance(other, (torch.Tensor, int, float)):
            return _foreign(torch.Tensor.add, (self, other), {})
        return NotImplemented

    def __radd__(self, other):
        if isinstance(other, (torch.Tensor, int, float)):
            return _foreign(torch.Tensor.add, (other, self), {})
        return NotImplemented

    def __or__(self, other):
        raise BiasCompositionError(
            f"cannot compose {self._family()} | {getattr(other, '_family', lambda: type(other).__name__)()}: "
            "the union of masks has no lazy form; use '&' to intersect, or build a bool tensor"
        )

    def _family(self) -> str:
        return type(self).__name__

    # ----------------------------------------------------------------------------- slicing
    def __getitem__(self, index):
        if not isinstance(index, tuple):
            index = (index,)
        if index and index[0] is Ellipsis:
            index = index[1:]
        while len(index) > 2 and index[0] == slice(None):
            index = index[1:]
        if len(index) == 1:
            index = (index[0], slice(None))
        if len(index) != 2 or not all(isinstance(s, slice) for s in index):
            raise InputError(
                f"a bias can be sliced only on its last two dims as bias[..., q0:q1, k0:k1], got {index!r}"
            )
        offsets = list(self._offsets)
        lengths = list(self._lengths)
        for d, s in enumerate(index):
            if s.step not in (None, 1):
                raise InputError(f"bias slices need step 1, got step {s.step} on dim {d - 2}")
            n = lengths[d]
            if n is not None:
                start, stop, _ = s.indices(n)
                stop = max(stop, start)
            else:
                start = s.start or 0
                if start < 0 or (s.stop is not None and s.stop < 0):
                    raise InputError(
                        f"slicing an unsized bias needs non-negative bounds, got {s!r}; "
                        "size it first with bias.bind(Mq, Mk)"
                    )
                stop = s.stop
                if stop is not None and self._full[d] is None and any(a.needs_full_size for a in self._atoms):
                    raise InputError(
                        f"{self._family()} is aligned to the bottom-right corner, so a slice with an end "
                        "needs the full size; call bias.bind(Mq, Mk) before slicing"
                    )
            offsets[d] += start
            lengths[d] = None if stop is None else stop - start
        return self._derive(offsets=tuple(offsets), lengths=tuple(lengths))

    def bind(self, Mq: int, Mk: int) -> AttentionBias:
        """Fix the full query and key sizes of an unsized bias (needed before slicing a bottom-right one)."""
        for d, (name, n) in enumerate((("Mq", Mq), ("Mk", Mk))):
            if self._full[d] is not None and self._full[d] != n:
                raise InputError(f"bias is already sized {name}={self._full[d]}, cannot bind to {n}")
        if self._offsets != (0, 0):
            raise InputError("bind() a bias before slicing it, not after")
        return self._derive(lengths=(Mq, Mk), full=(Mq, Mk))

    # ----------------------------------------------------------------------------- lazy tensor methods
    def to(self, *args, **kwargs) -> AttentionBias:
        """Move or cast the bias' small tensors; stays lazy."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        atoms = tuple(a.to(device=device, dtype=dtype) for a in self._atoms)
        return self._derive(atoms=atoms, device=device or self.device)

    def cuda(self, device=None, non_blocking=False) -> AttentionBias:
        """The bias on a CUDA device; stays lazy."""
        if device is None or isinstance(device, int):
            device = torch.device("cuda", device) if isinstance(device, int) else torch.device("cuda")
        return self.to(device)

    def cpu(self) -> AttentionBias:
        """The bias on the CPU; stays lazy."""
        return self.to("cpu")

    def clone(self, *args, **kwargs) -> AttentionBias:
        """A copy with cloned metadata; stays lazy."""
        return self._derive(atoms=tuple(a.clone() for a in self._atoms))

    def detach(self) -> AttentionBias:
        """The bias with detached additive tensors; stays lazy."""
        return self._derive(atoms=tuple(a.detach() for a in self._atoms))

    # ----------------------------------------------------------------------------- copy and pickle
    def __copy__(self) -> AttentionBias:
        return self._derive()

    def __deepcopy__(self, memo: dict) -> AttentionBias:
        atoms = tuple(
            dataclasses.replace(a, **{n: copy.deepcopy(t, memo) for n, t in a.tensors().items()}) for a in self._atoms
        )
        out = self._derive(atoms=atoms)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol):
        atoms = tuple(
            (
                class_name(type(a)),
                tuple((f.name, getattr(a, f.name)) for f in dataclasses.fields(a) if f.name not in a.tensors()),
                tuple(a.tensors().items()),
            )
            for a in self._atoms
        )
        state = (_STATE_VERSION, class_name(type(self)), str(self.device), atoms, self._offsets, self._lengths, self._full)
        return (_rebuild_bias, (state,))

    def __repr__(self, *args, **kwargs) -> str:
        parts = ", ".join(repr(a) for a in self._atoms)
        extra = ""
        if self._offsets != (0, 0) or self._lengths != self._full:
            extra = f", offsets={self._offsets}, lengths={self._lengths}"
        return f"{type(self).__name__}({parts}{extra})"

    def show(self, Mq: int | None = None, Mk: int | None = None, *, batch: int = 0, head: int = 0, ax=None):
        """Draw the visibility pattern (and additive values) with matplotlib; returns the Axes."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:  # pragma: no cover - optional dependency
            raise ImportError("bias.show() needs matplotlib: pip install matplotlib") from e
        Mq = Mq or self._lengths[0]
        Mk = Mk or self._lengths[1]
        if Mq is None or Mk is None:
            raise InputError(f"{self._family()} is unsized: pass Mq and Mk to show()")
        B, H = self._batch() or 1, self._heads() or 1
        dense = self.materialize((B, H, Mq, Mk)).to("cpu", torch.float32)[batch, head]
        if ax is None:
            _, ax = plt.subplots(figsize=(4, 4 * Mq / max(Mk, 1) + 0.5))
        shown = torch.where(torch.isinf(dense), torch.full_like(dense, float("nan")), dense)
        if self.is_mask:
            shown = torch.where(torch.isinf(dense), 0.0, 1.0)
        ax.imshow(shown.numpy(), cmap="viridis" if not self.is_mask else "Blues", interpolation="nearest", vmin=None)
        ax.set_title(type(self).__name__, fontsize=9)
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
        return ax

    # ----------------------------------------------------------------------------- torch.compile
    # The flatten protocol of traceable wrapper subclasses: the atoms' small tensors are the inner
    # tensors (attributes ``_t0``, ``_t1``, ...); everything else is hashable metadata that
    # torch.compile guards on. Sizes that follow from the wrapper's shape are stored as "outer", so
    # a bias whose Mq/Mk change (an AdditiveBias under ``dynamic=True``) keeps the same metadata.
    def _set_inner_tensors(self) -> None:
        n = 0
        for a in self._atoms:
            for t in a.tensors().values():
                setattr(self, f"_t{n}", t)
                n += 1
        if n == 0:  # fake-tensor conversion needs at least one inner tensor: an empty anchor
            with torch._C.DisableTorchFunctionSubclass():
                self._t0 = torch.empty(0, dtype=torch.int32, device=self.device)

    def __tensor_flatten__(self):
        with torch._C.DisableTorchFunctionSubclass():
            device, dtype = self.device, self.dtype
        ctx = _flatten_ctx(type(self), device, dtype, self._atoms, self._offsets, self._lengths, self._full)
        n = sum(len(names) for _, _, names in ctx[3])
        return [f"_t{i}" for i in range(max(n, 1))], ctx

    def _stable_hash_for_caching(self) -> str:
        """Deterministic key of the metadata and inner-tensor layout (torch.compile's graph caches)."""
        names, ctx = self.__tensor_flatten__()
        with torch._C.DisableTorchFunctionSubclass():
            shape = tuple(self.shape)
        inner = [(tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device)) for t in (getattr(self, n) for n in names)]
        return hashlib.blake2b(repr((_ctx_by_name(ctx), shape, inner)).encode(), digest_size=16).hexdigest()

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx, outer_size, outer_stride) -> AttentionBias:
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
            self._set_inner_tensors()
        return self

    # ----------------------------------------------------------------------------- torch function
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            from ..api import _sdpa_from_torch

            return _sdpa_from_torch(*args, **kwargs)
        if (
            func in _PASSTHROUGH
            or getattr(func, "__name__", "") in _PASSTHROUGH_NAMES
            or getattr(func, "namespace", None) == "biasattn"  # our custom ops take biases as they are
        ):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _LAZY_FUNCTIONS and isinstance(args[0], AttentionBias):
            # torch.clone(bias) / torch.detach(bias) (torch.compile clones its inputs) stay lazy.
            return getattr(args[0], _LAZY_FUNCTIONS[func])()
        return _foreign(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = DISPATCH_HANDLERS.get(func)
        if handler is not None:  # our own custom ops (torch.compile path): the handler unwraps the bias
            return handler(*args, **(kwargs or {}))
        # Reached only below torch-function handling (autograd internals, tracing): same rule.
        return _foreign(func, args, kwargs or {})


#: Every bias class by :func:`~.atoms.class_name`; unpickling builds biases from this table only.
BIAS_CLASSES: dict[str, type] = {class_name(AttentionBias): AttentionBias}
_STATE_VERSION = 1


def _rebuild_bias(state: tuple) -> AttentionBias:
    """Rebuild a pickled bias from the state :meth:`AttentionBias.__reduce_ex__` wrote.

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
    return AttentionBias._create.__func__(cls, atoms, tuple(offsets), tuple(lengths), device=device, full=tuple(full))  # type: ignore[attr-defined]


def _registered(table: dict[str, type], name: str, what: str) -> type:
    try:
        return table[name]
    except KeyError:
        raise InputError(f"a pickled bias names the {what} {name!r}, which this biasattn does not define") from None


torch.serialization.add_safe_globals([_rebuild_bias])


def _mask_operand(bias: AttentionBias, t: torch.Tensor) -> AttentionBias:
    """A plain tensor on one side of ``bias & t``: a bool tensor (True = visible) becomes a mask, as in ``attn_bias``."""
    if t.dtype == torch.bool:
        from ..inputs import as_bias

        return as_bias(t)
    if t.is_floating_point():
        raise BiasCompositionError(
            f"cannot compose {bias._family()} & a {str(t.dtype).replace('torch.', '')} tensor: '&' intersects masks; "
            "pass a bool tensor (True = visible) to intersect, or write bias + biasattn.AdditiveBias(t) to add "
            "a float bias lazily (bias + t materializes the bias)"
        )
    raise BiasCompositionError(
        f"cannot compose {bias._family()} & a {str(t.dtype).replace('torch.', '')} tensor: '&' takes a bias or a "
        "bool tensor (True = visible), e.g. bias & (t != 0)"
    )


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
# Custom ops (OpOverload -> handler) that take a bias argument and unwrap it in __torch_dispatch__;
# filled by biasattn.ops.custom_ops.
DISPATCH_HANDLERS: dict[Any, Any] = {}
_LAZY_FUNCTIONS = {torch.clone: "clone", torch.detach: "detach", torch.Tensor.clone: "clone", torch.Tensor.detach: "detach"}


def _flatten_ctx(cls, device, dtype, atoms, offsets, lengths, full) -> tuple:
    """The hashable metadata of :meth:`AttentionBias.__tensor_flatten__` (see there)."""
    atom_ctx = []
    for a in atoms:
        tensors = a.tensors()
        fields = tuple((f.name, getattr(a, f.name)) for f in dataclasses.fields(a)
                       if f.name not in tensors and f.name not in a.HOST_FIELDS)
        atom_ctx.append((type(a), fields, tuple(tensors)))
    sized = tuple(n is not None for n in lengths)
    full = tuple("outer" if sized[d] and full[d] == offsets[d] + lengths[d] else full[d] for d in range(2))
    return (cls, device, dtype, tuple(atom_ctx), tuple(offsets), sized, full)


def _ctx_by_name(ctx) -> tuple:
    """``ctx`` with classes replaced by ``"module:qualname"`` strings (graphs hold no classes)."""
    cls, device, dtype, atom_ctx, offsets, sized, full = ctx
    atom_ctx = tuple((f"{a.__module__}:{a.__qualname__}", fields, names) for a, fields, names in atom_ctx)
    return (f"{cls.__module__}:{cls.__qualname__}", device, dtype, atom_ctx, offsets, sized, full)


def _ctx_by_class(ctx) -> tuple:
    """Inverse of :func:`_ctx_by_name`."""
    cls, device, dtype, atom_ctx, offsets, sized, full = ctx
    atom_ctx = tuple((_class(a), fields, names) for a, fields, names in atom_ctx)
    return (_class(cls), device, dtype, atom_ctx, offsets, sized, full)


def _class(name: str) -> type:
    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _BiasConstructor(AttentionBias):
    """``_BiasConstructor(ctx, shape, *tensors)`` builds the bias that ``ctx`` describes.

    Dynamo places calls of tensor-subclass constructors in the graph as they are; bias factories
    traced by ``torch.compile`` (``BlockDiagonalMask.from_seqlens``, slicing, ``&``) end here.
    """

    @staticmethod
    def __new__(cls, ctx, shape, *tensors):
        ctx = _ctx_by_class(ctx)
        shape = tuple(shape)
        stride = tuple(math.prod(shape[d + 1 :]) for d in range(4))
        inner = {f"_t{i}": t for i, t in enumerate(tensors)}
        if not inner:
            with torch._C.DisableTorchFunctionSubclass():
                inner["_t0"] = torch.empty(0, dtype=torch.int32, device=ctx[1])
        return AttentionBias.__tensor_unflatten__(inner, ctx, shape, stride)


def _resolved(device) -> torch.device | None:
    """``device`` with a bare ``"cuda"`` resolved to the current CUDA device, so "cuda" and "cuda:0" compare equal."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _compose(a: AttentionBias, b: AttentionBias) -> AttentionBias:
    from .composed import ComposedBias

    if a._offsets != (0, 0) or b._offsets != (0, 0) or a._lengths != a._full or b._lengths != b._full:
        raise BiasCompositionError(
            f"cannot compose sliced biases ({a._family()}, {b._family()}): compose first, then slice"
        )
    atoms = a._atoms + b._atoms
    if a.device == b.device or b.follows_q:
        device = a.device
    elif a.follows_q:  # sizes only (LowerTriangularMask()) or lists with no device: follows the other
        device = b.device
    else:
        raise InputError(f"cannot compose biases on different devices: {a.device} and {b.device}")
    if a.device != b.device:  # a list-built part moves to the other's device now
        atoms = tuple(x.to(device) if x.follows_q and x.tensors() else x for x in atoms)
    return AttentionBias._create.__func__(ComposedBias, atoms, device=device)  # type: ignore[attr-defined]


def _flatten(obj, out: list):
    if isinstance(obj, (list, tuple)):
        for x in obj:
            _flatten(x, out)
    elif isinstance(obj, torch.Tensor):
        out.append(obj)


def _foreign(func, args, kwargs) -> Any:
    """Materialize every bias among ``args`` against the other tensors' shape, then call ``func``."""
    others: list[torch.Tensor] = []
    _flatten(list(args) + list(kwargs.values()), others)
    plain = [t for t in others if not isinstance(t, AttentionBias)]
    with torch._C.DisableTorchFunctionSubclass():
        target = torch.broadcast_shapes(*[t.shape for t in plain]) if plain else torch.Size()
    dtype = next((t.dtype for t in plain if t.is_floating_point()), torch.float32)

    def dense(x):
        if not isinstance(x, AttentionBias):
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
