"""The ``laid_out`` phase: one verifier, a text form that parses back, the stage in every dump."""

from __future__ import annotations

import re

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import harts
from harts.codegen.layout import build_layout, lay_out
from harts.errors import IRParseError, IRVerificationError, PipelineError, PlanArtifactError
from harts.ir.layout import ARRAY_FIELDS, LaidOutModule, MicrobatchLayout
from harts.ir.nodes import Module, Phase
from harts.ir.text import parse_ir, print_ir
from harts.ir.verify import verify
from harts.passes import PassContext
from harts.passes.lay_out import LayOut
from harts.passes.manager import DumpIR, run_pipeline
from tests.helpers import token_trees


@st.composite
def laid_out_plans(draw, max_trajectories=7, max_length=30):
    """A compiled plan (several microbatches when the capacity is small) and its chunk size."""
    chunk_size = draw(st.sampled_from([2, 4, 8]))
    trajectories = draw(token_trees(chunk_size=chunk_size, max_trajectories=max_trajectories, max_length=max_length))
    capacity = draw(st.sampled_from([max(len(t) for t in trajectories), 1 << 20]))
    return harts.compile(harts.RolloutBatch.from_trajectories(trajectories), capacity=capacity, chunk_size=chunk_size)


@settings(max_examples=25, deadline=None)
@given(laid_out_plans())
def test_codegen_is_the_last_stage_of_a_compiled_plan_and_verifies(plan):
    assert plan.pipeline.split(",")[-1] == "lay-out"
    assert plan.module.phase == Phase.ROUNDED and plan.stats["phase"] == "laid_out"
    stage = plan.stage
    assert isinstance(stage, LaidOutModule) and stage.phase == Phase.LAID_OUT
    verify(stage)
    assert stage == lay_out(plan.module)
    for mb in plan.microbatches:
        assert plan.layout(mb.index) is plan.layouts[mb.index]
        assert plan.layout(mb.index) == build_layout(plan.module, mb.index)


@settings(max_examples=25, deadline=None)
@given(laid_out_plans())
def test_the_laid_out_text_form_parses_back(plan):
    text = print_ir(plan.stage)
    assert parse_ir(text) == plan.stage
    assert print_ir(parse_ir(text)) == text


def test_long_arrays_print_as_runs_and_parse_back():
    tokens = list(range(1, 200))
    plan = harts.compile(harts.RolloutBatch.from_trajectories([tokens, tokens[:150] + [500, 501]]), chunk_size=16)
    text = print_ir(plan.stage)
    assert "trajectory_rows=Runs(start=[" in text
    assert parse_ir(text) == plan.stage
    with pytest.raises(IRParseError, match="array at offset"):
        parse_ir(text.replace("trajectory_rows=Runs(start=[0, 0", "trajectory_rows=Runs(start=[0, 0, 0", 1))


@settings(max_examples=30, deadline=None)
@given(plan=laid_out_plans(), data=st.data())
def test_the_verifier_catches_any_changed_entry_of_any_layout_array(plan, data):
    stage = plan.stage
    microbatch = data.draw(st.integers(0, len(stage.layouts) - 1), label="microbatch")
    layout = stage.layouts[microbatch]
    name = data.draw(st.sampled_from([f for f in ARRAY_FIELDS if getattr(layout, f).size]), label="field")
    values = getattr(layout, name).copy()
    entry = data.draw(st.integers(0, values.size - 1), label="entry")
    values[entry] += data.draw(st.sampled_from([-2, -1, 1, 2]), label="delta")
    layouts = list(stage.layouts)
    layouts[microbatch] = attrs.evolve(layout, **{name: values})
    with pytest.raises(IRVerificationError, match=f"microbatch {microbatch}"):
        verify(LaidOutModule(module=stage.module, layouts=tuple(layouts)))


_STRUCTURE_FIELDS = ("round_seq_start", "seq_row_start", "export_offsets", "ancestor_offsets", "trajectory_offsets",
                     "seq_state_source", "seq_state_export", "seq_trajectory", "export_chunk")


