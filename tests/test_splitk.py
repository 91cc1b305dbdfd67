"""The ``triton_splitk`` operator on tiny decode cases (CPU under the Triton interpreter, or GPU).

Every result is compared to a float64 reference; a result passes when its error is at most twice
the error of the same attention computed with the reference math in the input's precision.
Outputs and per-split buffers are poisoned with NaN first, so a row a kernel forgets to write fails.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import biasattn as ba
from biasattn.inputs import make_inputs
from biasattn.ops.merge import merge_partials, merge_partials_torch
from biasattn.ops.reference import dense_bias, softmax_attention
from biasattn.testing import strategies as bst

triton = pytest.importorskip("triton")
from biasattn.ops.triton.splitk import (  # noqa: E402
    choose_num_splits,
    merge_partials_triton,
    splitk_attention_fwd,
)

DEVICE = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
OP = ba.ops.get("triton_splitk")


def reference_pair(inp):
    """``(out, lse)`` in float64 and ``(out, lse)`` with the reference math in the input's dtype."""
    def run(dtype):
        add = inp.additive
        return softmax_attention(inp.q, inp.k, inp.v, dense_bias(inp, dtype, add), inp.scale, dtype)

    return run(torch.float64), run(inp.dtype)


def assert_close_to_reference(out, lse, inp):
    """The error rule of the project: ``max|out - ref| <= 2 max|out_lowprec - ref| + 1e-5`` (and for lse)."""
    (ref, ref_lse), (low, low_lse) = reference_pair(inp)
    assert not out.isnan().any(), "output has NaN (an unwritten row?)"
    assert out.dtype == inp.dtype and lse.dtype == torch.float32
    err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    bound = 2 * (low.double() - ref).abs().max().item() + 1e-5 if out.numel() else 0.0
    assert err <= bound, f"out error {err:.3g} > bound {bound:.3g}"
    dead = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), dead), "rows with no visible key must have lse = -inf"
    assert not lse.isnan().any()
    if (~dead).any():
        lerr = (lse.double() - ref_lse)[~dead].abs().max().item()
        lbound = 2 * (low_lse.double() - ref_lse)[~dead].abs().max().item() + 1e-5
        assert lerr <= lbound, f"lse error {lerr:.3g} > bound {lbound:.3g}"
    if dead.any():
        assert (out[dead] == 0).all(), "rows with no visible key must be 0"


def run_poisoned(inp, num_splits=None, config=None):
    """Run the launcher into NaN-filled out, lse and per-split buffers."""
    B, Hq, Mq, Dv = inp.B, inp.Hq, inp.Mq, inp.Dv
    out = torch.full((B, Hq, Mq, Dv), float("nan"), dtype=inp.dtype, device=inp.device)
    lse = torch.full((B, Hq, Mq), float("nan"), dtype=torch.float32, device=inp.device)
    partials = None
    if num_splits is not None and num_splits > 1:
        partials = (
            torch.full((num_splits, B, Hq, Mq, Dv), float("nan"), device=inp.device),
            torch.full((num_splits, B, Hq, Mq), float("nan"), device=inp.device),
        )
    return splitk_attention_fwd(inp, num_splits=num_splits, config=config, out=out, lse=lse, partials=partials)


def qkv(B, Hq, Hkv, Mq, Mk, D, dtype, Dv=None, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)

    return r(B, Hq, Mq, D), r(B, Hkv, Mk, D), r(B, Hkv, Mk, Dv or D)


def check(q, k, v, bias=None, splits=(None, 1, 3, 8), scale=None):
    for s in splits:
        inp = make_inputs(q, k, v, bias, scale=scale)
        assert not OP.not_supported_reasons(inp), OP.not_supported_reasons(inp)
        out, lse = run_poisoned(inp, num_splits=s)
        assert_close_to_reference(out, lse, inp)


# ------------------------------------------------------------------------------------ heuristic
def test_no_split_when_the_grid_is_full():
    assert choose_num_splits(264, 1000, 132, programs_per_sm=2) == 1
    assert choose_num_splits(5000, 10, 132) == 1


