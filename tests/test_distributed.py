"""Context parallelism on the CPU: gloo process groups of 2 and 4 ranks, float64, the chunked operator.

One pool of spawned processes per world size runs every case; each case checks all three methods
and both layouts against single-process ``biasattn.attention`` on the gathered tensors (output and
gradients of q, k, v and an additive bias' tensor).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import example, given, settings
from hypothesis import strategies as st

import biasattn as ba
from biasattn.distributed.layout import assemble, pieces, split
from biasattn.distributed.sparse import SPARSE_MAX_SHARE
from biasattn.testing import assert_close_to_reference
from biasattn.testing import strategies as bst

WORLDS = (2, 4)
CASE_TIMEOUT_S = 120


# ----------------------------------------------------------------------------- cases
@dataclasses.dataclass
class Case:
    """One distributed attention call, drawn in the parent and run by every rank."""

    shape: bst.Shape
    bias: object
    seed: int
    scale: float | None = None
    bias_grad: bool = False
    methods: tuple[str, ...] = ("ring", "allgather", "ulysses")
    layouts: tuple[str, ...] = ("zigzag", "contiguous")
    ops: tuple[str, ...] = ("chunked",)


@st.composite
def cp_shapes(draw, world: int, batch: int | None = None) -> bst.Shape:
    """Shapes whose sequences cut into 2R chunks and whose query heads divide by R (for ulysses)."""
    n = 2 * world
    Hq = world * draw(st.sampled_from([1, 2]))
    Hkv = draw(st.sampled_from([h for h in range(1, Hq + 1) if Hq % h == 0]))
    Mq = n * draw(st.integers(1, 3))
    Mk = draw(st.sampled_from([Mq, n * draw(st.integers(1, 3))]))
    D = draw(st.sampled_from([3, 8]))
    Dv = draw(st.sampled_from([D, D // 2 + 1]))
    B = batch if batch is not None else draw(st.integers(1, 2))
    return bst.Shape(B, Hq, Hkv, Mq, Mk, D, Dv)


@st.composite
def cp_cases(draw, world: int, families: tuple[str, ...], min_terms: int = 1, max_terms: int = 1) -> Case:
    """A :class:`Case` with a bias of ``families`` (one family, or compositions)."""
    shape = draw(cp_shapes(world, batch=1 if families == ("block_diagonal",) else None))
    bias = draw(bst.biases(shape, families, min_terms=min_terms, max_terms=max_terms))
    has_float_additive = any(a.kind == "additive" and not a.is_mask for a in bias.atoms)
    return Case(
        shape, bias, draw(st.integers(0, 2**31 - 1)), draw(st.one_of(st.none(), st.floats(0.1, 1.5))),
        bias_grad=has_float_additive and draw(st.booleans()),
    )


# ----------------------------------------------------------------------------- worker side
def _with_grad_additive(bias):
    atoms = tuple(
        dataclasses.replace(a, tensor=a.tensor.detach().clone().requires_grad_(True))
        if a.kind == "additive" and not a.is_mask else a
        for a in bias.atoms
    )
    return bias._derive(atoms=atoms)


def _bias_leaves(bias) -> list[torch.Tensor]:
    return [t for a in bias.atoms for t in a.tensors().values() if t.requires_grad] if bias is not None else []


def check_case(case: Case) -> None:
    """Every method and layout of ``case`` against single-process attention on the full tensors."""
    s = case.shape
    gen = torch.Generator().manual_seed(case.seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    q, k, v = randn(s.B, s.Hq, s.Mq, s.D), randn(s.B, s.Hkv, s.Mk, s.D), randn(s.B, s.Hkv, s.Mk, s.Dv)
    dout = randn(s.B, s.Hq, s.Mq, s.Dv)
    bias = _with_grad_additive(case.bias) if case.bias_grad else case.bias
    leaves = _bias_leaves(bias)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with ba.use_ops(*case.ops):
        ref = ba.attention(*full, bias, scale=case.scale)
    ref_grads = torch.autograd.grad(ref, full + leaves, dout, allow_unused=True)
    for layout in case.layouts:
        for method in case.methods:
            where = f"{method}/{layout}"
            local = [ba.distributed.shard_sequence(t, layout=layout).requires_grad_(True) for t in (q, k, v)]
            with ba.use_ops(*case.ops):
                out = ba.distributed.context_parallel_attention(*local, bias, layout=layout, method=method, scale=case.scale)
            grads = torch.autograd.grad(out, local + leaves, ba.distributed.shard_sequence(dout, layout=layout),
                                        allow_unused=True)
            assert_close_to_reference(ba.distributed.gather_sequence(out.detach(), layout=layout), ref, name=f"{where} out")
            for name, g, r in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3]):
                assert_close_to_reference(ba.distributed.gather_sequence(g, layout=layout), r, name=f"{where} {name}")
            for g, r in zip(grads[3:], ref_grads[3:]):
                g = torch.zeros_like(r) if g is None else g.clone()
                dist.all_reduce(g)  # each rank holds its share of a replicated tensor's gradient
                assert_close_to_reference(g, r, name=f"{where} dbias")


def count_launches(layout: str, method: str, M: int) -> dict[str, int]:
    """Operator fwd/bwd calls of one causal call on this rank (a spy around the chunked operator)."""
    op = ba.ops.get("chunked")
    counts = {"fwd": 0, "bwd": 0}
    real_fwd, real_bwd = op.fwd, op.bwd

    def fwd(inp):
        counts["fwd"] += 1
        return real_fwd(inp)

    def bwd(*args):
        counts["bwd"] += 1
        return real_bwd(*args)

    op.fwd, op.bwd = fwd, bwd
    try:
        x = torch.randn(1, 2, M, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        q = ba.distributed.shard_sequence(x, layout=layout).requires_grad_(True)
        with ba.use_ops("chunked"):
            out = ba.distributed.context_parallel_attention(q, q, q, ba.LowerTriangularMask(), layout=layout, method=method)
        out.sum().backward()
    finally:
        del op.fwd, op.bwd
    return counts


def rows_received(layout: str, M: int, lens: list[int]) -> list[int]:
    """Rows this rank receives in each all-to-all of one causal packed-documents call, forward and backward
    (a spy around ``all_to_all_single``); the call's output and gradients are checked by ``check_case``."""
    received = []
    real = dist.all_to_all_single

    def spy(out, inp, out_splits=None, in_splits=None, group=None):
        received.append(sum(out_splits))
        return real(out, inp, out_splits, in_splits, group=group)

    dist.all_to_all_single = spy
    try:
        x = torch.randn(1, 2, M, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        q = ba.distributed.shard_sequence(x, layout=layout).requires_grad_(True)
        bias = ba.BlockDiagonalMask.from_seqlens(lens).make_causal()
        with ba.use_ops("chunked"):
            out = ba.distributed.context_parallel_attention(q, q, q, bias, layout=layout, method="ring")
        out.sum().backward()
    finally:
        dist.all_to_all_single = real
    return received


def check_errors() -> None:
    """Clear errors for what context parallelism refuses."""
    world = dist.get_world_size()
    x = torch.randn(1, 2 * world, 2 * world + 1, 4, dtype=torch.float64)
    with pytest.raises(ba.InputError, match=rf"x has {2 * world + 1} rows .* not a multiple of {2 * world}"):
        ba.distributed.shard_sequence(x)
    odd = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    with pytest.raises(ba.InputError, match="q holds 3 rows .* multiple of 2"):
        ba.distributed.context_parallel_attention(odd, odd, odd)
    q = torch.randn(1, world + 1, 2, 4, dtype=torch.float64)
    with pytest.raises(ba.InputError, match=rf"Hq={world + 1} heads, not a multiple of {world}"):
        ba.distributed.context_parallel_attention(q, q, q, method="ulysses")
    q = torch.randn(1, world, 2, 4, dtype=torch.float64, requires_grad=True)
    for method in ("ring", "allgather"):
        with pytest.raises(ba.NotSupportedError, match=f"method='{method}' does not support dropout"):
            ba.distributed.context_parallel_attention(q, q, q, dropout_p=0.1, method=method)
    with ba.use_ops("chunked"):
        out = ba.distributed.context_parallel_attention(q, q, q, dropout_p=0.5, method="ulysses")
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    with pytest.raises(ba.InputError, match=r"method must be one of .* got 'tree'"):
        ba.distributed.context_parallel_attention(q, q, q, method="tree")
    with pytest.raises(ba.InputError, match=r"layout must be one of .* got 'striped'"):
        ba.distributed.context_parallel_attention(q, q, q, layout="striped")
    bias = ba.AdditiveBias(torch.zeros(3, 3, dtype=torch.float64))
    with pytest.raises(ba.InputError, match=rf"attn_bias describes the full sequence: it has Mq=3, .* Mq={2 * world}"):
        ba.distributed.context_parallel_attention(q, q, q, bias)


def _worker(rank: int, world: int, backend: str, store: str, tasks, results) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        while (task := tasks.get()) is not None:
            module, name, args = task
            try:
                results.put((rank, None, getattr(importlib.import_module(module), name)(*args)))
            except BaseException:  # noqa: BLE001 - the traceback goes back to the parent
                results.put((rank, traceback.format_exc(), None))
    finally:
        dist.destroy_process_group()


class Pool:
    """``world`` spawned processes in one process group; ``run(name, *args)`` calls ``module.name`` on every rank."""

    def __init__(self, world: int, backend: str = "gloo", module: str = __name__):
        ctx = mp.get_context("spawn")
        self.world, self.module = world, module
        self.dir = tempfile.TemporaryDirectory()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        store = os.path.join(self.dir.name, "store")
        self.procs = [ctx.Process(target=_worker, args=(r, world, backend, store, self.tasks[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, name: str, *args) -> list:
        for t in self.tasks:
            t.put((self.module, name, args))
        got = [self.results.get(timeout=CASE_TIMEOUT_S) for _ in range(self.world)]
        errors = [f"rank {r}:\n{err}" for r, err, _ in sorted(got, key=lambda g: g[0]) if err]
        if errors:
            raise AssertionError("\n".join(errors))
        return [value for _, _, value in sorted(got, key=lambda g: g[0])]

    def close(self) -> None:
        for t in self.tasks:
            t.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self.dir.cleanup()


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def pool(request):
    p = Pool(request.param)
    yield p
    p.close()


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("family", bst.FAMILIES)
def test_every_family_matches_single_process_attention(pool, family):
    @settings(max_examples=3)
    @given(cp_cases(pool.world, (family,)))
    def check(case):
        pool.run("check_case", case)

    check()


def test_compositions_match_single_process_attention(pool):
    @settings(max_examples=6)
    @given(cp_cases(pool.world, bst.FAMILIES, min_terms=2, max_terms=3))
    def check(case):
        pool.run("check_case", case)

    check()


def test_packed_documents_with_padding_and_window_match(pool):
    """Documents that cross shard boundaries, padded keys and a window, with a learned additive bias."""
    R = pool.world
    M = 4 * R * 3
    lens = [5, 0, M - 5 - 7 - 1, 7, 1]
    bias = ba.BlockDiagonalMask.from_seqlens(lens).make_causal() & ba.PaddedKeysMask([M - 3]) & ba.LocalAttentionMask(6, 0)
    bias = bias + ba.AdditiveBias(torch.randn(1, 2 * R, M, M, dtype=torch.float64))
    pool.run("check_case", Case(bst.Shape(1, 2 * R, R, M, M, 8, 8), bias, seed=1, bias_grad=True))


def test_operators_without_a_global_lse_backward_give_the_same_gradients(pool):
    """The reference operator's backward re-derives each pair's own out and lse (the generic path)."""
    R = pool.world
    shape = bst.Shape(2, R, 1, 4 * R, 2 * R, 4, 3)
    bias = ba.LowerTriangularFromBottomRightMask() + ba.ALiBi(torch.rand(R, dtype=torch.float64))
    pool.run("check_case", Case(shape, bias, seed=2, methods=("ring", "allgather"), ops=("reference",)))


@pytest.mark.parametrize("method", ["ring", "allgather"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_hidden_pairs_launch_nothing(pool, layout, method):
    """Under a causal mask only the (query chunk, key chunk) pairs on or below the diagonal are launched (ring),
    or per query piece the keys before it and its diagonal square (all-gather)."""
    R = pool.world
    counts = pool.run("count_launches", layout, method, 4 * R)
    n = 2 * R if layout == "zigzag" else R
    if method == "ring":
        expected = n * (n + 1) // 2  # one launch per visible chunk pair
    else:  # per query piece: the keys before it at once, and its causal square (the first piece has no keys before)
        pieces_ = R * (2 if layout == "zigzag" else 1)
        expected = 2 * pieces_ - 1
    assert sum(c["fwd"] for c in counts) == expected
    assert sum(c["bwd"] for c in counts) == expected


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_packed_documents_move_only_the_key_rows_some_query_sees(pool, layout):
    """Causal documents: a rank receives from the others exactly the key rows that one of its queries sees (the
    rows of documents that cross into its chunks from another rank's), counted on the dense mask; K and V travel
    together in one all-to-all in the forward, and dK/dV come back the same way in the backward. Results equal
    single-process attention."""
    R = pool.world
    M = 2 * R * 16
    lens = []
    while sum(lens) < M:
        lens.append(min((3, 7, 5, 2, 6, 4)[len(lens) % 6], M - sum(lens)))
    bias = ba.BlockDiagonalMask.from_seqlens(lens).make_causal()
    visible = bias.materialize((1, 1, M, M), dtype=torch.float64)[0, 0] == 0
    rows = [[i for p in pieces(layout, R, r, M) for i in range(p.start, p.start + p.length)] for r in range(R)]
    reads = [[int(visible[rows[d]][:, rows[s]].any(0).sum()) if d != s else 0 for s in range(R)] for d in range(R)]
    assert 0 < sum(map(sum, reads)) <= SPARSE_MAX_SHARE * R * (R - 1) * (M // R)  # what an all-gather moves
    received = pool.run("rows_received", layout, M, lens)
    for r in range(R):
        read, read_from_r = sum(reads[r]), sum(reads[d][r] for d in range(R))
        assert received[r] == [read, read_from_r], (r, received[r], reads)
    pool.run("check_case", Case(bst.Shape(1, 2 * R, R, M, M, 4, 4), bias, seed=3, methods=("ring", "allgather"),
                                layouts=(layout,)))


def test_refusals_give_clear_errors(pool):
    pool.run("check_errors")


@given(st.sampled_from(["zigzag", "contiguous"]), st.integers(1, 5), st.integers(1, 4))
@example("zigzag", 3, 2)
def test_split_and_assemble_are_inverse(layout, world, chunk):
    M = chunk * (2 * world if layout == "zigzag" else world)
    x = torch.arange(M).reshape(1, 1, M, 1)
    shards = split(x, 2, layout, world)
    assert torch.equal(assemble(shards, 2, layout), x)
    rows = sorted(i for r in range(world) for p in pieces(layout, world, r, M) for i in range(p.start, p.start + p.length))
    assert rows == list(range(M))
    if layout == "zigzag":
        assert [p.start // chunk for p in pieces(layout, world, 0, M)] == [0, 2 * world - 1]


@settings(max_examples=40)
@given(st.sampled_from([2, 4]), st.sampled_from(["zigzag", "contiguous"]), st.data())
def test_rows_read_hold_every_key_a_rank_sees(world, layout, data):
    """The rows a rank reads from the others (computed on the host from the full bias, the same on every
    rank) hold every key that one of its queries sees on the dense mask, for any bias and composition."""
    from biasattn.distributed.ring import Call
    from biasattn.distributed.sparse import rows_read

    shape = data.draw(cp_shapes(world))
    bias = data.draw(bst.biases(shape, bst.FAMILIES, min_terms=1, max_terms=2))
    full = bias.bind(shape.Mq, shape.Mk) if bias.sizes[2] is None or bias.sizes[3] is None else bias
    reads = rows_read(Call(None, world, 0, layout, 1.0, full, shape.Mq, shape.Mk, False), shape.B, shape.Hq, None)
    visible = (full.materialize((shape.B, shape.Hq, shape.Mq, shape.Mk), dtype=torch.float64) > float("-inf"))
    visible = visible.expand(shape.B, shape.Hq, shape.Mq, shape.Mk).any(0).any(0)
    for r in range(world):
        rows = [i for p in pieces(layout, world, r, shape.Mq) for i in range(p.start, p.start + p.length)]
        for s in range(world):
            keys = [j for p in pieces(layout, world, s, shape.Mk) for j in range(p.start, p.start + p.length)]
            seen = [keys[j] for j in visible[rows][:, keys].any(0).nonzero().flatten().tolist()]
            assert all(any(a <= j < b for a, b in reads[r][s]) for j in seen), (r, s, seen, reads[r][s])


@settings(max_examples=60)
@given(st.sampled_from([2, 4]), st.sampled_from(["zigzag", "contiguous"]), st.data())
def test_packed_documents_restricted_to_a_rank_are_the_full_mask_at_its_rows(world, layout, data):
    """The mask a rank's one local call takes (its query rows against the key rows it holds and reads) equals
    the full packed-documents mask at those rows, wherever every rank's restriction is block-diagonal; where a
    query row would be cut off from a key it sees, no rank takes that path."""
    from biasattn.bias.band import BOTTOM_RIGHT, TOP_LEFT
    from biasattn.distributed.documents import _blocks, documents_bias
    from biasattn.distributed.ring import Call
    from biasattn.distributed.sparse import rows_read

    M = 2 * world * data.draw(st.integers(1, 6), label="chunk")
    lens = data.draw(st.lists(st.integers(0, M), min_size=1, max_size=8).filter(lambda ls: sum(ls) <= M), label="lens")
    lens = lens + [M - sum(lens)]
    band = data.draw(st.sampled_from([None, (TOP_LEFT, None, 0), (BOTTOM_RIGHT, 3, 0), (BOTTOM_RIGHT, 2, 1)]))
    bias = ba.BlockDiagonalMask.from_seqlens(lens)
    bias = bias if band is None else bias._with_band(band)
    visible = bias.materialize((1, 1, M, M), dtype=torch.float64)[0, 0] > float("-inf")
    calls = [Call(None, world, r, layout, 1.0, bias, M, M, False) for r in range(world)]
    reads = rows_read(calls[0], 1, 1, None)
    got = [documents_bias(c, reads, None) for c in calls]
    assert all(g is None for g in got) or all(g is not None for g in got)
    for r, local in enumerate(got):
        rows = [i for p in pieces(layout, world, r, M) for i in range(p.start, p.start + p.length)]
        keys = [j for a, b in _blocks(calls[r], reads, r) for j in range(a, b)]
        assert not (visible[rows].any(0) & ~torch.isin(torch.arange(M), torch.tensor(keys))).any()  # nothing cut off
        if local is not None:
            mask = local.materialize((1, 1, len(rows), len(keys)), dtype=torch.float64)[0, 0] > float("-inf")
            assert torch.equal(mask, visible[rows][:, keys]), (r, lens, band)
    chunk = M // (2 * world)
    if band is None or (band[2] == 0 and max(lens) <= chunk):  # no band, or causal documents no longer than a chunk
        assert got[0] is not None


def test_packed_documents_plan_is_worked_out_once_per_bias():
    """The rows read and a rank's restricted documents mask are kept with the full bias: the layers of a
    model that pass one bias share them (and the restricted mask's own lowering)."""
    from biasattn.distributed.documents import reads_and_documents
    from biasattn.distributed.ring import Call

    bias = ba.BlockDiagonalMask.from_seqlens([5, 9, 2, 16]).make_causal()
    call = Call(None, 2, 1, "zigzag", 1.0, bias.bind(32, 32), 32, 32, False)
    first, again = reads_and_documents(call, 1, 2, None), reads_and_documents(call, 1, 2, None)
    assert first[1] is not None and again[1] is first[1] and again[0] is first[0]
    other = reads_and_documents(dataclasses.replace(call, rank=0), 1, 2, None)
    assert other[1] is not first[1] and other[1].q_seqlens != first[1].q_seqlens
