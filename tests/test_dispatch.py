"""The dispatcher: choices on the CPU, use_ops, forced operators, NotSupportedError and explain()."""

import contextlib
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import biasattn as ba
from biasattn import dispatch
from biasattn.inputs import make_inputs
from biasattn.ops.base import Operator
from biasattn.ops.reference import ReferenceOperator
from biasattn.testing import strategies


def qkv(requires_grad=False, dtype=torch.float32, B=1, H=2, M=5, D=8):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, M, D, generator=gen, dtype=dtype).requires_grad_(requires_grad) for _ in range(3)]


class ForwardOnly(ReferenceOperator):
    """A registered test operator: the reference forward, no backward."""

    NAME = "forward_only_test"
    SUPPORTS_BACKWARD = False
    calls = 0

    def fwd(self, inp):
        type(self).calls += 1
        return super().fwd(inp)


@pytest.fixture
def forward_only(monkeypatch):
    op = ForwardOnly()
    ba.ops.register(op)
    monkeypatch.setitem(dispatch.PRIORITY, "cpu", (op.NAME, "chunked", "reference"))
    yield op
    ba.ops.unregister(op.NAME)


def test_registry():
    names = ba.ops.available()
    assert {"chunked", "reference"} <= set(names)
    assert ba.ops.get("chunked").name == "chunked"
    op = ba.ops.get("reference")
    assert ba.ops.get(op) is op


def test_cpu_chooses_torchs_fused_kernel_for_causal_and_chunked_for_other_masks():
    inp = make_inputs(*qkv(requires_grad=True), ba.LowerTriangularMask())
    fwd, bwd = dispatch.choose(inp)
    assert fwd.name == "cpu_flash" and bwd.name == "cpu_flash"
    fwd, bwd = dispatch.choose(make_inputs(*qkv(), ba.LowerTriangularMask()))
    assert fwd.name == "cpu_flash" and bwd is None
    fwd, bwd = dispatch.choose(make_inputs(*qkv(requires_grad=True), ba.LocalAttentionMask(2)))
    assert fwd.name == "chunked" and bwd.name == "chunked"
    fwd, bwd = dispatch.choose(make_inputs(*qkv(requires_grad=True), ba.LowerTriangularMask()), need_lse=True)
    assert bwd.name == "chunked"  # no gradient through the lse in the fused kernel


def test_a_repeated_call_reuses_its_choice(monkeypatch):
    """Dispatch walks the operators once per spec and call signature, not on every call."""
    walks = []
    walk = dispatch._choose
    monkeypatch.setattr(dispatch, "_choose", lambda *a: walks.append(a) or walk(*a))
    bias = ba.LowerTriangularMask() & ba.PaddedKeysMask([3])
    first = dispatch.choose(make_inputs(*qkv(M=7), bias))
    assert dispatch.choose(make_inputs(*qkv(M=7), bias)) == first and len(walks) == 1
    dispatch.choose(make_inputs(*qkv(M=7), bias), need_lse=True)
    dispatch.choose(make_inputs(*qkv(M=7, requires_grad=True), bias))
    dispatch.choose(make_inputs(*qkv(M=7, dtype=torch.float64), bias))
    assert len(walks) == 4  # another flag, gradients, another dtype: walked again


def test_cache_length_masks_built_anew_share_their_choice(monkeypatch):
    """A PaddedKeysMask built for every decode step: one walk for all of them (per call signature),
    and the kept choice is the one a walk gives."""
    monkeypatch.setattr(dispatch, "_length_mask_choices", {})
    walks = []
    walk = dispatch._choose
    monkeypatch.setattr(dispatch, "_choose", lambda *a: walks.append(a) or walk(*a))
    q, k, v = qkv(B=2, M=9)
    chosen = [dispatch.choose(make_inputs(q, k, v, ba.PaddedKeysMask([9 - n, n]))) for n in range(5)]
    assert len(walks) == 1 and all(c == walk(make_inputs(q, k, v, ba.PaddedKeysMask([4, 5])), False, None) for c in chosen)
    dispatch.choose(make_inputs(q, k, v, ba.LowerTriangularMask() & ba.PaddedKeysMask([3, 4])))  # a band too
    dispatch.choose(make_inputs(q, k, v, ba.LowerTriangularMask() & ba.PaddedKeysMask([3, 4])))
    assert len(walks) == 3  # specs of other features keep their choices in their own stores


