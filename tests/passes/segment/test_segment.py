"""The ``segment`` pass against a token-level reference, and ``verify_segmented``."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.errors import IRVerificationError, PipelineError, PlanningError
from harts.ir.nodes import Phase
from harts.ir.prefix_index import PrefixIndex
from harts.ir.verify import verify
from harts.ir.verify_rounds import verify_segmented
from harts.passes import PassContext
from harts.passes.manager import run_pipeline
from harts.passes.segment import SegmentPass
from tests.helpers import token_trees
from tests.helpers import compressed_module, forked_trees, microbatch_split, scheduled_module


def segmented(token_lists, chunk_size=4, groups=None):
    batch, module = scheduled_module(token_lists, chunk_size, groups)
    return batch, SegmentPass().run(module, PassContext(batch=batch))


def reference_segments(token_lists, members):
    """(parent, start, end, representative) in preorder, from tokens alone.

    A position forks when the members that reach it continue with two or more distinct
    tokens; members that stop there do not count.
    """
    continuations: dict[tuple[int, ...], set[int]] = {}
    smallest: dict[tuple[int, ...], int] = {}
    for member in sorted(members):
        tokens = tuple(token_lists[member])
        for length in range(len(tokens) + 1):
            prefix = tokens[:length]
            smallest.setdefault(prefix, member)
            if length < len(tokens):
                continuations.setdefault(prefix, set()).add(tokens[length])
    result = []

    def walk(prefix, token, parent):
        path = prefix + (token,)
        while len(continuations.get(path, ())) == 1:
            path = path + (next(iter(continuations[path])),)
        number = len(result)
        result.append((parent, len(prefix), len(path), smallest[path]))
        for following in sorted(continuations.get(path, ())):
            walk(path, following, number)

    for first in sorted(continuations[()]):
        walk((), first, -1)
    return result


@st.composite
def batches_and_groups(draw):
    chunk = draw(st.sampled_from([2, 4, 8]))
    if draw(st.booleans()):
        token_lists = draw(forked_trees(chunk_size=chunk))
    else:
        token_lists = draw(token_trees(chunk_size=chunk, max_trajectories=10, max_length=30, vocab=3))
    return token_lists, chunk, microbatch_split(draw, len(token_lists))


@settings(max_examples=80, deadline=None)
@given(batches_and_groups())
def test_segments_match_token_level_forks(case):
    token_lists, chunk, groups = case
    batch, module = segmented(token_lists, chunk, groups)
    assert module.phase == Phase.SEGMENTED
    verify(module)
    prefixes = PrefixIndex.from_module(module)
    for microbatch in module.microbatches:
        got = [(s.parent, s.start, s.end, s.trajectory) for s in microbatch.segments]
        assert got == reference_segments(token_lists, microbatch.trajectories)
        assert sum(s.end - s.start for s in microbatch.segments) == prefixes.subset_work(microbatch.trajectories)
        assert microbatch.rounds is None and microbatch.replay_tokens is None


def test_a_trajectory_ending_inside_another_does_not_split_its_segment():
    long = list(range(1, 11))
    _, module = segmented([long, long[:5]])
    assert len(module.trie.nodes) == 2  # the trie splits at the end of the shorter one
    (segment,) = module.microbatches[0].segments
    assert (segment.start, segment.end, segment.nodes, segment.trajectory) == (0, 10, (0, 1), 0)
    _, alone = segmented([long, long[:5]], groups=[(1,), (0,)])
    assert [(s.start, s.end, s.trajectory) for s in alone.microbatches[0].segments] == [(0, 5, 1)]


def test_a_batch_fork_outside_the_microbatch_is_no_fork():
    shared = [7, 7, 7]
    _, module = segmented([shared + [1, 1], shared + [2, 2], shared + [3]], groups=[(1,), (0, 2)])
    (only,) = module.microbatches[0].segments
    assert (only.start, only.end, len(only.nodes), only.trajectory) == (0, 5, 2, 1)
    root, first, second = module.microbatches[1].segments
    assert (root.end, first.parent, second.parent, first.trajectory, second.trajectory) == (3, 0, 0, 0, 2)


def test_duplicates_take_the_smallest_index():
    tokens = [5, 6, 7, 8]
    _, module = segmented([tokens, [9], tokens, tokens[:2]], groups=[(2, 3), (0, 1, 2)])
    assert [(s.start, s.end, s.trajectory) for s in module.microbatches[0].segments] == [(0, 4, 2)]
    assert [(s.start, s.end, s.trajectory) for s in module.microbatches[1].segments] == [(0, 4, 0), (0, 1, 1)]


def test_segment_needs_a_scheduled_module():
    # the pass manager enforces the input phase; the pass does not check it again
    batch, module = compressed_module([[1, 2], [1, 3]], 4)
    with pytest.raises(PipelineError, match="segment"):
        run_pipeline(module, [SegmentPass()], PassContext(batch=batch))


def test_segment_rejects_an_unknown_trajectory():
    batch, module = scheduled_module([[1, 2], [1, 3]], 4)
    broken = attrs.evolve(module, microbatches=(attrs.evolve(module.microbatches[0], trajectories=(0, 5)),))
    with pytest.raises(PlanningError, match="microbatch 0: trajectory 5"):
        SegmentPass().run(broken, PassContext(batch=batch))


def _with_segments(module, segments):
    return attrs.evolve(module, microbatches=(attrs.evolve(module.microbatches[0], segments=tuple(segments)),) + module.microbatches[1:])


def test_verify_segmented_catches_corruption():
    b = 4
    base = [1, 2, 3]
    token_lists = [base + [4, 4, 4, 9], base + [4, 4, 4, 8], base + [5], base + [4, 4]]
    _, module = segmented(token_lists, b)
    verify_segmented(module)
    segments = list(module.microbatches[0].segments)
    # root [0,3) forks into [3,6) and [3,4); [3,6) forks into two leaves.
    assert [(s.parent, s.start, s.end) for s in segments] == [(-1, 0, 3), (0, 3, 6), (1, 6, 7), (1, 6, 7), (0, 3, 4)]
    corruptions = {
        "span": lambda s: s.__setitem__(1, attrs.evolve(s[1], end=7)),
        "parent": lambda s: s.__setitem__(2, attrs.evolve(s[2], parent=0)),
        "belongs to no segment": lambda s: s.pop(),
        "also belongs": lambda s: s.__setitem__(4, attrs.evolve(s[4], nodes=s[2].nodes)),
        "representative": lambda s: s.__setitem__(0, attrs.evolve(s[0], trajectory=3)),
        "numbered": lambda s: s.__setitem__(3, attrs.evolve(s[3], id=7)),
        "forks inside": lambda s: s.__setitem__(0, attrs.evolve(s[0], nodes=s[0].nodes + s[1].nodes, end=6)),
    }
    for expected, corrupt in corruptions.items():
        damaged = list(segments)
        corrupt(damaged)
        with pytest.raises(IRVerificationError, match=f"microbatch 0.*{expected}|microbatch 0: .*{expected}"):
            verify_segmented(_with_segments(module, damaged))


def test_verify_segmented_catches_a_non_maximal_split():
    long = list(range(1, 11))
    _, module = segmented([long, long[:5]])
    (whole,) = module.microbatches[0].segments
    upper = attrs.evolve(whole, end=5, nodes=whole.nodes[:1])
    lower = attrs.evolve(whole, id=1, parent=0, start=5, nodes=whole.nodes[1:])
    with pytest.raises(IRVerificationError, match="microbatch 0, segment 0: not maximal"):
        verify_segmented(_with_segments(module, [upper, lower]))
