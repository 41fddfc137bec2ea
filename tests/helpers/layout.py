"""Layout test helpers: the paper's figure batches and rounded modules built pass by pass."""

from __future__ import annotations

from hypothesis import strategies as st
import attrs

from harts.rollouts.batch import RolloutBatch
from harts.ir.nodes import Microbatch, Phase
from harts.ir.verify import verify
from harts.passes import PassContext, lower
from harts.passes.min_call_rounds import MinCallRounds
from harts.passes.prefix_compress import PrefixCompress
from harts.passes.segment import SegmentPass
from tests.helpers.strategies import token_trees


def rounded_module(batch: RolloutBatch, chunk_size: int, groups=None):
    """A rounded module whose microbatches are ``groups`` (lists of trajectory indices; default: one)."""
    module = lower(batch, capacity=1 << 30, chunk_size=chunk_size)
    module = PrefixCompress().run(module, PassContext(batch=batch))
    groups = [list(range(len(batch)))] if groups is None else groups
    trie = module.trie
    microbatches = []
    for index, group in enumerate(groups):
        members = tuple(sorted(group))
        work = sum(trie.nodes[n].end - trie.nodes[n].start for n in trie.used_nodes(members))
        microbatches.append(Microbatch(index, members, work, replica=0, slot=index))
    module = attrs.evolve(module, phase=Phase.SCHEDULED, microbatches=tuple(microbatches))
    verify(module)  # a hand-built phase must be one the passes could have produced
    ctx = PassContext(batch=batch)
    module = SegmentPass().run(module, ctx)
    module = MinCallRounds().run(module, ctx)
    verify(module)
    return module


@st.composite
def batches_with_groups(draw, chunk_sizes=(4, 8), max_trajectories=8, max_length=30, max_groups=3):
    """A batch, a chunk size and a split of its trajectories into microbatches (trees may be split or mixed)."""
    chunk_size = draw(st.sampled_from(chunk_sizes))
    trajectories = draw(token_trees(chunk_size=chunk_size, max_trajectories=max_trajectories, max_length=max_length))
    count = draw(st.integers(1, min(max_groups, len(trajectories))))
    assignment = draw(st.lists(st.integers(0, count - 1), min_size=len(trajectories), max_size=len(trajectories)))
    groups = [[i for i, g in enumerate(assignment) if g == k] for k in range(count)]
    groups = [g for g in groups if g]
    return RolloutBatch.from_trajectories(trajectories), chunk_size, groups


def figure_batch():
    """Forks at B-1, B and B+1 of one tree (B = 4), a prefix trajectory and a second tree."""
    base = list(range(1, 12))
    trajectories = [
        base,
        base[:3] + [20, 21, 22, 23, 24],  # fork at B-1
        base[:5] + [30, 31],  # fork at B+1
        base[:4] + [40],  # fork at B
        base[:6],  # a prefix of trajectory 0
        base[:5] + [30, 31, 32, 33, 34, 35, 36],  # continues trajectory 2 past a boundary
        [50, 51, 52],
    ]
    return RolloutBatch.from_trajectories(trajectories)


def nested_forks_batch():
    """For B = 8: forks at 9, 10 (three children), 11 and 13 inside the chunk [8, 16), one
    nested in another, a prefix trajectory, and a second rollout tree (own tree id) that
    shares the whole prompt of the first."""
    prompt = list(range(1, 10))
    t0 = prompt + [20, 21, 22, 23, 24, 25, 26, 27, 28]
    t2 = t0[:11] + [40, 41, 42, 43, 44, 45, 46, 47]
    trajectories = [
        t0,
        t0[:10] + [30, 31, 32],  # fork at 10
        t2,  # fork at 11, crosses 16
        t2[:13] + [50, 51],  # fork at 13 below the fork at 11
        prompt + [60],  # fork at 9
        t0[:12],  # a prefix of t0
        t0[:10] + [70, 71],  # a third child of the fork at 10
        prompt + [90, 91, 92],  # tree 1, same prompt
        prompt + [90, 93],
    ]
    return RolloutBatch.from_trajectories(trajectories, tree_ids=[0, 0, 0, 0, 0, 0, 0, 1, 1])
