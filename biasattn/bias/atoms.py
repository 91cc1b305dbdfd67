"""The atoms a bias is made of, and the geometry they are evaluated on.

An atom is one indivisible term (a band, segments, padded keys, a block layout, an additive tensor,
ALiBi slopes): it knows its sizes, its dense meaning (:meth:`Atom.dense`) and its lowering
(:meth:`Atom.lower`). Family modules define the atoms; :mod:`.base` composes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..errors import InputError


@dataclass(frozen=True)
class Geometry:
    """Where a bias is evaluated: the call's sizes and the bias' slicing offsets.

    Query row ``i`` of the call is row ``i + q_off`` of the bias; ``Mq_full``/``Mk_full`` are the
    sizes the bias is aligned to (bottom-right alignment and ALiBi use them).
    """

    B: int
    H: int
    Mq: int
    Mk: int
    q_off: int = 0
    k_off: int = 0
    Mq_full: int = 0
    Mk_full: int = 0
    full_known: tuple[bool, bool] = (True, True)  # False: a slice with an end of an unsized bias

    def rows(self, device) -> torch.Tensor:
        """Global query indices ``[Mq, 1]`` (int64)."""
        return (torch.arange(self.Mq, device=device) + self.q_off)[:, None]

    def cols(self, device) -> torch.Tensor:
        """Global key indices ``[1, Mk]`` (int64)."""
        return (torch.arange(self.Mk, device=device) + self.k_off)[None, :]


def class_name(cls: type) -> str:
    """``"module:qualname"`` of a class: how pickled biases and compiled graphs name atoms and families."""
    return f"{cls.__module__}:{cls.__qualname__}"


#: Every atom class by :func:`class_name`; unpickling builds atoms from this table only.
ATOM_CLASSES: dict[str, type] = {}


def visible_to_additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Turn a bool visibility tensor into the additive form (0 visible, -inf hidden)."""
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, torch.full((), float("-inf"), dtype=dtype, device=visible.device))


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s in-place write counter (-1 for inference tensors, which keep none)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def to_device(t, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` (a tensor, or a list of numbers made a tensor of ``dtype``) on ``device`` (None: where it is,
    torch's default device for a list).

    From the host to a GPU the copy goes through pinned memory without waiting: a plain copy from
    pageable memory waits until every kernel queued on the stream has run, so the host stops
    running ahead of the GPU (one such copy per fresh mask is enough to idle the GPU between
    steps). The pinned block is not reused before its copy has run (PyTorch records the copy).
    """
    if not isinstance(t, torch.Tensor):
        if device is not None and _pinned_copy(torch.device(device)):
            return torch.tensor(t, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
        t = torch.tensor(t, dtype=dtype)
    elif dtype is not None:
        t = t.to(dtype)
    device = torch.device(device) if device is not None else t.device
    if t.device.type == "cpu" and _pinned_copy(device):
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_device_parts(values: Sequence[int], sizes: Sequence[int], device) -> tuple[torch.Tensor, ...]:
    """int32 tensors on ``device`` (None: torch's default device) holding ``values`` cut into consecutive parts of
    ``sizes``, each with a storage of its own: to a GPU, one pinned host tensor and a copy per part,
    none of them waiting (as :func:`to_device`)."""
    if device is not None and _pinned_copy(torch.device(device)):
        host = torch.tensor(values, dtype=torch.int32, pin_memory=True)
        return tuple(part.to(device, non_blocking=True) for part in host.split(sizes))
    return tuple(part.clone() for part in to_device(list(values), device, torch.int32).split(sizes))


def _pinned_copy(device: torch.device) -> bool:
    """Whether a copy from the host to ``device`` goes through pinned memory: to a GPU, outside
    ``torch.compile`` and outside graph capture (a captured graph would read the pinned block at
    every replay, after it has been reused; capture refuses the plain copy instead, so that this
    cannot happen silently)."""
    return device.type == "cuda" and not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing()


def tensor_layout(t: torch.Tensor) -> tuple:
    """What lowering and launches take from a tensor whose values they pass on unread: shape, dtype,
    device, strides."""
    return (t.shape, t.dtype, t.device, t.stride())


def faking() -> bool:
    """Whether a trace outside Dynamo runs (``make_fx``, AOTAutograd, export): tensors made now are fake,
    and nothing made now may be kept for later calls."""
    return not torch.compiler.is_compiling() and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def readable(t: torch.Tensor) -> bool:
    """Whether ``t``'s values can be read on the host now (not meta, not a fake tensor of a trace)."""
    if t.device.type == "meta" or torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(t)


class Atom:
    """One indivisible term of a bias. Subclasses are frozen dataclasses in the family modules.

    ``HOST_FIELDS`` name fields that are host copies of the atom's tensors (sequence lengths): they
    are optional, never part of what ``torch.compile`` guards on, and read back from the tensors
    (:meth:`host_copy`) whenever the tensor was written in place since.
    """

    family: ClassVar[str] = "AttentionBias"
    kind: ClassVar[str] = ""
    is_mask: ClassVar[bool] = True
    HOST_FIELDS: ClassVar[tuple[str, ...]] = ()

    def host_copy(self, tensor: torch.Tensor, given: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """``tuple(tensor.tolist())``, read once per in-place version of ``tensor`` (a device sync on
        CUDA); ``given`` is the copy the constructor already had for the tensor's first version."""
        copies = self.__dict__.setdefault("_host_copies", {})
        key = id(tensor)
        held = copies.get(key)
        version = tensor_version(tensor)
        if held is None and given is not None and version in (0, -1):  # not written since it was made
            held = copies[key] = (version, tuple(given))
        if held is None or held[0] != version:
            held = copies[key] = (version, tuple(int(n) for n in tensor.tolist()))
        return held[1]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        ATOM_CLASSES[class_name(cls)] = cls

    def sizes(self) -> tuple[int | None, int | None, int | None, int | None]:
        """``(B, H, Mq_full, Mk_full)`` this atom fixes; None where it broadcasts or is unsized."""
        return (None, None, None, None)

    @property
    def needs_full_size(self) -> bool:
        """True when the atom's meaning depends on the full (unsliced) Mq/Mk."""
        return False

    def dense(self, g: Geometry, dtype: torch.dtype, device) -> torch.Tensor:
        """Additive tensor broadcastable to ``[B, H, Mq, Mk]`` in the call's coordinates."""
        raise NotImplementedError

    def lower(self, builder) -> None:
        """Record this atom in a :class:`~biasattn.bias.spec.SpecBuilder`."""
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        """Tensors this atom holds, by field name."""
        return {}

    def spec_token(self):
        """What the spec of a bias holding this atom takes from it, as a hashable token, where that is
        cheaper to tell than lowering; None where lowering must look (a value it reads, say). An atom
        without tensors is its own token (atoms never change; :func:`~biasattn.bias.band.band_atom`
        gives masks built afresh the same one)."""
        return None if self.tensors() else self

    def lowers_unread(self, g: Geometry, device, atoms: tuple) -> bool:
        """True when lowering this atom, one of ``atoms``, for a call of geometry ``g`` on ``device`` passes its tensors on
        without reading a value (lengths that only the device holds, say): the spec of one such atom
        then serves every atom of its structure."""
        return False

    def combinable_with(self, other: Atom) -> bool:
        """Whether an atom of the same kind can be composed with this one."""
        return True

    def incompatibility(self, other: Atom) -> str:
        """One sentence saying why :meth:`combinable_with` is False."""
        return ""

    @property
    def follows_q(self) -> bool:
        """True for an atom built from Python lists with no device given: its tensors go to q's device
        on use (subclasses that can be built so store the flag)."""
        return False

    def to(self, device=None, dtype=None) -> Atom:
        """Same atom with its tensors moved (and floating tensors cast); a device given is kept. A tensor in
        two roles stays one tensor, and lengths reach a GPU without a wait (:func:`to_device`)."""
        changes, moved = {}, {}
        for name, t in self.tensors().items():
            if id(t) not in moved:
                if t.is_floating_point():
                    moved[id(t)] = t.to(device=device, dtype=dtype)
                else:
                    moved[id(t)] = t if device is None else to_device(t, device)
            changes[name] = moved[id(t)]
        if device is not None and self.follows_q:
            changes["from_lists"] = False
        return replace(self, **changes) if changes else self

    def detach(self) -> Atom:
        """Same atom with detached tensors."""
        changes = {name: t.detach() for name, t in self.tensors().items()}
        return replace(self, **changes) if changes else self

    def clone(self) -> Atom:
        """Same atom with cloned tensors."""
        changes = {name: t.clone() for name, t in self.tensors().items()}
        return replace(self, **changes) if changes else self


def check_length_tensor(name: str, values: torch.Tensor, *, allow_empty: bool = False) -> None:
    """Validate what a tensor of lengths shows without reading it: an integer dtype and one dim."""
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise InputError(f"{name} must hold integers, got dtype {values.dtype}")
    if values.dim() != 1:
        raise InputError(f"{name} must be 1-D, got shape {list(values.shape)}")
    if values.shape[0] == 0 and not allow_empty:
        raise InputError(f"{name} must not be empty")


def as_lengths(name: str, values, *, allow_empty: bool = False) -> list[int]:
    """Validate a 1-D sequence of non-negative integer lengths and return it as a Python list."""
    if isinstance(values, torch.Tensor):
        check_length_tensor(name, values, allow_empty=True)
        values = values.tolist()
    if type(values) in (list, tuple) and set(map(type, values)) <= {int}:  # the common case, checked at C speed
        if values and min(values) >= 0 or not values and allow_empty:
            return list(values)
    try:
        out = [v if isinstance(v, int) else int(v) if float(v).is_integer() else None for v in values]
    except TypeError:
        raise InputError(f"{name} must be a sequence of ints, got {type(values).__name__}") from None
    if any(v is None or isinstance(v, bool) for v in out):
        raise InputError(f"{name} must hold integers, got {list(values)}")
    if not out and not allow_empty:
        raise InputError(f"{name} must not be empty")
    for k, v in enumerate(out):
        if v < 0:
            raise InputError(f"{name}[{k}] must be >= 0, got {v}")
    return out
