"""``min-call-rounds``: the fewest packed linear-attention calls per microbatch (§3.3, Alg. 1).

Execution model (the runtime's contract). A segment ``v = [s_v, e_v)`` has anchors
``a_v = B*floor(s_v/B)`` and ``b_v = B*floor(e_v/B)``. One input sequence runs a chain of
segments, each the *direct continuation* of the one before. Every other child ``u`` of a
segment ``v`` starts its own sequence from a boundary state and replays up to ``s_u = e_v``:

* if the state at ``a_v`` was ready before the round that runs ``v`` and ``v`` crosses no
  chunk boundary (``e_v < a_v + B``, Eq. 11), then ``b_v == a_v`` and ``u`` starts in the
  *same* round from that ready state, which is exactly the initial state of the sequence
  carrying ``v`` (the anchor of a ready chain never moves), replaying ``[a_v, e_v)``;
* otherwise ``S_{b_v}`` is produced inside the current call: the sequence carrying ``v``
  exports it and ``u`` starts in the *next* round from it, replaying ``[b_v, e_v)``.

Either way the replay is ``e_v mod B`` rows, so the total replay R (Eq. 15) is fixed by the
segment forest; only the round structure depends on the choices made here.

Two call counts per segment (both include the round ``v`` runs in): ``t_pre`` when
``S_{a_v}`` is ready before that round, ``t_in`` when ``v`` entered the round as a direct
continuation whose entry state is produced inside the call (Eq. 12-14). Recovery hands the
root's budget down, choosing as direct continuation the first child that fits its own
budget and leaves every other child within the side-branch budget (the paper's rule).

Critical path. Many plans share that fewest number of rounds (and R); they differ in how
long each round's state scan runs, which is its longest sequence in chunks. The paper's rule
ignores that; with ``shorten_critical_path`` (off by default: it costs a search per
microbatch) :func:`plan_forest` also recovers plans under per-round caps on the longest
sequence (:mod:`harts.passes.round_critical_path`) and keeps the one with the fewest serial
chunk steps, the first-fit plan on ties. Only the choice of continuations changes: every
plan follows the execution model above.

Determinism: children are scanned in segment-id (token) order, so ties go to the earliest
child; rounds are numbered from 0 and the sequences of a round are listed by their first
segment id (preorder), several trees of one microbatch interleaving by that order.

The core works on a plain segment forest (``parents``, ``starts``, ``ends``, ``B``) so it can
be checked against brute force; :class:`MinCallRounds` wraps it for the IR.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from operator import itemgetter

import attrs

from harts.errors import PlanningError
from harts.ir.nodes import InputSequence, Microbatch, Module, Phase, Round, StateRef
from harts.ir.verify_rounds import mandatory_replay  # noqa: F401 - R (Eq. 15) of the forests planned here
from harts.passes.base import Pass, PassContext, option
from harts.passes.registry import builtin_pass
from harts.passes.round_critical_path import (
    continuation_ends,
    round_chunk_steps,
    shortest_round_caps,
    side_branches_fit,
    side_launch,
)

logger = logging.getLogger(__name__)


@attrs.frozen
class StateSource:
    """The boundary state at ``position`` exported by planned sequence ``sequence``."""

    sequence: int
    position: int


@attrs.frozen
class PlannedSequence:
    """One input sequence of a plain-forest plan.

    ``segments``: the direct-continuation chain it runs, root to leaf. ``round``: 0-based.
    Rows ``[replay_start, starts[segments[0]])`` are replay. ``state`` is None for the zero
    state, else the export it starts from (always from an earlier round). ``launched_by``
    is the sequence carrying its parent segment (-1 for a root sequence) and
    ``same_round`` says whether it was launched from that sequence's ready initial state.
    """

    segments: tuple[int, ...]
    round: int
    replay_start: int
    state: StateSource | None
    launched_by: int
    same_round: bool


@attrs.frozen
class ForestPlan:
    """Algorithm 1 on a segment forest: call counts, the chosen continuations and the sequences."""

    t_pre: tuple[int, ...]
    t_in: tuple[int, ...]
    direct_child: tuple[int, ...]  # -1 for a leaf
    sequences: tuple[PlannedSequence, ...]
    exports: tuple[tuple[int, ...], ...]  # per sequence, ascending boundary positions requested from it
    num_rounds: int
    replay_tokens: int
    round_chunk_steps: tuple[int, ...]  # per round, the chunk steps of its longest sequence

    @property
    def critical_path(self) -> int:
        """Serial chunk steps of the plan's state scans: the sum of ``round_chunk_steps``."""
        return sum(self.round_chunk_steps)


