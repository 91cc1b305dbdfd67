"""The ``triton`` operator against the float64 reference, every BiasSpec feature, forward and backward.

On the CPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
with 16×16 tiles, so tiny shapes still cross tile boundaries. Criterion: ``max|out - ref| <=
factor · max|out_lowprec - ref| + 1e-5`` with ``out_lowprec`` the same attention done by the
reference math in the inputs' precision (factor 2; 3 for dq). Fresh outputs are poisoned with NaN.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import biasattn as ba
from biasattn.inputs import make_inputs
from biasattn.ops.reference import dense_bias, softmax_attention
from biasattn.testing import poison_hidden_lines

try:  # a module global: the probe kernel of test_chunked_program_order calls it
    from biasattn.ops.triton.common_kernels import _chunked_ids
except ImportError:
    _chunked_ids = None

OP = ba.ops.get("triton") if "triton" in ba.ops.available() else None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    OP is None or bool(OP.environment_reasons(torch.device(DEVICE))),
    reason="the triton operator cannot run here" + (f": {OP.environment_reasons(torch.device(DEVICE))}" if OP else ""),
)


@pytest.fixture(autouse=True)
def _poison(triton_options, monkeypatch):

    triton_options(poison_outputs=True)


# ----------------------------------------------------------------------------------------- checking
def assert_close(name: str, got, ref, low, factor: float = 2.0, atol: float = 1e-5, flash_err: float = 0.0) -> None:
    """``max|got - ref| <= factor · max(max|low - ref|, flash_err) + atol``; infinities must agree exactly, no NaN.

    ``flash_err``: how far the rounding of a flash kernel moves the result (:func:`_delta_rounding`)."""
    g, r, lo = (t.detach().double().cpu() for t in (got, ref, low))
    assert not torch.isnan(g).any(), f"{name}: NaN in the result"
    inf = torch.isinf(r)
    assert torch.equal(torch.isinf(g), inf), f"{name}: infinities differ from the reference"
    assert torch.equal(g[inf], r[inf]), f"{name}: infinities of the wrong sign"
    fin = ~inf
    if not fin.any():
        return
    err = float((g - r)[fin].abs().max())
    ok = fin & torch.isfinite(lo)
    low_err = max(float((lo - r)[ok].abs().max()) if ok.any() else 0.0, flash_err)
    bound = factor * low_err + atol
    assert err <= bound, f"{name}: max error {err:.3g} > {factor}·{low_err:.3g} + {atol} (low-precision reference error)"


def _delta_rounding(q, k, r_inp, r_out, r_lse, l_out, dout, add_shape) -> tuple[float, float, float]:
    """``(max |moved dq|, max |moved dk|, max |moved dadditive|)`` (the additive gradient summed to
    ``add_shape``, bounded through absolute values) when a flash backward takes ``delta = rowsum(dout * out)`` from
    the output rounded to the dtype (``l_out``) instead of the exact one: ``dS`` moves by
    ``-P · (delta_rounded - delta)`` on every row, a rounding every flash kernel has and the textbook
    low-precision math, which differentiates the softmax, does not (float64; the fuzz test's
    flash-rounding yardstick for the same reason)."""
    qd = q.detach().double()
    kd = k.detach().double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (qd @ kd.transpose(-1, -2)) * r_inp.scale
    dense = dense_bias(r_inp, torch.float64, r_inp.additive)
    if dense is not None:
        s = s + dense.detach()
    lse = r_lse.detach().double()[..., None]
    p = torch.where(torch.isfinite(lse), torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)), 0)
    moved = ((dout.double() * (l_out.detach().double() - r_out.detach().double())).sum(-1))[..., None]
    ds = torch.nan_to_num(-p * moved)
    dq = (ds @ kd) * r_inp.scale
    dk = (ds.transpose(-1, -2) @ qd) * r_inp.scale
    da = ds.abs()
    if add_shape is not None:
        shape = (1,) * (4 - len(add_shape)) + tuple(add_shape)
        dims = [d for d, n in enumerate(shape) if n == 1 and da.shape[d] != 1]
        da = da.sum(dims, keepdim=True) if dims else da
    return tuple(float(t.abs().max()) if t.numel() else 0.0 for t in (dq, dk, da))


def _leaf(t, dtype=None, grad=True):
    if t is None:
        return None
    t = t.detach().clone() if dtype is None else t.detach().to(dtype)
    return t.requires_grad_(grad and t.is_floating_point())


def check(q, k, v, make_bias, add=None, *, scale=None, grads=True, add_grad=True, use_dlse=True, seed=0, dropout_p=0.0):
    """Run the triton operator and compare out, lse (and dq, dk, dv, dadditive) with the references.

    ``make_bias(additive tensor or None)`` builds the bias, so each reference gets its own copy of the
    additive tensor in its own precision. With ``dropout_p`` the references apply the mask that
    :func:`~biasattn.ops.triton.flash.dropout_mask` writes for the seed the operator draws.
    """
    dtype = q.dtype
    user_make = make_bias

    def make_bias(a):  # tensor-free masks (LowerTriangularMask()) are created on the CPU
        bias = user_make(a)
        return bias.to(q.device) if bias is not None and bias.device != q.device else bias

    ours = [_leaf(t, grad=grads) for t in (q, k, v)]
    ref_in = [_leaf(t, torch.float64, grads) for t in (q, k, v)]
    low_in = [_leaf(t, grad=grads) for t in (q, k, v)]
    ag = grads and add_grad and add is not None
    a_ours, a_ref, a_low = _leaf(add, grad=ag), _leaf(add, torch.float64, ag), _leaf(add, grad=ag)

    torch.manual_seed(seed)
    if dropout_p > 0:  # the public API gives no lse with dropout
        out, lse, use_dlse = ba.attention(*ours, make_bias(a_ours), scale=scale, op="triton", dropout_p=dropout_p), None, False
    else:
        out, lse = ba.attention_with_lse(*ours, make_bias(a_ours), scale=scale, op="triton")
    inp = make_inputs(*low_in, make_bias(a_low), scale=scale)
    lo_dtype = dtype
    if dropout_p > 0:
        from biasattn.ops.common import new_seed
        from biasattn.ops.triton import flash

        torch.manual_seed(seed)  # the seed the operator drew
        mask = flash.dropout_mask(new_seed(), dropout_p, *out.shape[:3], k.shape[2], q.device)
        r_inp = make_inputs(*ref_in, make_bias(a_ref), scale=scale)
        r_out, r_lse = softmax_attention(*ref_in, dense_bias(r_inp, torch.float64, r_inp.additive), r_inp.scale,
                                         torch.float64, mask.double())
        l_out, l_lse = softmax_attention(*low_in, dense_bias(inp, lo_dtype, inp.additive), inp.scale, lo_dtype,
                                         mask.to(lo_dtype))
    else:
        r_inp = make_inputs(*ref_in, make_bias(a_ref), scale=scale)
        r_out, r_lse = ba.attention_with_lse(*ref_in, make_bias(a_ref), scale=scale, op="reference")
        l_out, l_lse = softmax_attention(*low_in, dense_bias(inp, lo_dtype, inp.additive), inp.scale, lo_dtype)
    assert out.dtype == dtype
    assert_close("out", out, r_out, l_out)
    if lse is not None:
        assert lse.dtype == torch.float32
        assert_close("lse", lse, r_lse, l_lse)
    if not grads:
        return out, lse
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dout = torch.randn(out.shape, generator=gen).to(out.device)
    dlse = torch.randn(out.shape[:3], generator=gen).to(out.device) if use_dlse else None

    def grads_of(o, l, inputs, extra):
        wrt = list(inputs) + ([extra] if extra is not None else [])
        outs, gs = [o], [dout.to(o.dtype)]
        if dlse is not None:
            outs.append(l)
            gs.append(dlse.to(l.dtype))
        return torch.autograd.grad(outs, wrt, gs)

    got = grads_of(out, lse, ours, a_ours if ag else None)
    ref = grads_of(r_out, r_lse, ref_in, a_ref if ag else None)
    low = grads_of(l_out, l_lse, low_in, a_low if ag else None)
    # the backward's delta comes from the output the forward stored: its rounding and the textbook one
    by_low, by_ours = (_delta_rounding(q, k, r_inp, r_out, r_lse, o, dout, add.shape if ag else None) for o in (l_out, out))
    dq_m, dk_m, da_m = (max(a, b) for a, b in zip(by_low, by_ours))
    moved = (dq_m, dk_m, 0.0, da_m)
    for name, g, r, lo, f, m in zip(("dq", "dk", "dv", "dadditive"), got, ref, low, (3.0, 2.0, 2.0, 2.0), moved):
        assert g.shape == r.shape and g.dtype == lo.dtype, f"{name}: shape/dtype {g.shape}/{g.dtype}"
        assert_close(name, g, r, lo, factor=f, flash_err=m)
    return out, lse


def record_descriptors(mp) -> list:
    """Patch ``tma.kv_descriptors`` (through the monkeypatch ``mp``) so that every launch's answer,
    descriptors or None, is appended to the returned list."""
    from biasattn.ops.triton import tma

    built, real = [], tma.kv_descriptors
    mp.setattr(tma, "kv_descriptors", lambda *a: built.append(real(*a)) or built[-1])
    return built


def qkv(B=1, Hq=2, Hkv=1, Mq=37, Mk=45, D=16, Dv=None, dtype=torch.float32, seed=0):
    """Random ``q [B, Hq, Mq, D]``, ``k [B, Hkv, Mk, D]``, ``v [B, Hkv, Mk, Dv]`` on the test device."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)

    return r(B, Hq, Mq, D), r(B, Hkv, Mk, D), r(B, Hkv, Mk, Dv or D)


