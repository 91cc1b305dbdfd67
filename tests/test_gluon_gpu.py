"""The Gluon forward and backward (``biasattn.ops.triton.gluon_forward``, ``gluon_backward``) at head dim 128
on sm_90, inside the ``triton`` operator: no bias, causal masks, windows, padded keys, packed documents. Same
criterion as tests/test_triton.py (float64 reference, low-precision reference math, NaN-poisoned outputs,
gradients with and without an lse gradient)."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from test_triton import _delta_rounding, _poison, assert_close, check, const, qkv  # noqa: F401  (_poison: autouse)
from torch.nn.attention import SDPBackend, sdpa_kernel

import biasattn as ba
from biasattn.inputs import make_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs an sm_90 GPU"),
]


@pytest.fixture
def gluon_calls(triton_options, monkeypatch):
    """Every call large enough for the Gluon forward; returns the list its launches are logged in, as
    ``(q shape, k shape, masked)``. Launch plans are off, so that every call reaches the launcher (a replay
    does not)."""
    from biasattn.ops.triton import flash, gluon_forward

    triton_options(gluon_min_scores=0, gluon_bwd_min_visible=0, gluon_layout_min_scores=0, plans=False)
    monkeypatch.setattr(flash, "_gluon_span", lambda *args, **kwargs: True)  # rows seeing few keys take it too
    calls = []
    real = gluon_forward.attn_fwd

    @functools.wraps(real)
    def counted(q, k, *args):
        masked = real(q, k, *args)
        calls.append((tuple(q.shape), tuple(k.shape), masked))
        return masked

    monkeypatch.setattr(gluon_forward, "attn_fwd", counted)
    return calls


@pytest.fixture
def gluon_bwd_calls(gluon_calls, monkeypatch):
    """As :func:`gluon_calls`, for the Gluon backward: the list its launches are logged in, as
    ``(q shape, k shape)``."""
    from biasattn.ops.triton import gluon_backward

    calls = []
    real = gluon_backward.attn_bwd

    @functools.wraps(real)
    def counted(q, k, *args):
        real(q, k, *args)
        calls.append((tuple(q.shape), tuple(k.shape)))

    monkeypatch.setattr(gluon_backward, "attn_bwd", counted)
    return calls


@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1, 4, 4, 1024), (2, 8, 2, 384), (3, 2, 1, 128)], ids=["mha", "gqa4", "mqa"])
def test_matches_the_reference(gluon_calls, gluon_bwd_calls, causal, dtype, shape):
    B, Hq, Hkv, M = shape
    bias = ba.LowerTriangularMask() if causal else None
    check(*qkv(B=B, Hq=Hq, Hkv=Hkv, Mq=M, Mk=M, D=128, dtype=dtype), const(bias))
    assert gluon_calls and all(c[2] == causal for c in gluon_calls)
    assert gluon_bwd_calls


def _mask(case: str, device):
    """``(bias, B, Mq, Mk)`` of a masked call the Gluon forward takes."""
    seg = ba.BlockDiagonalMask.from_seqlens
    if case == "window":
        return ba.LocalAttentionMask(window_left=100, window_right=30), 2, 384, 384
    if case == "causal_window_rect":
        return ba.LocalAttentionMask(window_left=200, window_right=0), 1, 300, 520
    if case == "bottom_right_rect":
        return ba.LowerTriangularFromBottomRightMask(), 2, 200, 456
    if case == "top_left_rect":
        return ba.LowerTriangularMask(), 1, 456, 200
    if case == "unaligned":
        return None, 2, 200, 333
    if case == "padded":
        return ba.PaddedKeysMask([100, 0, 384], device=device), 3, 384, 384
    if case == "padded_causal":
        return ba.PaddedKeysMask([71, 300], device=device) & ba.LowerTriangularFromBottomRightMask().to(device), 2, 300, 300
    if case == "packed":
        return seg([100, 300, 28, 0, 200], device=device), 1, 628, 628
    if case == "packed_rect":
        return seg([100, 0, 190, 64], [130, 70, 128, 1], device=device), 1, 354, 329
    if case == "packed_causal":
        return seg([100, 300, 28, 200], device=device).make_causal(), 1, 628, 628
    if case == "packed_window":
        return seg([260, 300, 68], device=device).make_local_attention(90, 10), 1, 628, 628
    raise ValueError(case)


MASKS = ["window", "causal_window_rect", "bottom_right_rect", "top_left_rect", "unaligned", "padded", "padded_causal",
         "packed", "packed_rect", "packed_causal", "packed_window"]


@pytest.mark.parametrize("case", MASKS)
@pytest.mark.parametrize("heads", [(2, 2), (4, 1)], ids=["mha", "mqa"])
def test_masks_match_the_reference(gluon_calls, gluon_bwd_calls, case, heads):
    bias, B, Mq, Mk = _mask(case, "cuda")
    check(*qkv(B=B, Hq=heads[0], Hkv=heads[1], Mq=Mq, Mk=Mk, D=128, dtype=torch.bfloat16), const(bias))
    assert gluon_calls and all(c[2] for c in gluon_calls)
    assert bool(gluon_bwd_calls) == (Mq % 4 == 0)  # the backward's lse and delta tiles need rows in fours


@pytest.mark.parametrize("case", ["none", "causal", "window", "unaligned", "padded_causal", "packed_causal",
                                  "bottom_right_rect"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_forward_at_head_dim_256_matches_the_reference(gluon_calls, gluon_bwd_calls, case, dtype):
    """At head dim 256 the forward runs in Gluon with 64-key tiles, two in flight, and the backward in Gluon's
    wide kernel (64 keys a program, the warpgroups splitting the scores by keys and dK, dV, dQ by dims)."""
    if case in ("none", "causal"):
        bias, B, Mq, Mk = (ba.LowerTriangularMask() if case == "causal" else None), 2, 512, 512
    else:
        bias, B, Mq, Mk = _mask(case, "cuda")
    check(*qkv(B=B, Hq=4, Hkv=2, Mq=Mq, Mk=Mk, D=256, dtype=dtype), const(bias))
    assert gluon_calls and all(c[0][-1] == 256 and c[2] == (case != "none") for c in gluon_calls)
    assert gluon_bwd_calls


@pytest.mark.parametrize("case", ["D64", "fp32", "strided", "dropout", "additive", "block_sparse_32"])
def test_other_calls_keep_the_triton_kernels(gluon_calls, gluon_bwd_calls, case):
    """Calls outside the kernels' tensors and biases run the ``triton.language`` kernels, with the same results."""
    D, M, dtype, bias = 128, 256, torch.bfloat16, None
    if case == "D64":
        D = 64
    elif case == "fp32":
        dtype = torch.float32
    elif case == "block_sparse_32":  # blocks smaller than the Gluon backward's tiles
        layout = torch.tril(torch.ones(8, 8, dtype=torch.bool, device="cuda"))
        bias = ba.BlockSparseMask(layout, 32)
    q, k, v = qkv(B=2, Hq=2, Hkv=2, Mq=M, Mk=M, D=D, dtype=dtype)
    if case == "strided":  # rows of a [B, M, H, D] projection
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    if case == "dropout":
        ba.attention(q, k, v, op="triton", dropout_p=0.1)
    elif case == "additive":
        check(q, k, v, lambda add: ba.AdditiveBias(add), torch.randn(1, 2, M, M, device="cuda", dtype=dtype))
    else:
        check(q, k, v, const(bias))
    assert gluon_calls == [] and bool(gluon_bwd_calls) == (case == "D64")  # the backward runs at D=64 too


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("heads", [(4, 4, 4), (4, 2, 1), (4, 2, 4)], ids=["mha", "gqa_shared", "gqa_per_head"])
def test_block_layouts_walk_their_tile_lists(gluon_calls, gluon_bwd_calls, heads, D):
    """A block layout whose blocks hold whole tiles (128 rows and keys here) runs in Gluon, each program walking
    the tiles its list holds: the forward at head dims 128 and 256, every row seeing its listed key tiles whole
    (rows that see none write 0), and the backward when a KV head's query heads share one list (MHA, or one
    layout for every head; a key block no row sees gets dK = dV = 0). Per-head layouts under GQA keep the
    ``triton.language`` backward."""
    Hq, Hkv, Hl = heads
    gen = torch.Generator().manual_seed(7)
    layout = torch.rand(Hl, 4, 4, generator=gen) < 0.5
    layout[:, :, 1] = False  # keys 128-255: no row sees them
    layout[:, 3, :] = False  # rows 384-511: they see no key
    layout[:, 0, 0] = True
    bias = ba.BlockSparseMask(layout[None].to("cuda"), 128)
    check(*qkv(B=2, Hq=Hq, Hkv=Hkv, Mq=512, Mk=512, D=D, dtype=torch.bfloat16), const(bias))
    assert bool(gluon_calls) == (D != 64) and not any(c[2] for c in gluon_calls)  # listed: no masked launch
    assert bool(gluon_bwd_calls) == (Hl == 1 or Hq == Hkv)


