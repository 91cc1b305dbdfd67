"""Validated attention inputs: every check of the design runs here, before any operator is touched."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .bias import AdditiveBias, AttentionBias, BiasSpec, lower
from .bias.spec import lowered_before
from .errors import InputError, InputTypeError
from .memo import BoundedCache

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(slots=True)
class AttentionInputs:
    """q ``[B, Hq, Mq, D]``, k ``[B, Hkv, Mk, D]``, v ``[B, Hkv, Mk, Dv]`` with their lowered bias.

    Treated as immutable (:meth:`with_tensors` makes a new one); not frozen, because a frozen
    dataclass costs a microsecond more to build on every call."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: AttentionBias | None
    spec: BiasSpec
    scale: float
    dropout_p: float = 0.0
    requires_grad: bool = False

    @property
    def B(self) -> int:
        return self.q.shape[0]

    @property
    def Hq(self) -> int:
        return self.q.shape[1]

    @property
    def Hkv(self) -> int:
        return self.k.shape[1]

    @property
    def Mq(self) -> int:
        return self.q.shape[2]

    @property
    def Mk(self) -> int:
        return self.k.shape[2]

    @property
    def D(self) -> int:
        return self.q.shape[3]

    @property
    def Dv(self) -> int:
        return self.v.shape[3]

    @property
    def groups(self) -> int:
        """Query heads per KV head (1 for multi-head attention)."""
        return self.Hq // self.Hkv

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def additive(self) -> torch.Tensor | None:
        """The spec's additive tensor (4-D, broadcastable to ``[B, Hq, Mq, Mk]``), or None."""
        return self.spec.additive

    def with_tensors(self, q, k, v, additive) -> AttentionInputs:
        """Same inputs with the tensors replaced (inside autograd functions)."""
        if q is self.q and k is self.k and v is self.v and additive is self.spec.additive:
            return self
        spec = self.spec if additive is self.spec.additive else replace(self.spec, additive=additive)
        return replace(self, q=q, k=k, v=v, spec=spec)

    def describe(self) -> str:
        """One line describing the inputs (for errors and explain())."""
        feats = ", ".join(sorted(self.spec.features)) or "none"
        bias = type(self.bias).__name__ if self.bias is not None else "None"
        grad = ", backward" if self.requires_grad else ""
        drop = f", dropout_p={self.dropout_p}" if self.dropout_p else ""
        return (
            f"q [{self.B}, {self.Hq}, {self.Mq}, {self.D}], k [{self.B}, {self.Hkv}, {self.Mk}, {self.D}], "
            f"v Dv={self.Dv}, {str(self.dtype).replace('torch.', '')} on {self.device}, "
            f"attn_bias={bias} (features: {feats}){drop}{grad}"
        )