def const(bias):
    """A ``make_bias`` for a bias without additive tensor."""
    return lambda add: bias


# ----------------------------------------------------------------------------------------- features
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_no_bias_gqa_and_dv(dtype):
    check(*qkv(B=2, Hq=4, Hkv=2, Mq=33, Mk=47, D=24, Dv=16, dtype=dtype), const(None))


@pytest.mark.parametrize(
    "bias",
    [
        ba.LowerTriangularMask(),
        ba.LowerTriangularFromBottomRightMask(),
        ba.LocalAttentionMask(7, 3),
        ba.LocalAttentionMask(0, 0),
    ],
    ids=["causal", "causal_bottom_right", "window", "diagonal"],
)
@pytest.mark.parametrize("sizes", [(40, 29), (29, 40)], ids=["Mq>Mk", "Mq<Mk"])
def test_band(bias, sizes):
    check(*qkv(Mq=sizes[0], Mk=sizes[1]), const(bias.to(DEVICE)))


def test_padded_keys_with_empty_rows():
    """A batch row with kv_seqlen 0 sees nothing: out 0, lse -inf, zero gradients."""
    check(*qkv(B=3, Mq=21, Mk=40), const(ba.PaddedKeysMask([40, 0, 17]).to(DEVICE)))


HIDDEN_CASES = ["padded", "padded_causal_br_gqa", "padded_window", "segments", "segments_causal",
                "padded_shared_additive", "padded_own_additive"]


@pytest.mark.parametrize("name", ["window", "causal"])
def test_a_masked_d256_tile_reads_its_values_after_the_softmax(triton_options, monkeypatch, name):
    """At head dims of 256 a masked tile fetched through descriptors loads V after its softmax (held
    from the top, the V tile spills): the results are the references', and a NaN value reaches
    exactly the rows that see it."""
    from biasattn.ops.triton import configs

    if not configs.interpreted():
        pytest.skip("descriptors are forced only under the interpreter; the GPU suite runs D=256 masks")
    triton_options(descriptors_interpreted=True, descriptors_min_scores=0)
    built = record_descriptors(monkeypatch)
    q, k, v = qkv(Mq=20, Mk=20, D=256)
    bias = ba.LocalAttentionMask(window_left=4, window_right=0) if name == "window" else ba.LowerTriangularMask()
    check(q, k, v, const(bias), grads=False)
    clean = ba.attention(q, k, v, bias, op="triton")
    ref = ba.attention(q.double(), k.double(), v.double(), bias, op="reference")
    low = ba.attention(q, k, v, bias, op="reference")
    bad = 17
    v[:, :, bad] = float("nan")
    out = ba.attention(q, k, v, bias, op="triton")
    sees = torch.zeros(20, dtype=torch.bool)
    sees[bad:bad + 5 if name == "window" else None] = True
    assert out[:, :, sees].isnan().all()
    # the other rows hold their clean values: rows of a tile that a NaN reached are computed again by
    # the exact kernel, whose rounding may differ from the tile loop's by an ulp; tiles whose key tiles
    # miss the NaN value are not touched at all
    assert_close("rows that do not see the NaN value", out[:, :, ~sees], ref[:, :, ~sees], low[:, :, ~sees])
    rows = configs.INTERPRETER_CONFIG.block_m
    untouched = [a for a in range(0, 20, rows)
                 if not (max(0, a - 4) if name == "window" else 0) <= bad <= min(a + rows - 1, 19)]
    assert untouched  # the case holds a tile that the NaN value cannot reach
    for a in untouched:
        torch.testing.assert_close(out[:, :, a:a + rows], clean[:, :, a:a + rows], rtol=0, atol=0)
    assert built and all(d is not None for d in built)


SPAN_BIASES = {
    "window": lambda: ba.LocalAttentionMask(window_left=5, window_right=20),
    "documents": lambda: ba.BlockDiagonalMask.from_seqlens([13, 22, 13]),
    "causal_documents": lambda: ba.BlockDiagonalMask.from_seqlens([13, 22, 13]).make_causal(),
}


@pytest.mark.parametrize("name", list(SPAN_BIASES))
def test_a_nan_value_reaches_only_the_rows_that_see_it_through_descriptors(triton_options, monkeypatch, name):
    """Masked tiles fetched through descriptors keep a NaN value from the rows that cannot see it: packed
    documents without a band by zeroing the values of keys outside their program's span, windows and
    causal documents through the exact pass, which computes again every row the value reached. At any
    key, one at a time, it reaches exactly the rows that see it. Query tiles of 32 rows over 16 keys
    give right edges of several masked tiles."""
    from biasattn.ops.triton import configs

    if not configs.interpreted():
        pytest.skip("descriptors are forced only under the interpreter; the GPU suite runs these masks")
    triton_options(descriptors_interpreted=True, descriptors_min_scores=0)
    built = record_descriptors(monkeypatch)
    q, k, v = qkv(Mq=48, Mk=48, D=16, Hq=1)
    bias = SPAN_BIASES[name]()
    ref = ba.attention(q.double(), k.double(), v.double(), bias, op="reference")
    low = ba.attention(q, k, v, bias, op="reference")
    seen = bias.materialize((1, 1, 48, 48), device=DEVICE)[0, 0] == 0  # [rows, keys]
    with configs.override(fwd=configs.TileConfig(32, 16, 4, 1)):
        for bad in range(48):
            poisoned = v.clone()
            poisoned[:, :, bad] = float("nan")
            out = ba.attention(q, k, poisoned, bias, op="triton")
            sees = seen[:, bad]
            assert out[:, :, sees].isnan().all(), f"key {bad}"
            assert_close(f"rows that do not see key {bad}", out[:, :, ~sees], ref[:, :, ~sees], low[:, :, ~sees])
    assert built and all(d is not None for d in built)


@pytest.mark.parametrize("case", HIDDEN_CASES)
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
def test_hidden_lines_hold_nan(triton_options, monkeypatch, case, tma):
    """Keys past a cache length and lines outside every packed segment may hold anything (NaN in an
    uninitialized cache): they stay out of the output and of every gradient, which are 0 there. The
    additive cases run the shared bias-gradient kernel and dQ read back from the bias gradient."""
    from biasattn.ops.triton import configs

    if tma and not configs.interpreted():
        pytest.skip("descriptors are forced only under the interpreter; on the GPU the dtype decides")
    triton_options(descriptors_interpreted=tma, descriptors_min_scores=0)
    built = record_descriptors(monkeypatch)
    B, Hq, Hkv, Mk = (3, 4, 2, 45) if "gqa" in case else (3, 2, 2, 45)
    padded = ba.PaddedKeysMask([45, 19, 3]).to(DEVICE)
    # a document without queries (its 5 keys hidden) and one without keys (its 8 rows see nothing)
    segments = ba.BlockDiagonalMask.from_seqlens([10, 0, 19, 8], [12, 5, 20, 0], device=DEVICE)
    if case.startswith("segments"):
        B, Mk = 1, 37
    masks = {
        "padded": padded,
        "padded_causal_br_gqa": padded & ba.LowerTriangularFromBottomRightMask().to(DEVICE),
        "padded_window": padded & ba.LocalAttentionMask(window_left=6, window_right=3).to(DEVICE),
        "segments": segments,
        "segments_causal": segments.make_causal_from_bottom_right(),
        "padded_shared_additive": padded,
        "padded_own_additive": padded & ba.LowerTriangularFromBottomRightMask().to(DEVICE),
    }[case]
    add = None
    if "additive" in case:
        shape = (1 if "shared" in case else B, Hq, 37, Mk)
        add = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    q, k, v = poison_hidden_lines(*qkv(B=B, Hq=Hq, Hkv=Hkv, Mq=37, Mk=Mk), masks)
    assert k.isnan().any() and (q.isnan().any() or not case.startswith("segments"))
    check(q, k, v, (lambda a: masks + ba.AdditiveBias(a)) if add is not None else const(masks), add)
    assert all(d is not None for d in built) == tma and built


@pytest.mark.parametrize("variant", ["plain", "causal", "causal_br", "local"])
def test_block_diagonal(variant):
    bias = ba.BlockDiagonalMask.from_seqlens([10, 0, 19, 7, 1], [12, 5, 3, 25, 0], device=DEVICE)
    bias = {"plain": bias, "causal": bias.make_causal(), "causal_br": bias.make_causal_from_bottom_right(),
            "local": bias.make_local_attention(4, 2)}[variant]
    check(*qkv(Hq=2, Hkv=1, Mq=37, Mk=45), const(bias))


