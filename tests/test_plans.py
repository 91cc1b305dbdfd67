"""Launch plans of the ``triton`` operator: a signature's launches are recorded on two calls and
replayed afterwards, with results equal bit for bit to the unplanned launches.

Runs wherever the triton operator does (the interpreter on the CPU, with tiny shapes)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import biasattn as ba
from biasattn.inputs import make_inputs

OP = ba.ops.get("triton") if "triton" in ba.ops.available() else None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    OP is None or bool(OP.environment_reasons(torch.device(DEVICE))), reason="the triton operator cannot run here",
)


@pytest.fixture(autouse=True)
def fresh_shared_specs(monkeypatch):
    """Specs shared between bias objects (no bias, tensor-free biases) start empty: no plan of an earlier test."""
    from biasattn.bias import spec as spec_module

    monkeypatch.setattr(spec_module, "_PLAIN_SPECS", {})
    monkeypatch.setattr(spec_module, "_STRUCTURAL_SPECS", {})
    from biasattn.ops.triton import flash

    monkeypatch.setattr(flash, "_SHARED_PLANS", {})
    try:
        from biasattn.ops.triton import splitk
    except ImportError:
        return
    monkeypatch.setattr(splitk, "_shared_plans", {})


@pytest.fixture
def plans():
    from biasattn.ops.triton import plans

    return plans


def _tensors(B=1, Hq=2, Hkv=1, Mq=24, Mk=24, D=16, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    return r(B, Hq, Mq, D), r(B, Hkv, Mk, D), r(B, Hkv, Mk, D), r(B, Hq, Mq, D)


def _fwd_bwd(q, k, v, dout, bias):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = ba.attention(q, k, v, bias, op="triton")
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def _stored(spec, kind: str):
    """The plan stores' entries for calls of ``kind`` (``"fwd"``/``"bwd"``): the spec's own, and those shared
    by specs of one structure (emptied for each test)."""
    from biasattn.ops.triton import flash

    own = [v for key, v in spec.derived.items() if isinstance(key, tuple) and key[:2] == ("launch plan", kind)]
    return own + [v for key, v in flash._SHARED_PLANS.items() if key[0][:2] == ("launch plan", kind)]


def _biases():
    layout = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    return {
        "none": None,
        "causal": ba.LowerTriangularMask(),
        "documents": ba.BlockDiagonalMask.from_seqlens([10, 14]).make_causal(),
        "padded_window": ba.PaddedKeysMask([17]) & ba.LocalAttentionMask(window_left=4, window_right=3),
        "block_sparse": ba.BlockSparseMask(layout[None, None], 12),
        "alibi": ba.ALiBi(ba.ALiBi.standard_slopes(2)),
        "additive": ba.AdditiveBias(torch.randn(1, 2, 24, 24)),
    }


@pytest.mark.parametrize("name", list(_biases()))
def test_replays_equal_the_launches_they_replace(triton_options, plans, monkeypatch, name):
    bias = _biases()[name]
    bias = bias.to(DEVICE) if bias is not None else None
    replays = []
    real_run = plans.Plan.run
    monkeypatch.setattr(plans.Plan, "run", lambda self, roles: replays.append(len(roles)) or real_run(self, roles))
    for call in range(6):
        q, k, v, dout = _tensors(seed=call)
        before = len(replays)
        planned = _fwd_bwd(q, k, v, dout, bias)
        replayed = len(replays) - before
        triton_options(plans=False)
        plain = _fwd_bwd(q, k, v, dout, bias)
        triton_options(plans=True)
        for what, a, b in zip(("out", "dq", "dk", "dv"), planned, plain):
            assert torch.equal(a, b), f"call {call}: {what} differs from the unplanned launches"
        if call >= 4:  # a call that marks the signature, two recordings (after a first launch that may
            # choose configs), then replays
            assert replayed == 2, f"call {call} replays the forward's and the backward's plans"
    spec = make_inputs(q, k, v, bias).spec
    assert all(type(s) is plans.Plan for s in _stored(spec, "fwd") + _stored(spec, "bwd"))


@pytest.mark.parametrize("case", ["causal", "bottom_right", "padded"])
def test_plans_serve_packed_documents_built_anew_every_step(triton_options, plans, monkeypatch, case):
    """Training on packed documents builds the mask from each batch's lengths: every step is a new spec,
    yet from the fifth step the forward and backward replay plans shared by those specs, with the
    step's own lengths and tile tables (the same bits as the full path)."""
    replays = []
    real_run = plans.Plan.run
    monkeypatch.setattr(plans.Plan, "run", lambda self, roles: replays.append(roles) or real_run(self, roles))
    steps = [[5, 19], [20, 4], [1, 23], [12, 12], [24, 0], [3, 21], [9, 15]]
    for step, lengths in enumerate(steps):
        q, k, v, dout = _tensors(B=2 if case == "padded" else 1, seed=step)
        if case == "padded":
            bias = ba.PaddedKeysMask(lengths, device=DEVICE) & ba.LowerTriangularFromBottomRightMask()
        else:
            bias = ba.BlockDiagonalMask.from_seqlens(lengths, device=DEVICE)
            bias = bias.make_causal() if case == "causal" else bias.make_causal_from_bottom_right()
        before = len(replays)
        planned = _fwd_bwd(q, k, v, dout, bias)
        triton_options(plans=False)
        plain = _fwd_bwd(q, k, v, dout, bias)
        triton_options(plans=True)
        for what, a, b in zip(("out", "dq", "dk", "dv"), planned, plain):
            assert torch.equal(a, b), f"step {step}: {what} differs from the unplanned launches"
        # a first step that may choose configs, one that marks the signature, two recordings, then replays
        assert len(replays) - before == (2 if step >= 4 else 0) or step == 3, f"step {step}"
        if step >= 4 and case != "padded":
            starts = torch.tensor([0, lengths[0], 24], dtype=torch.int32)
            assert any(torch.equal(r.cpu(), starts) for r in replays[-1]
                       if isinstance(r, torch.Tensor) and r.dtype == torch.int32), "old lengths replayed"


