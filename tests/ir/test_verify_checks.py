"""Every check of the vectorised verifiers still fires: a verified module, mutated one invariant at a time.

The laid-out verifier checks all microbatches at once and compares row and token arrays run by run
(one neighbour difference instead of the expected array), and ``verify(module, verified=...)`` skips
the phases a module shares object for object with a verified one. These tests break one thing of a
real compiled plan (several microbatches, shared prefixes, replay and state hand-offs) and check that
the verifier names it; the hypothesis test in ``tests/codegen/test_laid_out_phase.py`` changes random
entries of random arrays.
"""

from __future__ import annotations

import re

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harts
from harts.errors import IRVerificationError
from harts.ir.layout import ARRAY_FIELDS, RUNS_FIELDS, LaidOutModule, RunsArray
from harts.ir.nodes import Phase
from harts.ir.verify import verify
from harts.rollouts.workloads import swe_like_step


@pytest.fixture(scope="module")
def stage() -> LaidOutModule:
    batch = swe_like_step(seed=2, scale=0.03, vocab_size=500)
    plan = harts.compile(batch, capacity=2600, dp_size=2, chunk_size=16)
    stage = LaidOutModule(module=plan.module, layouts=plan.layouts)
    assert len(stage.layouts) >= 4
    assert any(layout.ancestor_rows.size and layout.export_position.size for layout in stage.layouts)
    return stage


def _with(stage: LaidOutModule, microbatch: int, **arrays) -> LaidOutModule:
    layouts = list(stage.layouts)
    layouts[microbatch] = attrs.evolve(layouts[microbatch], **arrays)
    return LaidOutModule(module=stage.module, layouts=tuple(layouts))


def _busiest(stage: LaidOutModule) -> int:
    """A microbatch that is not the first and has every kind of array non-empty (exports, ancestors)."""
    return max(range(1, len(stage.layouts)), key=lambda k: (stage.layouts[k].export_position.size > 0,
                                                             stage.layouts[k].ancestor_rows.size > 0, k))


@pytest.mark.parametrize("field", ARRAY_FIELDS)
def test_every_layout_array_is_checked_entry_by_entry(stage, field):
    verify(stage)
    k = _busiest(stage)
    values = getattr(stage.layouts[k], field).copy()
    if not values.size:
        pytest.skip(f"{field} is empty in this microbatch")
    # the middle entry: neither a run's first entry (checked by value) alone nor the last
    entry = values.size // 2
    values[entry] += 1 if values[entry] < values.max() else -1
    with pytest.raises(IRVerificationError, match=f"microbatch {k}") as caught:
        verify(_with(stage, k, **{field: values}))
    message = str(caught.value)
    # the check that fires names the array, or (for the map m) the trajectory, position and row
    assert field in message or "maps to layout row" in message or "state source" in message, message


def test_the_map_check_names_the_trajectory_position_and_row(stage):
    k = _busiest(stage)
    layout = stage.layouts[k]
    rows = layout.trajectory_rows.copy()
    member_end = int(layout.trajectory_offsets[1])
    # inside the first member's first trie node: the run check, not its first value, must catch it
    rows[[1, 2]] = rows[[2, 1]]
    with pytest.raises(IRVerificationError, match=re.escape(
            f"microbatch {k}: trajectory {int(layout.trajectories[0])}, position 1 maps to layout row {int(rows[1])}")):
        verify(_with(stage, k, trajectory_rows=rows))
    assert member_end > 2


def test_a_run_start_is_checked_by_value(stage):
    """Shifting a whole run keeps every step of 1 inside it: only the run's first value can catch it."""
    k = _busiest(stage)
    layout = stage.layouts[k]
    rows = layout.trajectory_rows.copy()
    start, end = int(layout.trajectory_offsets[-2]), int(layout.trajectory_offsets[-1])
    rows[start:end] = (rows[start:end] + 1) % layout.num_rows
    with pytest.raises(IRVerificationError, match=f"microbatch {k}: trajectory"):
        verify(_with(stage, k, trajectory_rows=rows))


def test_row_arrays_are_checked_as_runs(stage):
    k = _busiest(stage)
    layout = stage.layouts[k]
    for field, change in (("row_position", 1), ("row_trajectory", 1), ("row_multiplicity", 1)):
        values = getattr(layout, field).copy()
        values[: int(layout.seq_row_start[1])] += change  # a whole first sequence: steps inside it stay right
        with pytest.raises(IRVerificationError, match=f"microbatch {k}: layout field {field} differs from the rounds at entry 0"):
            verify(_with(stage, k, **{field: values}))


