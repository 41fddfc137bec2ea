"""Rollout trees sampled by the policy itself: forks at turn boundaries and inside turns.

An agentic rollout is a tree: a prompt, then turns of the policy separated by observations
of the environment, and several continuations wherever the trainer asks for them. Here
each prompt's tree is grown with an :class:`~harts.runtime.decode.IncrementalDecoder`,
batched over every open branch of every tree:

* at the start of turn ``j`` each branch forks into ``shape.branches[j]`` continuations
  (turn 0: right after the prompt; later turns: right after the observation);
* inside turn ``j`` each branch forks ``shape.inner_forks[j]`` more times, each at a cut
  drawn uniformly from the turn's interior positions (1 .. length - 1): the fork keeps the
  tokens before the cut and resamples the rest of the turn;
* after every turn but the last the task's observation is appended (tokens the policy did
  not sample, so ``loss_mask`` is 0 on them, as on the prompt).

Forking copies no tensor: decoder states are immutable and a fork reuses its parent's.
All randomness (cuts and token noise) comes from one ``torch.Generator`` in an order fixed
by the tree shape, so the same seed gives the same trees whenever the policy gives the
same log-probs (HARTS and the baseline sample identically from identical weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch

from harts.rollouts.batch import RolloutBatch
from harts.errors import HartsError
from harts.rl import group_advantages

if TYPE_CHECKING:
    from harts.runtime.decode import DecodeState, IncrementalDecoder
    from harts.tasks.base import Episode, Task

__all__ = ["Rollout", "TreeShape", "rollout_batch", "sample_rollouts"]


def _counts(instance, attribute, value) -> None:
    if not value or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        raise HartsError(f"TreeShape.{attribute.name} must be a non-empty tuple of ints >= 0, got {value!r}")


@attrs.frozen
class TreeShape:
    """How every prompt's tree branches, turn by turn (see the module docstring)."""

    branches: tuple[int, ...] = attrs.field(converter=tuple, validator=_counts)
    inner_forks: tuple[int, ...] = attrs.field(converter=tuple, validator=_counts)

    def __attrs_post_init__(self) -> None:
        if len(self.branches) != len(self.inner_forks):
            raise HartsError(f"TreeShape: {len(self.branches)} turn(s) of branches but {len(self.inner_forks)} of inner forks")
        if min(self.branches) < 1:
            raise HartsError(f"TreeShape.branches must be >= 1 per turn, got {self.branches}")

    @property
    def turns(self) -> int:
        return len(self.branches)

    def leaves(self, turn_length: int) -> int:
        """Leaves of one tree (inner forks need a turn of at least two tokens)."""
        count = 1
        for branches, forks in zip(self.branches, self.inner_forks):
            count *= branches * (1 + (forks if turn_length > 1 else 0))
        return count


@attrs.frozen(eq=False)
class Rollout:
    """One root-to-leaf path: tokens, the token-aligned loss mask and sampler log-probs, its turns and reward.

    ``rollout_log_probs[t]`` is the sampler's log-prob of ``tokens[t]`` (0 where the policy
    did not sample: prompt and observations).
    """

    tree: int
    tokens: tuple[int, ...]
    loss_mask: tuple[int, ...]
    rollout_log_probs: tuple[float, ...]
    turns: tuple[tuple[int, ...], ...]
    reward: float = 0.0


@attrs.frozen(eq=False)
class _Branch:
    state: DecodeState
    tree: int
    loss_mask: tuple[int, ...]
    log_probs: tuple[float, ...]
    turns: tuple[tuple[int, ...], ...] = ()
    current: tuple[int, ...] = ()
    cuts: tuple[int, ...] = ()

    def extended(self, state: DecodeState, tokens: Sequence[int], *, sampled: Sequence[float] | None = None) -> _Branch:
        count = len(tokens)
        if sampled is None:
            return attrs.evolve(self, state=state, loss_mask=self.loss_mask + (0,) * count, log_probs=self.log_probs + (0.0,) * count)
        return attrs.evolve(self, state=state, loss_mask=self.loss_mask + (1,) * count,
                            log_probs=self.log_probs + tuple(sampled), current=self.current + tuple(tokens))


