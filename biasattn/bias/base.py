"""The tensor-subclass machinery shared by every bias family.

An :class:`AttentionBias` is a ``torch.Tensor`` wrapper subclass: it has a shape, dtype and device,
but no storage of its own. Its meaning is a tuple of *atoms* (a band, segments, padded keys, a block
layout, an additive tensor, ALiBi slopes), each of which knows how to materialize itself and how to
lower itself into a :class:`~biasattn.bias.spec.BiasSpec`. Composition concatenates atoms; slicing
records offsets. Every family inherits the tensor protocol (``torch.compile`` flattening, pickling,
``__torch_function__`` routing and foreign-op materialization) from here; its code lives in
:mod:`.protocol`, and :meth:`AttentionBias.show` draws with :mod:`.drawing`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Sequence

import torch

from ..errors import BiasCompositionError, InputError
from . import drawing, protocol
from .atoms import Atom, Geometry, class_name, faking


def _merge_sizes(atoms: Sequence[Atom]) -> list[int | None]:
    """``[B, H, Mq_full, Mk_full]`` that the atoms fix together (None where none does); raises where two disagree."""
    sizes: list[int | None] = [None, None, None, None]
    for a in atoms:
        for d, n in enumerate(a.sizes()):
            if n is None or sizes[d] == n:
                continue
            if sizes[d] is not None:
                who = " and ".join(sorted({a.family for a in atoms})) or "bias"
                name = ("B", "H", "Mq", "Mk")[d]
                raise InputError(f"cannot compose biases: {who} fix {name}={sizes[d]} and {name}={n}")
            sizes[d] = n
    return sizes


def _check_pairs(atoms: Sequence[Atom]) -> None:
    """Reject compositions that have no lowering, naming the pair of families."""
    if len(atoms) < 2:
        return
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
        protocol.BIAS_CLASSES[class_name(cls)] = cls

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
        if len(atoms) == 1:  # a single term fixes its own sizes
            B, H, Mq, Mk = atoms[0].sizes()
        else:
            _check_pairs(atoms)
            B, H, Mq, Mk = _merge_sizes(atoms)
        if full is not None:  # sizes fixed by bind()
            Mq = Mq if full[0] is None else full[0]
            Mk = Mk if full[1] is None else full[1]
        if lengths is None:
            lengths = (None if Mq is None else Mq - offsets[0], None if Mk is None else Mk - offsets[1])
        dtype = torch.float32
        inner = []
        for a in atoms:
            for t in a.tensors().values():
                inner.append(t)
                if device is None:
                    device = t.device
                if not a.is_mask and t.is_floating_point():
                    dtype = t.dtype
        shape = (B or 1, H or 1, lengths[0] if lengths[0] is not None else 1, lengths[1] if lengths[1] is not None else 1)
        if torch.compiler.is_dynamo_compiling():
            # Dynamo cannot trace _make_wrapper_subclass; a constructor call is placed in the graph instead.
            dev = torch.device(device if device is not None else "cpu")
            ctx = protocol.flatten_ctx(cls, dev, dtype, atoms, offsets, lengths, (Mq, Mk))
            return _BiasConstructor(protocol.ctx_by_name(ctx), shape, *inner)
        if device is None:
            device = _CPU
        elif type(device) is not torch.device or (device.index is None and device.type == "cuda"):
            device = _resolved(device)
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        self._atoms = atoms
        self._offsets = offsets
        self._lengths = lengths
        self._full = (Mq, Mk)
        self._device = device  # read without __torch_function__
        protocol.set_inner_tensors(self, inner)
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
            return protocol.foreign(AttentionBias, torch.Tensor.add, (self, other), {})
        return NotImplemented

    def __radd__(self, other):
        if isinstance(other, (torch.Tensor, int, float)):
            return protocol.foreign(AttentionBias, torch.Tensor.add, (other, self), {})
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
        """Move or cast the bias' small tensors; stays lazy. A bias that holds no tensor keeps what it
        returned per device and dtype (a causal mask moved in every call is made once)."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if any(a.tensors() for a in self._atoms) or torch.compiler.is_compiling() or faking():
            return self._moved(device, dtype)
        moved = self.__dict__.setdefault("_moved_to", {})
        key = (device, dtype)
        out = moved.get(key)
        if out is None:
            out = moved[key] = _for_every_mode(lambda: self._moved(device, dtype))
        return out

    def _moved(self, device, dtype) -> AttentionBias:
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

    def __reduce_ex__(self, proto):
        return (_rebuild_bias, (protocol.pickled_state(self),))

    def __repr__(self, *args, **kwargs) -> str:
        parts = ", ".join(repr(a) for a in self._atoms)
        extra = ""
        if self._offsets != (0, 0) or self._lengths != self._full:
            extra = f", offsets={self._offsets}, lengths={self._lengths}"
        return f"{type(self).__name__}({parts}{extra})"

    def show(self, Mq: int | None = None, Mk: int | None = None, *, batch: int = 0, head: int = 0, ax=None):
        """Draw the visibility pattern (and additive values) with matplotlib; returns the Axes."""
        return drawing.show(self, Mq, Mk, batch=batch, head=head, ax=ax)

    # ----------------------------------------------------------------------------- tensor protocol
    def __tensor_flatten__(self):
        return protocol.tensor_flatten(self)

    def _stable_hash_for_caching(self) -> str:
        """Deterministic key of the metadata and inner-tensor layout (torch.compile's graph caches)."""
        return protocol.stable_hash(self)

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx, outer_size, outer_stride) -> AttentionBias:
        return protocol.tensor_unflatten(inner, ctx, outer_size, outer_stride)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return protocol.torch_function(AttentionBias, func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return protocol.torch_dispatch(AttentionBias, func, args, kwargs or {})


protocol.BIAS_CLASSES[class_name(AttentionBias)] = AttentionBias


def _rebuild_bias(state: tuple) -> AttentionBias:
    """Rebuild a pickled bias from the state :meth:`AttentionBias.__reduce_ex__` wrote (see :func:`.protocol.read_state`)."""
    cls, atoms, offsets, lengths, device, full = protocol.read_state(state)
    return AttentionBias._create.__func__(cls, atoms, offsets, lengths, device=device, full=full)  # type: ignore[attr-defined]


torch.serialization.add_safe_globals([_rebuild_bias])


def _mask_operand(bias: AttentionBias, t: torch.Tensor) -> AttentionBias:
    """A plain tensor on one side of ``bias & t``: a bool tensor (True = visible) becomes a mask, as in ``attn_bias``."""
    if t.dtype == torch.bool:
        from .additive import AdditiveBias

        return AdditiveBias(t)
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


class _BiasConstructor(AttentionBias):
    """``_BiasConstructor(ctx, shape, *tensors)`` builds the bias that ``ctx`` describes.

    Dynamo places calls of tensor-subclass constructors in the graph as they are; bias factories
    traced by ``torch.compile`` (``BlockDiagonalMask.from_seqlens``, slicing, ``&``) end here.
    """

    @staticmethod
    def __new__(cls, ctx, shape, *tensors):
        ctx = protocol.ctx_by_class(ctx)
        shape = tuple(shape)
        stride = tuple(math.prod(shape[d + 1 :]) for d in range(4))
        inner = {f"_t{i}": t for i, t in enumerate(tensors)}
        if not inner:
            with torch._C.DisableTorchFunctionSubclass():
                inner["_t0"] = torch.empty(0, dtype=torch.int32, device=ctx[1])
        return protocol.tensor_unflatten(inner, ctx, shape, stride)


_SHARED: dict = {}  # bias class -> its one instance (classes whose constructor takes no argument)


def shared(cls: type, build) -> AttentionBias:
    """The one instance of ``cls``, a bias family whose constructor takes no argument and whose bias holds
    no tensor (a causal mask), made by ``build()`` on first use: a mask built in every call then costs a
    lookup, and every call finds the dispatch and launch decisions kept on that one object. Biases never
    change, so sharing is invisible; a trace (``torch.compile``, fake tensors) builds its own."""
    if torch.compiler.is_compiling() or faking():
        return build()
    bias = _SHARED.get(cls)
    if bias is None:
        bias = _SHARED[cls] = _for_every_mode(build)
    return bias


def _for_every_mode(build):
    """``build()`` outside inference mode: a bias kept for later calls serves calls in and out of it."""
    if not torch.is_inference_mode_enabled():
        return build()
    with torch.inference_mode(False):
        return build()


_CPU = torch.device("cpu")


def _resolved(device) -> torch.device | None:
    """``device`` with a bare ``"cuda"`` resolved to the current CUDA device, so "cuda" and "cuda:0" compare equal."""
    if device is None:
        return None
    if type(device) is not torch.device:
        device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@functools.cache  # masks composed every step: an import statement per call costs several µs
def _composed_class():
    from .composed import ComposedBias

    return ComposedBias


def _compose(a: AttentionBias, b: AttentionBias) -> AttentionBias:
    ComposedBias = _composed_class()
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
