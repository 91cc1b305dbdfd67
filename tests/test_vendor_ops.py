"""CPU tests of the vendor operators: declarations, reasons, and the spec-to-kernel-argument mapping."""

from __future__ import annotations

import pytest
import torch

import biasattn as ba
from biasattn.bias.spec import lower
from biasattn.inputs import make_inputs
from biasattn.ops.vendor import base as vbase
from biasattn.ops.vendor import layout as vlayout
from biasattn.ops.vendor import lse as vlse
from biasattn.ops.vendor import masks as vmasks

VENDOR = ("cutlass", "flash2", "cudnn")


def _layout(bias, B, H, Mq, Mk):
    spec = lower(bias, B, H, Mq, Mk)
    return spec, vlayout.sequence_layout(spec)


# ------------------------------------------------------------------------------------- declarations
@pytest.mark.parametrize("name", VENDOR)
def test_registered_with_declarations(name):
    """Each vendor operator is registered, runs on CUDA only and declares what it supports."""
    op = ba.ops.get(name)
    d = op.declarations()
    assert name in ba.ops.available() and d["devices"] == ["cuda"]
    assert d["backward"] and d["dropout"] and op.DESCRIPTION and type(op).__doc__
    assert "band" in d["features"]


@pytest.mark.parametrize("name", VENDOR)
def test_cpu_tensors_refused_naming_the_device(name):
    """On CPU tensors each vendor operator gives a reason naming the device; forcing it raises."""
    q = k = v = torch.randn(1, 2, 5, 16, dtype=torch.float16)
    reasons = ba.ops.get(name).not_supported_reasons(make_inputs(q, k, v))
    assert any("cpu" in r and "cuda" in r for r in reasons), reasons
    with pytest.raises(ba.NotSupportedError, match=name):
        ba.attention(q, k, v, op=name)


def test_declared_limits_give_reasons():
    """Features a kernel cannot express are refused with one sentence each."""
    q = k = v = torch.randn(2, 4, 9, 16, dtype=torch.float16)
    layout = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    inp = make_inputs(q, k, v, ba.BlockSparseMask(layout, 16))
    for name in VENDOR:
        assert any("layout" in r for r in ba.ops.get(name).not_supported_reasons(inp))
    window = make_inputs(q, k, v, ba.LocalAttentionMask(3))
    assert any("band" in r for r in ba.ops.get("cutlass").not_supported_reasons(window))
    assert any("band" in r for r in ba.ops.get("cudnn").not_supported_reasons(window))
    assert not any("band" in r for r in ba.ops.get("flash2").not_supported_reasons(window))
    lse = ba.ops.get("flash2").not_supported_reasons(make_inputs(q, k, v), need_lse=True, backward=True)
    assert any("log-sum-exp" in r for r in lse)


def test_measured_kernel_limits_are_refused():
    """Limits found on the H200: CUTLASS bottom-right causal with Lq > Lk, FlashAttention-2 ALiBi, cuDNN ragged."""
    q = torch.randn(1, 2, 9, 16, dtype=torch.float16)
    k = v = torch.randn(1, 2, 5, 16, dtype=torch.float16)
    why = ba.ops.get("cutlass").not_supported_reasons(make_inputs(q, k, v, ba.LowerTriangularFromBottomRightMask()))
    assert any("more queries than keys" in r for r in why)
    why = ba.ops.get("flash2").not_supported_reasons(make_inputs(q, k, v, ba.ALiBi(ba.ALiBi.standard_slopes(2))))
    assert any("alibi" in r for r in why)
    packed = ba.BlockDiagonalMask.from_seqlens([4, 5], [2, 3])
    assert any("segments" in r for r in ba.ops.get("cudnn").not_supported_reasons(make_inputs(q, k, v, packed)))
    drop = make_inputs(q, k, v, packed, dropout_p=0.1)
    assert any("dropout" in r for r in ba.ops.get("cutlass").not_supported_reasons(drop))


