"""The microbatch planner's algorithms (§3.2) against brute force and direct recomputation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from harts.errors import PlanningError
from harts.ir.prefix_index import PrefixIndex
from harts.planner import (
    PlannerOptions,
    RankSpace,
    assign_slots,
    choose_microbatches,
    imbalance,
    instantiate,
    objective_of,
    select_best,
    slot_imbalances,
    step_imbalance,
)
from harts.planner import contiguous, greedy, repair
from tests.helpers import compressed_index, forests, two_groups, work_of


def brute_force_lcp(index: PrefixIndex, i: int, j: int) -> int:
    return index.lcp_ranks(i, j)


# --------------------------------------------------------------------------- Eq. 5, 6, 10
@settings(max_examples=40, deadline=None)
@given(forests(), st.data())
def test_rank_space_matches_prefix_index(trajectories, data):
    index = compressed_index(trajectories)
    space = RankSpace(index)
    n = index.size
    a = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=8)))
    b = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=len(a), max_size=len(a))))
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    assert space.interval_works(lo, hi).tolist() == [index.interval_work(int(x), int(y)) for x, y in zip(lo, hi)]
    distinct = lo < hi
    assert space.lcp_between(lo[distinct], hi[distinct]).tolist() == [
        brute_force_lcp(index, int(x), int(y)) for x, y in zip(lo[distinct], hi[distinct])
    ]
    labels = np.array(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)))
    labels = greedy.canonical_labels(labels)
    count = int(labels.max()) + 1
    expected = [work_of(index, np.flatnonzero(labels == g)) for g in range(count)]
    assert space.group_works(labels, count).tolist() == expected


@settings(max_examples=40, deadline=None)
@given(forests(), st.data())
def test_split_cost_is_the_boundary_lcp(trajectories, data):
    """Eq. 6: W(a, t-1) + W(t, b) - W(a, b) = L_t."""
    index = compressed_index(trajectories)
    n = index.size
    assume(n >= 2)
    t = data.draw(st.integers(1, n - 1))
    a = data.draw(st.integers(0, t - 1))
    b = data.draw(st.integers(t, n - 1))
    assert index.interval_work(a, t - 1) + index.interval_work(t, b) - index.interval_work(a, b) == index.lcp[t]


@settings(max_examples=40, deadline=None)
@given(forests(), st.data())
def test_insertion_cost_matches_recomputation(trajectories, data):
    """Eq. 10 with explicit predecessor/successor terms, and the packing's own bookkeeping."""
    index = compressed_index(trajectories)
    space = RankSpace(index)
    n = index.size
    assume(n >= 2)
    members = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n - 1)))
    outside = [r for r in range(n) if r not in members]
    x = data.draw(st.sampled_from(outside))
    before = [r for r in members if r < x]
    after = [r for r in members if r > x]
    delta = int(index.lengths[x])
    if before:
        delta -= index.lcp_ranks(before[-1], x)
    if after:
        delta -= index.lcp_ranks(x, after[0])
    if before and after:
        delta += index.lcp_ranks(before[-1], after[0])
    assert work_of(index, members + [x]) - work_of(index, members) == delta

    packing = _packing_from(space, 10**9, [members, [x]])
    assert int(index.lengths[x] - packing.shared_with_open(x)[0]) == delta
    packing.remove(x)
    packing.insert(x, 0)
    assert packing.work[0] == work_of(index, members + [x])
    assert packing.work[1] == 0 and packing.count[1] == 0


def _packing_from(space: RankSpace, capacity: int, groups) -> greedy.Packing:
    n = space.size
    columns = len(groups)
    packing = greedy.Packing(space, capacity, np.full((columns, n), -1, dtype=np.int32), np.full((columns, n), n, dtype=np.int32),
                             np.zeros(columns, dtype=np.int64), 0, np.full(n, -1, dtype=np.int64))
    for group in groups:
        column = packing.open(group[0])
        for rank in group[1:]:
            packing.insert(rank, column)
    return packing