def test_small_block_layouts_keep_the_triton_kernels(gluon_calls, gluon_bwd_calls, triton_options):
    """A block layout in a call of fewer than ``gluon_layout_min_scores`` scores stays on the ``triton.language``
    kernels, forward and backward; from that size on it takes the Gluon ones."""
    layout = torch.ones(1, 1, 4, 4, dtype=torch.bool, device="cuda").tril()
    args = qkv(B=2, Hq=2, Hkv=2, Mq=512, Mk=512, D=128, dtype=torch.bfloat16)
    n = 2 * 2 * 512 * 512
    triton_options(gluon_layout_min_scores=n + 1)
    check(*args, const(ba.BlockSparseMask(layout, 128)))
    assert gluon_calls == [] and gluon_bwd_calls == []
    triton_options(gluon_layout_min_scores=n)
    check(*args, const(ba.BlockSparseMask(layout, 128)))
    assert gluon_calls and gluon_bwd_calls


@pytest.mark.parametrize("case", ["none", "causal", "window", "padded", "packed_causal", "packed_rect"])
def test_backward_at_head_dim_64_matches_the_reference(gluon_calls, gluon_bwd_calls, case):
    """At head dim 64 the forward keeps the ``triton.language`` kernel and the backward runs in Gluon, one dQ
    piece a tile per warpgroup (its staging buffers alternating by tile)."""
    B, M, bias = 2, 384, None
    Mk = M
    if case == "causal":
        bias = ba.LowerTriangularMask()
    elif case == "window":
        bias = ba.LocalAttentionMask(window_left=100, window_right=64)
    elif case == "padded":
        bias = ba.PaddedKeysMask([100, 384], device="cuda")
    elif case.startswith("packed"):
        bias, B, M, Mk = _mask(case, "cuda")
    check(*qkv(B=B, Hq=4, Hkv=2, Mq=M, Mk=Mk, D=64, dtype=torch.bfloat16), const(bias))
    assert gluon_calls == [] and bool(gluon_bwd_calls) == (M % 4 == 0)


