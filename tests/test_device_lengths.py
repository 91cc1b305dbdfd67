"""Length-defined biases hold their lengths as tensors: new lengths never recompile a compiled function,
masks build from tensors without reading them, and an in-place write to the lengths takes effect."""

from __future__ import annotations

import random

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import biasattn as ba
from biasattn.testing import assert_close_to_reference, reference_attention

STEPS = 50
CAUSAL_BR = ba.LowerTriangularFromBottomRightMask()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(fn):
    cnt = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    return torch.compile(fn, fullgraph=True, dynamic=True, backend=cnt), cnt


def _graphs(cnt) -> int:
    """Graphs compiled with any node (with dynamic=True, Dynamo also hands the backend one empty graph
    on the first call, with or without a bias)."""
    return sum(len(g.graph.nodes) > 0 for g in cnt.graphs)


def _qkv(B, M, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, 2, M, 8, generator=g, dtype=torch.float64) for _ in range(3)]


def _check(out, q, k, v, bias):
    ref, _ = reference_attention(q, k, v, bias)
    assert_close_to_reference(out, ref)


def _random_split(rng: random.Random, total: int) -> list[int]:
    cuts = sorted(rng.randint(0, total) for _ in range(rng.randint(0, 5)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def _split_into(rng: random.Random, total: int, parts: int) -> list[int]:
    """``parts`` lengths summing to ``total``, empty ones allowed."""
    cuts = sorted(rng.choices(range(total + 1), k=parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def test_padded_keys_passed_in_compile_once_for_fifty_sets_of_lengths():
    """A PaddedKeysMask argument used to recompile for every new set of lengths (its lengths were guarded)."""
    cfn, cnt = _compiled(lambda q, k, v, bias: ba.attention(q, k, v, bias & ba.LowerTriangularFromBottomRightMask()))
    frames = None
    rng = random.Random(0)
    for step in range(STEPS):
        q, k, v = _qkv(3, 13, step)
        bias = ba.PaddedKeysMask(torch.tensor([rng.randint(0, 13) for _ in range(3)]))
        _check(cfn(q, k, v, bias), q, k, v, bias & ba.LowerTriangularFromBottomRightMask())
        if step == 0:
            frames = cnt.frame_count
    assert _graphs(cnt) == 1 and cnt.frame_count == frames


def test_padded_keys_built_inside_from_a_tensor_compile_once():
    """PaddedKeysMask(lengths) built inside the compiled function from a tensor traces (it used to fail) and
    compiles once for fifty sets of lengths."""
    cfn, cnt = _compiled(lambda q, k, v, lengths: ba.attention(q, k, v, ba.PaddedKeysMask(lengths)))
    frames = None
    rng = random.Random(1)
    for step in range(STEPS):
        q, k, v = _qkv(2, 11, step)
        lengths = torch.tensor([rng.randint(0, 11) for _ in range(2)])
        _check(cfn(q, k, v, lengths), q, k, v, ba.PaddedKeysMask(lengths))
        if step == 0:
            frames = cnt.frame_count
    assert _graphs(cnt) == 1 and cnt.frame_count == frames


def test_packed_documents_passed_in_compile_once_for_fifty_sets_of_documents():
    """A BlockDiagonalMask argument (made causal inside) compiles once for fifty packings of the same tokens."""
    cfn, cnt = _compiled(lambda q, k, v, bias: ba.attention(q, k, v, bias.make_causal()))
    frames = None
    rng = random.Random(2)
    for step in range(STEPS):
        q, k, v = _qkv(1, 29, step)
        bias = ba.BlockDiagonalMask.from_seqlens(_random_split(rng, 29))
        _check(cfn(q, k, v, bias), q, k, v, bias.make_causal())
        if step == 0:
            frames = cnt.frame_count
    assert _graphs(cnt) == 1 and cnt.frame_count == frames


def test_packed_documents_built_inside_from_tensors_compile_once_for_fifty_sets_of_documents():
    """BlockDiagonalMask.from_seqlens(tensor) inside the compiled function used to fail to trace (it read the
    lengths); it now keeps them as tensors, and fifty packings (2 to 6 documents: torch specializes a dim of
    size 1) compile one graph, with queries and keys packed apart."""
    def fn(q, k, v, q_lens, k_lens):
        return ba.attention(q, k, v, ba.BlockDiagonalMask.from_seqlens(q_lens, k_lens).make_causal_from_bottom_right())

    cfn, cnt = _compiled(fn)
    frames = None
    rng = random.Random(3)
    for step in range(STEPS):
        n = rng.randint(2, 6)
        q_lens, k_lens = (_split_into(rng, total, n) for total in (23, 31))
        q = _qkv(1, 23, step)[0]
        k, v = _qkv(1, 31, step)[1:]
        bias = ba.BlockDiagonalMask.from_seqlens(q_lens, k_lens).make_causal_from_bottom_right()
        _check(cfn(q, k, v, torch.tensor(q_lens), torch.tensor(k_lens)), q, k, v, bias)
        if step == 0:
            frames = cnt.frame_count
    assert _graphs(cnt) == 1 and cnt.frame_count == frames


def test_packed_lengths_traced_as_tensors_are_checked_when_the_compiled_call_runs():
    """Lengths that were not read while tracing must still sum to the call's M and be non-negative."""
    cfn, _ = _compiled(lambda q, k, v, lens: ba.attention(q, k, v, ba.BlockDiagonalMask.from_seqlens(lens)))
    q, k, v = _qkv(1, 9, 0)
    with pytest.raises(ba.errors.InputError, match=r"q_seqlens sum to 8, q has Mq=9"):
        cfn(q, k, v, torch.tensor([3, 5]))
    with pytest.raises(ba.errors.InputError, match=r"q_seqlens\[1\] must be >= 0, got -2"):
        cfn(q, k, v, torch.tensor([11, -2]))


@pytest.mark.parametrize("op", ["chunked", "reference"])
def test_an_in_place_write_to_the_lengths_takes_effect_on_the_next_call(op):
    """Writing new lengths into a mask's tensor changes the next call's result (chunked returned the stale one)."""
    q, k, v = _qkv(2, 9, 0)
    lengths = torch.tensor([9, 9], dtype=torch.int32)
    bias = ba.PaddedKeysMask(lengths)
    assert bias.kv_seqlens is lengths  # kept, not copied
    ba.attention(q, k, v, bias, op=op)
    lengths[1] = 3
    _check(ba.attention(q, k, v, bias, op=op), q, k, v, ba.PaddedKeysMask([9, 3]))
    packed = ba.BlockDiagonalMask.from_seqlens([4, 5])
    q1, k1, v1 = (t[:1] for t in (q, k, v))
    ba.attention(q1, k1, v1, packed, op=op)
    starts = packed.atoms[0].q_seqstart
    starts[1] = 2
    packed.atoms[0].k_seqstart[1] = 2
    packed.atoms[0].k_seqlen.copy_(torch.tensor([2, 7]))
    _check(ba.attention(q1, k1, v1, packed, op=op), q1, k1, v1, ba.BlockDiagonalMask.from_seqlens([2, 7]))


def test_lengths_from_a_tensor_are_not_read_when_the_mask_is_built():
    """Building a PaddedKeysMask from a tensor reads no value: it works on lengths that live on the meta device."""
    bias = ba.PaddedKeysMask(torch.empty(4, dtype=torch.int64, device="meta"))
    assert bias.kv_seqlens.device.type == "meta" and tuple(bias.shape)[0] == 4
    assert "4 lengths" in repr(bias)


@pytest.mark.parametrize("op", ["reference", "chunked", "triton", "auto"])
def test_key_lengths_only_the_device_holds_are_never_read_on_the_call_path(monkeypatch, op):
    """A GPU tensor's key lengths reach the kernels as they are: no operator reads a value on the host (here a
    CPU tensor plays the GPU's part: its host copy is withheld and any read raises). Out-of-range values act
    as clamped to [0, Mk]; composition, slicing and a batch of one length stay on the device; the vendor
    kernels, which need host lengths, refuse with that reason."""
    from biasattn.bias.atoms import Atom
    from biasattn.bias.padded import PaddedKeysAtom
    from biasattn.inputs import make_inputs

    if op == "triton" and torch.cuda.is_available():
        pytest.skip("CPU tensors reach the triton kernels only under the interpreter (GPU runs: test_no_sync_gpu.py)")

    def no_read(*args):
        raise AssertionError("a length was read on the host")

    monkeypatch.setattr(PaddedKeysAtom, "known_lengths", lambda self: None)
    monkeypatch.setattr(Atom, "host_copy", no_read)
    dtype = torch.float64 if op != "triton" else torch.float32
    q, k, v = (t.to(dtype) for t in _qkv(3, 7, 0))
    run = dict(op=None if op == "auto" else op)
    cases = [
        (torch.tensor([7, -2, 30]), [7, 0, 7], None),
        (torch.tensor([4]), [4, 4, 4], None),
        (torch.tensor([5, 1, 7]), [5, 1, 3], CAUSAL_BR & ba.PaddedKeysMask(torch.tensor([6, 9, 3]))),
    ]
    for lengths, clamped, extra in cases:
        bias = ba.PaddedKeysMask(lengths)
        bias = bias if extra is None else bias & extra
        out = ba.attention(q, k, v, bias, **run)
        monkeypatch.undo()
        expected = ba.PaddedKeysMask(clamped)
        expected = expected if extra is None else CAUSAL_BR & expected
        _check(out, q, k, v, expected)
        monkeypatch.setattr(PaddedKeysAtom, "known_lengths", lambda self: None)
        monkeypatch.setattr(Atom, "host_copy", no_read)
    sliced = ba.PaddedKeysMask(torch.tensor([6, 2, 7]))[:, :, :, 1:]
    out = ba.attention(q, k[:, :, 1:], v[:, :, 1:], sliced, **run)
    monkeypatch.undo()
    _check(out, q, k[:, :, 1:], v[:, :, 1:], ba.PaddedKeysMask([5, 1, 6]))
    monkeypatch.setattr(PaddedKeysAtom, "known_lengths", lambda self: None)
    inp = make_inputs(q.half(), k.half(), v.half(), ba.PaddedKeysMask(torch.tensor([3, 4, 5])))
    for name in ("cutlass", "flash2"):
        why = ba.ops.get(name).extra_reasons(inp, backward=False)
        assert any("on the device only" in r for r in why), why


def test_masks_of_lengths_only_the_device_holds_are_lowered_by_structure(monkeypatch):
    """A mask built anew every step from device lengths reuses the spec of its structure with its own tensors
    (one lookup, no lowering); results follow each mask's lengths. Causal documents whose queries and keys share
    one tensor of starts have one diagonal, so they share too. A slice, whose lengths are computed from the
    tensors, and packed documents with a band per document are lowered in full."""
    from biasattn.bias import spec as spec_module
    from biasattn.bias.block_diagonal import SegmentsAtom
    from biasattn.bias.padded import PaddedKeysAtom
    from biasattn.bias.spec import lower

    monkeypatch.setattr(spec_module, "_STRUCTURAL_SPECS", {})
    monkeypatch.setattr(PaddedKeysAtom, "known_lengths", lambda self: None)
    monkeypatch.setattr(SegmentsAtom, "starts_known", lambda self: False)
    q, k, v = _qkv(3, 7, 0)
    built = []
    real_build = spec_module.SpecBuilder.build
    monkeypatch.setattr(spec_module.SpecBuilder, "build", lambda self: built.append(1) or real_build(self))
    outs, masks = [], []
    for lengths in ([7, 2, 5], [1, 6, 3], [4, 4, 0]):
        mask = ba.PaddedKeysMask(torch.tensor(lengths)) & ba.LocalAttentionMask(3, 1)
        spec = lower(mask, 3, 2, 7, 7)
        assert spec.kv_seqlens is mask.atoms[0].kv_seqlens
        outs.append(ba.attention(q, k, v, mask, op="reference"))
        masks.append(lengths)
    assert len(built) == 1, "masks of one structure were lowered more than once"
    first, second = (lower(ba.PaddedKeysMask(torch.tensor(n)), 3, 2, 7, 7) for n in ([1, 2, 3], [3, 2, 1]))
    assert first.derived is not second.derived and first.kv_seqlens is not second.kv_seqlens
    assert first.by_structure is second.by_structure, "what follows from the structure is derived once"
    built.clear()
    for n in ([6, 2, 7], [5, 5, 5]):
        lower(ba.PaddedKeysMask(torch.tensor(n))[:, :, :, 1:], 3, 2, 7, 6)
    assert len(built) == 2, "a slice's shifted lengths were taken from another mask"
    built.clear()
    for n in ([3, 4], [5, 2]):
        lower(ba.BlockDiagonalMask._from_tensors(torch.tensor(n), None, None), 1, 2, 7, 7)
        causal = lower(ba.BlockDiagonalMask._from_tensors(torch.tensor(n), None, None).make_causal(), 1, 2, 7, 7)
        assert causal.band_lo.numel() == 1 and causal.band_hi.tolist() == [0]
        lower(ba.BlockDiagonalMask._from_tensors(torch.tensor(n), torch.tensor(n), None).make_causal(), 1, 2, 7, 7)
    assert len(built) == 4, ("plain documents and causal ones on one tensor of starts share a spec; with key "
                             "lengths of their own, causal documents compute their bands every time")
    monkeypatch.undo()
    for out, lengths in zip(outs, masks):
        _check(out, q, k, v, ba.PaddedKeysMask(lengths) & ba.LocalAttentionMask(3, 1))


@pytest.mark.parametrize("op", ["reference", "triton", "auto"])
def test_packed_documents_only_the_device_holds_are_never_read_on_the_call_path(monkeypatch, op):
    """Documents from a GPU tensor reach the kernels as their running sums, computed on the device: the
    tile tables, the bands of causal, bottom-right and windowed documents, a slice of the mask, forward
    and backward, and no value read on the host (here CPU tensors play the GPU's part: their host copies
    are withheld and any read raises). The operators that need the lengths on the host refuse."""
    from biasattn.bias.atoms import Atom
    from biasattn.bias.block_diagonal import SegmentsAtom
    from biasattn.inputs import make_inputs

    if op == "triton" and torch.cuda.is_available():
        pytest.skip("CPU tensors reach the triton kernels only under the interpreter (GPU runs: test_no_sync_gpu.py)")
    dtype = torch.float64 if op != "triton" else torch.float32
    run = dict(op=None if op == "auto" else op)
    bands = {"plain": lambda m: m, "causal": lambda m: m.make_causal(),
             "bottom_right": lambda m: m.make_causal_from_bottom_right(),
             "window": lambda m: m.make_local_attention(3, 1)}
    cases = [([5, 9, 10], None, "plain"), ([5, 9, 10], [7, 3, 14], "causal"), ([5, 9, 10], None, "causal"),
             ([3, 0, 12, 9], None, "bottom_right"), ([3, 0, 12, 9], None, "window"), ([8, 16], [20, 4], "window")]
    for q_lens, k_lens, band in ((q_lens, k_lens, bands[name]) for q_lens, k_lens, name in cases):
        Mq, Mk = sum(q_lens), sum(k_lens or q_lens)
        q, k, v = (t.to(dtype).requires_grad_() for t in _qkv(1, max(Mq, Mk), 0))
        q, k, v = q[:, :, :Mq], k[:, :, :Mk], v[:, :, :Mk]
        expected = band(ba.BlockDiagonalMask.from_seqlens(q_lens, k_lens))
        for rows in (slice(0, Mq), slice(4, Mq - 2)):
            monkeypatch.setattr(SegmentsAtom, "starts_known", lambda self: False)
            monkeypatch.setattr(Atom, "host_copy", lambda *a: (_ for _ in ()).throw(AssertionError("read on the host")))
            k_t = None if k_lens is None else torch.tensor(k_lens)
            mask = band(ba.BlockDiagonalMask._from_tensors(torch.tensor(q_lens), k_t, None))
            out = ba.attention(q[:, :, rows], k, v, mask[..., rows, :], **run)
            grads = torch.autograd.grad(out.sum(), (q, k, v))
            monkeypatch.undo()
            ref, _ = reference_attention(q[:, :, rows], k, v, expected[..., rows, :])
            assert_close_to_reference(out, ref)
            want = torch.autograd.grad(ref.sum(), (q, k, v))
            for g, w in zip(grads, want):
                assert_close_to_reference(g, w)
    monkeypatch.setattr(SegmentsAtom, "starts_known", lambda self: False)
    inp = make_inputs(q.half(), k.half(), v.half(), ba.BlockDiagonalMask._from_tensors(torch.tensor([8, 16]), None, None))
    for name in ("cutlass", "flash2", "chunked", "triton_splitk"):
        if name in ba.ops.available():
            assert any("on the device only" in r for r in ba.ops.get(name).not_supported_reasons(inp)), name


def test_packed_documents_only_the_device_holds_share_their_dispatch_choice(monkeypatch):
    """Masks built every step from a device tensor of lengths: the dispatcher walks its operators once
    per number of documents, not once per mask (no verdict can read the lengths)."""
    from biasattn import dispatch
    from biasattn.bias.block_diagonal import SegmentsAtom

    monkeypatch.setattr(SegmentsAtom, "starts_known", lambda self: False)
    monkeypatch.setattr(dispatch, "_length_mask_choices", type(dispatch._length_mask_choices)(16))
    walks = []
    real = dispatch._choose
    monkeypatch.setattr(dispatch, "_choose", lambda *a: walks.append(1) or real(*a))
    q, k, v = _qkv(1, 24, 0)
    for lengths in ([5, 9, 10], [20, 2, 2], [1, 1, 22], [12, 12]):
        mask = ba.BlockDiagonalMask._from_tensors(torch.tensor(lengths), None, None).make_causal()
        ba.attention(q, k, v, mask)
    assert len(walks) == 2, "one walk for three documents, one for two"


def test_negative_lengths_from_a_tensor_are_an_error_at_call_time():
    """Values the host holds are checked when the mask is used, with the message a list gets at construction."""
    q, k, v = _qkv(2, 5, 0)
    with pytest.raises(ba.errors.InputError, match=r"kv_seqlens\[1\] must be >= 0"):
        ba.attention(q, k, v, ba.PaddedKeysMask(torch.tensor([2, -1])))
    with pytest.raises(ba.errors.InputError, match=r"kv_seqlens\[1\] must be >= 0"):
        ba.PaddedKeysMask([2, -1])


def test_a_bias_built_from_lists_follows_q():
    """A mask built from Python lists with no device runs wherever q is (it raised 'attn_bias is on cpu, q is
    on cuda'); one given a device, or moved with .to(), keeps it."""
    q, k, v = _qkv(2, 7, 0)
    meta = [t.to("meta") for t in (q, k, v)]
    floating = ba.PaddedKeysMask([3, 7]) & ba.LowerTriangularMask()
    packed = ba.BlockDiagonalMask.from_seqlens([2, 5]).make_causal()
    assert floating.follows_q and packed.follows_q and ba.LowerTriangularMask().follows_q
    from biasattn.inputs import make_inputs

    spec = make_inputs(*meta, floating).spec
    assert spec.kv_seqlens.device.type == "meta"
    assert make_inputs(*(t[:1] for t in meta), packed).spec.q_seqstart.device.type == "meta"
    pinned = ba.PaddedKeysMask([3, 7], device="cpu")
    assert not pinned.follows_q and not floating.to("cpu").follows_q
    with pytest.raises(ba.errors.InputTypeError, match="move it with"):
        make_inputs(*meta, pinned)


def test_a_write_before_the_first_call_is_seen():
    """Lengths given as a list and written in place before the mask is first used: the call reads the tensor,
    not the list the mask was built from."""
    q, k, v = _qkv(2, 9, 0)
    bias = ba.PaddedKeysMask([9, 9])
    bias.kv_seqlens[1] = 4
    _check(ba.attention(q, k, v, bias, op="chunked"), q, k, v, ba.PaddedKeysMask([9, 4]))
    assert bias.atoms[0].lengths() == (9, 4)


def test_host_lists_reach_the_device_as_given():
    """Lengths, cu_seqlens and tile tables go through one helper (pinned, non-blocking on a GPU)."""
    from biasattn.bias.atoms import to_device

    t = to_device([3, 1, 4], "cpu", torch.int32)
    assert t.dtype == torch.int32 and t.tolist() == [3, 1, 4]
    same = to_device(torch.tensor([2.5]), "cpu", torch.float64)
    assert same.dtype == torch.float64 and same.item() == 2.5
    assert ba.BlockDiagonalMask.from_seqlens([2, 3]).materialize((1, 1, 5, 5)).isfinite().sum() == 13


def test_masks_from_lists_make_one_copy_of_their_lengths(monkeypatch):
    """A mask built from Python lists uploads its lengths once (one pinned host tensor on a GPU, copied
    without waiting into a tensor per role), and documents of self-attention share one tensor of starts
    for queries and keys."""
    from biasattn.bias import block_diagonal

    copies = []
    real = block_diagonal.to_device_parts
    monkeypatch.setattr(block_diagonal, "to_device_parts", lambda *a, **kw: copies.append(a[0]) or real(*a, **kw))
    self_attention = ba.BlockDiagonalMask.from_seqlens([2, 5, 3])
    cross = ba.BlockDiagonalMask.from_seqlens([2, 5, 3], [4, 1, 6])
    assert len(copies) == 2
    (a,), (b,) = self_attention.atoms, cross.atoms
    assert a.q_seqstart is a.k_seqstart and a.q_seqstart.tolist() == [0, 2, 7, 10] and a.k_seqlen.tolist() == [2, 5, 3]
    assert b.q_seqstart.tolist() == [0, 2, 7, 10] and b.k_seqstart.tolist() == [0, 4, 5, 11]
    assert b.k_seqlen.tolist() == [4, 1, 6]


def test_documents_built_from_lists_on_a_gpu_are_lowered_as_device_data(monkeypatch):
    """Packed self-attention documents built from lists with ``device=`` off the CPU (the meta device
    plays the GPU here: no value can be read there) lower like lengths from a GPU tensor: their tensors
    pass through unread and masks built anew share one spec per number of documents. Queries and keys
    packed apart, slices and compositions with another block-diagonal mask are lowered from the host copies."""
    from biasattn.bias import spec as spec_module
    from biasattn.bias.spec import lower

    monkeypatch.setattr(spec_module, "_STRUCTURAL_SPECS", {})
    built = []
    real_build = spec_module.SpecBuilder.build
    monkeypatch.setattr(spec_module.SpecBuilder, "build", lambda self: built.append(1) or real_build(self))
    specs = []
    for lengths in ([5, 9, 10], [20, 2, 2], [1, 1, 22]):
        mask = ba.BlockDiagonalMask.from_seqlens(lengths, device="meta").make_causal()
        spec = lower(mask, 1, 2, 24, 24, "meta")
        assert spec.host.q_seqstart is None and spec.q_seqstart is mask.atoms[0].q_seqstart
        assert spec.band_lo.numel() == 1
        assert mask.q_seqlens == lengths, "the host copies still serve the mask's own accessors"
        specs.append(spec)
    assert len(built) == 1, "documents of one structure were lowered more than once"
    assert specs[0].by_structure is specs[2].by_structure and specs[0].derived is not specs[2].derived
    cross = lower(ba.BlockDiagonalMask.from_seqlens([5, 9], [7, 3], device="meta"), 1, 2, 14, 10, "meta")
    assert cross.host.q_seqstart == (0, 5, 14), "a decode batch keeps its host lengths"
    docs = ba.BlockDiagonalMask.from_seqlens([5, 9], device="meta")
    both = lower(docs & ba.BlockDiagonalMask.from_seqlens([5, 9], device="meta"), 1, 2, 14, 14, "meta")
    assert both.host.q_seqstart == (0, 5, 14)
    part = lower(docs[..., 2:, 2:], 1, 2, 12, 12, "meta")
    assert part.host.q_seqstart == (0, 3, 12), "a slice (a context-parallel pair) keeps its host lengths"
    on_cpu = lower(ba.BlockDiagonalMask.from_seqlens([5, 9]), 1, 2, 14, 14, "cpu")
    assert on_cpu.host.q_seqstart == (0, 5, 14), "CPU lengths are read for free"


def test_key_bounds_of_documents_only_the_device_holds_cover_every_key(monkeypatch):
    """Host-side key bounds (context-parallel pairs, tile skipping) of packed documents whose lengths only
    the device holds cover every key instead of reading lengths the host does not have."""
    from biasattn.bias.block_diagonal import SegmentsAtom
    from biasattn.bias.spec import lower
    from biasattn.distributed.pairs import hides_everything
    from biasattn.ops.tiles import key_range, query_range

    monkeypatch.setattr(SegmentsAtom, "starts_known", lambda self: False)
    mask = ba.BlockDiagonalMask._from_tensors(torch.tensor([5, 9, 10]), None, None).make_causal()
    for spec in (lower(mask, 1, 2, 24, 24), lower(mask[..., 4:, :20], 1, 2, 20, 20)):
        assert spec.host.q_seqstart is None
        assert key_range(spec, 0, 3) == (0, spec.Mk) and query_range(spec) == (0, spec.Mq)
        assert not hides_everything(spec)


def test_moving_a_list_built_mask_keeps_one_tensor_of_starts_and_its_host_copies():
    """``.to(device)`` moves a tensor that plays two roles once (self-attention documents keep one tensor of
    starts, so they lower as device data there) and keeps the lengths the host was given."""
    from biasattn.bias.spec import lower

    docs = ba.BlockDiagonalMask.from_seqlens([3, 5]).make_causal().to("meta")
    atom = docs.atoms[0]
    assert atom.q_seqstart is atom.k_seqstart and atom.q_seqstart.device.type == "meta"
    assert docs.q_seqlens == [3, 5] and lower(docs, 1, 2, 8, 8, "meta").host.q_seqstart is None
    padded = ba.PaddedKeysMask([3, 4]).to("meta")
    assert padded.kv_seqlens.device.type == "meta" and padded.atoms[0].lengths() == (3, 4)


@pytest.mark.parametrize("op", ["reference", "chunked"])
def test_masks_built_every_call_from_device_lengths_are_prepared_once(monkeypatch, op):
    """A decode or training loop that builds its mask every call from lengths only the device holds is
    checked and dispatched once (dispatch.prepare); each later call runs on its own mask's lengths
    (a CPU tensor plays the GPU's part: its host copy is withheld and it gives a layout token)."""
    from biasattn import dispatch
    from biasattn.bias.block_diagonal import SegmentsAtom
    from biasattn.bias.padded import PaddedKeysAtom

    def token(self):
        t = self.kv_seqlens
        return (PaddedKeysAtom, self.family, t.shape, t.dtype, t.device, t.stride())

    monkeypatch.setattr(PaddedKeysAtom, "known_lengths", lambda self: None)
    monkeypatch.setattr(PaddedKeysAtom, "spec_token", token)
    monkeypatch.setattr(SegmentsAtom, "starts_known", lambda self: False)
    made = []
    real = dispatch.make_inputs
    monkeypatch.setattr(dispatch, "make_inputs", lambda *a, **kw: made.append(a) or real(*a, **kw))
    dispatch._CALLS.clear()
    q, k, v = _qkv(3, 7, 0)
    cases = [[7, 2, 5], [1, 6, 3], [4, 4, 0], [0, 7, 7]]
    outs = [ba.attention(q, k, v, ba.PaddedKeysMask(torch.tensor(n)) & CAUSAL_BR, op=op) for n in cases]
    assert len(made) == 1
    inp, _, _ = dispatch.prepare(q, k, v, ba.PaddedKeysMask(torch.tensor([1, 2, 3])) & CAUSAL_BR, op=op)
    assert inp.spec.kv_seqlens.tolist() == [1, 2, 3] and inp.spec.derived is not dispatch._CALLS[next(iter(
        dispatch._CALLS))][0].derived, "a prepared call's spec holds its own lengths and store"
    lengths = torch.tensor([2, 3, 4], dtype=torch.int32)  # kept by the mask as it is
    reused = ba.PaddedKeysMask(lengths) & CAUSAL_BR
    first = dispatch.prepare(q, k, v, reused, op=op)[0].spec
    assert dispatch.prepare(q, k, v, reused, op=op)[0].spec is first, "a bias used again keeps its spec (and store)"
    lengths[0] = 6
    assert dispatch.prepare(q, k, v, reused, op=op)[0].spec is not first, "an in-place write makes a new one"
    monkeypatch.undo()
    for out, n in zip(outs, cases):
        _check(out, q, k, v, ba.PaddedKeysMask(n) & CAUSAL_BR)
