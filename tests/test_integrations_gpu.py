"""GPU: the transformers backend and a compiled training step of MultiheadAttention through the triton operator."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch import nn

import biasattn as ba
from biasattn.nn import MultiheadAttention

pytestmark = pytest.mark.gpu

needs_triton = pytest.mark.skipif("triton" not in ba.ops.available(), reason="the triton operator is not part of this build")


def _right_padding(lengths, S):
    return torch.arange(S, device="cuda")[None, :] >= torch.tensor(lengths, device="cuda")[:, None]  # True = padding


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_training_step_through_triton(dtype):
    torch._dynamo.reset()
    torch.manual_seed(0)
    E, H, B, L = 256, 4, 3, 200
    ref = nn.MultiheadAttention(E, H, batch_first=True, device="cuda", dtype=dtype)
    mod = MultiheadAttention.from_torch(ref)
    x = torch.randn(B, L, E, device="cuda", dtype=dtype, requires_grad=True)
    kpm = _right_padding([200, 131, 77], L)

    def step(m, x):
        return m(x, x, x, key_padding_mask=kpm, is_causal=True)[0].float().square().mean()

    cnt = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, fullgraph=True, backend=cnt)
    with ba.use_ops("triton"):
        loss = compiled(mod, x)
        grads = torch.autograd.grad(loss, [x, *mod.parameters()])
        eager_loss = step(mod, x)
        eager_grads = torch.autograd.grad(eager_loss, [x, *mod.parameters()])
    assert cnt.frame_count == 1
    causal = torch.ones(L, L, dtype=torch.bool, device="cuda").triu(1)
    ref_loss = ref(x, x, x, key_padding_mask=kpm, attn_mask=causal, need_weights=False)[0].float().square().mean()
    ref_grads = torch.autograd.grad(ref_loss, [x, *ref.parameters()])
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(loss, eager_loss, **tol)
    torch.testing.assert_close(loss, ref_loss, **tol)
    for g, e, r in zip(grads, eager_grads, ref_grads):
        torch.testing.assert_close(g, e, **tol)
        torch.testing.assert_close(g.float(), r.float(), atol=tol["atol"] * 5, rtol=tol["rtol"] * 5)


def test_compiled_step_with_dispatcher_choice():
    """Without use_ops the dispatcher may pick a vendor kernel whose backward needs objects kept from the forward."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mod = MultiheadAttention(128, 2, batch_first=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(m, x):
        return m(x, x, x, is_causal=True)[0].float().square().mean()

    loss = torch.compile(step, fullgraph=True)(mod, x)
    grads = torch.autograd.grad(loss, [x, *mod.parameters()])
    eager = torch.autograd.grad(step(mod, x), [x, *mod.parameters()])
    for g, e in zip(grads, eager):
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)


@needs_triton
@pytest.mark.parametrize("band", ["make_causal", "make_causal_from_bottom_right"])
def test_compiled_packed_documents_built_inside_from_gpu_lengths(band):
    """A compiled step that builds its packed-document mask from a GPU tensor of lengths, as a data loader
    hands them over: it traces with fullgraph, matches eager and compiles one graph for new lengths."""
    torch._dynamo.reset()
    cnt = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def fn(q, k, v, lengths):
        return ba.attention(q, k, v, getattr(ba.BlockDiagonalMask.from_seqlens(lengths), band)())

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=cnt)
    g = torch.Generator(device="cuda").manual_seed(0)
    # 4 heads: no size of q equal to a document count (Dynamo's duck sizing would tie the two)
    q, k, v = (torch.randn(1, 4, 96, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    for lengths in ([40, 56], [10, 30, 56], [7, 89], [1, 2, 93]):
        lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
        torch.testing.assert_close(compiled(q, k, v, lens), fn(q, k, v, lens), atol=0, rtol=0)
    assert sum(len(gr.graph.nodes) > 0 for gr in cnt.graphs) == 1



@needs_triton
@pytest.mark.parametrize("mask", ["documents", "causal"])
def test_reduce_overhead_replays_training_steps_with_new_documents(mask):
    """``torch.compile(mode="reduce-overhead")``: a training step whose packed-document mask is built
    inside from a GPU tensor of lengths (tile tables on the ``triton`` path), or a causal one (cuDNN),
    runs in CUDA graph trees; each step's output and gradients match eager ones with its own lengths,
    and dropout there is refused with a clear error."""
    torch._dynamo.reset()

    def fn(q, k, v, lengths, p=0.0):
        bias = ba.BlockDiagonalMask.from_seqlens(lengths).make_causal() if mask == "documents" else ba.LowerTriangularMask()
        return ba.attention(q, k, v, bias, dropout_p=p)

    compiled = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    for lengths in ([40, 56, 160], [100, 100, 56], [1, 254, 1], [40, 56, 160], [200, 50, 6]):
        lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
        out = compiled(q, k, v, lens)
        got = (out.clone(), *(t.clone() for t in torch.autograd.grad(out, (q, k, v), dout)))
        ref = fn(q, k, v, lens)
        expected = (ref, *torch.autograd.grad(ref, (q, k, v), dout))
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):  # cuDNN's backward may add in any order
            tol = dict(atol=0, rtol=0) if mask == "documents" else dict(atol=1e-2, rtol=1.6e-2)
            torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name, lengths=lengths: f"{name}, {lengths}: {m}")
    with pytest.raises(RuntimeError, match="dropout_p=0.1"):
        compiled(q, k, v, lens, 0.1)


@needs_triton
def test_default_mode_calls_beside_graph_trees_are_not_inside_them():
    """A default-mode compiled call made while torch's CUDA-graph trees sit in warm-up (right after a
    ``reduce-overhead`` function's first call) runs outside the trees: it is not taken for a call
    inside them, so dropout works there; inside the trees it is refused."""
    from torch._inductor import cudagraph_trees

    from biasattn.ops.custom_ops import _in_graph_trees

    torch._dynamo.reset()

    def fn(q, k, v, p):
        return ba.attention(q, k, v, ba.LowerTriangularMask(), dropout_p=p, op="triton")

    graphed = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
    plain = torch.compile(fn, fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
               for _ in range(3))
    graphed(q, k, v, 0.0)
    manager = cudagraph_trees.get_manager(q.device.index, create_if_none_exists=False)
    assert manager is not None and manager.in_warmup  # the case under test: the trees in warm-up
    assert not _in_graph_trees(q.device)
    out = plain(q, k, v, 0.1)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert all(torch.isfinite(t).all() for t in (out, *grads))
    assert not torch.equal(out, fn(q, k, v, 0.0))  # dropped
    with pytest.raises(RuntimeError, match="dropout_p=0.1"):
        graphed(q, k, v, 0.1)


@needs_triton
def test_transformers_llama_through_triton():
    transformers = pytest.importorskip("transformers")
    import biasattn.integrations.transformers as bt

    bt.register()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    mask = (torch.arange(96, device="cuda")[None] < torch.tensor([96, 60, 17], device="cuda")[:, None]).long()
    ids = torch.randint(0, 101, mask.shape, device="cuda")
    out = {}
    for impl in ("sdpa", "biasattn"):
        model.set_attn_implementation(impl)
        with torch.no_grad(), ba.use_ops("triton"):
            out[impl] = model(input_ids=ids, attention_mask=mask).logits.float()
    valid = mask.bool()
    torch.testing.assert_close(out["biasattn"][valid], out["sdpa"][valid], atol=5e-2, rtol=5e-2)
