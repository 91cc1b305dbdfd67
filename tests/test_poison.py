"""A position that a bias hides from a row never affects that row, whatever it holds (NaN, ±inf).

For every family's hidden positions (causal in both alignments, a window, padded keys, packed
segments, a block layout, an additive -inf and compositions), one key, one value row or the
additive terms at hidden positions are poisoned. `reference` and `chunked` (default and small tiles)
return exactly the clean result in every row that does not see the poisoned key, and so does the
`triton` forward (CPU interpreter, float32 and float16). The vendor operators run on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import biasattn as ba
from biasattn.bias import lower
from biasattn.ops.chunked import ChunkedOperator
from biasattn.ops.triton.flash import EXACT_TILES
from biasattn.testing import assert_close_to_reference, reference_attention
from biasattn.testing.poison import poison_key_, visibility

CHUNKED_SMALL = ChunkedOperator(block_q=4, block_k=4)
EXACT_OPS = [pytest.param("reference", id="reference"), pytest.param("chunked", id="chunked"),
             pytest.param(CHUNKED_SMALL, id="chunked_small")]
D = 16
VENDOR_OPS = ("cutlass", "flash2", "cudnn")


def _layout():
    layout = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)[None, None]
    return layout.expand(2, 2, 2, 2).clone()


# name: (B, Hq, Hkv, Mq, Mk, bias factory)
FAMILIES = {
    "causal": (1, 2, 1, 24, 24, lambda: ba.LowerTriangularMask()),
    "causal_bottom_right": (1, 2, 2, 9, 24, lambda: ba.LowerTriangularFromBottomRightMask()),
    "window": (1, 2, 1, 24, 24, lambda: ba.LocalAttentionMask(3, 2)),
    "padded": (2, 2, 1, 5, 24, lambda: ba.PaddedKeysMask([24, 11])),
    "segments": (1, 2, 1, 24, 24, lambda: ba.BlockDiagonalMask.from_seqlens([5, 9, 10], [7, 3, 14])),
    "segments_causal": (1, 2, 1, 24, 24, lambda: ba.BlockDiagonalMask.from_seqlens([5, 9, 10]).make_causal()),
    "block_sparse": (2, 2, 2, 32, 32, lambda: ba.BlockSparseMask(_layout(), 16)),
    "causal_and_padded": (2, 2, 1, 24, 24, lambda: ba.LowerTriangularMask() & ba.PaddedKeysMask([24, 13])),
    "causal_plus_alibi": (1, 2, 1, 24, 24, lambda: ba.LowerTriangularMask() + ba.ALiBi(torch.tensor([0.5, 0.25]))),
    "window_plus_additive": (1, 2, 1, 24, 24, lambda: ba.LocalAttentionMask(4) + ba.AdditiveBias(_finite_additive(24, 24))),
    "additive_neg_inf": (1, 2, 1, 24, 24, lambda: ba.AdditiveBias(_hiding_additive(24, 24))),
}
MASKED = [n for n in FAMILIES if n != "additive_neg_inf"]


def _finite_additive(Mq, Mk):
    return torch.randn(Mq, Mk, generator=torch.Generator().manual_seed(5))


def _hiding_additive(Mq, Mk):
    """An additive bias that hides key j from rows i < j - 2 with -inf (a causal-like band)."""
    i, j = torch.arange(Mq)[:, None], torch.arange(Mk)[None, :]
    return torch.where(j > i + 2, float("-inf"), _finite_additive(Mq, Mk))


def _inputs(name, dtype=torch.float64, device="cpu"):
    B, Hq, Hkv, Mq, Mk, make = FAMILIES[name]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, m, D, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
               for h, m in ((Hq, Mq), (Hkv, Mk), (Hkv, Mk)))
    bias = make()
    bias = bias if bias.follows_q else bias.to(device)  # list-built masks follow q: the vendor kernels run them
    return q, k, v, bias, visibility(bias, (B, Hq, Mq, Mk), device)


def _partly_hidden_key(seen, Hkv):
    """``(b, hkv, j)``: a key that some query row sharing KV head ``hkv`` sees and some other does not
    (one that every row of a batch row misses when there is none, as for padded keys)."""
    B, Hq = seen.shape[:2]
    per_kv = seen.unflatten(1, (Hkv, Hq // Hkv))  # [B, Hkv, G, Mq, Mk]
    hidden = ~per_kv.all(3).all(2)  # [B, Hkv, Mk]
    partly = per_kv.any(3).any(2) & hidden
    found = (partly if partly.any() else hidden).nonzero()
    b, h, j = found[len(found) // 2].tolist()
    return b, h, j


def _sees(seen, Hkv, b, hkv, j):
    """Bool ``[Hq, Mq]``: the query rows of batch row ``b`` whose head shares KV head ``hkv`` and that see key ``j``."""
    Hq = seen.shape[1]
    g = Hq // Hkv
    out = torch.zeros(seen.shape[1:3], dtype=torch.bool, device=seen.device)
    out[hkv * g : (hkv + 1) * g] = seen[b, hkv * g : (hkv + 1) * g, :, j]
    return out


def _assert_rows(out, clean, affected, b, name):
    """Rows not ``affected`` ([Hq, Mq] of batch row ``b``) and other batch rows equal ``clean``; the others are not finite."""
    rows_ok = ~affected[None, :, :, None].expand(out.shape[0], -1, -1, out.shape[-1]).clone()
    rows_ok[:b] = True
    rows_ok[b + 1 :] = True
    assert_close_to_reference(torch.where(rows_ok, out, 0.0), torch.where(rows_ok, clean, 0.0), name=name)
    assert not torch.isfinite(out[b][affected]).any(), f"{name}: rows that see the poisoned position are finite"


@pytest.mark.parametrize("op", EXACT_OPS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("which", ["key", "value"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_hidden_key_or_value_never_reaches_the_rows_that_cannot_see_it(name, which, value, op):
    """Regression: a NaN in key 6 of 8 under a causal mask turned every row NaN in `reference` and `chunked`."""
    q, k, v, bias, seen = _inputs(name)
    b, hkv, j = _partly_hidden_key(seen, k.shape[1])
    want, want_lse = reference_attention(q, k, v, bias)
    pk, pv = k.clone(), v.clone()
    poison_key_(pk if which == "key" else pv, b, hkv, j, value)
    out, lse = ba.attention_with_lse(q, pk, pv, bias, op=op)
    sees = _sees(seen, k.shape[1], b, hkv, j)
    _assert_rows(out, want, sees, b, f"{name} out")
    if which == "key":
        _assert_rows(lse[..., None], want_lse[..., None], sees, b, f"{name} lse")
    else:
        assert_close_to_reference(lse, want_lse, name=f"{name} lse")
    ref_out, ref_lse = reference_attention(q, pk, pv, bias)  # the oracle is the same function
    assert_close_to_reference(out, ref_out, name=f"{name} out vs the poisoned reference")
    assert_close_to_reference(lse, ref_lse, name=f"{name} lse vs the poisoned reference")


@pytest.mark.parametrize("op", EXACT_OPS)
@pytest.mark.parametrize("name", MASKED)
def test_gradients_of_rows_that_cannot_see_a_poisoned_key_stay_clean(name, op):
    """dq of the rows that do not see a NaN key or value, and dk/dv of the other keys, equal the clean ones."""
    q, k, v, bias, seen = _inputs(name)
    b, hkv, j = _partly_hidden_key(seen, k.shape[1])
    dout = torch.randn(q.shape[:3] + (v.shape[-1],), generator=torch.Generator().manual_seed(3), dtype=q.dtype)

    def grads(kk, vv):
        leaves = [t.clone().requires_grad_() for t in (q, kk, vv)]
        out = ba.attention(*leaves, bias, op=op)
        return torch.autograd.grad((torch.where(torch.isfinite(out), out, 0.0) * dout).sum(), leaves)

    clean = grads(k, v)
    sees = _sees(seen, k.shape[1], b, hkv, j)
    other_keys = torch.ones(k.shape[:3], dtype=torch.bool)
    other_keys[b, hkv, j] = False
    for which in ("key", "value"):
        pk, pv = k.clone(), v.clone()
        poison_key_(pk if which == "key" else pv, b, hkv, j)
        dq, dk, dv = grads(pk, pv)
        rows = torch.ones(q.shape[:3], dtype=torch.bool)
        rows[b] = ~sees
        assert_close_to_reference(dq[rows], clean[0][rows], name=f"{name} {which}: dq of rows that cannot see it")
        # keys' gradients gather every row: only the keys that no row seeing the poison shares a tile with
        if not sees.any():
            assert_close_to_reference(dk[other_keys], clean[1][other_keys], name=f"{name} {which}: dk")
            assert_close_to_reference(dv[other_keys], clean[2][other_keys], name=f"{name} {which}: dv")


@pytest.mark.parametrize("op", EXACT_OPS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name", ["causal", "padded", "segments_causal", "block_sparse", "window"])
def test_an_additive_nan_or_inf_at_a_masked_position_is_hidden(name, value, op):
    """Regression: mask + additive materialized as -inf + NaN = NaN, and the NaN reached the row."""
    q, k, v, bias, seen = _inputs(name)
    B, Hq, Mq, Mk = seen.shape
    add = _finite_additive(Mq, Mk).to(q.dtype)
    poisoned = torch.where(seen[0, 0], add, value)
    want, want_lse = reference_attention(q, k, v, bias + ba.AdditiveBias(add))
    out, lse = ba.attention_with_lse(q, k, v, bias + ba.AdditiveBias(poisoned), op=op)
    assert_close_to_reference(out, want, name=f"{name} out")
    assert_close_to_reference(lse, want_lse, name=f"{name} lse")


def test_the_reference_reads_a_mask_over_an_additive_nan_as_hidden():
    """The testing oracle: a mask's -inf wins over an additive NaN or +inf at the same position."""
    from biasattn.testing.reference import dense_bias

    add = torch.zeros(3, 3)
    add[0, 2], add[1, 2] = float("nan"), float("inf")
    dense = dense_bias(ba.LowerTriangularMask() + ba.AdditiveBias(add), (1, 1, 3, 3))
    assert torch.isneginf(dense[0, 0, 0, 2]) and torch.isneginf(dense[0, 0, 1, 2])
    assert not torch.isnan(dense).any()


