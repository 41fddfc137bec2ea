"""The critical path of the rounds (serial chunk steps of the state scans): never longer than the
paper's first-fit rule, same rounds and replay, held to brute force over every continuation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import harts
from harts.passes import PassContext
from harts.passes.min_call_rounds import MinCallRounds, call_counts, first_fit, forest_children, plan_forest, recover
from harts.passes.round_critical_path import continuation_ends, round_chunk_steps, round_critical_path
from harts.passes.segment import SegmentPass
from harts.ir.verify import verify
from harts.ir.verify_rounds import mandatory_replay
from tests.helpers import (
    all_choices,
    brute_force_critical_path,
    chunk_steps_of,
    contract_schedule,
    forked_trees,
    scheduled_module,
    schedule_is_legal,
    segment_trees,
    sequence_states,
    tree_children,
)


def first_fit_steps(parents, starts, ends, chunk):
    """Per-round chunk steps of the paper's rule, from its recovered sequences."""
    children, roots, top_down = forest_children(parents, starts, ends)
    t_pre, t_in = call_counts(children, top_down, starts, ends, chunk)
    _, building = recover(children, roots, starts, ends, chunk, t_pre, first_fit(t_pre, t_in))
    steps = chunk_steps_of([(b.segments, b.round, b.replay_start) for b in building], ends, chunk)
    assert plan_forest(parents, starts, ends, chunk, shorten_critical_path=False).round_chunk_steps == steps
    return steps


def plan_schedule(plan):
    return [(list(s.segments), s.round, s.replay_start) for s in plan.sequences]


def check_plan_follows_the_contract(parents, starts, ends, chunk, plan):
    """The plan is exactly what the runtime contract makes of its continuations, and every state is ready."""
    children = tree_children(parents)
    choice = {v: plan.direct_child[v] for v in range(len(parents)) if children[v]}
    expected = sorted(contract_schedule(parents, starts, ends, chunk, choice))
    assert sorted(plan_schedule(plan)) == expected
    described = [sequence_states(parents, starts, ends, chunk, list(s.segments)) for s in plan.sequences]
    assert schedule_is_legal([d[1] for d in described], [d[2] for d in described], [s.round for s in plan.sequences])
    assert plan.round_chunk_steps == chunk_steps_of(expected, ends, chunk)


def chunk_boundary_trees():
    """Segment trees whose forks sit just before, on and after chunk boundaries."""
    return st.one_of(segment_trees(max_segments=9), segment_trees(max_segments=9, chunk_sizes=(2, 3)))


