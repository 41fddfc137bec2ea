"""Input checks shared by the reference kernels."""

from __future__ import annotations

import numpy as np
import torch

from . import host

__all__ = ["sequence_bounds"]


def _host_bounds(cu_seqlens: torch.Tensor) -> np.ndarray:
    """``cu_seqlens`` as read-only int64 numpy, read from the device at most once per tensor and version.

    Reading a CUDA tensor on the host waits for every kernel queued before it. A plan's programs
    pass the same cu_seqlens buffers to every layer, and those (like every tensor put on the
    device by :func:`harts.kernels.host.upload`) carry their host copy (:mod:`harts.kernels.host`):
    they are never read. Other tensors are read once, and their copy recorded.
    """
    return host.read(cu_seqlens).astype(np.int64, copy=False)


def sequence_bounds(cu_seqlens: torch.Tensor, total_rows: int, name: str) -> np.ndarray:
    """Check a cu_seqlens tensor against the packed row count and return it as int64 numpy."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name} must be a 1-D LongTensor [N+1], got {cu_seqlens!r}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must hold integers, got dtype {cu_seqlens.dtype}")
    bounds = _host_bounds(cu_seqlens)
    if bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {int(bounds[0])}")
    if bounds[-1] != total_rows:
        raise ValueError(f"{name} ends at {int(bounds[-1])} but the packed tensor has {total_rows} rows")
    if np.any(np.diff(bounds) < 0):
        bad = int(np.flatnonzero(np.diff(bounds) < 0)[0])
        raise ValueError(f"{name} must be non-decreasing; entry {bad + 1} ({int(bounds[bad + 1])}) < entry {bad}")
    return bounds
