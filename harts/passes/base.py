"""Passes, their registry, pipelines as data and as text.

A pass is a class with a kebab-case ``name``, the phase it ``requires`` and the phase it
``produces``, an attrs ``Options`` class (typed, with defaults) and a pure
``run(module, options, ctx) -> Module`` that never mutates its input.

Pipeline text: ``pass-a,pass-b{key=value,key=value},pass-c``.
"""

from __future__ import annotations

import logging
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs

from harts.errors import PipelineError
from harts.ir.nodes import Module, Phase

logger = logging.getLogger(__name__)

PASS_REGISTRY: dict[str, type["Pass"]] = {}


class Pass:
    """Base class; subclasses set ``name``, ``requires``, ``produces``, ``Options`` and ``run``."""

    name: ClassVar[str]
    requires: ClassVar[Phase]
    produces: ClassVar[Phase]
    summary: ClassVar[str] = ""

    @attrs.frozen
    class Options:
        pass

    def run(self, module: Module, options: Any, ctx: "PassContext") -> Module:  # pragma: no cover - abstract
        raise NotImplementedError


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator: add a pass to the registry under its ``name``."""
    if not re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", cls.name):
        raise ValueError(f"pass name {cls.name!r} is not kebab-case")
    if cls.name in PASS_REGISTRY and PASS_REGISTRY[cls.name] is not cls:
        raise ValueError(f"pass {cls.name!r} is registered twice")
    PASS_REGISTRY[cls.name] = cls
    return cls


@attrs.define
class PassContext:
    """What a pass may read besides the IR: the batch (tokens live there) and a progress hook."""

    batch: Any = None
    progress: Callable[[str, float], None] | None = None

    def report(self, what: str, fraction: float) -> None:
        if self.progress is not None:
            self.progress(what, fraction)


@attrs.frozen
class PassInvocation:
    """One pipeline entry: a registered pass name and its options."""

    name: str
    options: Any

    def to_text(self) -> str:
        defaults = _options_class(self.name)()
        changed = [
            (field.name, getattr(self.options, field.name))
            for field in attrs.fields(type(self.options))
            if getattr(self.options, field.name) != getattr(defaults, field.name)
        ]
        if not changed:
            return self.name
        return self.name + "{" + ",".join(f"{k}={_format_option(v)}" for k, v in changed) + "}"


def _format_option(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return str(value)


def _options_class(name: str) -> type:
    try:
        return PASS_REGISTRY[name].Options
    except KeyError:
        known = ", ".join(sorted(PASS_REGISTRY))
        raise PipelineError(f"unknown pass {name!r}; known passes: {known}") from None


def _convert_option(pass_name: str, field: attrs.Attribute, raw: str) -> Any:
    annotation = field.type
    if isinstance(annotation, str):
        annotation = eval(annotation, {"typing": typing, "None": None})  # noqa: S307 - annotations of our own classes
    allowed = typing.get_args(annotation) or (annotation,)
    if raw.lower() == "none" and type(None) in allowed:
        return None
    for kind in allowed:
        if kind is bool and raw.lower() in ("true", "false", "1", "0"):
            return raw.lower() in ("true", "1")
        if kind is int:
            try:
                return int(raw)
            except ValueError:
                continue
        if kind is float:
            try:
                return float(raw)
            except ValueError:
                continue
        if kind is str:
            return raw
    raise PipelineError(f"pass {pass_name!r}: option {field.name}={raw!r} is not a valid {annotation}")


def make_invocation(name: str, **options: Any) -> PassInvocation:
    options_class = _options_class(name)
    names = {f.name for f in attrs.fields(options_class)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise PipelineError(f"pass {name!r} has no option {unknown[0]!r}; its options: {', '.join(sorted(names)) or 'none'}")
    return PassInvocation(name, options_class(**options))


_ENTRY = re.compile(r"\s*([a-z0-9-]+)\s*(?:\{([^{}]*)\})?\s*(?:,|$)")


def parse_pipeline(text: str) -> list[PassInvocation]:
    """Parse ``a,b{k=v,k2=v2},c`` into invocations, checking names and option types."""
    invocations = []
    position = 0
    text = text.strip()
    while position < len(text):
        match = _ENTRY.match(text, position)
        if match is None or match.end() == position:
            raise PipelineError(f"cannot parse pipeline text at column {position}: {text[position:position + 30]!r}")
        name, body = match.group(1), match.group(2)
        options_class = _options_class(name)
        fields = {f.name: f for f in attrs.fields(options_class)}
        values: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in (body or "").split(","))):
            if "=" not in item:
                raise PipelineError(f"pass {name!r}: option {item!r} must be key=value")
            key, raw = (s.strip() for s in item.split("=", 1))
            if key not in fields:
                raise PipelineError(f"pass {name!r} has no option {key!r}; its options: {', '.join(sorted(fields)) or 'none'}")
            values[key] = _convert_option(name, fields[key], raw)
        invocations.append(PassInvocation(name, options_class(**values)))
        position = match.end()
    return invocations


def pipeline_to_text(invocations: Sequence[PassInvocation]) -> str:
    return ",".join(invocation.to_text() for invocation in invocations)
