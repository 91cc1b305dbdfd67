"""The kernels' log-sum-exp layouts to and from ``[B, H, Mq]`` float32 with ``-inf`` on rows that see no key."""

from __future__ import annotations

import torch

from .layout import SeqPlan, round_up, to_device

LSE_LAYOUTS = ("bhm", "bhm1", "h_total", "total_h1", "seq_h_m")


def lse_layout(raw: torch.Tensor, plan: SeqPlan, B: int, H: int, Mq: int) -> str:
    """Recognize a kernel's log-sum-exp layout (one of :data:`LSE_LAYOUTS`) from its shape."""
    shape, total = tuple(raw.shape), B * Mq
    if raw.dim() == 4 and shape[:3] == (B, H, Mq) and shape[3] == 1:
        return "bhm1"
    if plan.varlen and len(plan.seqs) > 1 and raw.dim() in (3, 4) and shape[:2] == (len(plan.seqs), H):
        if shape[2] >= plan.max_q and (raw.dim() == 3 or shape[3] == 1):
            return "seq_h_m"
    if raw.dim() == 3 and shape[:2] == (B, H) and shape[2] >= Mq:
        return "bhm"
    if raw.dim() == 2 and shape == (H, total):
        return "h_total"
    if raw.dim() in (2, 3) and shape[:2] == (total, H) and raw.numel() == total * H:
        return "total_h1"
    raise RuntimeError(f"unexpected log-sum-exp layout {list(shape)} for B={B}, H={H}, Mq={Mq}")


def lse_from_kernel(
    raw: torch.Tensor, plan: SeqPlan, B: int, H: int, Mq: int, layout: str, *, rows_may_be_hidden: bool = True,
) -> torch.Tensor:
    """A kernel's log-sum-exp (``layout``, see :func:`lse_to_kernel`) as ``[B, H, Mq]`` float32,
    ``-inf`` where a row sees no key (kernels write ``+inf``, ``-inf`` or NaN there). With
    ``rows_may_be_hidden=False`` (every row sees a key) the values are taken as they are."""
    if layout == "bhm":
        lse = raw[:, :, :Mq]
    elif layout == "bhm1":
        lse = raw[..., 0]
    elif layout == "h_total":
        lse = raw.reshape(H, B, Mq).transpose(0, 1)
    elif layout == "total_h1":
        lse = raw.reshape(B, Mq, H).transpose(1, 2)
    elif layout == "seq_h_m":
        seg, pos = packed_row_index(plan, raw.device)
        raw = raw[..., 0] if raw.dim() == 4 else raw
        lse = raw[seg, :, pos].reshape(B, Mq, H).transpose(1, 2)
    else:
        raise ValueError(f"layout must be one of {LSE_LAYOUTS}, got {layout!r}")
    if not rows_may_be_hidden:
        return lse.float().contiguous()
    inf = float("inf")
    return torch.nan_to_num(lse.float(), nan=-inf, posinf=-inf, neginf=-inf).contiguous()


def lse_to_kernel(lse: torch.Tensor, plan: SeqPlan, layout: str, pad: int = 1) -> torch.Tensor:
    """``lse [B, H, Mq]`` (ours) in a kernel's layout, ``+inf`` on empty rows (so their weights are 0).

    ``layout``: ``"bhm"`` (``[B, H, round_up(Mq, pad)]``), ``"bhm1"`` (``[B, H, Mq, 1]``), ``"h_total"``,
    ``"total_h1"`` or ``"seq_h_m"`` (``[nseq, H, round_up(max_q, pad)]``).
    """
    B, H, Mq = lse.shape
    lse = torch.where(torch.isneginf(lse), float("inf"), lse.float())
    if layout == "bhm":
        out = torch.full((B, H, round_up(Mq, pad)), float("inf"), dtype=torch.float32, device=lse.device)
        out[:, :, :Mq] = lse
        return out
    if layout == "bhm1":
        return lse[..., None].contiguous()
    if layout == "h_total":
        return lse.transpose(0, 1).reshape(H, B * Mq).contiguous()
    if layout == "total_h1":
        return lse.transpose(1, 2).reshape(B * Mq, H, 1).contiguous()
    if layout == "seq_h_m":
        n = len(plan.seqs)
        out = torch.full((n, H, round_up(max(plan.max_q, 1), pad)), float("inf"), dtype=torch.float32, device=lse.device)
        seg, pos = packed_row_index(plan, lse.device)
        out[seg, :, pos] = lse.transpose(0, 1).reshape(H, B * Mq).transpose(0, 1)
        return out
    raise ValueError(f"layout must be bhm, bhm1, h_total, total_h1 or seq_h_m, got {layout!r}")


def packed_row_index(plan: SeqPlan, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For every packed query row, its sequence index and its position in the sequence (int64; cached on the plan)."""
    return plan.cached(("rows", str(device)), lambda: _packed_row_index(plan, device))


def _packed_row_index(plan: SeqPlan, device) -> tuple[torch.Tensor, torch.Tensor]:
    seg, pos = [], []
    for n, s in enumerate(plan.seqs):
        seg.extend([n] * s.Lq)
        pos.extend(range(s.Lq))
    return to_device(seg, device), to_device(pos, device)
