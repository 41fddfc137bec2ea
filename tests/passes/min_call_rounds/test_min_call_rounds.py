"""Algorithm 1 on plain segment trees, held to brute force over every choice and schedule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.errors import PlanningError
from harts.passes.min_call_rounds import mandatory_replay, plan_forest
from tests.helpers import (
    brute_force_rounds_exhaustive,
    brute_force_rounds_fixpoint,
    schedule_is_legal,
    segment_trees,
    sequence_states,
    tree_children,
)


def check_plan_is_legal(parents, starts, ends, chunk, plan) -> None:
    """The recovered plan, judged by the brute-force model rather than by the planner's rules."""
    children = tree_children(parents)
    chains = [list(s.segments) for s in plan.sequences]
    assert sorted(v for c in chains for v in c) == list(range(len(parents))), "every segment runs exactly once"
    for chain in chains:
        assert parents[chain[0]] < 0 or plan.direct_child[parents[chain[0]]] != chain[0]
        for upper, lower in zip(chain, chain[1:]):
            assert parents[lower] == upper and plan.direct_child[upper] == lower
        assert not children[chain[-1]], "a sequence runs down to a leaf"
    described = [sequence_states(parents, starts, ends, chunk, c) for c in chains]
    for sequence, (replay_start, _, _) in zip(plan.sequences, described):
        assert sequence.replay_start == replay_start, "replay starts at the fixed anchor b_v of the parent"
        assert 0 <= starts[sequence.segments[0]] - replay_start < chunk
    launch = [s.round for s in plan.sequences]
    assert schedule_is_legal([d[1] for d in described], [d[2] for d in described], launch)
    # Exports are exactly the states later sequences start from, at their producer.
    for number, sequence in enumerate(plan.sequences):
        if sequence.state is not None:
            producer = plan.sequences[sequence.state.sequence]
            assert producer.round < sequence.round
            assert sequence.state.position in plan.exports[sequence.state.sequence]
            assert sequence.state.position == sequence.replay_start
            if sequence.same_round:
                assert sequence.round == plan.sequences[sequence.launched_by].round
                assert sequence.state == plan.sequences[sequence.launched_by].state
        else:
            assert sequence.replay_start == 0


@settings(max_examples=150, deadline=None)
@given(segment_trees())
def test_recurrence_matches_exhaustive_brute_force(tree):
    parents, starts, ends, chunk = tree
    plan = plan_forest(parents, starts, ends, chunk)
    best, replay_totals = brute_force_rounds_exhaustive(parents, starts, ends, chunk)
    assert plan.t_pre[0] == best
    assert plan.num_rounds == best
    check_plan_is_legal(parents, starts, ends, chunk, plan)
    # Eq. 15 holds for every choice of direct continuation, not just the chosen one.
    assert replay_totals == {mandatory_replay(parents, ends, chunk)}
    assert plan.replay_tokens == mandatory_replay(parents, ends, chunk)


@settings(max_examples=60, deadline=None)
@given(segment_trees(max_segments=11, chunk_sizes=(2, 3, 4)))
def test_recurrence_matches_earliest_schedule_brute_force(tree):
    parents, starts, ends, chunk = tree
    children = tree_children(parents)
    choices = 1
    for kids in children:
        choices *= max(1, len(kids))
    if choices > 3000:
        return
    plan = plan_forest(parents, starts, ends, chunk)
    assert plan.t_pre[0] == brute_force_rounds_fixpoint(parents, starts, ends, chunk)
    check_plan_is_legal(parents, starts, ends, chunk, plan)


@settings(max_examples=60, deadline=None)
@given(st.lists(segment_trees(max_segments=5, chunk_sizes=(3,)), min_size=1, max_size=3))
def test_forest_rounds_are_the_max_over_trees(trees):
    chunk = 3
    parents, starts, ends, per_tree = [], [], [], []
    for tree_parents, tree_starts, tree_ends, _ in trees:
        offset = len(parents)
        parents += [p + offset if p >= 0 else -1 for p in tree_parents]
        starts += tree_starts
        ends += tree_ends
        per_tree.append(plan_forest(tree_parents, tree_starts, tree_ends, chunk).num_rounds)
    plan = plan_forest(parents, starts, ends, chunk)
    assert plan.num_rounds == max(per_tree)
    check_plan_is_legal(parents, starts, ends, chunk, plan)


def test_figure_2_needs_two_calls():
    b = 64
    # v0=[0,B-1) forks into v1=[B-1,B+1) and v2; v1 forks at B+1 into v3 and v4.
    parents = [-1, 0, 0, 1, 1]
    starts = [0, b - 1, b - 1, b + 1, b + 1]
    ends = [b - 1, b + 1, b + 20, b + 30, b + 5]
    plan = plan_forest(parents, starts, ends, b)
    assert plan.num_rounds == 2
    by_head = {s.segments[0]: s for s in plan.sequences}
    assert by_head[0].segments == (0, 1, 3) and by_head[0].round == 0
    assert by_head[2].round == 0 and by_head[2].replay_start == 0 and by_head[2].state is None  # replays [0, B-1) from S_0
    assert by_head[4].round == 1 and by_head[4].replay_start == b  # replays [B, B+1) from S_B
    assert plan.exports[plan.sequences.index(by_head[0])] == (b,)
    assert plan.replay_tokens == (b - 1) + 1


