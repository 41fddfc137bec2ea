"""Canonical text form of the IR: deterministic, human-readable, and parsed back exactly.

Grammar (whitespace-insensitive; ``//`` starts a comment that runs to the end of the line)::

    value := INT | STRING | 'none' | 'true' | 'false' | PHASE | list | node | array
    list  := '[' (value (',' value)*)? ']'
    node  := NAME '(' (FIELD '=' value (',' FIELD '=' value)*)? ')'
    array := 'Runs' '(' 'start' '=' list ',' 'step' '=' list ',' 'length' '=' list ')'

Nodes print every field in declaration order; lists of nodes put one node per line,
lists of scalars stay on one line. An int64 array of a layout prints as a list, or as its
arithmetic runs (:class:`~harts.ir.layout.ArithmeticRuns`) when they are shorter. ``parse(print_ir(m)) == m``
for every module and every laid-out module. Comments carry what is derived and only shown,
such as the programs generated from a layout in an IR dump.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs
import numpy as np

from harts.errors import IRParseError
from harts.ir.layout import LAYOUT_NODE_CLASSES, ArithmeticRuns
from harts.ir.nodes import NODE_CLASSES as MODULE_NODE_CLASSES
from harts.ir.nodes import Phase

NODE_CLASSES: dict[str, type] = {**MODULE_NODE_CLASSES, **LAYOUT_NODE_CLASSES}
_INDENT = "  "
_ARRAY = "Runs"


def print_ir(value: Any) -> str:
    """Render an IR node (usually a :class:`~harts.ir.nodes.Module`) as canonical text."""
    return _render(value, 0) + "\n"


def _render(value: Any, depth: int) -> str:
    if isinstance(value, Phase):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, np.ndarray):
        runs = ArithmeticRuns.encode(value)
        if value.size <= max(16, 3 * len(runs.start)):  # short, or no longer than its runs: entries read better
            return _render(tuple(int(v) for v in value), depth)
        return f"{_ARRAY}(start={_render(runs.start, depth)}, step={_render(runs.step, depth)}, length={_render(runs.length, depth)})"
    if isinstance(value, tuple):
        if not value:
            return "[]"
        if all(not attrs.has(type(item)) for item in value):
            return "[" + ", ".join(_render(item, depth) for item in value) + "]"
        inner = _INDENT * (depth + 1)
        items = (",\n").join(inner + _render(item, depth + 1) for item in value)
        return "[\n" + items + "\n" + _INDENT * depth + "]"
    if attrs.has(type(value)) and type(value).__name__ in NODE_CLASSES:
        fields = attrs.fields(type(value))
        # a field's IR name is its alias: a private field read through a property (a layout's long arrays) prints as the property
        rendered = [f"{f.alias}={_render(getattr(value, f.alias), depth + 1)}" for f in fields]
        flat = type(value).__name__ + "(" + ", ".join(rendered) + ")"
        if "\n" not in flat and len(flat) <= 160:
            return flat
        inner = _INDENT * (depth + 1)
        return type(value).__name__ + "(\n" + ",\n".join(inner + r for r in rendered) + "\n" + _INDENT * depth + ")"
    raise TypeError(f"cannot print {type(value).__name__} as IR")


_TOKEN = re.compile(
    r"""(?:\s|//[^\n]*)*(?:
        (?P<int>-?\d+)
      | (?P<string>"(?:[^"\\]|\\.)*")
      | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
      | (?P<punct>[\[\](),=])
    )""",
    re.VERBOSE,
)

_BLANK = re.compile(r"(?:\s|//[^\n]*)*")
_PHASES = {str(phase): phase for phase in Phase}


class _Parser:
    def __init__(self, text: str):
        self.tokens: list[tuple[str, str, int]] = []
        position = 0
        while position < len(text):
            if _BLANK.fullmatch(text, position):
                break
            match = _TOKEN.match(text, position)
            if match is None:
                raise IRParseError(f"unexpected character {text[position]!r} at offset {position}")
            kind = match.lastgroup
            self.tokens.append((kind, match.group(kind), match.start(kind)))
            position = match.end()
        self.index = 0

    def peek(self) -> tuple[str, str, int]:
        if self.index >= len(self.tokens):
            return ("eof", "", -1)
        return self.tokens[self.index]

    def take(self, expected: str | None = None) -> tuple[str, str, int]:
        token = self.peek()
        if token[0] == "eof":
            raise IRParseError("unexpected end of IR text")
        if expected is not None and token[1] != expected:
            raise IRParseError(f"expected {expected!r} at offset {token[2]}, found {token[1]!r}")
        self.index += 1
        return token

    def value(self) -> Any:
        kind, text, offset = self.take()
        if kind == "int":
            return int(text)
        if kind == "string":
            return json.loads(text)
        if kind == "punct" and text == "[":
            items = []
            if self.peek()[1] != "]":
                items.append(self.value())
                while self.peek()[1] == ",":
                    self.take(",")
                    items.append(self.value())
            self.take("]")
            return tuple(items)
        if kind == "name":
            if text == "none":
                return None
            if text in ("true", "false"):
                return text == "true"
            if text in _PHASES and self.peek()[1] != "(":
                return _PHASES[text]
            if text == _ARRAY:
                runs = self.node(ArithmeticRuns, offset)
                try:
                    return runs.decode()
                except Exception as error:  # decoding reports bad runs with several types
                    raise IRParseError(f"array at offset {offset}: {error}") from None
            if text in NODE_CLASSES:
                return self.node(NODE_CLASSES[text], offset)
            raise IRParseError(f"unknown name {text!r} at offset {offset}")
        raise IRParseError(f"unexpected {text!r} at offset {offset}")

    def node(self, cls: type, offset: int) -> Any:
        self.take("(")
        values: dict[str, Any] = {}
        known = {f.alias for f in attrs.fields(cls)}
        while self.peek()[1] != ")":
            if values:
                self.take(",")
            kind, name, name_offset = self.take()
            if kind != "name" or name not in known:
                raise IRParseError(f"{cls.__name__} has no field {name!r} (offset {name_offset})")
            if name in values:
                raise IRParseError(f"{cls.__name__}: field {name!r} given twice (offset {name_offset})")
            self.take("=")
            values[name] = self.value()
        self.take(")")
        missing = [f.alias for f in attrs.fields(cls) if f.alias not in values and f.default is attrs.NOTHING]
        if missing:
            raise IRParseError(f"{cls.__name__} at offset {offset} lacks field(s) {', '.join(missing)}")
        return cls(**values)


def parse_ir(text: str) -> Any:
    """Parse canonical IR text back into nodes."""
    parser = _Parser(text)
    value = parser.value()
    if parser.peek()[0] != "eof":
        raise IRParseError(f"trailing text at offset {parser.peek()[2]}")
    return value
