"""The Gluon forward (``biasattn.ops.triton.gluon_forward``): dense and causal attention at head dim 128
on sm_90, inside the ``triton`` operator. Same criterion as tests/test_triton.py (float64 reference,
low-precision reference math, NaN-poisoned outputs, the backward on its out and lse)."""

from __future__ import annotations

import pytest
import torch
from test_triton import _poison, assert_close, check, const, qkv  # noqa: F401  (_poison: autouse fixture)
from torch.nn.attention import SDPBackend, sdpa_kernel

import biasattn as ba

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs an sm_90 GPU"),
]


@pytest.fixture
def gluon_calls(triton_options, monkeypatch):
    """Every call large enough for the Gluon forward; returns the list its launches are logged in."""
    from biasattn.ops.triton import gluon_forward

    triton_options(gluon_min_scores=0)
    calls = []
    real = gluon_forward.attn_fwd

    def counted(q, k, v, out, lse, qk_scale, causal):
        calls.append((tuple(q.shape), tuple(k.shape), causal))
        return real(q, k, v, out, lse, qk_scale, causal)

    monkeypatch.setattr(gluon_forward, "attn_fwd", counted)
    return calls


@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1, 4, 4, 1024), (2, 8, 2, 384), (3, 2, 1, 128)], ids=["mha", "gqa4", "mqa"])
def test_matches_the_reference(gluon_calls, causal, dtype, shape):
    B, Hq, Hkv, M = shape
    bias = ba.LowerTriangularMask() if causal else None
    check(*qkv(B=B, Hq=Hq, Hkv=Hkv, Mq=M, Mk=M, D=128, dtype=dtype), const(bias))
    assert gluon_calls and all(c[2] == causal for c in gluon_calls)


def test_bottom_right_causal_on_a_square_call_takes_it(gluon_calls):
    check(*qkv(B=1, Hq=2, Hkv=2, Mq=256, Mk=256, D=128, dtype=torch.bfloat16),
          const(ba.LowerTriangularFromBottomRightMask()))
    assert gluon_calls and gluon_calls[0][2]


@pytest.mark.parametrize("case", ["D64", "M200", "rect", "window", "padded", "fp32", "strided", "dropout"])
def test_other_calls_keep_the_triton_kernels(gluon_calls, case):
    """Calls outside the kernel's shapes and biases run the ``triton.language`` kernels, with the same results."""
    D, Mq, Mk, dtype, bias = 128, 256, 256, torch.bfloat16, None
    if case == "D64":
        D = 64
    elif case == "M200":
        Mq = Mk = 200
    elif case == "rect":
        Mk = 384
    elif case == "window":
        bias = ba.LocalAttentionMask(window_left=64)
    elif case == "padded":
        bias = ba.PaddedKeysMask([100, 256])
    elif case == "fp32":
        dtype = torch.float32
    q, k, v = qkv(B=2, Hq=2, Hkv=2, Mq=Mq, Mk=Mk, D=D, dtype=dtype)
    if case == "strided":  # rows of a [B, M, H, D] projection
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    if case == "dropout":
        ba.attention(q, k, v, op="triton", dropout_p=0.1)
    else:
        check(q, k, v, const(bias))
    assert gluon_calls == []


def test_causal_hidden_nan_values_reach_no_row_that_cannot_see_them(gluon_calls):
    """A NaN in the last key's value is hidden from every row but the last: the Gluon forward marks the
    rows it reached and the exact pass computes them again, as the ``triton.language`` path does."""
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Mq=512, Mk=512, D=128, dtype=torch.bfloat16)
    v[:, :, -1] = float("nan")
    out = ba.attention(q, k, v, ba.LowerTriangularMask(), op="triton")
    assert gluon_calls
    assert torch.isnan(out[:, :, -1]).all()
    seen = v.clone()
    seen[:, :, -1] = 0.0  # the other rows compute the same function with any value there
    with sdpa_kernel(SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), seen.double(), is_causal=True)
        low = torch.nn.functional.scaled_dot_product_attention(q, k, seen, is_causal=True)
    assert_close("out", out[:, :, :-1], ref[:, :, :-1], low[:, :, :-1])