def forest_children(parents: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> tuple[list[list[int]], list[int], list[int]]:
    """Children lists (ascending id), roots, and a parents-before-children order; validates the forest."""
    count = len(parents)
    if len(starts) != count or len(ends) != count:
        raise PlanningError(f"segment forest: parents, starts and ends differ in length ({count}, {len(starts)}, {len(ends)})")
    children: list[list[int]] = [[] for _ in range(count)]
    roots: list[int] = []
    for segment, parent in enumerate(parents):
        if starts[segment] >= ends[segment] or starts[segment] < 0:
            raise PlanningError(f"segment {segment}: span [{starts[segment]}, {ends[segment]}) is empty or negative")
        if parent == -1:
            if starts[segment] != 0:
                raise PlanningError(f"segment {segment}: a root segment must start at position 0, starts at {starts[segment]}")
            roots.append(segment)
        elif 0 <= parent < count:
            if starts[segment] != ends[parent]:
                raise PlanningError(
                    f"segment {segment}: starts at {starts[segment]} but its parent {parent} ends at {ends[parent]}"
                )
            children[parent].append(segment)
        else:
            raise PlanningError(f"segment {segment}: parent {parent} is not a segment of the forest")
    top_down: list[int] = []
    stack = list(reversed(roots))
    while stack:
        segment = stack.pop()
        top_down.append(segment)
        stack.extend(reversed(children[segment]))
    if len(top_down) != count:
        raise PlanningError("segment forest: the parent links form a cycle")
    return children, roots, top_down


def call_counts(children: Sequence[Sequence[int]], top_down: Sequence[int], starts: Sequence[int], ends: Sequence[int], chunk_size: int) -> tuple[list[int], list[int]]:
    """``t_pre`` and ``t_in`` of every segment (Eq. 12-14), one bottom-up sweep, linear time."""
    count = len(children)
    t_pre = [1] * count
    t_in = [1] * count
    for segment in reversed(top_down):
        kids = children[segment]
        if not kids:
            continue
        # Top two child t_pre values as a multiset: the best other child of o is the
        # second largest exactly when o holds the largest.
        largest = second = 0
        for child in kids:
            value = t_pre[child]
            if value > largest:
                largest, second = value, largest
            elif value > second:
                second = value
        best = min(max(t_in[child], 1 + (second if t_pre[child] == largest else largest)) for child in kids)
        t_in[segment] = best
        anchor = chunk_size * (starts[segment] // chunk_size)
        t_pre[segment] = largest if ends[segment] < anchor + chunk_size else best
    return t_pre, t_in


@attrs.define
class _Building:
    segments: list[int]
    round: int
    replay_start: int
    state: StateSource | None
    launched_by: int
    same_round: bool
    exports: set[int] = attrs.field(factory=set)


#: ``choose(segment, kids, same, budget, round) -> child``: the direct continuation of ``segment``
#: (-1 when none fits), given whether its side branches launch in the same round.
Chooser = Callable[[int, Sequence[int], bool, int, int], int]


def first_fit(t_pre: Sequence[int], t_in: Sequence[int]) -> Chooser:
    """The paper's rule: the first child that fits its own budget and leaves every other child
    within the side-branch budget."""

    def choose(segment: int, kids: Sequence[int], same: bool, budget: int, round_index: int) -> int:
        side_budget = budget if same else budget - 1
        over_side_budget = sum(1 for child in kids if t_pre[child] > side_budget)
        for child in kids:
            own = t_pre[child] if same else t_in[child]
            if own <= budget and over_side_budget - (t_pre[child] > side_budget) == 0:
                return child
        return -1

    return choose


def shortest_chain(caps: Sequence[int], least: Sequence[Sequence[tuple[float, float]]], starts: Sequence[int],
                   ends: Sequence[int], chunk_size: int) -> Chooser:
    """Within per-round caps: the child whose chain ends earliest among those that leave every other
    child able to meet its round's cap (``least`` from :func:`continuation_ends` under ``caps``)."""

    def choose(segment: int, kids: Sequence[int], same: bool, budget: int, round_index: int) -> int:
        _, side_round, replay_chunk = side_launch(starts[segment], ends[segment], same, round_index, chunk_size)
        fits = side_branches_fit(least, kids, side_round, replay_chunk, caps)
        misfits = fits.count(False)
        chosen, chosen_end = -1, math.inf
        for child, fit in zip(kids, fits):
            if misfits - (not fit) == 0 and least[child][round_index][same] < chosen_end:
                chosen, chosen_end = child, least[child][round_index][same]
        return chosen

    return choose


def recover(children: Sequence[Sequence[int]], roots: Sequence[int], starts: Sequence[int], ends: Sequence[int],
            chunk_size: int, root_budget: Sequence[int], choose: Chooser) -> tuple[list[int], list[_Building]]:
    """Walk every tree top-down, continuing each sequence with ``choose``'s child and launching the
    others (same round from the ready anchor, else next round from ``S_{b_v}``)."""
    direct_child = [-1] * len(children)
    building: list[_Building] = []
    # Task: (segment, anchor ready before the round, round budget, round, sequence).
    tasks: list[tuple[int, bool, int, int, int]] = []
    for root in reversed(roots):
        building.append(_Building([], 0, 0, None, -1, False))
        tasks.append((root, True, root_budget[root], 0, len(building) - 1))
    while tasks:
        segment, ready, budget, round_index, carrier = tasks.pop()
        building[carrier].segments.append(segment)
        kids = children[segment]
        if not kids:
            continue
        anchor = chunk_size * (starts[segment] // chunk_size)
        boundary = chunk_size * (ends[segment] // chunk_size)
        same = ready and ends[segment] < anchor + chunk_size
        chosen = choose(segment, kids, same, budget, round_index)
        if chosen < 0:
            raise PlanningError(f"segment {segment}: no direct continuation fits round budget {budget} (inconsistent call counts)")
        direct_child[segment] = chosen
        carrying = building[carrier]
        for child in reversed(kids):
            if child == chosen:
                continue
            if same:
                if carrying.replay_start != anchor:
                    raise PlanningError(
                        f"segment {segment}: ready anchor {anchor} differs from its sequence's initial state at {carrying.replay_start}"
                    )
                building.append(_Building([], round_index, anchor, carrying.state, carrier, True))
            else:
                carrying.exports.add(boundary)
                building.append(_Building([], round_index + 1, boundary, StateSource(carrier, boundary), carrier, False))
            tasks.append((child, True, budget if same else budget - 1, round_index + (0 if same else 1), len(building) - 1))
        tasks.append((chosen, same, budget, round_index, carrier))
    return direct_child, building


def _steps(building: Sequence[_Building], ends: Sequence[int], chunk_size: int) -> tuple[int, ...]:
    return round_chunk_steps([b.round for b in building], [b.replay_start for b in building], [ends[b.segments[-1]] for b in building], chunk_size)


def plan_forest(parents: Sequence[int], starts: Sequence[int], ends: Sequence[int], chunk_size: int,
                shorten_critical_path: bool = False) -> ForestPlan:
    """Algorithm 1 on a segment forest; trees are solved separately and share round numbers.

    ``parents[v]`` is -1 for a root; children are taken in ascending id order (the fixed
    order recovery scans). Rounds are numbered from 0. By default the first-fit recovery's plan
    (the paper's rule); with ``shorten_critical_path``, among it and the plans meeting
    :func:`shortest_round_caps` (all with the fewest rounds), the one with the fewest serial chunk
    steps (the first-fit plan on ties).
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise PlanningError(f"chunk size must be a positive integer, got {chunk_size!r}")
    children, roots, top_down = forest_children(parents, starts, ends)
    t_pre, t_in = call_counts(children, top_down, starts, ends, chunk_size)
    direct_child, building = recover(children, roots, starts, ends, chunk_size, t_pre, first_fit(t_pre, t_in))
    steps = _steps(building, ends, chunk_size)
    expected_rounds = max((t_pre[root] for root in roots), default=0)
    longest = max((-(-ends[v] // chunk_size) for v in range(len(ends)) if not children[v]), default=0)
    # One round, or already as short as the longest path: nothing to gain.
    if shorten_critical_path and expected_rounds > 1 and sum(steps) > longest:
        for caps in shortest_round_caps(children, roots, top_down, starts, ends, chunk_size, expected_rounds):
            least = continuation_ends(children, top_down, starts, ends, chunk_size, caps)
            chooser = shortest_chain(caps, least, starts, ends, chunk_size)
            candidate = recover(children, roots, starts, ends, chunk_size, t_pre, chooser)
            candidate_steps = _steps(candidate[1], ends, chunk_size)
            if sum(candidate_steps) < sum(steps):
                (direct_child, building), steps = candidate, candidate_steps

    sequences = tuple(
        PlannedSequence(tuple(b.segments), b.round, b.replay_start, b.state, b.launched_by, b.same_round) for b in building
    )
    num_rounds = max((b.round for b in building), default=-1) + 1
    if num_rounds != expected_rounds:
        raise PlanningError(f"recovered plan uses {num_rounds} rounds, the recurrence promised {expected_rounds}")
    return ForestPlan(
        t_pre=tuple(t_pre),
        t_in=tuple(t_in),
        direct_child=tuple(direct_child),
        sequences=sequences,
        exports=tuple(tuple(sorted(b.exports)) for b in building),
        num_rounds=num_rounds,
        replay_tokens=sum(starts[s.segments[0]] - s.replay_start for s in sequences),
        round_chunk_steps=steps,
    )


def round_microbatch(microbatch: Microbatch, chunk_size: int, shorten_critical_path: bool = False) -> Microbatch:
    """Fill ``rounds`` and ``replay_tokens`` of one segmented microbatch."""
    segments = microbatch.segments
    if not segments:
        raise PlanningError(f"microbatch {microbatch.index} has no segments; run the 'segment' pass first")
    parents = [s.parent for s in segments]
    starts = [s.start for s in segments]
    ends = [s.end for s in segments]
    try:
        plan = plan_forest(parents, starts, ends, chunk_size, shorten_critical_path)
    except PlanningError as error:
        raise PlanningError(f"microbatch {microbatch.index}: {error}") from None

    def representative(sequence: PlannedSequence) -> int:
        return segments[sequence.segments[-1]].trajectory

    input_sequences: list[tuple[int, int, InputSequence]] = []
    for number, sequence in enumerate(plan.sequences):
        state_from = None
        if sequence.state is not None:
            producer = plan.sequences[sequence.state.sequence]
            state_from = StateRef(round=producer.round, trajectory=representative(producer), position=sequence.state.position)
        first, last = segments[sequence.segments[0]], segments[sequence.segments[-1]]
        item = InputSequence(
            trajectory=representative(sequence),
            start=first.start,
            end=last.end,
            replay_start=sequence.replay_start,
            state_from=state_from,
            segments=sequence.segments,
            exports=plan.exports[number],
        )
        input_sequences.append((sequence.round, first.id, item))
    # (round, first segment) is unique: every segment runs in one sequence
    input_sequences.sort(key=itemgetter(0, 1))
    by_round: list[list[InputSequence]] = [[] for _ in range(plan.num_rounds)]
    for round_index, _, item in input_sequences:
        by_round[round_index].append(item)
    rounds = tuple(Round(index=r, sequences=tuple(items)) for r, items in enumerate(by_round))
    return attrs.evolve(microbatch, rounds=rounds, replay_tokens=plan.replay_tokens)


@builtin_pass("min-call-rounds")
@attrs.frozen
class MinCallRounds(Pass):
    #: among the plans with the fewest rounds, pick one with few serial chunk steps (round_critical_path)
    # Off by default: the search costs 0.36 s of planning on the SWE-like step and 0.95 s on the agentic
    # shape (bench_planner --shapes, 2-core CPU), against 3.9% and 6.7% fewer serial chunk steps; on the
    # headline plan it takes 204 steps to 175 (RESULTS, tenth session).
    shorten_critical_path: bool = option(False, doc="choose continuations that shorten the rounds' state scans "
                                                    "(costs planning time: a search per microbatch)")

    def run(self, module: Module, ctx: PassContext) -> Module:
        microbatches = tuple(
            round_microbatch(microbatch, module.chunk_size, self.shorten_critical_path) for microbatch in module.microbatches
        )
        logger.debug(
            "min-call-rounds: max %d rounds, %d replay tokens over %d microbatches",
            max((len(m.rounds) for m in microbatches), default=0),
            sum(m.replay_tokens for m in microbatches),
            len(microbatches),
        )
        return attrs.evolve(module, phase=Phase.ROUNDED, microbatches=microbatches)
