"""torch.compile: the custom ops, the bias flatten protocol, fullgraph tracing and dynamic shapes (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import biasattn as ba
from biasattn import ops
from biasattn.ops import custom_ops
from biasattn.ops.chunked import ChunkedOperator

F = torch.nn.functional
BACKEND = "aot_eager"  # Dynamo + AOTAutograd (functionalization, joint graph); inductor once below


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def qkv(B=2, Hq=4, Hkv=2, M=13, Mk=None, D=8, requires_grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    Mk = M if Mk is None else Mk
    q = torch.randn(B, Hq, M, D, generator=g)
    k = torch.randn(B, Hkv, Mk, D, generator=g)
    v = torch.randn(B, Hkv, Mk, D, generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def compiled(fn, **kwargs):
    cnt = torch._dynamo.testing.CompileCounterWithBackend(kwargs.pop("backend", BACKEND))
    return torch.compile(fn, fullgraph=True, backend=cnt, **kwargs), cnt


def grads(out, tensors):
    return torch.autograd.grad(out.square().sum(), tensors, allow_unused=True)


def assert_close_all(xs, ys):
    for x, y in zip(xs, ys):
        if x is None or y is None:
            assert x is None and y is None
        else:
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------ the custom ops


def test_opcheck_flat_ops():
    q, k, v = qkv(M=5, Mk=7)
    q = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # strided like a projection's view
    add = torch.randn(1, 4, 5, 7, requires_grad=True)
    bias = ba.AdditiveBias(add) + ba.LowerTriangularFromBottomRightMask()
    text, shape = custom_ops.bias_metadata(bias)
    tensors = custom_ops.inner_tensors(bias)
    fwd_args = (q, k, v, tensors, text, shape, None, 0.0, True, True, "")
    torch.library.opcheck(custom_ops.attention_fwd_flat, fwd_args)
    torch.library.opcheck(custom_ops.attention_fwd_flat, (q, k, v, [], "", [], 0.5, 0.0, True, False, "reference"))
    out, lse, state = custom_ops.attention_fwd_flat(*fwd_args)
    d = [t.detach() for t in (q, k, v, out, lse)]
    detached = [t.detach() for t in tensors]
    bwd_args = (torch.randn_like(out), torch.randn_like(lse), *d, state, detached, text, shape, None, 0.0, [True])
    torch.library.opcheck(custom_ops.attention_bwd_flat, bwd_args)


def test_a_backward_whose_state_lost_its_forward_dispatches_again():
    """A state tensor without the forward's attribute (a CUDA graph replayed from its recorded outputs
    hands the backward a new tensor object) gives the same gradients, the operator chosen again; with
    dropout it fails naming the probability, since the seed cannot be recovered."""
    q, k, v = qkv(B=1, M=9, Mk=9)
    mask = ba.BlockDiagonalMask.from_seqlens([4, 5]).make_causal()
    text, shape = custom_ops.bias_metadata(mask)
    tensors = custom_ops.inner_tensors(mask)
    out, lse, state = custom_ops.attention_fwd_flat(q, k, v, tensors, text, shape, None, 0.0, True, False, "")
    d = [t.detach() for t in (q, k, v, out)]
    dout = torch.randn_like(out)
    args = (dout, None, *d, lse, state, tensors, text, shape, None, 0.0, [False, False, False])
    kept = custom_ops.attention_bwd_flat(*args)
    bare = torch.empty(0, dtype=torch.int64)
    again = custom_ops.attention_bwd_flat(*args[:7], bare, *args[8:])
    for a, b in zip(kept[:3], again[:3]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="dropout_p=0.5"):
        custom_ops.attention_bwd_flat(*args[:7], bare, *args[8:12], 0.5, args[13])

@pytest.mark.parametrize("backend", [BACKEND, "inductor"])
def test_compiled_backward_reuses_what_its_forward_lowered(monkeypatch, backend):
    """The compiled backward takes the bias its forward lowered (tile tables and all) instead of lowering
    it again; with a bias gradient to compute it rebuilds the bias. Gradients equal eager ones either way."""
    from biasattn.bias import spec as spec_module

    lowered = []
    real = spec_module._lower_new
    monkeypatch.setattr(spec_module, "_lower_new", lambda *a: lowered.append(1) or real(*a))
    q, k, v = qkv(B=1, M=12)
    add = torch.randn(1, 4, 12, 12, requires_grad=True)
    cfn, _ = compiled(lambda q, k, v, lens, add: ba.attention(
        q, k, v, ba.BlockDiagonalMask.from_seqlens(lens).make_causal() + add, op="chunked"), backend=backend)
    for lens, with_add in (([3, 9], False), ([5, 7], False), ([6, 6], True)):
        a = add if with_add else add.detach()
        wrt = (q, k, v, a) if with_add else (q, k, v)
        expected = grads(ba.attention(q, k, v, ba.BlockDiagonalMask.from_seqlens(lens).make_causal() + a), wrt)
        lowered.clear()
        out = cfn(q, k, v, torch.tensor(lens), a)
        forward = len(lowered)
        got = grads(out, wrt)
        assert forward == 1 and len(lowered) == 1 + with_add, (lens, forward, len(lowered))
        assert_close_all(got, expected)


def test_compiled_layers_sharing_a_mask_lower_it_once_per_step(monkeypatch):
    """Three layers given one mask inside a compiled function lower it once per step, as eager layers
    given one mask object do; each step's new lengths are lowered anew, and outputs equal eager ones."""
    from biasattn.bias import spec as spec_module

    lowered = []
    real = spec_module._lower_new
    monkeypatch.setattr(spec_module, "_lower_new", lambda *a: lowered.append(1) or real(*a))

    def layers(q, k, v, lens):
        mask = ba.BlockDiagonalMask.from_seqlens(lens).make_causal()
        for _ in range(3):
            q = ba.attention(q, k, v, mask, op="chunked")
        return q

    q, k, v = qkv(B=1, Hkv=4, M=12)
    cfn, cnt = compiled(layers, backend="inductor", dynamic=True)
    frames = []
    for lens in ([3, 9], [5, 7], [2, 4, 6]):
        expected = grads(layers(q, k, v, torch.tensor(lens)), (q, k, v))
        lowered.clear()
        out = cfn(q, k, v, torch.tensor(lens))
        assert len(lowered) == 1, (lens, len(lowered))
        assert_close_all(grads(out, (q, k, v)), expected)
        frames.append(cnt.frame_count)
    assert frames[0] == frames[-1]  # new lengths, no new graph