@settings(max_examples=30, deadline=None)
@given(forests(), st.data())
def test_packing_tables_track_random_moves(trajectories, data):
    index = compressed_index(trajectories)
    space = RankSpace(index)
    n = index.size
    labels = np.array(data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))
    groups = [list(np.flatnonzero(labels == g)) for g in range(3) if np.any(labels == g)]
    packing = _packing_from(space, 10**9, groups)
    for _ in range(data.draw(st.integers(0, 6))):
        rank = data.draw(st.integers(0, n - 1))
        if packing.count[packing.labels[rank]] < 2:
            continue
        packing.remove(rank)
        packing.insert(rank, data.draw(st.integers(0, packing.used - 1)))
    for column in range(packing.used):
        members = np.flatnonzero(packing.labels == column)
        assert packing.work[column] == (work_of(index, members) if members.size else 0)
        for rank in range(n):
            below, above = members[members < rank], members[members > rank]
            assert packing.before[column, rank] == (below[-1] if below.size else -1)
            assert packing.after[column, rank] == (above[0] if above.size else n)


# --------------------------------------------------------------------------- exact DP
def contiguous_partitions(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield (0,) + cuts


@settings(max_examples=40, deadline=None)
@given(forests(max_trajectories=8, max_length=20), st.integers(8, 60))
def test_exact_dp_equals_brute_force(trajectories, capacity):
    index = compressed_index(trajectories)
    space = RankSpace(index)
    n = index.size
    assume(index.lengths.max() <= capacity)
    found = contiguous.exact_partitions(space, capacity, list(range(1, n + 1)))
    for k in range(1, n + 1):
        best = None
        for starts in contiguous_partitions(n, k):
            works = contiguous.partition_works(space, np.array(starts))
            if works.max() <= capacity:
                key = (int(works.sum()), int(works.max()))
                best = key if best is None else min(best, key)
        if best is None:
            assert k not in found
            continue
        starts = found[k]
        works = contiguous.partition_works(space, starts)
        assert len(starts) == k and starts[0] == 0 and np.all(np.diff(starts) > 0)
        assert works.max() <= capacity
        assert (int(works.sum()), int(works.max())) == best


@settings(max_examples=30, deadline=None)
@given(forests(), st.integers(6, 80), st.integers(1, 4))
def test_natural_partition_and_evolution_are_feasible(trajectories, capacity, dp_size):
    index = compressed_index(trajectories)
    space = RankSpace(index)
    n = index.size
    assume(index.lengths.max() <= capacity)
    natural = contiguous.natural_partition(space, capacity)
    assert natural[0] == 0 and np.all(np.diff(natural) > 0)
    assert contiguous.partition_works(space, natural).max() <= capacity
    targets = list(range(1, n + 1))
    evolved = contiguous.evolve_partitions(space, capacity, natural, targets)
    paper = contiguous.evolve_partitions(space, capacity, natural, targets, recut="never")
    # the paper's chain stops where no adjacent pair fits; the fallback goes at least as far
    assert set(paper) <= set(evolved)
    for k in paper:
        if k <= len(natural) and all(kk in paper for kk in range(k, len(natural) + 1)):
            assert np.array_equal(paper[k], evolved[k])
    exact = contiguous.exact_partitions(space, capacity, targets)
    assert np.array_equal(evolved[len(natural)], natural)
    for k, starts in evolved.items():
        works = contiguous.partition_works(space, starts)
        assert len(starts) == k and works.max() <= capacity and np.all(np.diff(starts) > 0)
        assert works.sum() >= contiguous.partition_works(space, exact[k]).sum()
    for k, starts in contiguous.evolve_partitions(space, capacity, natural, targets, recut="always").items():
        works = contiguous.partition_works(space, starts)
        assert len(starts) == k and works.max() <= capacity and np.all(np.diff(starts) > 0)
    # splitting never fails, so every K above K0 is reached
    assert all(k in evolved for k in range(len(natural), n + 1))
    k_values = contiguous.k_range(space.interval_work(0, n - 1), len(natural), n, capacity, dp_size)
    assert all(k % dp_size == 0 for k in k_values) and k_values == sorted(k_values)
    assert k_values[0] * capacity >= space.interval_work(0, n - 1)


@settings(max_examples=40, deadline=None)
@given(forests(max_trajectories=10, max_length=20), st.integers(8, 60), st.data())
def test_recut_is_the_best_three_into_two(trajectories, capacity, data):
    index = compressed_index(trajectories)
    space = RankSpace(index)
    n = index.size
    assume(n >= 3 and index.lengths.max() <= capacity)
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=2, max_size=n - 1)))
    starts = np.array([0] + cuts)
    assume(contiguous.partition_works(space, starts).max() <= capacity)
    works = contiguous.partition_works(space, starts)
    ends = contiguous.partition_ends(starts, n)
    best = None
    for first in range(len(starts) - 2):
        a, b = int(starts[first]), int(ends[first + 2])
        for cut in range(a + 1, b + 1):
            left, right = index.interval_work(a, cut - 1), index.interval_work(cut, b)
            if left <= capacity and right <= capacity:
                saving = int(works[first : first + 3].sum()) - left - right
                best = saving if best is None else max(best, saving)
    found = contiguous._best_recut(space, capacity, starts)
    if best is None:
        assert found is None
        return
    first, cut, saving = found
    assert saving == best
    new = np.concatenate([starts[: first + 1], [cut], starts[first + 3 :]])
    new_works = contiguous.partition_works(space, new)
    assert new_works.max() <= capacity and works.sum() - new_works.sum() == saving


