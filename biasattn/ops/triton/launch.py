"""Kernel launches with less host time: ``direct(kernel)[grid](*args, **meta)``.

Triton's ``kernel[grid](...)`` binds and specializes every argument, builds a cache key and checks
its globals on each call, which costs tens of microseconds for our kernels' 60-90 arguments. The
wrapper here keeps, per device, the compiled kernel of each argument signature and on a hit calls
the compiled launcher the way ``JITFunction.run`` does. Two tables lead to a compiled kernel:

- the exact signature (each argument's type, each tensor's dtype and 16-byte alignment, each
  tensor descriptor's dtype, block shape and (Gluon) shared layout, every other argument's value, the constexprs and
  launch options; for the integer arguments named as unkeyed, which the kernel does not
  specialize, only whether they fit 32 bits): one lookup of a few C-level passes;
- on a miss there, the specialization (the same, but each integer that is not a constexpr, in a tuple
  of strides too, reduced to what Triton specializes it on: equal to 1, divisible by 16, 32 or 64
  bits; floats to their type): a call whose sizes changed (a decode step against a cache one key longer) still finds
  the kernel compiled for the last one instead of going through Triton's binding.

A miss in both, the interpreter, a CPU tensor, a Triton whose ``run`` does not end in that call,
or the ``direct_launch`` option off go through ``kernel[grid](...)`` unchanged.
"""

from __future__ import annotations

import functools
import inspect
import operator

import torch

from ...memo import BoundedCache
from . import options, plans

_MAX_ENTRIES = 512  # signatures kept per kernel and table (the oldest go first)


@functools.cache
def _triton_run_matches() -> bool:
    """Whether the installed Triton's ``JITFunction.run`` ends in the launcher call replayed here."""
    try:
        from triton.runtime.jit import JITFunction

        source = inspect.getsource(JITFunction.run)
    except (ImportError, OSError, TypeError):
        return False
    return all(s in source for s in (
        "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata",
        "launch_metadata = kernel.launch_metadata(grid, stream, *bound_args.values())",
        "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())",
    ))


@functools.cache
def _runtime():
    """``(current-stream getter, Triton's knobs)``, looked up once instead of on every launch."""
    from triton import knobs
    from triton.runtime import driver

    return driver.active.get_current_stream, knobs


def _hook(hook):
    """A launch hook to call, or None where none is set (Triton's hooks are chains, empty when unused)."""
    return None if hook is None or not getattr(hook, "calls", True) else hook


def _device(first) -> torch.device:
    """The launch device: that of the first argument, a tensor or a tensor descriptor (Gluon kernels)."""
    return getattr(first, "base", first).device


def _int_class(a: int) -> int:
    """What Triton specializes an integer argument on: equal to 1, divisible by 16, fits 32 or 64 bits."""
    return (a == 1) + ((a & 15 == 0) << 1) + ((-2**31 <= a < 2**31) << 2) + ((a < 2**63) << 3)


