"""The operators that call PyTorch's fused kernels: CUDA (``cutlass``, ``flash2``, ``cudnn``) and CPU (``cpu_flash``).

From a :class:`~biasattn.bias.spec.BiasSpec` to those kernels' arguments, one concern per module:

- :mod:`.layout`: how the kernel sees the sequences (batched, packed segments, padded keys),
  ``cu_seqlens`` and the packed q/k/v;
- :mod:`.masks`: the kernel's mask argument and aligned additive bias that reproduce the spec;
- :mod:`.lse`: the kernels' log-sum-exp formats to and from ours;
- :mod:`.base`: :class:`~.base.VendorOperator`, the checks and the forward/backward frame they share;
- :mod:`.cutlass`, :mod:`.flash2`, :mod:`.cudnn`: one operator each;
- :mod:`.cpu_flash`: the CPU kernel, which needs none of the above (no bias but a causal mask).
"""
