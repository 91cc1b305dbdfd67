"""The ``triton`` operator on the GPU at realistic sizes: odd lengths, D up to 256, fp16/bf16, GQA 8:1.

Same criterion as tests/test_triton.py (float64 reference, low-precision reference math, NaN-poisoned
outputs), plus cases whose tensors exceed 2**31 elements, checked on a slice of rows.
"""

from __future__ import annotations

import pytest
import torch
from test_triton import (  # noqa: F401  (_poison: autouse fixture)
    _Counting,
    _poison,
    assert_close,
    check,
    const,
    qkv,
    record_descriptors,
)

import biasattn as ba
from biasattn.ops.reference import softmax_attention
from biasattn.testing import poison_hidden_lines

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SIZES = [(1, 4097), (17, 17), (113, 1000), (1000, 113), (4097, 4097)]


@pytest.mark.parametrize("D", [64, 80, 128, 256])
@pytest.mark.parametrize("sizes", SIZES, ids=[f"{a}x{b}" for a, b in SIZES])
def test_sizes_causal_gqa_bf16(sizes, D):
    Mq, Mk = sizes
    check(*qkv(B=1, Hq=8, Hkv=1, Mq=Mq, Mk=Mk, D=D, dtype=torch.bfloat16), const(ba.LowerTriangularFromBottomRightMask()))


@pytest.mark.parametrize("dtype,D", [(torch.float16, 128), (torch.bfloat16, 64), (torch.float16, 256)])
@pytest.mark.parametrize("sizes", SIZES[1:], ids=[f"{a}x{b}" for a, b in SIZES[1:]])
def test_sizes_no_bias(sizes, dtype, D):
    Mq, Mk = sizes
    check(*qkv(B=2, Hq=8, Hkv=1, Mq=Mq, Mk=Mk, D=D, dtype=dtype), const(None))