def test_rebuilt_biases_are_shared_only_while_their_tensors_are_unmodified():
    """The forward op reuses the bias rebuilt from the same length tensors, never after an in-place write
    to one of them, and never for an additive (floating-point) tensor."""
    mask = ba.BlockDiagonalMask.from_seqlens(torch.tensor([3, 9])).make_causal()
    text, shape = custom_ops.bias_metadata(mask)
    tensors = custom_ops.inner_tensors(mask)
    first = custom_ops.shared_bias(tensors, text, shape)
    assert custom_ops.shared_bias(tensors, text, shape) is first
    tensors[0].add_(0)
    assert custom_ops.shared_bias(tensors, text, shape) is not first
    additive = ba.AdditiveBias(torch.randn(1, 1, 4, 4))
    text, shape = custom_ops.bias_metadata(additive)
    tensors = custom_ops.inner_tensors(additive)
    assert custom_ops.shared_bias(tensors, text, shape) is not custom_ops.shared_bias(tensors, text, shape)


def test_opcheck_ops_taking_the_bias():
    """The ops called with the lazy bias itself (routed by AttentionBias.__torch_dispatch__) and with None."""
    q, k, v = qkv(M=5)
    bias = ba.PaddedKeysMask([3, 5]) & ba.LowerTriangularMask()
    tensors = custom_ops.inner_tensors(bias)
    for b, ts in ((bias, tensors), (None, [])):
        args = (q, k, v, b, ts, None, 0.0, True, False, "")
        torch.library.opcheck(custom_ops.attention_fwd, args)
        out, lse, state = custom_ops.attention_fwd(*args)
        d = [t.detach() for t in (q, k, v)]
        bwd = (torch.randn_like(out), None, *d, b, ts, out.detach(), lse.detach(), state, None, 0.0, [False] * len(ts))
        torch.library.opcheck(custom_ops.attention_bwd, bwd)


def test_bias_metadata_round_trip():
    bias = (ba.BlockDiagonalMask.from_seqlens([2, 3], [4, 1]).make_causal_from_bottom_right())[..., 1:4, :]
    text, shape = custom_ops.bias_metadata(bias)
    again = custom_ops.rebuild_bias(custom_ops.inner_tensors(bias), text, shape)
    assert type(again) is type(bias) and again.shape == bias.shape
    torch.testing.assert_close(again.materialize((1, 2, 3, 5)), bias.materialize((1, 2, 3, 5)))


