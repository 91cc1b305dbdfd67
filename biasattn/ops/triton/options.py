"""The launch choices of the Triton operators, in one frozen object.

Each default is a measured decision (``docs/design.md`` gives the evidence and the command that
repeats it); tests and A/B benchmarks run a block under other choices with :func:`use`::

    with options.use(fused_delta=False, plans=False):
        ba.attention(q, k, v, bias, op="triton")

Launch plans are keyed by the :func:`current` object, so a plan recorded under one set of choices is
never replayed under another.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Options:
    """What the Triton launchers may do; the defaults are the measured choices. Plan keys hold it:
    its hash is computed once."""

    plans: bool = True  # replay recorded launch plans (plans.py)
    direct_launch: bool = True  # launch compiled kernels directly (launch.py), not through ``kernel[grid]``
    specializations: bool = True  # the direct path's second table, keyed by argument specialization
    descriptors: bool = True  # forward K/V tiles through tensor descriptors (TMA) where the device has them
    descriptors_interpreted: bool = False  # tests: descriptors under the Triton interpreter too
    descriptors_min_scores: int = 2**24  # forwards computing fewer scores (flash.computed_scores) keep pointer loads
    gluon_forward: bool = True  # forwards at D=128, 256 on sm_90 (no bias, interval masks, block layouts): gluon_forward.py
    gluon_backward: bool = True  # backwards at head dims 64, 128, 256 on sm_90 (the same masks): gluon_backward.py
    gluon_min_scores: int = 2**26  # ... when they compute at least this many scores (smaller calls run faster without them)
    gluon_bwd_min_visible: int = 110_000_000  # ... the backward at D=128 from this many visible scores B·H·Mq·(mean keys)
    gluon_layout_min_scores: int = 2**29  # block layouts take the Gluon kernels from this many scores B·H·Mq·Mk
    list_in_registers: bool = True  # branch-free tile-list loops keep the program's list in registers
    order_tail_waves: int = 4  # forwards, Gluon backward at D=64: waves at a grid's end started rank by rank (0: plain)
    concurrent_bwd: bool = True  # long backwards run dQ on a side stream beside dK/dV
    fused_delta: bool = True  # without the side stream, dQ runs first and computes delta itself
    dq_from_ds: bool = True  # a per-(batch, head) bias gradient is dS: dQ reads it back after dK/dV
    split_kv_pdl: bool = True  # the split-KV merge as a programmatic dependent launch where the device has it
    pad_to_warpgroup: bool = True  # split-KV, sm90: 17-64 packed rows in one 64-row warp-group block
    many_rows_warpgroup: bool = True  # split-KV, sm90: 65-128 packed rows on long caches in two 64-row blocks
    short_row_blocks: bool = True  # split-KV, sm90: 17-32 rows on short caches in two 16-row blocks
    force_index_64: bool = False  # tests: 64-bit offsets inside a slice even when 32 bits would do
    poison_outputs: bool = False  # tests: fresh outputs start as NaN, so a write a kernel skips shows

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash


_current = Options()


def current() -> Options:
    """The choices in force."""
    return _current


@contextlib.contextmanager
def use(**changes) -> Iterator[Options]:
    """Run the block with some choices changed (names as in :class:`Options`; an unknown name raises
    ``TypeError``). Not thread-local: meant for tests and benchmarks."""
    global _current
    saved = _current
    _current = dataclasses.replace(saved, **changes)
    try:
        yield _current
    finally:
        _current = saved