def test_cudnn_refuses_bias_backward_at_the_nan_lengths():
    """cuDNN's NaN grad_q with a bias at seq_len % 128 == 64 (PyTorch issue 196678) is refused."""
    q = k = v = torch.randn(1, 2, 192, 16, dtype=torch.float16)
    inp = make_inputs(q, k, v, torch.randn(192, 192, dtype=torch.float16))
    op = ba.ops.get("cudnn")
    assert any("196678" in r for r in op.not_supported_reasons(inp, backward=True))
    assert not any("196678" in r for r in op.not_supported_reasons(inp, backward=False))


def test_cudnn_refuses_bias_backward_of_one_query():
    """cuDNN's grad_q with a bias at Mq = 1 was NaN in 16 of 206 random cases on the H200: refused, forward kept."""
    q = torch.randn(1, 8, 1, 64, dtype=torch.bfloat16)
    k = v = torch.randn(1, 4, 2, 64, dtype=torch.bfloat16)
    op = ba.ops.get("cudnn")
    inp = make_inputs(q, k, v, ba.AdditiveBias(torch.randn(1, 1, 1, 1, dtype=torch.bfloat16)))
    assert any("Mq = 1" in r for r in op.not_supported_reasons(inp, backward=True))
    assert not any("Mq = 1" in r for r in op.not_supported_reasons(inp, backward=False))
    assert not any("Mq = 1" in r for r in op.not_supported_reasons(make_inputs(q, k, v), backward=True))


def test_cudnn_refuses_the_backward_of_one_query_and_one_key():
    """cuDNN rejects the backward graph of Mq = Mk = 1, and a second such call crashed the process: refused up front."""
    q = k = v = torch.randn(2, 4, 1, 128, dtype=torch.bfloat16)
    op = ba.ops.get("cudnn")
    for bias in (None, ba.LocalAttentionMask(31, 0), ba.LowerTriangularFromBottomRightMask()):
        inp = make_inputs(q, k, v, bias)
        assert any("Mq = Mk = 1" in r for r in op.not_supported_reasons(inp, backward=True))
        assert not any("Mq = Mk = 1" in r for r in op.not_supported_reasons(inp, backward=False))
    longer = make_inputs(q, torch.randn(2, 4, 7, 128, dtype=torch.bfloat16), torch.randn(2, 4, 7, 128, dtype=torch.bfloat16))
    assert not any("Mq = Mk = 1" in r for r in op.not_supported_reasons(longer, backward=True))


@pytest.mark.parametrize("name", VENDOR)
def test_an_additive_bias_that_would_be_rounded_is_refused(name):
    """A float32 additive bias with bfloat16 q would be rounded to bfloat16 by the kernels (gradients then missed the
    criterion): refused; the same bias in q's dtype, and a bool mask (0 / -inf, exact), are not."""
    q = k = v = torch.randn(1, 2, 9, 16, dtype=torch.bfloat16)
    op = ba.ops.get(name)

    def rounds(bias):
        return any("would round" in r for r in op.not_supported_reasons(make_inputs(q, k, v, bias)))

    assert rounds(torch.randn(9, 9))
    assert rounds(ba.LowerTriangularMask() + ba.AdditiveBias(torch.randn(9, 9)))
    assert not rounds(torch.randn(9, 9, dtype=torch.bfloat16))
    assert not rounds(torch.rand(9, 9) < 0.5)
    assert not rounds(ba.AdditiveBias(torch.rand(9, 9) < 0.5) + ba.AdditiveBias(torch.rand(1, 9) < 0.5))
    q32 = k32 = v32 = q.float()
    if name == "cutlass":  # float32 inputs: a bfloat16 bias widens exactly
        why = op.not_supported_reasons(make_inputs(q32, k32, v32, torch.randn(9, 9, dtype=torch.bfloat16)))
        assert not any("would round" in r for r in why)


