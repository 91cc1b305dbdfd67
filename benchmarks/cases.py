"""The benchmark cases shared by every harness: inputs, the biasattn bias, and each peer's form of it.

A case builds q/k/v ``[B, H, M, D]``, the lazy biasattn bias, the dense mask a user would give SDPA
(built lazily, only for peers that need it), a FlexAttention ``mask_mod``/``score_mod``, and the
number of visible (query, key) pairs for "effective" FLOP counts.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import biasattn as ba


def device_tag(name: str) -> str:
    """A results folder name for a device: its model number ("NVIDIA H100 80GB HBM3" -> "h100"), else
    the whole name in lower case with non-alphanumerics as dashes."""
    model = re.search(r"\b([A-Z]\d{2,4})\b", name)
    return model.group(1).lower() if model else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def results_dir(*parts: str) -> str:
    """``benchmarks/results/<this GPU's tag, or cpu>/<parts>``: where a harness writes its records by default."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return os.path.join("benchmarks", "results", device_tag(name), *parts)


def git_commit() -> str:
    """The commit measured: ``BIASATTN_COMMIT`` when set (a copy of the tree without its history), else git's short
    hash, with ``-dirty`` when the tree measured differs from it (uncommitted changes, or a copy of another tree
    beside a stale history)."""
    if os.environ.get("BIASATTN_COMMIT"):
        return os.environ["BIASATTN_COMMIT"]
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                             text=True).stdout.strip()
    except OSError:
        out = ""
    return out or "unknown"


CASE_NAMES = ("none", "causal", "window", "padded", "varlen", "block_sparse", "additive", "alibi")


@dataclass
class Case:
    """One benchmark input. ``visible`` counts the (query, key) pairs the bias leaves visible, summed over B·H."""

    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: ba.AttentionBias | None
    visible: float
    dense_mask: Callable[[], torch.Tensor | None] = lambda: None
    flex_mask_mod: Callable | None = None
    flex_score_mod: Callable | None = None
    is_causal: bool = False
    extra: dict = field(default_factory=dict)

    def flops(self, mode: str) -> float:
        """FLOPs of the visible pairs: 4·D per pair forward; the backward is 2.5× forward, forward+backward 3.5×."""
        D = self.q.shape[-1]
        fwd = 4.0 * D * self.visible
        return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]


def _qkv(B, H, M, D, dtype, device, requires_grad, gen):
    def make():
        t = torch.randn(B, H, M, D, dtype=dtype, device=device, generator=gen)
        return t.requires_grad_(requires_grad)

    return make(), make(), make()


def _seqlens(total: int, n: int, gen: torch.Generator) -> list[int]:
    """``n`` mixed lengths summing to ``total`` (each at least 1)."""
    w = torch.rand(n, generator=gen) + 0.25
    lens = (w / w.sum() * (total - n)).floor().long() + 1
    lens[-1] += total - int(lens.sum())
    return lens.tolist()


def _block_layout(H: int, nb: int, density: float, gen: torch.Generator) -> torch.Tensor:
    """``[1, H, nb, nb]`` bool layout with ``round(density · nb²)`` visible blocks per head, the diagonal among them.

    The diagonal keeps every query block's row non-empty; the other visible blocks are drawn
    uniformly from the off-diagonal ones, so the density is the one asked for at every ``nb``
    (or-ing the diagonal into a random layout would make it ``density + (1 - density) / nb``).
    """
    keep = max(nb, round(density * nb * nb))
    eye = torch.eye(nb, dtype=torch.bool)
    off = (~eye).flatten().nonzero().squeeze(1)
    layout = eye.flatten().repeat(H, 1)
    for h in range(H):
        layout[h, off[torch.randperm(off.numel(), generator=gen)[: keep - nb]]] = True
    return layout.view(1, H, nb, nb)


def make_case(
    name: str, *, B: int, H: int, M: int, D: int = 128, dtype=torch.bfloat16, device="cuda",
    requires_grad: bool = False, seed: int = 0, window: int = 1024, block: int = 128,
    density: float = 0.25, docs: tuple[int, int] = (8, 32),
) -> Case:
    """Build case ``name`` (one of :data:`CASE_NAMES`) at ``[B, H, M, D]``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = _qkv(B, H, M, D, dtype, device, requires_grad, dev_gen)
    full = float(B * H * M * M)
    if name == "none":
        return Case(name, q, k, v, None, full)
    if name == "causal":
        return Case(
            name, q, k, v, ba.LowerTriangularMask(), B * H * M * (M + 1) / 2, is_causal=True,
            flex_mask_mod=lambda b, h, i, j: j <= i,
        )
    if name == "window":
        bias = ba.LocalAttentionMask(window_left=window)
        n = sum(min(i, window) + 1 for i in range(M))
        return Case(
            name, q, k, v, bias, float(B * H * n),
            dense_mask=lambda: bias.materialize((1, 1, M, M), device=device) == 0,
            flex_mask_mod=lambda b, h, i, j: (j <= i) & (i - j <= window),
        )
    if name == "padded":
        lens = torch.randint(M // 2, M + 1, (B,), generator=gen)
        bias = ba.PaddedKeysMask(lens.to(device))
        lens_dev = lens.to(device)
        return Case(
            name, q, k, v, bias, float(H * M * int(lens.sum())),
            dense_mask=lambda: bias.materialize((B, 1, M, M), device=device) == 0,
            flex_mask_mod=lambda b, h, i, j: j < lens_dev[b],
            extra={"kv_seqlens": lens.tolist()},
        )
    if name == "varlen":
        total = B * M
        n = int(torch.randint(docs[0], docs[1] + 1, (1,), generator=gen))
        lens = _seqlens(total, n, gen)
        bias = ba.BlockDiagonalMask.from_seqlens(lens, device=device).make_causal()
        q, k, v = _qkv(1, H, total, D, dtype, device, requires_grad, dev_gen)
        doc = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(lens, device=device))
        return Case(
            name, q, k, v, bias, float(H * sum(L * (L + 1) / 2 for L in lens)),
            dense_mask=lambda: bias.materialize((1, 1, total, total), device=device) == 0,
            flex_mask_mod=lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i),
            extra={"seqlens": lens},
        )
    if name == "block_sparse":
        layout = _block_layout(H, math.ceil(M / block), density, gen)
        bias = ba.BlockSparseMask(layout.to(device), block)
        layout_dev = layout.to(device)
        vis = float(B * layout.sum()) * block * block  # M is a multiple of block in the suite
        return Case(
            name, q, k, v, bias, vis,
            dense_mask=lambda: bias.materialize((1, H, M, M), device=device) == 0,
            flex_mask_mod=lambda b, h, i, j: layout_dev[0, h, i // block, j // block],
            extra={"density": float(layout.float().mean())},
        )
    if name == "additive":
        t = torch.randn(1, H, M, M, dtype=dtype, device=device, generator=dev_gen).requires_grad_(requires_grad)
        return Case(
            name, q, k, v, ba.AdditiveBias(t), full,
            dense_mask=lambda: t,
            flex_score_mod=lambda score, b, h, i, j: score + t[0, h, i, j],
        )
    if name == "alibi":
        slopes = ba.ALiBi.standard_slopes(H).to(device)
        bias = ba.ALiBi(slopes)
        return Case(
            name, q, k, v, bias, full,
            dense_mask=lambda: bias.materialize((1, H, M, M), dtype=dtype, device=device),
            flex_score_mod=lambda score, b, h, i, j: score - slopes[h] * (i - j).abs(),
        )
    raise ValueError(f"case must be one of {CASE_NAMES}, got {name!r}")
