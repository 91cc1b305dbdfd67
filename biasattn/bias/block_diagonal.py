"""Block-diagonal masks for packed variable-length batches (B == 1, sequences concatenated along M).

``BlockDiagonalMask.from_seqlens([2, 3])``        ``.make_causal()``
    ■ ■ □ □ □                                        ■ □ □ □ □
    ■ ■ □ □ □                                        ■ ■ □ □ □
    □ □ ■ ■ ■                                        □ □ ■ □ □
    □ □ ■ ■ ■                                        □ □ ■ ■ □
    □ □ ■ ■ ■                                        □ □ ■ ■ ■
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate

import torch

from ..errors import InputError
from .atoms import (
    Atom,
    Geometry,
    as_lengths,
    check_length_tensor,
    readable,
    tensor_layout,
    tensor_version,
    to_device,
    to_device_parts,
    visible_to_additive,
)
from .band import BOTTOM_RIGHT, TOP_LEFT, segment_diagonals
from .base import AttentionBias
from .local import check_window


@dataclass(frozen=True, eq=False)
class SegmentsAtom(Atom):
    """Query segment ``s`` sees key segment ``s`` only, optionally through a band local to the segment."""

    q_seqstart: torch.Tensor  # [S+1] int32
    k_seqstart: torch.Tensor  # [S+1] int32
    k_seqlen: torch.Tensor  # [S] int32
    Mq: int | None  # total queries and keys: the bias' size (None: the call's, for lengths not read yet)
    Mk: int | None
    band: tuple[str, int | None, int | None] | None = None  # (alignment, left, right) per segment
    q_given: tuple[int, ...] | None = None  # host copies of q_seqstart / k_seqstart, as given
    k_given: tuple[int, ...] | None = None
    from_lists: bool = False  # built from lists with no device: follows q's device
    family: str = "BlockDiagonalMask"
    kind = "segments"
    HOST_FIELDS = ("q_given", "k_given")

    @property
    def q_host(self) -> tuple[int, ...]:
        """``q_seqstart`` on the host (read from the tensor when it was written in place since)."""
        return self.host_copy(self.q_seqstart, self.q_given)

    @property
    def k_host(self) -> tuple[int, ...]:
        """``k_seqstart`` on the host."""
        return self.host_copy(self.k_seqstart, self.k_given)

    @property
    def follows_q(self) -> bool:
        return self.from_lists

    def starts_known(self) -> bool:
        """Whether the host has the starts for free: given as lists and not written since, or held by CPU
        tensors outside ``torch.compile`` (which reads them as it always has) that hold values (not a
        trace's fake tensors). The attention path never reads a GPU tensor's lengths."""
        if torch.compiler.is_compiling() or (self.q_seqstart.device.type == "cpu" and readable(self.q_seqstart)):
            return True
        return self.q_given is not None and all(
            tensor_version(t) in (0, -1) for t in (self.q_seqstart, self.k_seqstart, self.k_seqlen))

    def lowers_unread(self, g: Geometry, device, atoms: tuple) -> bool:
        """Lengths only the device holds are passed on unread, and so are packed self-attention documents
        (one tensor of starts for queries and keys) held by a GPU tensor, even where the host has a copy
        (built from lists with ``device=``), for a call that covers the whole mask: their launches and
        operator choice then follow from the number of documents alone. Lengths on the CPU, queries
        and keys packed apart (a decode batch), slices (context-parallel pairs bound their rows from the
        host copies) and compositions with key lengths or another block-diagonal mask are lowered from
        the host copies."""
        if not self.starts_known():
            return True
        if torch.compiler.is_compiling() or self.q_seqstart.device.type == "cpu" or self.q_seqstart is not self.k_seqstart:
            return False
        whole = (g.q_off, g.k_off, g.Mq, g.Mk) == (0, 0, g.Mq_full, g.Mk_full)
        return whole and not any(a is not self and a.kind in ("segments", "padded_keys") for a in atoms)

    def spec_token(self):
        """Segments on a GPU: what lowering looks at when it passes them on unread (see
        :meth:`lowers_unread`), i.e. their layout, band, size and whether the host knows them."""
        qs, ks, kl = self.q_seqstart, self.k_seqstart, self.k_seqlen
        if qs.device.type == "cpu" or torch.compiler.is_compiling():
            return None
        return (SegmentsAtom, self.family, self.band, self.Mq, self.Mk, self.from_lists, self.starts_known(), qs is ks,
                tensor_layout(qs), tensor_layout(ks), tensor_layout(kl))

    def sizes(self):
        return (None, None, self.Mq, self.Mk)

    def tensors(self):
        return {"q_seqstart": self.q_seqstart, "k_seqstart": self.k_seqstart, "k_seqlen": self.k_seqlen}

    def combinable_with(self, other) -> bool:
        if torch.compiler.is_compiling():  # checked when the compiled call runs the bias eagerly
            return True
        if (self.Mq, self.Mk, self.q_seqstart.shape) != (other.Mq, other.Mk, other.q_seqstart.shape):
            return False
        return self.q_host == other.q_host and self.k_host == other.k_host

    def incompatibility(self, other) -> str:
        return "the two block-diagonal masks have different sequence lengths"

    def segment_bounds(self) -> tuple[list[int], list[int]] | None:
        """Per segment, bounds on ``d = j - i`` in global coordinates (band local to each segment)."""
        if self.band is None:
            return None
        from .spec import BAND_UNBOUNDED

        alignment, left, right = self.band
        qs, ks = self.q_host, self.k_host
        if alignment == BOTTOM_RIGHT:  # each segment's diagonal: its last key against its last query
            shift = [b - a for a, b in zip(qs[1:], ks[1:])]
        else:  # ... or its first key against its first query
            shift = [b - a for a, b in zip(qs[:-1], ks[:-1])]
        los = [-BAND_UNBOUNDED] * len(shift) if left is None else [d - left for d in shift]
        his = [BAND_UNBOUNDED] * len(shift) if right is None else [d + right for d in shift]
        return los, his

    def dense(self, g: Geometry, dtype, device) -> torch.Tensor:
        qs, ks = (t.to(device=device, dtype=torch.int64) for t in (self.q_seqstart, self.k_seqstart))
        i, j = g.rows(device), g.cols(device)
        seg = torch.searchsorted(qs, i[:, 0].contiguous(), right=True) - 1  # [Mq]
        nseg = qs.shape[0] - 1
        inside = (seg >= 0) & (seg < nseg)
        seg = seg.clamp(0, max(nseg - 1, 0))
        visible = inside[:, None] & (j >= ks[seg][:, None]) & (j < ks[seg + 1][:, None])
        if self.band is not None:  # the band of segment_bounds, from the tensors
            alignment, left, right = self.band
            shift = segment_diagonals(qs, ks, alignment)
            d = j - i
            if left is not None:
                visible &= d >= (shift - left)[seg][:, None]
            if right is not None:
                visible &= d <= (shift + right)[seg][:, None]
        return visible_to_additive(visible, dtype)[None, None]

    def lower(self, builder) -> None:
        if builder.g.B != 1:
            raise InputError(
                f"{self.family} describes a packed batch: q must have batch size B=1, got B={builder.g.B}"
            )
        if self.lowers_unread(builder.g, builder.device, builder.atoms):
            builder.add_device_segments(
                tuple(to_device(t, builder.device) for t in (self.q_seqstart, self.k_seqstart, self.k_seqlen)), self.band)
            return
        if self.Mq is None:  # built from tensors without reading them: their values are checked now
            for name, starts, total in (("q_seqlens", self.q_host, builder.g.Mq_full),
                                        ("kv_seqlens", self.k_host, builder.g.Mk_full)):
                for n, (a, b) in enumerate(zip(starts, starts[1:])):
                    if b < a:
                        raise InputError(f"{name}[{n}] must be >= 0, got {b - a}")
                if starts[-1] != total:
                    side = "q has Mq" if name == "q_seqlens" else "k has Mk"
                    raise InputError(f"{name} sum to {starts[-1]}, {side}={total}")
        builder.add_segments(
            self.q_host, self.k_host, [b - a for a, b in zip(self.k_host, self.k_host[1:])],
            tuple(to_device(t, builder.device) for t in (self.q_seqstart, self.k_seqstart, self.k_seqlen)),
            band=self.segment_bounds(),
        )

    def __repr__(self) -> str:
        if not readable(self.q_seqstart):
            return f"{self.q_seqstart.shape[0] - 1} segments, Mq={self.Mq}, Mk={self.Mk}"
        q = [b - a for a, b in zip(self.q_host, self.q_host[1:])]
        k = [b - a for a, b in zip(self.k_host, self.k_host[1:])]
        band = "" if self.band is None else f", band={self.band}"
        return f"q_seqlens={q}, kv_seqlens={k}{band}"


class BlockDiagonalMask(AttentionBias):
    """Packed variable-length sequences: query segment ``s`` attends to key segment ``s`` only.

    Build with :meth:`from_seqlens` or :meth:`from_tensor_list`. q, k, v have batch size 1 and the
    sequences concatenated along M (``q: [1, H, sum(q_seqlens), D]``).
    """

    def __new__(cls, *args, **kwargs):
        raise TypeError("build a BlockDiagonalMask with BlockDiagonalMask.from_seqlens(q_seqlens, kv_seqlens)")

    @classmethod
    def from_seqlens(cls, q_seqlens, kv_seqlens=None, *, device=None) -> BlockDiagonalMask:
        """From per-sequence query lengths and key lengths (defaults to the query lengths).

        Lengths given as GPU tensors are never read, and neither are tensors inside ``torch.compile``: the
        mask holds their running sums as tensors (computed on their device) and covers whatever q and k
        the call has, so building it waits for nothing and new lengths never trace a new graph. The
        lengths must be non-negative and sum to Mq and Mk: inside ``torch.compile`` this is checked
        when the compiled call runs; from GPU tensors it is not checked at all (lines past the last
        segment see nothing), and only the operators that take lengths on the device (``triton``,
        ``reference``) run such a mask."""
        tensors = isinstance(q_seqlens, torch.Tensor) and (kv_seqlens is None or isinstance(kv_seqlens, torch.Tensor))
        if tensors and (torch.compiler.is_compiling() or q_seqlens.device.type != "cpu"):
            return cls._from_tensors(q_seqlens, kv_seqlens, device)
        q = as_lengths("q_seqlens", q_seqlens)
        k = q if kv_seqlens is None else as_lengths("kv_seqlens", kv_seqlens)
        if len(k) != len(q):
            raise InputError(f"kv_seqlens has {len(k)} sequences, q_seqlens has {len(q)}")
        if device is None:
            device = next((t.device for t in (q_seqlens, kv_seqlens) if isinstance(t, torch.Tensor)), None)
        return cls._from_host(q, k, None, device)

    @classmethod
    def _from_tensors(cls, q_seqlens: torch.Tensor, kv_seqlens: torch.Tensor | None, device) -> BlockDiagonalMask:
        """A mask on length tensors, none of them read (while tracing): its size is the call's."""
        check_length_tensor("q_seqlens", q_seqlens)
        if kv_seqlens is not None:
            check_length_tensor("kv_seqlens", kv_seqlens)
            if kv_seqlens.shape[0] != q_seqlens.shape[0]:
                raise InputError(f"kv_seqlens has {kv_seqlens.shape[0]} sequences, q_seqlens has {q_seqlens.shape[0]}")
        device = q_seqlens.device if device is None else torch.device(device)

        def starts(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if lengths.dtype is not torch.int32 or lengths.device != device:
                lengths = lengths.to(device=device, dtype=torch.int32)
            out = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=device)
            torch.cumsum(lengths, 0, dtype=torch.int32, out=out[1:])
            return out, lengths

        qs, ql = starts(q_seqlens)
        # self-attention shares one tensor of starts: lowering then knows every segment's diagonal is 0
        ks, kl = (qs, ql) if kv_seqlens is None else starts(kv_seqlens)
        atom = SegmentsAtom(qs, ks, kl, None, None, family=cls.__name__)
        return cls._create([atom], device=device)

    @classmethod
    def _from_host(cls, q, k, band, device) -> BlockDiagonalMask:
        qh = tuple([0] + list(accumulate(q)))
        kh = qh if k is q else tuple([0] + list(accumulate(k)))
        # one upload, a tensor per role; self-attention shares one tensor of starts
        n = len(qh)
        values = qh + tuple(k) if kh is qh else qh + kh + tuple(k)
        qs, *rest = to_device_parts(values, [n, len(k)] if kh is qh else [n, n, len(k)], device)
        ks, kl = (qs, *rest) if kh is qh else rest
        if not torch.compiler.is_compiling():
            # The number of documents is data: under torch.compile a new count must not be a new graph.
            # (The first call imports torch.distributed.tensor, which torch.compile imports anyway.)
            for t in {id(t): t for t in (qs, ks, kl)}.values():
                torch._dynamo.decorators.mark_unbacked(t, 0)
        atom = SegmentsAtom(qs, ks, kl, qh[-1], kh[-1], band, qh, kh, from_lists=device is None, family=cls.__name__)
        return cls._create([atom], device=device)

    @classmethod
    def from_tensor_list(cls, tensors, kv_tensors=None) -> tuple[BlockDiagonalMask, torch.Tensor]:
        """Pack ``[1, H, M_s, D]`` tensors along M; returns ``(bias, packed [1, H, sum M_s, D])``."""
        tensors = list(tensors)
        if not tensors:
            raise InputError("tensors must hold at least one tensor")
        for n, t in enumerate(tensors):
            if t.dim() != 4 or t.shape[0] != 1:
                raise InputError(f"tensors[{n}] must be [1, H, M, D], got shape {list(t.shape)}")
        q = [t.shape[2] for t in tensors]
        k = None if kv_tensors is None else [t.shape[2] for t in kv_tensors]
        bias = cls.from_seqlens(q, k, device=tensors[0].device)
        return bias, torch.cat(tensors, dim=2)

    @property
    def _segments(self) -> SegmentsAtom:
        return next(a for a in self.atoms if isinstance(a, SegmentsAtom))

    @property
    def q_seqlens(self) -> list[int]:
        """Query length of each sequence."""
        h = self._segments.q_host
        return [b - a for a, b in zip(h, h[1:])]

    @property
    def kv_seqlens(self) -> list[int]:
        """Key length of each sequence."""
        h = self._segments.k_host
        return [b - a for a, b in zip(h, h[1:])]

    def _with_band(self, band) -> BlockDiagonalMask:
        if self._offsets != (0, 0):
            raise InputError("make the mask causal/local before slicing it")
        seg = self._segments
        if seg.band is not None:
            raise InputError(f"{type(self).__name__} already has a band {seg.band}; build it again from_seqlens")
        atom = replace(seg, band=band, family=BlockDiagonalMask.__name__)
        # .device, not ._device: under torch.compile Dynamo runs this method on fake biases, which have no _device
        return BlockDiagonalMask._create([atom], device=self.device)

    def make_causal(self) -> BlockDiagonalMask:
        """Causal within each sequence, aligned top-left: ``j_local <= i_local``."""
        return self._with_band((TOP_LEFT, None, 0))

    def make_causal_from_bottom_right(self) -> BlockDiagonalMask:
        """Causal within each sequence, aligned bottom-right: ``j_local <= i_local + (k_len - q_len)``."""
        return self._with_band((BOTTOM_RIGHT, None, 0))

    def make_local_attention(self, window_left: int, window_right: int = 0) -> BlockDiagonalMask:
        """Sliding window within each sequence, aligned bottom-right (as :class:`LocalAttentionMask`)."""
        left = check_window("window_left", window_left)
        right = check_window("window_right", window_right)
        return self._with_band((BOTTOM_RIGHT, left, right))

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Split a packed ``[1, H, sum(q_seqlens), ...]`` tensor (e.g. the output) into its sequences."""
        if x.dim() < 3 or x.shape[0] != 1 or x.shape[2] != sum(self.q_seqlens):
            raise InputError(
                f"x must be [1, H, {sum(self.q_seqlens)}, ...] (the packed queries), got shape {list(x.shape)}"
            )
        return list(torch.split(x, self.q_seqlens, dim=2))

    def split_kv(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Split a packed ``[1, H, sum(kv_seqlens), ...]`` tensor into its sequences."""
        if x.dim() < 3 or x.shape[0] != 1 or x.shape[2] != sum(self.kv_seqlens):
            raise InputError(
                f"x must be [1, H, {sum(self.kv_seqlens)}, ...] (the packed keys), got shape {list(x.shape)}"
            )
        return list(torch.split(x, self.kv_seqlens, dim=2))
