"""The greedy by prefix runs (harts.planner.run_greedy) places exactly as the lockstep greedy does.

The lockstep (``greedy._place_group_pairs`` with the pair table, ``greedy._place_group_ranges``
with range-minimum queries) is the reference; batches get an optional common prompt so the
floor LCP is positive as well as zero, and lanes get random orders besides the planner's four.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from harts.planner import RankSpace, greedy, ranks, run_greedy
from tests.helpers import compressed_index, forests


@st.composite
def prompted_forests(draw):
    """A forest whose trajectories all start with one common prompt (possibly empty)."""
    prompt = draw(st.lists(st.integers(0, 9), max_size=6))
    return [prompt + trajectory for trajectory in draw(forests(max_trajectories=16))]


def reference_plans(space, capacity, dp_size):
    """greedy_plans over the lockstep's packings."""
    names = [(order, policy) for order in greedy.ORDERS for policy in greedy.POLICIES]
    lanes = [(greedy.processing_order(space, order), policy) for order, policy in names]
    plans = []
    for (order, policy), packing in zip(names, greedy._place_group_ranges(space, capacity, lanes, 4)):
        packing = greedy.align_to_dp(greedy.eliminate_small(packing), dp_size)
        if packing is not None:
            plans.append(greedy.GreedyPlan(packing.canonical_labels(), packing.live_count, packing.total_work(),
                                           f"greedy/{order}/{policy}"))
    return plans


def plan_summary(plan):
    return None if plan is None else (plan.source, plan.count, plan.total_work, plan.labels.tolist())


@settings(max_examples=60, deadline=None)
@given(prompted_forests())
def test_runs_split_where_the_floor_lcp_is(trajectories):
    index = compressed_index(trajectories)
    floor, firsts, lasts = RankSpace(index).prefix_runs()
    n = index.size
    for i in range(n):
        assert firsts[i] <= i <= lasts[i]
        for j in range(i + 1, n):
            if firsts[i] == firsts[j]:
                assert index.lcp_ranks(i, j) > floor
            else:
                assert index.lcp_ranks(i, j) == floor


@settings(max_examples=80, deadline=None)
@given(prompted_forests(), st.integers(4, 70), st.data())
def test_run_greedy_places_as_the_lockstep(trajectories, capacity, data):
    index = compressed_index(trajectories)
    space = RankSpace(index)
    assume(index.lengths.max() <= capacity)
    lanes = [(greedy.processing_order(space, order), policy) for order in greedy.ORDERS for policy in greedy.POLICIES]
    order = np.array(data.draw(st.permutations(list(range(index.size)))), dtype=np.int64)
    lanes += [(order, policy) for policy in greedy.POLICIES]
    want = greedy._place_group_pairs(space, capacity, lanes, 2, space.pair_table())
    assert all(np.array_equal(a.labels, b.labels) for a, b in zip(want, greedy._place_group_ranges(space, capacity, lanes, 2)))
    got = run_greedy.place_lanes(space, capacity, lanes)
    with pytest.MonkeyPatch.context() as patch:  # LCPs from running minima instead of the pair table
        patch.setattr(ranks, "PAIR_TABLE_BYTES", 0)
        without_table = run_greedy.place_lanes(RankSpace(index), capacity, lanes)
    for packing, (labels, works), (labels_alone, works_alone) in zip(want, got, without_table):
        assert labels.tolist() == packing.labels.tolist() == labels_alone.tolist()
        assert works.tolist() == packing.work[: packing.used].tolist() == works_alone.tolist()
    for packing, rebuilt in zip(want, greedy._place_group_runs(space, capacity, lanes)):
        assert rebuilt.used == packing.used
        assert np.array_equal(rebuilt.before[: packing.used], packing.before[: packing.used])
        assert np.array_equal(rebuilt.after[: packing.used], packing.after[: packing.used])


