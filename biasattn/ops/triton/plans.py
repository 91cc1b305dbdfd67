"""Launch plans: the kernel launches of one call, recorded and then replayed with the next call's tensors.

An eager call spends most of its host time deciding what to launch: schedules, tile lists, strides,
configs, and the argument signature that picks a compiled kernel. For a given input signature all
of that comes out the same every time; only the tensors differ. So a launcher that plans runs
its normal path under :func:`recording` for calls of one signature, and when two of them made the
same launches with the same arguments except for the call's own tensors and scale (its *roles*:
inputs, outputs, scratch it allocates, and the per-call floats), it keeps a :class:`Plan`. Later calls allocate their outputs,
build the argument lists from the plan's templates and launch, nothing else.

The two recordings are the safety net: any argument that changes from call to call without being
a role (a seed, a tensor allocated per call, a value read from data) makes them differ, and the
signature is then never planned. A launcher that plans must do all of its per-call work through
launches and role allocations; torch operations between launches are not replayed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from . import options

_SEEN = "seen"  # one call of the signature so far: the next one is recorded
_REFUSED = "refused"  # the signature's two recordings differed: this signature runs unplanned
_local = threading.local()


class Recording:
    """The launches made while recording: ``(launcher, grid, args, meta, compiled entry or None)``."""

    __slots__ = ("launches", "valid")

    def __init__(self) -> None:
        self.launches: list[tuple] = []
        self.valid = True


def active() -> Recording | None:
    """The recording of this thread's call, or None."""
    return getattr(_local, "recording", None)


def invalidate() -> None:
    """The call being recorded made a launch that a replay must not repeat (tuning, a config that did
    not fit, a forced config): keep no plan from it."""
    rec = active()
    if rec is not None:
        rec.valid = False


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Record the launches made inside the block (on this thread)."""
    saved = active()
    rec = _local.recording = Recording()
    try:
        yield rec
    finally:
        _local.recording = saved


def _is_handle(x) -> bool:
    """Tensors and tensor descriptors: arguments compared by identity, never by value."""
    return isinstance(x, torch.Tensor) or "block_shape" in getattr(type(x), "__dataclass_fields__", ())


def _role(x, roles: tuple) -> int | None:
    for i, r in enumerate(roles):
        if r is x:
            return i
    return None


class Plan:
    """Launches with their arguments fixed except for the role slots, filled on each :meth:`run`.

    ``note`` carries what the launcher needs to rebuild its role objects (descriptor tiles, say)."""

    __slots__ = ("launches", "note")

    def __init__(self, launches: list[tuple], note) -> None:
        self.launches = launches
        self.note = note

    def run(self, roles: tuple) -> None:
        """Make the planned launches with ``roles`` in their slots, on the current stream."""
        for launcher, grid, template, slots, meta, entry in self.launches:
            args = list(template)
            for pos, role in slots:
                args[pos] = roles[role]
            launcher.fire(grid, args, meta, entry)


def _draft(rec: Recording, roles: tuple, note) -> Plan:
    """``rec`` as a plan: role arguments become slots (and are dropped, so no tensor of the call is kept).

    Roles are the call's tensors and its per-call floats (the softmax scale): a float argument is
    a slot when it is the very object passed among the roles, so a new scale replays the same plan."""
    launches = []
    for launcher, grid, args, meta, entry in rec.launches:
        template, slots = list(args), []
        for pos, a in enumerate(args):
            role = _role(a, roles) if _is_handle(a) or type(a) is float else None
            if role is not None:
                template[pos] = None
                slots.append((pos, role))
        launches.append((launcher, tuple(grid), tuple(template), tuple(slots), meta, entry))
    return Plan(launches, note)


def _same(a: Plan, b: Plan) -> bool:
    """Whether two drafts launch the same kernels with the same arguments outside their role slots."""
    if a.note != b.note or len(a.launches) != len(b.launches):
        return False
    for (la, ga, ta, sa, ma, ea), (lb, gb, tb, sb, mb, eb) in zip(a.launches, b.launches):
        if la is not lb or ga != gb or sa != sb or ma != mb or ea is not eb or len(ta) != len(tb):
            return False
        for x, y in zip(ta, tb):
            if _is_handle(x) or _is_handle(y):
                if x is not y:
                    return False
            elif type(x) is not type(y) or x != y:
                return False
    return True


def lookup(store: dict, key) -> Plan | None:
    """The plan kept in ``store`` for ``key`` (None while none is settled, or when plans are off)."""
    if key is None or not options.current().plans:
        return None
    plan = store.get(key)
    return plan if type(plan) is Plan else None


def settle(store: dict, key, rec: Recording, roles: tuple, note=None) -> None:
    """Fold a finished recording into ``store``. A signature's first call only marks it as seen, so a
    spec used once (a bias built for one step) pays no more than that; the second becomes a draft,
    and a third that matches the draft makes the plan, one that does not refuses the signature."""
    if key is None or not options.current().plans or not rec.valid or not rec.launches:
        return
    held = store.get(key)
    if held is None:
        store[key] = _SEEN
    elif held is _SEEN:
        store[key] = (_draft(rec, roles, note),)
    elif isinstance(held, tuple):
        store[key] = plan if _same(held[0], plan := _draft(rec, roles, note)) else _REFUSED


def tensor_key(*tensors: torch.Tensor) -> tuple:
    """Everything about ``tensors`` that a launch depends on: the device, shapes, strides, dtypes,
    16-byte alignment, and which of them are the same tensor (a role is filled by position)."""
    parts: list = [tensors[0].get_device()]
    for t in tensors:
        parts += (t.shape, t.stride(), t.dtype, t.data_ptr() & 15)
    n = len(tensors)
    parts.append(tuple(i * n + j for i in range(n) for j in range(i) if tensors[i] is tensors[j]))
    return tuple(parts)
