"""Context parallelism: one attention over a sequence sharded across the ranks of a process group.

>>> q_l = ba.distributed.shard_sequence(q, group=g, layout="zigzag")        # doctest: +SKIP
>>> out_l = ba.distributed.context_parallel_attention(q_l, k_l, v_l, attn_bias=bias, group=g)  # doctest: +SKIP
>>> out = ba.distributed.gather_sequence(out_l, group=g, layout="zigzag")    # doctest: +SKIP

``attn_bias`` describes the full sequence; each rank attends with lazy slices of it and skips the
(query shard, key shard) pairs that a slice hides entirely. torch.distributed only (NCCL on GPUs,
gloo on the CPU); forward and backward. See the "Context parallelism" docs page.
"""

from .api import METHODS, context_parallel_attention
from .layout import LAYOUTS, gather_sequence, shard_sequence

__all__ = ["LAYOUTS", "METHODS", "context_parallel_attention", "gather_sequence", "shard_sequence"]