# ------------------------------------------------------------------------- triton (interpreter)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("which", ["key", "value"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_triton_a_hidden_key_or_value_never_reaches_the_rows_that_cannot_see_it(name, which, value, dtype):
    """Regression: a non-finite value row reached every row of a query program in which some row saw it (0 * NaN
    in p @ v), and a NaN key under an additive -inf every row. Now only the rows that see the position change."""
    q, k, v, bias, seen = _inputs(name, dtype)
    b, hkv, j = _partly_hidden_key(seen, k.shape[1])
    want, _ = reference_attention(q, k, v, bias, compute_dtype=torch.float64)
    pk, pv = k.clone(), v.clone()
    poison_key_(pk if which == "key" else pv, b, hkv, j, value)
    out = ba.attention(q, pk, pv, bias, op="triton")
    sees = _sees(seen, k.shape[1], b, hkv, j)
    ok = ~sees[None, :, :, None].expand(out.shape[0], -1, -1, out.shape[-1]).clone()
    ok[:b], ok[b + 1 :] = True, True
    low, _ = reference_attention(q, k, v, bias, compute_dtype=dtype)
    err = (torch.where(ok, low.double(), 0.0) - torch.where(ok, want, 0.0)).abs().max().item()
    got = (torch.where(ok, out.double(), 0.0) - torch.where(ok, want, 0.0)).abs().max().item()
    assert got <= 2 * err + 1e-3 and torch.isfinite(out[ok]).all(), f"{name}: rows that cannot see it changed ({got})"
    assert not torch.isfinite(out[b][sees]).any(), f"{name}: rows that see it are finite"
    ref, _ = reference_attention(q, pk, pv, bias, compute_dtype=torch.float64)  # the oracle is the same function
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), f"{name}: NaN where the poisoned reference has none"
    both = torch.isinf(out) | torch.isinf(ref)
    assert torch.equal(out[both].double(), ref[both]), f"{name}: infinities differ from the poisoned reference"