@pytest.mark.parametrize(
    ("fork", "side_round", "replay_start", "replay"),
    [(-1, 0, 0, -1), (0, 1, 1, 0), (1, 1, 1, 1)],
    ids=["B-1", "B", "B+1"],
)
@pytest.mark.parametrize("chunk", [4, 64])
def test_three_boundary_cases(chunk, fork, side_round, replay_start, replay):
    fork_at = chunk + fork
    parents, starts, ends = [-1, 0, 0], [0, fork_at, fork_at], [fork_at, fork_at + 3, fork_at + 7]
    plan = plan_forest(parents, starts, ends, chunk)
    side = next(s for s in plan.sequences if s.segments[0] == 2)
    assert side.round == side_round
    assert side.replay_start == replay_start * chunk
    assert fork_at - side.replay_start == (chunk - 1 if replay < 0 else replay)
    assert plan.num_rounds == side_round + 1
    if side_round == 0:
        assert side.state is None and side.same_round  # the zero state S_0 was ready before the call
    else:
        assert side.state.position == chunk and not side.same_round


def test_nested_forks_inside_one_chunk_share_the_ready_anchor():
    chunk = 16
    # Three forks at 3, 5 and 6, all before the first boundary: one call suffices.
    parents = [-1, 0, 0, 1, 1, 3, 3]
    starts = [0, 3, 3, 5, 5, 6, 6]
    ends = [3, 5, 30, 6, 40, 20, 9]
    plan = plan_forest(parents, starts, ends, chunk)
    assert plan.num_rounds == 1
    assert all(s.replay_start == 0 and s.state is None for s in plan.sequences)
    assert plan.replay_tokens == 3 + 5 + 6


def test_boundary_forks_along_a_spine_need_two_rounds():
    chunk = 4
    depth = 6
    # Spine segments of exactly B tokens, each but the last with a one-token side leaf: every
    # side leaf waits for S_b of its fork, yet all of them fit in the second round.
    parents, starts, ends = [], [], []
    previous_spine = -1
    for level in range(depth):
        spine = len(parents)
        parents.append(previous_spine)
        starts.append(level * chunk)
        ends.append((level + 1) * chunk)
        if level + 1 < depth:
            parents.append(spine)
            starts.append((level + 1) * chunk)
            ends.append((level + 1) * chunk + 1)
        previous_spine = spine
    plan = plan_forest(parents, starts, ends, chunk)
    assert plan.num_rounds == 2
    assert plan.t_pre[0] == brute_force_rounds_fixpoint(parents, starts, ends, chunk)
    spine_sequence = next(s for s in plan.sequences if s.segments[0] == 0)
    # Up to the last fork the spine must continue (a side spine would wait a round and then
    # fork again); at the last fork both children are leaves and either may continue.
    assert spine_sequence.segments[:depth - 1] == tuple(range(0, 2 * (depth - 1), 2))
    assert plan.exports[plan.sequences.index(spine_sequence)] == tuple(chunk * k for k in range(1, depth))
    assert plan.replay_tokens == 0


def test_plan_handles_very_deep_trees_without_recursion():
    chunk = 8
    count = 5000
    parents = [-1] + list(range(count - 1))
    starts = list(range(0, 3 * count, 3))
    ends = [s + 3 for s in starts]
    plan = plan_forest(parents, starts, ends, chunk)
    assert plan.num_rounds == 1 and len(plan.sequences) == 1


@pytest.mark.parametrize(
    ("parents", "starts", "ends", "message"),
    [
        ([-1, 0], [0, 4], [3, 6], "starts at 4 but its parent 0 ends at 3"),
        ([-1, 5], [0, 3], [3, 6], "parent 5"),
        ([-1], [2], [3], "must start at position 0"),
        ([-1, 0], [0, 3], [3, 3], "empty"),
    ],
)
def test_bad_forest_is_reported(parents, starts, ends, message):
    with pytest.raises(PlanningError, match=message):
        plan_forest(parents, starts, ends, 4)


@pytest.mark.parametrize("levels", [2, 3, 4])
def test_binary_tree_of_boundary_crossing_forks_needs_a_round_per_level(levels):
    chunk = 4
    count = 2 ** levels - 1
    parents = [-1] + [(v - 1) // 2 for v in range(1, count)]
    depth = [0] * count
    for v in range(1, count):
        depth[v] = depth[parents[v]] + 1
    starts = [chunk * d for d in depth]
    ends = [s + chunk for s in starts]  # e_v = a_v + B: every side branch waits for the call
    plan = plan_forest(parents, starts, ends, chunk)
    assert plan.num_rounds == levels
    assert plan.t_pre[0] == brute_force_rounds_fixpoint(parents, starts, ends, chunk)
    # Internal segments one token shorter: the root fork falls at B-1, its side branch starts
    # from the zero state in the first call, and a round is saved.
    short = [chunk - 1 if v < count // 2 else chunk for v in range(count)]
    starts_short, ends_short = [0] * count, [0] * count
    for v in range(count):
        starts_short[v] = 0 if v == 0 else ends_short[parents[v]]
        ends_short[v] = starts_short[v] + short[v]
    early = plan_forest(parents, starts_short, ends_short, chunk)
    assert early.num_rounds == brute_force_rounds_fixpoint(parents, starts_short, ends_short, chunk)
    assert early.num_rounds < levels
