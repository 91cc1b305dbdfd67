"""``triton_splitk`` on the GPU: realistic decode sizes, bf16/fp16, every head layout, CUDA graphs, compile."""

from __future__ import annotations

import pytest
import torch

import biasattn as ba
from biasattn import dispatch
from biasattn.inputs import make_inputs

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    from test_splitk import assert_close_to_reference, run_poisoned

CUDA = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
HEADS = [(32, 32), (32, 8), (32, 4), (32, 1)]  # 1:1, 4:1, 8:1, MQA


def rand(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device=CUDA, dtype=dtype)


def decode_inputs(B, Hq, Hkv, Mq, Mk, dtype, D=128, seed=0):
    return rand(B, Hq, Mq, D, dtype=dtype, seed=seed), rand(B, Hkv, Mk, D, dtype=dtype, seed=seed + 1), \
        rand(B, Hkv, Mk, D, dtype=dtype, seed=seed + 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("Mq", [1, 4, 16])
def test_decode_with_mixed_cache_lengths(dtype, heads, Mq):
    Mk = 4113
    q, k, v = decode_inputs(3, *heads, Mq, Mk, dtype)
    bias = ba.PaddedKeysMask([1, 1000, Mk], device=CUDA)
    if Mq > 1:
        bias = bias & ba.LowerTriangularFromBottomRightMask().to(CUDA)
    for s in (None, 7):
        inp = make_inputs(q, k, v, bias)
        assert_close_to_reference(*run_poisoned(inp, num_splits=s), inp)


def test_short_caches_in_two_16_row_blocks_and_one_tile_pieces():
    """Hopper launches of short caches: an MQA group of 32 heads over 56 sequences runs two 16-row
    blocks per pair, unsplit; a small GQA call splits into one-tile pieces of two stages. Both exact
    with mixed lengths, including 1 and 0."""
    from biasattn.ops.triton import splitk

    hopper = torch.cuda.get_device_capability(CUDA)[0] == 9
    q, k, v = decode_inputs(56, 32, 1, 1, 1024, torch.bfloat16)
    inp = make_inputs(q, k, v, ba.PaddedKeysMask([1024, 1, 0, 700] * 14, device=CUDA))
    shape = splitk.launch_shape(inp)
    if hopper and splitk.num_sms(CUDA) >= 112:
        assert (shape.config.block_m, shape.config.block_n, shape.row_blocks, shape.num_splits) == (16, 128, 2, 1), shape
    assert_close_to_reference(*run_poisoned(inp), inp)
    q, k, v = decode_inputs(1, 32, 8, 1, 1024, torch.bfloat16)
    inp = make_inputs(q, k, v, ba.PaddedKeysMask([1000], device=CUDA))
    shape = splitk._launch_shape(inp, 1, 1, 16, None)  # 16 splits of one 64-key tile
    assert shape.tiles_per_split == 1 and shape.config.num_stages == 2, shape
    assert_close_to_reference(*run_poisoned(inp, num_splits=16), inp)


def test_short_caches_run_unsplit_eagerly_and_split_inside_a_graph_capture():
    """An eager call on a cache of at most ``EAGER_NO_SPLIT_KEYS`` keys makes one launch: the merge and
    the partial buffers would cost the host more than splitting saves the GPU. Captured in a CUDA
    graph, where launches cost no host time, the same call splits. Both exact."""
    from biasattn.ops.triton import splitk

    q, k, v = decode_inputs(1, 8, 8, 1, 512, torch.bfloat16)
    bias = ba.PaddedKeysMask(torch.tensor([400], dtype=torch.int32, device=CUDA))
    inp = make_inputs(q, k, v, bias)
    assert splitk.launch_shape(inp).num_splits == 1
    assert_close_to_reference(*run_poisoned(inp), inp)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ba.attention(q, k, v, bias, op="triton_splitk")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = splitk.launch_shape(inp)
        out, lse = ba.attention_with_lse(q, k, v, bias, op="triton_splitk")
    assert captured.num_splits > 1, captured
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_reference(out, lse, inp)


@pytest.mark.parametrize("lengths", [[131072, 1], [65537, 0]])
def test_cache_lengths_up_to_128k(lengths):
    q, k, v = decode_inputs(2, 8, 2, 1, 131072, torch.bfloat16)
    inp = make_inputs(q, k, v, ba.PaddedKeysMask(lengths, device=CUDA))
    assert_close_to_reference(*run_poisoned(inp), inp)


@pytest.mark.parametrize("heads, Mq", [((32, 1), 4), ((32, 4), 16), ((24, 1), 4)])
def test_groups_of_65_to_128_rows_on_long_caches(heads, Mq):
    """65-128 packed rows on a long cache: on Hopper two 64-row warp-group blocks per (sequence, KV
    head) pair (96 rows: the second block half padding), split; exact with mixed lengths, a causal
    band, and rows that see no key."""
    from biasattn.ops.triton import splitk

    Mk = 8192 + 77
    q, k, v = decode_inputs(3, *heads, Mq, Mk, torch.bfloat16)
    bias = ba.PaddedKeysMask([Mk, 4000, 1], device=CUDA) & ba.LowerTriangularFromBottomRightMask().to(CUDA)
    inp = make_inputs(q, k, v, bias)
    shape = splitk.launch_shape(inp)
    if torch.cuda.get_device_capability(CUDA)[0] == 9:
        assert (shape.config.block_m, shape.row_blocks) == (64, 2) and shape.num_splits > 1, shape
    assert_close_to_reference(*run_poisoned(inp), inp)


def test_key_slice_beyond_2_31_elements():
    """A cache laid out [B, Mk, Hkv, D] whose (sequence, KV head) slice spans more than 2**31 elements:
    the key offsets switch to 64 bits. Two of the heads are checked against the reference."""
    Hkv, D = 8, 128
    Mk = 2**31 // (Hkv * D) + 5
    store = [rand(1, Mk, Hkv, D, seed=s) for s in (1, 2)]
    k, v = (t.transpose(1, 2) for t in store)  # [1, Hkv, Mk, D], key stride Hkv * D
    assert (Mk - 1) * k.stride(2) >= 2**31
    q = rand(1, Hkv, 1, D, seed=3)
    lengths = [Mk - 3]
    out, lse = run_poisoned(make_inputs(q, k, v, ba.PaddedKeysMask(lengths, device=CUDA)))
    heads = [0, Hkv - 1]
    small = make_inputs(q[:, heads], k[:, heads].contiguous(), v[:, heads].contiguous(),
                        ba.PaddedKeysMask(lengths, device=CUDA))
    del store, k, v  # the reference needs only the two heads
    assert_close_to_reference(out[:, heads], lse[:, heads], small)


def test_window_alibi_and_additive():
    q, k, v = decode_inputs(2, 16, 4, 2, 20000, torch.float16)
    slopes = ba.ALiBi.standard_slopes(16).to(CUDA)
    for bias in (
        ba.LocalAttentionMask(window_left=1000).to(CUDA),
        ba.PaddedKeysMask([20000, 777], device=CUDA) + ba.ALiBi(slopes),
        ba.AdditiveBias(rand(2, 16, 1, 20000, dtype=torch.float16)) + ba.LowerTriangularFromBottomRightMask().to(CUDA),
    ):
        inp = make_inputs(q, k, v, bias)
        assert_close_to_reference(*run_poisoned(inp), inp)


def test_packed_decoding():
    q_lens = [1, 4, 1, 2] * 8
    kv_lens = [int(x) for x in torch.randint(0, 9000, (32,), generator=torch.Generator().manual_seed(1))]
    bias = ba.BlockDiagonalMask.from_seqlens(q_lens, kv_lens, device=CUDA).make_causal_from_bottom_right()
    q, k, v = decode_inputs(1, 32, 8, sum(q_lens), sum(kv_lens), torch.bfloat16)
    inp = make_inputs(q, k, v, bias)
    assert_close_to_reference(*run_poisoned(inp), inp)


def test_cuda_graph_capture_and_replay_with_new_lengths():
    """A captured call reads the cache lengths and inputs of each replay (no host sync, no realloc)."""
    B, Hq, Hkv, Mk = 4, 32, 8, 8192
    q, k, v = decode_inputs(B, Hq, Hkv, 1, Mk, torch.bfloat16)
    lengths = torch.tensor([Mk, 100, 1, 5000], dtype=torch.int32, device=CUDA)
    bias = ba.PaddedKeysMask(lengths)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            ba.attention(q, k, v, bias, op="triton_splitk")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ba.attention(q, k, v, bias, op="triton_splitk")
    new = [3, Mk, 4097, 0]
    bias.kv_seqlens.copy_(torch.tensor(new, dtype=torch.int32))
    q.copy_(rand(*q.shape, seed=9))
    k.copy_(rand(*k.shape, seed=10))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    inp = make_inputs(q, k, v, ba.PaddedKeysMask(new, device=CUDA))
    _, lse = ba.attention_with_lse(q, k, v, ba.PaddedKeysMask(new, device=CUDA), op="triton_splitk")
    assert_close_to_reference(out, lse, inp)


@pytest.mark.parametrize("heads", [(32, 1), (32, 8)])
def test_merge_as_programmatic_dependent_launch(triton_options, monkeypatch, heads):
    """On Hopper the merge starts as a programmatic dependent of the split kernel: the same bits as two
    plain launches, eagerly and inside a CUDA graph, with the partials written just before."""
    from biasattn.ops.triton import splitk

    if not splitk.pdl_available(CUDA):
        pytest.skip("programmatic dependent launch needs compute capability 9.0 and a Triton with it")
    q, k, v = decode_inputs(4, *heads, 1, 8192, torch.bfloat16)
    bias = ba.PaddedKeysMask([8192, 3000, 1, 0], device=CUDA)
    inp = make_inputs(q, k, v, bias)
    triton_options(split_kv_pdl=False)
    plain = run_poisoned(inp, num_splits=16)
    triton_options(split_kv_pdl=True)
    eager = run_poisoned(inp, num_splits=16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = splitk.splitk_attention_fwd(inp, num_splits=16)
    for t in captured:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for a, b, c in zip(plain, eager, captured):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert_close_to_reference(*eager, inp)


def test_no_host_sync_per_call():
    q, k, v = decode_inputs(2, 32, 8, 1, 8192, torch.bfloat16)
    bias = ba.PaddedKeysMask([8192, 10], device=CUDA)
    ba.attention(q, k, v, bias, op="triton_splitk")  # lowers and caches the spec, compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ba.attention(q, k, v, bias, op="triton_splitk")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_cache_one_key_longer_reuses_the_compiled_kernels(monkeypatch):
    """Decode steps against a growing cache change Mk on every call: the launches find the kernels
    compiled for the last step by their specialization, without Triton's binding, and stay exact."""
    from biasattn.ops.triton import splitk

    K, V = (rand(2, 8, 300, 128, seed=s) for s in (1, 2))
    q = rand(2, 32, 1, 128, seed=3)
    inp = make_inputs(q, K[:, :, :200], V[:, :, :200])
    run_poisoned(inp, num_splits=3)  # compiles split and merge kernels for this specialization

    class Unbound:
        def __getitem__(self, grid):
            raise AssertionError("a launch went through Triton's binding")

    for kernel in (splitk._split, splitk._merge):
        monkeypatch.setattr(kernel, "kernel", Unbound())
    for Mk in (201, 203, 215, 257):  # none is 1 or a multiple of 16, as 200 is not
        inp = make_inputs(q, K[:, :, :Mk], V[:, :, :Mk])
        assert_close_to_reference(*run_poisoned(inp, num_splits=3), inp)


def test_torch_compile():
    q, k, v = decode_inputs(2, 32, 8, 1, 3000, torch.float16)

    def f(q, k, v):
        return ba.attention(q, k, v, op="triton_splitk") * 2

    got = torch.compile(f)(q, k, v)
    want = ba.attention(q, k, v, op="triton_splitk") * 2
    torch.testing.assert_close(got, want)


def test_dispatcher_prefers_splitk_for_decoding():
    q, k, v = decode_inputs(1, 64, 1, 1, 32768, torch.bfloat16)  # 64 query heads per KV head
    fwd, _ = dispatch.choose(make_inputs(q, k, v))
    assert fwd.NAME == "triton_splitk"
    assert "triton_splitk  chosen" in ba.explain(q, k, v)
    q4, k8, v8 = decode_inputs(1, 32, 8, 4, 32768, torch.bfloat16)  # 4 queries per sequence
    assert dispatch.choose(make_inputs(q4, k8, v8))[0].NAME == "triton_splitk"
    lens = ba.PaddedKeysMask([30000], device=CUDA)  # cuDNN would read the padded keys
    assert dispatch.choose(make_inputs(q4[:, :, :1], k8, v8, lens))[0].NAME == "triton_splitk"
    q2 = rand(1, 32, 64, 128)
    assert "handles at most Mq=16" in ba.explain(q2, k, v)


def test_dispatcher_prefers_cudnn_for_single_query_decoding_of_small_groups():
    q, k, v = decode_inputs(2, 32, 8, 1, 8192, torch.bfloat16)
    assert dispatch.choose(make_inputs(q, k, v))[0].NAME == "cudnn"
    out, lse = ba.attention_with_lse(q, k, v)
    assert_close_to_reference(out, lse, make_inputs(q, k, v))


def test_dispatcher_prefers_splitk_for_single_queries_inside_a_graph_capture():
    """Captured, only GPU time counts: the same step goes to triton_splitk and replays its eager result;
    the eager choice kept for these inputs (cudnn) does not leak into the capture, nor back."""
    q, k, v = decode_inputs(2, 32, 8, 1, 8192, torch.bfloat16)
    chosen = [dispatch.choose(make_inputs(q, k, v))[0].NAME]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ba.attention(q, k, v, op="triton_splitk")  # compiled before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chosen.append(dispatch.choose(make_inputs(q, k, v))[0].NAME)
        out = ba.attention(q, k, v)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    chosen.append(dispatch.choose(make_inputs(q, k, v))[0].NAME)
    assert chosen == ["cudnn", "triton_splitk", "cudnn"]
    assert torch.equal(out, ba.attention(q, k, v, op="triton_splitk"))


def test_merge_attentions_uses_the_shared_kernel():
    outs = [rand(2, 8, 3, 64, dtype=torch.float32, seed=s) for s in range(5)]
    lses = [rand(2, 8, 3, dtype=torch.float32, seed=10 + s) for s in range(5)]
    lses[0][0, 0, 0] = float("-inf")
    out, lse = ba.merge_attentions(outs, lses)
    from biasattn.ops.merge import merge_partials_torch

    ref_out, ref_lse = merge_partials_torch(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [(32, 8), (32, 1)])
def test_masks_built_every_step_replay_shared_plans_with_their_own_lengths(heads, monkeypatch):
    """An eager decode loop that builds its cache-length mask every step: after three steps of one
    launch shape the launches are replayed from the plan shared by those masks, with each step's
    own lengths (a replay that kept old lengths would miss keys, or read rows of length 0)."""
    from biasattn.ops.triton import plans, splitk

    monkeypatch.setattr(splitk, "_shared_plans", {})
    replays = []
    real_run = plans.Plan.run
    monkeypatch.setattr(plans.Plan, "run", lambda self, roles: replays.append(roles[-1]) or real_run(self, roles))
    q, k, v = decode_inputs(4, *heads, 1, 8192, torch.bfloat16)
    for step in range(6):
        lengths = [8192 - step, 3000 + step, 1 + step, 0]  # the same key tiles, so the same launch, every step
        bias = ba.LowerTriangularFromBottomRightMask() & ba.PaddedKeysMask(lengths, device=CUDA)
        before = len(replays)
        out, lse = ba.attention_with_lse(q, k, v, bias, op="triton_splitk")
        assert_close_to_reference(out, lse, make_inputs(q, k, v, ba.PaddedKeysMask(lengths, device=CUDA)))
        assert len(replays) - before == (1 if step >= 3 else 0), f"step {step}"
        if step >= 3:
            assert replays[-1].tolist() == lengths


def test_explain_names_the_decode_rule_and_the_split_kv_launch():
    q, k, v = decode_inputs(4, 64, 1, 1, 8192, torch.bfloat16)
    text = ba.explain(q, k, v)
    assert "order: triton_splitk first: a decode step of 1 query per sequence with 64 query heads per KV head" in text
    assert "triton_splitk  chosen: " in text and "key tiles" in text
    q, k, v = decode_inputs(4, 32, 8, 1, 8192, torch.bfloat16)
    assert "order: cudnn before triton_splitk" in ba.explain(q, k, v)
