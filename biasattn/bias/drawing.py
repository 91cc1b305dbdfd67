"""Pictures of biases with matplotlib (an optional dependency)."""

from __future__ import annotations

import torch

from ..errors import InputError


def show(bias, Mq: int | None = None, Mk: int | None = None, *, batch: int = 0, head: int = 0, ax=None):
    """Draw ``bias``' visibility pattern (and additive values) on ``ax`` (a new figure if None); returns the Axes."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - optional dependency
        raise ImportError("bias.show() needs matplotlib: pip install matplotlib") from e
    Mq = Mq or bias._lengths[0]
    Mk = Mk or bias._lengths[1]
    if Mq is None or Mk is None:
        raise InputError(f"{bias._family()} is unsized: pass Mq and Mk to show()")
    B, H = bias._batch() or 1, bias._heads() or 1
    dense = bias.materialize((B, H, Mq, Mk)).to("cpu", torch.float32)[batch, head]
    if ax is None:
        _, ax = plt.subplots(figsize=(4, 4 * Mq / max(Mk, 1) + 0.5))
    shown = torch.where(torch.isinf(dense), torch.full_like(dense, float("nan")), dense)
    if bias.is_mask:
        shown = torch.where(torch.isinf(dense), 0.0, 1.0)
    ax.imshow(shown.numpy(), cmap="viridis" if not bias.is_mask else "Blues", interpolation="nearest", vmin=None)
    ax.set_title(type(bias).__name__, fontsize=9)
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    return ax
