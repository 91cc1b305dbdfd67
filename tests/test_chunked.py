"""The chunked operator: gradients against the float64 reference, low precision, fully masked rows,
dropout, and the tiling it uses to skip hidden key blocks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import biasattn as ba
from biasattn.bias import lower
from biasattn.inputs import make_inputs
from biasattn.ops.chunked import ChunkedOperator
from biasattn.testing import assert_close_to_reference, poison_padding_, reference_attention
from biasattn.testing import strategies as bst

CHUNKED_SMALL = ChunkedOperator(block_q=8, block_k=8)
OPS = [pytest.param(CHUNKED_SMALL, id="chunked"), pytest.param("reference", id="reference")]


def _additive_leaves(bias):
    if bias is None:
        return []
    return [a.tensor for a in bias.atoms if a.kind == "additive" and a.tensor.requires_grad]


def _grads(out, lse, wrt, dout, dlse):
    loss = (out * dout.to(out.dtype)).sum()
    if dlse is not None:
        loss = loss + torch.where(torch.isfinite(lse), lse * dlse.to(lse.dtype), 0.0).sum()
    got = torch.autograd.grad(loss, wrt, allow_unused=True)
    return [torch.zeros_like(w) if g is None else g for g, w in zip(got, wrt)]


@pytest.mark.parametrize("op", OPS)
@settings(max_examples=3 * settings().max_examples)
@given(
    case=bst.attention_inputs(
        min_terms=0, max_terms=3, max_seqlen=40, requires_grad=True, bias_requires_grad=True, allow_empty=True
    ),
    with_dlse=st.booleans(),
)
def test_gradients_float64_match_reference(op, case, with_dlse):
    """dq, dk, dv and the additive bias' gradient (broadcast dims reduced), through out and lse."""
    wrt = [case.q, case.k, case.v] + _additive_leaves(case.bias)
    ref, ref_lse = reference_attention(case.q, case.k, case.v, case.bias, scale=case.scale)
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    dlse = torch.randn(ref_lse.shape, generator=gen, dtype=torch.float64) if with_dlse else None
    expected = _grads(ref, ref_lse, wrt, dout, dlse)
    out, lse = ba.attention_with_lse(case.q, case.k, case.v, case.bias, scale=case.scale, op=op)
    got = _grads(out, lse, wrt, dout, dlse)
    for name, g, e in zip(["dq", "dk", "dv"] + ["dbias"] * 3, got, expected):
        assert g.shape == e.shape, name
        assert_close_to_reference(g, e, name=name, atol=1e-8)


@given(case=bst.attention_inputs(dtypes=(torch.float16, torch.bfloat16, torch.float32), max_seqlen=60, requires_grad=True))
def test_low_precision_within_twice_the_dtype_error(case):
    """out/lse within 2×, dk/dv within 2× and dq within 3× the error of the same math in the dtype."""
    args = (case.q, case.k, case.v, case.bias)
    ref, ref_lse = reference_attention(*args, scale=case.scale)
    low, low_lse = reference_attention(*args, scale=case.scale, compute_dtype=case.q.dtype)
    gen = torch.Generator().manual_seed(2)
    dout = torch.randn(ref.shape, generator=gen).to(case.q.dtype)
    wrt = [case.q, case.k, case.v]
    expected = torch.autograd.grad((ref * dout.double()).sum(), wrt)
    low_grads = torch.autograd.grad((low * dout).sum(), wrt)
    out, lse = ba.attention_with_lse(*args, scale=case.scale, op=CHUNKED_SMALL)
    assert out.dtype == case.q.dtype
    assert_close_to_reference(out, ref, low, name="out")
    assert_close_to_reference(lse, ref_lse, low_lse, name="lse")
    got = torch.autograd.grad((out * dout).sum(), wrt)
    for name, g, e, lo in zip(("dq", "dk", "dv"), got, expected, low_grads):
        assert g.dtype == case.q.dtype
        assert_close_to_reference(g, e, lo, factor=3.0 if name == "dq" else 2.0, name=name)


