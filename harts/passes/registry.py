"""The pass registry: pass names to pass classes, filled lazily.

The built-in passes are a table of names and the modules that define them; a module is
imported the first time its pass is looked up, so importing :mod:`harts.passes` imports no
pass (and no planner). Other passes join with :func:`register_pass` (for the process) or
:meth:`PassRegistry.registered` (for a ``with`` block: tests use it, so that no test pass
outlives its test).
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Iterator, Mapping, Sequence

from harts.errors import PipelineError
from harts.passes.base import PASS_NAME, Pass

__all__ = ["BUILTIN_PASSES", "PASS_REGISTRY", "PassRegistry", "parse_pipeline", "pipeline_to_text", "register_pass"]

#: Where each built-in pass is defined, in pipeline order (``module:class``).
BUILTIN_PASSES: dict[str, str] = {
    "lower": "harts.passes.lower:Lower",
    "prefix-compress": "harts.passes.prefix_compress:PrefixCompress",
    "partition-microbatches": "harts.passes.partition_microbatches:PartitionMicrobatches",
    "schedule-slots": "harts.passes.schedule_slots:ScheduleSlots",
    "segment": "harts.passes.segment:SegmentPass",
    "min-call-rounds": "harts.passes.min_call_rounds:MinCallRounds",
    "codegen": "harts.passes.codegen:Codegen",
}


class PassRegistry(Mapping[str, type[Pass]]):
    """A read-only mapping from pass names to classes, loading built-in passes on first use."""

    def __init__(self, builtin: Mapping[str, str]):
        self._locations = dict(builtin)
        self._classes: dict[str, type[Pass]] = {}

    def __getitem__(self, name: str) -> type[Pass]:
        cls = self._classes.get(name)
        if cls is None:
            location = self._locations[name]
            module_name, _, class_name = location.partition(":")
            cls = getattr(importlib.import_module(module_name), class_name)
            if cls.name != name:
                raise PipelineError(f"{location} defines pass {cls.name!r}, not {name!r}")
            self._classes[name] = cls
        return cls

    def __contains__(self, name: object) -> bool:
        return name in self._locations or name in self._classes

    def __iter__(self) -> Iterator[str]:
        yield from self._locations
        yield from (name for name in self._classes if name not in self._locations)

    def __len__(self) -> int:
        return len(self._locations.keys() | self._classes.keys())

    def register(self, cls: type[Pass]) -> type[Pass]:
        """Add a pass class under its ``name`` (kebab-case, not taken by another class)."""
        if not (isinstance(cls, type) and issubclass(cls, Pass)):
            raise TypeError(f"only Pass subclasses can be registered, not {cls!r}")
        if not PASS_NAME.fullmatch(getattr(cls, "name", "")):
            raise ValueError(f"pass name {getattr(cls, 'name', None)!r} is not kebab-case")
        if cls.name in self and self[cls.name] is not cls:
            raise ValueError(f"pass {cls.name!r} is registered twice")
        self._classes[cls.name] = cls
        return cls

    @contextlib.contextmanager
    def registered(self, *classes: type[Pass]) -> Iterator[None]:
        """Register ``classes`` for the duration of a ``with`` block."""
        added = [cls for cls in classes if cls.name not in self]
        for cls in classes:
            self.register(cls)
        try:
            yield
        finally:
            for cls in added:
                del self._classes[cls.name]


PASS_REGISTRY = PassRegistry(BUILTIN_PASSES)


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator: add a pass to the process-wide registry under its ``name``."""
    return PASS_REGISTRY.register(cls)


_ENTRY = re.compile(r"\s*([a-z0-9-]+)\s*(?:\{([^{}]*)\})?\s*(?:,|$)")


def parse_pipeline(text: str, registry: Mapping[str, type[Pass]] = PASS_REGISTRY) -> list[Pass]:
    """Parse ``a,b{k=v,k2=v2},c`` into pass instances, checking names and option types."""
    passes = []
    position = 0
    text = text.strip()
    while position < len(text):
        match = _ENTRY.match(text, position)
        if match is None or match.end() == position:
            raise PipelineError(f"cannot parse pipeline text at column {position}: {text[position:position + 30]!r}")
        name, body = match.group(1), match.group(2)
        if name not in registry:
            raise PipelineError(f"unknown pass {name!r}; known passes: {', '.join(registry)}")
        values: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in (body or "").split(","))):
            if "=" not in item:
                raise PipelineError(f"pass {name!r}: option {item!r} must be key=value")
            key, raw = (part.strip() for part in item.split("=", 1))
            values[key] = raw
        passes.append(registry[name].from_text_options(values))
        position = match.end()
    return passes


def pipeline_to_text(passes: Sequence[Pass]) -> str:
    return ",".join(p.to_text() for p in passes)