def test_plans_know_sequences_without_keys():
    """Packed or padded sequences with queries but no keys: the kernels leave their rows undefined (CUTLASS wrote NaN),
    and a call where no sequence has keys made FlashAttention-2 fail with 'invalid argument'."""
    spec, layout = _layout(ba.BlockDiagonalMask.from_seqlens([1, 0, 1], [0, 0, 1]), 1, 2, 2, 1)
    assert layout.has_work and layout.keyless == ((0, 0, 1),)
    spec, layout = _layout(ba.PaddedKeysMask([0, 0, 0]), 3, 2, 5, 1)
    assert not layout.has_work and layout.keyless == ((0, 0, 5), (1, 0, 5), (2, 0, 5))
    spec, layout = _layout(ba.PaddedKeysMask([3, 0]), 2, 2, 5, 4)
    assert layout.has_work and layout.keyless == ((1, 0, 5),)
    q = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    k = v = torch.randn(1, 2, 1, 16, dtype=torch.bfloat16)
    packed = ba.BlockDiagonalMask.from_seqlens([1, 0, 1], [0, 0, 1])
    why = ba.ops.get("cutlass").not_supported_reasons(make_inputs(q, k, v, packed))
    assert any("no keys" in r for r in why)


def test_flash2_keeps_one_query_sequences_off_its_swapped_path():
    """With at most one query per sequence, FlashAttention-2 reshapes packed GQA queries as [sequences, Hkv, groups, D],
    which fails when a sequence is empty; a right window of 0 (equal for one query) keeps it off that path."""
    q = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
    k = v = torch.randn(1, 2, 700, 16, dtype=torch.bfloat16)
    flash2 = ba.ops.get("flash2")
    for bias in (ba.BlockDiagonalMask.from_seqlens([1, 0, 1], [300, 200, 200]).make_causal_from_bottom_right(),
                 ba.BlockDiagonalMask.from_seqlens([1, 0, 1], [300, 200, 200])):
        inp = make_inputs(q, k, v, bias)
        assert flash2._window(inp, flash2.layout(inp))[1] == 0
    inp = make_inputs(q, k, v, ba.BlockDiagonalMask.from_seqlens([2, 0], [300, 400]))
    assert flash2._window(inp, flash2.layout(inp)) == vmasks.flash_window(flash2.layout(inp))


def test_missing_entry_point_is_a_reason(monkeypatch):
    """A torch without the kernel's entry point gives a reason naming it."""
    monkeypatch.setattr(vbase, "aten_entry", lambda name: None)
    reasons = ba.ops.get("cutlass").probe_environment()
    assert reasons and "_efficient_attention_forward" in reasons[0]


# ------------------------------------------------------------------------------------- mapping
def test_plan_batched_and_bands():
    _, p = _layout(None, 2, 4, 7, 9)
    assert p.kind == "batched" and p.seqs[0].lo is None and p.seqs[0].hi is None
    assert vmasks.cutlass_mask_type(p) == vmasks.NO_MASK and vmasks.flash_window(p) == (-1, -1)
    assert vmasks.cudnn_causal(p) is False
    _, p = _layout(ba.LowerTriangularMask(), 2, 4, 7, 9)
    assert vmasks.cutlass_mask_type(p) == vmasks.CAUSAL_TOP_LEFT and vmasks.flash_window(p) is None  # right = -2
    assert vmasks.cudnn_causal(p) is True
    _, p = _layout(ba.LowerTriangularFromBottomRightMask(), 2, 4, 7, 9)
    assert vmasks.cutlass_mask_type(p) == vmasks.CAUSAL_BOTTOM_RIGHT and vmasks.flash_window(p) == (-1, 0)
    assert vmasks.cudnn_causal(p) is None
    _, p = _layout(ba.LocalAttentionMask(3, 1), 2, 4, 7, 9)
    assert vmasks.cutlass_mask_type(p) is None and vmasks.flash_window(p) == (3, 1) and vmasks.cudnn_causal(p) is None


def test_flash_window_top_left_is_a_right_window():
    """Top-left causal is FlashAttention's right window Mq - Mk, which must not be negative."""
    _, p = _layout(ba.LowerTriangularMask(), 1, 1, 7, 9)
    assert vmasks.flash_window(p) is None  # would need right = -2
    _, p = _layout(ba.LowerTriangularMask(), 1, 1, 9, 7)
    assert vmasks.flash_window(p) == (-1, 2)
    _, p = _layout(ba.LowerTriangularMask(), 1, 1, 8, 8)
    assert vmasks.flash_window(p) == (-1, 0)