@settings(max_examples=80, deadline=None)
@given(prompted_forests(), st.integers(4, 70), st.integers(1, 4))
def test_greedy_choice_is_the_preselected_plan(trajectories, capacity, dp_size):
    index = compressed_index(trajectories)
    space = RankSpace(index)
    assume(index.lengths.max() <= capacity)
    reference = reference_plans(space, capacity, dp_size)
    assert [plan_summary(plan) for plan in greedy.greedy_plans(space, capacity, dp_size)] == [plan_summary(p) for p in reference]
    want = plan_summary(greedy.preselect(reference))
    assert plan_summary(greedy.greedy_choice(space, capacity, dp_size)) == want
    with pytest.MonkeyPatch.context() as patch:  # every run too long: the lockstep finishes every lane
        patch.setattr(run_greedy, "RUN_LIMIT", 0)
        assert not run_greedy.runs_fit(space)
        assert plan_summary(greedy.greedy_choice(space, capacity, dp_size)) == want


def test_without_sharing_beyond_the_prompt_both_policies_agree():
    # every trajectory shares exactly the prompt with every other: one placement serves both policies
    rng = np.random.default_rng(5)
    trajectories = [[7, 7, 7, 10 + i] + [int(t) for t in rng.integers(0, 5, rng.integers(1, 9))] for i in range(30)]
    space = RankSpace(compressed_index(trajectories))
    floor, firsts, lasts = space.prefix_runs()
    assert floor == 3 and np.array_equal(firsts, lasts)
    lanes = [(greedy.processing_order(space, "longest"), policy) for policy in greedy.POLICIES]
    (best_fit, _), (max_shared, _) = run_greedy.place_lanes(space, 24, lanes)
    assert best_fit.tolist() == max_shared.tolist()
    assert [p.labels.tolist() for p in greedy._place_group_pairs(space, 24, lanes, 2, space.pair_table())] == [
        best_fit.tolist(), max_shared.tolist()]


@settings(max_examples=40, deadline=None)
@given(prompted_forests(), st.integers(4, 70))
def test_placement_stops_only_past_the_half_full_limit(trajectories, capacity):
    index = compressed_index(trajectories)
    space = RankSpace(index)
    assume(index.lengths.max() <= capacity)
    order = greedy.processing_order(space, "longest")
    labels, works = run_greedy.RunPlacer(space, capacity).place(order, "best-fit")
    half_full = int(np.count_nonzero(2 * works > capacity))
    for limit in range(half_full + 2):
        placed = run_greedy.RunPlacer(space, capacity).place(order, "best-fit", limit)
        if limit < half_full:
            assert placed is None
        else:
            assert placed[0].tolist() == labels.tolist() and placed[1].tolist() == works.tolist()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_neighbour_tables_by_column_equal_the_cumulative_ones(data):
    columns = data.draw(st.integers(1, 12))
    labels = np.array(data.draw(st.lists(st.integers(0, columns - 1), min_size=1, max_size=40)), dtype=np.int64)
    for dtype in (np.int16, np.int32):
        want_before, want_after = greedy._neighbour_tables_from_labels(labels, columns, dtype)
        got_before, got_after = greedy.neighbour_tables_by_column(labels, columns, dtype)
        assert got_before.dtype == want_before.dtype and got_before.shape == want_before.shape == (columns, labels.size)
        assert np.array_equal(got_before, want_before) and np.array_equal(got_after, want_after)


@settings(max_examples=60, deadline=None)
@given(prompted_forests(), st.integers(4, 70))
def test_whole_run_pieces_are_placed_as_by_eq_10(trajectories, capacity):
    from harts.planner import contiguous

    index = compressed_index(trajectories)
    assume(index.lengths.max() <= capacity)
    n = index.size
    for partition in ("natural", "units"):
        for policy in greedy.POLICIES:
            space = RankSpace(index)
            starts = (contiguous.natural_partition if partition == "natural" else contiguous.unit_partition)(space, capacity)
            got = greedy.place_pieces(space, capacity, starts, policy)
            with pytest.MonkeyPatch.context() as patch:  # no piece is a whole run: Eq. 10 through the LCPs everywhere
                patch.setattr(space, "prefix_runs", lambda: (0, np.arange(n), np.arange(n) - 1))
                want = greedy.place_pieces(space, capacity, starts, policy)
            assert got.used == want.used and got.labels.tolist() == want.labels.tolist()
            assert got.work[: got.used].tolist() == want.work[: want.used].tolist()
