"""Padded keys: per batch row, keys at or beyond the row's length are hidden.

``PaddedKeysMask([3, 5])`` (Mq=2, Mk=6), batch row 0 and row 1
    ■ ■ ■ □ □ □      ■ ■ ■ ■ ■ □
    ■ ■ ■ □ □ □      ■ ■ ■ ■ ■ □
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from .atoms import Atom, Geometry, as_lengths, check_length_tensor, readable, tensor_version, to_device, visible_to_additive
from .base import AttentionBias


@dataclass(frozen=True, eq=False)
class PaddedKeysAtom(Atom):
    """Key ``j`` of batch row ``b`` is visible iff ``j < kv_seqlens[b]``."""

    kv_seqlens: torch.Tensor  # [B] int32
    host: tuple[int, ...] | None = None  # the lengths as given, when given on the host
    from_lists: bool = False  # built from a list with no device: follows q's device
    family: str = "PaddedKeysMask"
    kind = "padded_keys"
    HOST_FIELDS = ("host",)

    @property
    def follows_q(self) -> bool:
        return self.from_lists

    def lengths(self) -> tuple[int, ...]:
        """The lengths on the host (read from the tensor when it was built on a device or written since)."""
        return self.host_copy(self.kv_seqlens, self.host)

    def known_lengths(self) -> tuple[int, ...] | None:
        """The lengths where the host has them for free (given as a list and not written since, or held
        by a CPU tensor outside ``torch.compile`` and not a trace's fake tensor), else None: the attention
        path never reads a GPU tensor's values, nor a traced one's."""
        t = self.kv_seqlens
        if torch.compiler.is_compiling():
            return None
        if (t.device.type == "cpu" and readable(t)) or (self.host is not None and tensor_version(t) in (0, -1)):
            return self.lengths()
        return None

    def lowers_unread(self, g, device, atoms: tuple) -> bool:
        return self.known_lengths() is None

    def spec_token(self):
        """Lengths only the device holds, built from a tensor: their layout (the values pass through unread)."""
        t = self.kv_seqlens
        if self.host is not None or t.device.type == "cpu" or torch.compiler.is_compiling():
            return None
        return (PaddedKeysAtom, self.family, t.shape, t.dtype, t.device, t.stride())

    def sizes(self):
        n = self.kv_seqlens.shape[0]
        return (n if n > 1 else None, None, None, None)

    def tensors(self):
        return {"kv_seqlens": self.kv_seqlens}

    def dense(self, g: Geometry, dtype, device) -> torch.Tensor:
        lens = self.kv_seqlens.to(device=device, dtype=torch.int64)[:, None, None, None]
        return visible_to_additive(g.cols(device)[None, None] < lens, dtype)

    def lower(self, builder) -> None:
        g = builder.g
        host = self.known_lengths()
        for b, n in enumerate(host or ()):
            if n < 0:
                raise InputError(f"kv_seqlens[{b}] must be >= 0, got {n}")
            if n > g.Mk_full and g.full_known[1]:
                raise InputError(f"kv_seqlens[{b}]={n} exceeds the key length Mk={g.Mk_full}")
        builder.add_kv_seqlens(host, to_device(self.kv_seqlens, builder.device))

    def __repr__(self) -> str:
        if not readable(self.kv_seqlens):
            return f"kv_seqlens=[{self.kv_seqlens.shape[0]} lengths]"
        return f"kv_seqlens={list(self.lengths())}"


class PaddedKeysMask(AttentionBias):
    """Per batch row ``b``, keys ``j >= kv_seqlens[b]`` are hidden (right-padded key batches).

    ``kv_seqlens``: ``[B]`` ints (list or tensor). A tensor is kept as the lengths (int32, on its
    device) without being read, so building the mask costs no device sync and works inside
    ``torch.compile``; an in-place write to :attr:`kv_seqlens` takes effect on the next call.
    Lengths the host holds (a list, a CPU tensor) must lie in ``[0, Mk]``, checked at call time;
    a GPU tensor's values are never read on the call path, so there a negative length hides every
    key and a length above Mk shows every key.
    """

    def __new__(cls, kv_seqlens, *, device=None):
        if isinstance(kv_seqlens, torch.Tensor):
            check_length_tensor("kv_seqlens", kv_seqlens)
            t = kv_seqlens
            if t.dtype is not torch.int32 or device is not None:
                t = t.to(device=device, dtype=torch.int32)
            return cls._create([PaddedKeysAtom(t)], device=t.device)
        host = as_lengths("kv_seqlens", kv_seqlens)
        t = to_device(host, device, torch.int32)
        return cls._create([PaddedKeysAtom(t, tuple(host), from_lists=device is None)], device=device)

    @classmethod
    def from_bool(cls, mask: torch.Tensor) -> PaddedKeysMask:
        """From a right-padding bool mask ``[B, Mk]`` (True = visible key)."""
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
            got = f"{mask.dtype} tensor of shape {list(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise InputError(f"mask must be a bool tensor [B, Mk], got {got}")
        lengths = mask.sum(-1)
        prefix = torch.arange(mask.shape[-1], device=mask.device)[None, :] < lengths[:, None]
        if not torch.equal(prefix, mask):
            bad = int((prefix != mask).any(-1).nonzero()[0, 0])
            raise InputError(
                f"mask row {bad} is not a right-padding mask (True then False); "
                "use AdditiveBias(mask) for arbitrary bool masks"
            )
        return cls(lengths.tolist(), device=mask.device)  # read once the check above has waited for the GPU

    @property
    def kv_seqlens(self) -> torch.Tensor:
        """The ``[B]`` int32 key lengths."""
        return self.atoms[0].kv_seqlens
