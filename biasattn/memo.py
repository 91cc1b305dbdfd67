"""The one bounded cache of the library: a mapping that forgets its oldest entries.

Every cache on the attention path is keyed by shapes, dtypes, devices and a bias's structure, never
by per-call values (a scale, a dropout probability, an operator object), and is one of these: a
cache that meets a new key every step (fresh masks, a learned temperature) then stays the same size.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator

_ADDED: list | None = None  # (cache, key) of the entries stored while a transient block runs


@contextlib.contextmanager
def transient() -> Iterator[None]:
    """Entries stored in any :class:`BoundedCache` inside the block are removed when it ends, so nothing
    derived there (a mask's tile tables, launch plans) outlives it: torch's CUDA-graph trees refuse
    live allocations of their pool that are not a graph's outputs."""
    global _ADDED
    outer, _ADDED = _ADDED, []
    try:
        yield
    finally:
        added, _ADDED = _ADDED, outer
        for cache, key in added:
            cache.pop(key, None)


class BoundedCache(OrderedDict):
    """A dict of at most ``maxsize`` entries; storing one more drops the oldest.

    Reads cost what a dict's do (the launch path reads these caches on every call); keys must be
    hashable, as for a dict.
    """

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be at least 1, got {maxsize}")
        super().__init__()
        self.maxsize = maxsize

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if _ADDED is not None:
            _ADDED.append((self, key))
        if len(self) > self.maxsize:
            self.popitem(last=False)

    def setdefault(self, key, default=None):
        """The value kept for ``key``, storing ``default`` first when there is none."""
        if key not in self:
            self[key] = default
            return default
        return self[key]

    def __reduce__(self):
        return (type(self), (self.maxsize,), None, None, iter(self.items()))

    def __repr__(self) -> str:
        return f"BoundedCache(maxsize={self.maxsize}, size={len(self)})"