@pytest.mark.parametrize("waves", [0, 1, 8], ids=["plain_order", "last_pairs_by_rank", "all_pairs_by_rank"])
def test_programs_started_rank_by_rank_keep_results(gluon_calls, gluon_bwd_calls, triton_options, monkeypatch, waves):
    """Under a causal mask the Gluon forward (D=128) and backward (D=64) start their last pairs' tiles rank by
    rank (``order_tail_waves``); every order writes the same results. A window keeps the plain order."""
    from biasattn.ops.triton import gluon_backward, gluon_forward

    triton_options(order_tail_waves=waves)
    chunks = set()
    for module, name in ((gluon_forward, "attn_fwd"), (gluon_backward, "attn_bwd")):
        real = getattr(module, name)
        chunk_of = inspect.signature(real).bind
        monkeypatch.setattr(module, name, lambda q, *args, real=real, name=name, chunk_of=chunk_of: chunks.add(
            (name, q.shape[-1], chunk_of(q, *args).arguments.get("chunk", 1))) or real(q, *args))
    for D in (128, 64):
        check(*qkv(B=3, Hq=4, Hkv=2, Mq=640, Mk=640, D=D, dtype=torch.bfloat16), const(ba.LowerTriangularMask()))
    by_rank = waves > 0  # 5 tiles a pair: 12 query-head pairs in the forward, 6 KV-head pairs in the backward
    assert chunks == {("attn_fwd", 128, 12 if by_rank else 1), ("attn_bwd", 128, 1), ("attn_bwd", 64, 6 if by_rank else 1)}
    chunks.clear()
    check(*qkv(B=3, Hq=4, Hkv=2, Mq=640, Mk=640, D=128, dtype=torch.bfloat16),
          const(ba.LocalAttentionMask(window_left=100, window_right=0)))
    assert chunks == {("attn_fwd", 128, 1), ("attn_bwd", 128, 1)}


