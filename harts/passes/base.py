"""Passes and pipelines, as data and as text.

A pass is a frozen attrs class: its fields are its typed options (declared with
:func:`option`), its class variables say what it is:

* ``name``: kebab-case, the name pipelines and dumps use;
* ``requires``: the phase its input must have reached (None for ``lower``, which starts
  from the batch in the context and takes no module);
* ``produces``: the phase of its output, exactly;
* ``run(module, ctx) -> result``: pure, never mutates its input.

The pass manager (:func:`harts.passes.manager.run_pipeline`) enforces ``requires`` and
``produces`` and verifies every output, so a pass checks neither its input phase nor its
output. A pipeline is a sequence of pass instances; its text form
(:func:`harts.passes.registry.parse_pipeline`) is ``pass-a,pass-b{key=value},pass-c`` and
lists only the options that differ from their defaults.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import attrs

from harts.rollouts.batch import RolloutBatch
from harts.errors import PipelineError
from harts.ir.layout import LaidOutModule
from harts.ir.nodes import CompactTrie, Module, Phase
from harts.ir.text import print_ir
from harts.options import DEFAULT_OPTIONS, CompileOptions

__all__ = ["PASS_NAME", "Pass", "PassContext", "Stage", "option"]

#: What flows through a pipeline: nothing before ``lower``, a Module, or (after ``lay-out``) a LaidOutModule.
Stage = Module | LaidOutModule

PASS_NAME = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")

_TEXT_KINDS = (bool, int, float, str)
_TRUE, _FALSE = ("true", "1"), ("false", "0")


def _kind_name(kind: type) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string"}[kind]


@attrs.frozen
class _OptionCheck:
    """attrs validator of one option: its kind, None when optional, and a lower bound."""

    kind: type
    optional: bool
    minimum: float | None

    def __call__(self, instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is None and self.optional:
            return
        valid = isinstance(value, self.kind) and not (self.kind is not bool and isinstance(value, bool))
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            valid = True
        if valid and self.minimum is not None and value < self.minimum:
            valid = False
        if not valid:
            bound = "" if self.minimum is None else f" >= {self.minimum:g}"
            raise PipelineError(
                f"pass {type(instance).name!r}: option '{attribute.name}' must be a{'n' if self.kind is int else ''} "
                f"{_kind_name(self.kind)}{bound}{' or none' if self.optional else ''}, got {value!r}"
            )


def option(default: Any, *, kind: type | None = None, minimum: float | None = None, doc: str = "") -> Any:
    """Declare a pass option: ``exact_threshold: int = option(512, minimum=1)``.

    ``kind`` (bool, int, float or str) is how the option is read from pipeline text; it
    defaults to the type of ``default``. A ``None`` default makes the option optional
    (``none`` in text) and needs ``kind``. The kind is declared, not read from the type
    annotation, so converting pipeline text never evaluates annotations.
    """
    kind = type(default) if kind is None else kind
    if kind not in _TEXT_KINDS:
        raise TypeError(f"an option's kind must be one of bool, int, float, str; got {kind!r}")
    check = _OptionCheck(kind=kind, optional=default is None, minimum=minimum)
    return attrs.field(default=default, validator=check, metadata={"option": check, "doc": doc})


def _from_text(pass_name: str, field: attrs.Attribute, raw: str) -> Any:
    check: _OptionCheck | None = field.metadata.get("option")
    if check is None:
        raise PipelineError(f"pass {pass_name!r}: option '{field.name}' is not declared with harts.passes.option and cannot be set from text")
    text = raw.strip()
    if check.optional and text.lower() == "none":
        return None
    try:
        if check.kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError(text)
            return text.lower() in _TRUE
        return check.kind(text)
    except ValueError:
        raise PipelineError(f"pass {pass_name!r}: option {field.name}={raw!r} is not a valid {_kind_name(check.kind)}") from None


def _to_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return str(value)


@attrs.define
class PassContext:
    """What a pass may read besides the IR: the batch (tokens live there), the compile
    options (``lower`` records them in the IR) and a progress hook.

    ``batch_trie``: the compact trie of ``batch.tokens``, when it was built before the pipeline ran
    (``harts.compile`` builds it while the batch hashes in another thread); ``prefix-compress``
    takes it instead of building the same trie again.

    ``batch_plan``: ``(trie, lengths, planner options, result)`` of the microbatch planner, when
    ``harts.compile`` ran it on ``batch_trie`` while the hash went on; ``partition-microbatches``
    takes the result only for that very trie object, those trajectory lengths and equal options,
    the whole of what the planner reads (:meth:`prepared_plan`).
    """

    batch: RolloutBatch | None = None
    options: CompileOptions = DEFAULT_OPTIONS
    progress: Callable[[str, float], None] | None = None
    batch_trie: CompactTrie | None = None
    batch_plan: tuple | None = None

    def prepared_plan(self, trie: CompactTrie | None, lengths: tuple[int, ...], options) -> Any:
        """The planner's result prepared for exactly these inputs (see ``batch_plan``), else None."""
        if self.batch_plan is None or trie is None:
            return None
        prepared_trie, prepared_lengths, prepared_options, result = self.batch_plan
        if prepared_trie is trie and prepared_lengths == lengths and prepared_options == options:
            return result
        return None

    def report(self, what: str, fraction: float) -> None:
        if self.progress is not None:
            self.progress(what, fraction)


class Pass:
    """Base of every pass; subclasses are ``@attrs.frozen`` and set the class variables below."""

    name: ClassVar[str]
    requires: ClassVar[Phase | None]
    produces: ClassVar[Phase]
    summary: ClassVar[str] = ""

    def run(self, module: Stage | None, ctx: PassContext) -> Stage:  # pragma: no cover - abstract
        raise NotImplementedError

    def render(self, result: Stage) -> str:
        """The text of the stage this pass produced, for IR dumps and printing (canonical IR text)."""
        return print_ir(result)

    def to_text(self) -> str:
        """This pass as pipeline text: its name and the options that differ from their defaults."""
        changed = [
            (field.name, getattr(self, field.name))
            for field in attrs.fields(type(self))
            if getattr(self, field.name) != field.default
        ]
        if not changed:
            return self.name
        return self.name + "{" + ",".join(f"{key}={_to_text(value)}" for key, value in changed) + "}"

    @classmethod
    def from_text_options(cls, raw: Mapping[str, str]) -> "Pass":
        """An instance from ``key=value`` strings of pipeline text."""
        fields = {field.name: field for field in attrs.fields(cls)}
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise PipelineError(f"pass {cls.name!r} has no option {unknown[0]!r}; its options: {', '.join(sorted(fields)) or 'none'}")
        return cls(**{key: _from_text(cls.name, fields[key], value) for key, value in raw.items()})