def test_no_feasible_dp_compatible_plan_is_explained():
    # six trajectories of ~20 tokens at capacity 40 fit at most two to a microbatch in one
    # way only; K = 4 has no feasible grouping and K = 8 exceeds the six trajectories
    zeros = [0] * 23
    trajectories = [[100] + zeros, [101] + zeros, [102] + zeros[:22], [102] + zeros[:18] + [1, 0, 0, 0],
                    [102] + zeros[:8] + [1] + zeros[:13], [102, 1] + zeros[:17]]
    index = compressed_index(trajectories)
    with pytest.raises(PlanningError, match=r"no candidate plan satisfies capacity 40 .*dp_size 4: tried K in 4\.\.4 \(K = 8 would exceed the 6 trajectories\)"):
        choose_microbatches(index, PlannerOptions(capacity=40, dp_size=4, exact_threshold=3))
    assert choose_microbatches(index, PlannerOptions(capacity=40, dp_size=3, exact_threshold=3)).objective[0] >= index.size


def test_sampled_k_values_keep_endpoints_and_budget():
    values = list(range(4, 404, 4))
    sampled = contiguous.sampled_k_values(values, 32)
    assert len(sampled) <= 32 and sampled[0] == 4 and sampled[-1] == 400
    assert sampled[:16] == values[:16]
    assert set(sampled) <= set(values)
    assert contiguous.sampled_k_values(values[:10], 32) == values[:10]


# --------------------------------------------------------------------------- refinement
@settings(max_examples=30, deadline=None)
@given(forests(), st.integers(6, 80), st.data())
def test_refinement_keeps_guarantees_and_never_adds_work(trajectories, capacity, data):
    index = compressed_index(trajectories)
    space = RankSpace(index)
    n = index.size
    assume(index.lengths.max() <= capacity)
    natural = contiguous.natural_partition(space, capacity)
    before = contiguous.partition_works(space, natural)
    refined = contiguous.refine_boundaries(space, capacity, natural, window=2)
    after = contiguous.partition_works(space, refined)
    assert len(refined) == len(natural) and after.max() <= capacity and np.all(np.diff(refined) > 0)
    assert (after.sum(), after.max()) <= (before.sum(), before.max())

    # sparse repair on an arbitrary feasible labelling: greedy placement in a random order
    order = np.array(data.draw(st.permutations(range(n))))
    packing = greedy.place_all(space, capacity, [(order, "best-fit")])[0]
    labels = packing.canonical_labels()
    count = int(labels.max()) + 1
    repaired = repair.sparse_repair(space, capacity, labels, window=3, iterations=4)
    assert int(repaired.max()) + 1 == count
    works = space.group_works(repaired, count)
    assert np.all(np.bincount(repaired, minlength=count) > 0) and works.max() <= capacity
    assert works.sum() <= space.group_works(labels, count).sum()