def test_a_kept_choice_follows_priority_use_ops_registry_and_capture(monkeypatch, forward_only):
    """A kept choice never outlives what it was made from: the priority list, use_ops, the registry, graph capture."""
    inp = make_inputs(*qkv(M=9))
    assert dispatch.choose(inp)[0] is forward_only
    with ba.use_ops("reference"):
        assert dispatch.choose(inp)[0].name == "reference"
    monkeypatch.setitem(dispatch.PRIORITY, "cpu", ("chunked", "reference"))
    assert dispatch.choose(inp)[0].name == "chunked"
    monkeypatch.setitem(dispatch.PRIORITY, "cpu", (forward_only.NAME, "chunked", "reference"))
    assert dispatch.choose(inp)[0] is forward_only
    ba.ops.unregister(forward_only.NAME)
    assert dispatch.choose(inp)[0].name == "chunked"
    ba.ops.register(forward_only)
    before = dispatch._decision_key(inp, False, None)
    monkeypatch.setattr(dispatch, "graph_capturing", lambda: True)
    assert dispatch._decision_key(inp, False, None) == before  # a CPU call never asks about graph capture
    with pytest.raises(ba.NotSupportedError):  # refusals are not kept: each forced call says why
        dispatch.choose(make_inputs(*qkv(M=9, requires_grad=True)), op=forward_only.NAME)
    with pytest.raises(ba.NotSupportedError):
        dispatch.choose(make_inputs(*qkv(M=9, requires_grad=True)), op=forward_only.NAME)


def test_use_ops_restricts_and_restores():
    inp = make_inputs(*qkv())
    with ba.use_ops("reference"):
        assert dispatch.choose(inp)[0].name == "reference"
        assert [op.name for op in dispatch.candidates("cpu")] == ["reference"]
    assert dispatch.choose(inp)[0].name == "cpu_flash"


def test_use_ops_unknown_name():
    with pytest.raises(ba.InputError, match="op must be one of"):
        with ba.use_ops("no_such_op"):
            pass


def test_use_ops_with_nothing_usable_lists_every_reason():
    if not {"cutlass", "flash2"} <= set(ba.ops.available()):
        pytest.skip("vendor operators not in this build")
    q, k, v = qkv()
    with ba.use_ops("cutlass", "flash2"), pytest.raises(ba.NotSupportedError) as info:
        ba.attention(q, k, v)
    err = info.value
    assert set(err.reasons) == {"cutlass", "flash2"}
    assert "no operator can run q [1, 2, 5, 8]" in str(err)
    assert "runs on cuda tensors, the inputs are on cpu" in str(err)


def test_forced_operator_that_cannot_run_raises_at_once_with_its_reasons():
    class NoGrad(Operator):
        NAME = "no_grad_test"
        DTYPES = frozenset({torch.float16})
        FEATURES = frozenset({"band"})

    q, k, v = qkv(requires_grad=True)
    with pytest.raises(ba.NotSupportedError) as info:
        ba.attention(q, k, v, ba.PaddedKeysMask([3]), op=NoGrad())
    reasons = info.value.reasons["no_grad_test"]
    assert "supports dtypes float16, got float32" in reasons
    assert any("does not support bias features ['padded_keys']" in r for r in reasons)
    assert "has no backward pass and gradients are required" in reasons
    assert "operator 'no_grad_test' was forced but cannot run" in str(info.value)


