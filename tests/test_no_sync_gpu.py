"""No call waits for the GPU: masks built fresh every step from Python lists, and reused ones, run
forward and backward under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any
synchronizing CUDA call (a blocking copy, a read of a device value on the host).

Key lengths built from a device tensor are never read: fresh padded-key masks from device lengths,
alone and composed, run without a wait, and a write into the lengths shows in the next call; so do
packed documents built from a device tensor of lengths (their tile tables are built on the device).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import biasattn as ba
from biasattn.testing import assert_close_to_reference, reference_attention

pytestmark = pytest.mark.gpu
DEV = "cuda"
B, H, M, D = 2, 4, 192, 64
LENS = ([150, 42], [100, 92], [192, 0])
DOCS = ([60, 70, 62], [192], [1, 190, 1])


@contextlib.contextmanager
def _sync_debug(mode: str):
    """``torch.cuda.set_sync_debug_mode(mode)`` inside the block, restored after."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def _padded(step):
    return ba.PaddedKeysMask(LENS[step % len(LENS)], device=DEV)


def _documents(step):
    return ba.BlockDiagonalMask.from_seqlens(DOCS[step % len(DOCS)] * B, device=DEV).make_causal()


def _documents_br(step):
    return ba.BlockDiagonalMask.from_seqlens(DOCS[step % len(DOCS)] * B, device=DEV).make_causal_from_bottom_right()


def _causal_padded(step):
    return ba.LowerTriangularMask() & ba.PaddedKeysMask(LENS[step % len(LENS)], device=DEV)


def _documents_moved(step):
    return ba.BlockDiagonalMask.from_seqlens(DOCS[step % len(DOCS)] * B).make_causal().to(DEV)


def _padded_moved(step):
    return ba.PaddedKeysMask(LENS[step % len(LENS)]).cuda()


FRESH = {"padded": _padded, "documents": _documents, "documents_br": _documents_br, "causal_padded": _causal_padded,
         "documents_moved": _documents_moved, "padded_moved": _padded_moved}
REUSED = {"causal": lambda: ba.LowerTriangularMask(), "window": lambda: ba.LocalAttentionMask(31, 0),
          "padded": lambda: _padded(0), "documents": lambda: _documents(0)}


def _tensors(packed: bool, dtype=torch.bfloat16):
    g = torch.Generator(device=DEV).manual_seed(0)
    b, m = (1, B * M) if packed else (B, M)
    return [torch.randn(b, H, m, D, device=DEV, dtype=dtype, generator=g).requires_grad_() for _ in range(3)]


def _step(q, k, v, bias, op):
    out = ba.attention(q, k, v, bias, op=op)
    return out, torch.autograd.grad(out, (q, k, v), torch.ones_like(out))


def _check_against_reference(q, k, v, bias, out):
    ref, _ = reference_attention(q, k, v, bias)
    low, _ = reference_attention(q, k, v, bias, compute_dtype=q.dtype)
    assert_close_to_reference(out, ref, low)


@pytest.mark.parametrize("op", [None, "triton"], ids=["auto", "triton"])
@pytest.mark.parametrize("name", list(FRESH))
def test_fresh_masks_from_lists_never_wait_for_the_gpu(name, op):
    """Six steps, a new mask object each step (three length sets, each seen twice): no synchronizing call."""
    make = FRESH[name]
    q, k, v = _tensors(name.startswith("documents"))
    for step in range(len(LENS)):  # warm-up: kernels compile and dispatch choices are made
        _step(q, k, v, make(step), op)
    torch.cuda.synchronize()
    outs = []
    with _sync_debug("error"):
        for step in range(2 * len(LENS)):
            bias = make(step)
            outs.append((bias, _step(q, k, v, bias, op)[0]))
    torch.cuda.synchronize()
    for bias, out in outs[: len(LENS)]:
        _check_against_reference(q, k, v, bias, out)


@pytest.mark.parametrize("name", list(REUSED))
def test_reused_masks_never_wait_for_the_gpu(name):
    """One mask object, three steps: no synchronizing call."""
    bias = REUSED[name]()
    q, k, v = _tensors(name == "documents")
    _step(q, k, v, bias, None)
    torch.cuda.synchronize()
    with _sync_debug("error"):
        for _ in range(3):
            out, _ = _step(q, k, v, bias, None)
    _check_against_reference(q, k, v, bias, out)


DEVICE_PADDED = {
    "padded": lambda t: ba.PaddedKeysMask(t),
    "causal_padded": lambda t: ba.LowerTriangularFromBottomRightMask() & ba.PaddedKeysMask(t),
    "window_padded": lambda t: ba.PaddedKeysMask(t) & ba.LocalAttentionMask(40, 0),
}


