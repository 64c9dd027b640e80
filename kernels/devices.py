"""Devices compared as the tensors on them are: ``cuda`` is the current CUDA device.

``torch.device("cuda")`` has no index, while every tensor made there reports one
(``cuda:0``), so ``torch.device("cuda") != tensor.device`` although they are the same GPU.
This module owns the one normalization (``device_key``) and comparison (``same_device``) the
LoRA tables and kernels use; it imports only torch.
"""

from __future__ import annotations

import torch


def device_key(device: torch.device | str) -> torch.device:
    """``device`` with its index filled in: a CUDA device without one is the current CUDA
    device (``torch.cuda.current_device()``), where tensors made on it land. Devices of other
    types, and ``cuda`` where no CUDA device is usable, come back as they are."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        try:
            return torch.device("cuda", torch.cuda.current_device())
        except (RuntimeError, AssertionError):  # no CUDA here: nothing can be made on it anyway
            return d
    return d


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether tensors on ``a`` and on ``b`` live on the same device (``cuda`` == ``cuda:0``
    when device 0 is current)."""
    return device_key(a) == device_key(b)


__all__ = ["device_key", "same_device"]