@pytest.mark.parametrize(
    "layout_shape,block",
    [((2, 2, 5, 6), 8), ((1, 1, 3, 3), 16), ((1, 2, 2, 2), 32), ((2, 1, 10, 3), (4, 16))],
    ids=["inexact", "exact", "exact_large", "rect_blocks"],
)
def test_block_sparse(layout_shape, block):
    gen = torch.Generator().manual_seed(1)
    layout = (torch.rand(layout_shape, generator=gen) < 0.45).to(DEVICE)
    layout[..., 0, 0] = False  # a query block that sees nothing in some heads
    bq, bk = (block, block) if isinstance(block, int) else block
    Mq, Mk = min(37, layout_shape[2] * bq), min(45, layout_shape[3] * bk)
    Mq, Mk = max(Mq, (layout_shape[2] - 1) * bq + 1), max(Mk, (layout_shape[3] - 1) * bk + 1)
    check(*qkv(B=2, Hq=2, Hkv=1, Mq=Mq, Mk=Mk), const(ba.BlockSparseMask(layout, block)))


@pytest.mark.parametrize("in_registers", [True, False], ids=["list_in_registers", "list_loaded"])
def test_block_sparse_list_only(triton_options, monkeypatch, in_registers):
    """Layout alone, kernel tiles inside its blocks, lengths in whole tiles: the branch-free list loops,
    with the tile list held in registers or read entry by entry."""
    from biasattn.ops.triton import configs, flash

    triton_options(list_in_registers=in_registers)

    taken = []
    real = flash._SpecArgs.tile_lists

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        taken.append(out[-1])
        return out

    monkeypatch.setattr(flash._SpecArgs, "tile_lists", spy)
    layout = (torch.rand((2, 2, 3, 4), generator=torch.Generator().manual_seed(2)) < 0.5).to(DEVICE)
    layout[..., 0, 0] = False  # a query block that sees nothing in some heads
    tiles = configs.TileConfig(16, 16, 4, 1)  # inside the 16-blocks on any device
    with configs.override(fwd=tiles, dkdv=tiles, dq=tiles):
        check(*qkv(B=2, Hq=2, Hkv=1, Mq=48, Mk=64), const(ba.BlockSparseMask(layout, 16)))
    assert len(taken) == 3 and all(taken)  # forward, dK/dV and dQ


@pytest.mark.parametrize("case", ["window", "padded_causal", "segments_causal"])
def test_grouped_heads_in_one_loop_per_kind_of_tile(case):
    """dK/dV of four query heads per KV head, the heads and tiles walked by one loop per kind of tile
    (masked left edge, unmasked middle, masked right edge), match the reference."""
    if case == "segments_causal":
        bias, B = ba.BlockDiagonalMask.from_seqlens([30, 0, 41], device=DEVICE).make_causal(), 1
    elif case == "padded_causal":
        bias, B = ba.PaddedKeysMask([71, 40], device=DEVICE) & ba.LowerTriangularFromBottomRightMask().to(DEVICE), 2
    else:
        bias, B = ba.LocalAttentionMask(window_left=35, window_right=5).to(DEVICE), 2
    check(*qkv(B=B, Hq=8, Hkv=2, Mq=71, Mk=71), const(bias))