def test_forced_operator_never_falls_back(monkeypatch):
    q, k, v = qkv()
    calls = []
    monkeypatch.setattr(type(ba.ops.get("chunked")), "fwd", lambda self, inp: calls.append(1) or (None,) * 3)
    out = ba.attention(q, k, v, op="reference")
    assert not calls and out.shape == (1, 2, 5, 8)


def test_forward_and_backward_chosen_separately(forward_only):
    q, k, v = qkv(requires_grad=True)
    inp = make_inputs(q, k, v)
    fwd, bwd = dispatch.choose(inp)
    assert fwd.name == "forward_only_test" and bwd.name == "chunked"
    before = ForwardOnly.calls
    out = ba.attention(q, k, v)
    out.sum().backward()
    assert ForwardOnly.calls == before + 1 and q.grad is not None
    ref = ba.attention(*(t.detach() for t in (q, k, v)), op="reference")
    torch.testing.assert_close(out.detach(), ref)


def test_dropout_keeps_forward_and_backward_on_one_operator(forward_only):
    inp = make_inputs(*qkv(requires_grad=True), dropout_p=0.1)
    fwd, bwd = dispatch.choose(inp)
    assert fwd is bwd and fwd.name == "chunked"


def test_need_lse(monkeypatch):
    class NoLse(ReferenceOperator):
        NAME = "no_lse_test"
        SUPPORTS_LSE = False

    op = NoLse()
    ba.ops.register(op)
    try:
        monkeypatch.setitem(dispatch.PRIORITY, "cpu", (op.NAME, "chunked", "reference"))
        q, k, v = qkv()
        inp = make_inputs(q, k, v)
        assert dispatch.choose(inp)[0].name == "no_lse_test"
        assert dispatch.choose(inp, need_lse=True)[0].name == "chunked"
        with pytest.raises(ba.NotSupportedError, match="does not return the log-sum-exp"):
            ba.attention_with_lse(q, k, v, op=op)
    finally:
        ba.ops.unregister(op.NAME)


def test_explain_lists_chosen_and_reasons():
    q, k, v = qkv()
    text = ba.explain(q, k, v, ba.LowerTriangularMask())
    assert "inputs: q [1, 2, 5, 8]" in text and "features: band" in text
    assert "chunked" in text and "chosen" in text
    assert "reference      available (lower priority)" in text
    text = ba.explain(q, k, v, requires_grad=True)
    assert "forward:" in text and "backward:" in text
    with ba.use_ops("reference"):
        assert "reference      chosen" in ba.explain(q, k, v)


def test_explain_names_every_registered_operator():
    """explain() reports every registered operator, also those outside the device's priority list."""
    q, k, v = qkv()
    text = ba.explain(q, k, v)
    for name in ba.ops.available():
        assert f"  {name:<14} " in text


