"""Additive biases: a float tensor broadcastable to ``[B, H, Mq, Mk]``, or a bool mask.

Broadcast dims keep stride 0 and are never expanded in memory; gradients flow to the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError, InputTypeError
from .atoms import Atom, Geometry, visible_to_additive
from .base import AttentionBias


@dataclass(frozen=True, eq=False)
class AdditiveAtom(Atom):
    """``tensor[b, h, i, j]`` is added to the scores (a bool mask is stored as 0 / -inf).

    ``tensor`` is the user's tensor itself (1 to 4 dims), not a view made at construction, so that
    ``requires_grad_()`` called on it later still reaches it; :attr:`tensor4d` is its 4-D view.
    """

    tensor: torch.Tensor  # 1-4 dims, broadcastable to [B, H, Mq_full, Mk_full]
    is_mask: bool = False
    family: str = "AdditiveBias"
    kind = "additive"

    @property
    def tensor4d(self) -> torch.Tensor:
        """``tensor`` as ``[B|1, H|1, Mq|1, Mk|1]`` (a view with leading 1s when it has fewer dims)."""
        t = self.tensor
        return t if t.dim() == 4 else t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))

    def sizes(self):
        shape = (1,) * (4 - self.tensor.dim()) + tuple(self.tensor.shape)
        return tuple(n if n > 1 else None for n in shape)

    def tensors(self):
        return {"tensor": self.tensor}

    def dense(self, g: Geometry, dtype, device) -> torch.Tensor:
        t = self.tensor4d.to(device=device, dtype=dtype)
        if t.shape[2] > 1:
            t = t[:, :, g.q_off : g.q_off + g.Mq]
        if t.shape[3] > 1:
            t = t[:, :, :, g.k_off : g.k_off + g.Mk]
        return t

    def lower(self, builder) -> None:
        builder.add_additive(self.tensor4d.to(builder.device), self.is_mask)

    def __repr__(self) -> str:
        kind = "mask" if self.is_mask else str(self.tensor.dtype).replace("torch.", "")
        return f"{kind}{list(self.tensor4d.shape)}"


class AdditiveBias(AttentionBias):
    """A dense float bias broadcastable to ``[B, H, Mq, Mk]`` (fewer dims broadcast from the left).

    A bool tensor means "True = visible" and becomes a mask. Gradients flow to a float tensor
    that requires grad, reduced over its broadcast dims; the bias keeps the tensor given, so
    ``t.requires_grad_()`` after construction still gives ``t.grad``.
    """

    def __new__(cls, tensor: torch.Tensor):
        if isinstance(tensor, AttentionBias):
            raise InputTypeError("AdditiveBias takes a plain tensor; compose biases with '+' instead")
        if not isinstance(tensor, torch.Tensor):
            raise InputTypeError(f"AdditiveBias takes a tensor, got {type(tensor).__name__}")
        if tensor.dim() > 4 or tensor.dim() < 1:
            raise InputError(f"AdditiveBias tensor must have 1 to 4 dims [B, H, Mq, Mk], got shape {list(tensor.shape)}")
        is_mask = tensor.dtype == torch.bool
        if is_mask:
            tensor = visible_to_additive(tensor, torch.float32)
        elif not tensor.is_floating_point():
            raise InputTypeError(f"AdditiveBias tensor must be floating point or bool, got dtype {tensor.dtype}")
        return cls._create([AdditiveAtom(tensor, is_mask=is_mask, family=cls.__name__)], device=tensor.device)

    @property
    def tensor(self) -> torch.Tensor:
        """The 4-D additive tensor: the float tensor given, viewed with leading 1s when it has fewer dims."""
        return self.atoms[0].tensor4d
