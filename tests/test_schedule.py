"""The per-segment tile tables of the Triton kernels (built on the device, here under the interpreter):
every line in exactly one program, no program straddling two segments, longest spans first and later
tiles first, as a plain loop would build them, then programs with no lines up to a row count that
follows from shapes alone."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import biasattn as ba
from biasattn.inputs import make_inputs
from biasattn.ops.triton.schedule import key_schedule, query_schedule, segment_tables

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _plain(starts, ends, total, block, spans):
    """The tables written as loops: tiles of each segment, then of the uncovered lines, sorted by
    ``(span, first line)`` descending (uncovered lines have span -1)."""
    progs = []
    for s, (a, b) in enumerate(zip(starts, ends)):
        progs += [((spans[s] if spans else 0, t), (t, min(t + block, b), s)) for t in range(a, b, block)]
    pos = 0
    gaps = []
    for a, b in sorted((a, b) for a, b in zip(starts, ends) if b > a):
        if a > pos:
            gaps.append((pos, a))
        pos = max(pos, b)
    if pos < total:
        gaps.append((pos, total))
    for a, b in gaps:
        progs += [((-1, t), (t, min(t + block, b), -1)) for t in range(a, b, block)]
    return [p for _, p in sorted(progs, key=lambda x: x[0], reverse=True)]


def _random_segments(rng: random.Random, total: int, n: int, holes: bool):
    cuts = sorted(rng.randint(0, total) for _ in range(2 * n if holes else n - 1))
    if holes:  # segments with uncovered lines between them (and empty ones)
        pairs = list(zip(cuts[::2], cuts[1::2]))
        return [a for a, _ in pairs], [b for _, b in pairs]
    bounds = [0, *cuts, total]
    return bounds[:-1], bounds[1:]


def _rows(table: torch.Tensor) -> list[tuple[int, int, int]]:
    return [tuple(row) for row in table.tolist()]


@pytest.mark.parametrize("seed", range(40))
def test_tables_match_the_plain_loops(seed):
    """One launch builds tables along the keys (segments with holes between them, ordered by query
    count) and along the queries (ordered by key count), of several tile lengths."""
    rng = random.Random(seed)
    total = rng.choice([0, 1, 17, 64, 300, 1000])
    n = rng.randint(1, 150 if seed % 10 == 0 else 9)  # more than one program of the table kernel at times
    starts, ends = _random_segments(rng, total, n, holes=seed % 2 == 1)
    lens = [e - a for a, e in zip(starts, ends)]
    q_counts = [rng.randint(0, 40) for _ in starts]
    q_starts = [0, *itertools.accumulate(q_counts)]
    wanted = tuple(rng.sample([(keys, b) for keys in (False, True) for b in (16, 32, 64, 128)], rng.randint(1, 6)))
    i32 = dict(dtype=torch.int32, device=DEVICE)
    scheds = segment_tables(torch.tensor(q_starts, **i32), torch.tensor(starts, **i32), torch.tensor(lens, **i32),
                            q_starts[-1], total, wanted)
    for (keys, block), sched in zip(wanted, scheds):
        lines = total if keys else q_starts[-1]
        want = (_plain(starts, ends, total, block, q_counts) if keys
                else _plain(q_starts[:-1], q_starts[1:], lines, block, lens))
        got = _rows(sched.table)
        assert (sched.n, sched.total, sched.block) == (lines // block + 2 * len(starts) + 2, lines, block)
        assert got == want + [(0, 0, -1)] * (sched.n - len(want)), (keys, block)
        covered = sorted(line for a, e, _ in got for line in range(a, e))
        assert covered == list(range(lines))


def test_one_launch_makes_the_tables_of_every_usual_tile(monkeypatch):
    """The first table a packed spec asks for brings both roles' tables of the usual tile lengths."""
    from biasattn.ops.triton import schedule

    q = torch.zeros(1, 1, 24, 8, device=DEVICE)
    spec = make_inputs(q, q, q, ba.BlockDiagonalMask.from_seqlens([5, 9, 10])).spec
    launches = []
    real = schedule.segment_tables
    monkeypatch.setattr(schedule, "segment_tables", lambda *a: launches.append(a[-1]) or real(*a))
    first = key_schedule(spec, 16, q.device)
    assert [query_schedule(spec, b, q.device).block for b in (16, *schedule.TABLE_BLOCKS)] == [16, 64, 128]
    assert [key_schedule(spec, b, q.device).block for b in schedule.TABLE_BLOCKS] == [64, 128]
    assert key_schedule(spec, 16, q.device) is first
    assert launches == [((False, 16), (True, 16), (False, 64), (True, 64), (False, 128), (True, 128))]


def test_schedules_of_a_packed_call():
    """Three documents of 5, 9 and 10 queries over 7, 3 and 14 keys, tiles of 4."""
    q = torch.zeros(1, 1, 24, 8, device=DEVICE)
    spec = make_inputs(q, q, q, ba.BlockDiagonalMask.from_seqlens([5, 9, 10], [7, 3, 14])).spec
    qs = query_schedule(spec, 4, q.device)
    # query tiles by their documents' key counts (14, 7, 3), later tiles first
    assert _rows(qs.table) == [(22, 24, 2), (18, 22, 2), (14, 18, 2), (4, 5, 0), (0, 4, 0), (13, 14, 1), (9, 13, 1),
                               (5, 9, 1)] + [(0, 0, -1)] * 6
    ks = key_schedule(spec, 4, q.device)  # key tiles by their documents' query counts (10, 9, 5)
    assert _rows(ks.table) == [(22, 24, 2), (18, 22, 2), (14, 18, 2), (10, 14, 2), (7, 10, 1), (4, 7, 0), (0, 4, 0)] + [
        (0, 0, -1)] * 7
    assert query_schedule(spec, 4, q.device) is qs  # built once per spec


def test_a_table_needs_no_host_copy_of_the_lengths():
    """A spec whose segments only the device holds (no host copies at all) gets the same table."""
    from biasattn.bias.spec import BiasSpec

    qs = torch.tensor([0, 5, 14, 24], dtype=torch.int32, device=DEVICE)
    spec = BiasSpec(B=1, H=1, Mq=24, Mk=24, q_seqstart=qs, k_seqstart=qs, k_seqlen=qs.diff())
    assert spec.host.q_seqstart is None
    got = [row for row in _rows(query_schedule(spec, 4, qs.device).table) if row[1] > row[0]]
    assert got == [(22, 24, 2), (18, 22, 2), (14, 18, 2), (13, 14, 1), (9, 13, 1), (5, 9, 1), (4, 5, 0), (0, 4, 0)]