def _check_qkv(q, k, v) -> None:
    """Every check of q, k and v against each other (not against a bias); skipped for a signature seen valid."""
    plain = type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
    if plain:
        sig = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device)
        if sig in _VALID_QKV:
            return
    _check_tensor("q", q, "[B, Hq, Mq, D]")
    _check_tensor("k", k, "[B, Hkv, Mk, D]")
    _check_tensor("v", v, "[B, Hkv, Mk, Dv]")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise InputTypeError(f"{name} has dtype {t.dtype}, q has {q.dtype}; they must agree")
        if t.device != q.device:
            raise InputTypeError(f"{name} is on {t.device}, q is on {q.device}; they must agree")
    B, Hq, Mq, D = q.shape
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != B:
            raise InputError(f"{name} has batch size {t.shape[0]}, q has {B}")
    if k.shape[3] != D:
        raise InputError(f"k has head dim {k.shape[3]}, q has {D}")
    if v.shape[1] != k.shape[1]:
        raise InputError(f"v has {v.shape[1]} heads, k has {k.shape[1]}")
    if v.shape[2] != k.shape[2]:
        raise InputError(f"v has Mk={v.shape[2]} keys, k has {k.shape[2]}")
    if D == 0 or v.shape[3] == 0:
        raise InputError(f"head dims must be positive, got D={D}, Dv={v.shape[3]}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise InputError(f"q has Hq={Hq} heads, which is not a multiple of k's Hkv={Hkv} heads" + _layout_hint(q, k))
    if plain:
        _VALID_QKV[sig] = True


def _check_bias(bias: AttentionBias, q, k) -> None:
    """The bias's device and sizes against q and k (:func:`make_inputs` skips it where the bias was
    lowered for this call size before)."""
    B, Hq, Mq, _ = q.shape
    Mk = k.shape[2]
    device = bias.__dict__.get("_device") or bias.device
    if device != q.device and not bias.follows_q and not _same_device(device, q.device):
        raise InputTypeError(f"attn_bias is on {bias.device}, q is on {q.device}; move it with attn_bias.to(q.device)")
    bB, bH, bMq, bMk = bias.sizes
    expected = (("batch size", bB, B, "q"), ("heads", bH, Hq, "q"), ("Mq", bMq, Mq, "q"), ("Mk", bMk, Mk, "k"))
    for name, got, want, what in expected:
        if got is not None and got != want:
            swapped = {"heads": q.shape[2], "Mq": q.shape[1], "Mk": k.shape[1]}.get(name)
            hint = _layout_hint(q, k) if got == swapped else ""  # the bias fits q and k read as [B, M, H, D]
            raise InputError(f"attn_bias ({type(bias).__name__}) has {name} {got}, {what} has {want}" + hint)


def _check_tensor(name: str, t, expected_rank_text: str) -> None:
    if not isinstance(t, torch.Tensor) or isinstance(t, AttentionBias):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise InputError(f"{name} must be 4-D {expected_rank_text}, got shape {list(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise InputTypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Device equality where ``cuda`` means the current CUDA device (``cuda`` == ``cuda:0`` there)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def _layout_hint(q: torch.Tensor, k: torch.Tensor) -> str:
    """A hint when q and k look like ``[B, M, H, D]`` (the xformers / flash-attn layout): with dims 1 and 2
    swapped, the head counts would divide. Empty otherwise."""
    Hq, Hkv = q.shape[2], k.shape[2]
    if Hkv == 0 or Hq % Hkv != 0 or (q.shape[1], k.shape[1]) == (Hq, Hkv):
        return ""
    return (f"; q {list(q.shape)} and k {list(k.shape)} look like [B, M, H, D], but biasattn takes [B, H, M, D] "
            "(PyTorch's layout): pass q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2) and transpose the "
            "output back with out.transpose(1, 2)")


def as_bias(attn_bias) -> AttentionBias | None:
    """Wrap a plain float/bool tensor into an :class:`AdditiveBias`; pass biases and None through."""
    if attn_bias is None or isinstance(attn_bias, AttentionBias):
        return attn_bias
    if isinstance(attn_bias, torch.Tensor):
        return AdditiveBias(attn_bias)
    raise InputTypeError(f"attn_bias must be a biasattn bias, a tensor or None, got {type(attn_bias).__name__}")


#: Signatures (shapes, dtypes, devices) of q, k, v that passed every check of :func:`_check_qkv`.
_VALID_QKV = BoundedCache(256)


def make_inputs(q, k, v, attn_bias=None, *, scale=None, dropout_p=0.0, requires_grad=None) -> AttentionInputs:
    """Validate everything and lower the bias; raises InputError / InputTypeError with a clear message.

    The checks of q, k, v and of a bias's sizes run once per signature (shapes, dtypes, devices):
    a call like an earlier valid one only looks its signature up."""
    _check_qkv(q, k, v)
    B, Hq, Mq, D = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise InputError(f"scale must be a finite float, got {scale!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise InputError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")

    bias = as_bias(attn_bias)
    spec = None if bias is None else lowered_before(bias, B, Hq, Mq, k.shape[2], q.device)
    if spec is None:  # a spec exists only for a call size the bias was checked against
        if bias is not None:
            _check_bias(bias, q, k)
        spec = lower(bias, B, Hq, Mq, k.shape[2], q.device)
    if requires_grad is None:
        requires_grad = torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad
            or (spec.additive is not None and spec.additive.requires_grad)
        )
    return AttentionInputs(q, k, v, bias, spec, float(scale), float(dropout_p), bool(requires_grad))