def test_flatten_unflatten_round_trip():
    bias = ba.AdditiveBias(torch.randn(2, 1, 6, 6)) + ba.LocalAttentionMask(2)
    names, ctx = bias.__tensor_flatten__()
    again = type(bias).__tensor_unflatten__({n: getattr(bias, n) for n in names}, ctx, bias.shape, bias.stride())
    assert again.__tensor_flatten__()[1] == ctx
    torch.testing.assert_close(again.materialize((2, 3, 6, 6)), bias.materialize((2, 3, 6, 6)))
    # made once per bias (compiled calls flatten every bias argument in their guards), handed out as a new list
    names.append("_t9")
    assert bias.__tensor_flatten__() == (names[:-1], ctx) and bias.__tensor_flatten__()[1] is ctx


# ------------------------------------------------------------------------------------ fullgraph


def _causal_inside(q, k, v):
    return ba.attention(q, k, v, ba.LowerTriangularMask())


def _block_diagonal_inside(q, k, v):
    bias = ba.BlockDiagonalMask.from_seqlens([4, 9]).make_causal()
    return ba.attention(q, k, v, bias)


def _bias_argument(q, k, v, bias):
    return ba.attention(q, k, v, bias & ba.LowerTriangularMask())


def _sdpa(q, k, v, bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=True, enable_gqa=True)


def _with_lse(q, k, v, bias):
    out, lse = ba.attention_with_lse(q, k, v, bias)
    return out * lse.exp()[..., None]


@pytest.mark.parametrize(
    "fn, make_bias, B",
    [
        (_causal_inside, None, 2),
        (_block_diagonal_inside, None, 1),
        (_bias_argument, lambda: ba.PaddedKeysMask([9, 13]), 2),
        (_sdpa, lambda: ba.PaddedKeysMask([9, 13]), 2),
        (_with_lse, lambda: ba.LocalAttentionMask(3, 1), 2),
    ],
    ids=["causal-inside", "block-diagonal-inside", "bias-argument", "sdpa", "with-lse"],
)
def test_compiled_matches_eager(fn, make_bias, B):
    q, k, v = qkv(B=B)
    args = (q, k, v) if make_bias is None else (q, k, v, make_bias())
    cfn, cnt = compiled(fn)
    out = cfn(*args)
    ref = fn(*args)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert_close_all(grads(out, (q, k, v)), grads(ref, (q, k, v)))
    assert cnt.frame_count == 1


