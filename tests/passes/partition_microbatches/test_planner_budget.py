"""Work budgets of the planner stages beyond the paper (harts.planner.budget): bounded, near-linear work on
every batch shape, and plans never worse than the paper's stages alone."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.errors import PlanningError
from harts.ir.prefix_index import PrefixIndex
from harts.passes.base import PassContext
from harts.passes.lower import lower
from harts.passes.prefix_compress import PrefixCompress
from harts.planner import PlannerOptions, RankSpace, choose_microbatches
from harts.planner.balance import balance_slots
from harts.planner.budget import WorkBudget
from harts.planner.exchange import exchange_subtrees
from harts.planner.search import EXTENSION_STAGES
from harts.rollouts.workloads import grpo_step, no_sharing_step, swe_like_step, wide_tree_step
from tests.helpers import compressed_index, forests
from tests.helpers import checked_objective


def index_of(batch, dp_size: int = 1) -> PrefixIndex:
    module = PrefixCompress().run(lower(batch, dp_size=dp_size), PassContext(batch=batch))
    return PrefixIndex.from_module(module)


def budgets(per_trajectory: int) -> dict:
    """The same work budget for every stage beyond the paper."""
    return {f"{stage}_work": per_trajectory for stage in EXTENSION_STAGES}


def paper_stages(capacity: int, dp_size: int) -> PlannerOptions:
    return PlannerOptions(capacity=capacity, dp_size=dp_size, extended=False, balance=False)


# Small versions of the shapes whose planning used to grow quadratically (benchmarks/bench_planner.py --shapes
# times the full-size ones): no sharing at all, one very wide tree, GRPO groups, deep agentic trees.
SHAPES = {
    "no-sharing": lambda scale: no_sharing_step(trajectories=60 * scale, min_tokens=20, max_tokens=200, seed=scale),
    "wide-tree": lambda scale: wide_tree_step(leaves=60 * scale, prompt_tokens=150, min_tokens=5, max_tokens=120, seed=scale),
    "grpo": lambda scale: grpo_step(groups=6 * scale, group_size=10, min_prompt=20, max_prompt=150, min_tokens=5,
                                    max_tokens=200, seed=scale),
    "agentic": lambda scale: swe_like_step(seed=scale, scale=0.01, tasks=5 * scale),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_beyond_paper_stages_stay_within_their_budgets_and_grow_linearly(shape):
    """Each stage beyond the paper uses at most its budget (16 units per trajectory here) plus one round, and a
    round costs at most 16 units per trajectory at every size: the work per trajectory does not grow with N.
    (Before the budgets, balancing a wide tree evaluated all N^2 / 2 unit pairs per round: 120 per trajectory
    at the larger size.)"""
    for scale in (1, 4):
        batch = SHAPES[shape](scale)
        index = index_of(batch)
        n = index.size
        capacity = max(int(index.lengths.max()), int(index.interval_work(0, n - 1)) // 12)
        result = choose_microbatches(index, PlannerOptions(capacity=capacity, dp_size=4, **budgets(16)))
        assert set(result.work) == set(EXTENSION_STAGES)
        for stage in EXTENSION_STAGES:
            assert result.work_limits[stage] == 16 * n
            assert result.work[stage] <= result.work_limits[stage] + 16 * n, (stage, scale, result.work[stage] / n)


@settings(max_examples=40, deadline=None)
@given(forests(max_trajectories=14), st.sampled_from([1, 2, 3]), st.sampled_from([0, 5, 40]), st.sampled_from([1, 64]))
def test_the_planner_is_never_worse_than_the_paper_stages_alone(trajectories, dp_size, slack, work_per_trajectory):
    """Total compact work (J1), and J as a whole, never exceed what the paper's stages alone reach, whatever the budget."""
    index = compressed_index(trajectories)
    if index.size < dp_size:
        return
    capacity = int(index.lengths.max()) + slack
    try:
        paper = choose_microbatches(index, paper_stages(capacity, dp_size))
    except PlanningError:  # no paper candidate is feasible: the extra candidates may still find a plan
        paper = None
    try:
        full = choose_microbatches(index, PlannerOptions(capacity=capacity, dp_size=dp_size, **budgets(work_per_trajectory)))
    except PlanningError:
        assert paper is None
        return
    if paper is not None:
        assert full.objective[0] <= paper.objective[0]
        assert full.objective <= paper.objective
    assert sorted(t for group in full.microbatches for t in group) == list(range(index.size))
    assert max(full.works) <= capacity and len(full.works) % dp_size == 0


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_full_planner_beats_or_ties_the_paper_stages_on_every_shape(shape):
    batch = SHAPES[shape](2)
    index = index_of(batch)
    capacity = max(int(index.lengths.max()), int(index.interval_work(0, index.size - 1)) // 10)
    for dp_size in (2, 8):
        paper = choose_microbatches(index, paper_stages(capacity, dp_size))
        full = choose_microbatches(index, PlannerOptions(capacity=capacity, dp_size=dp_size))
        assert full.objective <= paper.objective


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_a_spent_budget_stops_balancing_and_exchange_after_one_round(data):
    """With a budget of one unit each stage runs exactly one round, and the plan keeps every guarantee."""
    from tests.helpers import labelled_forests, prepared_case

    index, space, dp_size, labels, count, before, capacity = prepared_case(data.draw(labelled_forests()), data.draw(st.sampled_from([0, 10])))
    for run in (lambda budget: balance_slots(space, capacity, labels, dp_size, exchange=True, free_rounds=2, budget=budget),
                lambda budget: exchange_subtrees(space, capacity, labels, budget=budget)):
        budget = WorkBudget(limit=1)
        result = run(budget)
        assert budget.used == budget.largest_round  # one round only
        after = checked_objective(index, labels, result, dp_size, count, capacity)
        assert after[0] <= before[0]


def test_balancing_a_wide_tree_evaluates_a_linear_pool_per_round():
    """One tree of many leaves: every trajectory is its own unit. All-pairs unit swaps made a round cost N^2;
    now a round costs at most a fixed multiple of N (the counter is deterministic)."""
    batch = wide_tree_step(leaves=400, prompt_tokens=300, min_tokens=10, max_tokens=400, seed=3)
    index = index_of(batch)
    space = RankSpace(index)
    capacity = int(index.interval_work(0, index.size - 1)) // 16
    result = choose_microbatches(index, PlannerOptions(capacity=capacity, dp_size=8, balance=False, exchange=False))
    labels = np.empty(index.size, dtype=np.int64)
    for label, members in enumerate(result.microbatches):
        labels[index.rank[list(members)]] = label
    budget = WorkBudget(limit=PlannerOptions(capacity=capacity).balance_work * index.size)  # the planner's budget
    balance_slots(space, capacity, labels, 8, rounds=4, budget=budget, reach=8)
    assert budget.largest_round <= 40 * index.size  # the all-pairs pool alone was about N^2 / 2 = 80,000 entries


def test_piece_greedies_open_more_microbatches_than_the_trie_needs():
    """A long shared prompt repeated by every microbatch: the plan needs far more microbatches than G / T, and the
    piece greedy's tables (sized from G / T to stay linear) must grow rather than fail."""
    batch = wide_tree_step(leaves=100, prompt_tokens=900, min_tokens=50, max_tokens=50, seed=1)
    index = index_of(batch)
    result = choose_microbatches(index, PlannerOptions(capacity=1000, dp_size=2))
    assert len(result.works) >= 50 > 2 * -(-index.interval_work(0, index.size - 1) // 1000) + 8
    assert max(result.works) <= 1000 and sorted(t for group in result.microbatches for t in group) == list(range(100))
