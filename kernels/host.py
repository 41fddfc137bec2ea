"""Host copies of device tensors: index and token tensors checked and read without waiting for the GPU.

Every read of a CUDA tensor's values on the host (``int(t.max())``, ``t.tolist()``, ``t.cpu()``)
waits for every kernel queued before it, and every copy from pageable host memory to the GPU
waits too. The runtime's index tensors (a plan's rows, sequence offsets, token ids, replayed
experts) all start on the host, as numpy arrays of a layout or a bound plan; this module puts
them on the device without a wait (pinned memory, ``non_blocking``) and remembers their host
values, so the checks and the kernels' host-side bookkeeping read those instead of the device.

Entries are keyed by tensor identity and hold while the tensor's version counter is the one
recorded: an in-place write to the tensor (or to a view of it) makes the entry stale, and the
callers fall back to reading the device. A view (``t[:, i]``, a slice) of a recorded tensor has
no host copy of its own, but its values lie in the recorded tensor's range (:func:`value_range`).

PyTorch has no such registry (its own host copies, e.g. ``cu_seqlens_cpu`` arguments of fla, are
passed by hand); this one is small and keeps the device-side checks for tensors nobody recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["cached", "host_values", "index_select", "read", "record", "record_range", "upload", "value_range"]


class _Entry:
    """What is known on the host about one tensor at one version."""

    __slots__ = ("version", "values", "range", "derived")

    def __init__(self, version: int, values: np.ndarray | None, value_range: tuple[Any, Any] | None = None):
        self.version = version
        self.values = values
        self.range = value_range
        self.derived: dict[Hashable, Any] = {}


_ENTRIES = WeakIdKeyDictionary()


def _trackable(tensor: torch.Tensor) -> bool:
    # inference tensors have no version counter, so a later in-place write could not be noticed
    return isinstance(tensor, torch.Tensor) and not tensor.is_inference()


def _entry(tensor: torch.Tensor) -> _Entry | None:
    if not _trackable(tensor):
        return None
    entry = _ENTRIES.get(tensor)
    if entry is None or entry.version != tensor._version:
        return None
    return entry


def record(tensor: torch.Tensor, values: np.ndarray) -> torch.Tensor:
    """Remember ``values`` (read-only numpy, same shape) as ``tensor``'s host copy; returns ``tensor``."""
    if _trackable(tensor):
        values = np.asarray(values)
        if values.shape != tuple(tensor.shape):
            raise ValueError(f"host copy of shape {values.shape} for a tensor of shape {tuple(tensor.shape)}")
        _ENTRIES[tensor] = _Entry(tensor._version, values)
    return tensor


def record_range(tensor: torch.Tensor, low, high) -> torch.Tensor:
    """Remember that every value of ``tensor`` lies in ``[low, high]`` (e.g. it was gathered from a
    recorded tensor); returns ``tensor``."""
    if _trackable(tensor):
        _ENTRIES[tensor] = _Entry(tensor._version, None, (low, high))
    return tensor


def upload(values: np.ndarray | torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (numpy, or a CPU tensor) as a new tensor on ``device``, its host copy recorded, copied
    without waiting for the device.

    A copy from pageable memory to a GPU waits for the queue; from pinned memory with
    ``non_blocking`` it is queued like a kernel (PyTorch's pinned allocator keeps the staging
    buffer until the copy has run).
    """
    device = torch.device(device)
    if isinstance(values, torch.Tensor):
        staged = values.to(dtype) if dtype is not None else values
        values = staged.numpy().copy()  # the record never shares memory with a tensor someone may write
        fresh = False
    else:
        values = np.asarray(values)
        # torch.tensor copies: batch and layout arrays are read-only, which torch.as_tensor warns about
        staged = torch.tensor(values, dtype=dtype)
        if dtype is not None or values.flags.writeable:  # the record must not change under the tensor
            values = staged.numpy().copy()
        fresh = True
    if device.type == "cuda":
        tensor = staged.pin_memory().to(device, non_blocking=True)
    else:
        tensor = staged.to(device, copy=not fresh)  # always a tensor of its own, as on a GPU
    return record(tensor, values)


def host_values(tensor: torch.Tensor) -> np.ndarray | None:
    """The recorded host copy of ``tensor`` (None when there is none, or the tensor changed since)."""
    entry = _entry(tensor)
    return None if entry is None else entry.values


def read(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s values on the host, read-only: its recorded host copy, else read from the device (a wait for
    the queue) and recorded, so that the next read of the same tensor and version does not wait."""
    known = host_values(tensor)
    if known is not None:
        return known
    values = tensor.detach().cpu().numpy().copy()  # never memory a tensor write could change
    values.flags.writeable = False
    record(tensor, values)
    return values


def value_range(tensor: torch.Tensor) -> tuple[Any, Any] | None:
    """(low, high) bounding every value of ``tensor``, known on the host, else None.

    Exact (the minimum and maximum) for a tensor with a host copy; an enclosing range for a
    tensor recorded by :func:`record_range` or for a view of a recorded tensor. None for an
    empty tensor's copy, which has no range.
    """
    for candidate in (tensor, getattr(tensor, "_base", None)):
        if candidate is None or candidate.dtype != tensor.dtype:  # a view as another dtype reads other values
            continue
        entry = _entry(candidate)
        if entry is None:
            continue
        if entry.range is None and entry.values is not None and entry.values.size:
            entry.range = (entry.values.min().item(), entry.values.max().item())
        if entry.range is not None:
            return entry.range
    return None


def cached(tensor: torch.Tensor, key: Hashable, build: Callable[[np.ndarray], Any]) -> Any:
    """``build(host copy)``, computed once per tensor version and ``key``; None without a host copy."""
    entry = _entry(tensor)
    if entry is None or entry.values is None:
        return None
    if key not in entry.derived:
        entry.derived[key] = build(entry.values)
    return entry.derived[key]


def index_select(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``source.index_select(0, index)``, known to lie in ``source``'s value range when that is known
    (e.g. a microbatch's next-token targets, gathered from its recorded token ids)."""
    gathered = source.index_select(0, index)
    known = value_range(source)
    return gathered if known is None else record_range(gathered, *known)