@pytest.mark.parametrize("name", ["window", "block_sparse", "window_plus_additive"])
def test_triton_recomputes_a_poisoned_program_in_every_value_dim_and_under_dropout(name):
    """A program whose fast pass meets a hidden non-finite value runs again, 16 value dims at a time:
    value dims past 16 and not a multiple of 16 (Dv=40 beside D=24), and dropout (the same seed draws
    the same mask in both passes), give the rows that cannot see the value what the clean call gives."""
    B, Hq, Hkv, Mq, Mk, make = FAMILIES[name]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, Hq, Mq, 24, generator=gen)
    k = torch.randn(B, Hkv, Mk, 24, generator=gen)
    v = torch.randn(B, Hkv, Mk, 40, generator=gen)
    bias = make()
    seen = visibility(bias, (B, Hq, Mq, Mk), "cpu")
    b, hkv, j = _partly_hidden_key(seen, Hkv)
    pv = v.clone()
    poison_key_(pv, b, hkv, j, float("nan"))
    for dropout_p in (0.0, 0.3):
        torch.manual_seed(7)
        clean = ba.attention(q, k, v, bias, op="triton", dropout_p=dropout_p)
        torch.manual_seed(7)
        out = ba.attention(q, k, pv, bias, op="triton", dropout_p=dropout_p)
        sees = _sees(seen, Hkv, b, hkv, j)
        ok = ~sees[None, :, :, None].expand(B, -1, -1, out.shape[-1]).clone()
        ok[:b], ok[b + 1 :] = True, True
        torch.testing.assert_close(torch.where(ok, out, 0.0), torch.where(ok, clean, 0.0), rtol=1e-5, atol=1e-6)
        assert torch.isnan(out[b][sees]).all(), f"{name}: rows that see the NaN value are not NaN in every dim"


