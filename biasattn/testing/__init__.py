"""Testing tools for biasattn and for kernels built on it (public).

- :func:`reference_attention`: float64 attention over ``bias.materialize`` (independent of the
  lowering), differentiable, NaN-free on rows that see no key.
- :func:`assert_close_to_reference`: ``max|out - ref| <= 2 · max|out_lowprec_math - ref| + atol``
  (3× for dq), the dtype-relative criterion.
- :func:`poison_`, :func:`poison_padding_`, :func:`poison_hidden_lines`, :func:`poisoned_allocations`:
  NaN where a kernel must write or must not read.
- :mod:`biasattn.testing.strategies` (needs ``hypothesis``): shapes with odd sizes, GQA, ``Mq != Mk``,
  empty segments; dtypes; biases of every family and compositions of 2–3 families.

Typical test::

    from hypothesis import given
    from biasattn.testing import strategies as bst, reference_attention, assert_close_to_reference

    @given(bst.attention_inputs(dtypes=(torch.float16, torch.bfloat16)))
    def test_forward(case):
        out = biasattn.attention(case.q, case.k, case.v, case.bias, scale=case.scale)
        ref, _ = reference_attention(case.q, case.k, case.v, case.bias, scale=case.scale)
        low, _ = reference_attention(case.q, case.k, case.v, case.bias, scale=case.scale,
                                     compute_dtype=case.q.dtype)
        assert_close_to_reference(out, ref, low)
"""

from __future__ import annotations

from .asserts import DEFAULT_ATOL, assert_close_to_reference, max_abs_diff
from .poison import poison_, poison_hidden_lines, poison_padding_, poisoned_allocations
from .reference import dense_bias, reference_attention


def __getattr__(name: str):
    if name == "strategies":  # imported on demand: it needs hypothesis
        import importlib

        return importlib.import_module(f"{__name__}.strategies")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_ATOL",
    "assert_close_to_reference",
    "dense_bias",
    "max_abs_diff",
    "poison_",
    "poison_hidden_lines",
    "poison_padding_",
    "poisoned_allocations",
    "reference_attention",
]