@pytest.mark.parametrize("dims", [(24, 16), (64, 32), (16, 32)], ids=["24-16", "64-32", "16-32"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
def test_value_head_dim_unlike_the_key_head_dim(triton_options, dims, tma):
    """Dv != D in fp16 on every forward tile config, one-stage included, through pointers and
    descriptors (two tile dims once gave wrong outputs and illegal addresses on the H200), and the
    backward at the default tiles."""
    from biasattn.ops.triton import configs

    D, Dv = dims
    triton_options(descriptors=tma, descriptors_min_scores=0, plans=False)
    inputs = qkv(B=2, Hq=4, Hkv=2, Mq=33, Mk=47, D=D, Dv=Dv, dtype=torch.float16)
    for cfg in (*configs.candidates("fwd", 64), configs.TileConfig(128, 64, 4, 1)):
        with configs.override(fwd=cfg):
            check(*inputs, const(None), grads=False)
    check(*inputs, const(ba.LowerTriangularMask()))


def _layout(shape, density, seed=0):
    return (torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < density).cuda()


FEATURES = {
    "window": lambda M: const(ba.LocalAttentionMask(257, 3)),
    "padded": lambda M: const(ba.PaddedKeysMask([M, M // 2 + 1, 0], device="cuda")),
    "varlen_causal": lambda M: const(ba.BlockDiagonalMask.from_seqlens([1, 17, 113, M - 131], device="cuda").make_causal()),
    "varlen_local": lambda M: const(
        ba.BlockDiagonalMask.from_seqlens([M - 400, 0, 400], [300, 5, M - 305], device="cuda").make_local_attention(100, 7)
    ),
    "block_sparse_exact": lambda M: const(ba.BlockSparseMask(_layout((1, 8, -(-M // 128), -(-M // 128)), 0.3), 128)),
    "block_sparse_inexact": lambda M: const(ba.BlockSparseMask(_layout((3, 1, -(-M // 48), -(-M // 80)), 0.3), (48, 80))),
    "alibi_causal": lambda M: const(ba.ALiBi(ba.ALiBi.standard_slopes(8).cuda()) + ba.LowerTriangularMask().to("cuda")),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_features_bf16(feature):
    M = 1000
    B = 1 if feature.startswith("varlen") else 3
    check(*qkv(B=B, Hq=8, Hkv=1, Mq=M, Mk=M, D=128, dtype=torch.bfloat16), FEATURES[feature](M))


DROPOUT = {
    "none_gqa": (lambda M: const(None), 2),
    "causal_br": (lambda M: const(ba.LowerTriangularFromBottomRightMask()), 2),
    "varlen_causal": (FEATURES["varlen_causal"], 1),  # dK/dV key tiles off the 8-key grid
    "block_sparse": (FEATURES["block_sparse_exact"], 2),
}


@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 128), (torch.float16, 64)])
@pytest.mark.parametrize("case", list(DROPOUT))
def test_dropout(case, dtype, D):
    """Dropout at p = 0.17 against the float64 reference with the kernels' mask, forward and backward."""
    make, B = DROPOUT[case]
    M = 1000
    Mk = M if case == "varlen_causal" else M + 13
    check(*qkv(B=B, Hq=8, Hkv=2, Mq=M, Mk=Mk, D=D, dtype=dtype), make(M), dropout_p=0.17, seed=11)


def test_dropout_additive_gradient_bf16():
    add = torch.randn(1, 8, 500, 700, generator=torch.Generator().manual_seed(0)).cuda()
    check(*qkv(B=2, Hq=8, Hkv=8, Mq=500, Mk=700, D=64, dtype=torch.bfloat16), lambda a: ba.AdditiveBias(a), add,
          dropout_p=0.25, seed=12)


def test_dropout_seeds_reuse_the_compiled_launch():
    """A new seed per call goes through the direct launch path: seeds are arguments, not part of its key."""
    from biasattn.ops.triton import flash

    q, k, v = qkv(B=1, Hq=4, Hkv=4, Mq=256, Mk=256, D=64, dtype=torch.bfloat16)
    ba.attention(q, k, v, op="triton", dropout_p=0.1)
    hits, size = flash._fwd.hits, len(flash._fwd.table)
    outs = [ba.attention(q, k, v, op="triton", dropout_p=0.1) for _ in range(3)]
    assert flash._fwd.hits == hits + 3 and len(flash._fwd.table) == size
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("shape", [(1, 8, 1000, 1000), (2, 8, 1000, 1000), (1, 1, 1, 1000)], ids=["1HMM", "BHMM", "11_1M"])
def test_additive_gradient_bf16(shape):
    """``[1, H, M, M]`` broadcast over B (the benchmark's case), a full bias, and a key-padding bias."""
    add = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to("cuda", torch.bfloat16)
    check(*qkv(B=2, Hq=8, Hkv=1, Mq=1000, Mk=1000, D=128, dtype=torch.bfloat16), lambda a: ba.AdditiveBias(a), add)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_own_additive_gradient_with_masks(monkeypatch, dtype):
    """A bias slice per (batch row, head) under a causal band and padded keys: dQ comes back from dS."""
    from biasattn.ops.triton import flash_bwd

    launched = []
    monkeypatch.setattr(flash_bwd, "_dq_ds", _Counting(flash_bwd._dq_ds, launched))
    add = torch.randn((2, 8, 1000, 1013), generator=torch.Generator().manual_seed(7)).to("cuda", dtype)
    masks = ba.LowerTriangularFromBottomRightMask() & ba.PaddedKeysMask([1013, 517], device="cuda")
    check(*qkv(B=2, Hq=8, Hkv=2, Mq=1000, Mk=1013, D=128, dtype=dtype), lambda a: masks + ba.AdditiveBias(a), add)
    assert launched, "dQ was not read back from the bias gradient"


def _rows_check(q, k, v, add, out, lse, dq, dadd, dout, rows, head):
    """Reference (float64) and low-precision math on a slice of query rows of one head."""
    G = q.shape[1] // k.shape[1]
    hk = head // G
    qs = q[:, head : head + 1, rows].detach()
    ks, vs = k[:, hk : hk + 1].detach(), v[:, hk : hk + 1].detach()
    adds = None if add is None else add[:, head : head + 1 if add.shape[1] > 1 else 1, rows].detach()
    scale = q.shape[-1] ** -0.5
    results = {}
    for name, dt in (("ref", torch.float64), ("low", q.dtype)):
        qq = qs.to(dt).requires_grad_()
        aa = None if adds is None else adds.to(dt).requires_grad_()
        o, l = softmax_attention(qq, ks.to(dt), vs.to(dt), aa, scale, dt)
        wrt = [qq] + ([aa] if aa is not None else [])
        results[name] = (o, l, torch.autograd.grad(o, wrt, dout[:, head : head + 1, rows].to(dt)))
    (r_o, r_l, r_g), (l_o, l_l, l_g) = results["ref"], results["low"]
    assert_close("out", out[:, head : head + 1, rows], r_o, l_o)
    assert_close("lse", lse[:, head : head + 1, rows], r_l, l_l)
    assert_close("dq", dq[:, head : head + 1, rows], r_g[0], l_g[0], factor=3.0)
    if dadd is not None:
        assert_close("dadditive", dadd[:, head : head + 1, rows], r_g[1], l_g[1])


def test_q_beyond_2_31_elements():
    """q, out and dq with more than 2**31 elements: 64-bit offsets in the kernels."""
    B, H, Mq, Mk, D = 1, 16, 2**20 + 4099, 256, 128
    assert B * H * Mq * D > 2**31
    q = torch.randn(B, H, Mq, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(B, 2, Mk, D, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    out, lse = ba.attention_with_lse(q, k, v, ba.LowerTriangularFromBottomRightMask(), op="triton")
    dout = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, (q,), dout)
    rows = torch.cat([torch.arange(0, 64), torch.arange(Mq - 300, Mq)]).cuda()
    # bottom-right causal: row i sees keys j <= i + Mk - Mq, so only the last rows see any key
    qs, (ks, vs) = q, (k, v)
    bias_rows = ba.LowerTriangularFromBottomRightMask().materialize((1, 1, Mq, Mk), device="cuda")[:, :, rows]
    for head in (0, H - 1):
        hk = head // (H // 2)
        for name, dt in (("ref", torch.float64), ("low", torch.bfloat16)):
            qq = qs[:, head : head + 1, rows].detach().to(dt).requires_grad_()
            o, l = softmax_attention(qq, ks[:, hk : hk + 1].detach().to(dt), vs[:, hk : hk + 1].detach().to(dt),
                                     bias_rows.to(dt), D**-0.5, dt)
            g = torch.autograd.grad(o, qq, dout[:, head : head + 1, rows].to(dt))[0]
            if name == "ref":
                ref = (o, l, g)
            else:
                low = (o, l, g)
        assert_close("out", out[:, head : head + 1, rows], ref[0], low[0])
        assert_close("lse", lse[:, head : head + 1, rows], ref[1], low[1])
        assert_close("dq", dq[:, head : head + 1, rows], ref[2], low[2], factor=3.0)


def test_one_slice_beyond_2_31_elements():
    """A single (batch, head) slice of q past 2**31 elements: the kernels switch to 64-bit offsets."""
    B, H, Mq, Mk, D = 1, 1, 2**23 + 77, 64, 256
    assert Mq * D > 2**31
    q = torch.randn(B, H, Mq, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(B, H, Mk, D, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    out, lse = ba.attention_with_lse(q, k, v, op="triton")
    dout = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, (q,), dout)
    rows = torch.cat([torch.arange(0, 32), torch.arange(Mq - 100, Mq)]).cuda()
    _rows_check(q, k, v, None, out, lse, dq, None, dout, rows, 0)


def test_additive_beyond_2_31_elements():
    """An additive bias (and its gradient) with more than 2**31 elements."""
    B, H, M, D = 1, 8, 16400, 64
    assert H * M * M > 2**31
    add = torch.randn(B, H, M, M, device="cuda", dtype=torch.bfloat16).requires_grad_()
    q = torch.randn(B, H, M, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(B, H, M, D, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    out, lse = ba.attention_with_lse(q, k, v, ba.AdditiveBias(add), op="triton")
    dout = torch.randn_like(out)
    dq, dadd = torch.autograd.grad(out, (q, add), dout)
    rows = torch.arange(M - 50, M, device="cuda")
    _rows_check(q, k, v, add, out, lse, dq, dadd, dout, rows, H - 1)


SYNC_FREE = {
    "causal": lambda M: ba.LowerTriangularMask(),
    "window": lambda M: ba.LocalAttentionMask(257, 3),
    "padded": lambda M: ba.PaddedKeysMask([M, M // 2 + 1], device="cuda"),
    "varlen_causal": lambda M: ba.BlockDiagonalMask.from_seqlens([1, 17, 113, 2 * M - 131], device="cuda").make_causal(),
    "block_sparse": lambda M: ba.BlockSparseMask(_layout((1, 4, M // 128, M // 128), 0.3), 128),
    "alibi": lambda M: ba.ALiBi(ba.ALiBi.standard_slopes(4).cuda()),
    "additive": lambda M: ba.AdditiveBias(torch.randn(1, 4, M, M, device="cuda", dtype=torch.bfloat16)),
}


@pytest.mark.parametrize("name", list(SYNC_FREE))
def test_calls_never_wait_for_the_gpu(name):
    """After a first call, forward and backward queue their work without one synchronizing operation
    (CUDA's sync debug mode raises on any), so the host runs ahead of the GPU."""
    M = 512
    B = 1 if name == "varlen_causal" else 2
    Mq = 2 * M if name == "varlen_causal" else M
    q, k, v = (torch.randn(B, 4, Mq, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    bias = SYNC_FREE[name](M).to("cuda")  # built once: making a bias from host data may copy it to the GPU

    def call():
        out = ba.attention(q, k, v, bias, op="triton")
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):  # the recordings of the launch plans, then their replays
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_direct_launches_match_tritons_own():
    """Repeated launches call the compiled kernels directly, with the same results as ``kernel[grid]``."""
    from biasattn.ops.triton import flash, flash_bwd, launch, options

    assert launch._triton_run_matches(), "the installed Triton's launch path changed: direct launches are off"
    q, k, v = qkv(B=1, Hq=4, Hkv=2, Mq=300, Mk=300, D=64, dtype=torch.bfloat16)
    bias = ba.BlockDiagonalMask.from_seqlens([100, 200], device="cuda").make_causal()
    dout = torch.randn(1, 4, 300, 64, device="cuda", dtype=torch.bfloat16)

    def run():
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out = ba.attention(qg, kg, vg, bias, op="triton")
        return (out, *torch.autograd.grad(out, (qg, kg, vg), dout))

    run()
    hits = flash._fwd.hits + flash_bwd._dq.hits + flash_bwd._dkdv.hits
    direct = run()
    assert flash._fwd.hits + flash_bwd._dq.hits + flash_bwd._dkdv.hits >= hits + 3
    with options.use(direct_launch=False):
        plain = run()
    for a, b in zip(direct, plain):
        assert torch.equal(a, b)


def test_direct_launches_report_to_launch_hooks():
    """A launch hook (a profiler's) sees every direct launch with its metadata; without one, direct
    launches skip building that metadata."""
    from triton import knobs

    from biasattn.ops.triton import flash

    q, k, v = qkv(B=1, Hq=2, Hkv=2, Mq=200, Mk=200, D=64, dtype=torch.float16)
    ba.attention(q, k, v, ba.LowerTriangularMask(), op="triton")
    seen = []

    def hook(meta):
        seen.append(meta.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        hits = flash._fwd.hits
        ba.attention(q, k, v, ba.LowerTriangularMask(), op="triton")
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert flash._fwd.hits > hits and "_attn_fwd_kernel" in seen
    ba.attention(q, k, v, ba.LowerTriangularMask(), op="triton")
    assert seen.count("_attn_fwd_kernel") == 1


@pytest.mark.parametrize("name", list(SYNC_FREE))
def test_planned_launches_match_unplanned(triton_options, monkeypatch, name):
    """Once two calls of a signature are recorded, its launches are replayed from a plan (descriptors rebuilt
    for the call's K and V), bit for bit what the unplanned launches give."""
    from biasattn.ops.triton import plans

    M, B = 1024, 2
    Mq = 2 * M if name == "varlen_causal" else M
    B = 1 if name == "varlen_causal" else B
    bias = SYNC_FREE[name](M).to("cuda")
    replays = []
    real_run = plans.Plan.run
    monkeypatch.setattr(plans.Plan, "run", lambda self, roles: replays.append(len(roles)) or real_run(self, roles))

    def run(q, k, v, dout):
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out = ba.attention(qg, kg, vg, bias, op="triton")
        return (out, *torch.autograd.grad(out, (qg, kg, vg), dout))

    for call in range(6):
        tensors = [torch.randn(B, 4, Mq, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        before = len(replays)
        planned = run(*tensors)
        replayed = len(replays) - before
        triton_options(plans=False)
        plain = run(*tensors)
        triton_options(plans=True)
        for a, b in zip(planned, plain):
            assert torch.equal(a, b)
        if call >= 4:  # a first launch choosing configs, one marking the signature, two recordings, replays
            assert replayed == 2


@pytest.mark.parametrize("size", ["short", "long", "gluon"])
@pytest.mark.parametrize("name", ["causal", "window_padded"])
def test_forward_backward_in_a_cuda_graph(size, name):
    """A forward+backward captured in a CUDA graph replays to what eager calls give, on new inputs
    too; ``long`` backwards run dQ on a side stream, which the capture must take along. ``gluon`` lets
    the Gluon backward take the long call where it runs (sm_90): its dQ adds tiles in any order, so dQ
    may differ from the eager call's in its last bits."""
    from biasattn.bias.spec import lower
    from biasattn.ops.triton import flash_bwd, options

    B, H, M, D = (2, 4, 300, 64) if size == "short" else (16, 16, 2048, 128)
    bias = {"causal": ba.LowerTriangularMask(),
            "window_padded": ba.LocalAttentionMask(1000, 0) & ba.PaddedKeysMask([M] * (B - 1) + [M // 3])}[name].to("cuda")
    assert flash_bwd._long_backward(lower(bias, B, H, M, M), B, H, M, M, D) == (size != "short")
    q, k, v = (torch.randn(B, H, M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, M, D, device="cuda", dtype=torch.bfloat16)

    def call():
        out = ba.attention(q, k, v, bias, op="triton")
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    with options.use(gluon_backward=size == "gluon"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        for step in range(2):
            if step:
                with torch.no_grad():
                    for t in (q, k, v, dout):
                        t.copy_(torch.randn_like(t))
            graph.replay()
            eager = call()
            torch.cuda.synchronize()
            _assert_replayed(captured, eager, dq_any_order=size == "gluon")


def _assert_replayed(captured: tuple, eager: tuple, dq_any_order: bool) -> None:
    """``(out, dq, dk, dv)`` of a graph replay equal the eager call's; with ``dq_any_order`` (the Gluon backward adds
    dQ's tiles in any order) dQ's float32 sums may differ far below 1e-5 of the largest, one bf16 ulp once rounded."""
    for i, (a, b) in enumerate(zip(captured, eager)):
        if dq_any_order and i == 1:
            a, b = a.float(), b.float()
            tol = 2**-7 * torch.maximum(a.abs(), b.abs()) + 1e-5 * b.abs().max()
            assert bool(((a - b).abs() <= tol).all()), float((a - b).abs().max())
        else:
            assert torch.equal(a, b)


def test_packed_documents_forward_backward_in_a_cuda_graph():
    """Packed causal documents at the size the Gluon kernels take on sm_90, captured in a CUDA graph: replays
    after the memory freed since the capture went to other tensors, filled with garbage, still give what eager
    calls give, so the graph holds no pointer into memory it does not own (a tile table, a length, scratch)."""
    from biasattn.ops.triton import flash_bwd

    lens = [3000, 1, 2500, 4096, 777, 6010]
    bias = ba.BlockDiagonalMask.from_seqlens(lens, device="cuda").make_causal()
    H, M, D = 16, sum(lens), 128
    q, k, v = (torch.randn(1, H, M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, H, M, D, device="cuda", dtype=torch.bfloat16)

    def call():
        out = ba.attention(q, k, v, bias, op="triton")
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # the signature's plan settles
            call()
    torch.cuda.current_stream().wait_stream(side)
    gluon = flash_bwd._gluon_backward()._launch_bwd
    hits = gluon.hits
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    if torch.cuda.get_device_capability() == (9, 0):
        assert gluon.hits > hits, "the captured backward did not take the Gluon kernel"
    for _ in range(2):
        # blocks of every size class the allocator keeps, holding NaN as floats and -1 as offsets
        garbage = [torch.full((n,), -1, dtype=torch.int32, device="cuda") for n in (1, 64, 4096, 2**18, 2**22, 2**26)
                   for _ in range(8)]
        with torch.no_grad():
            for t in (q, k, v, dout):
                t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        del garbage
        eager = call()
        torch.cuda.synchronize()
        _assert_replayed(captured, eager, dq_any_order=True)


TMA_CASES = {
    "causal_gqa_d80": (dict(B=2, Hq=8, Hkv=1, Mq=1000, Mk=1000, D=80), lambda M: const(ba.LowerTriangularMask())),
    "padded_window": (dict(B=3, Hq=4, Hkv=2, Mq=113, Mk=4097, D=128),
                      lambda M: const(ba.PaddedKeysMask([M, 17, 0], device="cuda") & ba.LocalAttentionMask(300, 3))),
    "varlen_causal": (dict(B=1, Hq=4, Hkv=4, Mq=1000, Mk=1000, D=64),
                      lambda M: const(ba.BlockDiagonalMask.from_seqlens([1, 17, 113, 869], device="cuda").make_causal())),
    "block_sparse_d256": (dict(B=1, Hq=2, Hkv=1, Mq=517, Mk=517, D=256),
                          lambda M: const(ba.BlockSparseMask(_layout((1, 2, 5, 5), 0.5), 128))),
    "additive_dv": (dict(B=2, Hq=2, Hkv=2, Mq=300, Mk=301, D=128, Dv=64), None),
}


@pytest.mark.parametrize("layout", ["bhmd", "bmhd"])
@pytest.mark.parametrize("case", list(TMA_CASES))
def test_forward_through_tensor_descriptors(triton_options, monkeypatch, case, layout):
    """On Hopper the forward fetches K/V tiles through tensor descriptors; pointer loads give the same function."""
    from biasattn.ops.common import cuda_capability

    if cuda_capability(torch.device("cuda")) < (9, 0):
        pytest.skip("tensor descriptors need compute capability 9.0")
    sizes, make = TMA_CASES[case]
    q, k, v = qkv(**sizes, dtype=torch.bfloat16)
    if layout == "bmhd":  # [B, M, H, D] memory seen as [B, H, M, D]
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    add = torch.randn(1, sizes["Hq"], sizes["Mq"], sizes["Mk"], device="cuda") if make is None else None
    make_bias = ba.AdditiveBias if make is None else make(sizes["Mk"])
    triton_options(descriptors_min_scores=0)  # these small cases would keep pointer loads
    built = record_descriptors(monkeypatch)
    check(q, k, v, make_bias, add, grads=False)
    assert built and all(d is not None for d in built)
    triton_options(descriptors=False)
    check(q, k, v, make_bias, add, grads=False)
    assert built[-1] is None


HIDDEN_CASES = {
    "padded_prefill_gqa": (dict(B=3, Hq=8, Hkv=2, Mq=113, Mk=4097, D=128),
                           lambda: ba.PaddedKeysMask([4097, 1000, 17], device="cuda")
                           & ba.LowerTriangularFromBottomRightMask()),
    "padded_window_d64": (dict(B=2, Hq=4, Hkv=4, Mq=1000, Mk=1000, D=64),
                          lambda: ba.PaddedKeysMask([999, 130], device="cuda") & ba.LocalAttentionMask(257, 3)),
    "segments_causal": (dict(B=1, Hq=4, Hkv=1, Mq=1130, Mk=1269, D=128),
                        lambda: ba.BlockDiagonalMask.from_seqlens([1, 0, 113, 900, 116], [17, 139, 113, 1000, 0],
                                                                  device="cuda").make_causal_from_bottom_right()),
}


@pytest.mark.parametrize("tma", [True, False], ids=["descriptors", "pointers"])
@pytest.mark.parametrize("case", list(HIDDEN_CASES))
def test_hidden_lines_hold_nan(triton_options, monkeypatch, case, tma):
    """NaN in keys past the cache lengths and in lines outside every packed segment stays out of the
    output and of every gradient, with K/V through descriptors (Hopper) and through pointers."""

    triton_options(descriptors=tma)
    sizes, make = HIDDEN_CASES[case]
    q, k, v = poison_hidden_lines(*qkv(**sizes, dtype=torch.bfloat16), make())
    assert k.isnan().any()
    check(q, k, v, lambda a: make())
