"""Tile configurations for the Triton kernels, per kernel, head dim and device, with optional tuning.

``choose`` returns the first candidate for a key ``(kernel, head dim, dtype, capability, features)``
unless tuning is enabled (``BIASATTN_TRITON_TUNE=1``): then the first call for a key times every
candidate once and keeps the fastest. Sequence lengths are not part of the key, so a new length
never retunes. Under the Triton interpreter the tiles are small, so CPU tests cross many tiles.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..common import cuda_capability
from . import plans


@dataclass(frozen=True)
class TileConfig:
    """``block_m`` query rows by ``block_n`` keys per tile, with Triton's ``num_warps``/``num_stages``."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


INTERPRETER_CONFIG = TileConfig(16, 16, 4, 1)

# (kernel, largest padded head dim) -> candidates, best first (tile sweeps on an H200: bench_attention.py --tune).
_CANDIDATES: dict[tuple[str, int], tuple[TileConfig, ...]] = {
    ("fwd", 64): (TileConfig(128, 64, 4, 3), TileConfig(64, 64, 4, 4), TileConfig(128, 128, 4, 3), TileConfig(128, 128, 8, 3),
                  TileConfig(128, 64, 8, 3)),
    ("fwd", 128): (TileConfig(128, 128, 8, 3), TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3), TileConfig(128, 128, 8, 2)),
    # D=256: the first tiles that do not spill (benchmarks/tools/kernel_resources.py); H200, S=4096, bf16:
    # forward 128x64 w8 2.10 ms against 2.74 for 64x64 w4, dK/dV 128x32 w8 halves forward+backward (32.3 -> 16.0 ms)
    ("fwd", 256): (TileConfig(128, 64, 8, 2), TileConfig(128, 32, 8, 3), TileConfig(64, 32, 4, 2), TileConfig(64, 64, 4, 2)),
    ("dkdv", 64): (TileConfig(64, 64, 4, 3), TileConfig(64, 128, 8, 2), TileConfig(64, 128, 8, 3),
                   TileConfig(32, 128, 4, 3), TileConfig(64, 128, 4, 3), TileConfig(32, 64, 4, 4)),
    ("dkdv", 128): (TileConfig(64, 128, 8, 2), TileConfig(64, 128, 8, 3), TileConfig(64, 64, 4, 3),
                    TileConfig(32, 128, 4, 3), TileConfig(32, 128, 4, 5), TileConfig(32, 128, 8, 3),
                    TileConfig(64, 128, 4, 2), TileConfig(32, 64, 4, 4)),
    ("dkdv", 256): (TileConfig(128, 32, 8, 2), TileConfig(64, 32, 8, 3), TileConfig(16, 32, 4, 2), TileConfig(32, 64, 4, 2),
                    TileConfig(64, 64, 8, 2), TileConfig(32, 64, 8, 3)),  # 64 keys: warpgroup MMA, spills (design.md)
    ("dq", 64): (TileConfig(128, 64, 8, 3), TileConfig(128, 128, 8, 2), TileConfig(128, 64, 8, 2),
                 TileConfig(128, 32, 4, 3), TileConfig(64, 64, 4, 3)),
    ("dq", 128): (TileConfig(128, 64, 8, 3), TileConfig(128, 128, 8, 2), TileConfig(128, 64, 8, 2),
                  TileConfig(128, 32, 4, 3), TileConfig(128, 32, 4, 5), TileConfig(128, 32, 8, 3), TileConfig(64, 64, 4, 3)),
    ("dbias", 64): (TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3), TileConfig(128, 64, 8, 2)),
    ("dbias", 128): (TileConfig(128, 64, 8, 2), TileConfig(64, 64, 4, 3), TileConfig(64, 64, 4, 2)),
    ("dbias", 256): (TileConfig(64, 64, 4, 2), TileConfig(64, 32, 4, 2)),
    # dQ at D=256: 128 query rows against 32 keys with 8 warps do not spill; 64x32 w4 did (121 LDL/STL).
    # H200, bf16, S=8192: forward+backward 30.1 -> 28.2 ms (no bias), 16.3 -> 14.7 ms (causal)
    ("dq", 256): (TileConfig(128, 32, 8, 2), TileConfig(64, 32, 4, 2), TileConfig(64, 64, 8, 1), TileConfig(32, 64, 4, 2)),
    ("dq_ds", 64): (TileConfig(128, 64, 8, 3), TileConfig(128, 128, 8, 3), TileConfig(64, 64, 4, 3)),
    ("dq_ds", 128): (TileConfig(128, 64, 8, 3), TileConfig(128, 128, 8, 3), TileConfig(64, 64, 4, 3)),
    ("dq_ds", 256): (TileConfig(64, 64, 4, 2), TileConfig(64, 32, 4, 2)),
}

# dQ at head dim 64: 64x64 tiles with 4 warps first, block layouts and dropout aside (design.md: "dQ at head dim 64")
DQ_64 = TileConfig(64, 64, 4, 3)
# (kernel, padded head dim) -> the first tile where rows see few keys (design.md, "Short tiles when rows see few keys")
SHORT_ROWS = {
    ("fwd", 64): TileConfig(64, 64, 4, 3), ("dkdv", 64): TileConfig(32, 128, 4, 3),
    ("fwd", 128): TileConfig(64, 64, 4, 3), ("dkdv", 128): TileConfig(32, 64, 4, 4),
}

_overrides: dict[str, TileConfig] = {}
_tuned: dict[tuple, TileConfig] = {}
_launched: dict[tuple, TileConfig] = {}  # (kernel, head dim, dtype, device, features) -> the config that ran