def test_flash_window_refuses_a_left_window_over_more_queries_than_keys_plus_one():
    """With a left window, FlashAttention reads an unbounded right window as ``max_k`` keys: exact up to
    ``Mq = Mk + 1``, and hiding keys from the first rows beyond (wrong outputs before this refusal)."""
    _, p = _layout(ba.LocalAttentionMask(0, 5), 1, 1, 3, 2)
    assert vmasks.flash_window(p) == (0, -1)
    _, p = _layout(ba.LocalAttentionMask(0, 5), 1, 1, 5, 2)
    assert vmasks.flash_window(p) is None
    _, p = _layout(ba.LowerTriangularFromBottomRightMask(), 1, 1, 5, 2)
    assert vmasks.flash_window(p) == (-1, 0)  # no left window: an unbounded left stays exact


def test_plan_segments():
    bias = ba.BlockDiagonalMask.from_seqlens([3, 5, 7], [4, 1, 6]).make_causal_from_bottom_right()
    spec, p = _layout(bias, 1, 2, 15, 11)
    assert p.kind == "segments" and p.cu_q == (0, 3, 8, 15) and p.cu_k == (0, 4, 5, 11) and p.gather is None
    assert [(s.Lq, s.Lk) for s in p.seqs] == [(3, 4), (5, 1), (7, 6)]
    assert vmasks.cutlass_mask_type(p) == vmasks.CAUSAL_BOTTOM_RIGHT and vmasks.flash_window(p) == (-1, 0)
    assert vmasks.cudnn_causal(p) is None
    assert vlayout.rows_may_be_empty(spec, p)  # segment 1: 5 queries, 1 key, bottom-right
    spec, p = _layout(ba.BlockDiagonalMask.from_seqlens([3, 5, 7]).make_causal(), 1, 2, 15, 15)
    assert vmasks.cutlass_mask_type(p) == vmasks.CAUSAL_TOP_LEFT and vmasks.cudnn_causal(p) is True
    assert vmasks.flash_window(p) == (-1, 0) and not vlayout.rows_may_be_empty(spec, p)


def test_plan_segments_with_padded_keys_gathers():
    bias = ba.BlockDiagonalMask.from_seqlens([3, 5], [4, 6]) & ba.PaddedKeysMask([2])
    spec, p = _layout(bias, 1, 2, 8, 10)
    assert p.gather == ((0, 0, 2), (0, 4, 0)) and p.cu_k == (0, 2, 2)
    assert vlayout.rows_may_be_empty(spec, p)  # segment 1 keeps no key
    bias = ba.BlockDiagonalMask.from_seqlens([3, 5], [4, 6]) & ba.PaddedKeysMask([7])
    _, p = _layout(bias, 1, 2, 8, 10)
    assert p.gather is None and p.cu_k == (0, 4, 7)  # only the last segment shrinks: keys stay in place


def test_plan_padded_keys():
    spec, p = _layout(ba.PaddedKeysMask([5, 9, 0]), 3, 2, 6, 9)
    assert p.kind == "padded" and p.cu_q == (0, 6, 12, 18) and p.cu_k == (0, 5, 14, 14)
    assert p.gather == ((0, 0, 5), (1, 0, 9), (2, 0, 0))
    assert vlayout.rows_may_be_empty(spec, p)  # a batch row with no key
    _, p = _layout(ba.PaddedKeysMask([5, 9]) & ba.LowerTriangularMask(), 2, 2, 9, 9)
    assert vmasks.cutlass_mask_type(p) == vmasks.CAUSAL_TOP_LEFT
    assert vmasks.flash_window(p) is None  # top-left with per-row key lengths is not a bottom-right window


