"""The partition-microbatches and schedule-slots passes, their verifiers and their errors."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from harts.rollouts.batch import RolloutBatch
from harts.errors import IRVerificationError, PipelineError, PlanningError
from harts.ir.nodes import Phase
from harts.ir.prefix_index import PrefixIndex
from harts.ir.verify import verify
from harts.ir.verify_plan import verify_partitioned, verify_scheduled
from harts.passes import PASS_REGISTRY, parse_pipeline
from harts.passes.base import PassContext
from harts.passes.lower import lower
from harts.passes.manager import run_pipeline
from harts.passes.partition_microbatches import PartitionMicrobatches
from harts.passes.prefix_compress import PrefixCompress
from harts.passes.schedule_slots import ScheduleSlots
from harts.planner import PlannerOptions, RankSpace, contiguous, objective, choose_microbatches
from tests.helpers import token_trees


def compressed(token_lists, capacity=64, dp_size=1):
    batch = RolloutBatch.from_trajectories(token_lists)
    module = lower(batch, capacity=capacity, dp_size=dp_size)
    return PrefixCompress().run(module, PassContext(batch=batch))


def partitioned(module, **options):
    return PartitionMicrobatches(**options).run(module, PassContext())


def scheduled(module, **options):
    return ScheduleSlots().run(partitioned(module, **options), PassContext())


@st.composite
def forests(draw):
    trees = draw(st.integers(1, 4))
    trajectories = []
    for tree in range(trees):
        for path in draw(token_trees(chunk_size=8, max_trajectories=6, max_length=40, vocab=3)):
            trajectories.append([200 + tree] + path)
    return trajectories


def test_passes_are_registered_and_parse():
    assert PASS_REGISTRY["partition-microbatches"] is PartitionMicrobatches
    assert PASS_REGISTRY["schedule-slots"] is ScheduleSlots
    (invocation,) = parse_pipeline("partition-microbatches{exact_threshold=10,refine=false}")
    assert invocation == PartitionMicrobatches(exact_threshold=10, refine=False)
    assert invocation.to_text() == "partition-microbatches{exact_threshold=10,refine=false}"
    # T and D are compile options, recorded by lower: no pass overrides them
    with pytest.raises(PipelineError, match="has no option 'capacity'"):
        parse_pipeline("partition-microbatches{capacity=4096}")


@settings(max_examples=30, deadline=None)
@given(forests(), st.sampled_from([41, 64, 100, 1000]), st.integers(1, 4), st.sampled_from([2, 512]), st.booleans())
def test_pass_outputs_verify(trajectories, capacity, dp_size, exact_threshold, greedy):
    module = compressed(trajectories, capacity=capacity, dp_size=dp_size)
    index = PrefixIndex.from_module(module)
    assume(len(trajectories) >= dp_size)
    natural_count = len(contiguous.natural_partition(RankSpace(index), capacity))
    # splitting the natural partition reaches D * ceil(K0 / D) microbatches: a plan exists
    assume(dp_size * -(-natural_count // dp_size) <= len(trajectories))
    first = partitioned(module, exact_threshold=exact_threshold, greedy=greedy)
    assert first.phase == Phase.PARTITIONED
    verify_partitioned(first)
    assert all(mb.replica is None and mb.slot is None for mb in first.microbatches)
    assert [mb.index for mb in first.microbatches] == list(range(len(first.microbatches)))

    second = ScheduleSlots().run(first, PassContext())
    assert second.phase == Phase.SCHEDULED
    verify_scheduled(second)
    keys = [(mb.slot, mb.replica) for mb in second.microbatches]
    assert keys == sorted(keys)
    assert sorted(mb.trajectories for mb in second.microbatches) == sorted(mb.trajectories for mb in first.microbatches)
    # the scheduled module has exactly the J the planner selected on
    expected = choose_microbatches(index, PlannerOptions(capacity=capacity, dp_size=dp_size, exact_threshold=exact_threshold, greedy=greedy))
    assert objective(second.microbatches) == expected.objective
    per_replica = np.bincount([mb.replica for mb in second.microbatches], minlength=dp_size)
    assert np.all(per_replica == len(second.microbatches) // dp_size)


def test_the_planning_passes_plan_for_the_modules_targets_and_never_change_them():
    module = compressed([[1, 2, 3, 4], [1, 2, 3, 5], [7, 7, 7], [8, 8]], capacity=6, dp_size=2)
    result = scheduled(module)
    assert (result.capacity, result.dp_size) == (6, 2)
    verify(result)
    assert len(result.microbatches) % 2 == 0 and max(mb.work for mb in result.microbatches) <= 6


def test_prefix_sharing_trajectories_stay_together():
    # two trees of two paths each; at capacity 6 each tree fits in one microbatch
    module = compressed([[1, 2, 3, 4], [1, 2, 3, 5], [7, 7, 7, 7], [7, 7, 7, 8]], capacity=6, dp_size=2)
    result = scheduled(module)
    assert sorted(mb.trajectories for mb in result.microbatches) == [(0, 1), (2, 3)]
    assert [mb.work for mb in result.microbatches] == [5, 5]
    assert objective(result.microbatches) == (10, 5, 5)


def test_too_long_trajectory_is_named():
    module = compressed([[1, 2, 3], [4] * 9, [5, 6]], capacity=8)
    with pytest.raises(PlanningError, match=r"trajectory 1 has 9 tokens, more than the microbatch capacity 8"):
        partitioned(module)


def test_fewer_trajectories_than_replicas_is_explained():
    module = compressed([[1, 2, 3], [4, 5]], capacity=8, dp_size=3)
    with pytest.raises(PlanningError, match=r"2 trajectories but dp_size is 3"):
        partitioned(module)


def test_impossible_microbatch_count_is_explained():
    # 3 unrelated trajectories of 5 tokens at capacity 5 need 3 microbatches; D=2 needs K=4 > 3
    module = compressed([[1] * 5, [2] * 5, [3] * 5], capacity=5, dp_size=2)
    with pytest.raises(PlanningError, match=r"at least 4 microbatches .* only 3 trajectories"):
        partitioned(module)


@pytest.mark.parametrize("option", ["exact_threshold", "sample_budget"])
def test_bad_option_values_are_rejected(option):
    with pytest.raises(PipelineError, match=option):
        PartitionMicrobatches(**{option: 0})


def test_wrong_phase_is_rejected():
    # the pass manager enforces each pass's input phase; passes do not check it again
    batch = RolloutBatch.from_trajectories([[1, 2], [3]])
    with pytest.raises(PipelineError, match="compressed"):
        run_pipeline(lower(batch), [PartitionMicrobatches()], PassContext())
    with pytest.raises(PipelineError, match="partitioned"):
        run_pipeline(compressed([[1, 2], [3]]), [ScheduleSlots()], PassContext())


# --------------------------------------------------------------------------- verifiers
@pytest.fixture
def good():
    module = compressed([[1, 2, 3, 4], [1, 2, 3, 5], [7, 7, 7], [8, 8], [9]], capacity=6, dp_size=2)
    return scheduled(module)


def with_microbatch(module, position, **changes):
    microbatches = list(module.microbatches)
    microbatches[position] = attrs.evolve(microbatches[position], **changes)
    return attrs.evolve(module, microbatches=tuple(microbatches))


def test_good_plan_verifies(good):
    verify_partitioned(good)
    verify_scheduled(good)


def test_verify_partitioned_catches_coverage_errors(good):
    first, second = good.microbatches[0], good.microbatches[1]
    moved = first.trajectories[0]
    duplicate = with_microbatch(good, 1, trajectories=tuple(sorted(second.trajectories + (moved,))))
    with pytest.raises(IRVerificationError, match=f"trajectory {moved} is in microbatch"):
        verify_partitioned(duplicate)
    remaining = first.trajectories[1:]
    if remaining:
        missing = with_microbatch(good, 0, trajectories=remaining, work=PrefixIndex.from_module(good).subset_work(remaining))
        with pytest.raises(IRVerificationError, match=f"trajectory {moved} is in no microbatch"):
            verify_partitioned(missing)
    with pytest.raises(IRVerificationError, match="microbatch 0 holds no trajectories"):
        verify_partitioned(with_microbatch(good, 0, trajectories=()))
    with pytest.raises(IRVerificationError, match="trajectory 99 does not exist"):
        verify_partitioned(with_microbatch(good, 0, trajectories=first.trajectories + (99,)))
    if len(first.trajectories) > 1:
        with pytest.raises(IRVerificationError, match="ascending"):
            verify_partitioned(with_microbatch(good, 0, trajectories=first.trajectories[::-1]))


def test_verify_partitioned_catches_work_capacity_and_count(good):
    mb = good.microbatches[0]
    with pytest.raises(IRVerificationError, match=f"microbatch {mb.index}: work is {mb.work + 1}"):
        verify_partitioned(with_microbatch(good, 0, work=mb.work + 1))
    with pytest.raises(IRVerificationError, match=f"exceeds the capacity {mb.work - 1}"):
        verify_partitioned(attrs.evolve(good, capacity=mb.work - 1, dp_size=1))
    odd = attrs.evolve(good, dp_size=len(good.microbatches) + 1)
    with pytest.raises(IRVerificationError, match="not a multiple of dp_size"):
        verify_partitioned(odd)
    with pytest.raises(IRVerificationError, match="index"):
        verify_partitioned(with_microbatch(good, 0, index=7))


def test_verify_scheduled_catches_slot_errors(good):
    first, second = good.microbatches[0], good.microbatches[1]
    with pytest.raises(IRVerificationError, match=f"microbatch {first.index} has no replica/slot"):
        verify_scheduled(with_microbatch(good, 0, replica=None))
    with pytest.raises(IRVerificationError, match=f"microbatch {first.index}: replica 5 outside"):
        verify_scheduled(with_microbatch(good, 0, replica=5))
    slots = len(good.microbatches) // good.dp_size
    with pytest.raises(IRVerificationError, match=f"slot {slots} outside"):
        verify_scheduled(with_microbatch(good, 0, slot=slots))
    clash = with_microbatch(good, 1, replica=first.replica, slot=first.slot)
    with pytest.raises(IRVerificationError, match=f"microbatches {first.index} and {second.index} both run on replica"):
        verify_scheduled(clash)
    swapped = attrs.evolve(good, microbatches=(attrs.evolve(second, index=0), attrs.evolve(first, index=1)) + good.microbatches[2:])
    with pytest.raises(IRVerificationError, match="out of \\(slot, replica\\) order"):
        verify_scheduled(swapped)


@pytest.mark.parametrize("dp_size", [1, 2, 4])
@pytest.mark.parametrize("exact_threshold", [512, 16])
def test_swe_like_step_plans_verify_and_beat_contiguous_natural_partition(dp_size, exact_threshold):
    from harts.rollouts.workloads import swe_like_step

    batch = swe_like_step(seed=3, scale=0.1)
    module = PrefixCompress().run(lower(batch, capacity=8192, dp_size=dp_size), PassContext(batch=batch))
    result = scheduled(module, exact_threshold=exact_threshold)
    verify_scheduled(result)
    total = sum(mb.work for mb in result.microbatches)
    space = RankSpace(PrefixIndex.from_module(module))
    natural = contiguous.natural_partition(space, 8192)
    assert module.trie.compact_tokens <= total <= contiguous.partition_works(space, natural).sum() + 8192 * dp_size
    if exact_threshold == 512:
        # every exact contiguous optimum in the K range of Eq. 8 was a candidate
        k_values = contiguous.k_range(module.trie.compact_tokens, len(natural), space.size, 8192, dp_size)
        for starts in contiguous.exact_partitions(space, 8192, k_values).values():
            assert total <= contiguous.partition_works(space, starts).sum()