def _extend(decoder: IncrementalDecoder, branches: list[_Branch], tokens: list[list[int]]) -> list[_Branch]:
    states = decoder.extend([b.state for b in branches], tokens)
    return [b.extended(s, t) for b, s, t in zip(branches, states, tokens)]


def _sample_turn(decoder: IncrementalDecoder, branches: list[_Branch], length: int, forks: int,
                 generator: torch.Generator) -> list[_Branch]:
    """Sample ``length`` tokens on every branch; each forks ``forks`` times at random interior cuts."""
    if forks and length > 1:
        cuts = torch.randint(1, length, (len(branches), forks), generator=generator).tolist()
        branches = [attrs.evolve(b, cuts=tuple(sorted(c))) for b, c in zip(branches, cuts)]
    for position in range(length):
        spawned = [attrs.evolve(b, cuts=()) for b in branches for cut in b.cuts if cut == position]
        branches = branches + spawned
        tokens, log_probs = decoder.sample([b.state for b in branches], generator)
        states = decoder.extend([b.state for b in branches], [[t] for t in tokens])
        branches = [b.extended(s, [t], sampled=[lp]) for b, s, t, lp in zip(branches, states, tokens, log_probs)]
    return [attrs.evolve(b, turns=b.turns + (b.current,), current=(), cuts=()) for b in branches]


def sample_rollouts(decoder: IncrementalDecoder, task: Task, episodes: Sequence[Episode],
                    generator: torch.Generator) -> list[Rollout]:
    """Grow one tree per episode (see the module docstring); leaves grouped by tree, trees in episode order."""
    if not episodes:
        raise HartsError("sample_rollouts: no episodes to roll out")
    shape = task.shape
    start = decoder.start()
    branches = [
        _Branch(state=start, tree=index, loss_mask=(), log_probs=()) for index in range(len(episodes))
    ]
    branches = _extend(decoder, branches, [list(e.prompt) for e in episodes])
    for turn in range(shape.turns):
        branches = [b for b in branches for _ in range(shape.branches[turn])]
        branches = _sample_turn(decoder, branches, task.turn_length, shape.inner_forks[turn], generator)
        if turn + 1 < shape.turns:
            observations = [list(task.observation(episodes[b.tree], b.turns)) for b in branches]
            branches = _extend(decoder, branches, observations)
    branches.sort(key=lambda b: b.tree)  # stable: the sampling order within a tree
    return [
        Rollout(
            tree=b.tree, tokens=b.state.tokens, loss_mask=b.loss_mask, rollout_log_probs=b.log_probs, turns=b.turns,
            reward=float(task.reward(episodes[b.tree], b.turns)),
        )
        for b in branches
    ]


def rollout_batch(rollouts: Sequence[Rollout], *, normalize_std: bool = True) -> RolloutBatch:
    """The rollouts as a :class:`~harts.RolloutBatch` with GRPO group advantages (one group per tree).

    Fields: ``loss_mask`` and ``rollout_log_probs`` (per token), ``reward``, ``group_id`` and
    ``advantages`` (per trajectory); ``tree_ids`` are the trees.
    """
    trees = np.asarray([r.tree for r in rollouts], dtype=np.int64)
    rewards = np.asarray([r.reward for r in rollouts], dtype=np.float64)
    return RolloutBatch.from_trajectories(
        [list(r.tokens) for r in rollouts],
        tree_ids=trees,
        loss_mask=[np.asarray(r.loss_mask, dtype=np.float32) for r in rollouts],
        rollout_log_probs=[np.asarray(r.rollout_log_probs, dtype=np.float64) for r in rollouts],
        reward=rewards,
        group_id=trees,
        advantages=group_advantages(rewards, trees, normalize_std=normalize_std),
    )