def test_layout_refuses_rows_outside_segments():
    bias = ba.BlockDiagonalMask.from_seqlens([3, 5])[:, :, 2:6, :]
    spec = lower(bias, 1, 2, 4, 8)
    p = vlayout.sequence_layout(spec)
    assert p.reason is None or "segments cover" in p.reason


def test_effective_band_and_empty_rows():
    assert vlayout.effective_band(-100, 100, 5, 7) == (None, None)
    assert vlayout.effective_band(-4, 6, 5, 7) == (None, None)
    assert vlayout.effective_band(-3, 5, 5, 7) == (-3, 5)
    spec, p = _layout(ba.LowerTriangularFromBottomRightMask(), 1, 1, 9, 4)
    assert vlayout.rows_may_be_empty(spec, p)
    spec, p = _layout(ba.LowerTriangularMask(), 1, 1, 9, 4)
    assert not vlayout.rows_may_be_empty(spec, p)
    spec, p = _layout(ba.LocalAttentionMask(2), 1, 1, 9, 9)
    assert not vlayout.rows_may_be_empty(spec, p)


def test_alibi_alignment():
    slopes = ba.ALiBi.standard_slopes(2)
    _, p = _layout(ba.ALiBi(slopes), 1, 2, 5, 9)
    assert vmasks.alibi_matches(p)
    _, p = _layout(ba.ALiBi(slopes) + ba.PaddedKeysMask([4]), 1, 2, 5, 9)
    assert not vmasks.alibi_matches(p)  # FlashAttention would align ALiBi to 4 keys, ours to 9


# ------------------------------------------------------------------------------------- tensors
def test_aligned_bias_keeps_aligned_tensors():
    t = torch.randn(1, 3, 5, 16, dtype=torch.float16)
    out = vmasks.aligned_bias(t, (2, 3, 5, 16), torch.float16)
    assert out.data_ptr() == t.data_ptr() and out.stride(0) == 0 and tuple(out.shape) == (2, 3, 5, 16)


