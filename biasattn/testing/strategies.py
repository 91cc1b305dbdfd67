"""Hypothesis strategies for attention inputs: shapes, dtypes and biases of every family, composed.

Every strategy draws values that fit together: a bias drawn for a :class:`Shape` has segment lengths
summing to its Mq/Mk, padded lengths within Mk, a layout of exactly ``ceil(M/block)`` blocks, an
additive tensor that broadcasts to ``[B, Hq, Mq, Mk]``. Sizes favour the odd ones that break kernels
(1, 3, 17, 113), grouped-query heads, ``Mq != Mk`` and empty segments.

>>> from hypothesis import given
>>> from biasattn.testing import strategies as bst
>>> @given(bst.attention_inputs(families=("causal", "padded")))
... def test_my_kernel(case):
...     out = my_attention(case.q, case.k, case.v, case.bias)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from ..bias import (
    AdditiveBias,
    ALiBi,
    AttentionBias,
    BlockDiagonalMask,
    BlockSparseMask,
    LocalAttentionMask,
    LowerTriangularFromBottomRightMask,
    LowerTriangularMask,
    PaddedKeysMask,
)

#: Every bias family a strategy can draw, by name.
FAMILIES: tuple[str, ...] = (
    "causal",
    "causal_bottom_right",
    "local",
    "padded",
    "block_diagonal",
    "block_sparse",
    "additive",
    "alibi",
)
#: Families that only hide keys (they compose with ``&``).
MASK_FAMILIES = frozenset(FAMILIES) - {"additive", "alibi"}
#: Sizes that catch tiling bugs: never only powers of two.
ODD_SIZES: tuple[int, ...] = (1, 3, 17, 113)
DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Shape:
    """Sizes of one attention call: q ``[B, Hq, Mq, D]``, k ``[B, Hkv, Mk, D]``, v ``[B, Hkv, Mk, Dv]``."""

    B: int
    Hq: int
    Hkv: int
    Mq: int
    Mk: int
    D: int
    Dv: int

    @property
    def bias_shape(self) -> tuple[int, int, int, int]:
        """``(B, Hq, Mq, Mk)``: the shape a bias is materialized to."""
        return (self.B, self.Hq, self.Mq, self.Mk)


@dataclass
class AttentionCase:
    """A drawn attention call: tensors, the bias and the scale (None = ``1/sqrt(D)``)."""

    shape: Shape
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: AttentionBias | None
    scale: float | None
    families: tuple[str, ...]

    def __repr__(self) -> str:
        s = self.shape
        return (
            f"AttentionCase(q=[{s.B}, {s.Hq}, {s.Mq}, {s.D}], k=[{s.B}, {s.Hkv}, {s.Mk}, {s.D}], Dv={s.Dv}, "
            f"dtype={self.q.dtype}, scale={self.scale}, families={self.families}, bias={self.bias!r})"
        )


def seq_lens(max_size: int = 113, *, allow_empty: bool = False) -> st.SearchStrategy[int]:
    """A sequence length, favouring :data:`ODD_SIZES` (0 too when ``allow_empty``)."""
    odd = [n for n in ODD_SIZES if n <= max_size]
    low = 0 if allow_empty else 1
    return st.one_of(st.sampled_from(odd + ([0] if allow_empty else [])), st.integers(low, max(low, max_size)))


@st.composite
def shapes(
    draw,
    *,
    max_batch: int = 2,
    max_heads: int = 4,
    max_seqlen: int = 113,
    head_dims: tuple[int, ...] = (1, 8, 16, 33),
    gqa: bool = True,
    equal_v_dim: bool = False,
    allow_empty: bool = False,
    batch: int | None = None,
    square: bool | None = None,
    max_queries: int | None = None,
) -> Shape:
    """An attention :class:`Shape`; GQA (``Hq = g·Hkv``), ``Mq != Mk`` and ``Dv != D`` included.

    ``batch`` fixes B (1 for packed batches); ``square=True`` forces ``Mq == Mk``, False forbids it;
    ``max_queries`` caps Mq below ``max_seqlen`` (decoding: a few queries against many keys).
    """
    B = batch if batch is not None else draw(st.integers(1, max_batch))
    Hkv = draw(st.integers(1, max_heads))
    groups = draw(st.sampled_from([1, 2, 3])) if gqa else 1
    Hq = Hkv * groups
    if Hq > max_heads and Hkv > 1:
        Hkv = max(1, max_heads // groups)
        Hq = Hkv * groups
    Mq = draw(seq_lens(max_seqlen if max_queries is None else min(max_queries, max_seqlen), allow_empty=allow_empty))
    if square:
        Mk = Mq
    else:
        Mk = draw(st.one_of(st.just(Mq), seq_lens(max_seqlen, allow_empty=allow_empty)))
        if square is False and Mk == Mq:
            Mk = Mq + 1
    D = draw(st.sampled_from(head_dims))
    Dv = D if equal_v_dim else draw(st.sampled_from([D, D, max(1, D // 2 + 1)]))
    return Shape(B, Hq, Hkv, Mq, Mk, D, Dv)


def dtypes(include: tuple[torch.dtype, ...] = DTYPES) -> st.SearchStrategy[torch.dtype]:
    """A floating dtype among ``include``."""
    return st.sampled_from(list(include))


def _split(draw, total: int, parts: int, allow_empty: bool) -> list[int]:
    """``parts`` non-negative lengths summing to ``total`` (positive unless ``allow_empty``)."""
    if not allow_empty and total < parts:
        parts = max(total, 1)
    low = 0 if allow_empty else 1
    if parts == 1:
        return [total]
    cuts = sorted(draw(st.lists(st.integers(0, total - low * parts), min_size=parts - 1, max_size=parts - 1)))
    free = [b - a for a, b in zip([0] + cuts, cuts + [total - low * parts])]
    return [n + low for n in free]


def segment_lengths(total_q: int, total_k: int, *, max_segments: int = 4, allow_empty: bool = True):
    """Strategy for ``(q_seqlens, kv_seqlens)`` summing to ``total_q``/``total_k`` (empty segments allowed)."""

    @st.composite
    def _draw(draw):
        n = draw(st.integers(1, max_segments))
        q = _split(draw, total_q, n, allow_empty)
        k = _split(draw, total_k, len(q), True)
        return q, k

    return _draw()


@st.composite
def _block_diagonal(draw, shape: Shape) -> AttentionBias:
    q, k = draw(segment_lengths(shape.Mq, shape.Mk))
    same = q == k and draw(st.booleans())
    bias = BlockDiagonalMask.from_seqlens(q, None if same else k)
    variant = draw(st.sampled_from(["plain", "causal", "causal_bottom_right", "local"]))
    if variant == "causal":
        return bias.make_causal()
    if variant == "causal_bottom_right":
        return bias.make_causal_from_bottom_right()
    if variant == "local":
        return bias.make_local_attention(draw(st.integers(0, 8)), draw(st.integers(0, 3)))
    return bias


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@st.composite
def _block_sparse(draw, shape: Shape) -> AttentionBias:
    bq, bk = draw(st.sampled_from([1, 2, 4, 5, 8, 16, 32])), draw(st.sampled_from([1, 3, 4, 8, 16, 32]))
    nq, nk = _cdiv(shape.Mq, bq), _cdiv(shape.Mk, bk)
    b = shape.B if draw(st.booleans()) else 1
    h = shape.Hq if draw(st.booleans()) else 1
    seed = draw(st.integers(0, 2**31 - 1))
    density = draw(st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0]))
    layout = torch.rand((b, h, nq, nk), generator=torch.Generator().manual_seed(seed)) < density
    if b == 1 and draw(st.booleans()):
        layout = layout[0] if h > 1 or not draw(st.booleans()) else layout[0, 0]
    return BlockSparseMask(layout, bq if bq == bk and draw(st.booleans()) else (bq, bk))


@st.composite
def additive_tensors(draw, shape: Shape, *, dtype: torch.dtype = torch.float64, allow_bool: bool = True) -> torch.Tensor:
    """A float (or bool, True = visible) tensor of 1–4 dims broadcastable to ``[B, Hq, Mq, Mk]``."""
    full = list(shape.bias_shape)
    ndim = draw(st.integers(1, 4))
    dims = full[4 - ndim :]
    dims = [n if draw(st.booleans()) else 1 for n in dims]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if allow_bool and draw(st.integers(0, 3)) == 0:
        return torch.rand(dims, generator=gen) < 0.7
    return (torch.randn(dims, generator=gen, dtype=torch.float64) * 2).to(dtype)


@st.composite
def _alibi(draw, shape: Shape) -> AttentionBias:
    per_batch = draw(st.booleans())
    dims = [shape.B, shape.Hq] if per_batch else [shape.Hq]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if draw(st.booleans()):
        slopes = ALiBi.standard_slopes(shape.Hq)
        return ALiBi(slopes.expand(shape.B, -1).contiguous() if per_batch else slopes)
    return ALiBi(torch.rand(dims, generator=gen) * 0.5)


@st.composite
def bias_of_family(draw, family: str, shape: Shape, *, additive_dtype: torch.dtype = torch.float64) -> AttentionBias:
    """A bias of one family (see :data:`FAMILIES`) that fits ``shape``."""
    if family == "causal":
        return LowerTriangularMask()
    if family == "causal_bottom_right":
        return LowerTriangularFromBottomRightMask()
    if family == "local":
        return LocalAttentionMask(draw(st.integers(0, 20)), draw(st.integers(0, 4)))
    if family == "padded":
        if shape.B > 1 and draw(st.integers(0, 3)) == 0:
            return PaddedKeysMask([draw(st.integers(0, shape.Mk))])
        return PaddedKeysMask(draw(st.lists(st.integers(0, shape.Mk), min_size=shape.B, max_size=shape.B)))
    if family == "block_diagonal":
        if shape.B != 1:
            raise ValueError("block_diagonal biases need B == 1; draw the shape with shapes(batch=1)")
        return draw(_block_diagonal(shape))
    if family == "block_sparse":
        return draw(_block_sparse(shape))
    if family == "additive":
        return AdditiveBias(draw(additive_tensors(shape, dtype=additive_dtype)))
    if family == "alibi":
        return draw(_alibi(shape))
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


@st.composite
def family_lists(draw, families: tuple[str, ...] = FAMILIES, *, min_terms: int = 1, max_terms: int = 3) -> tuple[str, ...]:
    """``min_terms``–``max_terms`` family names; block_diagonal, block_sparse and alibi at most once.

    (Two ALiBi terms lower to one slope tensor summed in float32, which a float64 comparison would
    flag as a rounding difference.)
    """
    n = draw(st.integers(min_terms, max_terms))
    out: list[str] = []
    for _ in range(n):
        choices = [f for f in families if f not in out or f not in _AT_MOST_ONCE]
        out.append(draw(st.sampled_from(choices)))
    return tuple(out)


_AT_MOST_ONCE = ("block_diagonal", "block_sparse", "alibi")


def compose(terms: list[AttentionBias], ops: list[str]) -> AttentionBias:
    """Fold ``terms`` left to right with ``ops[i]`` (``"&"`` or ``"+"``) between term i and i+1."""
    bias = terms[0]
    for op, t in zip(ops, terms[1:]):
        bias = (bias & t) if op == "&" else (bias + t)
    return bias


@st.composite
def biases(
    draw,
    shape: Shape,
    families: tuple[str, ...] = FAMILIES,
    *,
    min_terms: int = 1,
    max_terms: int = 3,
    additive_dtype: torch.dtype = torch.float64,
) -> AttentionBias:
    """A bias for ``shape``: one family, or a composition of up to ``max_terms`` with ``&`` and ``+``.

    Masks are joined with ``&`` or ``+`` (same meaning), additive terms with ``+``. Families that
    need ``B == 1`` (block_diagonal) are left out when ``shape.B > 1``.
    """
    allowed = tuple(f for f in families if f != "block_diagonal" or shape.B == 1)
    names = draw(family_lists(allowed, min_terms=min_terms, max_terms=max_terms))
    return draw(_compose_families(names, shape, additive_dtype))


@st.composite
def _compose_families(draw, names, shape: Shape, additive_dtype=torch.float64) -> AttentionBias:
    terms = [draw(bias_of_family(name, shape, additive_dtype=additive_dtype)) for name in names]
    ops = []
    for n, t in enumerate(terms[1:], start=1):
        both_masks = t.is_mask and all(x.is_mask for x in terms[:n])
        ops.append(draw(st.sampled_from(["&", "+"])) if both_masks else "+")
    return compose(terms, ops)


@st.composite
def attention_inputs(
    draw,
    *,
    dtypes: tuple[torch.dtype, ...] = (torch.float64,),
    families: tuple[str, ...] = FAMILIES,
    min_terms: int = 0,
    max_terms: int = 3,
    max_seqlen: int = 113,
    max_batch: int = 2,
    max_heads: int = 4,
    head_dims: tuple[int, ...] = (1, 8, 16, 33),
    allow_empty: bool = False,
    requires_grad: bool = False,
    bias_requires_grad: bool = False,
    tensor_bias: bool = False,
    max_queries: int | None = None,
) -> AttentionCase:
    """A complete :class:`AttentionCase`: shape, q/k/v of one dtype, and a bias of 0–3 families.

    ``max_queries`` caps Mq (decode cases, e.g. 16 for ``triton_splitk``), keys still up to ``max_seqlen``.

    ``requires_grad`` marks q, k, v as requiring grad (they are then leaves, or transposed views of
    leaves: read gradients with ``torch.autograd.grad``); ``bias_requires_grad`` does so for the float
    tensor of an additive term. ``tensor_bias`` sometimes passes an additive term as a plain tensor.
    Half the draws give q, k, v as non-contiguous ``[B, M, H, D]``-memory views.
    """
    dtype = draw(st.sampled_from(list(dtypes)))
    n = draw(st.integers(min_terms, max_terms)) if families else 0
    names = draw(family_lists(families, min_terms=n, max_terms=n)) if n else ()
    batch = 1 if "block_diagonal" in names else None
    shape = draw(
        shapes(max_batch=max_batch, max_heads=max_heads, max_seqlen=max_seqlen, head_dims=head_dims,
               allow_empty=allow_empty, batch=batch, max_queries=max_queries)
    )
    bias = draw(_compose_families(names, shape, torch.float64 if dtype == torch.float64 else torch.float32)) if names else None
    if bias is not None and bias_requires_grad:
        bias = _with_grad_additive(bias)
    if tensor_bias and names == ("additive",) and draw(st.booleans()):
        bias = bias.atoms[0].tensor
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    # Half the cases use PyTorch's other common layout: [B, M, H, D] memory seen through a transpose.
    transposed = draw(st.booleans())

    def make(B, H, M, D):
        t = torch.randn((B, M, H, D) if transposed else (B, H, M, D), generator=gen, dtype=torch.float64).to(dtype)
        t = t.requires_grad_(requires_grad)
        return t.transpose(1, 2) if transposed else t

    q = make(shape.B, shape.Hq, shape.Mq, shape.D)
    k = make(shape.B, shape.Hkv, shape.Mk, shape.D)
    v = make(shape.B, shape.Hkv, shape.Mk, shape.Dv)
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    return AttentionCase(shape, q, k, v, bias, scale, tuple(names))


def _with_grad_additive(bias: AttentionBias) -> AttentionBias:
    """The same bias with the float tensors of its additive terms turned into leaves that require grad."""
    from dataclasses import replace

    atoms = []
    for a in bias.atoms:
        if a.kind == "additive" and not a.is_mask:
            a = replace(a, tensor=a.tensor.detach().clone().requires_grad_(True))
        atoms.append(a)
    return bias._derive(atoms=tuple(atoms))