def test_split_fills_one_wave_for_long_caches():
    # 32 (sequence, head) pairs, 2048 key tiles, 264 slots: 8 splits make exactly one full wave
    assert choose_num_splits(32, 2048, 132, programs_per_sm=2) == 8
    assert 100 < choose_num_splits(1, 2048, 132, programs_per_sm=2) <= 128  # one sequence: as many as allowed


def test_short_caches_pay_for_the_merge():
    # 64 programs of 16 tiles on 132 SMs: halving their work pays for the merge launch unless it costs
    # more than the 8 tiles it saves; 128 programs would need a second wave to split at all
    assert choose_num_splits(64, 16, 132) == 2
    assert choose_num_splits(64, 16, 132, merge_overhead_tiles=9.0) == 1
    assert choose_num_splits(128, 16, 132, merge_overhead_tiles=0.0) == 1
    assert choose_num_splits(128, 16, 132, programs_per_sm=2, merge_overhead_tiles=0.0) == 2


def test_short_caches_split_less():
    assert choose_num_splits(1, 1, 132) == 1
    assert choose_num_splits(1, 3, 132) <= 3
    assert choose_num_splits(32, 4, 132, split_overhead_tiles=4.0) < choose_num_splits(32, 4000, 132)


@given(
    bh=st.integers(1, 4096), tiles=st.integers(0, 5000), sms=st.integers(1, 160),
    ppsm=st.integers(1, 4), overhead=st.floats(0.0, 8.0), merge=st.floats(0.0, 16.0),
)
def test_split_count_properties(bh, tiles, sms, ppsm, overhead, merge):
    s = choose_num_splits(bh, tiles, sms, programs_per_sm=ppsm, split_overhead_tiles=overhead, merge_overhead_tiles=merge)
    assert 1 <= s <= max(1, min(128, tiles))
    slots = sms * ppsm
    if bh >= slots:
        assert s == 1
    def cost(n):
        piece = math.ceil(tiles / n)
        busy = bh * math.ceil(tiles / piece)
        return math.ceil(busy / slots - 1e-9) * (piece + overhead) + (merge if n > 1 else 0)

    if 1 < tiles and bh < slots:
        costs = [cost(n) for n in range(1, min(128, tiles) + 1)]
        assert cost(s) <= min(costs) * 1.05  # near the best modelled time
        assert all(c > min(costs) * 1.05 for c in costs[: s - 1])  # and the fewest splits that are