def _tile_ends(lens, tile=16):
    """The last key of every ``tile``-row query tile of causal segments of ``lens`` (one row of the tile sees it)."""
    ends, start = [], 0
    for n in lens:
        ends += [start + min(t + tile, n) - 1 for t in range(0, n, tile)]
        start += n
    return ends


@pytest.mark.parametrize("name", ["window", "segments_causal", "block_sparse"])
def test_triton_recomputes_marked_query_tiles_past_the_first_exact_program(name):
    """The exact pass checks ``EXACT_TILES`` query tiles per program: NaN values seen by rows of the
    first group of tiles, of a later one and of the partial last one (17 tiles of 16 rows under the
    interpreter; every tile of packed documents, whatever their scheduled order) reach exactly the rows
    that see them."""
    M = 16 * EXACT_TILES + 8
    lens = [40] * 5 + [32, 32]
    bias, keys = {
        "window": (ba.LocalAttentionMask(3, 2), [40, M // 2 + 3, M - 3]),
        "segments_causal": (ba.BlockDiagonalMask.from_seqlens(lens).make_causal(), _tile_ends(lens)),
        # 20-key blocks, each row block seeing its own and the one before: the last query tile holds
        # rows of two blocks, of which one sees key M - 3
        "block_sparse": (ba.BlockSparseMask(torch.ones(14, 14, dtype=torch.bool).tril().triu(-1), 20),
                         [45, M - 3]),
    }[name]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, M, D, generator=gen) for _ in range(3))
    seen = visibility(bias, (1, 2, M, M), "cpu")
    pv = v.clone()
    for j in keys:
        poison_key_(pv, 0, 0, j)
    out = ba.attention(q, k, pv, bias, op="triton")
    clean = ba.attention(q, k, v, bias, op="triton")
    sees = seen[0, :, :, keys].any(-1) & (torch.arange(2) == 0)[:, None]  # [Hq, Mq]: head 0 holds the NaN values
    if name != "segments_causal":  # scheduled tiles hold any rows; there every tile holds both kinds
        last = sees[0, 16 * EXACT_TILES :]
        assert last.any() and not last.all(), "the last query tile must hold rows of both kinds"
    torch.testing.assert_close(out[0][~sees], clean[0][~sees], rtol=1e-5, atol=1e-6)
    assert torch.isnan(out[0][sees]).all()


