"""Context parallelism on GPUs: NCCL process groups of 2 (and 4) GPUs, bfloat16, the default operators.

Each method and layout is held to the dtype-relative criterion: its error against a float64
reference on the full tensors is within a small multiple of the same math done in bfloat16.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import biasattn as ba
from biasattn.testing import assert_close_to_reference, reference_attention

pytestmark = pytest.mark.gpu

WORLDS = [w for w in (2, 4) if torch.cuda.is_available() and torch.cuda.device_count() >= w]


def _bias(name: str, M: int, H: int, device):
    if name == "causal":
        return ba.LowerTriangularMask()
    if name == "documents":
        lens = [M // 8, 0, M // 2 - 5, M // 4, M - M // 8 - M // 2 + 5 - M // 4]
        return ba.BlockDiagonalMask.from_seqlens(lens, device=device).make_causal()
    if name == "window_padded":
        return ba.LocalAttentionMask(M // 5, 0) & ba.PaddedKeysMask([M - 37], device=device)
    if name == "additive_alibi":
        gen = torch.Generator(device=device).manual_seed(3)
        add = torch.randn(1, H, M, M, generator=gen, device=device).to(torch.bfloat16).requires_grad_(True)
        return ba.LowerTriangularMask() + ba.ALiBi(ba.ALiBi.standard_slopes(H).to(device)) + ba.AdditiveBias(add)
    raise ValueError(name)


def check_bf16(bias_name: str, M: int) -> None:
    """Every method and layout in bfloat16 against the float64 reference, with bfloat16 math as the yardstick."""
    rank = dist.get_rank()
    device = torch.device("cuda", rank)
    B, Hq, Hkv, D = 1, 8, 2, 64
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(s, generator=gen, device=device).to(torch.bfloat16)
                     for s in ((B, Hq, M, D), (B, Hkv, M, D), (B, Hkv, M, D), (B, Hq, M, D)))
    bias = _bias(bias_name, M, Hq, device)
    leaves = [t for a in bias.atoms for t in a.tensors().values() if t.requires_grad]
    dense = ba.testing.dense_bias(bias, (B, Hq, M, M), torch.float64, device)
    refs = {}
    for kind, dt in (("ref", torch.float64), ("low", torch.bfloat16)):
        full = [t.to(dt).requires_grad_(True) for t in (q, k, v)]
        add = dense.to(dt).requires_grad_(True)
        out, _ = reference_attention(*full, bias_dense=add, compute_dtype=dt)
        refs[kind] = (out, torch.autograd.grad(out, full + [add], dout.to(dt)))
    (ref, ref_g), (low, low_g) = refs["ref"], refs["low"]
    for layout in ba.distributed.LAYOUTS:
        for method in ba.distributed.METHODS:
            where = f"{method}/{layout}"
            local = [ba.distributed.shard_sequence(t, layout=layout).requires_grad_(True) for t in (q, k, v)]
            out = ba.distributed.context_parallel_attention(*local, bias, layout=layout, method=method)
            grads = torch.autograd.grad(out, local + leaves, ba.distributed.shard_sequence(dout, layout=layout))
            whole = ba.distributed.gather_sequence(out.detach(), layout=layout)
            assert_close_to_reference(whole, ref, low, name=f"{where} out")
            for name, g, r, lo in zip(("dq", "dk", "dv"), grads[:3], ref_g[:3], low_g[:3]):
                assert_close_to_reference(ba.distributed.gather_sequence(g, layout=layout), r, lo, factor=3.0,
                                          name=f"{where} {name}")
            for g in grads[3:]:
                g = g.float()
                dist.all_reduce(g)
                r, lo = ref_g[3].sum(0, keepdim=True), low_g[3].float().sum(0, keepdim=True)
                assert_close_to_reference(g.to(torch.bfloat16), r, lo, factor=3.0, name=f"{where} dbias")


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def pool(request):
    from test_distributed import Pool

    p = Pool(request.param, backend="nccl", module=__name__)
    yield p
    p.close()


@pytest.mark.skipif(not WORLDS, reason="needs at least 2 CUDA GPUs")
@pytest.mark.parametrize("bias_name", ["causal", "documents", "window_padded", "additive_alibi"])
def test_bf16_on_gpus_within_the_dtype_relative_bound(pool, bias_name):
    pool.run("check_bf16", bias_name, 2 * pool.world * 96)