def test_mixed_lengths_split_to_balance_the_work():
    """128 (sequence, head) pairs nearly fill 132 slots: equal lengths need no split, mixed ones do."""
    assert choose_num_splits(128, 513, 132, programs_per_sm=1) == 1
    mixed = [65 + (448 * n) // 15 for n in range(16)]  # 16 sequences of 65..513 tiles
    assert choose_num_splits(128, 513, 132, programs_per_sm=1, tiles_per_sequence=mixed) > 4


def test_key_tiles_follow_the_cache_length_and_the_grid():
    """128-key tiles on long caches, and on mid-size ones when the grid needs splits; 64 otherwise."""
    from biasattn.ops.triton.splitk import SplitKConfig, default_config

    cuda = torch.device("cuda")
    assert default_config(1, 128, 128, cuda, keys=1024, pairs=32).block_n == 64
    assert default_config(1, 128, 128, cuda, keys=2048, pairs=128).block_n == 128
    assert default_config(1, 128, 128, cuda, keys=4096, pairs=512).block_n == 64  # a full grid
    assert default_config(256, 128, 128, cuda, keys=4096, pairs=256).block_n == 64  # 2 row blocks per pair
    assert default_config(1, 128, 128, cuda, keys=8192, pairs=2048).block_n == 128
    big = default_config(128, 128, 128, cuda, keys=32768, pairs=64)
    assert (big.block_m, big.block_n, big.num_warps, big.num_stages) == (128, 128, 8, 3)
    assert default_config(4, 256, 256, cuda, keys=32768, pairs=8).block_n == 32
    assert default_config(4, 128, 128, torch.device("cpu"), keys=32768).block_n == 16  # the interpreter's tiles
    # short caches: three stages, or on a grid already full, two for single queries and four for several
    assert default_config(4, 128, 128, cuda, keys=1024, pairs=32).num_stages == 3
    assert default_config(4, 128, 128, cuda, keys=1024, pairs=512).num_stages == 2
    assert default_config(4, 128, 128, cuda, keys=1024, pairs=512, queries=4).num_stages == 4
    # 128 packed rows (MQA, 4 queries) on a short cache: two 64-row blocks per pair
    assert default_config(128, 128, 128, cuda, keys=1024, pairs=64, queries=4) == SplitKConfig(64, 64, 4, 3)


@pytest.mark.parametrize("keys", [1024, 8192, 131072])
def test_hopper_pads_mid_size_row_groups_to_a_warp_group_tile(triton_options, keys, monkeypatch):
    """17-64 packed rows (an MQA group of 32 heads) run 64-row blocks on sm90 from 8192 keys per call,
    not on other devices nor with the switch off; 16 rows or fewer, and more than 64, keep their own blocks."""
    from biasattn.ops.triton.splitk import SplitKConfig, default_config

    cuda = torch.device("cuda")
    for rows in (17, 32, 64):
        assert default_config(rows, 128, 128, cuda, keys=keys, pairs=8, capability=(9, 0)) == SplitKConfig(64, 64, 4, 3)
        ampere = default_config(rows, 128, 128, cuda, keys=keys, pairs=8, capability=(8, 0))
        assert ampere.block_m == 2 ** math.ceil(math.log2(rows))
    assert default_config(16, 128, 128, cuda, keys=keys, pairs=4, capability=(9, 0)).block_m == 16
    assert default_config(4, 128, 128, cuda, keys=keys, pairs=4, capability=(9, 0)).block_m == 16
    assert default_config(32, 256, 256, cuda, keys=keys, pairs=4, capability=(9, 0)).block_n == 32  # wide heads unchanged
    if keys >= 8192:
        assert default_config(128, 128, 128, cuda, keys=keys, pairs=4, capability=(9, 0)) == SplitKConfig(128, 128, 8, 3)
        # 65-128 rows: two 64-row blocks while the call still splits every pair within one wave
        two_blocks = default_config(128, 128, 128, cuda, keys=keys, pairs=4, capability=(9, 0), sms=132)
        assert two_blocks == SplitKConfig(64, 128, 4, 3)
        assert default_config(96, 128, 128, cuda, keys=keys, pairs=33, capability=(9, 0), sms=132).block_m == 64
        assert default_config(96, 128, 128, cuda, keys=keys, pairs=34, capability=(9, 0), sms=132).block_m == 128
        assert default_config(128, 128, 128, cuda, keys=keys, pairs=4, capability=(8, 0), sms=108).block_m == 128
    if keys == 1024:  # 4 pairs of 1k keys: a call too small to pad
        assert default_config(32, 128, 128, cuda, keys=keys, pairs=4, capability=(9, 0)).block_m == 32
    triton_options(pad_to_warpgroup=False)
    assert default_config(32, 128, 128, cuda, keys=keys, pairs=8, capability=(9, 0)).block_m == 32
    triton_options(many_rows_warpgroup=False)
    if keys >= 8192:
        assert default_config(128, 128, 128, cuda, keys=keys, pairs=4, capability=(9, 0), sms=132).block_m == 128


def test_hopper_fills_a_wave_with_two_short_row_blocks_on_short_caches(triton_options, monkeypatch):
    """17-32 packed rows on a short cache run two 16-row blocks of 128-key tiles on sm90 where those
    blocks fill more than two thirds of the SMs and at most all of them; otherwise (fewer or more pairs,
    longer caches, 33+ rows, other devices, the switch off) the other rules decide."""
    from biasattn.ops.triton.splitk import SplitKConfig, default_config

    cuda, hopper = torch.device("cuda"), (9, 0)
    short = SplitKConfig(16, 128, 4, 3)
    for pairs in (45, 56, 66):
        for rows in (17, 32):
            assert default_config(rows, 128, 128, cuda, keys=1024, pairs=pairs, capability=hopper, sms=132) == short
    assert default_config(32, 128, 128, cuda, keys=1024, pairs=44, capability=hopper, sms=132) != short
    assert default_config(32, 128, 128, cuda, keys=1024, pairs=67, capability=hopper, sms=132) != short
    assert default_config(32, 128, 128, cuda, keys=2048, pairs=64, capability=hopper, sms=132) != short
    assert default_config(64, 128, 128, cuda, keys=1024, pairs=32, capability=hopper, sms=132) != short
    assert default_config(32, 128, 128, cuda, keys=1024, pairs=64, capability=(8, 0), sms=108) != short
    triton_options(short_row_blocks=False)
    assert default_config(32, 128, 128, cuda, keys=1024, pairs=64, capability=hopper, sms=132) != short


def test_one_tile_pieces_run_two_stages():
    """A program of a single key tile runs two pipeline stages whatever its config says (deeper
    stages only delay its one tile); longer pieces, and configs of fewer stages, keep theirs."""
    from biasattn.ops.triton.splitk import piece_stages

    assert [piece_stages(s, 1) for s in (1, 2, 3, 4)] == [1, 2, 2, 2]
    assert [piece_stages(s, 2) for s in (2, 3, 4)] == [2, 3, 4]
    assert [piece_stages(4, t, short_piece=3) for t in (1, 2, 3, 4)] == [2, 2, 3, 4]
    assert piece_stages(3, 1, short_piece=0) == 3


def test_a_padded_warp_group_block_prices_its_merge_by_the_rows_merged():
    """A padded warp-group block's merge costs more of its tiles per wave of merged rows, so a call
    whose pairs already fill half the SMs stays unsplit (B=64, 32 heads on one KV head, 1k keys),
    while a small batch still splits; other blocks keep the fixed price."""
    from biasattn.ops.triton import splitk
    from biasattn.ops.triton.splitk import SplitKConfig, merge_overhead

    padded, own = SplitKConfig(64, 64, 4, 3), SplitKConfig(32, 64, 4, 3)
    assert merge_overhead(own, 32, 64 * 32, 132) == splitk.MERGE_OVERHEAD_TILES
    assert merge_overhead(padded, 32, 64 * 32, 132) > merge_overhead(padded, 32, 16 * 32, 132) > splitk.MERGE_OVERHEAD_TILES
    overhead = 1.0 + 32 * 128 * 8 / (64 * 256 * 2)  # writing a 32-row partial, in 64-key tiles of D = Dv = 128
    big, small = (choose_num_splits(pairs, 16, 132, split_overhead_tiles=overhead,
                                    merge_overhead_tiles=merge_overhead(padded, 32, pairs * 32, 132)) for pairs in (64, 16))
    assert (big, small) == (1, 8)
    assert choose_num_splits(64, 16, 132, split_overhead_tiles=overhead, merge_overhead_tiles=splitk.MERGE_OVERHEAD_TILES) == 2


def test_launch_shape_is_what_the_launcher_launches(monkeypatch):
    """explain()'s launch line comes from the same computation as the call's grid (padded keys,
    packed segments with a band, forced Mq)."""
    from biasattn.ops.triton import splitk

    made = []
    real = splitk._launch_shape
    monkeypatch.setattr(splitk, "_launch_shape", lambda *a: made.append(real(*a)) or made[-1])
    q, k, v = qkv(3, 4, 2, 2, 70, 16, torch.float16)
    packed_q, packed_k, packed_v = qkv(1, 4, 2, 5, 90, 16, torch.float16)
    cases = [
        make_inputs(q, k, v, ba.PaddedKeysMask([70, 9, 0], device=DEVICE)),
        make_inputs(packed_q, packed_k, packed_v,
                    ba.BlockDiagonalMask.from_seqlens([2, 3], [40, 50], device=DEVICE).make_causal_from_bottom_right()),
    ]
    for inp in cases:
        splitk_attention_fwd(inp)
        shape = splitk.launch_shape(inp)
        assert shape == made[-1]
        assert f"{shape.config.block_n}-key tiles" in shape.describe()


# ------------------------------------------------------------------------------------ kernels
DECODE_FAMILIES = tuple(f for f in bst.FAMILIES if f != "block_sparse")


@settings(max_examples=60, deadline=None)
@given(
    case=bst.attention_inputs(dtypes=(torch.float16, torch.float32), families=DECODE_FAMILIES, max_terms=2,
                              max_queries=16, max_seqlen=90, head_dims=(1, 16, 33), allow_empty=True),
    splits=st.sampled_from([None, 1, 2, 7, 128]),
)
def test_random_decode_cases_match_the_reference(case, splits):
    """Every family the operator declares, composed, at any split count (empty pieces included)."""
    q, k, v = (t.to(DEVICE) for t in (case.q, case.k, case.v))
    inp = make_inputs(q, k, v, case.bias.to(DEVICE) if case.bias is not None else None, scale=case.scale)
    assert not OP.not_supported_reasons(inp), OP.not_supported_reasons(inp)
    out, lse = run_poisoned(inp, num_splits=splits)
    assert_close_to_reference(out, lse, inp)


@pytest.mark.parametrize("splits", [1, 3])
def test_row_block_taller_than_the_group(splits):
    """A 64-row block over 4 heads x 3 queries (12 rows): the padding rows are neither read nor written."""
    from biasattn.ops.triton.splitk import SplitKConfig

    q, k, v = qkv(2, 8, 2, 3, 40, 16, torch.float16)
    inp = make_inputs(q, k, v, ba.LowerTriangularFromBottomRightMask())
    out, lse = run_poisoned(inp, num_splits=splits, config=SplitKConfig(64, 16, 4, 1))
    assert_close_to_reference(out, lse, inp)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("Mq", [1, 3])
def test_plain_decode(dtype, heads, Mq):
    q, k, v = qkv(2, heads[0], heads[1], Mq, 41, 16, dtype)
    check(q, k, v)


@pytest.mark.parametrize("Mk", [1, 2, 16, 17])
def test_short_caches(Mk):
    q, k, v = qkv(1, 2, 1, 2, Mk, 16, torch.float32)
    check(q, k, v, splits=(None, 1, 4))


def test_sixteen_queries_and_odd_head_dims():
    q, k, v = qkv(1, 4, 2, 16, 35, 24, torch.float16, Dv=40)
    check(q, k, v, splits=(None, 3))


def test_padded_keys_with_empty_and_single_key_sequences():
    q, k, v = qkv(4, 4, 2, 2, 45, 16, torch.float16)
    check(q, k, v, ba.PaddedKeysMask([0, 1, 45, 20], device=DEVICE))


def test_bottom_right_causal_and_padding():
    q, k, v = qkv(3, 4, 2, 4, 38, 16, torch.float32)
    check(q, k, v, ba.LowerTriangularFromBottomRightMask().to(DEVICE), splits=(None, 2, 8))
    causal = ba.LowerTriangularFromBottomRightMask().to(DEVICE)
    check(q, k, v, causal & ba.PaddedKeysMask([38, 3, 0], device=DEVICE), splits=(None, 5))


def test_sliding_window_skips_to_the_visible_keys():
    q, k, v = qkv(2, 2, 2, 3, 60, 16, torch.float16)
    check(q, k, v, ba.LocalAttentionMask(window_left=9).to(DEVICE), splits=(None, 1, 4))
    band = ba.LocalAttentionMask(window_left=5, window_right=2).to(DEVICE)
    check(q, k, v, band & ba.PaddedKeysMask([60, 30], device=DEVICE), splits=(2,))


def test_64_bit_key_offsets(triton_options, monkeypatch):
    """The 64-bit key-offset path (a K/V slice past 2**31 elements) computes the same as the 32-bit one."""

    triton_options(force_index_64=True)
    q, k, v = qkv(3, 4, 2, 4, 38, 16, torch.float16)
    bias = ba.LowerTriangularFromBottomRightMask().to(DEVICE) & ba.PaddedKeysMask([38, 3, 0], device=DEVICE)
    check(q, k, v, bias + ba.ALiBi(ba.ALiBi.standard_slopes(4).to(DEVICE)), splits=(None, 5))


@pytest.mark.parametrize("case", ["padded_gqa", "padded_causal_alibi", "packed_window", "additive"])
def test_keys_past_the_lengths_are_never_read(case):
    """NaN in every key past a sequence's length (an uninitialized cache) stays out of the result."""
    from biasattn.testing import poison_padding_

    lengths = [70, 0, 33, 1]
    padded = ba.PaddedKeysMask(lengths, device=DEVICE)
    if case == "packed_window":
        q_lens, kv_lens = [1, 2, 1, 0], [40, 60, 0, 10]
        q, k, v = qkv(1, 4, 2, sum(q_lens), sum(kv_lens), 16, torch.float32)
        bias = ba.BlockDiagonalMask.from_seqlens(q_lens, kv_lens, device=DEVICE).make_local_attention(50)
        with torch.no_grad():
            k[:, :, 100:], v[:, :, 100:] = float("nan"), float("nan")  # the keys of a document without queries
    else:
        q, k, v = qkv(4, 4, 1 if case == "padded_gqa" else 2, 2, 70, 16, torch.float32)
        poison_padding_(k, lengths), poison_padding_(v, lengths)
        bias = padded
        if case == "padded_causal_alibi":
            bias = padded & ba.LowerTriangularFromBottomRightMask().to(DEVICE)
            bias = bias + ba.ALiBi(ba.ALiBi.standard_slopes(4).to(DEVICE))
        elif case == "additive":
            bias = padded + ba.AdditiveBias(torch.randn(1, 4, 2, 70, device=DEVICE))
    check(q, k, v, bias, splits=(None, 1, 3))


def test_programmatic_dependent_launch_only_where_the_device_has_it(triton_options, monkeypatch):
    """The merge runs as a programmatic dependent launch only on CUDA devices of capability 9.0+ (never
    under the interpreter, never when switched off)."""
    from biasattn.ops.triton import splitk

    assert not splitk.pdl_available(torch.device("cpu"))
    if DEVICE.type == "cuda":
        from biasattn.ops.common import cuda_capability

        has_gdc = splitk.splitk_kernels.gdc_wait is not None
        assert splitk.pdl_available(DEVICE) == (has_gdc and cuda_capability(DEVICE) >= (9, 0))
        triton_options(split_kv_pdl=False)
        assert not splitk.pdl_available(DEVICE)


def test_lengths_written_after_lowering_are_honoured():
    """Cache lengths grown in place after the bias was lowered (as between CUDA-graph replays) are all read."""
    q, k, v = qkv(2, 2, 1, 1, 70, 16, torch.float32)
    bias = ba.PaddedKeysMask([3, 5], device=DEVICE)
    splitk_attention_fwd(make_inputs(q, k, v, bias))  # lowers (host lengths 3 and 5) and caches
    bias.kv_seqlens.copy_(torch.tensor([70, 41], dtype=torch.int32))
    out, lse = splitk_attention_fwd(make_inputs(q, k, v, bias))
    assert_close_to_reference(out, lse, make_inputs(q, k, v, ba.PaddedKeysMask([70, 41], device=DEVICE)))


def test_lengths_written_out_of_range_read_as_the_nearest_end():
    """Lengths written in place after a call was set up (as between CUDA-graph replays) read as Mk when above
    it and as 0 when negative (zeros, lse = -inf): never a read past the cache. An eager call reads them
    again and names the bad value."""
    q, k, v = qkv(3, 2, 1, 1, 40, 16, torch.float32)
    bias = ba.PaddedKeysMask([40, 40, 40], device=DEVICE)
    inp = make_inputs(q, k, v, bias)
    splitk_attention_fwd(inp)
    bias.kv_seqlens.copy_(torch.tensor([1000, -5, 17], dtype=torch.int32))
    for splits in (None, 1, 3):
        out, lse = run_poisoned(inp, num_splits=splits)
        assert_close_to_reference(out, lse, make_inputs(q, k, v, ba.PaddedKeysMask([40, 0, 17], device=DEVICE)))
    with pytest.raises(ba.errors.InputError, match=r"kv_seqlens\[0\]=1000 exceeds the key length Mk=40"):
        make_inputs(q, k, v, bias)


def test_top_left_causal_hides_whole_rows():
    """Rows of a top-left causal mask with Mq > Mk see nothing: 0 out, -inf lse."""
    q, k, v = qkv(1, 2, 1, 5, 3, 16, torch.float32)
    check(q, k, v, ba.LowerTriangularMask().to(DEVICE), splits=(None, 2))


def test_alibi_and_additive():
    q, k, v = qkv(2, 4, 2, 2, 33, 16, torch.float32)
    slopes = ba.ALiBi.standard_slopes(4).to(DEVICE)
    check(q, k, v, ba.PaddedKeysMask([33, 10], device=DEVICE) + ba.ALiBi(slopes), splits=(None, 3))
    add = torch.randn(1, 4, 1, 33, device=DEVICE)  # broadcast over batch and queries: stride 0
    check(q, k, v, ba.AdditiveBias(add) + ba.LowerTriangularFromBottomRightMask().to(DEVICE), splits=(2,))
    full = torch.randn(2, 4, 2, 33, device=DEVICE, dtype=torch.float16)
    check(q, k, v, full, splits=(None,))


def test_packed_sequences_against_their_own_keys():
    q_lens, kv_lens = [1, 0, 3, 2, 1], [5, 4, 1, 19, 0]
    bias = ba.BlockDiagonalMask.from_seqlens(q_lens, kv_lens, device=DEVICE)
    q, k, v = qkv(1, 4, 2, sum(q_lens), sum(kv_lens), 16, torch.float16)
    check(q, k, v, bias, splits=(None, 1, 3))
    check(q, k, v, bias.make_causal_from_bottom_right(), splits=(None, 4))
    check(q, k, v, bias.make_local_attention(2), splits=(2,))


def test_packed_decode_many_sequences():
    """Packed decoding: 20 queries in total (more than MAX_MQ) but at most 2 per sequence."""
    q_lens = [1, 2] * 10
    kv_lens = [(7 * n) % 23 for n in range(20)]
    bias = ba.BlockDiagonalMask.from_seqlens(q_lens, kv_lens, device=DEVICE).make_causal_from_bottom_right()
    q, k, v = qkv(1, 2, 2, sum(q_lens), sum(kv_lens), 16, torch.float32)
    check(q, k, v, bias, splits=(None,))


def test_sliced_bias_offsets_are_folded_in():
    q, k, v = qkv(1, 2, 2, 2, 30, 16, torch.float32)
    big = (ba.LowerTriangularFromBottomRightMask().to(DEVICE) & ba.PaddedKeysMask([70], device=DEVICE)).bind(40, 70)
    check(q, k, v, big[..., 38:40, 40:70], splits=(None, 3))


def test_through_the_public_api():
    q, k, v = qkv(2, 4, 1, 1, 40, 16, torch.float16)
    bias = ba.PaddedKeysMask([40, 7], device=DEVICE)
    out, lse = ba.attention_with_lse(q, k, v, bias, op="triton_splitk")
    assert_close_to_reference(out, lse, make_inputs(q, k, v, bias))
    out2 = ba.attention(q, k, v, bias, op="triton_splitk")
    assert torch.equal(out, out2)


def test_empty_inputs():
    q, k, v = qkv(1, 2, 2, 0, 5, 16, torch.float32)
    out, lse = ba.attention_with_lse(q, k, v, op="triton_splitk")
    assert out.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)
    q, k, v = qkv(1, 2, 2, 2, 0, 16, torch.float32)
    out, lse = ba.attention_with_lse(q, k, v, op="triton_splitk")
    assert (out == 0).all() and torch.isneginf(lse).all()