@pytest.mark.parametrize("need_lse", [False, True])
def test_a_compiled_training_step_replays_the_backward_plan(plans, monkeypatch, need_lse):
    """Under ``torch.compile`` the traced backward fills the gradient of an lse nobody asked for with
    zeros; the backward must still take the call as one without an lse gradient, and so replay its
    plan like the eager call does. With the lse returned (and used), its gradient is real."""
    def step(q, k, v, lengths):
        bias = ba.BlockDiagonalMask.from_seqlens(lengths).make_causal()
        if need_lse:
            out, lse = ba.attention_with_lse(q, k, v, bias, op="triton")
            return out + lse[..., None]
        return ba.attention(q, k, v, bias, op="triton")

    from biasattn.ops.triton import flash, options

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    replays = []
    real_run = plans.Plan.run
    monkeypatch.setattr(plans.Plan, "run", lambda self, roles: replays.append(self) or real_run(self, roles))
    steps = [[5, 19], [20, 4], [1, 23], [12, 12], [24, 0]]  # the fifth compiled step replays
    for call, lengths in enumerate(steps[:2] if need_lse else steps):
        q, k, v, dout = (t.requires_grad_() for t in _tensors(seed=call))
        lengths = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        del replays[:]
        got = torch.autograd.grad(compiled(q, k, v, lengths), (q, k, v), dout)
        compiled_replays = list(replays)
        with options.use(plans=False):
            want = torch.autograd.grad(step(q, k, v, lengths), (q, k, v), dout)
        for what, a, b in zip(("dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, msg=lambda m, what=what, call=call: f"call {call}, {what}: {m}")
    backward = [v for key, v in flash._SHARED_PLANS.items() if key[0][:2] == ("launch plan", "bwd")]
    if not need_lse:
        assert any(type(p) is plans.Plan and p in compiled_replays for p in backward), \
            "the compiled backward did not replay its plan"


@pytest.mark.parametrize("name", ["causal", "documents"])
def test_a_new_scale_every_call_replays_the_same_plan(triton_options, plans, monkeypatch, name):
    """The softmax scale is a role of a plan, not part of its key (a learned temperature changes it every
    step): calls with a new scale each time settle one plan per pass and replay it with their own scale,
    equal bit for bit to the unplanned launches."""
    bias = _biases()[name].to(DEVICE)
    replays = []
    real_run = plans.Plan.run
    monkeypatch.setattr(plans.Plan, "run", lambda self, roles: replays.append(roles) or real_run(self, roles))
    for call in range(6):
        q, k, v, dout = _tensors(seed=call)
        scale = 0.1 + 0.07 * call
        before = len(replays)
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
        out = ba.attention(q_, k_, v_, bias, scale=scale, op="triton")
        planned = (out, *torch.autograd.grad(out, (q_, k_, v_), dout))
        triton_options(plans=False)
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
        out = ba.attention(q_, k_, v_, bias, scale=scale, op="triton")
        plain = (out, *torch.autograd.grad(out, (q_, k_, v_), dout))
        triton_options(plans=True)
        for what, a, b in zip(("out", "dq", "dk", "dv"), planned, plain):
            assert torch.equal(a, b), f"call {call}: {what} differs from the unplanned launches"
        if call >= 4:
            assert len(replays) - before == 2, f"call {call} replays the forward's and the backward's plans"
            assert scale in [r for r in replays[-1] if type(r) is float], "the call's own scale was not replayed"
    spec = make_inputs(q, k, v, bias).spec
    assert len(_stored(spec, "fwd")) == 1 and len(_stored(spec, "bwd")) == 1


def test_strides_and_aliases_are_part_of_the_signature(plans):
    """A plan fills its tensors by position: a view with other strides, or k and v that stop being
    one tensor, must not reuse a plan recorded without them."""
    bias = ba.LowerTriangularMask()
    q, k, v, _ = _tensors(Mq=20, Mk=20)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    for args in ((q, k, k), (q, k, v), (qt, k, v)):  # k is v first: a plan with one tensor in both places
        for _ in range(4):
            got = ba.attention(*args, bias, op="triton")
        torch.testing.assert_close(got, ba.attention(*args, bias, op="reference"), atol=1e-5, rtol=1e-5)
    assert len(_stored(make_inputs(q, k, v, bias).spec, "fwd")) == 3


def test_a_layout_changed_in_place_gets_its_own_plan():
    """Tile lists come from the block layout: editing it in place must not replay the old lists."""
    layout = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)[None, None].to(DEVICE)
    bias = ba.BlockSparseMask(layout, 16)  # blocks the size of the interpreter's tiles: lists of whole tiles
    q, k, v, _ = _tensors(Mq=32, Mk=32)
    for _ in range(4):
        ba.attention(q, k, v, bias, op="triton")
    layout[0, 0, 0, 1] = True
    got = ba.attention(q, k, v, bias, op="triton")
    torch.testing.assert_close(got, ba.attention(q, k, v, bias, op="reference"), atol=1e-5, rtol=1e-5)


def test_a_draft_keeps_no_tensor_of_its_call():
    q, k, v, _ = _tensors()
    bias = ba.LowerTriangularMask()
    gc.disable()
    try:
        spec = make_inputs(q, k, v, bias).spec
        for _ in range(3):  # the second recorded call of a signature leaves a draft behind
            out = ba.attention(q, k, v, bias, op="triton")
            if any(isinstance(s, tuple) for s in _stored(spec, "fwd")):
                break
        else:
            raise AssertionError("no draft after three calls")
        ref = weakref.ref(out)
        del out
        assert ref() is None
    finally:
        gc.enable()


def test_no_plan_under_forced_configs_or_with_dropout(plans):
    from biasattn.ops.triton import configs

    bias = ba.LowerTriangularMask()
    q, k, v, _ = _tensors(Mq=16, Mk=16)
    with configs.override(fwd=configs.TileConfig(16, 16, 4, 1)):
        for _ in range(3):
            ba.attention(q, k, v, bias, op="triton")
    for _ in range(3):
        ba.attention(q, k, v, bias, op="triton", dropout_p=0.3)
    assert _stored(make_inputs(q, k, v, bias).spec, "fwd") == []


class _Launcher:
    """Stands in for a direct launcher: ``fire`` keeps what it was given."""

    def __init__(self):
        self.fired = []

    def fire(self, grid, args, meta, entry):
        self.fired.append((grid, args, meta))


def _record(plans, launcher, args):
    with plans.recording() as rec:
        plans.active().launches.append((launcher, (4, 1), args, {"BLOCK": 16}, None))
    return rec


def test_recordings_that_differ_outside_their_roles_refuse_the_signature(plans):
    launcher, scratch = _Launcher(), torch.zeros(2)
    a, b, c = (torch.zeros(3) for _ in range(3))
    store = {"key": plans._SEEN}
    plans.settle(store, "key", _record(plans, launcher, (a, scratch, 7)), (a,))
    assert plans.lookup(store, "key") is None, "one recording is only a draft"
    plans.settle(store, "key", _record(plans, launcher, (b, scratch, 7)), (b,))
    plan = plans.lookup(store, "key")
    assert plan is not None
    plan.run((c,))
    assert launcher.fired[-1][1][0] is c and launcher.fired[-1][1][1] is scratch
    for second in ((b, scratch, 8), (b, torch.zeros(2), 7)):  # a per-call value, a per-call tensor
        store = {"key": plans._SEEN}
        plans.settle(store, "key", _record(plans, launcher, (a, scratch, 7)), (a,))
        plans.settle(store, "key", _record(plans, launcher, second), (b,))
        assert plans.lookup(store, "key") is None and store["key"] == plans._REFUSED


def test_invalid_recordings_are_not_kept(plans):
    store, launcher = {}, _Launcher()
    with plans.recording() as rec:
        plans.invalidate()
    rec.launches.append((launcher, (1,), (torch.zeros(1),), {}, None))
    plans.settle(store, "key", rec, ())
    assert store == {}


# ------------------------------------------------------------------------------------ split-KV
SPLITK = ba.ops.get("triton_splitk") if "triton_splitk" in ba.ops.available() else None


def _decode_biases():
    return {
        "none": None,
        "padded": ba.PaddedKeysMask([150, 7, 0]),
        "padded_causal": ba.PaddedKeysMask([150, 7, 3]) & ba.LowerTriangularFromBottomRightMask(),
        "window_alibi": ba.LocalAttentionMask(window_left=9, window_right=0) + ba.ALiBi(ba.ALiBi.standard_slopes(4)),
        "additive": ba.AdditiveBias(torch.randn(3, 4, 2, 200)),
    }


@pytest.mark.skipif(SPLITK is None or bool(SPLITK.environment_reasons(torch.device(DEVICE))),
                    reason="the triton_splitk operator cannot run here")
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", list(_decode_biases()))
def test_split_kv_replays_equal_the_launches_they_replace(triton_options, plans, monkeypatch, name, splits):
    """Decode steps through ``triton_splitk``: from the fourth call of a signature its launches are
    replayed (the merge too, when the keys are split), with the same bits as the full path, though every
    call has a scale of its own (a role of the plan, not part of its key)."""
    from biasattn.ops.triton import splitk

    original = splitk.choose_num_splits
    monkeypatch.setattr(splitk, "choose_num_splits", lambda *a, **kw: splits if splits > 1 else original(*a, **kw))
    if splits > 1:  # an eager GPU call would not split these short caches at all
        monkeypatch.setattr(splitk, "EAGER_NO_SPLIT_KEYS", 0)
    bias = _decode_biases()[name]
    bias = bias.to(DEVICE) if bias is not None else None
    replays = []
    real_run = plans.Plan.run
    monkeypatch.setattr(plans.Plan, "run", lambda self, roles: replays.append(self.note) or real_run(self, roles))
    gen = torch.Generator().manual_seed(0)
    for call in range(5):
        q = torch.randn(3, 4, 2, 16, generator=gen).to(DEVICE)
        k, v = (torch.randn(3, 2, 200, 16, generator=gen).to(DEVICE) for _ in range(2))  # 4+ key tiles on the GPU too
        before = len(replays)
        scale = 0.2 + 0.05 * call
        planned = ba.attention_with_lse(q, k, v, bias, scale=scale, op="triton_splitk")
        triton_options(plans=False)
        plain = ba.attention_with_lse(q, k, v, bias, scale=scale, op="triton_splitk")
        triton_options(plans=True)
        for what, a, b in zip(("out", "lse"), planned, plain):
            assert torch.equal(a, b), f"call {call}: {what} differs from the unplanned launches"
        assert len(replays) - before == (1 if call >= 3 else 0), f"call {call}"
    if splits > 1:
        assert replays[-1] > 1, "the replayed plan launches the merge"


@pytest.mark.skipif(SPLITK is None or bool(SPLITK.environment_reasons(torch.device(DEVICE))),
                    reason="the triton_splitk operator cannot run here")
def test_split_kv_calls_with_forced_splits_are_never_planned(plans):
    from biasattn.ops.triton.splitk import splitk_attention_fwd

    q = torch.randn(1, 2, 9, 16).to(DEVICE)
    k, v = torch.randn(1, 1, 30, 16).to(DEVICE), torch.randn(1, 1, 30, 16).to(DEVICE)
    forced = make_inputs(q, k, v, ba.PaddedKeysMask([30]).to(DEVICE))
    for _ in range(4):
        splitk_attention_fwd(forced, num_splits=2)
    assert not any(isinstance(key, tuple) and key[0] == "split-KV plan" for key in forced.spec.derived)
    for _ in range(4):
        splitk_attention_fwd(forced)
    stored = [val for key, val in forced.spec.derived.items() if isinstance(key, tuple) and key[0] == "split-KV plan"]
    assert len(stored) == 1 and type(stored[0]) is plans.Plan


@pytest.mark.skipif(SPLITK is None or bool(SPLITK.environment_reasons(torch.device(DEVICE))),
                    reason="the triton_splitk operator cannot run here")
@pytest.mark.parametrize("causal", [False, True], ids=["padded", "padded+causal"])
def test_split_kv_plans_serve_a_mask_built_anew_every_step(triton_options, plans, monkeypatch, causal):
    """A decode loop that builds its cache-length mask every step (a new spec each time) replays a plan
    shared by those specs, with the step's own lengths: the same bits as the full path, and a plan
    only for steps whose lengths give the same launch."""
    from biasattn.ops.triton import splitk

    replays, shapes = [], []
    real_run = plans.Plan.run
    monkeypatch.setattr(plans.Plan, "run", lambda self, roles: replays.append(roles[-1]) or real_run(self, roles))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 1, 16, generator=gen).to(DEVICE)
    k, v = (torch.randn(3, 1, 200, 16, generator=gen).to(DEVICE) for _ in range(2))  # 3 pairs: lengths set the split
    steps = [[150 + i, 7 + i, i % 2] for i in range(6)] + [[200, 200, 200]] * 4  # the last lengths split otherwise
    for step, lengths in enumerate(steps):
        bias = ba.PaddedKeysMask(lengths, device=DEVICE)
        if causal:  # one query per sequence: the causal mask hides nothing and lowers away
            bias = ba.LowerTriangularFromBottomRightMask() & bias
        before = len(replays)
        planned = ba.attention_with_lse(q, k, v, bias, op="triton_splitk")
        shapes.append(splitk.launch_shape(make_inputs(q, k, v, bias)))
        triton_options(plans=False)
        plain = ba.attention_with_lse(q, k, v, bias, op="triton_splitk")
        triton_options(plans=True)
        for what, a, b in zip(("out", "lse"), planned, plain):
            assert torch.equal(a, b), f"step {step}: {what} differs from the unplanned launches"
        if len(replays) > before:
            assert torch.equal(replays[-1].cpu(), torch.tensor(lengths, dtype=torch.int32)), "replayed with old lengths"
    if DEVICE == "cpu":  # the interpreter's split choice; a GPU's follows its multiprocessor count
        assert len(set(shapes)) > 1, "the steps should cover several launch shapes"
    seen: dict = {}
    for shape in shapes:  # a launch shape's first three steps record its plan, later ones replay it
        seen[shape] = seen.get(shape, 0) + 1
    expected = sum(max(0, n - 3) for n in seen.values())
    assert expected > 0 and len(replays) == expected


