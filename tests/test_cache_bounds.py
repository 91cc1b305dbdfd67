"""Caches on the attention path are keyed by shapes and structure and bounded: per-call values and masks
built anew every step never grow them."""

import gc

import pytest
import torch

import biasattn as ba
from biasattn import dispatch, memo
from biasattn.bias import spec as spec_module
from biasattn.memo import BoundedCache


def test_bounded_cache_drops_the_oldest_entry():
    """A full cache forgets the entry stored first."""
    c = BoundedCache(2)
    c["a"], c["b"] = 1, 2
    assert c.get("a") == 1
    c["c"] = 3
    assert list(c) == ["b", "c"] and c.get("a") is None
    assert c.setdefault("d", 4) == 4 and list(c) == ["c", "d"]
    with pytest.raises(ValueError, match="maxsize"):
        BoundedCache(0)


def test_a_transient_block_leaves_every_cache_as_it_was_and_calls_inside_share_entries():
    """What a block stores in any cache is gone when it ends (entries from before stay), while calls
    inside it still find each other's entries; a full call's lowering leaves no tensor behind."""
    a, b = BoundedCache(4), BoundedCache(4)
    a["kept"] = 1
    with memo.transient():
        a["x"], b["y"] = 2, 3
        assert a.get("x") == 2 and b.setdefault("z", 4) == 4 and b.get("z") == 4
        with memo.transient():
            b["inner"] = 5
        assert b.get("inner") is None and a.get("x") == 2
    assert list(a) == ["kept"] and len(b) == 0
    q = k = v = torch.randn(1, 2, 40, 16)
    stores = (spec_module._INT_TENSORS, spec_module._PLAIN_SPECS, spec_module._STRUCTURAL_SPECS, dispatch._CALLS)
    sizes = [len(c) for c in stores]
    with memo.transient():
        mask = ba.BlockDiagonalMask.from_seqlens(torch.tensor([10, 30])).make_causal()
        ba.attention(q, k, v, mask)
    assert [len(c) for c in stores] == sizes  # a call outside the block keeps the lengths' int32 copies


def _store_sizes(spec) -> tuple[int, ...]:
    return (len(spec.derived), len(dispatch._length_mask_choices), len(spec_module._PLAIN_SPECS),
            len(spec_module._STRUCTURAL_SPECS))


def test_distinct_scales_dropout_values_and_operator_objects_do_not_grow_the_choice_store():
    """2,000 calls with distinct dropout_p and scale (a schedule, a learned temperature) once kept 2,000 choices."""
    q = k = v = torch.randn(1, 2, 3, 8)
    spec = spec_module.lower(None, 1, 2, 3, 3)
    ba.attention(q, k, v, scale=0.5, dropout_p=0.1)
    ba.attention(q, k, v, scale=0.5, dropout_p=0.1, op=ba.ops.get("chunked"))
    before = len(spec.derived)
    for n in range(2000):
        ba.attention(q, k, v, scale=0.1 + n * 1e-4, dropout_p=0.05 + n * 1e-4)
        ba.attention(q, k, v, scale=0.1 + n * 1e-4, dropout_p=0.05 + n * 1e-4, op="chunked")
    assert len(spec.derived) == before


def test_ten_thousand_fresh_masks_leave_the_stores_as_they_were():
    """Masks built anew every step (lengths of each batch) keep no entry per mask once they are gone."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 1, 8)
    k = v = torch.randn(2, 2, 16, 8)
    plain = spec_module.lower(None, 2, 2, 1, 16)
    for _ in range(2):  # warm: the first calls of a kind fill the stores once
        ba.attention(q, k, v, ba.PaddedKeysMask(torch.randint(1, 17, (2,), generator=gen)))
    sizes = _store_sizes(plain)
    for n in range(10_000):
        lengths = torch.randint(1, 17, (2,), generator=gen)
        bias = ba.PaddedKeysMask(lengths)
        if n % 20 == 0:
            ba.attention(q, k, v, bias, scale=0.3 + n * 1e-5)
    gc.collect()
    assert _store_sizes(plain) == sizes
