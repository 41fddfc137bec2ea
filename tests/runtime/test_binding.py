"""Plan.bind: where a plan meets a batch (hash, trajectories, shared-row tokens, vocabulary, routed experts).

A plan whose input hash was forged for another batch must not run silently on it (issue 24 item 7):
binding gathers every compact row's token once and refuses rows whose trajectories disagree,
naming them and the position. Fields that do not change the computation may be added after
compiling (issue 26 item 5).
"""

from __future__ import annotations

import copy

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import harts
from harts.binding import BoundPlan
from harts.errors import ModelInputError, PlanArtifactError, PlanBatchMismatchError
from harts.plan import Plan
from harts.runtime import log_probs, log_probs_baseline
from harts.train import TrainConfig, Trainer
from tests.helpers import figure_batch, forked_batch, rl_batch, tiny_model, token_trees


def _forged(plan: Plan, batch) -> Plan:
    """``plan`` with its input hash (and nothing else) swapped for ``batch``'s, as an edited artifact would be."""
    return attrs.evolve(plan, module=attrs.evolve(plan.module, input_hash=batch.input_hash()))


def _with_tokens(batch, trajectory: int, position: int, token: int):
    tokens = [t.tolist() for t in batch.tokens]
    tokens[trajectory][position] = token
    return harts.RolloutBatch.from_trajectories(tokens, tree_ids=batch.tree_ids)


def _shared_row(layout) -> tuple[int, int]:
    """(trajectory, position) of a row that two member trajectories pass through: the second member
    (in member order) through it, so the first one still carries the row's original value
    (whichever sequence the planner lets compute the row)."""
    row = int(np.flatnonzero(layout.row_multiplicity > 1)[0])
    members = [int(t) for t in layout.trajectories]
    through = []
    for member, trajectory in enumerate(members):
        rows = layout.trajectory_rows[layout.trajectory_offsets[member] : layout.trajectory_offsets[member + 1]]
        hits = np.flatnonzero(rows == row)
        if hits.size:
            through.append((trajectory, int(hits[0])))
    if len(through) < 2:
        raise AssertionError("no second trajectory through the shared row")
    return through[1]