@settings(max_examples=60, deadline=None)
@given(laid_out_plans(), st.data())
def test_the_structure_checks_of_all_layouts_at_once_agree_with_each_layouts(plan, data):
    """The verifier checks every layout's structure in one sweep (``_structures_sound``); an edited offset or state
    array of any layout makes it fail exactly when that layout's own ``structure_problem`` names a fault, and the
    verifier then raises that layout's message."""
    from harts.ir.verify_layout import _check_headers, _structures_sound

    stage = plan.stage
    layouts = list(stage.layouts)
    microbatch = data.draw(st.integers(0, len(layouts) - 1), label="microbatch")
    name = data.draw(st.sampled_from(_STRUCTURE_FIELDS), label="field")
    values = getattr(layouts[microbatch], name).copy()
    how = data.draw(st.sampled_from(["shift", "drop", "extend"]) if values.size else st.just("extend"), label="edit")
    if how == "shift":
        values[data.draw(st.integers(0, values.size - 1), label="entry")] += data.draw(st.sampled_from([-2, -1, 1, 2, 50]), label="delta")
    elif how == "drop":
        values = values[:-1]
    else:
        values = np.append(values, data.draw(st.integers(-1, 60), label="value"))
    layouts[microbatch] = attrs.evolve(layouts[microbatch], **{name: values})
    broken = LaidOutModule(module=stage.module, layouts=tuple(layouts))
    problems = [layout.structure_problem() for layout in layouts]
    sound = all(problem is None for problem in problems)
    views = _check_headers(stage.module, stage.layouts)  # the views of the intact layouts, for the sweep's signature
    assert _structures_sound(stage.layouts, views)
    if sound:
        try:
            verify(broken)
        except IRVerificationError as error:
            assert "layout: " not in str(error)
    else:
        first = next(k for k, problem in enumerate(problems) if problem is not None)
        with pytest.raises(IRVerificationError, match=re.escape(f"microbatch {first}: layout: {problems[first]}")):
            verify(broken)


def test_the_verifier_names_what_is_wrong():
    plan = harts.compile(harts.RolloutBatch.from_trajectories([[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7]]), chunk_size=2)
    stage = plan.stage
    layout = stage.layouts[0]
    swapped = layout.trajectory_rows.copy()
    swapped[[1, 2]] = swapped[[2, 1]]
    cases = [
        (attrs.evolve(layout, trajectory_rows=swapped), "trajectory 0, position 1 maps to layout row 2, which holds another token prefix"),
        (attrs.evolve(layout, seq_state_chunk=np.array([-1, 0, 1])), "layout field seq_state_chunk differs from the rounds at entry 1 (0, expected 1)"),
        (attrs.evolve(layout, chunk_size=4), "the layout is of microbatch 0 at chunk size 4, expected microbatch 0 at chunk size 2"),
        (attrs.evolve(layout, ancestor_offsets=layout.ancestor_offsets[:-1]), "ancestor_offsets is not a valid offset array"),
    ]
    for broken, message in cases:
        with pytest.raises(IRVerificationError, match=re.escape(message)):
            verify(LaidOutModule(module=stage.module, layouts=(broken,)))
    with pytest.raises(IRVerificationError, match="one layout per microbatch: 1 microbatches, 0 layouts"):
        verify(LaidOutModule(module=stage.module, layouts=()))
    with pytest.raises(IRVerificationError, match="holds a rounded module, not segmented"):
        verify(LaidOutModule(module=attrs.evolve(stage.module, phase=Phase.SEGMENTED, microbatches=tuple(
            attrs.evolve(mb, rounds=None, replay_tokens=None) for mb in stage.module.microbatches)), layouts=stage.layouts))
    with pytest.raises(IRVerificationError, match="a Module cannot be at phase laid_out"):
        verify(attrs.evolve(stage.module, phase=Phase.LAID_OUT))


def test_codegen_runs_on_a_rounded_module_only():
    plan = harts.compile(harts.RolloutBatch.from_trajectories([[1, 2, 3], [1, 2, 4]]), pipeline="prefix-compress")
    with pytest.raises(PipelineError, match="pass 'lay-out' needs phase rounded but the module is compressed"):
        run_pipeline(plan.module, [LayOut()], PassContext())


def test_a_pipeline_that_reaches_the_rounded_phase_ends_in_codegen():
    batch = harts.RolloutBatch.from_trajectories([[1, 2, 3], [1, 2, 4]])
    plan = harts.compile(batch, chunk_size=2, pipeline="prefix-compress,partition-microbatches,schedule-slots,segment,min-call-rounds")
    assert plan.pipeline.endswith("min-call-rounds,lay-out") and plan.layouts is not None
    assert plan.stage == harts.compile(batch, chunk_size=2).stage
    assert harts.compile(batch, pipeline="prefix-compress").layouts is None


