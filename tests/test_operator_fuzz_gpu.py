"""Seeded random cases against the float64 reference, through every operator that accepts them and ``auto``.

Shapes favour what breaks kernels (M of 1, 2, 3, odd and large; Mq != Mk; empty and one-token
segments; grouped-query heads; head dims that are not a multiple of 64 or 8), biases are random
compositions of every family, dtypes fp16 and bf16, forward and backward. For each operator a case
either runs and matches the reference within the dtype-relative criterion, or the operator refuses
it before launch: ``not_supported_reasons`` is non-empty and ``op=`` raises ``NotSupportedError``.
Any other error, a crash or a criterion failure is a bug.

The criterion is :func:`~biasattn.testing.assert_close_to_reference` (factor 2, 3 for dq and the bias
gradient) with one addition: the low-precision yardstick is the farther from the float64 reference of
two computations in the case's dtype, the textbook math and the rounding of a flash kernel
(:func:`_flash_rounding`). On tiny tensors the two differ most: a flash backward takes ``delta`` from
the output rounded to the dtype, which on a peaked row moves dq and dk by several times the textbook
math's error, identically in FlashAttention-2, CUTLASS and cuDNN.

The ``gpu`` suite runs a fast seeded subset. A longer run writes one JSON line per case (what each
operator did) to ``BIASATTN_FUZZ_LOG``; ``BIASATTN_FUZZ_OPS`` and ``BIASATTN_FUZZ_FAMILIES`` narrow
the operators (``auto`` among them) and the bias families; ``BIASATTN_FUZZ_SEEDS=3,17`` runs only those
seeds (a failure found by a long run, drawn with the same families)::

    BIASATTN_FUZZ_CASES=3000 BIASATTN_FUZZ_LOG=fuzz.jsonl python -m pytest -q -m gpu -n 8 tests/test_operator_fuzz_gpu.py

On a machine of several GPUs, ``BIASATTN_SPREAD_GPUS=1`` puts xdist worker ``n`` on GPU ``n mod count``
(``-n 32`` on four GPUs: eight workers a GPU). Set ``OMP_NUM_THREADS=1``: the comparisons run on the
CPU, and dozens of workers each spawning a thread per core run a hundred times slower.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass

import pytest
import torch

import biasattn as ba
from biasattn.errors import NotSupportedError
from biasattn.inputs import make_inputs
from biasattn.testing import assert_close_to_reference, reference_attention
from biasattn.testing.asserts import max_abs_diff

pytestmark = pytest.mark.gpu
DEV = "cuda"
OPS = tuple(os.environ.get("BIASATTN_FUZZ_OPS", "cutlass,flash2,cudnn,triton,triton_splitk,chunked,auto").split(","))
SIZES = (1, 1, 2, 2, 3, 5, 17, 63, 64, 65, 113, 128, 203, 700)
HEAD_DIMS = (16, 32, 40, 64, 64, 80, 96, 128, 128, 192, 256, 20, 33)
FAMILIES = tuple(os.environ.get(
    "BIASATTN_FUZZ_FAMILIES", "causal,causal_br,local,padded,block_diagonal,block_sparse,additive,alibi").split(","))
CASES = int(os.environ.get("BIASATTN_FUZZ_CASES", "48"))
FIRST_SEED = int(os.environ.get("BIASATTN_FUZZ_FIRST_SEED", "0"))
PINNED = 12  # len(pinned_cases())


@dataclass
class FuzzCase:
    """One drawn call: shapes, dtype, bias and scale, as a readable description."""

    seed: int
    B: int
    Hq: int
    Hkv: int
    Mq: int
    Mk: int
    D: int
    dtype: torch.dtype
    bias: object
    additive: torch.Tensor | None
    scale: float | None
    text: str


def _split(rng: random.Random, total: int, parts: int, allow_empty: bool = True) -> list[int]:
    """``parts`` lengths summing to ``total``; empty and one-token pieces are likely."""
    if total == 0:
        return [0] * parts
    cuts = sorted(rng.randint(0, total) for _ in range(parts - 1))
    lens = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
    if not allow_empty and 0 in lens:
        return _split(rng, total, parts, allow_empty) if total >= parts else [total]
    return lens


def _term(rng: random.Random, family: str, B: int, Hq: int, Mq: int, Mk: int, dtype):
    """One bias term and a description of it; the additive tensor too when there is one."""
    if family == "causal":
        return ba.LowerTriangularMask(), "causal", None
    if family == "causal_br":
        return ba.LowerTriangularFromBottomRightMask(), "causal_br", None
    if family == "local":
        left, right = rng.choice([0, 1, 3, 31, 200]), rng.choice([0, 0, 1, 5])
        return ba.LocalAttentionMask(left, right), f"local({left},{right})", None
    if family == "padded":
        lens = [rng.choice([0, 1, Mk, Mk, rng.randint(0, Mk)]) for _ in range(B)]
        return ba.PaddedKeysMask(lens, device=DEV), f"padded({lens})", None
    if family == "block_diagonal":
        n = rng.choice([1, 2, 3, 5])
        ql = _split(rng, Mq, n)
        kl = ql if Mq == Mk and rng.random() < 0.5 else _split(rng, Mk, n)
        bias = ba.BlockDiagonalMask.from_seqlens(ql, kl, device=DEV)
        variant = rng.choice(["plain", "causal", "causal_br", "local"])
        if variant == "causal":
            bias = bias.make_causal()
        elif variant == "causal_br":
            bias = bias.make_causal_from_bottom_right()
        elif variant == "local":
            bias = bias.make_local_attention(rng.choice([0, 2, 30]), rng.choice([0, 1]))
        return bias, f"block_diagonal({ql},{kl}).{variant}", None
    if family == "block_sparse":
        bq, bk = rng.choice([16, 32, 64, 128]), rng.choice([16, 32, 64, 128])
        layout = torch.rand((1, Hq if rng.random() < 0.5 else 1, -(-Mq // bq), -(-Mk // bk))) < rng.choice([0.3, 0.7, 1.0])
        return ba.BlockSparseMask(layout.to(DEV), (bq, bk)), f"block_sparse({bq},{bk})", None
    if family == "additive":
        dims = [d if rng.random() < 0.6 else 1 for d in (B, Hq, Mq, Mk)]
        t = torch.randn(dims, device=DEV, dtype=torch.float64) * 2
        if rng.random() < 0.2:
            t[..., : max(1, dims[2] // 3), :] = float("-inf")
        t = t.to(rng.choice([torch.float32, dtype]))
        if rng.random() < 0.4:
            t.requires_grad_(True)
        return ba.AdditiveBias(t), f"additive({dims},{t.dtype},grad={t.requires_grad})", t
    if family == "alibi":
        return ba.ALiBi(ba.ALiBi.standard_slopes(Hq).to(DEV)), "alibi", None
    raise ValueError(family)


def draw_case(seed: int, families: tuple[str, ...] | None = None) -> FuzzCase:
    """The case of ``seed`` drawn from ``families`` (default: ``BIASATTN_FUZZ_FAMILIES`` or all), the same
    on every machine and run."""
    families = FAMILIES if families is None else families
    rng = random.Random(seed)
    dtype = rng.choice([torch.float16, torch.bfloat16])
    Hkv = rng.choice([1, 2, 4])
    Hq = Hkv * rng.choice([1, 1, 2, 4])
    Mq = rng.choice(SIZES)
    Mk = Mq if rng.random() < 0.4 else rng.choice(SIZES)
    D = rng.choice(HEAD_DIMS)
    n = rng.choice([0, 1, 1, 2, 2, 3])
    names: list[str] = []
    for _ in range(n):
        f = rng.choice(families)
        if f not in names or f in ("causal", "local", "padded"):
            names.append(f)
    B = 1 if "block_diagonal" in names else rng.choice([1, 2, 3])
    bias, texts, additive = None, [], None
    for f in names:
        term, text, add = _term(rng, f, B, Hq, Mq, Mk, dtype)
        additive = add if add is not None else additive
        texts.append(text)
        if bias is None:
            bias = term
        elif term.is_mask and bias.is_mask and rng.random() < 0.5:
            bias = bias & term
        else:
            bias = bias + term
    scale = None if rng.random() < 0.8 else rng.choice([0.05, 0.3, 1.0])
    text = (f"seed={seed} {str(dtype)[6:]} B={B} H={Hq}/{Hkv} Mq={Mq} Mk={Mk} D={D} scale={scale} "
            f"bias={' + '.join(texts) or None}")
    return FuzzCase(seed, B, Hq, Hkv, Mq, Mk, D, dtype, bias, additive, scale, text)


def _additive(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(shape, device=DEV, generator=gen, dtype=torch.float64) * 2).to(dtype)


def pinned_cases() -> list[FuzzCase]:
    """Cases that once failed in a vendor operator or in ``auto`` (each docstring-like text says how)."""
    bf16, fp16 = torch.bfloat16, torch.float16
    out = []

    def pin(text, B, Hq, Hkv, Mq, Mk, D, dtype, bias, additive=None):
        out.append(FuzzCase(len(out), B, Hq, Hkv, Mq, Mk, D, dtype, bias, additive, None, text))

    for name, make in (
        ("window", lambda a: ba.LocalAttentionMask(31, 0)),
        ("causal_br", lambda a: ba.LowerTriangularFromBottomRightMask()),
        ("additive", lambda a: ba.AdditiveBias(a)),
        ("causal+additive", lambda a: ba.LowerTriangularMask() + ba.AdditiveBias(a)),
    ):
        a = _additive((2, 4, 1, 1), bf16)
        pin(f"cuDNN backward with Mq = Mk = 1 raised, then crashed the process ({name})", 2, 4, 4, 1, 1, 128, bf16,
            make(a), a if "additive" in name else None)
    pin("flash2's one-query GQA path reshaped packed queries with an empty document", 1, 4, 2, 2, 700, 128, bf16,
        ba.BlockDiagonalMask.from_seqlens([1, 0, 1], [300, 200, 200], device=DEV).make_causal_from_bottom_right())
    pin("flash2's one-query GQA path, fp16, MQA, Mq = Mk = 2 over 3 documents", 1, 4, 1, 2, 2, 64, fp16,
        ba.BlockDiagonalMask.from_seqlens([1, 1, 0], [1, 0, 1], device=DEV).make_causal_from_bottom_right())
    for lens in ([0], [1]):
        pin(f"flash2 backward: CUDA invalid argument; cutlass backward: max_seqlen_k required (padded {lens})",
            1, 16, 4, 1, 1, 32, bf16, ba.LowerTriangularFromBottomRightMask() & ba.PaddedKeysMask(lens, device=DEV))
    for seed in range(4):
        a = _additive((3, 4, 2, 2), seed=seed)
        pin(f"dK above the criterion: GQA, D=80, bottom-right causal + float32 additive (seed {seed})",
            3, 4, 2, 2, 2, 80, bf16, ba.LowerTriangularFromBottomRightMask() + ba.AdditiveBias(a), None)
    return out


def _tensors(case: FuzzCase):
    gen = torch.Generator(device=DEV).manual_seed(case.seed)

    def make(*shape):
        return torch.randn(shape, device=DEV, dtype=torch.float64, generator=gen).to(case.dtype)

    q, dout = make(case.B, case.Hq, case.Mq, case.D), make(case.B, case.Hq, case.Mq, case.D)
    k, v = make(case.B, case.Hkv, case.Mk, case.D), make(case.B, case.Hkv, case.Mk, case.D)
    return q, k, v, dout


def _references(case: FuzzCase, q, k, v, dout):
    """``{"ref", "low", "flash"}: (out, grads)``: float64, the textbook math in the case's dtype, and the
    rounding of a flash kernel (:func:`_flash_rounding`)."""
    res = {}
    dense = None
    if case.bias is not None:
        dense = case.bias.materialize((case.B, case.Hq, case.Mq, case.Mk), dtype=torch.float64, device=DEV)
    for name, cd in (("ref", torch.float64), ("low", case.dtype)):
        leaves = [t.detach().to(cd).requires_grad_(True) for t in (q, k, v)]
        bias = None if dense is None else dense.to(cd).detach()
        if case.additive is not None and case.additive.requires_grad:
            # the gradient of the additive term equals the gradient of the dense bias, summed over broadcast dims
            bias = bias.requires_grad_(True)
            leaves.append(bias)
        out, _ = reference_attention(*leaves[:3], None, scale=case.scale, compute_dtype=cd, bias_dense=bias)
        grads = torch.autograd.grad(out, leaves, dout.to(cd), allow_unused=True)
        if len(grads) == 4:
            grads = (*grads[:3], _sum_to(grads[3], case.additive.shape))
        res[name] = (out, grads)
    res["flash"] = _flash_rounding(case, q, k, v, dout, dense)
    return res


def _flash_rounding(case: FuzzCase, q, k, v, dout, dense):
    """``(out, (dq, dk, dv, dbias or None))`` computed as flash kernels round: float32 scores, softmax
    and accumulation; ``P`` and ``dS`` rounded to the case's dtype before their products; the output
    stored in the dtype and ``delta = rowsum(dout * out)`` taken from it; dK and dV summed over a
    query-head group in float32; a bias gradient stored in the bias's dtype entry by entry, then summed
    over broadcast dimensions. Where a kernel's rounding differs from the textbook low-precision math
    (a peaked row's ``delta``, a large ``dv`` entry) this is the yardstick that every such kernel meets."""
    lp, f32 = case.dtype, torch.float32
    groups = case.Hq // case.Hkv
    qf = q.to(f32)
    kf, vf = (t.to(f32).repeat_interleave(groups, dim=1) for t in (k, v))
    scale = case.scale if case.scale is not None else case.D**-0.5
    s = (qf @ kf.transpose(-1, -2)) * scale
    if dense is not None:
        s = s + dense.to(f32)
    m = s.amax(-1, keepdim=True) if case.Mk else s.new_zeros(s.shape[:-1] + (1,))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = ((p.to(lp).to(f32) @ vf) / safe).to(lp)
    prob = p / safe
    dof = dout.to(f32)
    ds = prob * ((dof @ vf.transpose(-1, -2)) - (dof * out.to(f32)).sum(-1, keepdim=True))

    def by_kv_head(g):  # [B, Hq, Mk, D] -> [B, Hkv, Mk, D], summed in float32
        return g.reshape(case.B, case.Hkv, groups, *g.shape[2:]).sum(2)

    dq = ((ds.to(lp).to(f32) @ kf) * scale).to(lp)
    dk = (by_kv_head(ds.to(lp).to(f32).transpose(-1, -2) @ qf) * scale).to(lp)
    dv = by_kv_head(prob.to(lp).to(f32).transpose(-1, -2) @ dof).to(lp)
    dbias = None
    if case.additive is not None and case.additive.requires_grad:
        dbias = _sum_to(ds.to(case.additive.dtype).to(f32), case.additive.shape).to(case.additive.dtype)
    return out, (dq, dk, dv, dbias)


def _sum_to(g: torch.Tensor, shape) -> torch.Tensor:
    dims = [d for d, n in enumerate(shape) if n == 1 and g.shape[d] != 1]
    return g.sum(dims, keepdim=True) if dims else g


def _check(case: FuzzCase, op: str | None, refs) -> str:
    """Run ``op`` (None = auto) on the case; returns "ran" or "refused"; raises on any defect."""
    q, k, v, dout = _tensors(case)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    if case.additive is not None and case.additive.requires_grad:
        case.additive.grad = None
    if op is not None:
        inp = make_inputs(*leaves, case.bias, scale=case.scale, requires_grad=True)
        why = ba.ops.get(op).not_supported_reasons(inp)
        if why:
            with pytest.raises(NotSupportedError):
                ba.attention(*leaves, case.bias, scale=case.scale, op=op)
            return "refused"
    out = ba.attention(*leaves, case.bias, scale=case.scale, op=op)
    wrt = list(leaves)
    if case.additive is not None and case.additive.requires_grad:
        wrt.append(case.additive)
    got = torch.autograd.grad(out, wrt, dout, allow_unused=True)
    name = op or "auto"
    ref_out, ref_grads = refs["ref"]
    low_out, low_grads = refs["low"]
    flash_out, flash_grads = refs["flash"]
    assert_close_to_reference(out, ref_out, _yardstick(low_out, flash_out, ref_out), name=f"{name} out")
    for n, g, r, lo, fl in zip(("dq", "dk", "dv", "dbias"), got, ref_grads, low_grads, flash_grads):
        assert g is not None, f"{name} gave no {n}"
        factor = 3.0 if n in ("dq", "dbias") else 2.0
        assert_close_to_reference(g, r, _yardstick(lo, fl, r), factor=factor, name=f"{name} {n}")
    return "ran"


def _yardstick(low, flash, ref):
    """Of the two low-precision computations, the one farther from the float64 reference: the criterion
    asks an operator to be within a small multiple of the error that its dtype costs either way."""
    if flash is None:
        return low
    return flash if max_abs_diff(flash.cpu(), ref.cpu()) > max_abs_diff(low.cpu(), ref.cpu()) else low


def _run_all(case: FuzzCase) -> None:
    q, k, v, dout = _tensors(case)
    refs = _references(case, q, k, v, dout)
    results, failures, seconds = {}, [], {}
    for op in (None if name == "auto" else name for name in OPS):
        if op is not None and op not in ba.ops.available():
            continue
        start = time.perf_counter()
        try:
            results[op or "auto"] = _check(case, op, refs)
        except Exception as e:  # noqa: BLE001 - every operator is tried; all failures are reported together
            results[op or "auto"] = "failed"
            failures.append(f"{op or 'auto'}: {type(e).__name__}: {str(e)[:400]}")
        seconds[op or "auto"] = round(time.perf_counter() - start, 3)
    log = os.environ.get("BIASATTN_FUZZ_LOG")
    if log:
        with open(log, "a") as f:
            record = {"case": case.text, "results": results, "failures": failures, "seconds": seconds}
            f.write(json.dumps(record) + "\n")
    assert not failures, case.text + "\n" + "\n".join(failures)


SEEDS = [int(s) for s in os.environ["BIASATTN_FUZZ_SEEDS"].split(",")] if os.environ.get("BIASATTN_FUZZ_SEEDS") else (
    range(FIRST_SEED, FIRST_SEED + CASES))


@pytest.mark.parametrize("seed", SEEDS)
def test_operators_match_reference_on_random_cases(seed):
    """Every operator that accepts a random case matches the reference (forward, backward); the others refuse before launch."""
    _run_all(draw_case(seed))


VENDOR_FAMILIES = ("causal", "causal_br", "additive")
#: Random cases that once missed the criterion or gave NaN, with the families they were drawn from.
PINNED_SEEDS = (
    (211247, None),  # dq of cutlass and flash2 (identical): delta from the rounded output on a peaked row
    (20265, None),  # triton's bias gradient summed over 128 queries
    # dv of all three vendors (identical): -9.1875 against a true -9.1411, one bf16 unit; they store grouped-query
    # dv per head in bf16 before the group sum. Fails the strict bound on the H200: a criterion decision, open
    (731808, VENDOR_FAMILIES),
    (702267, VENDOR_FAMILIES),  # cutlass's gradient of a scalar bias: exactly 0, rounded terms summed
    (715102, VENDOR_FAMILIES),  # cuDNN's NaN grad_q with a bias at Mq = 1 (now refused)
    (561136, None),  # flash2's left window with Mq > Mk + 1: first rows lost their keys (now refused)
)


@pytest.mark.parametrize(("seed", "families"), PINNED_SEEDS, ids=[str(s) for s, _ in PINNED_SEEDS])
def test_operators_on_random_cases_that_once_failed(seed, families):
    """Random cases found by long runs: they meet the criterion, cuDNN refuses Mq = 1 with a bias, and FlashAttention-2
    refuses a left window over more than ``Mk + 1`` queries."""
    _run_all(draw_case(seed, families))


@pytest.mark.parametrize("index", range(PINNED))
def test_operators_on_cases_that_once_failed(index):
    """Edge shapes that crashed or raised inside vendor kernels, or missed the criterion, now run or are refused up front."""
    cases = pinned_cases()
    assert len(cases) == PINNED
    case = cases[index]
    for _ in range(2):  # a failed vendor call must not leave the process unable to run the next one
        _run_all(case)
