"""Whole-tree units (contiguous.unit_partition) and the ``units/...`` packing candidate."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from harts.planner import PlannerOptions, RankSpace, choose_microbatches
from harts.planner import contiguous
from tests.helpers import compressed_index, forests, work_of


@settings(max_examples=80, deadline=None)
@given(forests(max_trajectories=14), st.integers(0, 5), st.sampled_from([8, 20, 45, 1000]))
def test_units_are_whole_trees_where_they_fit_and_natural_pieces_where_they_do_not(trajectories, prompt_length, capacity):
    trajectories = [[7] * prompt_length + path for path in trajectories]  # a prompt every tree shares
    assume(max(map(len, trajectories)) <= capacity)  # the planner rejects longer ones before partitioning
    index = compressed_index(trajectories)
    space = RankSpace(index)
    n = space.size
    starts = contiguous.unit_partition(space, capacity).tolist()
    assert starts[0] == 0 and starts == sorted(set(starts))
    ends = [*(s - 1 for s in starts[1:]), n - 1]
    floor = int(space.lcp[1:].min()) if n > 1 else 0
    tree_starts = [0, *(t for t in range(1, n) if space.lcp[t] <= floor)]
    # every cut at the batch's lowest valley is a unit boundary, and so is every natural cut
    assert set(tree_starts) <= set(starts)
    assert set(contiguous.natural_partition(space, capacity).tolist()) <= set(starts)
    for tree_first, tree_end in zip(tree_starts, [*tree_starts[1:], n]):
        inside = [(s, e) for s, e in zip(starts, ends) if tree_first <= s < tree_end]
        if work_of(index, range(tree_first, tree_end)) <= capacity:
            assert inside == [(tree_first, tree_end - 1)]  # a tree that fits stays whole
        else:  # otherwise its pieces are exactly the natural partition of the tree on its own
            sub = compressed_index([trajectories[int(index.order[r])] for r in range(tree_first, tree_end)])
            natural = contiguous.natural_partition(RankSpace(sub), capacity).tolist()
            assert [s - tree_first for s, _ in inside] == natural
        for s, e in inside:
            assert work_of(index, range(s, e + 1)) <= capacity


def test_packing_whole_trees_finds_the_plan_the_papers_candidates_miss():
    # four trees under a 3-token prompt, two answers each. Trees 1 + 3 (24 tokens) and 2 + 4
    # (27 tokens) fill two microbatches of 28 exactly; the paper's candidates split a tree and
    # repeat its stem. Brute force over all partitions of the 8 trajectories confirms 51.
    prompt = [99] * 3
    shapes = [(1, 8, 4, 2), (2, 8, 1, 3), (3, 3, 1, 3), (4, 7, 4, 1)]
    trajectories = []
    for token, stem, first_answer, second_answer in shapes:
        trajectories.append(prompt + [token] * stem + [50] * first_answer)
        trajectories.append(prompt + [token] * stem + [51] * second_answer)
    index = compressed_index(trajectories)
    options = dict(capacity=28, dp_size=2, exact_threshold=0)
    full = choose_microbatches(index, PlannerOptions(**options))
    paper = choose_microbatches(index, PlannerOptions(**options, extended=False))
    assert sum(full.works) == 51 and len(full.works) == 2
    assert full.source.startswith("units/")
    assert sorted(full.microbatches) == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert sum(paper.works) > 51
    assert _brute_force_minimum(index, 8, capacity=28, dp_size=2) == 51


def _brute_force_minimum(index, count: int, capacity: int, dp_size: int) -> int:
    def partitions(items):
        if not items:
            yield []
            return
        for rest in partitions(items[1:]):
            for i in range(len(rest)):
                yield rest[:i] + [[items[0]] + rest[i]] + rest[i + 1 :]
            yield [[items[0]]] + rest

    best = None
    for groups in partitions(list(range(count))):
        if len(groups) % dp_size:
            continue
        works = [index.subset_work(np.asarray(sorted(group))) for group in groups]
        if max(works) <= capacity:
            best = sum(works) if best is None else min(best, sum(works))
    return best
