"""``min-call-rounds`` on real batches: the plan executes correctly, is minimal, and verify guards it."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.errors import IRVerificationError, PipelineError
from harts.ir.nodes import Phase
from harts.ir.verify import verify
from harts.ir.verify_rounds import verify_rounded
from harts.passes import PASS_REGISTRY, PassContext
from harts.passes.manager import run_pipeline
from harts.passes.min_call_rounds import MinCallRounds, plan_forest
from harts.passes.segment import SegmentPass
from tests.helpers import token_trees
from tests.helpers import (
    all_choices,
    brute_force_rounds_fixpoint,
    forked_trees,
    microbatch_split,
    scheduled_module,
    segment_tree_tokens,
    segment_trees,
    tree_children,
)


def rounded(token_lists, chunk_size, groups=None):
    batch, module = scheduled_module(token_lists, chunk_size, groups)
    ctx = PassContext(batch=batch)
    module = SegmentPass().run(module, ctx)
    return batch, MinCallRounds().run(module, ctx)


def execute(token_lists, chunk_size, microbatch):
    """Run the plan on a toy recurrence whose state *is* the consumed prefix.

    A sequence must find its initial state among the states exported by rounds that have
    already returned, and that state must be exactly its own prefix up to ``replay_start``.
    States can only be exported on the chunk grid. Returns the outputs keyed by the prefix
    they belong to (each must appear once).
    """
    exported: dict[tuple[int, int, int], tuple[int, ...]] = {}
    outputs: dict[tuple[int, ...], int] = {}
    for round_ in microbatch.rounds:
        returned: dict[tuple[int, int, int], tuple[int, ...]] = {}
        for sequence in round_.sequences:
            tokens = tuple(token_lists[sequence.trajectory])
            if sequence.state_from is None:
                state = ()
            else:
                source = sequence.state_from
                state = exported[(source.round, source.trajectory, source.position)]  # KeyError: not ready
            assert state == tokens[: sequence.replay_start], "initial state belongs to another prefix"
            for position in range(sequence.replay_start, sequence.end):
                state = state + (tokens[position],)
                if position >= sequence.start:
                    assert state not in outputs, f"prefix of length {len(state)} output twice"
                    outputs[state] = round_.index
                if len(state) in sequence.exports:
                    assert len(state) % chunk_size == 0, "states exist only at chunk boundaries"
                    returned[(round_.index, sequence.trajectory, len(state))] = state
        exported.update(returned)  # visible to later rounds only
    return outputs


def token_forks(token_lists, members):
    """{fork prefix length: number of distinct continuations} over every fork, from tokens."""
    continuations: dict[tuple[int, ...], set[int]] = {}
    for member in members:
        tokens = tuple(token_lists[member])
        for length in range(1, len(tokens)):
            continuations.setdefault(tokens[:length], set()).add(tokens[length])
    return [(len(prefix), len(nexts)) for prefix, nexts in continuations.items() if len(nexts) > 1]


@st.composite
def batches_and_groups(draw):
    chunk = draw(st.sampled_from([2, 3, 4, 8]))
    if draw(st.integers(0, 3)):
        token_lists = draw(forked_trees(chunk_size=chunk, max_segments=14, max_trees=3))
    else:
        token_lists = draw(token_trees(chunk_size=chunk, max_trajectories=10, max_length=30, vocab=3))
    whole = [tuple(range(len(token_lists)))]
    return token_lists, chunk, whole if draw(st.booleans()) else microbatch_split(draw, len(token_lists))


@settings(max_examples=100, deadline=None)
@given(batches_and_groups())
def test_plans_execute_and_are_minimal(case):
    token_lists, chunk, groups = case
    _, module = rounded(token_lists, chunk, groups)
    assert module.phase == Phase.ROUNDED
    verify(module)
    for microbatch in module.microbatches:
        outputs = execute(token_lists, chunk, microbatch)
        expected = {tuple(token_lists[t][: p + 1]) for t in microbatch.trajectories for p in range(len(token_lists[t]))}
        assert set(outputs) == expected, "every compact row is output exactly once"
        assert len(outputs) == microbatch.work
        for round_ in microbatch.rounds:
            for sequence in round_.sequences:
                assert 0 <= sequence.start - sequence.replay_start < chunk
                assert sequence.replay_start % chunk == 0
        # R of Eq. 15, from token-level forks.
        forks = token_forks(token_lists, microbatch.trajectories)
        assert microbatch.replay_tokens == sum((k - 1) * (p % chunk) for p, k in forks)

        segments = microbatch.segments
        parents = [s.parent for s in segments]
        starts = [s.start for s in segments]
        ends = [s.end for s in segments]
        # Several trees: each is planned alone, and the microbatch needs the worst of them.
        roots = [s.id for s in segments if s.parent < 0]
        per_tree = []
        for root in roots:
            members = [s.id for s in segments if _root_of(parents, s.id) == root]
            renumber = {old: new for new, old in enumerate(members)}
            per_tree.append(
                plan_forest(
                    [renumber[parents[v]] if parents[v] >= 0 else -1 for v in members],
                    [starts[v] for v in members],
                    [ends[v] for v in members],
                    chunk,
                ).num_rounds
            )
        assert len(microbatch.rounds) == max(per_tree)
        if len(all_choices(tree_children(parents))) <= 256:
            assert len(microbatch.rounds) == brute_force_rounds_fixpoint(parents, starts, ends, chunk)


@settings(max_examples=80, deadline=None)
@given(segment_trees(max_segments=15, chunk_sizes=(2, 3, 4)))
def test_plans_of_batches_built_from_segment_trees(tree):
    """Deep and bushy trees (up to four rounds) through the passes: same call count as the plain plan."""
    parents, starts, ends, chunk = tree
    token_lists = segment_tree_tokens(parents, starts, ends)
    _, module = rounded(token_lists, chunk)
    verify(module)
    (microbatch,) = module.microbatches
    # Single-child segments of the plain tree merge in the IR; the call count must not change.
    assert len(microbatch.rounds) == plan_forest(parents, starts, ends, chunk).num_rounds
    assert microbatch.replay_tokens == sum((k - 1) * (p % chunk) for p, k in token_forks(token_lists, range(len(token_lists))))
    outputs = execute(token_lists, chunk, microbatch)
    assert len(outputs) == microbatch.work


def _root_of(parents, segment):
    while parents[segment] >= 0:
        segment = parents[segment]
    return segment


@pytest.mark.parametrize("chunk", [4, 16])
def test_boundary_cases_as_in_section_3_3(chunk):
    """Fork at B-1: same round, replay B-1 from S_0. At B: next round, replay 0 from S_B. At B+1: replay 1."""
    cases = {chunk - 1: (1, 0, None, chunk - 1), chunk: (2, 1, chunk, 0), chunk + 1: (2, 1, chunk, 1)}
    for fork, (calls, side_round, source_position, replay) in cases.items():
        trunk = [50 + i for i in range(fork)]
        _, module = rounded([trunk + [1, 2, 3], trunk + [7, 8]], chunk)
        microbatch = module.microbatches[0]
        assert len(microbatch.rounds) == calls
        first = microbatch.rounds[0].sequences[0]
        assert (first.trajectory, first.start, first.replay_start, first.state_from) == (0, 0, 0, None)
        (side,) = [s for r in microbatch.rounds for s in r.sequences if s.trajectory == 1]
        side_index = next(r.index for r in microbatch.rounds if side in r.sequences)
        assert side_index == side_round
        assert side.start == fork and side.start - side.replay_start == replay
        if source_position is None:
            assert side.state_from is None and side.replay_start == 0
            assert first.exports == ()
        else:
            assert (side.state_from.round, side.state_from.trajectory, side.state_from.position) == (0, 0, source_position)
            assert first.exports == (source_position,)
        assert microbatch.replay_tokens == fork % chunk


def test_figure_2_gives_two_calls():
    b = 64
    trunk = list(range(1000, 1000 + b - 1))  # v0 = [0, B-1)
    v1 = trunk + [1, 2]  # v1 = [B-1, B+1)
    token_lists = [v1 + [3] * 10, v1 + [4] * 6, trunk + [5] * 9]  # v3, v4 under v1; v2 under v0
    _, module = rounded(token_lists, b)
    microbatch = module.microbatches[0]
    assert len(microbatch.rounds) == 2
    first, second = microbatch.rounds
    assert [(s.trajectory, s.replay_start, s.start, s.end, s.state_from) for s in first.sequences] == [
        (0, 0, 0, b + 11, None),
        (2, 0, b - 1, b + 8, None),
    ]
    assert first.sequences[0].exports == (b,)
    (v4,) = second.sequences
    assert (v4.trajectory, v4.replay_start, v4.start) == (1, b, b + 1)
    assert (v4.state_from.round, v4.state_from.trajectory, v4.state_from.position) == (0, 0, b)
    assert microbatch.replay_tokens == (b - 1) + 1
    assert execute(token_lists, b, microbatch)


def test_same_round_launch_reuses_the_carrying_sequence_initial_state():
    b = 4
    # Round 0 exports S_4; the side branch at 5 starts from it in round 1 and its own
    # children fork at 6 and 7, inside the chunk [4, 8): they launch in round 1 too, from S_4.
    trunk = [9, 9, 9, 9, 9]
    token_lists = [trunk + [1, 1, 1, 1], trunk + [2, 3, 3], trunk + [2, 4, 5], trunk + [2, 4, 6, 6]]
    _, module = rounded(token_lists, b)
    microbatch = module.microbatches[0]
    verify(module)
    assert len(microbatch.rounds) == 2
    later = microbatch.rounds[1].sequences
    assert len(later) == 3
    assert {s.state_from for s in later} == {microbatch.rounds[1].sequences[0].state_from}
    assert all(s.replay_start == 4 for s in later)
    assert microbatch.replay_tokens == 1 + 2 + 3
    execute(token_lists, b, microbatch)


def test_multi_tree_microbatch_takes_the_deepest_tree():
    b = 4
    deep = [[1] * 4 + [2] * 4 + [3], [1] * 4 + [2] * 4 + [4], [1] * 4 + [5]]  # forks at 4 and 8
    flat = [[7, 7, 1], [7, 7, 2]]  # one fork at 2: one call
    _, module = rounded(deep + flat, b, groups=[(0, 1, 2, 3, 4), (3, 4)])
    both, flat_only = module.microbatches
    assert len(flat_only.rounds) == 1
    assert len(both.rounds) == 2
    assert {s.trajectory for s in both.rounds[0].sequences} >= {0, 3, 4}


def test_pass_needs_segments():
    # the pass manager enforces the input phase; the pass does not check it again
    batch, module = scheduled_module([[1, 2], [1, 3]], 4)
    with pytest.raises(PipelineError, match="min-call-rounds"):
        run_pipeline(module, [MinCallRounds()], PassContext(batch=batch))


def test_passes_are_registered():
    assert PASS_REGISTRY["segment"] is SegmentPass
    assert PASS_REGISTRY["min-call-rounds"] is MinCallRounds


@pytest.mark.skipif("partition-microbatches" not in PASS_REGISTRY or "schedule-slots" not in PASS_REGISTRY, reason="microbatch planner not available")
@settings(max_examples=15, deadline=None)
@given(st.sampled_from([4, 8]).flatmap(lambda b: st.tuples(st.just(b), forked_trees(chunk_size=b, max_trees=3))))
def test_full_pipeline(case):
    import harts.compiler

    chunk, token_lists = case
    plan = harts.compiler.compile(
        harts.RolloutBatch.from_trajectories(token_lists), capacity=max(len(t) for t in token_lists) * 2, chunk_size=chunk
    )
    verify(plan.module)
    assert plan.module.phase == Phase.ROUNDED
    for microbatch in plan.module.microbatches:
        outputs = execute(token_lists, chunk, microbatch)
        assert len(outputs) == microbatch.work


# ----------------------------------------------------------------- verify_rounded catches damage


def _damaged(module, edit):
    microbatch = module.microbatches[0]
    rounds = [list(r.sequences) for r in microbatch.rounds]
    replay = edit(rounds, microbatch)
    new_rounds = tuple(attrs.evolve(r, sequences=tuple(rounds[i])) for i, r in enumerate(microbatch.rounds) if i < len(rounds))
    changed = attrs.evolve(microbatch, rounds=new_rounds, replay_tokens=microbatch.replay_tokens if replay is None else replay)
    return attrs.evolve(module, microbatches=(changed,) + module.microbatches[1:])


def _set(rounds, r, i, **changes):
    rounds[r][i] = attrs.evolve(rounds[r][i], **changes)


@pytest.fixture(scope="module")
def figure_2_module():
    b = 8
    trunk = list(range(100, 100 + b - 1))
    v1 = trunk + [1, 2]
    token_lists = [v1 + [3] * 10, v1 + [4] * 6, trunk + [5] * 9]
    return rounded(token_lists, b)[1]


CORRUPTIONS = {
    # state taken from the same round: not ready before the call
    "not ready before round 1": lambda rs, mb: _set(rs, 1, 0, state_from=attrs.evolve(rs[1][0].state_from, round=1)),
    # replay one full chunk longer
    "replays 9 rows": lambda rs, mb: _set(rs, 1, 0, replay_start=0, state_from=None),
    "not a multiple of the chunk size": lambda rs, mb: _set(rs, 1, 0, replay_start=7, state_from=attrs.evolve(rs[1][0].state_from, position=7)),
    "state_from position 0 differs from replay_start 8": lambda rs, mb: _set(rs, 1, 0, state_from=attrs.evolve(rs[1][0].state_from, position=0)),
    "segment 4 is run by no input sequence": lambda rs, mb: rs[0].pop(),
    "round 1, trajectory 1: span \\[8, 15\\) differs from its segments": lambda rs, mb: _set(rs, 1, 0, start=8),
    "round 1, trajectory 0: segment 0 is also run": lambda rs, mb: rs[1].append(rs[0][0]),
    "replay_tokens 3": lambda rs, mb: 3,
    "not exported by trajectory 0": lambda rs, mb: _set(rs, 0, 0, exports=()),
    "no later sequence starts from it": lambda rs, mb: _set(rs, 0, 1, exports=(8,)),
    "round 1, trajectory 1: starts from the zero state but replays from 8": lambda rs, mb: _set(rs, 1, 0, state_from=None),
    "no sequence of trajectory 1 runs in round 0": lambda rs, mb: _set(rs, 1, 0, state_from=attrs.evolve(rs[1][0].state_from, trajectory=1)),
    "state at 8 is not exported by trajectory 2": lambda rs, mb: _set(rs, 1, 0, state_from=attrs.evolve(rs[1][0].state_from, trajectory=2)),
    "not a leaf segment": lambda rs, mb: _set(rs, 0, 0, segments=(0, 1), end=9),
}


@pytest.mark.parametrize("expected", list(CORRUPTIONS))
def test_verify_rounded_catches(figure_2_module, expected):
    verify_rounded(figure_2_module)
    damaged = _damaged(figure_2_module, CORRUPTIONS[expected])
    with pytest.raises(IRVerificationError, match=f"microbatch 0.*({expected})"):
        verify_rounded(damaged)


def test_verify_rounded_catches_a_state_of_another_prefix():
    b = 4
    token_lists = [[1, 1, 1, 1, 1, 5], [1, 1, 1, 1, 1, 6], [1, 1, 2, 2, 2, 7], [1, 1, 2, 2, 2, 8]]
    _, module = rounded(token_lists, b)
    verify_rounded(module)
    microbatch = module.microbatches[0]
    # Swap the producers of the two S_4 states the side branches start from.
    late = list(microbatch.rounds[1].sequences)
    assert len(late) == 2
    a, c = late
    late = [attrs.evolve(a, state_from=c.state_from), attrs.evolve(c, state_from=a.state_from)]
    broken = attrs.evolve(microbatch, rounds=(microbatch.rounds[0], attrs.evolve(microbatch.rounds[1], sequences=tuple(late))))
    with pytest.raises(IRVerificationError, match="microbatch 0, round 1, trajectory .*another prefix"):
        verify_rounded(attrs.evolve(module, microbatches=(broken,)))
