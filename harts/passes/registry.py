"""The pass registry: one row per pass, the pipeline's table of contents.

:data:`BUILTIN_PASSES` is the only list of the built-in passes: one :class:`PassRow` each (name,
the phase it requires and the phase it produces, the verifier of that phase, a one-line purpose
and where it is defined), in pipeline order. Everything else derives from it: the default
pipeline (:data:`harts.compiler.DEFAULT_PIPELINE`), the verifier table of
:func:`harts.ir.verify.verify`, the ``harts passes`` listing, and each built-in pass class's
``name`` / ``requires`` / ``produces`` / ``summary`` (set by :func:`builtin_pass`).

A pass module is imported the first time its pass is looked up, so importing
:mod:`harts.passes` imports no pass (and no planner). Other passes join with
:func:`register_pass` (for the process) or :meth:`PassRegistry.registered` (for a ``with``
block: tests use it, so that no test pass outlives its test).
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from harts.errors import PipelineError
from harts.ir.nodes import Phase
from harts.passes.base import PASS_NAME, Pass

__all__ = [
    "BUILTIN_PASSES", "PASS_REGISTRY", "PassRegistry", "PassRow", "builtin_pass", "parse_pipeline", "pipeline_to_text",
    "register_pass", "row_of",
]


def load(location: str) -> Any:
    """The object a ``module:name`` location names, importing its module."""
    module_name, _, attribute = location.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


@attrs.frozen
class PassRow:
    """One pass: its ``name``; the phase its input must have reached (``requires``, None: it starts from the
    batch) and the phase it produces; the ``verifier`` (``module:function``) of the invariants that phase adds
    (``harts.ir.verify`` runs the verifiers of every phase up to a module's own); a one-line ``purpose``, which
    also says why the pass sits where it does; and where the pass class is defined (``module:class``)."""

    name: str
    requires: Phase | None
    produces: Phase
    verifier: str | None
    purpose: str
    location: str | None = None


#: The built-in passes, in pipeline order: the default pipeline runs every one of them.
BUILTIN_PASSES: dict[str, PassRow] = {row.name: row for row in (
    PassRow("lower", None, Phase.LOWERED, "harts.ir.verify:verify_lowered",
            "the batch enters as IR: trajectories, input hash and the targets T, D, B every pass plans for",
            "harts.passes.lower:Lower"),
    PassRow("prefix-compress", Phase.LOWERED, Phase.COMPRESSED, "harts.ir.verify:verify_compressed",
            "the compact trie comes first: all later work is counted in compact rows (§3.1, Eq. 5-6)",
            "harts.passes.prefix_compress:PrefixCompress"),
    PassRow("partition-microbatches", Phase.COMPRESSED, Phase.PARTITIONED, "harts.ir.verify_plan:verify_partitioned",
            "microbatch membership ranked by J, which needs the trie's LCP work; replica and slot stay unset (§3.2, Eq. 4, 7-10)",
            "harts.passes.partition_microbatches:PartitionMicrobatches"),
    PassRow("schedule-slots", Phase.PARTITIONED, Phase.SCHEDULED, "harts.ir.verify_plan:verify_scheduled",
            "replica x slot of the chosen microbatches, by the rule J was ranked with: the only place slots are assigned (§3.2)",
            "harts.passes.schedule_slots:ScheduleSlots"),
    PassRow("segment", Phase.SCHEDULED, Phase.SEGMENTED, "harts.ir.verify_rounds:verify_segmented",
            "segment forests need final membership, and the scheduled phase beneath them (§3.3)",
            "harts.passes.segment:SegmentPass"),
    PassRow("min-call-rounds", Phase.SEGMENTED, Phase.ROUNDED, "harts.ir.verify_rounds:verify_rounded",
            "rounds, replay and state hand-offs over each microbatch's segment forest (Alg. 1)",
            "harts.passes.min_call_rounds:MinCallRounds"),
    PassRow("lay-out", Phase.ROUNDED, Phase.LAID_OUT, "harts.ir.verify_layout:verify_laid_out",
            "last: each microbatch's compact layout (rows, map m, replay and ancestor rows, state hand-offs) freezes "
            "everything above into what the runtime executes (§4.2)",
            "harts.passes.lay_out:LayOut"),
)}


def builtin_pass(name: str) -> Callable[[type[Pass]], type[Pass]]:
    """Class decorator of a built-in pass: its name, phases and summary come from its row of :data:`BUILTIN_PASSES`."""
    row = BUILTIN_PASSES[name]

    def decorate(cls: type[Pass]) -> type[Pass]:
        cls.name, cls.requires, cls.produces, cls.summary = row.name, row.requires, row.produces, row.purpose
        return cls

    return decorate


def row_of(cls: type[Pass]) -> PassRow:
    """The registry row of a pass class: a built-in's own row, or one read from the class of a registered pass
    (its verifier is that of the built-in pass producing the same phase)."""
    row = BUILTIN_PASSES.get(cls.name)
    if row is not None and row.location is not None and load(row.location) is cls:
        return row
    same_phase = next((r.verifier for r in BUILTIN_PASSES.values() if r.produces == cls.produces), None)
    return PassRow(cls.name, cls.requires, cls.produces, same_phase, cls.summary, f"{cls.__module__}:{cls.__qualname__}")


class PassRegistry(Mapping[str, type[Pass]]):
    """A read-only mapping from pass names to classes, loading built-in passes on first use."""

    def __init__(self, builtin: Mapping[str, PassRow]):
        self._locations = {name: row.location for name, row in builtin.items()}
        self._classes: dict[str, type[Pass]] = {}

    def __getitem__(self, name: str) -> type[Pass]:
        cls = self._classes.get(name)
        if cls is None:
            location = self._locations[name]
            cls = load(location)
            if cls.name != name:
                raise PipelineError(f"{location} defines pass {cls.name!r}, not {name!r}")
            self._classes[name] = cls
        return cls

    def rows(self) -> list[PassRow]:
        """Every registered pass's row, built-in passes first in pipeline order (``harts passes`` lists them)."""
        return [row_of(self[name]) for name in self]

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
