"""The kernels' log-sum-exp formats to and from ``[B, H, Mq]`` float32 with ``-inf`` on rows that see no key."""

from __future__ import annotations

import torch

from ...bias.atoms import to_device
from .layout import SequenceLayout, round_up

LSE_FORMATS = ("bhm", "bhm1", "h_total", "total_h1", "seq_h_m")


def lse_format(raw: torch.Tensor, layout: SequenceLayout, B: int, H: int, Mq: int) -> str:
    """Recognize a kernel's log-sum-exp format (one of :data:`LSE_FORMATS`) from its shape."""
    shape, total = tuple(raw.shape), B * Mq
    if raw.dim() == 4 and shape[:3] == (B, H, Mq) and shape[3] == 1:
        return "bhm1"
    if layout.varlen and len(layout.seqs) > 1 and raw.dim() in (3, 4) and shape[:2] == (len(layout.seqs), H):
        if shape[2] >= layout.max_q and (raw.dim() == 3 or shape[3] == 1):
            return "seq_h_m"
    if raw.dim() == 3 and shape[:2] == (B, H) and shape[2] >= Mq:
        return "bhm"
    if raw.dim() == 2 and shape == (H, total):
        return "h_total"
    if raw.dim() in (2, 3) and shape[:2] == (total, H) and raw.numel() == total * H:
        return "total_h1"
    raise RuntimeError(f"unexpected log-sum-exp format {list(shape)} for B={B}, H={H}, Mq={Mq}")


def lse_from_kernel(
    raw: torch.Tensor, layout: SequenceLayout, B: int, H: int, Mq: int, fmt: str, *, rows_may_be_hidden: bool = True,
) -> torch.Tensor:
    """A kernel's log-sum-exp (``fmt``, see :func:`lse_to_kernel`) as ``[B, H, Mq]`` float32,
    ``-inf`` where a row sees no key (kernels write ``+inf``, ``-inf`` or NaN there). With
    ``rows_may_be_hidden=False`` (every row sees a key) the values are taken as they are."""
    if fmt == "bhm":
        lse = raw[:, :, :Mq]
    elif fmt == "bhm1":
        lse = raw[..., 0]
    elif fmt == "h_total":
        lse = raw.reshape(H, B, Mq).transpose(0, 1)
    elif fmt == "total_h1":
        lse = raw.reshape(B, Mq, H).transpose(1, 2)
    elif fmt == "seq_h_m":
        seg, pos = packed_row_index(layout, raw.device)
        raw = raw[..., 0] if raw.dim() == 4 else raw
        lse = raw[seg, :, pos].reshape(B, Mq, H).transpose(1, 2)
    else:
        raise ValueError(f"fmt must be one of {LSE_FORMATS}, got {fmt!r}")
    if not rows_may_be_hidden:
        return lse.float().contiguous()
    inf = float("inf")
    return torch.nan_to_num(lse.float(), nan=-inf, posinf=-inf, neginf=-inf).contiguous()


def lse_to_kernel(lse: torch.Tensor, layout: SequenceLayout, fmt: str, pad: int = 1) -> torch.Tensor:
    """``lse [B, H, Mq]`` (ours) in a kernel's format, ``+inf`` on empty rows (so their weights are 0).

    ``fmt``: ``"bhm"`` (``[B, H, round_up(Mq, pad)]``), ``"bhm1"`` (``[B, H, Mq, 1]``), ``"h_total"``,
    ``"total_h1"`` or ``"seq_h_m"`` (``[nseq, H, round_up(max_q, pad)]``).
    """
    B, H, Mq = lse.shape
    lse = torch.where(torch.isneginf(lse), float("inf"), lse.float())
    if fmt == "bhm":
        out = torch.full((B, H, round_up(Mq, pad)), float("inf"), dtype=torch.float32, device=lse.device)
        out[:, :, :Mq] = lse
        return out
    if fmt == "bhm1":
        return lse[..., None].contiguous()
    if fmt == "h_total":
        return lse.transpose(0, 1).reshape(H, B * Mq).contiguous()
    if fmt == "total_h1":
        return lse.transpose(1, 2).reshape(B * Mq, H, 1).contiguous()
    if fmt == "seq_h_m":
        n = len(layout.seqs)
        out = torch.full((n, H, round_up(max(layout.max_q, 1), pad)), float("inf"), dtype=torch.float32, device=lse.device)
        seg, pos = packed_row_index(layout, lse.device)
        out[seg, :, pos] = lse.transpose(0, 1).reshape(H, B * Mq).transpose(0, 1)
        return out
    raise ValueError(f"fmt must be bhm, bhm1, h_total, total_h1 or seq_h_m, got {fmt!r}")


def packed_row_index(layout: SequenceLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For every packed query row, its sequence index and its position in the sequence (int64; cached on the layout)."""
    return layout.cached(("rows", str(device)), lambda: _packed_row_index(layout, device))


def _packed_row_index(layout: SequenceLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    seg, pos = [], []
    for n, s in enumerate(layout.seqs):
        seg.extend([n] * s.Lq)
        pos.extend(range(s.Lq))
    return to_device(seg, device, torch.int64), to_device(pos, device, torch.int64)