@pytest.mark.parametrize("shape", [(1, 3, 5, 13), (2, 1, 1, 13), (1, 1, 5, 1)])
def test_aligned_bias_pads_a_copy(shape):
    """Last dim 13 (not a multiple of 8) or broadcast: a copy padded to 16, broadcast dims stay stride 0."""
    t = torch.randn(shape, dtype=torch.float32)
    out = vmasks.aligned_bias(t, (2, 3, 5, 13), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (2, 3, 5, 13) and out.stride(-1) == 1
    assert vmasks.bias_is_aligned(out, 13, torch.bfloat16)
    for d in range(3):
        assert shape[d] > 1 or out.stride(d) == 0
    assert torch.equal(out.float(), t.to(torch.bfloat16).float().expand(2, 3, 5, 13))


def test_bias_alignment_rule():
    t = torch.randn(2, 3, 5, 16)
    assert vmasks.bias_is_aligned(t, 16, torch.float32)
    assert not vmasks.bias_is_aligned(t[..., 1:], 15, torch.float32)
    assert not vmasks.bias_is_aligned(t, 16, torch.float16)


@pytest.mark.parametrize("fmt", ["bhm", "bhm1", "h_total", "total_h1"])
def test_lse_formats_round_trip(fmt):
    spec, p = _layout(ba.PaddedKeysMask([3, 0]), 2, 3, 5, 4)
    lse = torch.randn(2, 3, 5)
    lse[1] = float("-inf")
    raw = vlse.lse_to_kernel(lse, p, fmt, pad=8)
    assert bool(torch.isposinf(raw).any())
    assert torch.equal(vlse.lse_from_kernel(raw, p, 2, 3, 5, fmt), lse)
    detected = vlse.lse_format(raw, p, 2, 3, 5)  # [B, H, M] and per-sequence coincide for padded keys
    assert torch.equal(vlse.lse_from_kernel(raw, p, 2, 3, 5, detected), lse)


def test_lse_per_sequence_format_round_trip():
    spec, p = _layout(ba.BlockDiagonalMask.from_seqlens([3, 5, 2]), 1, 2, 10, 10)
    lse = torch.randn(1, 2, 10)
    raw = vlse.lse_to_kernel(lse, p, "seq_h_m", pad=32)
    assert tuple(raw.shape) == (3, 2, 32) and torch.equal(raw[1, :, :5], lse[0, :, 3:8])
    assert vlse.lse_format(raw, p, 1, 2, 10) == "seq_h_m"
    assert torch.equal(vlse.lse_from_kernel(raw, p, 1, 2, 10, "seq_h_m"), lse)


def test_lse_from_kernel_turns_empty_rows_to_minus_inf():
    _, p = _layout(None, 1, 1, 3, 3)
    raw = torch.tensor([[[1.0, float("inf"), float("nan")]]])
    assert vlse.lse_from_kernel(raw, p, 1, 1, 3, "bhm").tolist() == [[[1.0, float("-inf"), float("-inf")]]]


def test_lse_from_kernel_keeps_values_when_every_row_sees_a_key():
    """Without hidden rows the kernel's values pass as they are: no fix-up launch, and NaN is not disguised as -inf."""
    _, p = _layout(None, 1, 1, 3, 3)
    raw = torch.tensor([[[1.0, 2.0, float("nan")]]])
    out = vlse.lse_from_kernel(raw, p, 1, 1, 3, "bhm", rows_may_be_hidden=False)
    assert out.dtype == torch.float32 and out.is_contiguous() and torch.equal(out[..., :2], raw[..., :2])
    assert out[0, 0, 2].isnan()


@pytest.mark.parametrize("name", VENDOR)
def test_rows_may_be_hidden(name):
    """Hidden rows are possible with an empty cache, a band that leaves rows without keys, or any additive bias."""
    op = ba.ops.get(name)
    q = torch.randn(2, 2, 4, 8)
    cases = [
        (None, False), (ba.LowerTriangularMask(), False), (ba.PaddedKeysMask([4, 1]), False),
        (ba.PaddedKeysMask([4, 0]), True), (ba.LowerTriangularFromBottomRightMask(), False),
        (ba.AdditiveBias(torch.zeros(1, 1, 4, 4)), True),
    ]
    for bias, hidden in cases:
        inp = make_inputs(q, q, q, bias)
        assert op.rows_may_be_hidden(inp, op.layout(inp)) == hidden, bias
    inp = make_inputs(q, torch.randn(2, 2, 2, 8), torch.randn(2, 2, 2, 8), ba.LowerTriangularFromBottomRightMask())
    assert op.rows_may_be_hidden(inp, op.layout(inp))  # 4 queries, 2 keys, bottom-right: the first rows see none


def test_pack_and_unpack_keys():
    spec, p = _layout(ba.PaddedKeysMask([2, 4]), 2, 3, 5, 4)
    k = torch.randn(2, 3, 4, 8)
    packed = vlayout.pack_keys(k, spec, p)
    assert tuple(packed.shape) == (6, 3, 8)
    assert torch.equal(packed[:2], k[0, :, :2].transpose(0, 1)) and torch.equal(packed[2:], k[1].transpose(0, 1))
    back = vlayout.unpack_keys(packed, spec, p, 2, 4)
    assert torch.equal(back[0, :, :2], k[0, :, :2]) and bool((back[0, :, 2:] == 0).all()) and torch.equal(back[1], k[1])
    q = torch.randn(2, 3, 5, 8)
    assert torch.equal(vlayout.unpack_queries(vlayout.pack_queries(q, p), p, 2), q)


def test_unpack_zeroes_keys_after_the_last_segment():
    spec, p = _layout(ba.BlockDiagonalMask.from_seqlens([3, 2], [2, 4]) & ba.PaddedKeysMask([4]), 1, 1, 5, 6)
    assert p.gather is None and p.cu_k == (0, 2, 4)
    g = torch.ones(6, 1, 4)
    out = vlayout.unpack_keys(g, spec, p, 1, 6)
    assert bool((out[0, :, 4:] == 0).all()) and bool((out[0, :, :4] == 1).all())