def test_dump_ir_shows_every_stage_lowering_and_codegen_included_and_each_parses_back(tmp_path):
    batch = harts.RolloutBatch.from_trajectories([[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7]])
    plan = harts.compile(batch, chunk_size=2, instruments=[DumpIR(tmp_path)])
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == [f"{n:03d}_{name}.txt" for n, name in enumerate(harts.DEFAULT_PIPELINE)]
    stages = [parse_ir(f.read_text()) for f in files]
    assert [stage.phase for stage in stages] == list(Phase)
    assert all(isinstance(stage, Module) for stage in stages[:-1])
    assert stages[-1] == plan.stage
    codegen_text = files[-1].read_text()
    assert "// ===== programs of microbatch 0 (replica 0, slot 0) =====" in codegen_text
    assert "// def forward(self, q, k, v, log_decay, beta, scale)" in codegen_text


@pytest.mark.parametrize("name", ["trajectory_rows", "ancestor_rows"])
@pytest.mark.parametrize("where", [0, -1])
def test_a_row_outside_the_layout_is_named_by_the_verifier_and_by_loading(name, where):
    """The row range check reads the rows as unsigned (one pass): a negative row and one past the last row are
    both out of range, wherever they are."""
    plan = harts.compile(harts.RolloutBatch.from_trajectories([[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7]]), chunk_size=2)
    stage = plan.stage
    layout = stage.layouts[0]
    for bad in (-1, layout.num_rows, -(1 << 62)):
        values = getattr(layout, name).copy()
        values[where] = bad
        broken = attrs.evolve(layout, **{name: values})
        assert broken.structure_problem() == f"{name} holds a row outside [0, {layout.num_rows})"
        with pytest.raises(IRVerificationError, match=re.escape(f"{name} holds a row outside")):
            verify(LaidOutModule(module=stage.module, layouts=(broken,)))
        with pytest.raises(PlanArtifactError, match=re.escape(f"{name} holds a row outside")):
            MicrobatchLayout.from_tensors(broken.to_tensors())


@settings(max_examples=15, deadline=None)
@given(laid_out_plans(max_trajectories=10))
def test_microbatches_laid_out_together_are_the_ones_laid_out_alone_and_share_no_writable_memory(plan):
    """lay_out builds each array once over every microbatch and hands each layout its part (a view): a layout must
    be the one its microbatch gets alone, and no write through any layout array may reach another layout."""
    together = lay_out(plan.module)
    assert together.layouts == tuple(build_layout(plan.module, mb.index) for mb in plan.module.microbatches)
    for layout in together.layouts:
        for name in ARRAY_FIELDS:
            array = getattr(layout, name)
            assert not array.flags.writeable
            with pytest.raises(ValueError):
                array[...] = 0
    verify(together)


@settings(max_examples=50, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(-50, 50), st.integers(-3, 3), st.integers(1, 6)), max_size=8))
def test_an_array_held_as_runs_reads_as_its_runs_expanded(runs):
    """A RunsArray expands to the entries of its runs (whatever their steps), once, read-only; pickles as it is held."""
    import pickle

    from harts.ir.layout import RunsArray, decode_arithmetic_runs

    starts, steps, lengths = (np.array([run[i] for run in runs], dtype=np.int64) for i in range(3))
    held = RunsArray.from_runs(starts, steps, lengths)
    assert held.size == int(lengths.sum())
    expected = decode_arithmetic_runs(starts, steps, lengths)
    copy = pickle.loads(pickle.dumps(held))
    array = held.array()
    assert np.array_equal(array, expected) and array is held.array() and not array.flags.writeable
    assert copy.runs is not None and np.array_equal(copy.array(), expected)
    assert held.outside(int(expected.max(initial=-1)) + 1) == bool(expected.size and expected.min() < 0)
    with pytest.raises(ValueError):
        RunsArray.from_runs(starts, steps, np.zeros_like(lengths) if lengths.size else np.zeros(1, dtype=np.int64))


@settings(max_examples=10, deadline=None)
@given(laid_out_plans())
def test_a_laid_out_plan_pickles_with_its_layouts(plan):
    import pickle

    assert pickle.loads(pickle.dumps(plan.stage)) == plan.stage
