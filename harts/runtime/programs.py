"""What the runtime derives from a frozen layout, built once and kept while the layout lives.

Layouts are immutable IR (:class:`~harts.ir.layout.MicrobatchLayout`); the torch.fx programs
generated from them (:mod:`harts.codegen.fx`) depend on where they run (device) and what
they call (kernel set), so they are built here, at run time, and cached per layout: every
view, layer and step on the same layout reuses them. Entries go when their layout is
garbage-collected.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import numpy as np
import torch

from harts.codegen.fx import build_program
from harts.ir.layout import MicrobatchLayout
from harts.kernels import host

__all__ = ["LayoutCache", "RUNTIME_CACHE"]

T = TypeVar("T")


class LayoutCache:
    """Per-layout memo, keyed by the layout's identity (layouts compare by value and do not hash)."""

    def __init__(self) -> None:
        self._entries: dict[int, dict[Hashable, Any]] = {}

    def get(self, layout: MicrobatchLayout, key: Hashable, build: Callable[[], T]) -> T:
        """The value cached for ``(layout, key)``, built by ``build()`` the first time."""
        entries = self._entries.get(id(layout))
        if entries is None:
            entries = self._entries[id(layout)] = {}
            weakref.finalize(layout, self._entries.pop, id(layout), None)
        if key not in entries:
            entries[key] = build()
        return entries[key]

    def program(self, layout: MicrobatchLayout, kind: str, device: torch.device | str | None = None, kernels: Any = None,
                **options: Any) -> torch.fx.GraphModule:
        """The program of ``kind`` for a layout (see :func:`harts.codegen.fx.build_program`), once per device and kernel set."""
        # Kernel sets need not be hashable (a namespace of functions); the entry keeps the object
        # alive, so its id cannot be reused while the entry exists.
        key = ("program", kind, tuple(sorted(options.items())), str(device), id(kernels))

        def build() -> tuple[Any, torch.fx.GraphModule]:
            program = build_program(layout, kind, kernels, **options)
            return kernels, program if device is None else on_device(program, device)

        return self.get(layout, key, build)[1]

    def tensor(self, layout: MicrobatchLayout, name: str, values: Callable[[], np.ndarray], device: torch.device | str,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """The layout's array ``name`` (built by ``values()``) on ``device``, copied there once and then reused
        by every view and pass of the layout (:func:`harts.kernels.host.upload`: no wait for the device)."""
        key = ("tensor", name, str(torch.device(device)), dtype)
        return self.get(layout, key, lambda: host.upload(values(), device, dtype))

    def __len__(self) -> int:
        return len(self._entries)


def on_device(program: torch.fx.GraphModule, device: torch.device | str) -> torch.fx.GraphModule:
    """``program`` with its index buffers on ``device``, each carrying its host copy (:mod:`harts.kernels.host`),
    so that the checks and kernels that need a buffer's values on the host never read them from the device.

    Each buffer goes by :func:`harts.kernels.host.upload` (pinned, no wait for the device) rather than by
    ``program.to(device)``, whose copies from pageable memory would each wait: a training step on a new
    plan builds its programs in its first pass.
    """
    for module in program.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            module.register_buffer(name, host.upload(buffer, device))
    return program


#: The process-wide cache the execution views use.
RUNTIME_CACHE = LayoutCache()
