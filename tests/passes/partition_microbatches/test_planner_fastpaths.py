"""The planner's fast paths return exactly what the straightforward versions return.

The all-pairs LCP table, the lockstep greedy that reads it, the incremental merge/split
chains and the scalar boundary refinement are pure speed-ups: each is held here to a
reference (the range-minimum path kept in the package, or the previous array version
copied below) on hypothesis batches.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from harts.errors import PlanningError
from harts.planner import PlannerOptions, RankSpace, choose_microbatches, ranks
from harts.planner import contiguous, greedy
from tests.helpers import compressed_index, forests


# --------------------------------------------------------------------------- references (the previous versions)
def reference_refine_boundaries(space, capacity, starts, window=8, sweeps=2):
    starts = starts.copy()
    n = space.size
    for _ in range(sweeps):
        moved = False
        for i in range(1, len(starts)):
            first = int(starts[i - 1])
            last = int(starts[i + 1]) - 1 if i + 1 < len(starts) else n - 1
            current = int(starts[i])
            cuts = np.arange(max(first + 1, current - window), min(last, current + window) + 1)
            left = space.interval_works(np.full_like(cuts, first), cuts - 1)
            right = space.interval_works(cuts, np.full_like(cuts, last))
            feasible = (left <= capacity) & (right <= capacity)
            cuts, left, right = cuts[feasible], left[feasible], right[feasible]
            pick = np.lexsort((np.abs(cuts - current), np.maximum(left, right), left + right))[0]
            here = np.flatnonzero(cuts == current)[0]
            if (left[pick] + right[pick], max(left[pick], right[pick])) < (left[here] + right[here], max(left[here], right[here])):
                starts[i] = cuts[pick]
                moved = True
        if not moved:
            break
    return starts


def reference_evolve_partitions(space, capacity, natural, targets, recut="fallback"):
    result = {}
    k_natural = len(natural)
    if k_natural in targets:
        result[k_natural] = natural.copy()
    below = sorted((k for k in targets if k < k_natural), reverse=True)
    above = sorted(k for k in targets if k > k_natural)
    n = space.size
    starts = natural.copy()
    for target in below:
        while len(starts) > target:
            ends = contiguous.partition_ends(starts, n)
            merged = space.interval_works(starts[:-1], ends[1:])
            saving = space.lcp[starts[1:]]
            feasible = np.flatnonzero(merged <= capacity)
            wanted = recut == "always" or (recut == "fallback" and feasible.size == 0)
            best_recut = contiguous._best_recut(space, capacity, starts) if wanted else None
            if best_recut is not None and (feasible.size == 0 or best_recut[2] > saving[feasible].max()):
                first, cut, _ = best_recut
                starts = np.concatenate([starts[: first + 1], [cut], starts[first + 3 :]])
                continue
            if feasible.size == 0:
                break
            pick = feasible[np.lexsort((feasible, merged[feasible], -saving[feasible]))[0]]
            starts = np.delete(starts, pick + 1)
        if len(starts) != target:
            break
        result[target] = starts.copy()
    if above:
        bounds = [(int(a), int(b)) for a, b in zip(natural, contiguous.partition_ends(natural, n))]
        for target in above:
            while len(bounds) < target:
                options = []
                for position, interval in enumerate(bounds):
                    if interval[0] != interval[1]:
                        cut, cost = contiguous._best_split(space, *interval)
                        options.append((cost, -space.interval_work(*interval), position, cut))
                if not options:
                    break
                _, _, position, cut = min(options)
                first, last = bounds[position]
                bounds[position : position + 1] = [(first, cut - 1), (cut, last)]
            if len(bounds) != target:
                break
            result[target] = np.array([first for first, _ in bounds], dtype=np.int64)
    return result


# --------------------------------------------------------------------------- the pair table
@settings(max_examples=40, deadline=None)
@given(forests())
def test_pair_table_holds_every_pairwise_lcp(trajectories):
    index = compressed_index(trajectories)
    space = RankSpace(index)
    table = space.pair_table()
    n = index.size
    assert table.shape == (n + 1, n + 1)
    for i in range(n):
        for j in range(n):
            assert table[i, j] == index.lcp_ranks(i, j)
    assert not table[n].any() and not table[:, n].any()
    lower = np.array([-1] + list(range(n - 1)))
    upper = np.array([0] + list(range(1, n)))
    assert space.lcp_between(lower, upper).tolist() == space.range_min(lower + 1, upper).tolist()
    ranks_ = np.arange(n)
    assert space.neighbour_shared(ranks_, ranks_ - 1, ranks_ + 1).tolist() == np.maximum(
        space.range_min(ranks_, ranks_), space.range_min(ranks_ + 1, ranks_ + 1)).tolist()


@settings(max_examples=40, deadline=None)
@given(forests(), st.lists(st.integers(0, 9), max_size=5))
def test_pair_table_by_runs_equals_row_by_row(trajectories, prompt):
    index = compressed_index([prompt + trajectory for trajectory in trajectories])
    by_runs = RankSpace(index).pair_table()
    with pytest.MonkeyPatch.context() as patch:  # every run too long: the cumulative minima fill it
        patch.setattr(ranks, "RUN_PAIRS_PER_TRAJECTORY", -1)
        row_by_row = RankSpace(index).pair_table()
    assert by_runs.dtype == row_by_row.dtype and np.array_equal(by_runs, row_by_row)


def test_pair_table_is_skipped_above_the_memory_budget(monkeypatch):
    monkeypatch.setattr(ranks, "PAIR_TABLE_BYTES", 0)
    index = compressed_index([[1, 2, 3], [1, 2, 4], [5]])
    space = RankSpace(index)
    assert space.pair_table() is None
    assert space.lcp_between(np.array([0, -1]), np.array([1, 3])).tolist() == [2, 0]


# --------------------------------------------------------------------------- greedy
@settings(max_examples=40, deadline=None)
@given(forests(max_trajectories=16), st.integers(4, 60), st.sampled_from([1, 2, 16]))
def test_greedy_with_the_pair_table_equals_range_queries(trajectories, capacity, columns):
    index = compressed_index(trajectories)
    space = RankSpace(index)
    assume(index.lengths.max() <= capacity)
    lanes = [(greedy.processing_order(space, order), policy) for order in greedy.ORDERS for policy in greedy.POLICIES]
    fast = greedy._place_group_pairs(space, capacity, lanes, columns, space.pair_table())
    slow = greedy._place_group_ranges(space, capacity, lanes, columns)
    for a, b in zip(fast, slow):
        assert a.used == b.used
        assert np.array_equal(a.labels, b.labels)
        assert np.array_equal(a.work[: a.used], b.work[: b.used])
        assert np.array_equal(a.before[: a.used], b.before[: b.used])
        assert np.array_equal(a.after[: a.used], b.after[: b.used])
    for dp_size in (1, 2, 3):
        got = [(p.source, p.count, p.total_work, p.labels.tolist()) for p in greedy.greedy_plans(space, capacity, dp_size)]
        packings = greedy._place_group_ranges(space, capacity, lanes, columns)
        want = []
        for (order, policy), packing in zip([(o, p) for o in greedy.ORDERS for p in greedy.POLICIES], packings):
            packing = greedy.align_to_dp(greedy.eliminate_small(packing), dp_size)
            if packing is not None:
                want.append((f"greedy/{order}/{policy}", packing.live_count, packing.total_work(), packing.canonical_labels().tolist()))
        assert got == want


@settings(max_examples=25, deadline=None)
@given(forests(max_trajectories=14), st.sampled_from([8, 16, 40, 200]), st.integers(1, 4), st.sampled_from([3, 512]))
def test_plans_do_not_depend_on_the_pair_table(trajectories, capacity, dp_size, exact_threshold):
    index = compressed_index(trajectories)
    assume(index.lengths.max() <= capacity and index.size >= dp_size)
    options = PlannerOptions(capacity=capacity, dp_size=dp_size, exact_threshold=exact_threshold)
    try:
        with_table = choose_microbatches(index, options)
    except PlanningError:
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ranks, "PAIR_TABLE_BYTES", 0)
        without = choose_microbatches(index, options)
    assert with_table.microbatches == without.microbatches
    assert with_table.candidates == without.candidates


# --------------------------------------------------------------------------- contiguous chains and refinement
@settings(max_examples=60, deadline=None)
@given(forests(max_trajectories=16), st.integers(4, 80), st.data())
def test_incremental_chains_equal_the_array_version(trajectories, capacity, data):
    index = compressed_index(trajectories)
    space = RankSpace(index)
    assume(index.lengths.max() <= capacity)
    natural = contiguous.natural_partition(space, capacity)
    targets = sorted(set(data.draw(st.lists(st.integers(1, index.size), min_size=1, max_size=6))))
    for mode in contiguous.RECUT_MODES:
        got = contiguous.evolve_partitions(space, capacity, natural, targets, mode)
        want = reference_evolve_partitions(space, capacity, natural, targets, mode)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].tolist() == want[k].tolist()


@settings(max_examples=60, deadline=None)
@given(forests(max_trajectories=16), st.integers(4, 80), st.sampled_from([1, 3, 8]), st.data())
def test_scalar_boundary_refinement_equals_the_array_version(trajectories, capacity, window, data):
    index = compressed_index(trajectories)
    space = RankSpace(index)
    assume(index.lengths.max() <= capacity)
    natural = contiguous.natural_partition(space, capacity)
    starts = data.draw(st.sampled_from([natural] + list(contiguous.evolve_partitions(
        space, capacity, natural, list(range(1, index.size + 1)), "always").values())))
    got = contiguous.refine_boundaries(space, capacity, starts, window, 2)
    assert got.tolist() == reference_refine_boundaries(space, capacity, starts, window, 2).tolist()


# --------------------------------------------------------------------------- sharing ranges (subtree exchange)
@settings(max_examples=60, deadline=None)
@given(forests(max_trajectories=16), st.lists(st.integers(0, 9), max_size=5), st.data())
def test_sharing_range_is_the_farthest_rank_sharing_more(trajectories, prompt, data):
    from harts.planner.exchange import _sharing_range

    index = compressed_index([prompt + trajectory for trajectory in trajectories])  # a prompt: a floor above 0
    space = RankSpace(index)
    n = index.size
    ranks_ = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=12)), dtype=np.int64)
    threshold = np.array(data.draw(st.lists(st.integers(-1, 45), min_size=ranks_.size, max_size=ranks_.size)), dtype=np.int64)
    for upward in (False, True):
        got = _sharing_range(space, ranks_, threshold, upward)
        for rank, bound, end in zip(ranks_.tolist(), threshold.tolist(), got.tolist()):
            side = range(rank + 1, n) if upward else range(rank - 1, -1, -1)
            want = rank
            for other in side:  # LCPs only fall with rank distance: the range ends at the first that shares too little
                if index.lcp_ranks(min(rank, other), max(rank, other)) <= bound:
                    break
                want = other
            assert end == want