def _picker(positions: list[int]):
    """A function returning the tuple of ``args[i]`` for ``i`` in ``positions``."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*positions)


class _Direct:
    """``kernel[grid](*args, **meta)`` with a table of compiled kernels per argument signature."""

    def __init__(self, kernel, unkeyed: tuple[str, ...] = ()):
        self.kernel = kernel
        self.table = BoundedCache(_MAX_ENTRIES)  # exact signature -> (compiled kernel, constexpr tail)
        self.specialized = BoundedCache(_MAX_ENTRIES)  # specialization -> the same
        self.hits = 0
        names = list(getattr(kernel, "arg_names", ()))
        self.unkeyed = frozenset(names.index(n) for n in unkeyed)
        self.constexprs = frozenset(i for i, p in enumerate(getattr(kernel, "params", ())) if getattr(p, "is_constexpr", True))
        self.picks: dict = {}  # argument types -> pickers of the tensor, keyed and unkeyed arguments
        self.spec_picks: dict = {}  # the same -> pickers of the exact-valued and the integer keyed arguments

    def _signature(self, args: tuple) -> tuple:
        """``(argument types, every keyed non-tensor value, tensor dtypes, tensor 16-byte alignments,
        whether each unkeyed integer fits 32 bits, descriptor dtypes, block shapes and shared layouts)``: where the
        tensors sit is looked up once per tuple of argument types, so a call costs a few C-level
        passes instead of a Python step per argument."""
        types = tuple(map(type, args))
        picks = self.picks.get(types)
        if picks is None:
            tensors = [i for i, t in enumerate(types) if issubclass(t, torch.Tensor)]
            descs = [i for i, t in enumerate(types) if "block_shape" in getattr(t, "__dataclass_fields__", ())]
            keyed = [i for i, t in enumerate(types) if i not in tensors and i not in descs and i not in self.unkeyed]
            unkeyed = [i for i in self.unkeyed if i < len(types) and i not in tensors]
            picks = self.picks[types] = (_picker(tensors), _picker(keyed), _picker(unkeyed), _picker(descs))
            # for _specialization: integers (alone or in tuples) reduced to their class, floats dropped
            # (constexprs stay exact)
            ints = [i for i in keyed if types[i] is int and i not in self.constexprs]
            tuples = [i for i in keyed if types[i] is tuple and i not in self.constexprs]
            exact = [i for i in keyed if i not in ints and i not in tuples
                     and not (types[i] is float and i not in self.constexprs)]
            self.spec_picks[types] = (_picker(exact), _picker(ints), _picker(tuples))
        tensors, keyed, unkeyed, descs = (pick(args) for pick in picks)
        return (types, keyed, tuple([t.dtype for t in tensors]), tuple([t.data_ptr() & 15 == 0 for t in tensors]),
                tuple([-2**31 <= a < 2**31 for a in unkeyed]),
                tuple([(d.base.dtype, tuple(d.block_shape), d.padding, getattr(d, "layout", None)) for d in descs]))

    def _specialization(self, args: tuple, signature: tuple) -> tuple:
        """``signature`` with the keyed integers (not constexprs) reduced to Triton's integer
        specialization and the keyed floats dropped (their type is in the signature)."""
        types = signature[0]
        exact, ints, tuples = (pick(args) for pick in self.spec_picks[types])  # filled by _signature
        classes = tuple([_int_class(a) for a in ints])
        tuple_classes = tuple([tuple([_int_class(a) for a in t]) for t in tuples])
        return (types, exact, classes, tuple_classes, *signature[2:])

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args, **meta):
        """Launch on ``grid``; the first argument's device (a tensor's or a descriptor's) is the launch device. Inside
        :func:`plans.recording` the launch is also recorded, with the compiled entry it used."""
        entry = self._launch(grid, args, meta)
        rec = plans.active()
        if rec is not None:
            rec.launches.append((self, grid, args, meta, entry))

    def unrecorded(self, grid, *args, **meta):
        """Launch on ``grid`` without recording it into a launch plan: for work that a plan's replay
        does itself before it launches (the tile table a replay passes as a role)."""
        self._launch(grid, args, meta)

    def _launch(self, grid, args, meta):
        """Launch; return the table entry ``(compiled, constexpr tail)`` that ran, or None when
        the launch went through ``kernel[grid]``."""
        device = _device(args[0])
        opts = options.current()
        if not (opts.direct_launch and device.type == "cuda" and _triton_run_matches()):
            self.kernel[grid](*args, **meta)
            return None
        constexprs = tuple(meta.items())
        signature = self._signature(args)
        key = (device.index, constexprs, *signature)
        entry = self.table.get(key)
        if entry is None:
            spec_key = (device.index, constexprs, *self._specialization(args, signature)) if opts.specializations else None
            entry = self.specialized.get(spec_key)
            if entry is None:
                compiled = self.kernel[grid](*args, **meta)
                names = self.kernel.arg_names
                if compiled is None or len(names) < len(args) or any(n not in meta for n in names[len(args):]):
                    return None
                entry = (compiled, tuple(meta[n] for n in names[len(args):]))
                self.table[key] = entry
                if spec_key is not None:
                    self.specialized[spec_key] = entry
                return entry
            self.table[key] = entry
        self.hits += 1
        self._run(entry, grid, args)
        return entry

    @staticmethod
    def _run(entry, grid, args) -> None:
        """Call a compiled kernel's launcher the way ``JITFunction.run`` does."""
        compiled, tail = entry
        get_stream, knobs = _runtime()
        values = (*args, *tail)
        stream = get_stream(_device(args[0]).index)
        g = tuple(grid) + (1, 1)
        enter, leave = _hook(knobs.runtime.launch_enter_hook), _hook(knobs.runtime.launch_exit_hook)
        # the metadata only the hooks read: without one, neither it nor a call into an empty chain
        meta = None if enter is None and leave is None else compiled.launch_metadata(grid, stream, *values)
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, meta, enter, leave, *values)

    def fire(self, grid, args, meta, entry) -> None:
        """Replay a recorded launch with new arguments of the same signature (:mod:`.plans`)."""
        if entry is None:
            self.kernel[grid](*args, **meta)
        else:
            self.hits += 1
            self._run(entry, grid, args)


def direct(kernel, unkeyed: tuple[str, ...] = ()) -> _Direct:
    """Wrap a ``@triton.jit`` kernel so that repeated launches skip Triton's per-call binding.

    ``unkeyed`` names integer arguments in the kernel's ``do_not_specialize`` whose value changes
    on every call (a random seed): a new value then reuses the compiled kernel."""
    return _Direct(kernel, unkeyed)