@settings(max_examples=200, deadline=None)
@given(chunk_boundary_trees())
def test_never_longer_than_first_fit_and_as_short_as_brute_force_allows(tree):
    parents, starts, ends, chunk = tree
    plan = plan_forest(parents, starts, ends, chunk, shorten_critical_path=True)
    check_plan_follows_the_contract(parents, starts, ends, chunk, plan)
    old = first_fit_steps(parents, starts, ends, chunk)
    assert plan.num_rounds == len(old), "the fewest calls are kept"
    assert plan.replay_tokens == mandatory_replay(parents, ends, chunk), "R (Eq. 15) is kept"
    assert plan.critical_path <= sum(old)
    if len(all_choices(tree_children(parents))) <= 2000:
        fewest_rounds, shortest = brute_force_critical_path(parents, starts, ends, chunk)
        assert plan.num_rounds == fewest_rounds
        assert shortest <= plan.critical_path
    # No plan is shorter than its longest root-to-leaf path in chunks.
    assert plan.critical_path >= max(-(-e // chunk) for e in ends)


@settings(max_examples=60, deadline=None)
@given(st.lists(segment_trees(max_segments=6, chunk_sizes=(3,)), min_size=2, max_size=3))
def test_forests_of_several_trees(trees):
    chunk = 3
    parents, starts, ends = [], [], []
    for tree_parents, tree_starts, tree_ends, _ in trees:
        offset = len(parents)
        parents += [p + offset if p >= 0 else -1 for p in tree_parents]
        starts += tree_starts
        ends += tree_ends
    plan = plan_forest(parents, starts, ends, chunk, shorten_critical_path=True)
    check_plan_follows_the_contract(parents, starts, ends, chunk, plan)
    assert plan.critical_path <= sum(first_fit_steps(parents, starts, ends, chunk))
    assert plan.num_rounds == len(first_fit_steps(parents, starts, ends, chunk))


def test_short_continuation_lets_the_two_long_branches_share_a_round():
    b = 4
    # v0 = [0, 5) crosses S_4, so side branches wait a round; v1 and v3 are long, v2 is short.
    parents, starts, ends = [-1, 0, 0, 0], [0, 5, 5, 5], [5, 40, 6, 38]
    assert first_fit_steps(parents, starts, ends, b) == (10, 9)  # v1 continues; v3 alone in round 1
    plan = plan_forest(parents, starts, ends, b, shorten_critical_path=True)
    assert plan.direct_child[0] == 2
    assert plan.round_chunk_steps == (2, 9) and plan.critical_path == 11
    assert brute_force_critical_path(parents, starts, ends, b) == (2, 11)


def test_ties_keep_the_first_fit_plan():
    b = 64
    parents = [-1, 0, 0, 1, 1]  # Figure 2: both continuations of v1 take 3 chunk steps
    starts = [0, b - 1, b - 1, b + 1, b + 1]
    ends = [b - 1, b + 1, b + 20, b + 30, b + 5]
    plan = plan_forest(parents, starts, ends, b, shorten_critical_path=True)
    assert plan.direct_child == (1, 3, -1, -1, -1)
    assert plan.critical_path == sum(first_fit_steps(parents, starts, ends, b)) == 3


def test_continuation_ends_reports_an_unplannable_cap():
    b = 4
    parents, starts, ends = [-1, 0, 0], [0, 5, 5], [5, 40, 38]
    children, _, top_down = forest_children(parents, starts, ends)
    # Whichever long branch waits for round 1 replays from S_4 and needs 9 chunks there.
    assert continuation_ends(children, top_down, starts, ends, b, [10, 9])[0][0][1] == 10
    assert continuation_ends(children, top_down, starts, ends, b, [10, 8])[0][0][1] == float("inf")


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([2, 4, 8]).flatmap(lambda b: st.tuples(st.just(b), forked_trees(chunk_size=b, max_segments=12, max_trees=3))))
def test_metric_of_microbatches_and_layouts(case):
    chunk, token_lists = case
    batch, module = scheduled_module(token_lists, chunk)
    ctx = PassContext(batch=batch)
    module = MinCallRounds(shorten_critical_path=True).run(SegmentPass().run(module, ctx), ctx)
    verify(module)
    (microbatch,) = module.microbatches
    segments = microbatch.segments
    forest = ([s.parent for s in segments], [s.start for s in segments], [s.end for s in segments])
    assert round_critical_path(microbatch, chunk) == plan_forest(*forest, chunk, shorten_critical_path=True).round_chunk_steps
    # The default keeps the paper's rule; both plans verify and keep the rounds and R.
    plain = MinCallRounds().run(SegmentPass().run(scheduled_module(token_lists, chunk)[1], ctx), ctx)
    verify(plain)
    (plain_microbatch,) = plain.microbatches
    assert round_critical_path(plain_microbatch, chunk) == first_fit_steps(*forest, chunk)
    assert sum(round_critical_path(microbatch, chunk)) <= sum(round_critical_path(plain_microbatch, chunk))
    assert (len(plain_microbatch.rounds), plain_microbatch.replay_tokens) == (len(microbatch.rounds), microbatch.replay_tokens)
    compiled = harts.compile(harts.RolloutBatch.from_trajectories(token_lists), capacity=sum(map(len, token_lists)), chunk_size=chunk)
    for layout in compiled.layouts:
        steps = round_critical_path(layout)
        assert len(steps) == layout.num_rounds and all(step >= 1 for step in steps)


def test_round_chunk_steps_counts_replay_chunks():
    # A sequence replaying [4, 6) and outputting [6, 13) walks chunks [4, 8), [8, 12), [12, 13).
    assert round_chunk_steps([0, 1, 1], [0, 4, 8], [5, 13, 9], 4) == (2, 3)


def test_metric_needs_rounds_and_a_chunk_size():
    batch, module = scheduled_module([[1, 2], [1, 3]], 4)
    module = SegmentPass().run(module, PassContext(batch=batch))
    with pytest.raises(ValueError, match="no rounds"):
        round_critical_path(module.microbatches[0], 4)
    with pytest.raises(TypeError, match="chunk size"):
        round_critical_path(module.microbatches[0])