def test_verifying_against_a_verified_module_reruns_what_changed(stage):
    rounded = stage.module
    verify(rounded)
    verify(rounded, verified=rounded)  # nothing changed, nothing to find
    node = rounded.trie.nodes[0]
    broken_trie = attrs.evolve(rounded.trie, nodes=(attrs.evolve(node, multiplicity=node.multiplicity + 1),) + rounded.trie.nodes[1:])
    with pytest.raises(IRVerificationError, match="multiplicity"):
        verify(attrs.evolve(rounded, trie=broken_trie), verified=rounded)
    first = rounded.microbatches[0]
    heavier = (attrs.evolve(first, work=first.work + 1),) + rounded.microbatches[1:]
    with pytest.raises(IRVerificationError, match="microbatch 0: work"):
        verify(attrs.evolve(rounded, microbatches=heavier), verified=rounded)
    swapped = (attrs.evolve(first, slot=rounded.microbatches[1].slot, replica=rounded.microbatches[1].replica),) + rounded.microbatches[1:]
    with pytest.raises(IRVerificationError, match="both run on replica"):
        verify(attrs.evolve(rounded, microbatches=swapped), verified=rounded)
    with pytest.raises(IRVerificationError, match="capacity"):
        verify(attrs.evolve(rounded, capacity=1), verified=rounded)


def test_verifying_against_a_verified_module_skips_the_unchanged_phases(stage, monkeypatch):
    import harts.ir.verify as verify_module

    calls = []
    checks = tuple((phase, (lambda check, phase: lambda module: (calls.append(phase), check(module)))(check, phase))
                   for phase, check in verify_module.phase_checks())
    monkeypatch.setattr(verify_module, "phase_checks", lambda: checks)
    rounded = stage.module
    verify(rounded, verified=rounded)
    assert calls == []
    resegmented = attrs.evolve(rounded, microbatches=tuple(attrs.evolve(mb, segments=tuple(list(mb.segments))) for mb in rounded.microbatches))
    verify(resegmented, verified=rounded)
    assert calls == [Phase.SEGMENTED, Phase.ROUNDED]  # new segment tuples: their checks and the later ones
    calls.clear()
    verify(stage, verified=rounded)
    assert calls == [Phase.LAID_OUT]
    calls.clear()
    verify(rounded)
    assert calls == [Phase.LOWERED, Phase.COMPRESSED, Phase.PARTITIONED, Phase.SCHEDULED, Phase.SEGMENTED, Phase.ROUNDED]
    assert np.all([mb.rounds is not None for mb in rounded.microbatches])


#: the layout arrays the verifier checks as runs (read off their runs, or off one scan of an array), and each
#: one's step inside a run
_STEPS = {"trajectory_rows": 1, "ancestor_rows": 1, "row_position": 1, "row_trajectory": 0, "row_multiplicity": 0}
_RUN_CHECKED = tuple(_STEPS)


def _as_runs(values: np.ndarray, step: int) -> RunsArray:
    """``values`` as runs that all go up by ``step`` (a run wherever it stops doing so), as lay-out builds them."""
    starts = np.concatenate(([0], np.flatnonzero(np.diff(values) != step) + 1)) if values.size else np.zeros(0, dtype=np.int64)
    lengths = np.diff(np.append(starts, values.size))
    return RunsArray.from_runs(values[starts], np.full(starts.size, step), lengths)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_changed_row_or_token_array_is_reported_at_its_first_wrong_entry(stage, data):
    """The run checks read each long array once (its breaks, where it stops going up by its step) and never build
    the expected array: whatever entries change, the message names the first one that differs from the layout
    built, with the value found and the value the rounds need, as a whole-array comparison would."""
    k = data.draw(st.integers(0, len(stage.layouts) - 1), label="microbatch")
    layout = stage.layouts[k]
    name = data.draw(st.sampled_from([f for f in _RUN_CHECKED if getattr(layout, f).size]), label="field")
    good = getattr(layout, name)
    values = good.copy()
    entries = data.draw(st.lists(st.integers(0, values.size - 1), min_size=1, max_size=4, unique=True), label="entries")
    for entry in entries:
        values[entry] = data.draw(st.integers(0, layout.num_rows - 1).filter(lambda v, e=entry: v != good[e]), label="value")
    first = min(entries)
    with pytest.raises(IRVerificationError) as caught:
        verify(_with(stage, k, **{name: values}))
    # the same entries held as runs (as lay-out holds its arrays): read off the runs, never expanded, same message
    with pytest.raises(IRVerificationError) as caught_as_runs:
        verify(_with(stage, k, **{name: _as_runs(values, _STEPS[name])}))
    assert str(caught_as_runs.value) == str(caught.value)
    if name == "trajectory_rows":
        member = int(np.searchsorted(layout.trajectory_offsets, first, side="right")) - 1
        expected = (f"microbatch {k}: trajectory {int(layout.trajectories[member])}, position "
                    f"{first - int(layout.trajectory_offsets[member])} maps to layout row {int(values[first])}, which holds another token prefix")
    else:
        expected = (f"microbatch {k}: layout field {name} differs from the rounds at entry {first} "
                    f"({int(values[first])}, expected {int(good[first])})")
    assert str(caught.value) == expected