def test_sparse_repair_moves_a_stray_trajectory_home():
    # two trees; the labelling puts one member of tree A with tree B
    trajectories = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 4, 7], [9, 8, 7], [9, 8, 6]]
    index = compressed_index(trajectories)
    space = RankSpace(index)
    labels = two_groups(index, [2, 3, 4])
    repaired = repair.sparse_repair(space, 100, labels)
    groups = {tuple(sorted(index.order[np.flatnonzero(repaired == g)])) for g in range(2)}
    assert groups == {(0, 1, 2), (3, 4)} or groups == {(0, 1), (2, 3, 4)}
    assert space.group_works(repaired, 2).sum() < space.group_works(labels, 2).sum()
    assert space.group_works(repaired, 2).sum() == 7 + 4  # 4 shared + 3 leaves; 2 shared + 2 leaves


# --------------------------------------------------------------------------- greedy
@settings(max_examples=30, deadline=None)
@given(forests(max_trajectories=14), st.integers(6, 60), st.integers(1, 3))
def test_greedy_plans_keep_guarantees(trajectories, capacity, dp_size):
    index = compressed_index(trajectories)
    space = RankSpace(index)
    n = index.size
    assume(index.lengths.max() <= capacity)
    plans = greedy.greedy_plans(space, capacity, dp_size)
    for result in plans:
        labels = result.labels
        counts = np.bincount(labels)
        works = space.group_works(labels, len(counts))
        assert len(counts) == result.count and result.count % dp_size == 0 and np.all(counts > 0)
        assert works.max() <= capacity and works.sum() == result.total_work
    if n >= 2 * dp_size + 8:
        assert len(plans) == 8
    chosen = greedy.preselect(plans)
    if plans:
        assert (chosen.count, chosen.total_work) == min((p.count, p.total_work) for p in plans)


@settings(max_examples=30, deadline=None)
@given(forests(max_trajectories=14), st.integers(6, 60), st.integers(1, 3))
def test_piece_plans_keep_guarantees_and_pieces(trajectories, capacity, dp_size):
    index = compressed_index(trajectories)
    space = RankSpace(index)
    assume(index.lengths.max() <= capacity)
    natural = contiguous.natural_partition(space, capacity)
    for policy in greedy.POLICIES:
        packing = greedy.place_pieces(space, capacity, natural, policy)
        labels = packing.labels
        # a piece is placed whole, and the tables agree with a rebuild from the labels
        for first, last in zip(natural, contiguous.partition_ends(natural, space.size)):
            assert len(set(labels[first : last + 1].tolist())) == 1
        rebuilt = _packing_from(space, capacity, [list(np.flatnonzero(labels == c)) for c in range(packing.used)])
        assert np.array_equal(rebuilt.before[: packing.used], packing.before[: packing.used])
        assert np.array_equal(rebuilt.after[: packing.used], packing.after[: packing.used])
        assert np.array_equal(rebuilt.work[: packing.used], packing.work[: packing.used])
        assert packing.work[: packing.used].max() <= capacity
    for result in greedy.piece_plans(space, capacity, dp_size, natural):
        counts = np.bincount(result.labels)
        works = space.group_works(result.labels, len(counts))
        assert result.count % dp_size == 0 and np.all(counts > 0) and works.max() <= capacity
        assert works.sum() == result.total_work


def test_lockstep_lanes_match_single_lanes():
    rng = np.random.default_rng(3)
    trajectories = [[int(t) for t in rng.integers(0, 3, rng.integers(3, 25))] for _ in range(40)]
    index = compressed_index(trajectories)
    space = RankSpace(index)
    lanes = [(greedy.processing_order(space, order), policy) for order in greedy.ORDERS for policy in greedy.POLICIES]
    together = greedy.place_all(space, 40, lanes, columns=2)
    alone = [greedy.place_all(space, 40, [lane], columns=2, memory_budget=1)[0] for lane in lanes]
    for a, b in zip(together, alone):
        assert np.array_equal(a.canonical_labels(), b.canonical_labels())
        assert a.total_work() == b.total_work()


