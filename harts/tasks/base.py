"""What an online RL task is: prompts, an environment that answers between turns, a programmatic reward."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np

from harts.tasks.trees import TreeShape

__all__ = ["Episode", "Task"]


@attrs.frozen
class Episode:
    """One prompt of a task and what the environment keeps hidden about it (``data``)."""

    prompt: tuple[int, ...] = attrs.field(converter=tuple)
    data: Any = None


class Task(abc.ABC):
    """An online RL task (see :mod:`harts.tasks`).

    A subclass sets ``name``, ``summary``, ``OPTIONS``, ``vocab_size``, ``turn_length`` (tokens the policy samples per
    turn), ``shape`` (how each prompt's tree branches), ``prompts_per_step``, ``model`` (preset
    overrides of a policy that fits the task) and ``defaults`` (``harts train`` options), and
    implements the three methods below.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    #: Options a task spec may set (``name:option=value,...``) -> their types; the constructor's keywords.
    OPTIONS: ClassVar[dict[str, type]] = {}
    vocab_size: int
    turn_length: int
    shape: TreeShape
    prompts_per_step: int
    model: Mapping[str, Any] = {}
    defaults: Mapping[str, Any] = {}

    @property
    def turns(self) -> int:
        return self.shape.turns

    @abc.abstractmethod
    def episode(self, rng: np.random.Generator) -> Episode:
        """A fresh prompt."""

    @abc.abstractmethod
    def observation(self, episode: Episode, turns: Sequence[Sequence[int]]) -> Sequence[int]:
        """The environment's answer after the policy's turns so far (appended before the next turn)."""

    @abc.abstractmethod
    def reward(self, episode: Episode, turns: Sequence[Sequence[int]]) -> float:
        """The reward in [0, 1] of a finished path (all its turns)."""

    def episodes(self, rng: np.random.Generator, count: int | None = None) -> list[Episode]:
        return [self.episode(rng) for _ in range(self.prompts_per_step if count is None else count)]