@pytest.mark.parametrize("name", ["trajectory_rows", "ancestor_rows"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [-1, "rows"])
def test_a_row_outside_the_layout_is_a_structure_problem_wherever_it_is(stage, name, where, bad):
    """The range of the map and of the ancestor rows is read off the same scan (each run's first and last entry):
    a row out of range anywhere, inside a run or at either end of the array, is still named as before."""
    k = _busiest(stage)
    layout = stage.layouts[k]
    values = getattr(layout, name).copy()
    entry = {"first": 0, "middle": values.size // 2, "last": values.size - 1}[where]
    values[entry] = -1 if bad == -1 else layout.num_rows
    for held in (values, _as_runs(values, 1)):
        with pytest.raises(IRVerificationError, match=re.escape(f"microbatch {k}: layout: {name} holds a row outside [0, {layout.num_rows})")):
            verify(_with(stage, k, **{name: held}))


def test_compiling_verifies_the_long_arrays_from_their_runs_without_expanding_them():
    """lay-out hands the long arrays over as runs and the verifier reads only those: a compiled plan holds none
    expanded; reading one expands it once (the same read-only array from then on), equal to a layout given arrays."""
    plan = harts.compile(swe_like_step(seed=3, scale=0.03, vocab_size=500), capacity=2600, dp_size=2, chunk_size=16)
    stage = LaidOutModule(module=plan.module, layouts=plan.layouts)
    assert all(layout.runs_array(name).runs is not None and layout.runs_array(name)._array is None
               for layout in stage.layouts for name in RUNS_FIELDS)
    layout = stage.layouts[_busiest(stage)]
    rows = layout.trajectory_rows
    assert rows is layout.trajectory_rows and not rows.flags.writeable
    as_arrays = attrs.evolve(layout, **{name: np.array(getattr(layout, name)) for name in RUNS_FIELDS})
    assert as_arrays == layout and layout == as_arrays
    assert all(as_arrays.runs_array(name).runs is None for name in RUNS_FIELDS)


def test_a_layout_that_is_not_one_is_named_after_the_faults_of_the_layouts_before_it(stage):
    """The headers are checked layout after layout: a structure fault in an earlier layout is named before a later
    entry that is not a layout at all, and that entry is named when the layouts before it are sound."""
    k = _busiest(stage)
    layout = stage.layouts[k]
    not_a_layout = list(stage.layouts)
    not_a_layout[k] = "layout"
    with pytest.raises(IRVerificationError, match=f"microbatch {k}: expected a MicrobatchLayout, got str"):
        verify(LaidOutModule(module=stage.module, layouts=tuple(not_a_layout)))
    rows = stage.layouts[0].trajectory_rows.copy()
    rows[0] = -1
    not_a_layout[0] = attrs.evolve(stage.layouts[0], trajectory_rows=rows)
    with pytest.raises(IRVerificationError, match=re.escape("microbatch 0: layout: trajectory_rows holds a row outside")):
        verify(LaidOutModule(module=stage.module, layouts=tuple(not_a_layout)))
    assert layout.num_rows


def test_the_state_source_lcps_read_at_once_are_each_sequences_own(stage):
    """The rounds verifier reads the LCP of every state reader with its source from one sparse-table sweep: the
    LCP of those two trajectories, for every sequence that starts from a state."""
    from harts.ir.prefix_index import PrefixIndex
    from harts.ir.verify_rounds import _state_source_lcps

    module = stage.module
    prefixes = PrefixIndex.from_module(module)
    shared_of = _state_source_lcps(module, prefixes)
    readers = [s for mb in module.microbatches for r in mb.rounds for s in r.sequences if s.state_from is not None]
    assert readers and len(shared_of) == len(readers)
    for sequence in readers:
        assert shared_of[id(sequence)] == prefixes.lcp_trajectories(sequence.state_from.trajectory, sequence.trajectory)
        assert shared_of[id(sequence)] >= sequence.state_from.position
