"""Rollout-batch inputs named on the command line: node tables and presets.

``resolve_input(spec)`` turns what a user types after ``harts compile`` / ``harts train`` into a
:class:`~harts.rollouts.batch.RolloutBatch`:

* a node table path (``.jsonl`` / ``.parquet``, :mod:`harts.rollouts.nodetable`);
* ``demo``: the small node table bundled with the library (``harts/data/demo_rollouts.jsonl``);
* a generated preset, ``name`` or ``name:option=value,...`` (``swe-like:seed=3,scale=0.1``):
  ``swe-like``, ``no-sharing``, ``wide-tree`` and ``grpo`` come from the generators of
  :mod:`harts.rollouts.workloads`.

A project adds its own presets through the ``harts.presets`` entry-point group, each entry a
:class:`Preset`; a built-in name always wins.
"""

from __future__ import annotations

import importlib.resources
import os
from collections.abc import Callable
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import attrs

from harts.errors import RolloutInputError
from harts.rollouts.batch import RolloutBatch
from harts.rollouts.batch import read_node_table
from harts.rollouts.nodetable import SUFFIXES
from harts.rollouts.workloads import DEMO_RESOURCE, grpo_step, no_sharing_step, swe_like_step, wide_tree_step

__all__ = ["DEMO_RESOURCE", "ENTRY_POINT_GROUP", "Preset", "demo_batch", "parse_options", "input_path", "presets", "resolve_input"]

ENTRY_POINT_GROUP = "harts.presets"


@attrs.frozen
class Preset:
    """A named generated batch: ``make(**options)``, each option converted by ``options[name]``."""

    make: Callable[..., RolloutBatch]
    options: dict[str, type] = attrs.field(factory=dict)
    summary: str = ""

    def build(self, name: str, option_text: str) -> RolloutBatch:
        return self.make(**parse_options(name, option_text, self.options))


def demo_batch() -> RolloutBatch:
    """The bundled demo batch (``harts/data/demo_rollouts.jsonl``)."""
    resource = importlib.resources.files("harts.data").joinpath(DEMO_RESOURCE)
    with importlib.resources.as_file(resource) as path:
        return read_node_table(path)


_SWE_LIKE_OPTIONS = {"seed": int, "scale": float, "vocab_size": int, "profile": str, "tasks": int}


def _built_in_presets() -> dict[str, Preset]:
    return {
        "demo": Preset(make=demo_batch, summary="the bundled demo batch"),
        "grpo": Preset(grpo_step, {"groups": int, "group_size": int, "min_prompt": int, "max_prompt": int,
                                   "min_tokens": int, "max_tokens": int, "seed": int, "vocab_size": int},
                       "GRPO groups of responses to one prompt"),
        "no-sharing": Preset(no_sharing_step, {"trajectories": int, "min_tokens": int, "max_tokens": int, "seed": int,
                                               "vocab_size": int}, "trajectories that share no prefix"),
        "swe-like": Preset(swe_like_step, _SWE_LIKE_OPTIONS, "one SWE-like agentic step (profile: large-trees or calibrated)"),
        "wide-tree": Preset(wide_tree_step, {"leaves": int, "prompt_tokens": int, "min_tokens": int, "max_tokens": int,
                                             "seed": int, "vocab_size": int}, "one prompt with many leaves"),
    }


@cache
def presets() -> dict[str, Preset]:
    """Every preset: the built-in ones and those registered under the ``harts.presets`` entry points."""
    found = _built_in_presets()
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        preset = entry.load()
        if not isinstance(preset, Preset):
            raise TypeError(f"entry point {entry.name!r} of {ENTRY_POINT_GROUP!r} is {type(preset).__name__}, not a harts.rollouts.inputs.Preset")
        found.setdefault(entry.name, preset)
    return found


def parse_options(owner: str, text: str, allowed: dict[str, type], *, what: str = "preset") -> dict[str, Any]:
    """``option=value,...`` of a preset (or of another named thing, ``what``: e.g. an online RL task)."""
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        option, separator, value = item.partition("=")
        option = option.strip().replace("-", "_")
        if not separator or option not in allowed:
            known = ", ".join(allowed) or "none"
            raise RolloutInputError(f"{what} '{owner}': unknown option {item!r}; options: {known}")
        try:
            options[option] = allowed[option](value.strip())
        except ValueError as error:
            raise RolloutInputError(f"{what} '{owner}': option '{option}' must be {allowed[option].__name__}, got {value!r}") from error
    return options


def input_path(spec: str | os.PathLike[str]) -> Path | None:
    """The file an input names (None for a preset): what outputs of the same run must not write over."""
    text = os.fspath(spec)
    return None if text.partition(":")[0] in presets() else Path(text)


def resolve_input(spec: str | os.PathLike[str]) -> RolloutBatch:
    """A batch from a node-table path or a preset (see the module docstring)."""
    text = os.fspath(spec)
    name, _, option_text = text.partition(":")
    known = presets()
    if name in known:
        return known[name].build(name, option_text)
    path = Path(text)
    if path.suffix.lower() in SUFFIXES:
        return read_node_table(path)
    raise RolloutInputError(
        f"input {text!r} is neither a node table ({', '.join(SUFFIXES)}) nor a preset; presets: {', '.join(known)} "
        "(e.g. 'swe-like:seed=3,scale=0.1')"
    )
