"""Planner test helpers: compressed batches and their prefix index, random forests of trajectories, exact work."""

from __future__ import annotations

from hypothesis import strategies as st
import numpy as np

from harts.rollouts.batch import RolloutBatch
from harts.ir.prefix_index import PrefixIndex
from harts.passes.base import PassContext
from harts.passes.lower import lower
from harts.passes.prefix_compress import PrefixCompress
from harts.planner import RankSpace, assign_slots, objective_of
from harts.planner import greedy
from tests.helpers.strategies import token_trees


def two_groups(index: PrefixIndex, second: list[int]) -> np.ndarray:
    """Canonical rank labels of two microbatches: the trajectories (input order) in ``second`` and the rest."""
    labels = np.zeros(index.size, dtype=np.int64)
    labels[index.rank[second]] = 1
    return greedy.canonical_labels(labels)


def compressed_index(token_lists) -> PrefixIndex:
    batch = RolloutBatch.from_trajectories(token_lists)
    module = PrefixCompress().run(lower(batch), PassContext(batch=batch))
    return PrefixIndex.from_module(module)


@st.composite
def forests(draw, max_trajectories: int = 12, max_length: int = 30):
    """Several rollout trees (distinct first tokens) with forks anywhere, including at chunk edges."""
    trees = draw(st.integers(1, 3))
    trajectories: list[list[int]] = []
    for tree in range(trees):
        for path in draw(token_trees(chunk_size=4, max_trajectories=max(1, max_trajectories // trees), max_length=max_length, vocab=3)):
            trajectories.append([100 + tree] + path)
    return trajectories


def work_of(index: PrefixIndex, ranks) -> int:
    return index.subset_work(index.order[np.asarray(sorted(ranks), dtype=np.int64)])


def objective_by_labels(index, labels, dp_size):
    """J recomputed from scratch: C(M) by the prefix index, keys = each group's smallest rank."""
    count = int(labels.max()) + 1
    works = np.array([work_of(index, np.flatnonzero(labels == g)) for g in range(count)])
    keys = np.array([np.flatnonzero(labels == g).min() for g in range(count)])
    replica, slot = assign_slots(works, keys, dp_size)
    return works, replica, slot, objective_of(works, replica, slot)


def prepared_case(case, slack: int):
    """A labelled forest ready for a planner step: index, rank space, D, labels, K, J before, capacity."""
    trajectories, dp_size, labels = case
    index = compressed_index(trajectories)
    count = int(labels.max()) + 1
    before_works, _, _, before = objective_by_labels(index, labels, dp_size)
    return index, RankSpace(index), dp_size, labels, count, before, int(before_works.max()) + slack


def checked_objective(index, labels, changed, dp_size, count, capacity):
    """J of ``changed`` after asserting the guarantees: one label per trajectory, K nonempty microbatches, capacity."""
    assert changed.shape == labels.shape
    assert sorted(set(changed.tolist())) == list(range(count))  # coverage, K, every microbatch nonempty
    works, _, _, objective = objective_by_labels(index, changed, dp_size)
    assert works.max() <= capacity
    return objective


@st.composite
def labelled_forests(draw):
    """A forest, a D, and a random labelling with K a multiple of D and every group nonempty."""
    trajectories = draw(forests(max_trajectories=14, max_length=30))
    n = len(trajectories)
    dp_size = draw(st.integers(2, 4).filter(lambda d: d <= n))
    count = dp_size * draw(st.integers(1, max(1, n // dp_size)))
    labels = np.array(draw(st.permutations(list(range(count)) + draw(st.lists(st.integers(0, count - 1), min_size=n - count, max_size=n - count)))))
    return trajectories, dp_size, labels