def test_greedy_places_by_policy():
    # x shares 4 tokens with microbatch A and none with B; A and B never fit together
    trajectories = [[1] * 7, [2] * 8, [1, 1, 1, 1, 2]]
    index = compressed_index(trajectories)
    space = RankSpace(index)
    a, b, x = (int(r) for r in index.rank)
    order = np.array([a, b, x])
    for capacity in (10, 14):
        best_fit, max_shared = greedy.place_all(space, capacity, [(order, "best-fit"), (order, "max-shared")])
        assert best_fit.labels[a] != best_fit.labels[b]
        # max-shared follows the shared prefix: A after insertion holds 7 + 1 = 8
        assert max_shared.labels[x] == max_shared.labels[a]
        if capacity == 10:
            assert best_fit.labels[x] == best_fit.labels[a]  # B would hold 8 + 5 > 10
        else:
            assert best_fit.labels[x] == best_fit.labels[b]  # 13 is the heaviest fit
            assert best_fit.work[best_fit.labels[x]] == 13


def test_alignment_splits_the_cheapest_singleton():
    trajectories = [[1, 2, 3, 4], [1, 2, 3, 5], [7, 8, 9, 9], [7, 8, 9, 8], [6, 6]]
    index = compressed_index(trajectories)
    space = RankSpace(index)
    packing = greedy.place_all(space, 100, [(np.arange(5), "max-shared")])[0]
    assert packing.live_count == 1
    aligned = greedy.align_to_dp(packing, 2)
    assert aligned.live_count == 2
    # the unrelated [6, 6] shares nothing with the others, so splitting it off costs 0
    alone = np.flatnonzero(np.bincount(aligned.labels) == 1)
    assert index.order[np.flatnonzero(aligned.labels == alone[0])].tolist() == [4]
    assert aligned.total_work() == space.interval_work(0, 4)


def test_elimination_dissolves_a_small_microbatch():
    trajectories = [[1] * 6, [2] * 6, [3] * 2]
    index = compressed_index(trajectories)
    space = RankSpace(index)
    packing = _packing_from(space, 8, [[int(index.rank[0])], [int(index.rank[1])], [int(index.rank[2])]])
    assert packing.live_count == 3
    packing = greedy.eliminate_small(packing)
    assert packing.live_count == 2 and packing.work[: packing.used][packing.alive[: packing.used]].max() == 8


# --------------------------------------------------------------------------- assignment, J, selection
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4).flatmap(lambda d: st.tuples(st.just(d), st.lists(st.integers(0, 50), min_size=1, max_size=6).map(lambda blocks: blocks * d))))
def test_assignment_gives_each_replica_k_over_d_microbatches(case):
    dp_size, works = case
    works = works[: len(works) - len(works) % dp_size]
    if not works:
        return
    replica, slot = assign_slots(works, list(range(len(works))), dp_size)
    slots = len(works) // dp_size
    assert sorted(zip(replica.tolist(), slot.tolist())) == sorted(itertools.product(range(dp_size), range(slots)))
    # slots are consecutive blocks of the heaviest-first order
    slot_min = [min(w for w, s in zip(works, slot) if s == j) for j in range(slots)]
    slot_max = [max(w for w, s in zip(works, slot) if s == j) for j in range(slots)]
    assert all(slot_min[j] >= slot_max[j + 1] for j in range(slots - 1))
    total, critical, heaviest = objective_of(works, replica, slot)
    assert total == sum(works) and critical == sum(slot_max)
    assert heaviest == max(sum(w for w, r in zip(works, replica) if r == d) for d in range(dp_size))
    assert step_imbalance(works, replica, slot, dp_size) == pytest.approx(imbalance([
        sum(w for w, r in zip(works, replica) if r == d) for d in range(dp_size)]))
    assert len(slot_imbalances(works, replica, slot, dp_size)) == slots