def test_triton_dq_read_back_from_the_bias_gradient_keeps_a_hidden_key_out():
    """With a bias gradient of its own per (batch row, head), dQ is dS @ K from that gradient: the same rule holds."""
    q, k, v, bias, seen = _inputs("causal_and_padded", torch.float32)
    add = torch.randn(seen.shape, generator=torch.Generator().manual_seed(7))
    b, hkv, j = _partly_hidden_key(seen, k.shape[1])
    pk = poison_key_(k.clone(), b, hkv, j)
    leaf_q, leaf_a = q.clone().requires_grad_(), add.clone().requires_grad_()
    out = ba.attention(leaf_q, pk, v, bias + ba.AdditiveBias(leaf_a), op="triton")
    dq, da = torch.autograd.grad(torch.where(torch.isfinite(out), out, 0.0).sum(), (leaf_q, leaf_a))
    rows = torch.ones(q.shape[:3], dtype=torch.bool)
    rows[b] = ~_sees(seen, k.shape[1], b, hkv, j)
    ref = {}
    for dtype in (torch.float64, torch.float32):
        lq, la = q.to(dtype).requires_grad_(), add.to(dtype).requires_grad_()
        o, _ = reference_attention(lq, k.to(dtype), v.to(dtype), bias + ba.AdditiveBias(la), compute_dtype=dtype)
        ref[dtype] = torch.autograd.grad(o.sum(), (lq, la))
    assert_close_to_reference(dq[rows], ref[torch.float64][0][rows], ref[torch.float32][0][rows], factor=3.0, name="dq")
    assert_close_to_reference(da[rows], ref[torch.float64][1][rows], ref[torch.float32][1][rows], factor=3.0, name="dbias")


@pytest.mark.parametrize("name", ["causal", "window", "block_sparse"])
def test_triton_a_shared_bias_gradient_takes_nothing_from_a_value_hidden_from_its_rows(name):
    """A bias shared by batch rows and heads gets its gradient from the kernel that sums dS over them: a
    NaN value leaves every position of the rows that cannot see it, and the hidden positions of the
    rows that do, as they are without it."""
    q, k, v, bias, seen = _inputs(name, torch.float32)
    add = _finite_additive(*seen.shape[2:])
    b, hkv, j = _partly_hidden_key(seen, k.shape[1])
    sees = _sees(seen, k.shape[1], b, hkv, j)

    def bias_grad(vv):
        leaf = add.clone().requires_grad_()
        out = ba.attention(q, k, vv, bias + ba.AdditiveBias(leaf), op="triton")
        return torch.autograd.grad(torch.where(torch.isfinite(out), out, 0.0).sum(), leaf)[0]

    clean = bias_grad(v)
    poisoned = bias_grad(poison_key_(v.clone(), b, hkv, j))
    # [Mq, Mk]: positions where no (batch row, head) whose row sees the value takes a dS
    kept = ~(sees[:, :, None] & seen[b]).any(0)
    assert (~kept).any() and (kept & seen[b].any(0)).any()
    torch.testing.assert_close(poisoned[kept], clean[kept])


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name", ["causal", "padded", "segments_causal", "block_sparse"])
def test_triton_an_additive_nan_or_inf_at_a_masked_position_is_hidden(name, value):
    """Masked tiles apply the mask with where after adding the additive tile."""
    q, k, v, bias, seen = _inputs(name, torch.float32)
    add = _finite_additive(*seen.shape[2:])
    want, _ = reference_attention(q, k, v, bias + ba.AdditiveBias(add))
    low, _ = reference_attention(q, k, v, bias + ba.AdditiveBias(add), compute_dtype=torch.float32)
    out = ba.attention(q, k, v, bias + ba.AdditiveBias(torch.where(seen[0, 0], add, value)), op="triton")
    assert_close_to_reference(out, want, low)


