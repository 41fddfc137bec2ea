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

import torch

from harts.codegen.fx import build_program
from harts.ir.layout import MicrobatchLayout

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
            return kernels, program if device is None else program.to(device)

        return self.get(layout, key, build)[1]

    def __len__(self) -> int:
        return len(self._entries)


#: The process-wide cache the execution views use.
RUNTIME_CACHE = LayoutCache()
