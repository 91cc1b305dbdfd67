"""GPU tests of the vendor operators (``cutlass``, ``flash2``, ``cudnn``) against the float64 reference.

Every case lists the operators whose declarations cover it; each of them must accept it and match
the reference forward (out and lse) and backward (dq, dk, dv, and the bias gradient where the
operator computes it) within the dtype-relative criterion. Sizes are odd; hidden keys are poisoned
with NaN so a kernel that reads them fails; rows that see no key must give 0, lse -inf and no NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch._dynamo

import biasattn as ba
from biasattn import dispatch
from biasattn.inputs import make_inputs
from biasattn.ops import autograd
from biasattn.testing import assert_close_to_reference as _assert_close
from biasattn.testing import reference_attention

pytestmark = pytest.mark.gpu
DEV = "cuda"
ATOL = 1e-5


@dataclass
class Case:
    """One input family: shapes, a bias builder (given the additive tensor, if any) and the ops that declare it."""

    name: str
    ops: tuple[str, ...]
    B: int
    Hq: int
    Hkv: int
    Mq: int
    Mk: int
    D: int = 64
    bias: Callable | None = None
    additive: tuple | None = None  # shape of an additive tensor (passed to ``bias``)
    empty_rows: bool = False
    backward: tuple[str, ...] | None = None  # ops expected to support backward (default: all of ``ops``)
    hidden_keys: Callable | None = None  # bool [B, Mk]: keys no row may read (poisoned with NaN)


def assert_close_to_reference(out, ref, low, **kw):
    """The shared criterion, on CPU copies."""
    _assert_close(out.detach().cpu(), ref.detach().cpu(), None if low is None else low.detach().cpu(), **kw)


def _lens_mask(lens, Mk):
    return torch.arange(Mk)[None] >= torch.tensor(lens)[:, None]


CASES = [
    Case("none", ("cutlass", "flash2", "cudnn"), 2, 4, 4, 203, 203),
    Case("gqa_causal", ("cutlass", "flash2", "cudnn"), 2, 8, 2, 113, 113, 128, lambda a: ba.LowerTriangularMask()),
    Case("decode_gqa", ("cutlass", "flash2", "cudnn"), 3, 8, 2, 1, 777, 128),
    Case("causal_br_short_q", ("cutlass", "flash2"), 2, 4, 4, 17, 203, 64, lambda a: ba.LowerTriangularFromBottomRightMask()),
    Case("causal_tl_long_q", ("cutlass", "flash2"), 1, 4, 4, 203, 113, 64, lambda a: ba.LowerTriangularMask()),
    Case("causal_br_long_q", ("flash2",), 1, 4, 4, 203, 113, 64,
         lambda a: ba.LowerTriangularFromBottomRightMask(), empty_rows=True),
    Case("window", ("flash2",), 2, 4, 4, 203, 203, 64, lambda a: ba.LocalAttentionMask(31, 5)),
    Case("varlen_causal", ("cutlass", "flash2"), 1, 4, 4, 203, 203, 64,
         lambda a: ba.BlockDiagonalMask.from_seqlens([17, 113, 3, 70]).make_causal()),
    Case("varlen_kv", ("cutlass", "flash2"), 1, 4, 4, 62, 108, 64,
         lambda a: ba.BlockDiagonalMask.from_seqlens([5, 40, 17], [30, 1, 77])),
    Case("varlen_causal_br", ("flash2",), 1, 4, 4, 62, 108, 64,
         lambda a: ba.BlockDiagonalMask.from_seqlens([5, 40, 17], [30, 1, 77]).make_causal_from_bottom_right(),
         empty_rows=True),
    Case("padded", ("cutlass", "flash2"), 3, 4, 4, 113, 113, 64, lambda a: ba.PaddedKeysMask([50, 113, 1]),
         hidden_keys=lambda: _lens_mask([50, 113, 1], 113)),
    Case("padded_causal", ("cutlass",), 3, 4, 4, 113, 113, 64,
         lambda a: ba.PaddedKeysMask([50, 113, 7]) & ba.LowerTriangularMask(),
         hidden_keys=lambda: _lens_mask([50, 113, 7], 113)),
    Case("additive", ("cutlass", "cudnn"), 2, 4, 4, 113, 203, 64, lambda a: ba.AdditiveBias(a), (1, 4, 113, 203)),
    Case("additive_bcast_causal", ("cutlass", "cudnn"), 2, 4, 4, 113, 113, 64,
         lambda a: ba.LowerTriangularMask().to(a.device) + ba.AdditiveBias(a), (1, 1, 1, 113)),
    Case("head_dim_20", ("cutlass", "flash2"), 2, 4, 2, 113, 113, 20, lambda a: ba.LowerTriangularMask()),
]


def _make(case: Case, dtype, requires_grad: bool, seed: int = 0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(case.B, case.Hq, case.Mq, case.D, device=DEV, dtype=dtype, generator=gen)
    k = torch.randn(case.B, case.Hkv, case.Mk, case.D, device=DEV, dtype=dtype, generator=gen)
    v = torch.randn(case.B, case.Hkv, case.Mk, case.D, device=DEV, dtype=dtype, generator=gen)
    add = None
    if case.additive is not None:
        add = torch.randn(case.additive, device=DEV, dtype=dtype, generator=gen)
    return q, k, v, add


def _bias(case: Case, add):
    if case.bias is None:
        return None
    return case.bias(add)  # list-built masks follow q: their lengths stay on the host, where the vendor kernels read them


def _leaf(t, dtype=None, grad=True):
    if t is None:
        return None
    t = t.detach().to(dtype or t.dtype).clone()
    return t.requires_grad_(grad)


def _references(case, q, k, v, add, dtype, backward, dout, bias_grad):
    """``(outputs, gradients)`` in float64 and in ``dtype`` math (out, lse; dq, dk, dv, dadd)."""
    res = {}
    for name, cd in (("ref", torch.float64), ("low", dtype)):
        qq, kk, vv = (_leaf(t, cd, backward) for t in (q, k, v))
        aa = _leaf(add, cd, bias_grad) if add is not None else None
        bias = _bias(case, aa)
        dense = None
        if aa is not None:
            shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            masks = _bias(case, torch.zeros_like(aa)).materialize(shape, dtype=cd, device=DEV)
            dense = masks + aa
        out, lse = reference_attention(qq, kk, vv, bias, compute_dtype=cd, bias_dense=dense)
        grads = None
        if backward:
            wrt = [qq, kk, vv] + ([aa] if bias_grad else [])
            grads = torch.autograd.grad(out, wrt, dout.to(cd))
        res[name] = (out, lse, grads)
    return res


def _check_case(case: Case, op: str, dtype, poison: bool = True):
    backward_ops = case.ops if case.backward is None else case.backward
    backward = op in backward_ops
    q, k, v, add = _make(case, dtype, backward)
    bias_grad = backward and add is not None and op == "cutlass"
    dout = torch.randn(case.B, case.Hq, case.Mq, case.D, device=DEV, dtype=dtype)
    refs = _references(case, q, k, v, add, dtype, backward, dout, bias_grad)

    qq, kk, vv = (_leaf(t, None, backward) for t in (q, k, v))
    if poison and case.hidden_keys is not None:  # NaN where no row may read
        hidden = case.hidden_keys().to(DEV)[:, None, :, None]
        kk = kk.detach().masked_fill(hidden, float("nan")).requires_grad_(backward)
        vv = vv.detach().masked_fill(hidden, float("nan")).requires_grad_(backward)
    aa = _leaf(add, None, bias_grad) if add is not None else None
    bias = _bias(case, aa)
    inp = make_inputs(qq, kk, vv, bias, requires_grad=backward)
    if op == "auto":
        fwd_op, bwd_op = dispatch.choose(inp)
    else:
        fwd_op = ba.ops.get(op)
        why = fwd_op.not_supported_reasons(inp, backward=backward)
        assert not why, f"{op} declares {case.name} but refuses it: {why}"
        bwd_op = fwd_op if backward else None
    out, lse = autograd.run(inp, fwd_op, bwd_op)
    ref_out, ref_lse, ref_grads = refs["ref"]
    low_out, low_lse, low_grads = refs["low"]
    assert_close_to_reference(out, ref_out, low_out, atol=ATOL, name=f"{op} {case.name} out")
    assert_close_to_reference(lse, ref_lse, low_lse, atol=ATOL, name=f"{op} {case.name} lse")
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (case.B, case.Hq, case.Mq)
    if case.empty_rows:
        empty = torch.isneginf(ref_lse)
        assert bool(empty.any()), "the case should have rows that see no key"
        assert bool((out[empty] == 0).all()) and bool(torch.isneginf(lse[empty]).all())
    # the output alone (ba.attention without gradients): operators may skip the lse there
    plain = make_inputs(qq.detach(), kk.detach(), vv.detach(), bias, requires_grad=False)
    only, no_lse = autograd.run(plain, fwd_op, None, need_lse=False)
    assert no_lse is None
    assert_close_to_reference(only, ref_out, low_out, atol=ATOL, name=f"{op} {case.name} out without lse")
    if case.empty_rows:
        assert bool((only[torch.isneginf(ref_lse)] == 0).all())
    if not backward:
        return
    wrt = [qq, kk, vv] + ([aa] if bias_grad else [])
    # with and without the lse: a training call that needs no lse may take PyTorch's own gradient
    out_alone, _ = autograd.run(inp, fwd_op, bwd_op, need_lse=False)
    for how, o in (("with lse", out), ("without lse", out_alone)):
        got = torch.autograd.grad(o, wrt, dout)
        names = ["dq", "dk", "dv", "dbias"]
        for n, g, r, lo in zip(names, got, ref_grads, low_grads):
            if case.hidden_keys is not None and n in ("dk", "dv"):
                hidden = case.hidden_keys().to(DEV)[:, None, :, None].expand_as(g)
                assert bool((g[hidden] == 0).all()), f"{n} of hidden keys must be 0"
            factor = 3.0 if n in ("dq", "dbias") else 2.0
            assert_close_to_reference(g, r, lo, factor=factor, atol=ATOL, name=f"{op} {case.name} {n} ({how})")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("op", ["cutlass", "flash2", "cudnn"])
def test_vendor_matches_reference(case, op):
    """Each vendor operator matches the float64 reference, forward and backward, on every case it declares."""
    if op not in case.ops:
        pytest.skip(f"{op} does not declare {case.name}")
    _check_case(case, op, torch.bfloat16)


@pytest.mark.parametrize("op", ["flash2", "cudnn"])
@pytest.mark.parametrize("case", ["none", "gqa_causal", "window", "causal_br_long_q", "varlen_causal", "additive"])
def test_training_calls_take_torchs_gradient_where_nothing_needs_fixing(op, case):
    """``ba.attention`` with gradients and no lse runs the kernel under PyTorch's own autograd node when
    nothing of ours is needed after it (no rows without keys, no packing, no additive bias), and under
    ours otherwise; the gradients match the reference either way, for a ``dout`` laid out unlike ``out``."""
    case = next(c for c in CASES if c.name == case)
    q, k, v, add = _make(case, torch.bfloat16, True)
    bias = _bias(case, add)
    inp = make_inputs(q, k, v, bias, requires_grad=True)
    if ba.ops.get(op).not_supported_reasons(inp, backward=True):
        pytest.skip(f"{op} does not declare {case.name} with gradients")
    dout = torch.randn(case.B, case.Mq, case.Hq, case.D, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    refs = _references(case, q, k, v, add, torch.bfloat16, True, dout, False)
    qq, kk, vv = (_leaf(t) for t in (q, k, v))
    out = ba.attention(qq, kk, vv, bias, op=op)
    ours = type(out.grad_fn).__name__ == "_AttentionFunctionBackward"
    grouped_on_cudnn = op == "cudnn" and case.Hq != case.Hkv  # only cuDNN's ragged entry takes them
    expected = case.name in ("causal_br_long_q", "varlen_causal", "additive") or grouped_on_cudnn
    assert ours == expected, type(out.grad_fn).__name__
    got = torch.autograd.grad(out, (qq, kk, vv), dout)
    for n, g, r, lo in zip(("dq", "dk", "dv"), got, refs["ref"][2], refs["low"][2]):
        assert_close_to_reference(g, r, lo, factor=3.0 if n == "dq" else 2.0, atol=ATOL, name=f"{op} {case.name} {n}")


@pytest.mark.parametrize("bias", [None, "causal", "window"])
def test_prepared_forward_only_calls_go_straight_to_cudnn(bias, monkeypatch):
    """A forward-only call prepared before runs the function the cudnn operator kept: the output still
    matches the reference, for new tensors, a new scale and a causal mask built anew; a window (not a
    cuDNN band) keeps its own operator, and a call with gradients its own path."""
    make = {None: lambda: None, "causal": ba.LowerTriangularMask, "window": lambda: ba.LocalAttentionMask(5, 0)}[bias]
    dispatch._CALLS.clear()
    full_path = []
    real_run = autograd.run
    monkeypatch.setattr(autograd, "run", lambda *a, **kw: full_path.append(1) or real_run(*a, **kw))
    for n, scale in enumerate((0.5, 0.3, 0.2)):
        case = Case("fwd_only", ("cudnn",), 2, 4, 4, 67, 67, 64)
        q, k, v, _ = _make(case, torch.bfloat16, False, seed=n)
        out = ba.attention(q, k, v, make(), scale=scale)
        ref = reference_attention(q, k, v, make(), scale=scale)[0]
        low = reference_attention(q, k, v, make(), scale=scale, compute_dtype=q.dtype)[0]
        assert_close_to_reference(out, ref, low, atol=ATOL, name=f"{bias} call {n}")
    (entry,) = dispatch._CALLS.values()
    assert (entry[6] is not None) == (entry[4].NAME == "cudnn") and (bias == "window") == (entry[4].NAME != "cudnn")
    assert len(full_path) == (3 if bias == "window" else 1)
    q, k, v, _ = _make(case, torch.bfloat16, True)
    ba.attention(*(_leaf(t) for t in (q, k, v)), make())
    assert [e[6] for e in dispatch._CALLS.values()][1] is None


@pytest.mark.parametrize("op", ["cutlass", "flash2", "cudnn"])
def test_vendor_float16_causal(op):
    """float16 inputs, causal, Mq == Mk (odd)."""
    _check_case(Case("fp16_causal", (op,), 2, 4, 4, 203, 203, 64, lambda a: ba.LowerTriangularMask()), op, torch.float16)


def test_cutlass_float32():
    """The CUTLASS kernel also runs float32."""
    _check_case(Case("fp32", ("cutlass",), 2, 4, 4, 77, 113, 64, lambda a: ba.LowerTriangularFromBottomRightMask()),
                "cutlass", torch.float32)


@pytest.mark.parametrize("op", ["cutlass", "cudnn"])
def test_additive_fully_masked_rows(op):
    """An additive bias that hides whole rows gives 0 / -inf there, no NaN, forward and backward."""
    B, H, M = 2, 4, 113
    q, k, v = (torch.randn(B, H, M, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    add = torch.randn(1, H, M, M, device=DEV, dtype=torch.bfloat16)
    add[:, :, 5:9] = float("-inf")
    with torch.no_grad():
        out, lse = ba.attention_with_lse(q, k, v, ba.AdditiveBias(add), op=op)
    assert bool((out[:, :, 5:9] == 0).all()) and bool(torch.isneginf(lse[:, :, 5:9]).all())
    ref, _ = reference_attention(q, k, v, ba.AdditiveBias(add))
    assert_close_to_reference(out, ref, reference_attention(q, k, v, ba.AdditiveBias(add), compute_dtype=q.dtype)[0])
    out = ba.attention(q, k, v, ba.AdditiveBias(add), op=op)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert bool((grads[0][:, :, 5:9] == 0).all())


@pytest.mark.parametrize("op", ["cutlass", "flash2", "cudnn", "triton"])
@pytest.mark.parametrize("bias", ["none", "varlen"])
def test_dropout_forward_backward_agree(op, bias):
    """With dropout, out = A·v for the dropped matrix A, so <out, dout> must equal <v, dv> (same mask in both passes)."""
    torch.manual_seed(0)
    M = 203
    attn_bias = None if bias == "none" else ba.BlockDiagonalMask.from_seqlens([17, 113, 3, 70]).make_causal()
    B = 2 if bias == "none" else 1
    q, k, v = (torch.randn(B, 4, M, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    why = ba.ops.get(op).not_supported_reasons(make_inputs(q, k, v, attn_bias, dropout_p=0.3))
    if why:
        assert op not in ("flash2", "triton") and bias == "varlen", why
        pytest.skip(f"{op} refuses: {why}")
    out = ba.attention(q, k, v, attn_bias, dropout_p=0.3, op=op)
    plain = ba.attention(q, k, v, attn_bias, op=op)
    assert bool(torch.isfinite(out).all())
    assert float((out.float() - plain.float()).abs().max()) > 0.05, "dropout changed nothing"
    dout = torch.randn_like(out)
    dv = torch.autograd.grad(out, v, dout)[0]
    lhs = float((out.double() * dout.double()).sum())
    rhs = float((v.double() * dv.double()).sum())
    assert abs(lhs - rhs) <= 2e-2 * (abs(lhs) + abs(rhs)) + 1.0, (lhs, rhs)


@pytest.mark.parametrize(
    "fwd,bwd,varlen",
    [("cudnn", "flash2", False), ("flash2", "cutlass", True), ("cutlass", "cudnn", False), ("triton", "cutlass", False),
     ("flash2", "triton", True)],
)
def test_forward_and_backward_by_different_operators(fwd, bwd, varlen):
    """The dispatcher may pair a forward of one operator with the backward of another (foreign ctx)."""
    if fwd not in ba.ops.available() or bwd not in ba.ops.available():
        pytest.skip("operator not registered")
    causal = ba.BlockDiagonalMask.from_seqlens([17, 113, 3, 70]).make_causal() if varlen else ba.LowerTriangularMask()
    case = Case("mixed", (fwd, bwd), 1, 4, 4, 203, 203, 64, lambda a: causal)
    q, k, v, _ = _make(case, torch.bfloat16, True)
    dout = torch.randn_like(q)
    refs = _references(case, q, k, v, None, torch.bfloat16, True, dout, False)
    qq, kk, vv = (_leaf(t) for t in (q, k, v))
    inp = make_inputs(qq, kk, vv, _bias(case, None), requires_grad=True)
    out, _ = autograd.run(inp, ba.ops.get(fwd), ba.ops.get(bwd))
    got = torch.autograd.grad(out, (qq, kk, vv), dout)
    for n, g, r, lo in zip(("dq", "dk", "dv"), got, refs["ref"][2], refs["low"][2]):
        assert_close_to_reference(g, r, lo, factor=3.0 if n == "dq" else 2.0, atol=ATOL, name=f"{fwd}->{bwd} {n}")



@pytest.mark.parametrize("path", ["triton->cudnn", "compiled"])
def test_cudnn_backward_of_a_fused_projections_views(path):
    """q, k, v as views of one fused projection ``[B, M, 3, H, D]`` (every transformer's layout) and an
    out laid out otherwise (another operator's forward, or a compiled forward, returns it contiguous):
    cuDNN's backward gave gradients off by more than their own size until out is laid out like q."""
    if "cudnn" not in ba.ops.available() or "triton" not in ba.ops.available():
        pytest.skip("operator not registered")
    case = Case("projection", ("cudnn",), 2, 4, 4, 203, 203, 64, lambda a: ba.LowerTriangularMask())
    g = torch.Generator(device=DEV).manual_seed(0)
    qkv = torch.randn(2, 203, 3, 4, 64, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_()
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    dout = torch.randn(2, 4, 203, 64, device=DEV, dtype=torch.bfloat16, generator=g)
    refs = _references(case, q, k, v, None, torch.bfloat16, True, dout, False)
    if path == "compiled":
        torch._dynamo.reset()
        fn = torch.compile(lambda q, k, v: ba.attention(q, k, v, ba.LowerTriangularMask(), op="cudnn"), backend="aot_eager",
                           fullgraph=True)
        out = fn(q, k, v)
    else:
        out, _ = autograd.run(make_inputs(q, k, v, ba.LowerTriangularMask(), requires_grad=True), ba.ops.get("triton"),
                              ba.ops.get("cudnn"))
    got = torch.autograd.grad(out, (q, k, v), dout)
    for n, gr, r, lo in zip(("dq", "dk", "dv"), got, refs["ref"][2], refs["low"][2]):
        assert_close_to_reference(gr, r, lo, factor=3.0 if n == "dq" else 2.0, atol=ATOL, name=f"{path} {n}")

@pytest.mark.parametrize("M", [192, 320])
def test_cudnn_nan_grad_q_regression(M):
    """cuDNN with a bias gave NaN grad_q at seq_len % 128 == 64 (PyTorch issue 196678): refused or finite."""
    q, k, v = (torch.randn(2, 4, M, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    add = torch.randn(1, 4, M, M, device=DEV, dtype=torch.bfloat16)
    inp = make_inputs(q, k, v, ba.AdditiveBias(add))
    op = ba.ops.get("cudnn")
    with torch.no_grad():
        raw = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, add.expand(2, 4, M, M), True, 0.0, False, False)
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            torch.ones_like(raw[0]), q, k, v, raw[0], raw[1], raw[6], raw[7], add.expand(2, 4, M, M),
            raw[2], raw[3], M, M, 0.0, False,
        )
    buggy = not bool(torch.isfinite(grads[0]).all())
    print(f"torch {torch.__version__}: raw cuDNN grad_q with a bias at M={M}: {'NaN' if buggy else 'finite'}")
    if op.supports(inp, backward=True):
        out = ba.attention(q, k, v, ba.AdditiveBias(add), op="cudnn")
        dq = torch.autograd.grad(out.float().sum(), q)[0]
        assert bool(torch.isfinite(dq).all())
    else:
        assert M % 128 == 64


HEAD_DIMS = (64, 80, 96, 128, 192, 256)


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("op", ["cutlass", "flash2", "cudnn", "triton", "auto"])
@pytest.mark.parametrize("bias", ["causal", "window"])
def test_every_head_dim_runs_or_is_refused_up_front(D, op, bias):
    """Each head dim: an operator that declares it matches the reference forward and backward; one that
    does not refuses before launch. ``auto`` runs every case (at D > 128 its backward is flash2's where it runs)."""
    make = (lambda a: ba.LowerTriangularMask()) if bias == "causal" else (lambda a: ba.LocalAttentionMask(31, 0))
    case = Case(f"{bias}_d{D}", (op,), 2, 8, 2, 203, 203, D, make)
    if op != "auto":
        q = torch.empty(2, 8, 203, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(2, 2, 203, D, device=DEV, dtype=torch.bfloat16)
        why = ba.ops.get(op).not_supported_reasons(make_inputs(q, k, k, make(None)), backward=True)
        if why:
            with pytest.raises(ba.NotSupportedError):
                ba.attention(q, k, k, make(None), op=op)
            return
    _check_case(case, op, torch.bfloat16)