@pytest.mark.parametrize("D", [8, 64, 128, 192, 256, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_explain_on_this_device_asks_no_operator_about_another(D, dtype):
    """explain() walks every registered operator, GPU-only ones included, for any head dim and dtype
    without asking CUDA anything when the inputs are not on a GPU (a CPU-only torch has no CUDA to ask)."""
    q = torch.randn(2, 4, 7, D, dtype=dtype, requires_grad=True)
    k, v = torch.randn(2, 4, 33, D, dtype=dtype), torch.randn(2, 4, 33, D, dtype=dtype)
    for bias in (None, ba.LowerTriangularMask(), ba.PaddedKeysMask([33, 9]), ba.AdditiveBias(torch.randn(7, 33))):
        text = ba.explain(q, k, v, bias)
        for name in ba.ops.available():
            assert f"  {name:<14} " in text


def test_explain_reports_no_operator():
    q, k, v = qkv()
    if "flash2" not in ba.ops.available():
        pytest.skip("vendor operators not in this build")
    with ba.use_ops("flash2"):
        text = ba.explain(q, k, v)
    assert "no operator can run these inputs" in text
    assert "runs on cuda tensors" in text


def test_declarations_are_data():
    d = ba.ops.get("chunked").declarations()
    assert d["name"] == "chunked" and d["backward"] and d["gqa"] and "segments" in d["features"]
    assert set(d["dtypes"]) == {"float16", "bfloat16", "float32", "float64"}


def test_non_positive_scales_go_to_operators_that_take_any_scale():
    """Kernels that take row maxima before scaling (or are unverified otherwise) refuse a scale <= 0 by
    declaration; the dispatcher then picks an operator that computes the same function as the reference."""
    from biasattn.testing import reference_attention

    q, k, v = qkv(M=7)
    for scale in (-0.7, 0.0):
        inp = make_inputs(q, k, v, ba.LowerTriangularMask(), scale=scale)
        for name in ba.ops.available():
            op = ba.ops.get(name)
            assert op.declarations()["scale"] == ("> 0" if op.POSITIVE_SCALE_ONLY else "any")
            if op.POSITIVE_SCALE_ONLY:
                assert f"needs a positive scale, got scale={scale}" in op.not_supported_reasons(inp)
        out = ba.attention(q, k, v, ba.LowerTriangularMask(), scale=scale)
        ref, _ = reference_attention(q.double(), k.double(), v.double(), ba.LowerTriangularMask(), scale=scale)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    assert {"triton", "triton_splitk"} <= {n for n in ba.ops.available() if ba.ops.get(n).POSITIVE_SCALE_ONLY}


def _decode(Hq, Hkv, Mq, bias=None, B=2, Mk=40):
    q, k = torch.randn(B, Hq, Mq, 8), torch.randn(B, Hkv, Mk, 8)
    return make_inputs(q, k, k, bias)


def test_cuda_priority_puts_cudnn_first_for_single_query_decoding_of_small_groups():
    order = dispatch.priority("cuda", _decode(8, 2, 1))
    assert order.index("cudnn") < order.index("triton_splitk") < order.index("triton")
    assert dispatch.priority("cuda", _decode(32, 1, 1)).index("cudnn") == 0  # 32 query heads per KV head
    for inp in (_decode(64, 1, 1), _decode(8, 2, 4)):  # 64 query heads per KV head; 4 queries
        assert dispatch.priority("cuda", inp)[0] == "triton_splitk"
    order = dispatch.priority("cuda", _decode(2, 2, 17))  # not a decode shape
    assert order.index("cudnn") < order.index("cutlass") < order.index("triton_splitk")


def test_cuda_priority_keeps_triton_splitk_first_for_single_queries_in_a_captured_graph(monkeypatch):
    monkeypatch.setattr(dispatch, "graph_capturing", lambda: True)  # only GPU time counts there
    for inp in (_decode(8, 2, 1), _decode(16, 1, 1), _decode(8, 8, 1, B=64)):
        assert dispatch.priority("cuda", inp)[0] == "triton_splitk"
    assert dispatch.priority("cuda", _decode(32, 32, 4, B=16))[0] == "cudnn"  # several ungrouped queries


def test_cuda_priority_puts_cudnn_first_for_a_few_ungrouped_queries_on_large_batches():
    assert dispatch.priority("cuda", _decode(32, 32, 4, B=16))[0] == "cudnn"  # 512 (sequence, head) pairs
    assert dispatch.priority("cuda", _decode(32, 32, 2, B=64))[0] == "cudnn"
    # a small batch; 5 queries; grouped heads; a long cache
    for inp in (_decode(32, 32, 4, B=4), _decode(32, 32, 5, B=64), _decode(32, 8, 4, B=64), _decode(8, 8, 4, B=64, Mk=8193)):
        assert dispatch.priority("cuda", inp)[0] == "triton_splitk"
    assert dispatch.priority("cuda", _decode(8, 8, 4, B=64, Mk=8192))[0] == "cudnn"


def test_cuda_priority_with_dropout_puts_flash2_before_triton():
    q = torch.randn(2, 4, 64, 8)
    plain = dispatch.priority("cuda", make_inputs(q, q, q))
    dropped = dispatch.priority("cuda", make_inputs(q, q, q, dropout_p=0.1))
    assert plain.index("triton") < plain.index("flash2")
    assert dropped.index("cudnn") < dropped.index("flash2") < dropped.index("triton") < dropped.index("cutlass")
    assert sorted(plain) == sorted(dropped)


def test_priority_notes_name_the_rule_and_its_numbers(monkeypatch):
    """explain()'s order lines: one per rule that moved an operator, with the values it read."""
    (note,) = dispatch.priority_notes("cuda", _decode(8, 2, 1))
    assert note.startswith("cudnn before triton_splitk") and "4 query heads per KV head" in note
    (note,) = dispatch.priority_notes("cuda", _decode(32, 32, 4, B=16))
    assert note.startswith("cudnn before triton_splitk") and "512 (sequence, KV head) pairs" in note
    (note,) = dispatch.priority_notes("cuda", _decode(64, 1, 1))
    assert note.startswith("triton_splitk first") and "64 query heads per KV head, called eagerly" in note
    (note,) = dispatch.priority_notes("cuda", _decode(2, 2, 17))
    assert note.startswith("triton_splitk tried late") and "17 queries" in note
    q = torch.randn(2, 4, 64, 8)
    notes = dispatch.priority_notes("cuda", make_inputs(q, q, q, dropout_p=0.1))
    assert notes[-1] == "flash2 before triton: dropout (p=0.1) costs flash2 less"
    assert dispatch.priority_notes("cpu", _decode(8, 2, 1)) == []
    monkeypatch.setattr(dispatch, "graph_capturing", lambda: True)
    (note,) = dispatch.priority_notes("cuda", _decode(8, 2, 1))
    assert note.startswith("triton_splitk first") and "inside a CUDA graph capture" in note


def test_explain_shows_a_chosen_split_kv_launch(monkeypatch):
    from biasattn.ops.triton import environment

    if environment.environment_reasons(torch.device("cpu")):
        pytest.skip("triton_splitk runs on the CPU only under the Triton interpreter")
    q, k = torch.randn(4, 32, 1, 16, dtype=torch.float16), torch.randn(4, 1, 300, 16, dtype=torch.float16)
    with ba.use_ops("triton_splitk"):
        text = ba.explain(q, k, k, ba.PaddedKeysMask([200, 300, 40, 1]))
    assert "triton_splitk  chosen: 1 block of 32 packed rows per (sequence, KV head), 16-key tiles" in text


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_an_operator_that_runs_the_backward_runs_the_forward(data):
    """The dispatcher's one walk for both passes relies on this: backward only adds reasons."""
    shape = data.draw(strategies.shapes(max_seqlen=40))
    dtype = data.draw(strategies.dtypes())
    bias = data.draw(strategies.biases(shape, additive_dtype=dtype))
    q = torch.randn(shape.B, shape.Hq, shape.Mq, shape.D, dtype=dtype)
    k = torch.randn(shape.B, shape.Hkv, shape.Mk, shape.D, dtype=dtype)
    v = torch.randn(shape.B, shape.Hkv, shape.Mk, shape.Dv, dtype=dtype)
    inp = make_inputs(q, k, v, bias, requires_grad=True)
    for name in ba.ops.available():
        op = ba.ops.get(name)
        for need_lse in (False, True):
            back = set(op.not_supported_reasons(inp, need_lse=need_lse, backward=True))
            assert set(op.not_supported_reasons(inp, need_lse=need_lse, backward=False)) <= back, name


def _walk_or_refusal(inp, need_lse, op):
    try:
        return dispatch._choose(inp, need_lse, op)
    except ba.NotSupportedError:
        return "refused"


def _choice_or_refusal(inp, need_lse, op):
    try:
        return dispatch.choose(inp, need_lse=need_lse, op=op)
    except ba.NotSupportedError:
        return "refused"


@settings(max_examples=40, deadline=None)
@given(case=strategies.attention_inputs(dtypes=(torch.float32, torch.float16), max_seqlen=24, allow_empty=True))
def test_kept_choices_equal_a_fresh_walk(case):
    """Whatever calls came before on the same spec, a kept choice is the one a fresh walk makes."""
    combos = list(itertools.product(
        [None, ("triton_splitk", "chunked"), ("triton", "reference"), ("reference",)],  # use_ops
        [False, True], [False, True], [None, "chunked", "triton_splitk"],  # need_lse, gradients, op=
    ))
    for restrict, need_lse, grad, op in combos + combos[::-1]:
        inp = make_inputs(case.q, case.k, case.v, case.bias, scale=case.scale, requires_grad=grad)
        with ba.use_ops(*restrict) if restrict else contextlib.nullcontext():
            assert _choice_or_refusal(inp, need_lse, op) == _walk_or_refusal(inp, need_lse, op)


@pytest.mark.parametrize(("D", "Dv", "backward_flash2_first"), [(256, 256, False), (192, 192, True), (128, 256, False),
                                                            (129, 64, True), (255, 255, True)])
def test_cuda_large_head_dims_try_flash2_before_triton_per_pass(D, Dv, backward_flash2_first):
    """HEAD_DIM_ORDER: flash2 goes first for the backward at head dims 129..255, never for the forward, and
    explain() names the rule; the rest of the order is unchanged."""
    q, k, v = torch.randn(1, 2, 64, D), torch.randn(1, 2, 64, D), torch.randn(1, 2, 64, Dv)
    inp = make_inputs(q.requires_grad_(), k, v, ba.LocalAttentionMask(16, 0))
    forward, backward = dispatch.priority("cuda", inp), dispatch.priority("cuda", inp, backward=True)
    assert forward.index("flash2") > forward.index("triton")
    assert (backward.index("flash2") < backward.index("triton")) == backward_flash2_first
    assert [n for n in backward if n not in ("flash2", "triton")] == [n for n in forward if n not in ("flash2", "triton")]
    notes = dispatch.priority_notes("cuda", inp)
    assert any(f"for the backward: head dim {max(D, Dv)} is in 129..255" in note for note in notes) == backward_flash2_first
    assert not any("for the forward: head dim" in note for note in notes)
    small = make_inputs(q[..., :128].detach().requires_grad_(), k[..., :128], v[..., :128], ba.LocalAttentionMask(16, 0))
    assert dispatch.priority("cuda", small, backward=True) == dispatch.priority("cuda", small)
    assert not any("head dim" in note for note in dispatch.priority_notes("cuda", small))


def test_a_call_prepared_before_skips_checks_and_walk(monkeypatch):
    """A call without a bias or with one holding no tensor (a causal mask built anew) is checked and
    walked once per signature; a new flag, dtype or bias structure prepares again."""
    dispatch._CALLS.clear()
    made = []
    real = dispatch.make_inputs
    monkeypatch.setattr(dispatch, "make_inputs", lambda *a, **kw: made.append(a) or real(*a, **kw))
    q, k, v = qkv(M=7)
    for _ in range(3):
        inp, fwd, _ = dispatch.prepare(q, k, v)
        inp_c, fwd_c, _ = dispatch.prepare(q, k, v, ba.LowerTriangularMask(), scale=0.3)
    assert len(made) == 2
    assert inp.scale == make_inputs(q, k, v).scale and inp_c.scale == 0.3 and inp_c.spec.features == {"band"}
    assert (inp.spec, fwd) == (make_inputs(q, k, v).spec, dispatch.choose(make_inputs(q, k, v))[0])
    dispatch.prepare(q, k, v, ba.LowerTriangularMask(), need_lse=True)
    dispatch.prepare(q, k, v, ba.LocalAttentionMask(2, 0))
    dispatch.prepare(*qkv(M=7, dtype=torch.float64))
    dispatch.prepare(*qkv(M=7, requires_grad=True))
    with ba.use_ops("reference"):
        assert dispatch.prepare(q, k, v)[1].name == "reference"
    assert len(made) == 7
    inp_i = dispatch.prepare(q, k, v, dropout_p=0, scale=2)[0]  # ints as make_inputs takes them: floats inside
    assert dispatch.prepare(q, k, v, dropout_p=0, scale=3)[0].scale == 3.0 and type(inp_i.dropout_p) is float
    assert len(made) == 8
    dispatch.prepare(q, k, v, ba.PaddedKeysMask([3]))  # a bias holding a tensor: checked on every call
    dispatch.prepare(q, k, v, ba.PaddedKeysMask([3]))
    assert len(made) == 10


def test_forward_only_calls_prepared_before_take_the_operators_direct_function(monkeypatch):
    """``attention`` without gradients or lse, on a bias holding no tensor, calls the function its operator
    kept (``direct_out``) from the second call on, with the call's tensors, scale and dropout; calls
    with gradients, with the lse or with a bias holding tensors keep the full path."""
    dispatch._CALLS.clear()
    op = ba.ops.get("chunked")
    direct_calls = []

    def direct_out(inp):
        def out(q, k, v, scale, dropout_p):
            direct_calls.append((scale, dropout_p))
            return op.fwd_out(make_inputs(q, k, v, ba.LocalAttentionMask(2), scale=scale, dropout_p=dropout_p))
        return out

    monkeypatch.setattr(op, "direct_out", direct_out, raising=False)
    q, k, v = qkv(M=7)
    first = ba.attention(q, k, v, ba.LocalAttentionMask(2), scale=0.5)
    assert direct_calls == []
    q2, k2, v2 = (t + 1 for t in (q, k, v))
    again = ba.attention(q2, k2, v2, ba.LocalAttentionMask(2), scale=0.25)
    assert direct_calls == [(0.25, 0.0)]
    ref = ReferenceOperator()
    assert torch.allclose(first, ref.fwd(make_inputs(q, k, v, ba.LocalAttentionMask(2), scale=0.5))[0], atol=1e-5)
    assert torch.allclose(again, ref.fwd(make_inputs(q2, k2, v2, ba.LocalAttentionMask(2), scale=0.25))[0], atol=1e-5)
    for _ in range(2):
        ba.attention(*qkv(M=7, requires_grad=True), ba.LocalAttentionMask(2))
        ba.attention_with_lse(q, k, v, ba.LocalAttentionMask(2))
        ba.attention(q, k, v, ba.PaddedKeysMask([3]))
    assert len(direct_calls) == 1


@pytest.mark.parametrize(("change", "message"), [
    ({"scale": float("nan")}, "scale must be a finite float"),
    ({"scale": True}, "scale must be a finite float"),
    ({"dropout_p": 1.0}, "dropout_p must be a float in"),
    ({"dropout_p": -0.5}, "dropout_p must be a float in"),
    ({"v": torch.randn(1, 2, 7, 8, dtype=torch.float64)}, "v has dtype"),
    ({"k": torch.randn(1, 2, 6, 8)}, "v has Mk=7 keys, k has 6"),
])
def test_a_prepared_signature_still_rejects_bad_values(change, message):
    """Values a signature does not fix are checked on every call: a hit never lets a bad one through."""
    q, k, v = qkv(M=7)
    args = {"q": q, "k": k, "v": v, "scale": 0.5, "dropout_p": 0.1}
    for _ in range(2):
        dispatch.prepare(**args)
    with pytest.raises((ba.InputError, ba.InputTypeError), match=message):
        dispatch.prepare(**{**args, **change})


def test_distinct_scales_and_dropout_values_prepare_one_entry():
    """A learned temperature or a dropout schedule: one prepared signature for all values."""
    q, k, v = qkv(M=7)
    ba.attention(q, k, v, scale=0.5, dropout_p=0.1)
    before = len(dispatch._CALLS)
    for n in range(500):
        out = ba.attention(q, k, v, scale=0.1 + n * 1e-3, dropout_p=0.05 + n * 1e-4)
    assert len(dispatch._CALLS) == before and torch.isfinite(out).all()
