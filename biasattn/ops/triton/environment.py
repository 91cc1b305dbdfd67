"""Whether the Triton operators can run here: triton installed, and the interpreter on for the CPU."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch


@functools.cache
def triton_installed() -> bool:
    """True when the triton package can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """True when the kernels run through Triton's CPU interpreter.

    Once the kernels are loaded, their decoration decided it; before that, ``TRITON_INTERPRET`` does.
    """
    for name in ("biasattn.ops.triton.flash", "biasattn.ops.triton.splitk"):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "INTERPRETED"):
            return bool(mod.INTERPRETED)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
