"""The chunked operator never allocates an ``Mq × Mk`` tensor: causal & padding at Mq = Mk = 8192.

CPU allocations are invisible to tracemalloc, so :class:`AllocationTracker` watches every aten op
through a ``TorchDispatchMode`` and records the storage size of each tensor the op returns. It is
checked against operations known to allocate a dense matrix, so a silent tracker cannot pass.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import biasattn as ba


class AllocationTracker(TorchDispatchMode):
    """Records the largest storage (bytes) returned by any aten op run inside the block."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.largest_op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                n = t.untyped_storage().nbytes()
                if n > self.largest:
                    self.largest, self.largest_op = n, str(func)
        return out


def _inputs(M, D=16, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, 1, M, D, generator=gen).requires_grad_(requires_grad) for _ in range(3)]


def test_tracker_detects_a_dense_matrix():
    M = 1024
    q, k, v = _inputs(M)
    bias = ba.LowerTriangularMask() & ba.PaddedKeysMask([M - 100])
    with AllocationTracker() as tracker:
        ba.attention(q, k, v, bias, op="reference")
    assert tracker.largest >= M * M * 4, tracker.largest_op
    with AllocationTracker() as tracker:
        torch.zeros(1, 1, M, M) + bias
    assert tracker.largest >= M * M * 4


def test_chunked_causal_and_padding_8192_allocates_no_mq_by_mk_tensor():
    M = 8192
    q, k, v = _inputs(M, requires_grad=True)
    bias = ba.LowerTriangularMask() & ba.PaddedKeysMask([M - 1000])
    with AllocationTracker() as tracker:
        out = ba.attention(q, k, v, bias, op="chunked")
        out.sum().backward()
    dense = M * M * 4
    # The largest buffers are a [block_q, block_k] score tile and the [M, D] inputs/outputs.
    assert tracker.largest < dense // 16, (tracker.largest, tracker.largest_op)
    assert q.grad.shape == q.shape and torch.isfinite(q.grad).all()