@pytest.mark.parametrize("bias_grad", [False, True], ids=["no_bias_grad", "bias_grad"])
def test_additive_bias_of_each_head_with_grouped_heads(bias_grad):
    """A bias tile of its own per (batch row, head) with four query heads per KV head: the dK/dV program
    reads (and writes the gradient of) each query head's tile, causal edges and unmasked tiles alike."""
    add = torch.randn(2, 8, 71, 71, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    check(*qkv(B=2, Hq=8, Hkv=2, Mq=71, Mk=71), lambda a: ba.LowerTriangularMask().to(DEVICE) + ba.AdditiveBias(a), add,
          add_grad=bias_grad)


@pytest.mark.parametrize("fused", [True, False], ids=["delta_in_dq", "delta_preprocessed"])
@pytest.mark.parametrize("case", ["segments", "causal_gqa"])
def test_backward_delta_paths(triton_options, monkeypatch, fused, case):
    """dQ computing delta for dK/dV (two launches) and the separate preprocessing launch both match."""

    triton_options(fused_delta=fused)
    if case == "segments":  # per-segment dQ tiles that end mid-tile, a segment without keys
        bias = ba.BlockDiagonalMask.from_seqlens([10, 0, 19, 7, 1], [12, 5, 3, 25, 0], device=DEVICE)
        check(*qkv(Mq=37, Mk=45), const(bias))
    else:
        check(*qkv(B=2, Hq=4, Hkv=2, Mq=37, Mk=45), const(ba.LowerTriangularMask()))


def test_backward_preprocessing_writes_the_guarded_lse():
    """The preprocessing that the Gluon backward reads: delta, lse with +inf for a row that saw no key
    (lse -inf: P is 0 there) and NaN for a row that saw an infinite score (lse +inf: no defined gradient),
    every other row as it is, and the float32 dQ it adds into, zeroed (rows past a tile's end included)."""
    from biasattn.ops.triton import flash_bwd

    gen = torch.Generator().manual_seed(4)
    out, dout = (torch.randn(2, 3, 37, 16, generator=gen).to(DEVICE) for _ in range(2))
    lse = torch.randn(2, 3, 37, generator=gen).to(DEVICE) * 5
    lse[0, 1, 3], lse[1, 2, 36], lse[1, 0, 0] = float("-inf"), float("inf"), float("nan")
    delta, guarded = (torch.full_like(lse, 7.0) for _ in range(2))
    dq32 = torch.full_like(out, float("nan"))
    f32 = torch.zeros(1, device=DEVICE)
    flash_bwd._delta(out, dout, None, delta, f32, 16, lse, guarded, dq32)
    assert torch.equal(dq32, torch.zeros_like(dq32))
    torch.testing.assert_close(delta, (out.double() * dout.double()).sum(-1).float())
    want = lse.clone()
    want[0, 1, 3], want[1, 2, 36] = float("inf"), float("nan")
    torch.testing.assert_close(guarded, want, equal_nan=True, rtol=0, atol=0)
    assert torch.isnan(guarded[1, 0, 0]) and guarded.isfinite().sum() == lse.numel() - 3


@pytest.mark.parametrize(
    "shape",
    [(2, 2, 37, 45), (1, 2, 37, 45), (2, 1, 37, 45), (1, 1, 37, 45), (2, 2, 1, 45), (1, 2, 37, 1), (1, 1, 1, 1)],
    ids=["full", "bcast_B", "bcast_H", "bcast_BH", "bcast_q", "bcast_k", "scalar"],
)
def test_additive_gradient(shape):
    gen = torch.Generator().manual_seed(2)
    add = torch.randn(shape, generator=gen).to(DEVICE)
    check(*qkv(B=2, Hq=2, Hkv=1, Mq=37, Mk=45), lambda a: ba.AdditiveBias(a), add)


@pytest.mark.parametrize("masks", ["causal", "padded_layout", "window_gqa"])
def test_shared_additive_gradient_with_masks(monkeypatch, masks):
    """A bias gradient shared by batch rows (or heads) is summed by its own kernel, with every mask applied."""
    from biasattn.ops.triton import flash_bwd

    launched = []
    monkeypatch.setattr(flash_bwd, "_dbias", _Counting(flash_bwd._dbias, launched))
    gen = torch.Generator().manual_seed(5)
    Hkv = 1 if masks == "window_gqa" else 2
    shape = (1, 1, 37, 45) if masks == "window_gqa" else (1, 2, 37, 45)
    add = torch.randn(shape, generator=gen).to(DEVICE)
    if masks == "causal":
        extra = ba.LowerTriangularFromBottomRightMask()
    elif masks == "padded_layout":
        layout = (torch.rand(1, 2, 5, 6, generator=gen) < 0.6).to(DEVICE)
        extra = ba.PaddedKeysMask([30, 45], device=DEVICE) & ba.BlockSparseMask(layout, 8)
    else:
        extra = ba.LocalAttentionMask(9, 3)
    check(*qkv(B=2, Hq=2, Hkv=Hkv, Mq=37, Mk=45), lambda a: extra + ba.AdditiveBias(a), add)
    assert launched, "the shared bias gradient did not go through its kernel"


@pytest.mark.parametrize("masks", ["none", "causal_padded", "window_gqa", "dropout"])
def test_own_additive_gradient_gives_dq(monkeypatch, masks):
    """A bias slice per (batch row, head): dK/dV writes dS as the gradient once, and dQ is read back from it."""
    from biasattn.ops.triton import flash_bwd

    launched = []
    monkeypatch.setattr(flash_bwd, "_dq_ds", _Counting(flash_bwd._dq_ds, launched))
    gen = torch.Generator().manual_seed(6)
    add = torch.randn(2, 2, 37, 45, generator=gen).to(DEVICE)
    Hkv = 1 if masks == "window_gqa" else 2
    if masks == "causal_padded":
        extra = ba.LowerTriangularFromBottomRightMask() & ba.PaddedKeysMask([30, 45], device=DEVICE)
    elif masks == "window_gqa":
        extra = ba.LocalAttentionMask(9, 3)
    else:
        extra = None
    p = 0.3 if masks == "dropout" else 0.0
    check(*qkv(B=2, Hq=2, Hkv=Hkv, Mq=37, Mk=45), lambda a: ba.AdditiveBias(a) if extra is None else extra + ba.AdditiveBias(a),
          add, dropout_p=p)
    assert launched, "dQ was not read back from the bias gradient"


def test_dq_reads_dbias_only_when_dS_is_the_gradient():
    """dQ comes from the bias gradient only for a slice per (batch row, head), precise enough, without segments or layouts."""
    from biasattn.bias.spec import lower
    from biasattn.ops.triton.flash_bwd import _dq_reads_dbias

    def spec(shape, dtype=torch.float16, extra=None):
        bias = ba.AdditiveBias(torch.zeros(shape, dtype=dtype))
        return lower((extra + bias) if extra is not None else bias, 2, 4, 8, 8)

    h = torch.float16
    assert _dq_reads_dbias(spec((2, 4, 8, 8)), "full", 2, 4, h)
    assert _dq_reads_dbias(spec((2, 4, 8, 8), torch.float32), "full", 2, 4, h)
    assert not _dq_reads_dbias(spec((2, 4, 8, 8), torch.bfloat16), "full", 2, 4, h)  # dS would lose bits
    assert not _dq_reads_dbias(spec((1, 4, 8, 8)), "full", 2, 4, h)  # shared by the batch: a sum of dS
    assert not _dq_reads_dbias(spec((2, 1, 8, 8)), "full", 2, 4, h)  # shared by heads
    assert not _dq_reads_dbias(spec((2, 4, 1, 8)), "col", 2, 4, h)
    layout = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    assert not _dq_reads_dbias(spec((2, 4, 8, 8), extra=ba.BlockSparseMask(layout, 8)), "full", 2, 4, h)


class _Counting:
    """A kernel stand-in that records its launches and forwards them."""

    def __init__(self, kernel, log):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        self.log.append(grid)
        return self.kernel[grid]


def test_additive_broadcast_stays_strided():
    """An expanded (stride-0) additive tensor is read through its strides; its gradient keeps its shape."""
    base = torch.randn(1, 2, 1, 45).to(DEVICE)
    add = base.expand(2, 2, 37, 45)
    assert add.stride()[0] == 0
    check(*qkv(B=2, Hq=2, Hkv=1, Mq=37, Mk=45), lambda a: ba.AdditiveBias(a), add, add_grad=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_output_laid_out_like_a_fused_projections_views(dtype):
    """q, k, v viewed from one ``[B, M, 3, H, D]`` projection keep each row's heads side by side, and so does
    the output: turning it back into ``[B, M, H * D]`` is a view, and the gradient that comes back
    through that view (strided, not copied) gives the reference's gradients."""
    B, M, H, D = 2, 37, 2, 16
    gen = torch.Generator().manual_seed(5)
    qkv_ = torch.randn(B, M, 3, H, D, generator=gen).to(device=DEVICE, dtype=dtype).requires_grad_()
    q, k, v = qkv_.permute(2, 0, 3, 1, 4)
    out = ba.attention(q, k, v, ba.LowerTriangularMask(), op="triton")
    assert out.transpose(1, 2).is_contiguous(), f"out strides {out.stride()} for q strides {q.stride()}"
    flat = out.transpose(1, 2).view(B, M, H * D)  # raises if the layout needed a copy
    dflat = torch.randn(B, M, H * D, generator=gen).to(device=DEVICE, dtype=dtype)
    got = torch.autograd.grad(flat, (q, k, v), dflat)
    dout = dflat.view(B, M, H, D).transpose(1, 2)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    r_out = ba.attention(*ref, ba.LowerTriangularMask(), op="reference")
    l_out, _ = softmax_attention(*low, dense_bias(make_inputs(*low, ba.LowerTriangularMask()), dtype, None),
                                 1 / math.sqrt(D), dtype)
    assert_close("out", out, r_out, l_out)
    r_grads = torch.autograd.grad(r_out, ref, dout.double())
    l_grads = torch.autograd.grad(l_out, low, dout)
    for name, g, r, lo in zip(("dq", "dk", "dv"), got, r_grads, l_grads):
        assert_close(name, g, r, lo, factor=3.0 if name == "dq" else 2.0)


def test_additive_minus_inf_rows():
    """Rows masked only through -inf in the additive tensor: out 0, lse -inf, no NaN."""
    add = torch.randn(1, 1, 37, 45)
    add[:, :, 5] = float("-inf")
    add[:, :, 20, 3:] = float("-inf")
    check(*qkv(Mq=37, Mk=45), lambda a: ba.AdditiveBias(a), add.to(DEVICE), add_grad=False)


@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi(per_batch):
    slopes = ba.ALiBi.standard_slopes(4)
    slopes = torch.stack([slopes, slopes * 0.5]) if per_batch else slopes
    check(*qkv(B=2, Hq=4, Hkv=2, Mq=29, Mk=40), const(ba.ALiBi(slopes.to(DEVICE))))


def test_composition_sliced():
    """Segments & layout & band + additive + ALiBi, sliced so every offset is non-zero."""
    Mq_full, Mk_full = 50, 58
    segs = ba.BlockDiagonalMask.from_seqlens([20, 30], [25, 33], device=DEVICE).make_local_attention(9, 4)
    layout = (torch.rand(1, 2, 7, 8, generator=torch.Generator().manual_seed(3)) < 0.7).to(DEVICE)
    alibi = ba.ALiBi(ba.ALiBi.standard_slopes(2).to(DEVICE))
    add = torch.randn(1, 2, Mq_full, Mk_full, generator=torch.Generator().manual_seed(4)).to(DEVICE)

    def make(a):
        bias = segs & ba.BlockSparseMask(layout, 8)
        return (bias + ba.AdditiveBias(a) + alibi)[..., 3:44, 5:50]

    check(*qkv(B=1, Hq=2, Hkv=1, Mq=41, Mk=45), make, add)


@pytest.mark.parametrize("case", ["composed", "additive_grad"])
def test_64_bit_slice_offsets(triton_options, monkeypatch, case):
    """The 64-bit offset path (slices past 2**31 elements) computes the same as the 32-bit one."""

    triton_options(force_index_64=True)
    if case == "composed":
        layout = (torch.rand(1, 2, 5, 6, generator=torch.Generator().manual_seed(6)) < 0.6).to(DEVICE)
        bias = (ba.BlockSparseMask(layout, 8) & ba.LocalAttentionMask(9, 2)) + ba.ALiBi(ba.ALiBi.standard_slopes(2).to(DEVICE))
        check(*qkv(B=2, Hq=2, Hkv=1, Mq=37, Mk=45), const(bias))
    else:
        add = torch.randn(1, 2, 37, 45, generator=torch.Generator().manual_seed(7)).to(DEVICE)
        check(*qkv(B=2, Hq=2, Hkv=1, Mq=37, Mk=45), lambda a: ba.AdditiveBias(a), add)


def test_head_dim_padding_and_scale():
    check(*qkv(Mq=20, Mk=33, D=12, Dv=20), const(ba.LowerTriangularMask()), scale=0.37)


def test_empty_inputs():
    for Mq, Mk in ((0, 5), (5, 0)):
        q, k, v = qkv(Mq=Mq, Mk=Mk)
        out, lse = ba.attention_with_lse(q, k, v, op="triton")
        assert out.shape == (1, 2, Mq, 16) and not torch.isnan(out).any() and (out == 0).all()
        assert (lse == float("-inf")).all()


# ----------------------------------------------------------------------------------------- dropout
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["none_gqa_dv", "causal", "segments", "padded_window", "layout", "alibi"])
def test_dropout(case, dtype):
    """Out, lse and every gradient equal the reference's with the kernels' own mask applied."""
    if case == "none_gqa_dv":
        check(*qkv(B=2, Hq=4, Hkv=2, Mq=33, Mk=47, D=24, Dv=16, dtype=dtype), const(None), dropout_p=0.4, seed=1)
    elif case == "causal":
        check(*qkv(Mq=40, Mk=29, dtype=dtype), const(ba.LowerTriangularFromBottomRightMask()), dropout_p=0.2, seed=2)
    elif case == "segments":  # dK/dV key tiles start at the documents: the element-by-element draw
        seg = ba.BlockDiagonalMask.from_seqlens([5, 20, 12], [13, 7, 27], device=DEVICE).make_causal()
        check(*qkv(Mq=37, Mk=47, dtype=dtype), const(seg), dropout_p=0.3, seed=3)
    elif case == "padded_window":
        bias = ba.PaddedKeysMask([40, 9], device=DEVICE) & ba.LocalAttentionMask(12, 3)
        check(*qkv(B=2, Mq=33, Mk=45, dtype=dtype), const(bias), dropout_p=0.5, seed=4)
    elif case == "layout":
        layout = torch.rand(1, 1, 3, 3, generator=torch.Generator().manual_seed(5)) < 0.6
        check(*qkv(Mq=48, Mk=48, dtype=dtype), const(ba.BlockSparseMask(layout.to(DEVICE), (16, 16))), dropout_p=0.25, seed=5)
    else:
        alibi = ba.ALiBi(torch.tensor([[0.3, 0.1]], device=DEVICE))
        check(*qkv(Mq=21, Mk=38, dtype=dtype), const(ba.LowerTriangularMask() + alibi), dropout_p=0.1, seed=6)


@pytest.mark.parametrize("shape", [(1, 2, 21, 34), (2, 2, 21, 34)], ids=["shared_by_batch", "per_batch"])
def test_dropout_additive_gradient(shape):
    """The bias gradient with dropout: the shared-gradient kernel (bias broadcast over B) and dK/dV's."""
    add = torch.randn(*shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    check(*qkv(B=2, Mq=21, Mk=34), lambda a: ba.AdditiveBias(a), add, dropout_p=0.3, seed=7)


def test_dropout_mask_draws():
    """One draw, two ways (eight keys per Philox call or one at a time); the keep rate and scale are
    those of the probability rounded to 2**-16; a new seed gives a new mask."""
    from biasattn.ops.triton import flash

    p = 0.3
    a = flash.dropout_mask(2**61 + 12345, p, 2, 3, 37, 45, DEVICE)
    b = flash.dropout_mask(2**61 + 12345, p, 2, 3, 37, 45, DEVICE, aligned=False)
    assert torch.equal(a, b)
    threshold = round(p * 2**16)
    assert threshold == flash.dropout_args(p, 0)[2]
    scale = 2**16 / (2**16 - threshold)
    values = a.unique().tolist()
    assert len(values) == 2 and values[0] == 0.0 and values[1] == pytest.approx(scale, rel=1e-6)
    n = a.numel()
    kept = int((a > 0).sum())
    keep = 1 - threshold / 2**16
    assert abs(kept - n * keep) < 5 * math.sqrt(n * keep * (1 - keep)), f"{kept} kept of {n}"
    c = flash.dropout_mask(2**61 + 12346, p, 2, 3, 37, 45, DEVICE)
    assert 0.3 < float((a != c).float().mean()) < 0.5  # independent masks differ in 2p(1-p) = 42%
    assert not torch.equal(a[0, 0], a[0, 1]) and not torch.equal(a[0], a[1])  # each (batch, head) draws its own


def test_dropout_seed_follows_torch_manual_seed():
    """The same torch seed gives the same dropped output; another one a different output; p = 0 is exact."""
    q, k, v = qkv(Mq=20, Mk=24)
    torch.manual_seed(0)
    a = ba.attention(q, k, v, op="triton", dropout_p=0.5)
    torch.manual_seed(0)
    b = ba.attention(q, k, v, op="triton", dropout_p=0.5)
    torch.manual_seed(1)
    c = ba.attention(q, k, v, op="triton", dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.testing.assert_close(ba.attention(q, k, v, op="triton", dropout_p=0.0), ba.attention(q, k, v, op="reference"))


def test_backward_after_another_operators_forward():
    """The dispatcher may pair another forward with this backward; that forward's ctx is not a seed."""
    from biasattn.ops import autograd

    q, k, v = (t.requires_grad_() for t in qkv(Mq=20, Mk=24, dtype=torch.float16))  # chunked keeps an object
    bias = ba.LowerTriangularMask()
    inp = make_inputs(q, k, v, bias, requires_grad=True)
    out, _ = autograd.run(inp, ba.ops.get("chunked"), OP)
    dout = torch.ones_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    r_in = [_leaf(t, torch.float64) for t in (q, k, v)]
    ref = torch.autograd.grad(ba.attention(*r_in, bias, op="reference"), r_in, dout.double())
    l_in = [_leaf(t) for t in (q, k, v)]
    low_out, _ = softmax_attention(*l_in, dense_bias(inp, torch.float16, None), inp.scale, torch.float16)
    low = torch.autograd.grad(low_out, l_in, dout)
    for name, g, r, lo in zip(("dq", "dk", "dv"), got, ref, low):
        assert_close(name, g, r, lo, factor=3.0)


# ----------------------------------------------------------------------------------------- properties
@st.composite
def cases(draw):
    """Random shapes, dtype and a composition of every bias family (possibly sliced)."""
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    families = ["causal", "causal_br", "local", "padded", "segments", "layout"]
    fams = draw(st.lists(st.sampled_from(families), max_size=3, unique=True))
    extra = draw(st.lists(st.sampled_from(["additive", "alibi"]), max_size=2, unique=True))
    Hkv, G = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    B = 1 if "segments" in fams else draw(st.sampled_from([1, 2]))
    Mq, Mk = draw(st.integers(1, 48)), draw(st.integers(1, 48))
    D = draw(st.sampled_from([8, 16, 32]))
    Dv = draw(st.sampled_from([D, 16]))
    sliced = draw(st.booleans())
    q_off, k_off = (draw(st.integers(0, 6)), draw(st.integers(0, 6))) if sliced else (0, 0)
    Fq, Fk = Mq + q_off + (draw(st.integers(0, 6)) if sliced else 0), Mk + k_off + (draw(st.integers(0, 6)) if sliced else 0)
    seed = draw(st.integers(0, 2**16))
    dropout_p = draw(st.sampled_from([0.0, 0.0, 0.3]))
    gen = torch.Generator().manual_seed(seed)
    masks, documents = [], None
    for f in fams:
        if f == "causal":
            masks.append(ba.LowerTriangularMask())
        elif f == "causal_br":
            masks.append(ba.LowerTriangularFromBottomRightMask())
        elif f == "local":
            masks.append(ba.LocalAttentionMask(draw(st.integers(0, 20)), draw(st.integers(0, 5))))
        elif f == "padded":
            masks.append(ba.PaddedKeysMask([draw(st.integers(0, Fk)) for _ in range(B)], device=DEVICE))
        elif f == "segments":
            n = draw(st.integers(1, 4))
            cq = sorted(draw(st.lists(st.integers(0, Fq), min_size=n - 1, max_size=n - 1)))
            ck = sorted(draw(st.lists(st.integers(0, Fk), min_size=n - 1, max_size=n - 1)))
            lq = [b - a for a, b in zip([0, *cq], [*cq, Fq])]
            lk = [b - a for a, b in zip([0, *ck], [*ck, Fk])]
            seg = ba.BlockDiagonalMask.from_seqlens(lq, lk, device=DEVICE)
            documents = seg  # without the band: what the segments alone hide
            kind = draw(st.sampled_from(["plain", "causal", "causal_br", "local"]))
            if kind == "causal":
                seg = seg.make_causal()
            elif kind == "causal_br":
                seg = seg.make_causal_from_bottom_right()
            elif kind == "local":
                seg = seg.make_local_attention(draw(st.integers(0, 12)), draw(st.integers(0, 3)))
            masks.append(seg)
        else:
            bq, bk = draw(st.sampled_from([4, 8, 16, 32])), draw(st.sampled_from([4, 8, 16, 32]))
            lb, lh = draw(st.sampled_from([1, B])), draw(st.sampled_from([1, Hkv * G]))
            layout = torch.rand(lb, lh, math.ceil(Fq / bq), math.ceil(Fk / bk), generator=gen) < 0.5
            masks.append(ba.BlockSparseMask(layout.to(DEVICE), (bq, bk)))
    add = None
    if "additive" in extra:
        shape = [draw(st.sampled_from([1, n])) for n in (B, Hkv * G, Fq, Fk)]
        add = torch.randn(shape, generator=gen).to(DEVICE)
    alibi = None
    if "alibi" in extra:
        alibi = ba.ALiBi((torch.rand(B, Hkv * G, generator=gen) * 0.5).to(DEVICE))

    def make(a, hiding=False):
        bias = None
        for f, m in zip(fams, masks):
            if hiding:  # only what may hide lines that hold anything: padded keys, the documents themselves
                if f not in ("padded", "segments"):
                    continue
                m = documents if f == "segments" else m
            bias = m if bias is None else bias & m
        for term in ([ba.AdditiveBias(a)] if a is not None else []) + ([alibi] if alibi is not None else []):
            bias = term if bias is None else bias + term
        if bias is not None and sliced:
            bias = bias.bind(Fq, Fk)[..., q_off : q_off + Mq, k_off : k_off + Mk]
        return bias

    q, k, v = qkv(B, Hkv * G, Hkv, Mq, Mk, D, Dv, dtype, seed)
    hiding = make(None, hiding=True)
    if hiding is not None and draw(st.booleans()):
        q, k, v = poison_hidden_lines(q, k, v, hiding)
    return dict(q=q, k=k, v=v, make=make, add=add, dropout_p=dropout_p,
                desc=f"{fams}+{extra} p={dropout_p} B={B} Hq={Hkv * G} Hkv={Hkv} "
                f"Mq={Mq} Mk={Mk} D={D} Dv={Dv} {dtype} slice=({q_off},{k_off},{Fq},{Fk})")


@settings(max_examples=30)
@given(case=cases())
def test_random_compositions(case):
    try:
        bias = case["make"](case["add"])
    except ba.BiasCompositionError:
        return  # a pair the algebra refuses (tested with the biases)
    del bias
    check(case["q"], case["k"], case["v"], case["make"], case["add"], dropout_p=case["dropout_p"])


# ----------------------------------------------------------------------------------------- operator
def test_declarations_and_reasons():
    decl = OP.declarations()
    assert decl["backward"] and decl["bias_grad"] and decl["gqa"] and decl["dropout"]
    q, k, v = qkv(D=16)
    assert not OP.not_supported_reasons(make_inputs(q, k, v, dropout_p=0.1))
    big = make_inputs(torch.randn(1, 1, 4, 300), torch.randn(1, 1, 4, 300), torch.randn(1, 1, 4, 300))
    assert any("head dims" in r for r in OP.not_supported_reasons(big))
    for scale in (0.0, -0.5):
        reasons = OP.not_supported_reasons(make_inputs(q, k, v, scale=scale))
        assert any("positive scale" in r and str(scale) in r for r in reasons)


def test_cpu_needs_interpreter(monkeypatch):
    """On the CPU the operator names the interpreter as the reason when it is off."""
    import biasattn.ops.triton_flash as tf
    from biasattn.ops.triton import flash

    monkeypatch.setattr(flash, "INTERPRETED", False)
    reasons = tf.TritonOperator().environment_reasons(torch.device("cpu"))
    assert reasons and "TRITON_INTERPRET=1" in reasons[0]


def test_launch_arguments_keep_no_cycle_through_the_spec():
    """What the launchers cache on a spec frees with it, without waiting for the cycle collector
    (an additive bias can be large)."""
    import gc
    import weakref

    from biasattn.inputs import make_inputs
    from biasattn.ops.triton import flash

    q, k, v = qkv(B=2, Hq=2, Hkv=1, Mq=20, Mk=24)
    add = torch.randn(1, 2, 20, 24).to(DEVICE)
    gc.disable()
    try:
        inp = make_inputs(q, k, v, ba.LowerTriangularMask() + ba.AdditiveBias(add))
        flash.attn_fwd(q, k, v, inp.spec, inp.scale)
        assert inp.spec.derived, "the forward launch caches its arguments on the spec"
        spec = weakref.ref(inp.spec)
        del inp
        assert spec() is None
    finally:
        gc.enable()


def test_a_long_backward_counts_the_keys_rows_see():
    """dQ runs beside dK/dV on a side stream only for backwards of at least 2**36 of work; the work counts
    twice the keys a row sees on average, at most Mk, so dense and causal calls keep their nominal size while
    a 1k window over 8k keys, a call of about a millisecond, counts a quarter of it."""
    from biasattn.bias.spec import lower
    from biasattn.ops.triton.flash_bwd import _long_backward

    def long(bias, B, M, D, H=16):
        return _long_backward(lower(bias, B, H, M, M), B, H, M, M, D)

    window = ba.LocalAttentionMask(window_left=1024)
    assert long(None, 8, 2048, 128) and long(ba.LowerTriangularMask(), 8, 2048, 128)  # 2**36
    assert not long(None, 8, 2048, 64) and not long(ba.LowerTriangularMask(), 4, 2048, 128)  # 2**35
    assert not long(window, 2, 8192, 64)  # nominal 2**37, about 2**34.9 counted
    assert not long(window, 2, 8192, 128) and long(window, 2, 8192, 256)
    assert long(ba.PaddedKeysMask([2048, 1024] * 4), 8, 2048, 128)  # rows see 1,536 keys: 2x is more than Mk
    assert not long(ba.BlockDiagonalMask.from_seqlens([8192] * 4), 1, 32768, 128)  # packed documents: never


def test_short_spans_pick_short_forward_tiles():
    """The forward's tile choice sees how many keys a row visits on average (a bucket, not a length)."""
    from biasattn.ops.triton import configs, flash

    def spec(bias, Mq, Mk, B=1):
        return make_inputs(torch.empty(B, 1, Mq, 8), torch.empty(B, 1, Mk, 8), torch.empty(B, 1, Mk, 8), bias).spec

    def brute(bias, Mq, Mk, B=1):  # every row of a 64-row sequence is sampled, so the estimate is exact
        vis = bias.materialize((B, 1, Mq, Mk)) == 0 if bias is not None else torch.ones(B, 1, Mq, Mk, dtype=torch.bool)
        return vis.sum(-1).double().mean().item()

    for bias, B, Mq, Mk in [
        (None, 1, 64, 300),
        (ba.LowerTriangularMask(), 1, 64, 64),
        (ba.LocalAttentionMask(10, 3), 1, 64, 90),
        (ba.PaddedKeysMask([40, 90, 7]), 3, 64, 90),
    ]:
        assert flash.mean_visible_keys(spec(bias, Mq, Mk, B), Mq, Mk) == pytest.approx(brute(bias, Mq, Mk, B)), bias
    # packed segments count by shape: equal ones twice the mean length, whatever the lengths
    for q_lens, k_lens in [([64, 64], [30, 70]), ([127, 1], [1, 99])]:
        bias = ba.BlockDiagonalMask.from_seqlens(q_lens, k_lens)
        assert flash.mean_visible_keys(spec(bias, 128, 100), 128, 100) == pytest.approx(100.0)
    for lens in ([64, 64], [5, 123]):
        bias = ba.BlockDiagonalMask.from_seqlens(lens).make_causal()
        causal = brute(ba.LowerTriangularMask(), 128, 128)
        assert flash.mean_visible_keys(spec(bias, 128, 128), 128, 128) == pytest.approx(causal)
    causal = ba.LowerTriangularMask()
    both = ("short_span", "short_span_dkdv")
    assert flash._span_features(spec(causal, 1024, 1024), 1024, 1024) == (*both, "narrow_span")  # 512.5 keys
    assert flash._span_features(spec(causal, 1536, 1536), 1536, 1536) == both  # 768.5
    assert flash._span_features(spec(causal, 512, 512), 512, 512) == (*both, "narrow_span")  # 256.5
    assert flash._span_features(spec(causal, 2048, 2048), 2048, 2048) == ()
    assert flash._span_features(spec(ba.LocalAttentionMask(1024), 16384, 16384), 16384, 16384) == ("short_span",)
    assert flash._span_features(spec(ba.LocalAttentionMask(1024), 2048, 2048), 2048, 2048) == both
    assert flash._span_features(spec(None, 1024, 1024), 1024, 1024) == ()
    assert flash._span_features(spec(None, 1024, 900), 1024, 900) == ("short_span",)
    assert flash._span_features(spec(None, 1024, 800), 1024, 800) == both
    short = configs._candidates_for("fwd", 128, torch.bfloat16, ("band", "short_span"))
    assert short[0] == configs.TileConfig(64, 64, 4, 3)
    assert configs._candidates_for("fwd", 128, torch.bfloat16, ("band",))[0] == configs.TileConfig(128, 128, 8, 3)
    assert configs._candidates_for("fwd", 256, torch.bfloat16, ("band", "short_span")) == configs.candidates("fwd", 256)
    for head_dim in (32, 64):  # head dims up to 64 share one list, and its short forward tile
        assert configs._candidates_for("fwd", head_dim, torch.bfloat16, ("band", "short_span"))[0] == short[0]
        assert configs._candidates_for("fwd", head_dim, torch.bfloat16, ("band",))[0] == configs.candidates("fwd", 64)[0]
    short_dkdv = configs._candidates_for("dkdv", 128, torch.bfloat16, ("segments",) + both)
    assert short_dkdv[0] == configs.TileConfig(32, 64, 4, 4)
    assert configs._candidates_for("dkdv", 128, torch.bfloat16, ("band", "short_span")) == configs.candidates("dkdv", 128)
    assert configs._candidates_for("dq", 128, torch.bfloat16, ("segments", "short_span")) == configs.candidates("dq", 128)


def test_dropout_takes_short_dkdv_tiles_only_where_they_do_not_spill():
    """With dropout, dK/dV tries 32x64 tiles first up to head dim 128; at 256 they spill (1,528 local
    loads and stores on sm_90), so the usual first tile stays first."""
    from biasattn.ops.triton import configs

    assert configs._candidates_for("dkdv", 128, torch.bfloat16, ("dropout",))[0] == configs.TileConfig(32, 64, 4, 4)
    assert configs._candidates_for("dkdv", 256, torch.bfloat16, ("dropout",)) == configs.candidates("dkdv", 256)


def test_dropout_forward_at_head_dim_64_takes_64_row_tiles():
    """With dropout, the forward at head dim 64 tries 64x64 tiles with 4 warps first (128 rows at 4
    warps spill there on sm_90); at 128 the usual 128-row tiles stay first, narrowed to 64 keys."""
    from biasattn.ops.triton import configs

    assert configs._candidates_for("fwd", 64, torch.bfloat16, ("dropout",))[0] == configs.TileConfig(64, 64, 4, 3)
    assert configs._candidates_for("fwd", 128, torch.bfloat16, ("dropout",))[0] == configs.TileConfig(128, 64, 8, 3)


@pytest.mark.parametrize(
    ("features", "dtype", "first_64"),
    [
        ((), torch.bfloat16, True),
        (("band",), torch.float16, True),
        (("padded_keys",), torch.bfloat16, True),
        (("alibi", "band"), torch.bfloat16, True),
        (("additive", "full"), torch.bfloat16, True),
        (("band", "short_span"), torch.bfloat16, True),
        (("segments", "band", "short_span"), torch.bfloat16, True),
        ((), torch.float32, False),  # fp32 keeps its capped list
        (("layout",), torch.bfloat16, False),
        (("dropout",), torch.bfloat16, False),
    ],
)
def test_dq_at_head_dim_64_takes_64_row_tiles(features, dtype, first_64):
    """dQ at head dim 64 tries 64x64 tiles with 4 warps first outside block layouts and dropout; other head
    dims keep their first tile."""
    from biasattn.ops.triton import configs

    first = configs._candidates_for("dq", 64, dtype, features)[0]
    assert (first == configs.DQ_64) is first_64
    if dtype != torch.float32:
        if not first_64:
            assert first == configs.candidates("dq", 64)[0]
        for head_dim in (128, 256):
            assert configs._candidates_for("dq", head_dim, dtype, features)[0] == configs.candidates("dq", head_dim)[0]


@pytest.mark.parametrize(
    ("features", "dtype", "short"),
    [
        (("segments", "band", "short_span", "short_span_dkdv"), torch.bfloat16, True),
        (("band", "short_span", "short_span_dkdv"), torch.float16, True),
        (("band", "short_span"), torch.bfloat16, False),  # rows see more keys than the dK/dV bound
        (("band", "short_span", "short_span_dkdv", "dropout"), torch.bfloat16, False),
        (("full", "short_span", "short_span_dkdv", "additive"), torch.bfloat16, False),
        (("band", "short_span", "short_span_dkdv"), torch.float32, False),
    ],
)
def test_dkdv_at_head_dim_64_takes_32_row_tiles_where_rows_see_few_keys(features, dtype, short):
    """dK/dV at head dim 64 tries 32 rows by 128 keys first where rows see few keys (no additive bias or
    dropout); head dim 128 takes its own short tile there."""
    from biasattn.ops.triton import configs

    first = configs._candidates_for("dkdv", 64, dtype, features)[0]
    assert (first == configs.SHORT_ROWS["dkdv", 64]) is short
    if not short and dtype != torch.float32 and "dropout" not in features:
        assert first == configs.candidates("dkdv", 64)[0]
    if short:
        assert configs._candidates_for("dkdv", 128, dtype, features)[0] == configs.SHORT_ROWS["dkdv", 128]


def test_direct_launch_signature():
    """The direct-launch key changes with what Triton specializes on and nothing else."""
    from biasattn.ops.triton import launch
    from biasattn.ops.triton.fwd_kernels import _attn_fwd_kernel

    direct = launch.direct(_attn_fwd_kernel, ("seed_lo",))
    seed = _attn_fwd_kernel.arg_names.index("seed_lo")
    base = torch.zeros(64)

    def sig(t=base, n=7, s=3, x=0.5):
        args = [None] * (seed + 1)
        args[0], args[1], args[2], args[seed] = t, n, x, s
        return direct._signature(tuple(args))

    assert sig() == sig(t=torch.ones(64), s=2**31 - 1)  # a new tensor of the same kind, another 32-bit seed
    assert sig() != sig(t=base.half())  # dtype
    assert sig() != sig(t=base[1:])  # 16-byte alignment
    assert sig() != sig(n=8) and sig() != sig(x=0.25)  # keyed values
    assert sig() != sig(s=2**31)  # an unkeyed integer past 32 bits
    assert sig() != sig(n=7.0)  # argument types
    assert sig(t=5) != sig(t=6) and sig(t=5)[0] != sig()[0]  # a tensor slot holding an int keys on its value


def test_direct_launch_specialization_of_stride_tuples():
    """Strides passed as a tuple key the specialization table by what Triton specializes each on (equal to 1,
    divisible by 16), as lone integers do: a call whose sizes changed finds the kernel compiled for the last."""
    from biasattn.ops.triton import launch
    from biasattn.ops.triton.fwd_kernels import _attn_fwd_kernel

    direct = launch.direct(_attn_fwd_kernel)
    t = torch.zeros(64)

    def spec(strides):
        args = (t, strides)
        return direct._specialization(args, direct._signature(args))

    assert spec((4096, 512, 128, 1)) == spec((8192, 1024, 128, 1))  # longer rows: same classes
    assert spec((4096, 512, 128, 1)) != spec((4096, 512, 120, 1))  # 120 is not divisible by 16
    assert spec((4096, 512, 128, 1)) != spec((4096, 512, 128, 2))  # a unit stride is a constant
    assert direct._signature((t, (4096, 512, 128, 1))) != direct._signature((t, (8192, 1024, 128, 1)))  # exact table


def test_direct_launch_signature_of_descriptors():
    """A tensor descriptor keys on its dtype and block shape, not on its base or extents."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from biasattn.ops.triton import launch
    from biasattn.ops.triton.fwd_kernels import _attn_fwd_kernel

    direct = launch.direct(_attn_fwd_kernel)

    def sig(t, block=(1, 1, 16, 16)):
        return direct._signature((torch.zeros(4), TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))))

    t = torch.zeros(2, 3, 40, 16)
    assert sig(t) == sig(torch.ones(1, 2, 99, 16))
    assert sig(t) != sig(t.half()) and sig(t) != sig(t, (1, 1, 32, 16))


def test_descriptor_rules(triton_options, monkeypatch):
    """K/V qualify for descriptors only with 16-byte aligned strides, a unit last stride and no broadcast or empty dim,
    in a launch of at least ``descriptors_min_scores`` scores."""
    from biasattn.ops.triton import tma

    triton_options(descriptors_interpreted=True, descriptors_min_scores=0)
    if not tma.available(torch.device(DEVICE)):
        pytest.skip("no tensor descriptors with this Triton or device")
    x = torch.zeros(2, 4, 40, 16, device=DEVICE, dtype=torch.float16)
    assert tma.describable(x)
    assert tma.describable(x.transpose(1, 2).contiguous().transpose(1, 2))  # [B, M, H, D] memory
    assert tma.describable(x[..., :10])  # 10 of each row's 16 elements: the rows stay 32 bytes apart
    narrow = torch.zeros(2, 4, 40, 10, device=DEVICE, dtype=torch.float16)
    assert not tma.describable(narrow)  # rows 20 bytes apart
    assert not tma.describable(x.transpose(2, 3))  # last stride not 1
    assert not tma.describable(x[:, :1].expand(2, 4, 40, 16))  # a broadcast head dim
    assert not tma.describable(x[:, :, :0])  # empty
    scores = 2 * 4 * 40 * 40
    assert tma.kv_descriptors(x, narrow, 16, 16, 16, scores) is None
    k, v = tma.kv_descriptors(x, x, 32, 16, 16, scores)
    assert k.block_shape == [1, 1, 32, 16] and list(v.shape) == [2, 4, 40, 16]
    triton_options(descriptors_min_scores=scores + 1)  # a launch this small keeps pointer loads
    assert tma.kv_descriptors(x, x, 32, 16, 16, scores) is None
    triton_options(descriptors=False, descriptors_min_scores=0)
    assert tma.kv_descriptors(x, x, 32, 16, 16, scores) is None


def test_descriptor_threshold_counts_the_scores_computed():
    """The descriptors' threshold reads the scores a forward computes as far as shapes tell: packed
    documents count as equal ones, a band on a square call as half."""
    from biasattn.inputs import make_inputs
    from biasattn.ops.triton.flash import computed_scores

    q, short = torch.zeros(1, 2, 64, 16), torch.zeros(1, 2, 16, 16)

    def scores(bias, qq=q):
        return computed_scores(make_inputs(qq, q, q, bias).spec, 1, 2, qq.shape[2], 64)

    docs = ba.BlockDiagonalMask.from_seqlens([10, 30, 20, 4])
    assert scores(None) == 2 * 64 * 64
    assert scores(ba.LowerTriangularMask()) == 2 * 64 * 64 // 2
    assert scores(docs) == 2 * 64 * 64 // 4
    assert scores(docs.make_causal()) == 2 * 64 * 64 // 8
    assert scores(ba.LowerTriangularFromBottomRightMask(), short) == 2 * 16 * 64  # a band on a wide call: not halved


@settings(max_examples=12, deadline=None)
@given(case=cases())
def test_random_compositions_through_descriptors(case):
    """The forward with K/V tiles fetched through tensor descriptors (the copy engine on Hopper, its
    emulation under the interpreter) computes what the pointer loads do."""
    from biasattn.ops.triton import options, tma

    try:
        case["make"](case["add"])
    except ba.BiasCompositionError:
        return
    with pytest.MonkeyPatch.context() as mp, options.use(descriptors_interpreted=True, descriptors_min_scores=0):
        if not tma.available(case["q"].device) or not (tma.describable(case["k"]) and tma.describable(case["v"])):
            return  # pointer loads: every other test covers them
        built = record_descriptors(mp)
        check(case["q"], case["k"], case["v"], case["make"], case["add"], dropout_p=case["dropout_p"], grads=False)
    assert built and all(d is not None for d in built)


def test_chunked_program_order():
    """Grid positions map one to one onto (tile rank, pair): the plain order, then the last ``chunk`` pairs rank by rank."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(Rank, Pair, n_tiles, n_pairs, chunk, TAIL_ORDER: tl.constexpr):
        rank, pair = _chunked_ids(tl.program_id(0), tl.program_id(1), n_tiles, n_pairs, chunk, TAIL_ORDER)
        lin = tl.program_id(1) * n_tiles + tl.program_id(0)
        tl.store(Rank + lin, rank)
        tl.store(Pair + lin, pair)

    for n_tiles, n_pairs, chunk in ((3, 5, 2), (4, 6, 3), (2, 3, 1), (5, 4, 4), (1, 7, 3)):
        rank = torch.full((n_tiles * n_pairs,), -1, dtype=torch.int32, device=DEVICE)
        pair = torch.full_like(rank, -1)
        for tail_order in (True, False):
            probe[(n_tiles, n_pairs)](rank, pair, n_tiles, n_pairs, chunk, tail_order)
            got = list(zip(rank.tolist(), pair.tolist()))
            first = n_pairs - chunk if tail_order else n_pairs
            expected = [(r, p) for p in range(first) for r in range(n_tiles)]
            expected += [(r, p) for r in range(n_tiles) for p in range(first, n_pairs)]
            assert got == expected, (n_tiles, n_pairs, chunk, tail_order)


@pytest.mark.parametrize("waves", [0, 1, 8], ids=["plain_order", "last_pairs_by_rank", "all_pairs_by_rank"])
def test_program_order_keeps_results(triton_options, monkeypatch, waves):
    """Banded programs in the plain order, with the last pairs started rank by rank, or every pair so."""
    from biasattn.ops.triton import flash

    triton_options(order_tail_waves=waves)
    assert flash.program_chunk(8, 3, 4, 1) == {0: 1, 1: 2, 8: 8}[waves]  # 4 SMs, 3 tiles per pair
    assert flash.program_chunk(8, 3, 4, 1, banded=False) == 1  # work that does not shrink along the tiles
    check(*qkv(B=2, Hq=4, Hkv=4, Mq=37, Mk=45), const(ba.LowerTriangularMask()))
    check(*qkv(B=2, Hq=4, Hkv=2, Mq=40, Mk=29), const(ba.LocalAttentionMask(7, 3)))


def test_only_causal_bands_grow_the_spans_along_the_rows():
    """The Gluon kernels order their tails under a band bounded on the right only: causal masks of either
    alignment, per packed document too; not a window (its tiles are alike), nor without a band."""
    from biasattn.bias.spec import lower
    from biasattn.ops.triton.flash import growing_spans

    def grows(bias, Mq=64, Mk=64):
        return growing_spans(lower(bias, 1, 1, Mq, Mk, DEVICE))

    assert grows(ba.LowerTriangularMask()) and grows(ba.LowerTriangularFromBottomRightMask(), 32, 64)
    assert grows(ba.BlockDiagonalMask.from_seqlens([20, 44], device=DEVICE).make_causal())
    assert not grows(ba.LocalAttentionMask(window_left=8, window_right=0)) and not grows(None)
    assert not grows(ba.PaddedKeysMask([30], device=DEVICE))


def test_the_gluon_kernels_are_imported_on_sm90_gpus_only():
    """A call the Gluon forward and backward would take on an sm_90 GPU (D=128, a causal mask) runs the
    ``triton.language`` kernels elsewhere, without importing the Gluon modules (their language needs the GPU's
    Triton)."""
    import sys

    from biasattn.bias.spec import lower
    from biasattn.ops.triton import flash, flash_bwd

    if DEVICE != "cpu":
        pytest.skip("checked where no sm_90 GPU runs the call")
    q, k, v = qkv(B=1, Hq=1, Hkv=1, Mq=64, Mk=64, D=128, dtype=torch.float16)
    features = lower(ba.LowerTriangularMask(), 1, 1, 64, 64).features
    assert features <= flash.GLUON_FEATURES and features <= flash_bwd.GLUON_FEATURES
    check(q, k, v, const(ba.LowerTriangularMask()))
    assert "biasattn.ops.triton.gluon_forward" not in sys.modules
    assert "biasattn.ops.triton.gluon_backward" not in sys.modules


def test_rows_seeing_few_keys_keep_the_short_tiles_off_the_gluon_kernels():
    """Rows that see few keys (a narrow window, short documents) keep the ``triton.language`` kernels' short
    tiles: at head dim 64 (the backward) under 1,000 keys per row, at 128 (the forward) under
    :data:`~.flash.NARROW_SPAN_KEYS`; at 256 the Gluon kernels take every span. A wide window, a causal mask and
    padded keys take them at every head dim."""
    from biasattn.inputs import make_inputs
    from biasattn.ops.triton import flash

    def takes(bias, M, B=1):
        q = torch.empty(B, 1, M, 128)
        spec = make_inputs(q, q, q, bias).spec
        return tuple(flash._gluon_span(spec, D, M, M) for D in (64, 128, 256))

    assert takes(ba.LocalAttentionMask(window_left=256), 2048) == (False, False, True)
    assert takes(ba.LocalAttentionMask(window_left=512), 8192) == (False, False, True)  # 497 keys per row
    assert takes(ba.LocalAttentionMask(window_left=1024), 8192) == (False, True, True)  # 961
    assert takes(ba.BlockDiagonalMask.from_seqlens([512] * 16).make_causal(), 8192) == (False, False, True)
    assert takes(ba.BlockDiagonalMask.from_seqlens([800] * 10 + [192]).make_causal(), 8192) == (False, True, True)
    assert takes(ba.LocalAttentionMask(window_left=2048), 4096) == (True, True, True)
    assert takes(ba.LowerTriangularMask(), 4096) == (True, True, True)
    assert takes(ba.PaddedKeysMask([3000, 4096]), 4096, B=2) == (True, True, True)


def test_the_gluon_backward_at_head_dim_128_takes_calls_by_their_visible_scores(triton_options):
    """At head dim 128 the Gluon backward takes a call from ``gluon_bwd_min_visible`` visible scores (B·H·Mq
    times the keys a row sees on average), whatever the rows' span: the calls measured on each side of the
    bound, at H=16."""
    from biasattn.inputs import make_inputs
    from biasattn.ops.triton import flash_bwd

    def takes(bias, B, M, D=128):
        q = torch.empty(B, 1, M, 8)
        return flash_bwd._gluon_size(make_inputs(q, q, q, bias).spec, B, 16, M, M, D)

    window, causal = ba.LocalAttentionMask(window_left=128), ba.LowerTriangularMask()
    documents = ba.BlockDiagonalMask.from_seqlens(
        [847, 282, 318, 464, 735, 616, 953, 587, 734, 498, 542, 227, 349, 453, 639, 788, 873, 342, 443, 775, 969,
         538, 935, 557, 668, 1000, 252]).make_causal()  # 27 documents in 16k tokens
    assert takes(window, 8, 8192)  # 133M visible scores
    assert not takes(window, 2, 8192)  # 33M
    assert not takes(window, 2, 8192, D=64) and takes(window, 2, 8192, D=256)  # by span at the other head dims
    assert takes(causal, 16, 1024) and not takes(causal, 32, 512)  # 134M and 67M
    assert not takes(causal, 2, 2048)  # 67M
    assert takes(documents, 1, 16384)  # 159M by the estimate
    assert not takes(ba.PaddedKeysMask([384] * 32), 32, 512)  # 101M
    assert takes(ba.LocalAttentionMask(window_left=512), 8, 2048)  # 117M
    triton_options(gluon_bwd_min_visible=0)
    assert takes(window, 2, 8192)


def _gluon_that_cannot_build(monkeypatch, module: str, entry: str, **attrs):
    """Replace the Gluon ``module`` of ``biasattn.ops.triton`` by one whose ``entry`` raises the
    CompilationError of a Triton whose Gluon lacks what the kernel uses."""
    import ast
    import sys
    import types

    from triton.compiler.errors import CompilationError

    import biasattn.ops.triton as package

    def fails(*args):
        raise CompilationError("x = 1", ast.parse("x = 1").body[0], "no such layout")

    fake = types.ModuleType(f"biasattn.ops.triton.{module}")
    setattr(fake, entry, fails)
    for name, value in attrs.items():
        setattr(fake, name, value)
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(package, module, fake, raising=False)


def test_a_triton_whose_gluon_cannot_build_the_forward_falls_back(monkeypatch):
    """Where the installed Triton's Gluon cannot build the kernel (another version's API), the call runs the
    ``triton.language`` kernels with the same results, and says why once a process."""
    from biasattn.ops.triton import flash

    _gluon_that_cannot_build(monkeypatch, "gluon_forward", "attn_fwd", BLOCK_M=128, descriptors=lambda *args: ())
    monkeypatch.setattr(flash, "_gluon_runs", lambda *args: True)  # as on an sm_90 GPU
    monkeypatch.setattr(flash, "_gluon_failure", [])
    q, k, v = qkv(B=1, Hq=1, Hkv=1, Mq=128, Mk=128, D=128, dtype=torch.float16)
    with pytest.warns(RuntimeWarning, match="Gluon forward does not build .*no such layout"):
        check(q, k, v, const(ba.LowerTriangularMask()), grads=False)
    assert flash._gluon_failure == ["CompilationError: no such layout"]


def test_a_triton_whose_gluon_cannot_build_the_backward_falls_back(monkeypatch):
    """The same for the Gluon backward: the ``triton.language`` kernels compute the gradients, and a warning
    says why once a process; the forward is not affected."""
    from biasattn.ops.triton import flash, flash_bwd

    _gluon_that_cannot_build(monkeypatch, "gluon_backward", "attn_bwd", descriptors=lambda *args: (),
                             program_keys=lambda D: 128, tma_outputs=lambda D, documents: False)
    monkeypatch.setattr(flash_bwd, "_gluon_runs", lambda *args: True)  # as on an sm_90 GPU
    monkeypatch.setattr(flash_bwd, "_gluon_failure", [])
    q, k, v = qkv(B=1, Hq=1, Hkv=1, Mq=64, Mk=64, D=128, dtype=torch.float16)
    with pytest.warns(RuntimeWarning, match="Gluon backward does not build .*no such layout"):
        check(q, k, v, const(ba.LowerTriangularMask()))
    assert flash_bwd._gluon_failure == ["CompilationError: no such layout"]
    assert flash._gluon_failure == []
