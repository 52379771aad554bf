"""Which torch build and device compiled artifacts belong to (the ``torch`` layout's group).

Kept apart from ``torch_artifacts`` so the layout can name its group without importing the
module that writes entries (which imports the layout): no import cycle.
"""

from __future__ import annotations

import contextlib


def torch_device() -> str:
    """``cpu`` or ``cuda-sm<major><minor>`` (compiled kernels are specific to the architecture)."""
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"cuda-sm{major}{minor}"
    return "cpu"


def torch_group(device: str | None = None) -> str:
    """``torch-<torch version>[-triton<version>]-<device>``, e.g. ``torch-2.13.0+cpu-cpu``."""
    import torch

    parts = [f"torch-{torch.__version__}"]
    dev = device or torch_device()
    if dev != "cpu":
        with contextlib.suppress(ImportError):
            import triton

            parts.append(f"triton{triton.__version__}")
    parts.append(dev)
    return "-".join(parts)


__all__ = ["torch_device", "torch_group"]
