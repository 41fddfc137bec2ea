"""Synthetic rollout batches: an agentic SWE-like training step, and a small bundled demo.

``swe_like_step`` imitates one step of the agentic SWE workload (paper §5): task trees that
share one system prompt, each a multi-turn agent interaction that forks repeatedly (retries,
parallel exploration) at turn boundaries and inside turns. Two profiles (``SWE_LIKE_PROFILES``):

* ``large-trees`` (the default): about a hundred tasks of about 15 paths, forks spread over
  the second half of a path; about 40% of the trees are larger than a 65,536-token
  microbatch, so a plan repeats long stems: planned compression 3.0-4.1x on seeds 1-10,
  although the trie alone gives 5.3-6.0x.
* ``calibrated``: 180 smaller tasks with later forks, chosen so that the figures the paper
  reports for its recorded SWE-bench steps come out alike at T = 65,536: on seeds 1-10,
  1.5k-1.8k paths and 34-44M raw tokens per step (paper: 1.3k-2.4k, 35-59M), planned
  compression 5.1-6.2x (paper 5.0-7.6x) and microbatches 97% full at D = 4 (paper: 98%,
  from its slot counts).

Everything is deterministic from a seed; token arrays are built with NumPy and shared
prefixes are shared arrays until the final concatenation.

The bundled demo node table (``harts/data/demo_rollouts.jsonl``, read by
:func:`harts.rollouts.inputs.demo_batch`) is the output of ``make_demo_batch()``, written by
``write_demo_data``. :mod:`harts.rollouts.inputs` names the generators as presets (``swe-like``,
``no-sharing``, ``wide-tree``, ``grpo``) for ``harts compile`` / ``harts train``.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np

from harts.errors import RolloutInputError
from harts.rollouts.batch import RolloutBatch
from harts.rollouts.fields import MAX_TOKEN_ID, adopt

logger = logging.getLogger(__name__)

#: Every generated trajectory is at most this long (one microbatch of capacity 65,536 holds it).
MAX_TRAJECTORY_TOKENS = 65_535

PROMPT, ASSISTANT, TOOL = 0, 1, 2


def grpo_advantages(rewards: np.ndarray, groups: np.ndarray, epsilon: float = 1e-6) -> np.ndarray:
    """GRPO advantages: each reward minus its group's mean, over the group's std plus ``epsilon``."""
    rewards = np.asarray(rewards, dtype=np.float64)
    groups = np.asarray(groups)
    advantages = np.zeros_like(rewards)
    for group in np.unique(groups):
        members = groups == group
        values = rewards[members]
        advantages[members] = (values - values.mean()) / (values.std() + epsilon)
    return advantages


# ----------------------------------------------------------------------------- SWE-like


@attrs.frozen
class SweLikeShape:
    """Knobs of the SWE-like generator at scale 1 (token counts scale with ``scale``)."""

    tasks: int = 100
    system_prompt_tokens: tuple[int, int] = (2_000, 4_000)
    task_prompt_tokens: tuple[int, int] = (1_500, 6_000)
    assistant_turn_tokens: tuple[int, int] = (50, 800)
    assistant_turn_median: float = 220.0
    tool_turn_tokens: tuple[int, int] = (100, 4_000)
    tool_turn_median: float = 700.0
    paths_median: float = 12.0
    paths_sigma: float = 0.75
    max_paths: int = 64
    horizon_median: float = 20_000.0
    horizon_sigma: float = 0.6
    horizon_tokens: tuple[int, int] = (3_000, 58_000)
    # Forks come late more often than early: retries and parallel attempts near the end.
    fork_beta: tuple[float, float] = (4.2, 0.9)
    continuation_sigma: float = 0.6


#: Named generator shapes; see the module docstring.
SWE_LIKE_PROFILES = {
    "large-trees": SweLikeShape(),
    "calibrated": SweLikeShape(tasks=180, paths_median=7.0, horizon_median=17_000.0, horizon_sigma=0.8, fork_beta=(20.0, 0.6)),
}
DEFAULT_SWE_LIKE_PROFILE = "large-trees"


@attrs.define
class _Path:
    """One trajectory under construction: token pieces (shared arrays) and its turn layout."""

    pieces: list[np.ndarray]
    piece_roles: list[int]
    turn_starts: list[int]
    turn_ends: list[int]
    turn_roles: list[int]
    length: int
    prompt_end: int

    def prefix(self, position: int) -> "_Path":
        """The first ``position`` tokens; a turn cut in the middle keeps its role."""
        pieces, roles, offset = [], [], 0
        for piece, role in zip(self.pieces, self.piece_roles):
            if offset >= position:
                break
            take = min(len(piece), position - offset)
            pieces.append(piece if take == len(piece) else piece[:take])
            roles.append(role)
            offset += take
        count = bisect.bisect_left(self.turn_starts, position)
        ends = self.turn_ends[:count]
        if ends:
            ends[-1] = min(ends[-1], position)
        return _Path(pieces, roles, self.turn_starts[:count], ends, self.turn_roles[:count], position, self.prompt_end)

    def token_at(self, position: int) -> int:
        offset = 0
        for piece in self.pieces:
            if position < offset + len(piece):
                return int(piece[position - offset])
            offset += len(piece)
        raise IndexError(position)


class _SweLikeGenerator:
    def __init__(self, rng: np.random.Generator, scale: float, vocab_size: int, shape: SweLikeShape):
        self.rng, self.scale, self.vocab_size, self.shape = rng, scale, vocab_size, shape

    def _scaled(self, bounds: tuple[int, int]) -> tuple[int, int]:
        low = max(1, round(bounds[0] * self.scale))
        return low, max(low, round(bounds[1] * self.scale))

    def _uniform_length(self, bounds: tuple[int, int]) -> int:
        low, high = self._scaled(bounds)
        return int(self.rng.integers(low, high + 1))

    def _turn_length(self, role: int) -> int:
        shape = self.shape
        bounds, median = (
            (shape.assistant_turn_tokens, shape.assistant_turn_median)
            if role == ASSISTANT
            else (shape.tool_turn_tokens, shape.tool_turn_median)
        )
        low, high = self._scaled(bounds)
        drawn = median * self.scale * self.rng.lognormal(0.0, 0.8)
        return int(np.clip(round(drawn), low, high))

    def _tokens(self, count: int) -> np.ndarray:
        return self.rng.integers(0, self.vocab_size, size=count, dtype=np.int64)

    def _append_turn(self, path: _Path, role: int, length: int, avoid_first: int | None = None) -> None:
        length = min(length, MAX_TRAJECTORY_TOKENS - path.length)
        if length <= 0:
            return
        tokens = self._tokens(length)
        if avoid_first is not None and tokens[0] == avoid_first:
            tokens[0] = (avoid_first + 1) % self.vocab_size
        path.pieces.append(tokens)
        path.piece_roles.append(role)
        path.turn_starts.append(path.length)
        path.turn_ends.append(path.length + length)
        path.turn_roles.append(role)
        path.length += length

    def _extend_turn(self, path: _Path, extra: int, avoid_first: int | None) -> None:
        """Continue the last (cut) turn with ``extra`` fresh tokens of its role."""
        extra = min(extra, MAX_TRAJECTORY_TOKENS - path.length)
        if extra <= 0:
            return
        tokens = self._tokens(extra)
        if avoid_first is not None and tokens[0] == avoid_first:
            tokens[0] = (avoid_first + 1) % self.vocab_size
        path.pieces.append(tokens)
        path.piece_roles.append(path.turn_roles[-1])
        path.turn_ends[-1] += extra
        path.length += extra

    def _continue(self, path: _Path, target: float, next_role: int, avoid_first: int | None = None) -> None:
        """Alternate assistant and tool turns until ``target`` tokens, ending on an assistant turn."""
        role = next_role
        while path.length < MAX_TRAJECTORY_TOKENS:
            if path.length >= target and path.turn_roles[-1] == ASSISTANT:
                break
            self._append_turn(path, role, self._turn_length(role), avoid_first)
            avoid_first = None
            role = TOOL if role == ASSISTANT else ASSISTANT

    def _fork(self, parent: _Path) -> tuple[_Path, int, int | None]:
        """Pick a fork position on ``parent``; return the shared prefix, the role that continues, the token to avoid."""
        rng, shape = self.rng, self.shape
        span = parent.length - parent.prompt_end
        position = parent.prompt_end + int(rng.beta(*shape.fork_beta) * span)
        position = min(position, parent.length)
        kind = rng.random()
        turn = bisect.bisect_right(parent.turn_starts, position) - 1
        if kind < 0.03:
            position = parent.length  # the parent becomes a prefix of the child
        elif kind < 0.50:
            # a turn boundary: the start of the assistant turn at or after ``position``
            while turn < len(parent.turn_roles) and parent.turn_roles[turn] != ASSISTANT:
                turn += 1
            position = parent.turn_starts[turn] if turn < len(parent.turn_roles) else parent.length
        elif kind < 0.92:
            # inside an assistant turn: resampling diverges mid-turn
            while turn < len(parent.turn_roles) and parent.turn_roles[turn] != ASSISTANT:
                turn += 1
            if turn < len(parent.turn_roles):
                start, end = parent.turn_starts[turn], parent.turn_ends[turn]
                if not start < position < end:
                    position = int(rng.integers(start + 1, end)) if end - start > 1 else start
            else:
                position = parent.length
        # otherwise anywhere, tool output included (a nondeterministic environment)
        position = max(position, parent.prompt_end)
        child = parent.prefix(position)
        avoid = parent.token_at(position) if position < parent.length else None
        if position == parent.length:
            return child, TOOL, avoid
        turn = bisect.bisect_right(parent.turn_starts, position) - 1
        role = parent.turn_roles[turn]
        if parent.turn_starts[turn] == position:
            return child, role, avoid
        # Mid-turn: the cut turn continues with fresh tokens before the next turn starts.
        done = position - parent.turn_starts[turn]
        extra = max(1, self._turn_length(role) - done) if role != PROMPT else 1
        self._extend_turn(child, extra, avoid)
        return child, TOOL if role == ASSISTANT else ASSISTANT, None

    def task(self, system_prompt: np.ndarray) -> list[_Path]:
        rng, shape = self.rng, self.shape
        task_prompt = self._tokens(self._uniform_length(shape.task_prompt_tokens))
        prompt = [system_prompt, task_prompt]
        prompt_end = len(system_prompt) + len(task_prompt)
        root = _Path(prompt, [PROMPT, PROMPT], [0], [prompt_end], [PROMPT], prompt_end, prompt_end)
        low, high = self._scaled(shape.horizon_tokens)
        horizon = float(np.clip(shape.horizon_median * self.scale * rng.lognormal(0.0, shape.horizon_sigma), low, high))
        count = int(np.clip(round(rng.lognormal(np.log(shape.paths_median), shape.paths_sigma)), 1, shape.max_paths))
        paths: list[_Path] = []
        first = root.prefix(prompt_end)
        self._continue(first, horizon * rng.uniform(0.7, 1.3), ASSISTANT)
        paths.append(first)
        while len(paths) < count:
            parent = paths[int(rng.integers(len(paths)))]
            child, next_role, avoid = self._fork(parent)
            remaining = max(parent.length - child.length, 1)
            target = child.length + remaining * rng.lognormal(-shape.continuation_sigma**2 / 2, shape.continuation_sigma)
            self._continue(child, min(target, high * 1.05), next_role, avoid)
            paths.append(child)
        return paths


def _path_arrays(path: _Path) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.concatenate(path.pieces)
    lengths = np.fromiter((len(p) for p in path.pieces), dtype=np.int64, count=len(path.pieces))
    roles = np.asarray(path.piece_roles)
    loss_mask = np.repeat((roles == ASSISTANT).astype(np.float32), lengths)
    return tokens, loss_mask


def swe_like_step(seed: int = 0, scale: float = 1.0, vocab_size: int = 151_000,
                  profile: str = DEFAULT_SWE_LIKE_PROFILE, tasks: int | None = None) -> RolloutBatch:
    """One synthetic agentic-SWE training step (at scale 1: about 1.5k paths, 40M tokens, 5.7x trie sharing).

    ``scale`` multiplies every token length and the number of tasks (at least one task);
    ``profile`` names a shape of :data:`SWE_LIKE_PROFILES`; ``tasks`` sets the number of task
    trees instead (token lengths still follow ``scale``).
    Fields: ``loss_mask`` (1 on assistant tokens), ``group_id`` (the task), ``reward``
    (0/1), ``advantage`` (GRPO within the task's group).
    """
    if not scale > 0:
        raise RolloutInputError(f"swe-like: option 'scale' must be positive, got {scale!r}")
    _check_vocabulary("swe-like", vocab_size)
    if profile not in SWE_LIKE_PROFILES:
        raise RolloutInputError(f"swe-like: unknown profile {profile!r}; profiles: {', '.join(SWE_LIKE_PROFILES)}")
    if tasks is not None and not 1 <= tasks <= _MAX_GENERATED_TRAJECTORIES:
        raise RolloutInputError(f"swe-like: option 'tasks' must be in 1..{_MAX_GENERATED_TRAJECTORIES:,}, got {tasks!r}")
    shape = SWE_LIKE_PROFILES[profile]
    count = max(1, round(shape.tasks * scale)) if tasks is None else tasks
    paths = min(shape.max_paths, shape.paths_median * np.exp(shape.paths_sigma**2 / 2))
    length = min(MAX_TRAJECTORY_TOKENS, shape.horizon_median * scale * np.exp(shape.horizon_sigma**2 / 2))
    _check_generated_tokens("swe-like", count * paths * length)
    rng = np.random.default_rng(seed)
    generator = _SweLikeGenerator(rng, scale, vocab_size, shape)
    system_prompt = generator._tokens(generator._uniform_length(shape.system_prompt_tokens))
    tasks = max(1, round(shape.tasks * scale)) if tasks is None else tasks
    tokens, masks, groups, rewards = [], [], [], []
    for task in range(tasks):
        success = rng.beta(1.2, 1.8)
        for path in generator.task(system_prompt):
            path_tokens, loss_mask = _path_arrays(path)
            tokens.append(adopt(path_tokens))  # fresh arrays: the batch takes them without a copy
            masks.append(adopt(loss_mask))
            groups.append(task)
            rewards.append(float(rng.random() < success))
    groups_array = np.asarray(groups, dtype=np.int64)
    rewards_array = np.asarray(rewards, dtype=np.float64)
    batch = RolloutBatch(
        tokens=tuple(tokens),
        token_fields={"loss_mask": tuple(masks)},
        trajectory_fields={
            "group_id": groups_array,
            "reward": rewards_array,
            "advantage": grpo_advantages(rewards_array, groups_array),
        },
        tree_ids=groups_array.copy(),
    )
    batch.validate()
    logger.debug("swe-like step seed=%d scale=%g profile=%s: %d tasks, %d paths, %d tokens",
                 seed, scale, profile, tasks, len(batch), batch.semantic_tokens)
    return batch


def swe_like_steps(count: int = 10, scale: float = 1.0, profile: str = DEFAULT_SWE_LIKE_PROFILE) -> list[RolloutBatch]:
    """``count`` SWE-like steps, for seeds 1..count."""
    return [swe_like_step(seed=seed, scale=scale, profile=profile) for seed in range(1, count + 1)]


# ----------------------------------------------------------------------------- planner shapes
#
# The batch shapes a planner must handle in bounded time besides agentic trees (benchmarks/bench_planner.py
# --shapes): no sharing at all, one very wide tree, GRPO groups. Prompt tokens carry loss mask 0, generated
# tokens 1; every trajectory gets a 0/1 reward and a GRPO advantage within its group.

#: generators refuse more trajectories, or more expected raw tokens, than this (a typo such as groups=2560000 or
#: scale=100 should fail at once, not exhaust the machine's memory)
_MAX_GENERATED_TRAJECTORIES = 1_000_000
MAX_GENERATED_TOKENS = 1_000_000_000


def _check_generated_tokens(preset: str, expected: float) -> None:
    if expected > MAX_GENERATED_TOKENS:
        raise RolloutInputError(
            f"{preset}: these options generate about {expected:,.0f} tokens, more than the {MAX_GENERATED_TOKENS:,} "
            "a generated batch may hold; lower the scale or the counts"
        )


def _check_count(preset: str, name: str, value: int, low: int = 1, high: int = _MAX_GENERATED_TRAJECTORIES) -> None:
    if not low <= value <= high:
        raise RolloutInputError(f"{preset}: {name} must be in {low:,}..{high:,}, got {value!r}")


def _check_vocabulary(preset: str, vocab_size: int) -> None:
    if not 2 <= vocab_size <= MAX_TOKEN_ID + 1:
        raise RolloutInputError(f"{preset}: option 'vocab_size' must be at least 2 and at most {MAX_TOKEN_ID + 1:,}, got {vocab_size!r}")


def _prompted_batch(rng: np.random.Generator, prompts: list[np.ndarray], responses: list[tuple[int, np.ndarray]]) -> RolloutBatch:
    """Trajectories ``prompts[p] + response`` for (p, response) pairs; tree and group = p."""
    tokens, masks = [], []
    for prompt_index, response in responses:
        prompt = prompts[prompt_index]
        tokens.append(adopt(np.concatenate([prompt, response])))
        masks.append(adopt(np.concatenate([np.zeros(len(prompt), np.float32), np.ones(len(response), np.float32)])))
    groups = np.array([p for p, _ in responses], dtype=np.int64)
    rewards = (rng.random(len(responses)) < 0.5).astype(np.float64)
    return RolloutBatch(tokens=tuple(tokens), token_fields={"loss_mask": tuple(masks)},
                        trajectory_fields={"group_id": groups, "reward": rewards, "advantage": grpo_advantages(rewards, groups)},
                        tree_ids=groups.copy())


def no_sharing_step(trajectories: int = 1500, min_tokens: int = 1000, max_tokens: int = 5133, seed: int = 0,
                    vocab_size: int = 151_000) -> RolloutBatch:
    """``trajectories`` unrelated single-turn trajectories (distinct first tokens: no shared prefix at all),
    lengths uniform in ``[min_tokens, max_tokens]`` (by default 4.6M tokens for 1,500)."""
    _check_count("no-sharing", "option 'trajectories'", trajectories)
    _check_vocabulary("no-sharing", vocab_size)
    if not 1 <= min_tokens <= max_tokens <= MAX_TRAJECTORY_TOKENS:
        raise RolloutInputError(f"no-sharing: need 1 <= min_tokens <= max_tokens <= {MAX_TRAJECTORY_TOKENS}, got {min_tokens}, {max_tokens}")
    if trajectories > vocab_size:
        raise RolloutInputError(f"no-sharing: {trajectories} distinct first tokens need vocab_size >= {trajectories}")
    _check_generated_tokens("no-sharing", trajectories * (min_tokens + max_tokens) / 2)
    rng = np.random.default_rng(seed)
    firsts = rng.permutation(vocab_size)[:trajectories]
    lengths = rng.integers(min_tokens, max_tokens + 1, size=trajectories)
    prompts = [np.array([first], dtype=np.int64) for first in firsts]
    responses = [(i, rng.integers(0, vocab_size, size=int(length) - 1, dtype=np.int64)) for i, length in enumerate(lengths)]
    return _prompted_batch(rng, prompts, responses)


def wide_tree_step(leaves: int = 2000, prompt_tokens: int = 2000, min_tokens: int = 100, max_tokens: int = 3000,
                   seed: int = 0, vocab_size: int = 151_000) -> RolloutBatch:
    """One very wide rollout tree: ``leaves`` responses (lengths uniform in ``[min_tokens, max_tokens]``) forking
    from one ``prompt_tokens``-token prompt."""
    _check_count("wide-tree", "option 'leaves'", leaves)
    _check_vocabulary("wide-tree", vocab_size)
    if not 1 <= prompt_tokens or not 1 <= min_tokens <= max_tokens or prompt_tokens + max_tokens > MAX_TRAJECTORY_TOKENS:
        raise RolloutInputError(f"wide-tree: need prompt and response lengths >= 1 with prompt + max_tokens <= {MAX_TRAJECTORY_TOKENS}")
    _check_generated_tokens("wide-tree", leaves * (prompt_tokens + (min_tokens + max_tokens) / 2))
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab_size, size=prompt_tokens, dtype=np.int64)
    lengths = rng.integers(min_tokens, max_tokens + 1, size=leaves)
    return _prompted_batch(rng, [prompt], [(0, rng.integers(0, vocab_size, size=int(n), dtype=np.int64)) for n in lengths])


def grpo_step(groups: int = 256, group_size: int = 16, min_prompt: int = 200, max_prompt: int = 3000,
              min_tokens: int = 100, max_tokens: int = 8000, seed: int = 0, vocab_size: int = 151_000) -> RolloutBatch:
    """GRPO groups: ``groups`` prompts (lengths uniform in ``[min_prompt, max_prompt]``), each answered
    ``group_size`` times (lengths uniform in ``[min_tokens, max_tokens]``); by default 4,096 trajectories, 23M tokens."""
    _check_count("grpo", "option 'groups'", groups)
    _check_count("grpo", "option 'group_size'", group_size)
    _check_count("grpo", "groups x group_size (the trajectories)", groups * group_size)
    _check_vocabulary("grpo", vocab_size)
    if not 1 <= min_prompt <= max_prompt or not 1 <= min_tokens <= max_tokens or max_prompt + max_tokens > MAX_TRAJECTORY_TOKENS:
        raise RolloutInputError(f"grpo: need lengths >= 1 with max_prompt + max_tokens <= {MAX_TRAJECTORY_TOKENS}")
    _check_generated_tokens("grpo", groups * group_size * (min_prompt + max_prompt + min_tokens + max_tokens) / 2)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab_size, size=int(n), dtype=np.int64) for n in rng.integers(min_prompt, max_prompt + 1, size=groups)]
    lengths = rng.integers(min_tokens, max_tokens + 1, size=groups * group_size)
    responses = [(i // group_size, rng.integers(0, vocab_size, size=int(n), dtype=np.int64)) for i, n in enumerate(lengths)]
    return _prompted_batch(rng, prompts, responses)


def trees_near_compression(batch: RolloutBatch, budget: int, target: float, capacity: int) -> RolloutBatch:
    """Whole rollout trees of ``batch``, at most ``budget`` raw tokens, whose joint sharing is close to ``target``.

    Sharing is raw tokens over compact-trie tokens of the chosen trajectories together (trees
    also share the system prompt). Trees whose own compact form exceeds ``capacity`` are left
    out: the planner would split them and repeat their shared prefix, a different experiment.
    Greedy: each step adds the tree that fits the budget and brings the joint sharing closest
    to ``target`` (ties by generation order); it stops when no tree fits. The subset keeps
    generation order. Raises :class:`RolloutInputError` when no tree qualifies.
    """
    from harts.passes.prefix_compress import build_compact_trie

    if not target >= 1.0:
        raise RolloutInputError(f"trees_near_compression: 'target' must be at least 1, got {target!r}")
    tree_ids = np.asarray(batch.tree_ids)
    lengths = batch.lengths

    def sharing(indices: np.ndarray) -> float:
        return int(lengths[indices].sum()) / build_compact_trie(tuple(batch.tokens[i] for i in indices)).compact_tokens

    candidates: dict[int, np.ndarray] = {}
    for position, tree in enumerate(dict.fromkeys(tree_ids.tolist())):
        members = np.flatnonzero(tree_ids == tree)
        compact = build_compact_trie(tuple(batch.tokens[i] for i in members)).compact_tokens
        if compact <= capacity and int(lengths[members].sum()) <= budget:
            candidates[position] = members
    if not candidates:
        raise RolloutInputError(
            f"trees_near_compression: no rollout tree has a compact size within capacity {capacity} "
            f"and at most {budget} raw tokens"
        )
    chosen: dict[int, np.ndarray] = {}
    total = 0
    def distance_if_added(position: int) -> tuple[float, int]:
        joint = np.concatenate([*chosen.values(), candidates[position]])
        return abs(sharing(joint) - target), position

    while True:
        fitting = [p for p, members in candidates.items() if total + int(lengths[members].sum()) <= budget]
        if not fitting:
            break
        best = min(fitting, key=distance_if_added)
        chosen[best] = candidates.pop(best)
        total += int(lengths[chosen[best]].sum())
    indices = np.concatenate([chosen[p] for p in sorted(chosen)])
    logger.info("trees_near_compression: %d tree(s), %d trajectories, %d raw tokens, sharing %.3f (target %.3f)",
                len(chosen), len(indices), total, sharing(indices), target)
    return batch.subset(indices.tolist())


def trie_compression(batch: RolloutBatch) -> float:
    """Raw tokens over the compact trie's tokens: the sharing of the whole batch, before any capacity split."""
    from harts.passes.prefix_compress import build_compact_trie

    return batch.semantic_tokens / build_compact_trie(batch.tokens).compact_tokens


def _unused_ids(taken: set[int], count: int, vocab_size: int) -> list[int]:
    """``count`` token ids outside ``taken``, counted down from the top of the vocabulary."""
    ids = [v for v in range(vocab_size - 1, max(-1, vocab_size - 2 - count - len(taken)), -1) if v not in taken]
    return ids[:count]


def _diverged(tokens: np.ndarray, position: int, value: int) -> np.ndarray:
    changed = np.array(tokens, copy=True)
    changed[position] = value
    return changed


def with_compression(batch: RolloutBatch, target: float, *, vocab_size: int = 151_000, seed: int = 0,
                     measure: Callable[[RolloutBatch], float] | None = None) -> RolloutBatch:
    """``batch`` with its sharing lowered to ``target`` (1.0: no shared prefix at all), everything else kept.

    Trajectories, their lengths and order, every field and the raw token count stay; what changes is how
    far trajectories share prefixes. In a seeded random order, trajectories are isolated one after another
    (their first token becomes one no other trajectory starts with, and each gets a tree of its own), and
    the last one isolated only from a position on, so the result lands within one token of the target.
    Isolating more never raises sharing, so both steps are binary searches. ``measure`` is the
    compression to aim at (default :func:`trie_compression`; a benchmark can pass the planned compression
    of its capacity instead, which splits large trees). Raises :class:`RolloutInputError` for a target
    below 1 or above the batch's own compression (sharing is only lowered) and for more trajectories
    than ``vocab_size`` leaves distinct first tokens for.
    """
    measure = trie_compression if measure is None else measure
    if not target >= 1.0:
        raise RolloutInputError(f"with_compression: 'target' must be at least 1, got {target!r}")
    _check_vocabulary("with_compression", vocab_size)
    count = len(batch)
    base = measure(batch)
    if target > base * (1 + 1e-9):
        raise RolloutInputError(f"with_compression: the batch's compression is {base:.3f}, below the target {target}; "
                                "sharing can only be lowered")
    order = np.random.default_rng(seed).permutation(count).tolist()
    tree_ids = np.asarray(batch.tree_ids if batch.tree_ids is not None else np.zeros(count, dtype=np.int64), dtype=np.int64)
    fresh_tree = int(tree_ids.max()) + 1 if count else 0

    # isolated first tokens: ids no trajectory starts with, one per trajectory
    firsts = _unused_ids({int(t[0]) for t in batch.tokens}, count, vocab_size)
    if len(firsts) < count:
        raise RolloutInputError(f"with_compression: vocab_size {vocab_size} leaves too few unused first tokens for {count} trajectories")

    def isolated(whole: int, partial_at: int | None = None) -> RolloutBatch:
        tokens, trees = list(batch.tokens), tree_ids.copy()
        for number, trajectory in enumerate(order[:whole]):
            tokens[trajectory] = _diverged(tokens[trajectory], 0, firsts[number])
            trees[trajectory] = fresh_tree + number
        if partial_at is not None:
            # a token no other trajectory has at that position makes every longer prefix its own
            partial = order[whole]
            taken = {int(t[partial_at]) for other, t in enumerate(tokens) if other != partial and len(t) > partial_at}
            tokens[partial] = _diverged(tokens[partial], partial_at, _unused_ids(taken, 1, vocab_size)[0])
        return RolloutBatch(tokens=tuple(tokens), token_fields=batch.token_fields,
                            trajectory_fields=batch.trajectory_fields, tree_ids=trees)

    # the most whole isolations that keep the compression at or above the target
    low, high = 0, count
    while low < high:
        middle = (low + high + 1) // 2
        if measure(isolated(middle)) >= target:
            low = middle
        else:
            high = middle - 1
    best = isolated(low)
    if low < count:
        # then the one trajectory isolated from a position on: diverging later shares more
        first, last = 0, len(batch.tokens[order[low]]) - 1
        while first < last:
            middle = (first + last) // 2
            if measure(isolated(low, middle)) >= target:
                last = middle
            else:
                first = middle + 1
        candidates = [best, isolated(low, first)] + ([isolated(low, first - 1)] if first > 0 else [])
        best = min(candidates, key=lambda candidate: abs(measure(candidate) - target))
    logger.info("with_compression: %d of %d trajectories isolated, compression %.3f (target %.3f, batch %.3f)",
                low, count, measure(best), target, base)
    return best


# ----------------------------------------------------------------------------- demo

_DEMO_VOCAB = 1000
_DEMO_SYSTEM_PROMPT = 40


class _DemoTree:
    """Trajectories of one demo tree grown by forking: tokens, loss mask and rollout log-probs."""

    def __init__(self, rng: np.random.Generator, prompt: np.ndarray):
        self.rng = rng
        self.prompt = prompt
        self.tokens: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.logprobs: list[np.ndarray] = []

    def _fresh(self, count: int, first_role: int, avoid_first: int | None) -> tuple[np.ndarray, np.ndarray]:
        tokens = self.rng.integers(10, _DEMO_VOCAB, size=count, dtype=np.int64)
        if avoid_first is not None and count and tokens[0] == avoid_first:
            tokens[0] = 10 + (avoid_first - 9) % (_DEMO_VOCAB - 10)
        roles = np.empty(count, dtype=np.float32)
        position, role = 0, first_role
        while position < count:
            turn = int(self.rng.integers(8, 40))
            roles[position:position + turn] = 1.0 if role == ASSISTANT else 0.0
            position += turn
            role = TOOL if role == ASSISTANT else ASSISTANT
        return tokens, roles

    def _add(self, tokens: np.ndarray, mask: np.ndarray) -> int:
        # Rollout log-probs exist for sampled (assistant) tokens; multiples of 1/256 keep the JSON short.
        steps = self.rng.integers(0, 1024, size=len(tokens))
        logprobs = np.where(mask > 0, -steps / 256.0, 0.0).astype(np.float32)
        self.tokens.append(tokens)
        self.masks.append(mask)
        self.logprobs.append(logprobs)
        return len(self.tokens) - 1

    def trunk(self, length: int) -> int:
        tokens, mask = self._fresh(length - len(self.prompt), ASSISTANT, None)
        return self._add(np.concatenate([self.prompt, tokens]), np.concatenate([np.zeros(len(self.prompt), np.float32), mask]))

    def fork(self, parent: int, position: int, length: int) -> int:
        """A trajectory sharing ``parent``'s first ``position`` tokens (and their metadata), then fresh tokens."""
        base_tokens, base_mask, base_logprobs = self.tokens[parent], self.masks[parent], self.logprobs[parent]
        avoid = int(base_tokens[position]) if position < len(base_tokens) else None
        role = ASSISTANT if position < len(base_mask) and base_mask[position] > 0 else TOOL
        tokens, mask = self._fresh(length - position, role, avoid)
        index = self._add(np.concatenate([base_tokens[:position], tokens]), np.concatenate([base_mask[:position], mask]))
        self.logprobs[index][:position] = base_logprobs[:position]
        return index

    def prefix(self, parent: int, length: int) -> int:
        """A trajectory that is the first ``length`` tokens of ``parent``."""
        index = self._add(self.tokens[parent][:length].copy(), self.masks[parent][:length].copy())
        self.logprobs[index][:] = self.logprobs[parent][:length]
        return index


def make_demo_batch(seed: int = 0) -> RolloutBatch:
    """The bundled demo: 6 small trees, 39 trajectories, forks around chunk boundaries of 64.

    Trees 0 and 1 share a system prompt. Tree 0 forks at 63, 64, 65, 127 and 128 and holds a
    trajectory that is a prefix of another; tree 1 forks five times inside the chunk
    [64, 128); tree 2 has a trajectory whose loss mask differs on a shared prefix; tree 3 is
    a single path; tree 4 is a deep chain of nested forks; tree 5 fans out at 191, 192, 193.
    """
    rng = np.random.default_rng(seed)
    system_prompt = rng.integers(10, _DEMO_VOCAB, size=_DEMO_SYSTEM_PROMPT, dtype=np.int64)
    used_first_tokens = {int(system_prompt[0])}

    def own_prompt(length: int) -> np.ndarray:
        while True:
            prompt = rng.integers(10, _DEMO_VOCAB, size=length, dtype=np.int64)
            if int(prompt[0]) not in used_first_tokens:
                used_first_tokens.add(int(prompt[0]))
                return prompt

    trees: list[_DemoTree] = []

    tree = _DemoTree(rng, np.concatenate([system_prompt, rng.integers(10, _DEMO_VOCAB, size=10, dtype=np.int64)]))
    trunk = tree.trunk(300)
    for position, length in ((63, 180), (64, 240), (65, 400), (127, 260), (128, 150)):
        tree.fork(trunk, position, length)
    tree.prefix(trunk, 200)
    trees.append(tree)

    tree = _DemoTree(rng, np.concatenate([system_prompt, rng.integers(10, _DEMO_VOCAB, size=30, dtype=np.int64)]))
    trunk = tree.trunk(260)
    branches = [tree.fork(trunk, position, length) for position, length in ((70, 200), (75, 320), (81, 140), (90, 220), (101, 310))]
    tree.fork(branches[1], 250, 330)
    trees.append(tree)

    tree = _DemoTree(rng, own_prompt(50))
    trunk = tree.trunk(220)
    first = tree.fork(trunk, 100, 240)
    tree.fork(first, 180, 290)
    tree.fork(trunk, 150, 200)
    second = tree.fork(first, 130, 230)
    tree.fork(second, 190, 210)
    # The same tokens as ``first`` but one assistant turn left out of the loss: shared
    # positions with different metadata.
    masked = tree.prefix(first, 240)
    tree.masks[masked][110:140] = 0.0
    trees.append(tree)

    tree = _DemoTree(rng, own_prompt(20))
    tree.trunk(45)
    trees.append(tree)

    tree = _DemoTree(rng, own_prompt(30))
    chain = tree.trunk(120)
    for position, length in ((60, 170), (130, 230), (190, 290), (255, 350), (320, 390)):
        chain = tree.fork(chain, position, length)
    trees.append(tree)

    tree = _DemoTree(rng, own_prompt(40))
    trunk = tree.trunk(280)
    for position, length in ((191, 260), *(((192, 200 + 15 * k) for k in range(8))), (193, 300)):
        tree.fork(trunk, position, length)
    trees.append(tree)

    tokens, masks, logprobs, tree_ids = [], [], [], []
    for tree_index, tree in enumerate(trees):
        tokens.extend(tree.tokens)
        masks.extend(tree.masks)
        logprobs.extend(tree.logprobs)
        tree_ids.extend([tree_index] * len(tree.tokens))
    tree_ids_array = np.asarray(tree_ids, dtype=np.int64)
    rewards = (rng.random(len(tokens)) < 0.5).astype(np.float64)
    batch = RolloutBatch(
        tokens=tuple(tokens),
        token_fields={"loss_mask": tuple(masks), "rollout_logprobs": tuple(logprobs)},
        trajectory_fields={
            "group_id": tree_ids_array.copy(),
            "reward": rewards,
            "advantage": grpo_advantages(rewards, tree_ids_array),
        },
        tree_ids=tree_ids_array,
    )
    batch.validate()
    return batch


#: The bundled demo node table, in the package ``harts.data``.
DEMO_RESOURCE = "demo_rollouts.jsonl"


def write_demo_data(path: str | os.PathLike[str] | None = None) -> Path:
    """Regenerate the bundled demo node table from ``make_demo_batch()``."""
    target = Path(path) if path is not None else Path(__file__).resolve().parents[1] / "data" / DEMO_RESOURCE
    make_demo_batch().write(target)
    return target


__all__ = [
    "MAX_TRAJECTORY_TOKENS",
    "DEMO_RESOURCE",
    "SweLikeShape",
    "grpo_advantages",
    "grpo_step",
    "no_sharing_step",
    "wide_tree_step",
    "make_demo_batch",
    "swe_like_step",
    "swe_like_steps",
]