# ------------------------------------------------------------------------------- vendor (GPU)
@pytest.mark.gpu
@pytest.mark.parametrize("op", ["cutlass", "flash2", "cudnn", "triton", "triton_splitk", "chunked", "reference"])
@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("which", ["key", "value"])
def test_vendor_hidden_keys_never_reach_the_rows_that_cannot_see_them_gpu(name, op, which):
    """On a GPU, every operator that runs these inputs keeps a NaN key or value out of the rows that do not see it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    q, k, v, bias, seen = _inputs(name, torch.bfloat16, "cuda")
    if ba.ops.get(op).not_supported_reasons(_make(q, k, v, bias)):
        pytest.skip(f"{op} does not run {name}")
    b, hkv, j = _partly_hidden_key(seen, k.shape[1])
    want, _ = reference_attention(q, k, v, bias)
    pk, pv = k.clone(), v.clone()
    poison_key_(pk if which == "key" else pv, b, hkv, j)
    out = ba.attention(q, pk, pv, bias, op=op)
    sees = _sees(seen, k.shape[1], b, hkv, j)
    ok = ~sees[None, :, :, None].expand(out.shape[0], -1, -1, out.shape[-1]).clone()
    ok[:b], ok[b + 1 :] = True, True
    low, _ = reference_attention(q, k, v, bias, compute_dtype=torch.bfloat16)
    known = which == "value" and op in VENDOR_OPS and lower(bias, *seen.shape, q.device).band_lo is not None
    try:
        assert_close_to_reference(
            torch.where(ok, out, 0).double(), torch.where(ok, want, 0.0), torch.where(ok, low, 0).double())
    except AssertionError:
        if known:
            pytest.xfail("vendor kernels multiply a value hidden by their causal band or window by 0 (docs/numerics.md)")
        raise
    assert not known, f"{op} now keeps a hidden value out of {name}: drop its expected failure and the docs' exception"


def _make(q, k, v, bias):
    from biasattn.inputs import make_inputs

    return make_inputs(q, k, v, bias)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name", MASKED)
@pytest.mark.parametrize("which", ["key", "value"])
def test_triton_backward_a_hidden_key_or_value_never_reaches_the_dq_of_rows_that_cannot_see_it(name, value, which):
    """dq of a row is a sum of dS · k over key tiles; a key a row cannot see has dS = 0 there (set with where,
    since a hidden value's NaN reaches dP), and the key is zeroed for that product when it is not finite
    (0 · NaN would be NaN)."""
    q, k, v, bias, seen = _inputs(name, torch.float32)
    b, hkv, j = _partly_hidden_key(seen, k.shape[1])
    dout = torch.randn(q.shape[:3] + (v.shape[-1],), generator=torch.Generator().manual_seed(3))
    pk, pv = k.clone(), v.clone()
    poison_key_(pk if which == "key" else pv, b, hkv, j, value)
    leaf = q.clone().requires_grad_()
    out = ba.attention(leaf, pk, pv, bias, op="triton")
    (dq,) = torch.autograd.grad((torch.where(torch.isfinite(out), out, 0.0) * dout).sum(), (leaf,))
    rows = torch.ones(q.shape[:3], dtype=torch.bool)
    rows[b] = ~_sees(seen, k.shape[1], b, hkv, j)
    ref = {}
    for dtype in (torch.float64, torch.float32):  # the clean key: rows that cannot see it get the same dq
        leaf = q.to(dtype).requires_grad_()
        o, _ = reference_attention(leaf, k.to(dtype), v.to(dtype), bias, compute_dtype=dtype)
        (ref[dtype],) = torch.autograd.grad((o * dout.to(dtype)).sum(), (leaf,))
    assert torch.isfinite(dq[rows]).all(), f"{name}: a row that cannot see the {which} got a non-finite dq"
    assert_close_to_reference(dq[rows], ref[torch.float64][rows], ref[torch.float32][rows], factor=3.0, name="dq")
