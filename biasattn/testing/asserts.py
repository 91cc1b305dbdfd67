"""Comparison against the reference with a tolerance relative to the dtype's own rounding error.

The criterion (as in FlashAttention's tests): compute the reference in float64 and the same math in
the low precision; an operator passes when ``max|out - ref| <= factor * max|ref_lowprec - ref| +
atol``, with ``factor`` 2 (3 for dq). It adapts to every dtype without hand-tuned tolerances. For
float64 outputs the low-precision math *is* the reference, so the bound is ``atol`` alone: tight.
"""

from __future__ import annotations

import torch

#: Small absolute slack per output dtype, added to the relative bound.
DEFAULT_ATOL: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-3,
}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b|`` in float64 over entries where both are finite (0 for empty tensors)."""
    a, b = a.detach().double(), b.detach().double()
    both = torch.isfinite(a) & torch.isfinite(b)
    if not bool(both.any()):
        return 0.0
    return float((a - b)[both].abs().max())


def assert_close_to_reference(
    out: torch.Tensor,
    ref: torch.Tensor,
    ref_lowprec: torch.Tensor | None = None,
    *,
    factor: float = 2.0,
    atol: float | None = None,
    name: str = "out",
) -> None:
    """Assert ``max|out - ref| <= factor * max|ref_lowprec - ref| + atol``.

    Args:
        out: the operator's result (any dtype).
        ref: the float64 reference (:func:`~biasattn.testing.reference_attention`).
        ref_lowprec: the same reference math done in ``out``'s dtype; None means ``out`` is compared
            with ``atol`` alone (use for float64 outputs).
        factor: 2 for outputs and lse, 3 for dq (which accumulates more rounding).
        atol: absolute slack; defaults to :data:`DEFAULT_ATOL` for ``out.dtype``.
        name: what is compared, for the message.

    Non-finite entries must agree exactly: ``-inf`` in ``ref`` (an lse of a row that sees no key)
    must be ``-inf`` in ``out``; ``out`` must have no NaN unless ``ref`` has a NaN in that place.
    """
    if tuple(out.shape) != tuple(ref.shape):
        raise AssertionError(f"{name} has shape {list(out.shape)}, the reference has {list(ref.shape)}")
    atol = DEFAULT_ATOL.get(out.dtype, 1e-5) if atol is None else atol
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    nan_out = torch.isnan(o) & ~torch.isnan(r)
    if bool(nan_out.any()):
        where = nan_out.nonzero()[0].tolist()
        raise AssertionError(f"{name} has {int(nan_out.sum())} NaN where the reference is finite (first at {where})")
    nonfinite = ~torch.isfinite(r) | ~torch.isfinite(o)
    mismatch = nonfinite & ~((o == r) | (torch.isnan(o) & torch.isnan(r)))
    if bool(mismatch.any()):
        at = tuple(mismatch.nonzero()[0].tolist())
        raise AssertionError(f"{name}{list(at)} is {o[at].item()}, the reference is {r[at].item()}")
    err = max_abs_diff(o, r)
    base = 0.0 if ref_lowprec is None else max_abs_diff(ref_lowprec.detach().cpu(), r)
    bound = factor * base + atol
    if not err <= bound:
        diff = torch.where(torch.isfinite(o) & torch.isfinite(r), (o - r).abs(), torch.zeros_like(o))
        at = tuple(torch.nonzero(diff == diff.max())[0].tolist())
        raise AssertionError(
            f"{name}: max|out - ref| = {err:.3g} exceeds {factor} * {base:.3g} (low-precision math's error) "
            f"+ {atol:.3g} = {bound:.3g}; worst at {list(at)}: {o[at].item()} vs {r[at].item()}"
        )
