"""Whether the Triton operators can run here: triton installed, and the interpreter on for the CPU."""

from __future__ import annotations

import functools
import importlib.util

import torch

from ..common import interpreted


@functools.cache
def triton_installed() -> bool:
    """True when the triton package can be imported."""
    return importlib.util.find_spec("triton") is not None


def environment_reasons(device: torch.device | None = None) -> list[str]:
    """Reasons a Triton operator cannot run on ``device``, independent of the inputs."""
    if not triton_installed():
        return ["needs the triton package, which is not installed"]
    if device is not None and device.type == "cpu" and not interpreted():
        return [
            "runs on the CPU only under the Triton interpreter "
            "(TRITON_INTERPRET=1 set before biasattn's kernels load), which is off"
        ]
    return []