def test_forged_hash_on_a_shared_row_is_refused_naming_trajectories_and_position():
    batch = figure_batch()
    plan = harts.compile(batch, capacity=64, chunk_size=4)
    trajectory, position = _shared_row(plan.layout(0))
    other = _with_tokens(batch, trajectory, position, 99)
    forged = _forged(plan, other)
    model = tiny_model()
    with pytest.raises(PlanBatchMismatchError, match=rf"field 'tokens': trajectories \d+ and {trajectory} share the token at position {position}"):
        log_probs(model, forged, other)
    with pytest.raises(PlanBatchMismatchError, match="share the token"):
        forged.bind(other)
    trainer = Trainer(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(PlanBatchMismatchError, match="share the token"):
        trainer.step(rl_batch([t.tolist() for t in other.tokens]), _forged(plan, rl_batch([t.tolist() for t in other.tokens])))


def test_forged_hash_with_other_lengths_is_refused():
    batch = figure_batch()
    plan = harts.compile(batch, capacity=64, chunk_size=4)
    longer = harts.RolloutBatch.from_trajectories([list(t) + [1] for t in batch.tokens])
    with pytest.raises(PlanBatchMismatchError, match="trajectory 0: the plan was compiled for 11 tokens, the batch holds 12"):
        _forged(plan, longer).bind(longer)
    fewer = batch.subset(list(range(len(batch) - 1)))
    with pytest.raises(PlanBatchMismatchError, match="the plan holds 7 trajectories, the batch 6"):
        _forged(plan, fewer).bind(fewer)


@settings(max_examples=10, deadline=None)
@given(token_trees(chunk_size=4, max_trajectories=6, max_length=14), st.data())
def test_binding_gathers_row_tokens_and_a_forged_plan_is_right_or_refused(trajectories, data):
    """The bound row tokens are the rows' tokens; a forged plan either fails on a shared row or, when
    the new tokens differ only on rows of one trajectory, computes the other batch's log-probs exactly."""
    batch = harts.RolloutBatch.from_trajectories(trajectories)
    plan = harts.compile(batch, capacity=1 << 20, chunk_size=4)
    bound = plan.bind(batch)
    for layout, tokens in zip(plan.layouts, bound.row_tokens):
        np.testing.assert_array_equal(tokens, layout.input_ids(batch.tokens))
        assert not tokens.flags.writeable
    trajectory = data.draw(st.integers(0, len(trajectories) - 1))
    if len(trajectories[trajectory]) == 0:
        return
    position = data.draw(st.integers(0, len(trajectories[trajectory]) - 1))
    other = _with_tokens(batch, trajectory, position, 7)  # token trees draw ids below 5: always a change
    forged = _forged(plan, other)
    layout = next(l for l in plan.layouts if trajectory in l.trajectories)
    shared = layout.row_multiplicity[layout.rows_of_trajectory(trajectory)[position]] > 1
    model = tiny_model()
    if shared:
        with pytest.raises(PlanBatchMismatchError, match=f"position {position}"):
            log_probs(model, forged, other)
    else:
        got = log_probs(model, forged, other).packed
        torch.testing.assert_close(got, log_probs_baseline(model, other, chunk_size=4).packed, rtol=0, atol=1e-10)


def test_fields_added_after_compiling_keep_the_plan():
    """A plan binds to tokens, structure and routed experts; log-prob and advantage fields may come later."""
    batch = forked_batch()
    plan = harts.compile(batch, capacity=40, chunk_size=4)
    lengths = [len(t) for t in batch.tokens]
    later = harts.RolloutBatch(
        tokens=batch.tokens,
        token_fields={**batch.token_fields, "old_log_probs": tuple(np.full(n, -1.0) for n in lengths)},
        trajectory_fields={**batch.trajectory_fields, "advantages": np.arange(len(lengths), dtype=np.float64)},
        tree_ids=batch.tree_ids,
    )
    assert later.content_hash() != batch.content_hash()
    assert later.input_hash() == batch.input_hash() == plan.input_hash
    model = tiny_model()
    bound = plan.bind(batch, model)
    for given_plan in (plan, bound):
        out = log_probs(model, given_plan, later)
        torch.testing.assert_close(out.packed, log_probs(model, plan, batch).packed, rtol=0, atol=0)
        assert out.input_hash == plan.input_hash
    other = harts.RolloutBatch.from_trajectories([list(t) + [1] for t in batch.tokens])
    with pytest.raises(PlanBatchMismatchError, match="not for this batch"):
        bound.for_batch(other)


def test_runtime_takes_only_a_laid_out_plan_or_a_bound_one():
    batch = figure_batch()
    plan = harts.compile(batch, capacity=64, chunk_size=4)
    model = tiny_model()
    with pytest.raises(ModelInputError, match="expected a harts.Plan .* got Module"):
        log_probs(model, plan.module, batch)
    early = harts.compile(batch, capacity=64, chunk_size=4, pipeline="lower,prefix-compress")
    with pytest.raises(PlanArtifactError, match="laid-out plan"):
        log_probs(model, early, batch)
    with pytest.raises(PlanArtifactError, match="rounded plan is laid out"):
        Plan(module=plan.module, pipeline=plan.pipeline, stats=plan.stats)
    assert isinstance(plan.bind(batch), BoundPlan)


def test_plan_stage_is_built_once():
    plan = harts.compile(figure_batch(), capacity=64, chunk_size=4)
    assert plan.stage is plan.stage
    assert plan.stage.layouts is plan.layouts


def test_layout_arrays_are_read_only(tmp_path):
    plan = harts.compile(figure_batch(), capacity=64, chunk_size=4)
    loaded = harts.load_plan(plan.save(tmp_path / "plan"))
    for layout in (plan.layouts[0], loaded.layouts[0]):
        before = layout.row_trajectory.copy()
        with pytest.raises(ValueError, match="read-only"):
            layout.row_trajectory[0] = 99
        with pytest.raises(ValueError, match="read-only"):
            layout.trajectory_rows[:] = 0
        np.testing.assert_array_equal(layout.row_trajectory, before)


def test_fast_kernel_chunk_limits_surface_at_compile_time(tmp_path):
    """One chunk size, the plan's: compiled for the fast kernels, a chunk they cannot take is refused up front."""
    batch = figure_batch()
    with pytest.raises(harts.PipelineError, match="chunk_size' is 16, but the fast linear-attention kernels take chunk sizes 32 or 64"):
        harts.compile(batch, chunk_size=16, fast_kernels=True)
    plan = harts.compile(batch, chunk_size=32, fast_kernels=True)
    assert plan.fast_kernels and plan.chunk_size == 32 == plan.layouts[0].chunk_size
    assert harts.load_plan(plan.save(tmp_path / "plan")).fast_kernels
    assert not harts.compile(batch, chunk_size=16).fast_kernels
    from harts.kernels.linear_attention.chunk import SUPPORTED_CHUNK_SIZES
    from harts.options import FAST_KERNEL_CHUNK_SIZES

    assert SUPPORTED_CHUNK_SIZES is FAST_KERNEL_CHUNK_SIZES


def test_one_chunk_size_the_plans_reaches_the_kernels():
    """Every linear-attention call of a plan runs at the plan's chunk size (the model config has none)."""
    batch = figure_batch()
    model = tiny_model()
    assert not hasattr(model.config, "chunk_size")
    seen = []

    class Recording:
        def __getattr__(self, name):
            return getattr(harts.kernels.naive, name)

        def chunk_linear_attention(self, *args, chunk_size, **kwargs):
            seen.append(chunk_size)
            return harts.kernels.naive.chunk_linear_attention(*args, chunk_size=chunk_size, **kwargs)

    for chunk in (4, 8):
        seen.clear()
        log_probs(model, harts.compile(batch, chunk_size=chunk), batch, kernels=Recording())
        assert seen and set(seen) == {chunk}
