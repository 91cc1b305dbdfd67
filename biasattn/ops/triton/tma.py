"""Tensor descriptors for Hopper's tensor memory accelerator (TMA), the copy engine of sm_90 and later.

A kernel that receives a descriptor instead of a pointer has each tile fetched by the copy engine:
no address arithmetic or bounds masks in the kernel's registers, and reads past a tensor's edge
come back as zeros. :func:`kv_descriptors` says whether K and V qualify and builds their
descriptors; everything else keeps pointer loads, with the same results.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..common import cuda_capability
from . import configs, options

_GPU_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _descriptor_class():
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


@functools.cache
def _field_defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def qualified_descriptor(cls, base: torch.Tensor, shape: list[int], strides: list[int], block_shape: list[int],
                         **fields):
    """A ``cls`` descriptor (Triton's ``TensorDescriptor`` or Gluon's) of a tensor its caller has qualified
    (:func:`describable`, the Gluon kernels' ``eligible``), built without the dataclass's own checks: launches
    build up to eleven per call, and those checks cost more host time than the rest of the descriptor."""
    d = object.__new__(cls)
    d.__dict__.update(_field_defaults(cls), base=base, shape=shape, strides=strides, block_shape=block_shape, **fields)
    return d


def available(device: torch.device) -> bool:
    """Whether launches on ``device`` take descriptors: a CUDA device of compute capability 9.0 or
    later (or the interpreter under the ``descriptors_interpreted`` option), a Triton that has them,
    and the ``descriptors`` option."""
    opts = options.current()
    if not opts.descriptors or _descriptor_class() is None:
        return False
    if configs.interpreted():
        return opts.descriptors_interpreted
    return device.type == "cuda" and cuda_capability(device) >= (9, 0)


def describable(t: torch.Tensor) -> bool:
    """Whether the copy engine can address ``t``: 16-byte aligned base and strides, unit last stride,
    no empty or broadcast (stride 0) dimension, and 16-bit elements on the GPU."""
    if t.dtype not in _GPU_DTYPES and not configs.interpreted():
        return False
    size = t.element_size()
    if t.data_ptr() % 16 or t.stride(-1) != 1 or min(t.shape) <= 0:
        return False
    return all(s > 0 and (s * size) % 16 == 0 for s in t.stride()[:-1])


def kv_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int, head_dim: int, head_dim_v: int, scores: int):
    """Descriptors of ``k [B, Hkv, Mk, D]`` and ``v [B, Hkv, Mk, Dv]`` that fetch ``[1, 1, block_n, head_dim]``
    tiles (head dims padded to the kernel's with zeros), or None when either tensor does not qualify
    or the launch computes fewer ``scores`` (:func:`~biasattn.ops.triton.flash.computed_scores`) than the
    ``descriptors_min_scores`` option: building and passing two descriptors costs about 30 µs of host
    time, more than the copy engine saves on a launch of about 20 µs of GPU time."""
    if scores < options.current().descriptors_min_scores or not (available(k.device) and describable(k) and describable(v)):
        return None
    cls = _descriptor_class()
    return (qualified_descriptor(cls, k, list(k.shape), list(k.stride()), [1, 1, block_n, head_dim]),
            qualified_descriptor(cls, v, list(v.shape), list(v.stride()), [1, 1, block_n, head_dim_v]))