# ------------------------------------------------------------------------------------ declarations
def test_reasons():
    q, k, v = qkv(1, 2, 2, 17, 20, 16, torch.float32)
    assert any("Mq=16" in r for r in OP.not_supported_reasons(make_inputs(q, k, v)))
    bias = ba.BlockDiagonalMask.from_seqlens([17, 1], [10, 10], device=DEVICE)
    q, k, v = qkv(1, 2, 2, 18, 20, 16, torch.float32)
    why = OP.not_supported_reasons(make_inputs(q, k, v, bias))
    assert why == ["handles at most 16 queries per packed sequence, got a sequence of 17"]
    q, k, v = qkv(1, 2, 2, 2, 20, 16, torch.float32)
    grad = OP.not_supported_reasons(make_inputs(q, k, v, requires_grad=True))
    assert grad == ["has no backward pass and gradients are required"]
    assert OP.not_supported_reasons(make_inputs(q, k, v, scale=-0.25)) == ["needs a positive scale, got scale=-0.25"]
    layout = torch.ones(1, 1, 1, 2, dtype=torch.bool, device=DEVICE)
    assert any("layout" in r for r in OP.not_supported_reasons(make_inputs(q, k, v, ba.BlockSparseMask(layout, 16))))
    with pytest.raises(ba.NotSupportedError, match="triton_splitk"):
        ba.attention(q, k, v, op="triton_splitk", dropout_p=0.5)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="interpreter rules apply on the CPU")