def test_compiled_call_without_a_bias_holds_the_flat_op_only():
    """A call without a bias compiles to the flat op itself (one op at run time, not an op calling
    another), and matches eager with its gradients."""
    q, k, v = qkv()
    cfn, cnt = compiled(lambda q, k, v: ba.attention(q, k, v))
    out = cfn(q, k, v)
    targets = {n.target for g in cnt.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert torch.ops.biasattn.attention_fwd_flat.default in targets
    assert torch.ops.biasattn.attention_fwd.default not in targets
    ref = ba.attention(q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert_close_all(grads(out, (q, k, v)), grads(ref, (q, k, v)))


def test_additive_bias_gradient_compiled():
    """Gradients reach an additive tensor through the compiled path (it is passed to the op explicitly)."""
    q, k, v = qkv(requires_grad=False)
    table = torch.randn(1, 4, 13, 13, requires_grad=True)

    def fn(q, k, v, table):
        return ba.attention(q, k, v, ba.AdditiveBias(table) + ba.LowerTriangularMask())

    cfn, _ = compiled(fn)
    (g,) = grads(cfn(q, k, v, table), (table,))
    (ref,) = grads(fn(q, k, v, table), (table,))
    torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)


def test_no_graph_breaks():
    q, k, v = qkv()
    explanation = torch._dynamo.explain(_causal_inside)(q, k, v)
    assert explanation.graph_count == 1
    assert explanation.graph_break_count == 0


@pytest.mark.parametrize(
    "make", [lambda M: None, lambda M: ba.AdditiveBias(torch.randn(1, 4, M, M))], ids=["causal-inside", "additive-argument"]
)
def test_dynamic_no_recompile_for_new_length(make):
    def fn(q, k, v, bias):
        causal = ba.LowerTriangularMask()
        return ba.attention(q, k, v, causal if bias is None else bias + causal)

    cfn, cnt = compiled(fn, dynamic=True)
    frames = []
    for M in (5, 11, 17):
        q, k, v = qkv(M=M, requires_grad=False)
        bias = make(M)
        torch.testing.assert_close(cfn(q, k, v, bias), fn(q, k, v, bias), atol=1e-5, rtol=1e-5)
        frames.append(cnt.frame_count)
    assert frames[1:] == frames[:1] * 2  # compiled once, never again for a new sequence length


def test_block_diagonal_argument_new_lengths():
    """A packed batch passed in works for new lengths (its host lengths are guarded: one compile per layout)."""
    cfn, _ = compiled(lambda q, k, v, bias: ba.attention(q, k, v, bias.make_causal()))
    for lengths in ([4, 9], [1, 7, 5]):
        q, k, v = qkv(B=1, requires_grad=False)
        bias = ba.BlockDiagonalMask.from_seqlens(lengths)
        torch.testing.assert_close(cfn(q, k, v, bias), ba.attention(q, k, v, bias.make_causal()))


def test_block_diagonal_from_symbolic_lengths():
    """Lengths computed from q's (symbolic) size under dynamic=True specialize instead of failing to serialize."""
    def fn(q, k, v):
        return ba.attention(q, k, v, ba.BlockDiagonalMask.from_seqlens([3, q.shape[2] - 3]))

    cfn, _ = compiled(fn, dynamic=True)
    for M in (8, 11):
        q, k, v = qkv(B=1, M=M, requires_grad=False)
        torch.testing.assert_close(cfn(q, k, v), ba.attention(q, k, v, ba.BlockDiagonalMask.from_seqlens([3, M - 3])))


def test_forced_operator_and_use_ops_inside_compiled_code():
    q, k, v = qkv(requires_grad=False)
    ref = ba.attention(q, k, v, ba.LowerTriangularMask(), op="reference")
    cfn, _ = compiled(lambda q, k, v: ba.attention(q, k, v, ba.LowerTriangularMask(), op="reference"))
    torch.testing.assert_close(cfn(q, k, v), ref)
    cfn, _ = compiled(_causal_inside)
    with ba.use_ops("reference"):
        torch.testing.assert_close(cfn(q, k, v), ref)
    with pytest.raises(ba.NotSupportedError):
        with ba.use_ops("cutlass"):  # chosen at run time: the restriction applies to compiled code too
            cfn(q, k, v)


def test_dropout_compiled_matches_eager_with_same_seed():
    q, k, v = qkv()

    def fn(q, k, v):
        return ba.attention(q, k, v, ba.LowerTriangularMask(), dropout_p=0.25)

    cfn, _ = compiled(fn)
    torch.manual_seed(7)
    out = cfn(q, k, v)
    g = grads(out, (q, k, v))
    torch.manual_seed(7)
    ref = fn(q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert_close_all(g, grads(ref, (q, k, v)))


class _ObjectCtxOperator(ChunkedOperator):
    """The chunked operator keeping a Python object between forward and backward (as vendor kernels do)."""

    NAME = "chunked_object_ctx"

    def fwd(self, inp):
        out, lse, seed = super().fwd(inp)
        return out, lse, {"seed": seed}

    def bwd(self, inp, out, lse, ctx, dout, dlse):
        return super().bwd(inp, out, lse, ctx["seed"], dout, dlse)


def test_operator_ctx_objects_reach_the_backward():
    op = ops.register(_ObjectCtxOperator())
    try:
        q, k, v = qkv()
        fn = lambda q, k, v: ba.attention(q, k, v, ba.LowerTriangularMask(), op=op.NAME)  # noqa: E731
        cfn, _ = compiled(fn)
        out = cfn(q, k, v)  # the ctx rides on the forward's state tensor (a backward without it would fail)
        assert_close_all(grads(out, (q, k, v)), grads(_causal_inside(q, k, v), (q, k, v)))
    finally:
        ops._REGISTRY.pop(op.NAME)


@pytest.mark.parametrize("backend", [BACKEND, "inductor"])
def test_outputs_laid_out_like_a_fused_projections_views(backend):
    """q, k, v viewed from one ``[B, M, 3, H, D]`` projection: the compiled call returns an output that keeps
    each row's heads side by side (the fake kernels and the real ones agree on those strides, whatever
    operator runs), with the eager call's values and gradients."""
    B, M, H, D = 2, 13, 4, 8

    def fn(qkv, bias):
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        return ba.attention(q, k, v, bias & ba.LowerTriangularMask())

    qkv_ = torch.randn(B, M, 3, H, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    bias = ba.PaddedKeysMask([9, 13])
    cfn, cnt = compiled(fn, backend=backend)
    out, ref = cfn(qkv_, bias), fn(qkv_, bias)
    assert out.transpose(1, 2).is_contiguous(), out.stride()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert_close_all(grads(out, (qkv_,)), grads(ref, (qkv_,)))
    assert cnt.frame_count == 1


def test_inductor_forward_and_backward():
    q, k, v = qkv()
    bias = ba.PaddedKeysMask([9, 13])
    cfn, cnt = compiled(_bias_argument, backend="inductor")
    out = cfn(q, k, v, bias)
    ref = _bias_argument(q, k, v, bias)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert_close_all(grads(out, (q, k, v)), grads(ref, (q, k, v)))
    assert cnt.frame_count == 1
