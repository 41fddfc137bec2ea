"""Progress lines and device timing helpers shared by the benchmarks."""

from __future__ import annotations

import time

import torch

__all__ = ["STARTED", "peak_memory_gib", "reset_peak_memory", "say", "synchronize"]

#: When this process started benchmarking (the first import), for progress lines and first-step times.
STARTED = time.perf_counter()


def say(message: str) -> None:
    """One progress line, stamped with the seconds since :data:`STARTED`."""
    print(f"[{time.perf_counter() - STARTED:8.1f}s] {message}", flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None