def test_cpu_needs_the_interpreter(monkeypatch):
    q, k, v = qkv(1, 2, 2, 2, 20, 16, torch.float32)
    from biasattn.ops.triton import environment

    monkeypatch.setattr(environment, "interpreted", lambda: False)  # kernels decorated without the interpreter
    assert any("TRITON_INTERPRET=1" in r for r in OP.not_supported_reasons(make_inputs(q, k, v)))
    monkeypatch.undo()
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    assert any("bfloat16" in r for r in OP.not_supported_reasons(make_inputs(qb, kb, vb)))


# ------------------------------------------------------------------------------------ merge
@pytest.mark.parametrize("S", [1, 3, 40, 200])  # 200: more splits than one program loads at once
def test_merge_kernel_matches_the_torch_path(S):
    g = torch.Generator().manual_seed(S)
    outs = torch.randn(S, 2, 3, 5, 24, generator=g).to(DEVICE)
    lses = (torch.randn(S, 2, 3, 5, generator=g) * 3).to(DEVICE)
    lses[:, 0, 0, 0] = float("-inf")  # a row no split saw
    lses[0, 1, 2] = float("-inf")  # one split saw nothing
    outs[0, 1, 2] = float("nan")  # and its output is garbage: must be ignored
    out = torch.full((2, 3, 5, 24), float("nan"), device=DEVICE, dtype=torch.float16)
    lse = torch.full((2, 3, 5), float("nan"), device=DEVICE)
    merge_partials_triton(outs, lses, out=out, lse=lse)
    outs[0, 1, 2] = 0.0
    ref_out, ref_lse = merge_partials_torch(outs.double(), lses.double())
    assert torch.allclose(out.double(), ref_out, atol=2e-3, rtol=1e-3)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = ~torch.isneginf(ref_lse)
    assert torch.allclose(lse[fin].double(), ref_lse[fin].double(), atol=1e-5, rtol=1e-6)
    assert (out[0, 0, 0] == 0).all()


def test_merge_partials_keeps_gradients():
    """The shared entry point stays differentiable (torch path) when inputs require grad."""
    outs = torch.randn(3, 1, 2, 4, 8, device=DEVICE, requires_grad=True)
    lses = torch.randn(3, 1, 2, 4, device=DEVICE, requires_grad=True)
    out, lse = merge_partials(outs, lses)
    (out.sum() + lse.sum()).backward()
    assert outs.grad is not None and lses.grad is not None and not outs.grad.isnan().any()