@pytest.mark.parametrize("op", [None, "triton"], ids=["auto", "triton"])
@pytest.mark.parametrize("name", list(DEVICE_PADDED))
def test_fresh_padded_masks_from_device_lengths_never_wait_for_the_gpu(name, op):
    """A new mask each step from a device tensor of lengths, written in place between steps (one out of range,
    which acts clamped): no synchronizing call, and each step's result is that step's lengths'."""
    q, k, v = _tensors(False)
    lengths = torch.tensor(LENS[0], device=DEV, dtype=torch.int32)
    _step(q, k, v, DEVICE_PADDED[name](lengths), op)
    torch.cuda.synchronize()
    steps = [*LENS, [-3, 500]]
    outs = []
    with _sync_debug("error"):
        for values in steps:
            lengths.copy_(torch.tensor(values, dtype=torch.int32).pin_memory(), non_blocking=True)
            outs.append(_step(q, k, v, DEVICE_PADDED[name](lengths), op)[0])
    torch.cuda.synchronize()
    for values, out in zip(steps, outs):
        clamped = [min(max(n, 0), M) for n in values]
        _check_against_reference(q, k, v, DEVICE_PADDED[name](torch.tensor(clamped, device=DEV)), out)


@pytest.mark.parametrize("name", list(DEVICE_PADDED))
def test_a_cuda_graph_replays_the_lengths_written_into_its_mask(name):
    """Captured once, replayed after each in-place write of new lengths: every replay is that step's attention."""
    q, k, v = (t.detach() for t in _tensors(False))
    lengths = torch.tensor(LENS[0], device=DEV, dtype=torch.int32)
    bias = DEVICE_PADDED[name](lengths)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            ba.attention(q, k, v, bias)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ba.attention(q, k, v, bias)
    for values in [*LENS, [-3, 500]]:
        lengths.copy_(torch.tensor(values, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        clamped = [min(max(n, 0), M) for n in values]
        _check_against_reference(q, k, v, DEVICE_PADDED[name](torch.tensor(clamped, device=DEV)), out.clone())


@pytest.mark.parametrize("op", [None, "triton"], ids=["auto", "triton"])
@pytest.mark.parametrize("band", ["causal", "bottom_right"])
def test_fresh_documents_from_device_tensors_never_wait_for_the_gpu(band, op):
    """Packed documents built every step from a device tensor of lengths (as a data loader hands them over):
    no synchronizing call, forward and backward, and each step's result is that of its own lengths."""
    q, k, v = _tensors(True)
    lengths = [torch.tensor(docs * B, device=DEV, dtype=torch.int32) for docs in DOCS]

    def make(t):
        mask = ba.BlockDiagonalMask.from_seqlens(t)
        return mask.make_causal() if band == "causal" else mask.make_causal_from_bottom_right()

    _step(q, k, v, make(lengths[0]), op)
    torch.cuda.synchronize()
    outs = []
    with _sync_debug("error"):
        for step in range(6):
            outs.append(_step(q, k, v, make(lengths[step % len(lengths)]), op)[0])
    for step, out in enumerate(outs):
        expected = ba.BlockDiagonalMask.from_seqlens(DOCS[step % len(DOCS)] * B)
        expected = expected.make_causal() if band == "causal" else expected.make_causal_from_bottom_right()
        _check_against_reference(q, k, v, expected, out)


@pytest.mark.parametrize("op", [None, "triton"], ids=["auto", "triton"])
def test_a_captured_training_step_builds_the_documents_of_each_replay(op):
    """Packed documents built inside a captured forward+backward from a device tensor of lengths: each
    replay after an in-place write of new lengths gives what an eager step with a mask built from those
    lengths gives (output and gradients), so a graphed training loop pays nothing for a fresh mask."""
    q, k, v = _tensors(True)
    dout = torch.randn(q.shape, device=DEV, dtype=q.dtype, generator=torch.Generator(device=DEV).manual_seed(1))
    steps = ([60, 70, 62], [1, 190, 1], [0, 192, 0], [192, 0, 0])
    lengths = torch.tensor(steps[0] * B, device=DEV, dtype=torch.int32)

    def step(lens):
        out = ba.attention(q, k, v, ba.BlockDiagonalMask.from_seqlens(lens).make_causal(), op=op)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(lengths)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(lengths)
    for values in (*steps[1:], steps[0]):
        lengths.copy_(torch.tensor(values * B, dtype=torch.int32))
        graph.replay()
        eager = step(torch.tensor(values * B, device=DEV, dtype=torch.int32))
        torch.cuda.synchronize()
        for name, a, b in zip(("out", "dq", "dk", "dv"), captured, eager):
            assert torch.equal(a, b), f"{name} of the replay with lengths {values} differs from the eager step"
        _check_against_reference(q, k, v, ba.BlockDiagonalMask.from_seqlens(values * B).make_causal(), captured[0].clone())