def test_backward_rows_not_a_multiple_of_four_keep_the_triton_kernels(gluon_calls, gluon_bwd_calls):
    """lse and delta rows go through TMA boxes per head, whose row stride must be a multiple of 16 bytes."""
    check(*qkv(B=1, Hq=2, Hkv=2, Mq=201, Mk=256, D=128, dtype=torch.bfloat16), const(ba.LowerTriangularMask()))
    assert gluon_calls and gluon_bwd_calls == []


def test_deterministic_runs_keep_the_triton_backward(gluon_calls, gluon_bwd_calls):
    """The Gluon backward adds dQ tiles in whatever order programs reach them: runs under
    ``torch.use_deterministic_algorithms`` take the ``triton.language`` backward, bit for bit the same."""
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Mq=512, Mk=512, D=128, dtype=torch.bfloat16)
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        grads = []
        for _ in range(2):
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            ba.attention(qq, kk, vv, ba.LowerTriangularMask(), op="triton").sum().backward()
            grads.append((qq.grad, kk.grad, vv.grad))
    finally:
        torch.use_deterministic_algorithms(saved)
    assert gluon_calls and gluon_bwd_calls == []
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_replayed_plan_keeps_its_kernels_and_asks_nothing(gluon_calls, gluon_bwd_calls, triton_options, monkeypatch):
    """A signature's launch plan records the kernels its calls took: replays do not ask again whether the Gluon
    kernels run, and a run under ``torch.use_deterministic_algorithms`` (another plan key) takes the
    ``triton.language`` backward instead of the Gluon plan, bit for bit repeatable."""
    from biasattn.ops.triton import flash, flash_bwd

    triton_options(plans=True)
    asked = []
    for module in (flash, flash_bwd):
        real = module._gluon_runs
        monkeypatch.setattr(module, "_gluon_runs", lambda *a, real=real, **kw: asked.append(1) or real(*a, **kw))
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Mq=512, Mk=512, D=128, dtype=torch.bfloat16)

    def grads():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        ba.attention(qq, kk, vv, ba.LowerTriangularMask(), op="triton").sum().backward()
        return qq.grad, kk.grad, vv.grad

    for _ in range(5):
        grads()
    assert len(gluon_calls) == 3 and len(gluon_bwd_calls) == 3 and len(asked) == 6
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        runs = [grads() for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(saved)
    assert len(gluon_bwd_calls) == 3
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_repeated_calls_launch_the_compiled_kernels_directly(gluon_calls, gluon_bwd_calls, causal):
    """The second call of a signature skips Triton's binding (``launch.direct``) in both Gluon kernels and
    gives what the first gave: the same output and dK/dV, dQ apart only by the order of its additions."""
    from biasattn.ops.triton import gluon_backward, gluon_forward

    q, k, v = qkv(B=2, Hq=4, Hkv=2, Mq=384, Mk=384, D=128, dtype=torch.bfloat16)
    dout = torch.randn(2, 4, 384, 128, device=q.device, dtype=q.dtype)
    bias = ba.LowerTriangularMask() if causal else None
    runs, hits = [], []
    for _ in range(3):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = ba.attention(qq, kk, vv, bias, op="triton")
        runs.append((out, *torch.autograd.grad(out, (qq, kk, vv), dout)))
        hits.append((gluon_forward._launch_fwd.hits, gluon_backward._launch_bwd.hits))
    assert len(gluon_calls) == 3 and len(gluon_bwd_calls) == 3
    assert hits[2][0] > hits[0][0] and hits[2][1] > hits[0][1]
    out, dq, dk, dv = runs[0]
    assert torch.equal(runs[2][0], out) and torch.equal(runs[2][2], dk) and torch.equal(runs[2][3], dv)
    a, b = runs[2][1].float(), dq.float()
    assert bool(((a - b).abs() <= 2**-7 * torch.maximum(a.abs(), b.abs()) + 1e-5 * b.abs().max()).all())


@pytest.mark.parametrize("D", [128, 256])
def test_calls_of_one_signature_replay_a_launch_plan(gluon_calls, gluon_bwd_calls, triton_options, D):
    """From the fourth call of a signature both Gluon kernels replay a launch plan (their launchers run for the
    first three calls only), and every replay, with a fresh mask of new lengths and window and a new scale,
    matches the reference."""
    triton_options(plans=True)
    B, H, M = 2, 4, 384
    gen = torch.Generator().manual_seed(0)
    q, k, v = qkv(B=B, Hq=H, Hkv=H, Mq=M, Mk=M, D=D, dtype=torch.bfloat16)
    for step in range(5):
        lens = torch.randint(M // 2, M + 1, (B,), generator=gen).to(device="cuda", dtype=torch.int32)
        bias = ba.LocalAttentionMask(window_left=100 + 40 * step, window_right=0) & ba.PaddedKeysMask(lens)
        check(q, k, v, const(bias), scale=0.05 + 0.01 * step, use_dlse=False)
    assert len(gluon_calls) == 3 and len(gluon_bwd_calls) == 3


def test_fresh_documents_replay_a_launch_plan(gluon_calls, gluon_bwd_calls, triton_options):
    """Packed documents built every step from a device tensor of new lengths share one launch plan: from the
    fourth call both Gluon kernels replay it with the new lengths and tile tables, and every step matches the
    reference (documents starting off the 64-row grid included)."""
    triton_options(plans=True)
    M = 512
    gen = torch.Generator().manual_seed(1)
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Mq=M, Mk=M, D=128, dtype=torch.bfloat16)
    for _ in range(5):
        cuts = torch.randint(1, M, (2,), generator=gen).sort().values.tolist()
        lens = torch.tensor([cuts[0], cuts[1] - cuts[0], M - cuts[1]], dtype=torch.int32, device="cuda")
        bias = ba.BlockDiagonalMask.from_seqlens(lens).make_causal()
        check(q, k, v, const(bias), use_dlse=False)
    assert len(gluon_calls) == 3 and len(gluon_bwd_calls) == 3


def _reference(q, k, v, mask):
    """``(float64, low precision)`` math-SDPA outputs under a dense boolean ``mask``."""
    with sdpa_kernel(SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
        low = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return ref, low


@pytest.mark.parametrize("D", [128, 256])
def test_causal_hidden_nan_values_reach_no_row_that_cannot_see_them(gluon_calls, D):
    """A NaN in the last key's value is hidden from every row but the last: the Gluon forward marks the
    rows it reached and the exact pass computes them again, as the ``triton.language`` path does."""
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Mq=512, Mk=512, D=D, dtype=torch.bfloat16)
    v[:, :, -1] = float("nan")
    out = ba.attention(q, k, v, ba.LowerTriangularMask(), op="triton")
    assert gluon_calls
    assert torch.isnan(out[:, :, -1]).all()
    seen = v.clone()
    seen[:, :, -1] = 0.0  # the other rows compute the same function with any value there
    ref, low = _reference(q, k, seen, torch.ones(512, 512, dtype=torch.bool, device="cuda").tril())
    assert_close("out", out[:, :, :-1], ref[:, :, :-1], low[:, :, :-1])


@pytest.mark.parametrize("D", [128, 256])
@pytest.mark.parametrize("case", ["padded", "packed"])
def test_keys_no_row_sees_may_hold_nan(gluon_calls, case, D):
    """Keys past a length or of a document without queries (an uninitialized cache) may hold NaN in K and
    V: no output takes it, though the kernel reads such keys with the tiles around them."""
    M = 384
    keys = torch.arange(M, device="cuda")
    if case == "padded":
        B, lengths = 2, torch.tensor([130, 300], device="cuda")
        bias = ba.PaddedKeysMask(lengths)
        mask = (keys[None, :] < lengths[:, None])[:, None, None, :].expand(B, 1, M, M)
        hidden = keys[None, :] >= lengths[:, None]
    else:  # the second document has keys but no queries
        B = 1
        bias = ba.BlockDiagonalMask.from_seqlens([150, 0, 234], [150, 100, 134], device="cuda")
        doc_q = (keys >= 150).long() * 2
        doc_k = (keys >= 150).long() + (keys >= 250).long()
        mask = (doc_q[:, None] == doc_k[None, :])[None, None]
        hidden = (doc_k == 1)[None]
    q, k, v = qkv(B=B, Hq=2, Hkv=2, Mq=M, Mk=M, D=D, dtype=torch.bfloat16)
    k[hidden[:, None].expand_as(k[..., 0])] = float("nan")
    v[hidden[:, None].expand_as(v[..., 0])] = float("nan")
    out = ba.attention(q, k, v, bias, op="triton")
    assert gluon_calls
    seen = (~hidden)[:, None, :, None]
    ref, low = _reference(q, torch.where(seen, k, 0.0), torch.where(seen, v, 0.0), mask)
    assert_close("out", out, ref, low)


def _check_hidden_nan_gradients(q, k, v, bias, mask, hidden, gluon_bwd_calls, seed: int) -> None:
    """Put NaN in K and V where ``hidden`` (keys no row sees), run the Gluon backward and check: the gradients are
    those of the clean keys (``mask`` the visible pairs), and dK, dV of the hidden keys are exactly 0."""
    k, v = (torch.where(hidden, float("nan"), t) for t in (k, v))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    ba.attention(qq, kk, vv, bias, op="triton").backward(do)
    assert gluon_bwd_calls
    ref, low, moved = _reference_gradients(q, k.nan_to_num(0.0), v.nan_to_num(0.0), bias, mask, do)
    for name, got, r, lo, factor, m in zip(("dq", "dk", "dv"), (qq.grad, kk.grad, vv.grad), ref, low, (3.0, 2.0, 2.0),
                                           moved):
        assert_close(name, got, r, lo, factor=factor, flash_err=m)
    assert (kk.grad[hidden.expand_as(kk.grad)] == 0).all() and (vv.grad[hidden.expand_as(vv.grad)] == 0).all()


@pytest.mark.parametrize("D", [128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["padded", "padded_causal"])
def test_backward_keys_no_row_sees_may_hold_nan(gluon_calls, gluon_bwd_calls, causal, D):
    """NaN in K and V past the key lengths reaches no gradient: dK and dV of those keys are 0, dQ is that of
    the keys the rows see."""
    B, M = 3, 384
    lengths = torch.tensor([130, 0, 300], device="cuda")
    bias = ba.PaddedKeysMask(lengths)
    keys = torch.arange(M, device="cuda")
    mask = (keys[None, :] < lengths[:, None])[:, None, None, :].expand(B, 1, M, M)
    if causal:
        bias = bias & ba.LowerTriangularMask().to("cuda")
        mask = mask & torch.ones(M, M, dtype=torch.bool, device="cuda").tril()
    hidden = (keys[None, :] >= lengths[:, None])[:, None, :, None]
    q, k, v = qkv(B=B, Hq=4, Hkv=2, Mq=M, Mk=M, D=D, dtype=torch.bfloat16)
    _check_hidden_nan_gradients(q, k, v, bias, mask, hidden, gluon_bwd_calls, seed=100)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_backward_documents_without_queries_may_hold_nan(gluon_calls, gluon_bwd_calls, D):
    """NaN in K and V of a document that has keys but no queries reaches no gradient: its dK and dV are 0, and
    the other documents' gradients are those of the keys they see."""
    M = 384
    bias = ba.BlockDiagonalMask.from_seqlens([150, 0, 234], [150, 100, 134], device="cuda")
    keys = torch.arange(M, device="cuda")
    doc_q = (keys >= 150).long() * 2
    doc_k = (keys >= 150).long() + (keys >= 250).long()
    mask = (doc_q[:, None] == doc_k[None, :])[None, None]
    hidden = (doc_k == 1)[None, None, :, None]
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Mq=M, Mk=M, D=D, dtype=torch.bfloat16)
    _check_hidden_nan_gradients(q, k, v, bias, mask, hidden, gluon_bwd_calls, seed=101)


@pytest.mark.parametrize("which", ["key", "value"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("case", ["causal", "window"])
@pytest.mark.parametrize("D", [128, 256])
def test_backward_a_hidden_key_or_value_reaches_no_row_that_cannot_see_it(gluon_calls, gluon_bwd_calls, case, value,
                                                                          which, D):
    """A NaN or inf in a key or value that the band hides from some rows leaves their dQ as with the clean
    inputs: dS is 0 where P is, and K's non-finite elements are zeroed for ``dS K`` (tests/test_poison.py
    holds the ``triton.language`` kernels to the same rule)."""
    M, j = 384, 200
    i, jj = torch.arange(M, device="cuda")[:, None], torch.arange(M, device="cuda")[None, :]
    if case == "causal":
        bias, mask = ba.LowerTriangularMask(), jj <= i
    else:
        bias, mask = ba.LocalAttentionMask(window_left=100, window_right=30), (jj - i >= -100) & (jj - i <= 30)
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Mq=M, Mk=M, D=D, dtype=torch.bfloat16)
    do = torch.randn(1, 4, M, D, device="cuda", dtype=torch.bfloat16)
    pk, pv = k.clone(), v.clone()
    (pk if which == "key" else pv)[:, :, j] = value
    leaves = [t.detach().requires_grad_() for t in (q, pk, pv)]
    out = ba.attention(*leaves, bias.to("cuda"), op="triton")
    (dq,) = torch.autograd.grad((torch.where(torch.isfinite(out), out, 0.0) * do).sum(), leaves[:1])
    assert gluon_bwd_calls
    rows = ~mask[:, j]  # the rows that cannot see key j
    ref, low, moved = _reference_gradients(q, k, v, bias.to("cuda"), mask[None, None], do)
    assert_close("dq", dq[:, :, rows], ref[0][:, :, rows], low[0][:, :, rows], factor=3.0, flash_err=moved[0])


def _reference_gradients(q, k, v, bias, mask, do):
    """``(float64 grads, bf16 grads, (moved dq, moved dk, 0))`` of math SDPA on finite ``q, k, v`` under the dense
    boolean ``mask`` (which ``bias`` expresses), against the output gradient ``do``; rows that see no key take
    no part. ``moved``: how far taking delta from the bf16 output moves dq and dk, as in every flash backward
    (test_triton.check)."""
    rows = mask.any(-1, keepdim=True)
    ref_mask, ref_do = mask | ~rows, torch.where(rows, do, 0.0)
    grads = []
    for dt in (torch.float64, torch.bfloat16):
        ins = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.MATH):
            o = torch.nn.functional.scaled_dot_product_attention(*ins, attn_mask=ref_mask, enable_gqa=True)
        grads.append(torch.autograd.grad(o, ins, ref_do.to(dt)))
    exact = [t.detach().double() for t in (q, k, v)]
    r_out, r_lse = ba.attention_with_lse(*exact, bias, op="reference")
    out = ba.attention(q, k, v, bias, op="triton")
    moved = _delta_rounding(q, exact[1], make_inputs(*exact, bias), r_out, r_lse, out, ref_do, None)
    return grads[0], grads[1], (moved[0], moved[1], 0.0)