FULLY_MASKED = [
    ("padded_zero", lambda: ba.PaddedKeysMask([0, 4])),
    ("bottom_right_more_queries", lambda: ba.LowerTriangularFromBottomRightMask()),
    ("empty_key_segment", lambda: ba.BlockDiagonalMask.from_seqlens([3, 6], [0, 9])),
    ("empty_layout_row", lambda: ba.BlockSparseMask(torch.tensor([[True, False], [False, False], [True, True]]), (3, 5))),
    ("bool_tensor_row", lambda: torch.tensor([[True] * 9] * 8 + [[False] * 9])),
    ("additive_neg_inf", lambda: ba.AdditiveBias(torch.where(torch.arange(9) < 5, 0.0, float("-inf"))[:, None])),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,make", FULLY_MASKED, ids=[f[0] for f in FULLY_MASKED])
def test_fully_masked_rows_give_zero_out_neg_inf_lse_zero_grads(name, make, dtype, op):
    bias = make()
    gen = torch.Generator().manual_seed(0)
    B = 2 if name == "padded_zero" else 1
    q = torch.randn(B, 2, 9, 4, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(B, 2, 9, 4, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(B, 2, 9, 4, generator=gen).to(dtype).requires_grad_()
    if name == "bottom_right_more_queries":
        k = k[:, :, :4].detach().requires_grad_()
        v = v[:, :, :4].detach().requires_grad_()
    out, lse = ba.attention_with_lse(q, k, v, bias, op=op)
    dense = (bias if isinstance(bias, ba.AttentionBias) else ba.AdditiveBias(bias)).materialize(
        (B, 2, 9, k.shape[2]), dtype=torch.float64
    )
    hidden = torch.isneginf(dense).all(-1)  # [B, 2, 9] rows with no visible key
    assert bool(hidden.any()), "the case must have a fully masked row"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert bool((out[hidden] == 0).all())
    assert bool(torch.isneginf(lse[hidden]).all())
    assert bool(torch.isfinite(lse[~hidden]).all())
    (out.float().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    for t in (q, k, v):
        assert not torch.isnan(t.grad).any()
    assert bool((q.grad[hidden] == 0).all())


def test_all_keys_hidden_gives_zero_gradients():
    q = torch.randn(1, 1, 5, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 6, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 6, 4, dtype=torch.float64, requires_grad=True)
    for op in (CHUNKED_SMALL, "reference"):
        out, lse = ba.attention_with_lse(q, k, v, ba.PaddedKeysMask([0]), op=op)
        assert (out == 0).all() and torch.isneginf(lse).all()
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all((g == 0).all() for g in grads)


@pytest.mark.parametrize("op", ["chunked", "reference"])
def test_dropout_backward_matches_its_forward(op):
    """gradcheck with the seed fixed: the backward replays the forward's dropout mask."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    add = torch.randn(1, 2, 9, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    operator = CHUNKED_SMALL if op == "chunked" else op

    def f(q, k, v, add):
        torch.manual_seed(123)
        return ba.attention(q, k, v, ba.AdditiveBias(add) + ba.LowerTriangularMask(), dropout_p=0.3, op=operator)

    assert torch.autograd.gradcheck(f, (q, k, v, add), eps=1e-6, atol=1e-5)


def test_dropout_is_unbiased_and_drops():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 16, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    base = ba.attention(q, k, v, op=CHUNKED_SMALL)
    torch.manual_seed(0)
    outs = torch.stack([ba.attention(q, k, v, dropout_p=0.5, op=CHUNKED_SMALL) for _ in range(300)])
    assert not torch.allclose(outs[0], outs[1])
    assert (outs.mean(0) - base).abs().max() < 0.25


# ------------------------------------------------------------------------------------ tiling
@st.composite
def _spec_case(draw):
    names = draw(bst.family_lists(tuple(f for f in bst.FAMILIES if f != "additive"), min_terms=1, max_terms=3))
    shape = draw(bst.shapes(batch=1 if "block_diagonal" in names else None, max_seqlen=60, allow_empty=True))
    bias = draw(bst._compose_families(names, shape))
    return shape, bias, draw(st.sampled_from([(8, 8), (3, 5), (16, 4)]))


@given(case=_spec_case())
def test_tiles_cover_every_visible_element_and_full_tiles_have_no_mask(case):
    """The tiles chunked visits cover every visible (i, j); tiles it treats as unmasked hide nothing."""
    shape, bias, (bq, bk) = case
    q = torch.zeros(shape.B, shape.Hq, shape.Mq, shape.D)
    k = torch.zeros(shape.B, shape.Hkv, shape.Mk, shape.D)
    inp = make_inputs(q, k, torch.zeros(shape.B, shape.Hkv, shape.Mk, shape.Dv), bias)
    dense = bias.materialize(shape.bias_shape, dtype=torch.float64)
    covered = torch.zeros(shape.Mq, shape.Mk, dtype=torch.bool)
    for i0, i1, keys in ChunkedOperator(bq, bk)._tiles(inp):
        for kt in keys:
            for j0, j1 in kt.ranges:
                assert not covered[i0:i1, j0:j1].any(), "a key block is visited twice"
                covered[i0:i1, j0:j1] = True
                if kt.full:
                    assert not torch.isneginf(dense[..., i0:i1, j0:j1]).any(), (i0, i1, j0, j1)
    visible = (~torch.isneginf(dense)).any(0).any(0)
    assert not (visible & ~covered).any()


def _visited(inp, op=None):
    """Number of (query, key) pairs the chunked operator computes."""
    op = op or ChunkedOperator(8, 8)
    return sum((i1 - i0) * kt.width for i0, i1, keys in op._tiles(inp) for kt in keys)


def test_hidden_key_blocks_are_skipped():
    q = torch.zeros(1, 1, 64, 4)
    assert _visited(make_inputs(q, q, q, ba.LowerTriangularMask())) == 64 * 8 * 9 // 2  # the lower 8 × 8 blocks
    assert _visited(make_inputs(q, q, q, ba.BlockDiagonalMask.from_seqlens([16] * 4))) == 4 * 16 * 16
    layout = torch.eye(8, dtype=torch.bool)
    assert _visited(make_inputs(q, q, q, ba.BlockSparseMask(layout, 8))) == 8 * 8 * 8
    layout = torch.rand(1, 2, 8, 8, generator=torch.Generator().manual_seed(0)) < 0.3
    q2 = torch.zeros(1, 2, 64, 4)
    op = ChunkedOperator(8, 8)
    parts = op._layout_parts(make_inputs(q2, q2, q2, ba.BlockSparseMask(layout, 8)))  # one per head
    assert len(parts) == 2 and sum(_visited(sub, op) for *_, sub in parts) == 8 * 8 * int(layout.sum())


def test_unmasked_blocks_are_gathered_into_wide_tiles():
    q = torch.zeros(1, 1, 64, 4)
    layout = torch.tensor([[True, False, True, True, False, False, True, False]] * 8)
    inp = make_inputs(q, q, q, ba.BlockSparseMask(layout, 8))
    for _, _, keys in ChunkedOperator(8, 8)._tiles(inp):
        assert keys == [ba.ops.chunked.KeyTile(((0, 8), (16, 32), (48, 56)), True)]


def test_spec_lowering_no_device_sync_metadata():
    """Host copies exist for every metadata field the tiling reads."""
    bias = ba.BlockDiagonalMask.from_seqlens([3, 4]).make_causal() & ba.PaddedKeysMask([6])
    spec = lower(bias, 1, 1, 7, 7)
    assert spec.host.q_seqstart == (0, 3, 7) and spec.host.k_seqlen == (3, 3)
    assert spec.host.band_lo is not None


def test_default_blocks_with_many_heads_use_short_row_tiles():
    """Score tiles are capped at TILE_ELEMENTS: many batch rows × heads give short row blocks."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 16, 70, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(4, 8, 600, 8, generator=gen, dtype=torch.float64)
    bias = ba.LocalAttentionMask(300) & ba.PaddedKeysMask([600, 1, 0, 599])
    op = ChunkedOperator()
    rows = [i1 - i0 for i0, i1, _ in op._tiles(make_inputs(q, k, k, bias))]
    assert max(rows) < op.block_q
    ref, ref_lse = reference_attention(q, k, k, bias)
    out, lse = ba.attention_with_lse(q, k, k, bias, op=op)
    assert_close_to_reference(out, ref)
    assert_close_to_reference(lse, ref_lse)


POISONED = [
    ("padded_kv_cache", 2, 9, 7, lambda: ba.PaddedKeysMask([3, 7]) & ba.LowerTriangularFromBottomRightMask()),
    (
        "packed_with_padding", 1, 8, 9,
        lambda: ba.BlockDiagonalMask.from_seqlens([2, 0, 3, 3], [4, 2, 3, 0]) & ba.PaddedKeysMask([6]),
    ),
    ("bottom_right_more_queries", 1, 9, 4, lambda: ba.LocalAttentionMask(2) + ba.ALiBi(torch.ones(2))),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name,B,Mq,Mk,make", POISONED, ids=[p[0] for p in POISONED])
def test_nan_in_hidden_queries_and_keys_never_reaches_the_result(name, B, Mq, Mk, make, op):
    """Regression: NaN in padding (an uninitialized KV cache, packed padding rows) gave NaN outputs."""
    bias = make()
    dense = bias.materialize((B, 2, Mq, Mk), dtype=torch.float64)
    hidden_rows = torch.isneginf(dense).all(-1).all(1)  # [B, Mq], hidden for every head
    hidden_keys = torch.isneginf(dense).all(-2).all(1)  # [B, Mk]
    assert hidden_rows.any() or hidden_keys.any()
    gen = torch.Generator().manual_seed(0)
    clean = [torch.randn(B, 2, M, 4, generator=gen, dtype=torch.float64) for M in (Mq, Mk, Mk)]
    for t, hidden in zip(clean, (hidden_rows, hidden_keys, hidden_keys)):
        t[hidden[:, None, :, None].expand_as(t)] = 0.0
    dirty = [t.clone() for t in clean]
    for t, hidden in zip(dirty, (hidden_rows, hidden_keys, hidden_keys)):
        t.masked_fill_(hidden[:, None, :, None], float("nan"))
    dirty = [t.requires_grad_() for t in dirty]
    want, want_lse = ba.attention_with_lse(*clean, bias, op=op)
    out, lse = ba.attention_with_lse(*dirty, bias, op=op)
    assert_close_to_reference(out, want, atol=1e-12)
    assert_close_to_reference(lse, want_lse, atol=1e-12)
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    for t in dirty:
        assert not torch.isnan(t.grad).any()
    assert (dirty[0].grad[hidden_rows[:, None, :, None].expand_as(dirty[0])] == 0).all()
    assert (dirty[1].grad[hidden_keys[:, None, :, None].expand_as(dirty[1])] == 0).all()


def test_poison_padding_helper_with_chunked():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=gen) for _ in range(3))
    bias = ba.PaddedKeysMask([2, 5])
    want = ba.attention(q, k, v, bias, op=CHUNKED_SMALL)
    out = ba.attention(q, poison_padding_(k.clone(), [2, 5]), poison_padding_(v.clone(), [2, 5]), bias, op=CHUNKED_SMALL)
    assert_close_to_reference(out, want.double(), atol=1e-6)


@pytest.mark.parametrize("op", OPS)
def test_empty_batch(op):
    """Regression: a batch of size 0 failed in the chunked backward (reshape with -1 of 0 elements)."""
    q = torch.randn(0, 2, 5, 8, requires_grad=True)
    k = torch.randn(0, 2, 6, 8, requires_grad=True)
    out, lse = ba.attention_with_lse(q, k, k, ba.LowerTriangularMask() + ba.ALiBi(torch.ones(2)), op=op)
    assert out.shape == (0, 2, 5, 8) and lse.shape == (0, 2, 5)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_reference_operator_runs_without_keys():
    """Regression: the reference operator refused Mk = 0 (and its softmax failed on an empty key dim)."""
    q = torch.randn(1, 2, 3, 4, requires_grad=True)
    k = torch.randn(1, 2, 0, 4, requires_grad=True)
    out, lse = ba.attention_with_lse(q, k, k, ba.LowerTriangularMask(), op="reference")
    assert (out == 0).all() and torch.isneginf(lse).all()
    out.sum().backward()
    assert (q.grad == 0).all()


def test_low_precision_dq_uses_the_unrounded_output():
    """Regression: the fp16 backward took rowsum(dout * out) from the rounded output, up to 7× the dtype's error in dq."""
    gen = torch.Generator().manual_seed(37)
    q, k, v = (torch.randn(1, 4, m, 16, generator=gen).half().requires_grad_() for m in (1, 39, 39))
    dout = torch.randn(1, 4, 1, 16, generator=gen).half()
    ref, _ = reference_attention(q, k, v, scale=2.0)
    expected = torch.autograd.grad((ref * dout.double()).sum(), q)[0]
    out = ba.attention(q, k, v, scale=2.0, op=CHUNKED_SMALL)
    dq = torch.autograd.grad((out * dout).sum(), q)[0]
    assert (dq.double() - expected).abs().max() <= 2e-3


@settings(max_examples=3 * settings().max_examples)
@given(case=bst.attention_inputs(min_terms=1, max_terms=3, max_seqlen=40), data=st.data())
def test_visible_ranges_hold_every_visible_pair(case, data):
    """``key_range`` over a block of rows holds every key some row of it sees, and ``query_range`` every row
    that sees a key, on the dense mask of any bias (also sliced); both are tight for packed documents."""
    from biasattn.ops.tiles import key_range, query_range

    B, H, Mq, Mk = case.q.shape[0], case.q.shape[1], case.q.shape[2], case.k.shape[2]
    i0 = data.draw(st.integers(0, Mq))
    i1 = data.draw(st.integers(i0, Mq))
    spec = lower(case.bias, B, H, Mq, Mk)
    visible = case.bias.materialize((B, H, Mq, Mk), dtype=torch.float64) > float("-inf")
    visible = visible.expand(B, H, Mq, Mk).any(0).any(0)
    lo, hi = key_range(spec, i0, i1)
    keys = visible[i0:i1].any(0).nonzero().flatten().tolist()
    assert all(lo <= j < hi for j in keys), (lo, hi, keys)
    q_lo, q_hi = query_range(spec)
    rows = visible.any(1).nonzero().flatten().tolist()
    assert all(q_lo <= i < q_hi for i in rows), (q_lo, q_hi, rows)
    if {a.kind for a in case.bias.atoms} == {"segments"} and rows:
        assert (q_lo, q_hi) == (rows[0], rows[-1] + 1)


def test_query_range_of_documents_seen_from_another_chunk():
    """The rows of a causal document that see keys of an earlier chunk: only those of the document crossing it."""
    from biasattn.ops.tiles import query_range

    bias = ba.BlockDiagonalMask.from_seqlens([5, 9, 6]).make_causal()  # documents [0, 5), [5, 14), [14, 20)
    spec = lower(bias[..., 10:20, 0:10], 1, 1, 10, 10)  # rows 10..19 against keys 0..9: document 2's rows 10..13
    assert query_range(spec) == (0, 4)
    assert query_range(lower(bias[..., 14:20, 0:10], 1, 1, 6, 10)) == (0, 0)


def test_a_trace_masks_hidden_values_without_reading_them():
    """Traced outside Dynamo (``make_fx``, as AOTAutograd traces), the chunked operator cannot ask a fake
    tensor whether it holds NaN: it masks hidden values always. The graph computes what the reference
    does, with a NaN in a value that the causal band hides from the first rows, and the trace leaves
    no fake tensor in a cache that a later eager call reads (that call once returned zeros)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, generator=gen)
    k, v = (torch.randn(2, 2, 13, 8, generator=gen) for _ in range(2))
    v[:, :, 8] = float("nan")  # key 8: hidden from rows 0..3 by the bottom-right band (Mk - Mq = 4)

    def f(q, k, v, op=CHUNKED_SMALL):
        bias = ba.PaddedKeysMask([9, 13]) & ba.LowerTriangularFromBottomRightMask()
        return ba.attention(q, k, v, bias, op=op)

    traced = make_fx(lambda q, k, v: f(q, k, v), tracing_mode="fake")(q, k, v)
    want = f(q.double(), k.double(), v.double(), op="reference").float()
    torch.testing.assert_close(traced(q, k, v), want, equal_nan=True)
    torch.testing.assert_close(f(q, k, v), want, equal_nan=True)
    assert not want[:, :, :4].isnan().any() and want[:, :, 4:].isnan().all()