@functools.cache
def interpreted() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def candidates(kernel: str, head_dim: int) -> tuple[TileConfig, ...]:
    """Candidate configs of ``kernel`` (``"fwd"``, ``"dq"``, ``"dkdv"``, ``"dbias"``, ``"dq_ds"``) for a padded head dim."""
    size = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
    return _CANDIDATES[(kernel, size)]


@contextlib.contextmanager
def override(**configs: TileConfig) -> Iterator[None]:
    """Force configs inside the block, e.g. ``override(fwd=TileConfig(32, 16))`` (tests, benchmarks)."""
    saved = dict(_overrides)
    _overrides.update(configs)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


def _candidates_for(kernel: str, head_dim: int, dtype: torch.dtype, features: tuple = ()) -> tuple[TileConfig, ...]:
    cands = candidates(kernel, head_dim)
    span = {"fwd": "short_span", "dkdv": "short_span_dkdv"}.get(kernel)
    first = SHORT_ROWS.get((kernel, 64 if head_dim <= 64 else head_dim))
    if (first and span in features and not {"additive", "dropout"} & set(features)
            and (head_dim > 64 or dtype != torch.float32)):  # fp32 up to head dim 64 keeps its capped list (untimed)
        # rows see few keys: shorter tiles, more programs finish sooner (H200: +17-25% on packed documents)
        cands = (first, *(c for c in cands if c != first))
    if kernel == "fwd" and "additive" in features:  # the bias tile adds registers: narrower key tiles first,
        # and at head dim 64 shorter query tiles (128 rows at 4 warps spill the prefetched bias tile)
        cands = tuple(sorted(cands, key=lambda c: (c.block_n > 64, head_dim <= 64 and c.block_m > 64)))
    if kernel == "dkdv" and "additive" in features:  # the bias read wants a deeper pipeline (H200: 2% faster)
        cands = tuple(sorted(cands, key=lambda c: c.num_stages != 3))
    if kernel == "fwd" and "dropout" in features:  # the mask draw adds registers: 128x128 tiles spill,
        # and at head dim 64 so do 128 rows at 4 warps (40-58 local loads and stores; 64x64 w4 s3: none)
        cands = tuple(sorted(cands, key=lambda c: c.block_n > 64))
        if head_dim <= 64:
            cands = (TileConfig(64, 64, 4, 3), *(c for c in cands if c != TileConfig(64, 64, 4, 3)))
    if kernel == "dkdv" and "dropout" in features and head_dim <= 128:  # H200, tuned with dropout: short tiles,
        # deep pipeline (at D=256 those spill: 1,528 local loads and stores against 2 for the usual tile)
        cands = (TileConfig(32, 64, 4, 4), *(c for c in cands if c != TileConfig(32, 64, 4, 4)))
    if kernel == "dq" and head_dim <= 64 and dtype != torch.float32 and not {"layout", "dropout"} & set(features):
        # more, shorter programs (H200: forward+backward 2-6% faster on long rows, 4-11% less GPU time on packed
        # documents and windows; block layouts keep 128 rows)
        cands = (DQ_64, *(c for c in cands if c != DQ_64))
    if dtype == torch.float32:  # fp32 tiles take twice the shared memory
        cands = tuple(TileConfig(min(c.block_m, 64), min(c.block_n, 64), c.num_warps, min(c.num_stages, 2)) for c in cands)
    return cands


def choose(kernel: str, head_dim: int, dtype: torch.dtype, device: torch.device, features: tuple,
           run: Callable[[TileConfig], None] | None = None) -> TileConfig:
    """The config for one launch; ``run(config)`` launches the kernel (used only when tuning)."""
    if kernel in _overrides:
        return _overrides[kernel]
    if device.type != "cuda" or interpreted():
        return INTERPRETER_CONFIG
    cands = _candidates_for(kernel, head_dim, dtype, features)
    key = (kernel, head_dim, dtype, cuda_capability(device), features)
    if key in _tuned:
        return _tuned[key]
    if run is None or os.environ.get("BIASATTN_TRITON_TUNE", "0") != "1":
        return cands[0]
    import triton.testing

    times = {}
    for cfg in cands:
        try:
            times[cfg] = triton.testing.do_bench(lambda cfg=cfg: run(cfg), warmup=5, rep=20)
        except Exception:  # a config that does not fit (shared memory, registers) is skipped
            continue
    best = min(times, key=times.get) if times else cands[0]
    _tuned[key] = best
    return best


def launch(kernel: str, head_dim: int, dtype: torch.dtype, device: torch.device, features: tuple,
           run: Callable[[TileConfig], None]) -> TileConfig:
    """Run ``run(config)`` with the chosen config; when it needs more shared memory than the device
    has (an extra bias tile, say), fall back to the next candidate and remember it for this key."""
    if kernel in _overrides or device.type != "cuda" or interpreted():
        if kernel in _overrides:
            plans.invalidate()
        cfg = choose(kernel, head_dim, dtype, device, features, run)
        run(cfg)
        return cfg
    seen = (kernel, head_dim, dtype, device, features)
    cfg = _launched.get(seen)
    if cfg is not None:
        run(cfg)
        return cfg
    plans.invalidate()  # a first launch may time candidates or try configs that do not fit
    from triton.runtime.errors import OutOfResources

    cfg = choose(kernel, head_dim, dtype, device, features, run)
    key = (kernel, head_dim, dtype, cuda_capability(device), features)
    cfg = _tuned.get(key, cfg)
    rest = [c for c in _candidates_for(kernel, head_dim, dtype, features) if c != cfg]
    for attempt in [cfg, *rest]:
        try:
            run(attempt)
        except OutOfResources:
            continue
        _tuned[key] = _launched[seen] = attempt
        return attempt
    raise RuntimeError(f"no tile config of the {kernel} kernel fits this device for head dim {head_dim}, {dtype}, {features}")
