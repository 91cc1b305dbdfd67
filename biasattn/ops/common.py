"""Small helpers shared by the PyTorch operators."""

from __future__ import annotations

import functools
import os
import sys

import torch

from ..bias.atoms import readable


def interpreted() -> bool:
    """True when the Triton kernels run through Triton's CPU interpreter.

    Once the kernels are loaded, their decoration decided it; before that, ``TRITON_INTERPRET`` does.
    """
    for name in ("biasattn.ops.triton.flash", "biasattn.ops.triton.splitk"):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "INTERPRETED"):
            return bool(mod.INTERPRETED)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def int32_on(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` as int32 on ``device``: itself when it already is (a mask's lengths usually are), so the
    launch path pays no conversion call."""
    return t if t.dtype is torch.int32 and t.device == device else t.to(device=device, dtype=torch.int32)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (Triton's ``cdiv`` unwraps constexprs on every call; this runs per launch)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``), in plain ints like :func:`cdiv`."""
    return 1 << max(0, n - 1).bit_length()


def tile_size(n: int, lo: int = 16) -> int:
    """A kernel tile dim covering ``n``: the next power of two, at least ``lo`` (``tl.dot``'s minimum)."""
    return max(lo, next_power_of_2(n))


def head_tiles(D: int, Dv: int) -> tuple[int, int]:
    """The kernels' tile dims of q/k rows and of v rows: one :func:`tile_size` covering both head dims.

    With two different tile dims, Triton 3.6 on Hopper miscompiled the 16-bit forward for some tile
    configurations (wrong outputs, illegal addresses; D=24/Dv=16, D=32/Dv=16, D=64/Dv=32 on the H200)."""
    size = tile_size(max(D, Dv))
    return size, size


def slice_span(t: torch.Tensor) -> int:
    """Largest element offset inside one (batch, head) slice of a 4-D ``t`` (dims 2 and 3)."""
    _, _, m, d = t.shape
    _, _, sm, sd = t.stride()
    return max(m - 1, 0) * abs(sm) + max(d - 1, 0) * abs(sd)


def heads_inside_rows(t: torch.Tensor) -> bool:
    """Whether ``t [B, H, M, X]`` keeps each row's heads side by side in memory (``[B, M, H, X]``, as q
    viewed from a ``[B, M, H * D]`` projection is), where the choice matters (H and M above 1)."""
    return t.shape[1] > 1 and t.shape[2] > 1 and t.stride(1) < t.stride(2)


def new_like_rows(t: torch.Tensor, shape, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new dense ``[B, H, M, X]`` tensor laid out like ``t``: each row's heads side by side where ``t``
    has them so (:func:`heads_inside_rows`), else contiguous. An output laid out like q makes
    ``out.transpose(1, 2).reshape(B, M, H * X)`` a view, and the gradient that comes back through it
    needs no copy either."""
    if heads_inside_rows(t):
        B, H, M, X = shape
        return t.new_empty((B, M, H, X), dtype=dtype).transpose(1, 2)
    return t.new_empty(shape, dtype=dtype)


def in_layout_of_rows(ref: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` laid out as :func:`new_like_rows` lays out a tensor like ``ref`` (a copy only where it is not)."""
    B, H, M, X = t.shape
    inside = heads_inside_rows(ref)
    strides = (M * H * X, X, H * X, 1) if inside else (H * M * X, M * X, X, 1)
    if all(n == 1 or a == b for n, a, b in zip(t.shape, t.stride(), strides)):  # strides of size-1 dims never matter
        return t
    return new_like_rows(ref, t.shape, t.dtype).copy_(t)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def group_heads(t: torch.Tensor, Hkv: int) -> torch.Tensor:
    """View ``[B, Hq, ...]`` (or a head-broadcast ``[B, 1, ...]``) as ``[B, Hkv, G, ...]``."""
    b, h = t.shape[:2]
    if h == 1:
        return t.reshape(b, 1, 1, *t.shape[2:])
    return t.reshape(b, Hkv, h // Hkv, *t.shape[2:])


def reduce_to(t: torch.Tensor, shape) -> torch.Tensor:
    """Sum ``t`` over the dims where ``shape`` broadcasts (size 1), keeping dims."""
    dims = [d for d, (n, m) in enumerate(zip(t.shape, shape)) if m == 1 and n != 1]
    return t.sum(dim=dims, keepdim=True) if dims else t


def dropout_keep(seed: int, tile: tuple[int, int], shape, p: float, device) -> torch.Tensor:
    """Deterministic keep-mask (float, 0 or 1/(1-p)) of one tile; the same tile gives the same mask."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + tile[0] * 92_821 + tile[1]) % (2**63 - 1))
    keep = torch.rand(shape, generator=gen, device=device) >= p
    return keep.to(torch.float32) / (1.0 - p)


def new_seed() -> int:
    """A dropout seed drawn from torch's default CPU generator (so torch.manual_seed reproduces it)."""
    return int(torch.randint(0, 2**62, (1,)).item())


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device, read once per device (it is asked on every call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (4 for the CPU, where kernels run under the interpreter)."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def may_hold_nonfinite(t: torch.Tensor) -> bool:
    """Whether ``t`` may hold NaN or inf: one sum per call (a NaN or inf makes it non-finite), so finite
    inputs skip the hidden-value masking; a sum that overflows float32 answers True as well, which only
    turns the masking on. A sum costs a fifth of ``isfinite(t).all()`` on a CPU.

    True while a CUDA graph is being captured or a trace holds ``t`` (neither may branch on a value;
    masking is then always on).
    """
    if not readable(t) or (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        return True
    wide = torch.float64 if t.dtype == torch.float64 else torch.float32
    return t.numel() > 0 and not bool(torch.isfinite(t.sum(dtype=wide)))