def test_imbalance_is_excess_of_the_heaviest_over_the_mean():
    assert imbalance([10, 10, 10]) == 0.0
    assert imbalance([30, 10, 20]) == pytest.approx(30 / 20 - 1)
    assert imbalance([0, 0]) == 0.0


def _candidate(index: PrefixIndex, groups, dp_size: int, source: str):
    labels = np.empty(index.size, dtype=np.int64)
    for label, group in enumerate(groups):
        labels[index.rank[group]] = label
    return instantiate(index, labels, dp_size, source)


def test_selection_prefers_total_work_first():
    # trajectories 0 and 1 share five tokens; keeping them together saves them
    index = compressed_index([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [9, 9], [8, 8]])
    together = _candidate(index, [[0, 1], [2, 3]], 2, "together")
    apart = _candidate(index, [[0, 2], [1, 3]], 2, "apart")
    assert together.objective == (11, 7, 7) and apart.objective == (16, 8, 8)
    assert select_best([apart, together]) is together


def test_selection_breaks_ties_by_slot_critical_then_replica_work():
    # seven unrelated trajectories of lengths 1..7: every partition has total work 28
    index = compressed_index([[10 + i] * (i + 1) for i in range(7)])
    best = _candidate(index, [[2, 3], [1, 4], [0, 5], [6]], 2, "best")
    worse_slots = _candidate(index, [[0], [1], [2, 3, 4], [5, 6]], 2, "slots")
    worse_replica = _candidate(index, [[0], [2], [1, 3, 5], [4, 6]], 2, "replica")
    assert best.objective == (28, 14, 14)
    assert worse_slots.objective == (28, 15, 14)
    assert worse_replica.objective == (28, 15, 15)
    assert select_best([worse_replica, worse_slots, best]) is best
    assert select_best([worse_replica, worse_slots]) is worse_slots


# --------------------------------------------------------------------------- the whole planner
@settings(max_examples=40, deadline=None)
@given(forests(max_trajectories=14), st.sampled_from([8, 16, 40, 200]), st.integers(1, 4), st.sampled_from([3, 512]), st.booleans())
def test_plan_guarantees(trajectories, capacity, dp_size, exact_threshold, extended):
    index = compressed_index(trajectories)
    assume(index.lengths.max() <= capacity and index.size >= dp_size)
    space = RankSpace(index)
    # with K0 the natural partition's count, splitting reaches D * ceil(K0 / D): a plan exists
    natural_count = len(contiguous.natural_partition(space, capacity))
    assume(dp_size * -(-natural_count // dp_size) <= index.size)
    result = choose_microbatches(index, PlannerOptions(capacity=capacity, dp_size=dp_size, exact_threshold=exact_threshold, extended=extended))
    if not extended:
        assert not any("pieces" in source or "recut" in source or "exchanged" in source for source, _, _ in result.candidates)
    members = sorted(t for group in result.microbatches for t in group)
    assert members == list(range(index.size))
    assert all(group and list(group) == sorted(group) for group in result.microbatches)
    assert [index.subset_work(group) for group in result.microbatches] == list(result.works)
    assert max(result.works) <= capacity
    k = len(result.microbatches)
    assert k % dp_size == 0
    # J is that of the slot rule schedule-slots applies: keys are each microbatch's smallest rank
    rank = np.argsort(index.order)
    replicas, slots = assign_slots(result.works, [int(rank[list(group)].min()) for group in result.microbatches], dp_size)
    assert sorted(zip(replicas.tolist(), slots.tolist())) == sorted(itertools.product(range(dp_size), range(k // dp_size)))
    assert result.objective == objective_of(result.works, replicas, slots)
    assert result.objective == min(c[2] for c in result.candidates)
    assert result.objective[0] >= result.lower_bound
    if exact_threshold == 512:
        # the exact contiguous optimum of each K in range is among the candidates
        for kk, starts in contiguous.exact_partitions(space, capacity, list(result.k_range)).items():
            assert result.objective[0] <= contiguous.partition_works(space, starts).sum()
