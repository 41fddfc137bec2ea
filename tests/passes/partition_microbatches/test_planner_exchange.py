"""Subtree exchange (harts.planner.exchange): exact, only lowers compact work, keeps every guarantee."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.errors import PlanningError
from harts.planner import PlannerOptions, RankSpace, choose_microbatches
from harts.planner import greedy, repair
from harts.planner.exchange import Layout, exchange_subtrees, subtree_runs
from tests.helpers import compressed_index, forests, two_groups, work_of
from tests.helpers import checked_objective, labelled_forests, prepared_case


def brute_force_subtrees(index, labels):
    """Runs of each group's sorted members whose internal LCP exceeds the LCP with the run's neighbours in the
    group (0 at the group's ends); single members included, whole groups excluded; as sorted positions."""
    order = np.lexsort((np.arange(labels.size), labels))
    runs = []
    start = 0
    for group in range(int(labels.max()) + 1):
        members = order[labels[order] == group].tolist()
        size = len(members)
        for i in range(size):
            for j in range(i, size):
                if i == 0 and j == size - 1:
                    continue
                if i == j:
                    runs.append((start + i, start + j))
                    continue
                inside = index.lcp_ranks(members[i], members[j])
                left = index.lcp_ranks(members[i - 1], members[i]) if i > 0 else 0
                right = index.lcp_ranks(members[j], members[j + 1]) if j < size - 1 else 0
                if inside > max(left, right):
                    runs.append((start + i, start + j))
        start += size
    return sorted(runs)


@settings(max_examples=60, deadline=None)
@given(labelled_forests())
def test_subtree_runs_are_the_lcp_intervals_of_each_group(case):
    trajectories, _, labels = case
    index = compressed_index(trajectories)
    space = RankSpace(index)
    layout = Layout(space, labels, int(labels.max()) + 1)
    first, last = subtree_runs(layout)
    found = list(zip(first.tolist(), last.tolist()))
    assert sorted(found) == brute_force_subtrees(index, labels)
    assert found == sorted(found, key=lambda run: (run[0], run[1] - run[0]))  # by group position, then length
    again = subtree_runs(layout)  # the second call reads the per-group cache
    assert np.array_equal(again[0], first) and np.array_equal(again[1], last)


@settings(max_examples=60, deadline=None)
@given(labelled_forests(), st.data())
def test_layout_costs_match_recomputation(case, data):
    """Run savings and insert costs (Eq. 5 / Eq. 10 for runs) equal C recomputed from scratch."""
    trajectories, _, labels = case
    index = compressed_index(trajectories)
    space = RankSpace(index)
    count = int(labels.max()) + 1
    layout = Layout(space, labels, count)
    first, last = subtree_runs(layout)
    if first.size == 0:
        return
    pick = data.draw(st.integers(0, first.size - 1))
    a, b = int(first[pick]), int(last[pick])
    source = int(layout.group_of_position[a])
    run = layout.order[a : b + 1]
    rest = np.setdiff1d(np.flatnonzero(labels == source), run)
    saving, run_work = layout.run_saving(np.array([a]), np.array([b]))
    assert int(saving[0]) == work_of(index, np.flatnonzero(labels == source)) - work_of(index, rest)
    assert int(run_work[0]) == work_of(index, run)
    target = data.draw(st.integers(0, count - 1))
    if target == source:
        return
    cost, fits = layout.insert_cost(np.array([target]), np.array([a]), np.array([b]), run_work, np.array([1]), np.array([0]))
    members = np.flatnonzero(labels == target)
    inside = members[(members > run.min()) & (members < run.max())]
    assert bool(fits[0]) == (inside.size == 0)
    if fits[0]:
        assert int(cost[0]) == work_of(index, np.concatenate([members, run])) - work_of(index, members)


@settings(max_examples=80, deadline=None)
@given(labelled_forests(), st.sampled_from([0, 3, 20, 10_000]), st.sampled_from([1, 8]))
def test_exchange_keeps_guarantees_and_only_lowers_work(case, slack, window):
    index, space, dp_size, labels, count, before, capacity = prepared_case(case, slack)
    exchanged = exchange_subtrees(space, capacity, labels, rounds=16, window=window)
    after = checked_objective(index, labels, exchanged, dp_size, count, capacity)
    if np.array_equal(exchanged, labels):
        assert after == before
    else:
        assert after[0] < before[0]


@settings(max_examples=60, deadline=None)
@given(labelled_forests())
def test_exchange_ends_where_no_subtree_move_to_a_sharing_neighbour_saves(case):
    """At the fixed point no single subtree move to the microbatch of an adjacent rank lowers work (any capacity)."""
    trajectories, dp_size, labels = case
    index = compressed_index(trajectories)
    space = RankSpace(index)
    count = int(labels.max()) + 1
    exchanged = exchange_subtrees(space, 10**9, labels, rounds=200, window=index.size)
    layout = Layout(space, exchanged, count)
    total = space.group_works(exchanged, count).sum()
    for a, b in zip(*subtree_runs(layout)):
        run = layout.order[a : b + 1]
        for neighbour in (run.min() - 1, run.max() + 1):
            if 0 <= neighbour < index.size and exchanged[neighbour] != exchanged[run[0]]:
                trial = exchanged.copy()
                trial[run] = exchanged[neighbour]
                members = np.flatnonzero(trial == exchanged[neighbour])
                between = members[(members > run.min()) & (members < run.max())]
                if between.size == 0:  # the pass proposes only inserts that keep the run contiguous
                    assert space.group_works(trial, count).sum() >= total


def test_a_stranded_subtree_moves_home_where_single_moves_cannot_help():
    # tree A: a 10-token prompt, then a 6-token stem shared by two answers; one tree B.
    # The two stem answers sit with tree B: moving either alone repeats prompt + stem, so
    # sparse repair finds nothing; moving both together saves the prompt and the stem.
    prompt, stem = [7] * 10, [3] * 6
    trajectories = [prompt + [1] * 4, prompt + [2] * 4, prompt + stem + [1], prompt + stem + [2], [9] * 12]
    index = compressed_index(trajectories)
    space = RankSpace(index)
    labels = two_groups(index, [2, 3, 4])
    capacity = 64
    assert np.array_equal(repair.sparse_repair(space, capacity, labels, window=8, iterations=4), labels)
    exchanged = exchange_subtrees(space, capacity, labels)
    groups = {tuple(sorted(index.order[np.flatnonzero(exchanged == g)])) for g in range(2)}
    assert groups == {(0, 1, 2, 3), (4,)}
    assert space.group_works(exchanged, 2).sum() == (10 + 4 + 4 + 6 + 1 + 1) + 12
    assert space.group_works(exchanged, 2).sum() < space.group_works(labels, 2).sum()


def test_a_swap_makes_room_when_the_receiver_is_full():
    # A holds one answer of tree P and an unrelated Y; B holds P's two stem answers and an unrelated Z.
    # Both are full: neither the stem pair nor Y can move alone, but swapping them saves P's prompt.
    prompt, stem = [7] * 10, [3] * 6
    y, z = [9] * 8, [8] * 4
    trajectories = [prompt + [1] * 4, prompt + stem + [1], prompt + stem + [2], y, z]
    index = compressed_index(trajectories)
    space = RankSpace(index)
    rank = index.rank
    labels = np.zeros(5, dtype=np.int64)
    labels[rank[[1, 2, 4]]] = 1
    labels = greedy.canonical_labels(labels)
    works = space.group_works(labels, 2)
    assert sorted(works.tolist()) == [22, 22]
    exchanged = exchange_subtrees(space, 22, labels)
    groups = {tuple(sorted(index.order[np.flatnonzero(exchanged == g)])) for g in range(2)}
    assert groups == {(0, 1, 2), (3, 4)}
    assert sorted(space.group_works(exchanged, 2).tolist()) == [12, 22]


@settings(max_examples=30, deadline=None)
@given(forests(max_trajectories=14), st.sampled_from([16, 40, 200]), st.integers(1, 4), st.booleans())
def test_plan_with_exchange_is_never_worse(trajectories, capacity, dp_size, extended):
    index = compressed_index(trajectories)
    if index.size < dp_size or index.lengths.max() > capacity:
        return
    options = dict(capacity=capacity, dp_size=dp_size, exact_threshold=3, extended=extended)
    try:
        without = choose_microbatches(index, PlannerOptions(**options, exchange=False))
    except PlanningError:  # infeasible inputs are tested in test_planner.py
        return
    with_exchange = choose_microbatches(index, PlannerOptions(**options, exchange=True))
    assert with_exchange.objective <= without.objective
    assert not any("+exchanged" in source for source, _, _ in without.candidates)
    if not extended:  # the paper's candidate set: no exchange
        assert with_exchange.objective == without.objective
        assert not any("+exchanged" in source for source, _, _ in with_exchange.candidates)
    assert sorted(t for group in with_exchange.microbatches for t in group) == list(range(index.size))
    assert max(with_exchange.works) <= capacity


def test_partition_option_switches_exchange_off():
    from harts.rollouts.batch import RolloutBatch
    from harts.passes import PassContext, parse_pipeline
    from harts.passes.lower import lower
    from harts.passes.partition_microbatches import PartitionMicrobatches
    from harts.passes.prefix_compress import PrefixCompress

    prompt, stem = [7] * 10, [3] * 6
    trajectories = [prompt + [1] * 4, prompt + [2] * 4, prompt + stem + [1], prompt + stem + [2], [9] * 12, [9] * 11 + [1]]
    batch = RolloutBatch.from_trajectories(trajectories)
    module = PrefixCompress().run(lower(batch, capacity=30, dp_size=2), PassContext(batch=batch))
    on = PartitionMicrobatches().run(module, PassContext())
    off = PartitionMicrobatches(exchange=False).run(module, PassContext())
    assert PartitionMicrobatches().exchange is True
    assert sum(mb.work for mb in on.microbatches) <= sum(mb.work for mb in off.microbatches)
    (invocation,) = parse_pipeline("partition-microbatches{exchange=false}")
    assert invocation.to_text() == "partition-microbatches{exchange=false}"
