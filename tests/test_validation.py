"""Every validation of DESIGN §5, one test each: the error type, and a message that names the
argument, the expected value and the actual value."""

import re

import pytest
import torch

import biasattn as ba
from biasattn.errors import BiasattnError, InputError, InputTypeError
from biasattn.ops.base import Operator


def qkv(B=2, Hq=2, Mq=5, Mk=6, D=8, Hkv=None, Dv=None, dtype=torch.float32):
    Hkv = Hkv or Hq
    return (
        torch.randn(B, Hq, Mq, D, dtype=dtype),
        torch.randn(B, Hkv, Mk, D, dtype=dtype),
        torch.randn(B, Hkv, Mk, Dv or D, dtype=dtype),
    )


def raises(exc, *fragments):
    """pytest.raises that also checks every fragment appears in the message."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


# ------------------------------------------------------------------------------------ tensors
def test_q_not_a_tensor():
    _, k, v = qkv()
    with raises(InputTypeError, "q must be a torch.Tensor", "list"):
        ba.attention([[1.0]], k, v)


def test_rank():
    q, k, v = qkv()
    with raises(InputError, "q must be 4-D", "[B, Hq, Mq, D]", "[2, 5, 8]"):
        ba.attention(q[0], k, v)
    with raises(InputError, "k must be 4-D", "[B, Hkv, Mk, D]", "[2, 6, 8]"):
        ba.attention(q, k[0], v)


def test_integer_dtype():
    q, k, v = qkv()
    with raises(InputTypeError, "q must be float16, bfloat16, float32 or float64", "torch.int64"):
        ba.attention(q.long(), k, v)


def test_dtypes_disagree():
    q, k, v = qkv()
    with raises(InputTypeError, "k has dtype torch.float16", "q has torch.float32"):
        ba.attention(q, k.half(), v)
    with raises(InputTypeError, "v has dtype torch.float64", "q has torch.float32"):
        ba.attention(q, k, v.double())


def test_devices_disagree():
    q, k, v = qkv()
    with raises(InputTypeError, "k is on meta", "q is on cpu"):
        ba.attention(q, k.to("meta"), v)


def test_batch_sizes_disagree():
    q, _, _ = qkv(B=2)
    _, k, v = qkv(B=3)
    with raises(InputError, "k has batch size 3", "q has 2"):
        ba.attention(q, k, v)


def test_head_dims_disagree():
    q, _, _ = qkv(D=16)
    _, k, v = qkv(D=8)
    with raises(InputError, "k has head dim 8", "q has 16"):
        ba.attention(q, k, v)


def test_v_heads_disagree_with_k():
    q, k, _ = qkv(Hq=4, Hkv=2)
    v = torch.randn(2, 3, 6, 8)
    with raises(InputError, "v has 3 heads", "k has 2"):
        ba.attention(q, k, v)


def test_v_length_disagrees_with_k():
    q, k, _ = qkv()
    v = torch.randn(2, 2, 5, 8)
    with raises(InputError, "v has Mk=5", "k has 6"):
        ba.attention(q, k, v)


def test_zero_head_dim():
    q, k, v = qkv(D=0)
    with raises(InputError, "head dims must be positive", "D=0"):
        ba.attention(q, k, v)


def test_heads_not_divisible():
    q, k, v = qkv(Hq=3, Hkv=2)
    with raises(InputError, "Hq=3", "not a multiple", "Hkv=2"):
        ba.attention(q, k, v)


def test_heads_not_divisible_names_a_transposed_layout():
    """q/k/v in the [B, M, H, D] layout got a head-count error with no hint that they were transposed."""
    q, k, v = (t.transpose(1, 2) for t in qkv(Hq=4, Hkv=2, Mq=9, Mk=6))  # [B, M, H, D]
    with raises(InputError, "Hq=9", "Hkv=6", "look like [B, M, H, D]", "[B, H, M, D]", "q.transpose(1, 2)"):
        ba.attention(q, k, v)
    ba.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # the hint's advice runs


def test_bias_heads_mismatch_names_a_transposed_layout():
    """A bias that fits q read as [B, M, H, D] says the inputs look transposed; one that fits neither reading does not."""
    q, k, v = (t.transpose(1, 2) for t in qkv(Hq=4, Mq=6, Mk=6))  # [2, 6, 4, 8]: six "heads" as written
    with raises(InputError, "attn_bias (AdditiveBias) has heads 4", "q has 6", "look like [B, M, H, D]"):
        ba.attention(q, k, v, torch.zeros(2, 4, 6, 6))
    with pytest.raises(InputError) as err:
        ba.attention(q, k, v, torch.zeros(2, 3, 4, 4))
    assert "look like" not in str(err.value)


def test_untransposed_heads_error_has_no_layout_hint():
    """The layout hint appears only when swapping dims 1 and 2 would make the heads divide."""
    q, k, v = qkv(Hq=3, Hkv=2, Mq=5, Mk=6)
    with pytest.raises(InputError) as err:
        ba.attention(q, k, v)
    assert "look like" not in str(err.value)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "0.5", True])
def test_scale(scale):
    q, k, v = qkv()
    with raises(InputError, "scale must be a finite float", repr(scale)):
        ba.attention(q, k, v, scale=scale)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_dropout_p(p):
    q, k, v = qkv()
    with raises(InputError, "dropout_p must be a float in [0, 1)", repr(p)):
        ba.attention(q, k, v, dropout_p=p)


def test_attn_bias_type():
    q, k, v = qkv()
    with raises(InputTypeError, "attn_bias must be", "str"):
        ba.attention(q, k, v, "causal")


def test_integer_tensor_bias():
    q, k, v = qkv()
    with raises(InputTypeError, "AdditiveBias tensor must be floating point or bool", "torch.int64"):
        ba.attention(q, k, v, torch.zeros(5, 6, dtype=torch.long))


# ------------------------------------------------------------------------------------ bias vs q/k
def test_bias_on_another_device():
    q, k, v = qkv()
    bias = ba.PaddedKeysMask([3, 4], device="meta")
    with raises(InputTypeError, "attn_bias is on meta", "q is on cpu"):
        ba.attention(q, k, v, bias)


def test_bias_batch_size():
    q, k, v = qkv(B=2)
    with raises(InputError, "attn_bias (PaddedKeysMask) has batch size 3", "q has 2"):
        ba.attention(q, k, v, ba.PaddedKeysMask([1, 2, 3]))


def test_bias_heads():
    q, k, v = qkv(Hq=2)
    with raises(InputError, "attn_bias (ALiBi) has heads 3", "q has 2"):
        ba.attention(q, k, v, ba.ALiBi(torch.ones(3)))


def test_bias_query_length():
    q, k, v = qkv(Mq=5, Mk=6)
    with raises(InputError, "attn_bias (AdditiveBias) has Mq 4", "q has 5"):
        ba.attention(q, k, v, torch.zeros(4, 6))


def test_bias_key_length():
    q, k, v = qkv(Mq=5, Mk=6)
    with raises(InputError, "attn_bias (AdditiveBias) has Mk 7", "k has 6"):
        ba.attention(q, k, v, torch.zeros(5, 7))


def test_additive_bias_does_not_broadcast():
    q, k, v = qkv(B=2, Hq=2, Mq=5, Mk=6)
    with raises(InputError, "has heads 3", "q has 2"):
        ba.attention(q, k, v, torch.zeros(3, 5, 6))


def test_additive_bias_too_many_dims():
    with raises(InputError, "AdditiveBias tensor must have 1 to 4 dims", "[1, 1, 1, 1, 1]"):
        ba.AdditiveBias(torch.zeros(1, 1, 1, 1, 1))


# ------------------------------------------------------------------------------------ lengths
def test_query_seqlens_do_not_sum_to_mq():
    q, k, v = qkv(B=1, Mq=8, Mk=8)
    with raises(InputError, "has Mq 7", "q has 8"):
        ba.attention(q, k, v, ba.BlockDiagonalMask.from_seqlens([3, 4], [4, 4]))


def test_key_seqlens_do_not_sum_to_mk():
    q, k, v = qkv(B=1, Mq=8, Mk=8)
    with raises(InputError, "has Mk 9", "k has 8"):
        ba.attention(q, k, v, ba.BlockDiagonalMask.from_seqlens([4, 4], [4, 5]))


def test_negative_seqlens():
    with raises(InputError, "q_seqlens[1] must be >= 0", "-2"):
        ba.BlockDiagonalMask.from_seqlens([3, -2])
    with raises(InputError, "kv_seqlens[0] must be >= 0", "-1"):
        ba.PaddedKeysMask([-1, 2])


def test_seqlens_not_integers():
    with raises(InputError, "kv_seqlens must hold integers", "torch.float32"):
        ba.PaddedKeysMask(torch.tensor([1.5, 2.0]))


def test_seqlens_count_mismatch():
    with raises(InputError, "kv_seqlens has 3 sequences", "q_seqlens has 2"):
        ba.BlockDiagonalMask.from_seqlens([2, 2], [1, 1, 2])


def test_padded_length_exceeds_mk():
    q, k, v = qkv(Mk=6)
    with raises(InputError, "kv_seqlens[1]=9", "exceeds the key length Mk=6"):
        ba.attention(q, k, v, ba.PaddedKeysMask([3, 9]))


def test_packed_batch_needs_batch_size_one():
    q, k, v = qkv(B=2, Mq=6, Mk=6)
    with raises(InputError, "batch size B=1", "got B=2"):
        ba.attention(q, k, v, ba.BlockDiagonalMask.from_seqlens([3, 3]))


def test_padded_keys_and_packed_batch():
    with raises(BiasattnError, "BlockDiagonalMask", "PaddedKeysMask", "batch size 2"):
        ba.BlockDiagonalMask.from_seqlens([3, 3]) & ba.PaddedKeysMask([2, 3])


def test_from_bool_not_a_padding_mask():
    with raises(InputError, "mask row 1 is not a right-padding mask"):
        ba.PaddedKeysMask.from_bool(torch.tensor([[True, False], [False, True]]))
    with raises(InputError, "mask must be a bool tensor [B, Mk]", "torch.float32"):
        ba.PaddedKeysMask.from_bool(torch.zeros(2, 3))


# ------------------------------------------------------------------------------------ layouts, windows, slopes
def test_layout_of_the_wrong_shape():
    q, k, v = qkv(Mq=5, Mk=6)
    layout = torch.ones(1, 1, 2, 3, dtype=torch.bool)  # needs ceil(5/4) x ceil(6/4) = 2 x 2
    with raises(InputError, "ceil(Mq/block_q) x ceil(Mk/block_k) = 2 x 2", "Mq=5, Mk=6", "got 2 x 3"):
        ba.attention(q, k, v, ba.BlockSparseMask(layout, 4))


def test_layout_heads_do_not_match_q():
    q, k, v = qkv(Hq=2, Mq=4, Mk=4)
    with raises(InputError, "has heads 3", "q has 2"):
        ba.attention(q, k, v, ba.BlockSparseMask(torch.ones(1, 3, 1, 1, dtype=torch.bool), 4))


def test_layout_rank_dtype_and_block_size():
    with raises(InputError, "layout must be [B, H, nq, nk]", "[4]"):
        ba.BlockSparseMask(torch.ones(4, dtype=torch.bool), 2)
    with raises(InputError, "layout must be a bool", "torch.float32"):
        ba.BlockSparseMask(torch.ones(2, 2), 2)
    with raises(InputError, "block_k must be a positive int", "0"):
        ba.BlockSparseMask(torch.ones(2, 2, dtype=torch.bool), (2, 0))


def test_window_sizes():
    with raises(InputError, "window_left must be >= 0", "-1"):
        ba.LocalAttentionMask(-1)
    with raises(InputError, "window_right must be a non-negative int", "1.5"):
        ba.LocalAttentionMask(2, 1.5)
    with raises(InputError, "window_left must be >= 0", "-3"):
        ba.BlockDiagonalMask.from_seqlens([2]).make_local_attention(-3)


def test_alibi_slopes_rank():
    with raises(InputError, "ALiBi slopes must be [H] or [B, H]", "[1, 2, 3]"):
        ba.ALiBi(torch.ones(1, 2, 3))


def test_dv_must_equal_d_for_operators_that_need_it():
    class EqualDv(Operator):
        NAME = "equal_dv_test"
        REQUIRES_EQUAL_V_DIM = True

    q, k, v = qkv(D=8, Dv=4)
    with raises(ba.NotSupportedError, "equal_dv_test", "needs Dv == D, got Dv=4, D=8"):
        ba.attention(q, k, v, op=EqualDv())


def test_validation_runs_before_any_operator():
    class Exploding(Operator):
        NAME = "exploding_test"
        FEATURES = frozenset({"padded_keys"})

        def fwd(self, inp):  # pragma: no cover - must never run
            raise AssertionError("operator ran on invalid inputs")

    q, k, v = qkv(Mk=6)
    with raises(InputError, "exceeds the key length Mk=6"):
        ba.attention(q, k, v, ba.PaddedKeysMask([3, 9]), op=Exploding())


def test_unknown_operator_name():
    q, k, v = qkv()
    with raises(InputError, "op must be one of", "chunked", "'nope'"):
        ba.attention(q, k, v, op="nope")