def test_launch_options_change_for_a_block_and_key_plans_by_value():
    """options.use changes choices for a block and restores them; an unknown name raises; equal choices
    make equal plan keys, so a plan recorded before a block is found again after it."""
    from biasattn.ops.triton import options

    before = options.current()
    with options.use(fused_delta=False, plans=False) as inside:
        assert options.current() is inside and not inside.fused_delta and not inside.plans
        assert inside != before
    assert options.current() is before
    with pytest.raises(TypeError):
        with options.use(no_such_option=True):
            pass
    assert options.current() is before
    again = options.Options(**{f: getattr(before, f) for f in before.__dataclass_fields__})
    assert again == before and hash(again) == hash(before) and {before: 1}[again] == 1


@pytest.fixture
def gluon_modules_forgotten():
    """Leave the Gluon modules unimported after the test, as off an sm_90 GPU (``test_triton.py`` checks that)."""
    import sys

    from biasattn.ops.triton import flash, flash_bwd

    package = sys.modules["biasattn.ops.triton"]
    absent = [name for name in ("gluon_forward", "gluon_backward") if f"{package.__name__}.{name}" not in sys.modules]
    yield
    for name in absent:
        sys.modules.pop(f"{package.__name__}.{name}", None)
        if hasattr(package, name):
            delattr(package, name)
    flash._gluon_forward.cache_clear()
    flash_bwd._gluon_backward.cache_clear()


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("name", ["none", "causal", "documents"])
def test_every_descriptor_of_a_gluon_backward_launch_is_a_role(monkeypatch, gluon_modules_forgotten, name, D):
    """Each tensor descriptor a Gluon backward launches with is a role of its plan (the launch traced on the CPU,
    the kernel not run): descriptors are built per call, so one outside the roles would differ from call to
    call, and the signature would never settle into a plan."""
    from triton.runtime.jit import JITFunction

    from biasattn.bias.spec import lower
    from biasattn.ops.triton import flash, flash_bwd

    try:
        from biasattn.ops.triton import gluon_backward  # noqa: F401
    except Exception as e:  # a Triton whose Gluon lacks what the kernel uses
        pytest.skip(f"the installed Triton's Gluon cannot import the kernel: {e}")
    settled = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kwargs: None)
    monkeypatch.setattr(flash_bwd.plans, "settle", lambda store, key, rec, roles, note=None: settled.append((rec, roles)))
    B, H, M = (1 if name == "documents" else 2), 2, 256
    bias = {"none": None, "causal": ba.LowerTriangularMask(),
            "documents": ba.BlockDiagonalMask.from_seqlens([128, 64, 64]).make_causal()}[name]
    q, k, v = (torch.randn(B, H, M, D, dtype=torch.float16) for _ in range(3))
    grads = [torch.empty_like(t) for t in (k, v)]
    flash_bwd._gluon_bwd(q, k, v, torch.zeros_like(q), torch.zeros(B, H, M), torch.zeros_like(q), None,
                         lower(bias, B, H, M, M), D ** -0.5, D ** -0.5 * flash.LOG2E, *grads, {}, None, ())
    (rec, roles), = settled
    descs = [a for launch in rec.launches for a in launch[2] if "block_shape" in getattr(type(a), "__dataclass_fields__", ())]
    assert len(descs) >= 7 and all(any(a is r for r in roles) for a in descs)
