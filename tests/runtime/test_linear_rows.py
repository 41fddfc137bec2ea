"""The linear-attention layers' packed rows (``TreeView.linear_rows``, ``harts.codegen.fx.linear_rows``).

A KDA / Gated DeltaNet layer on a layout with replay gathers its hidden rows into round order once
and runs projections, convolution and the chunkwise rounds there. Held here, in float64 on random
rollout trees with forks before, on and after chunk boundaries: the maps are inverse where they
must be, the packed order is what the rounds read, and the layer run on packed rows gives the
outputs and gradients (input and every parameter) of the same layer on the compact rows, which the
runtime equivalence tests hold to the trajectory-wise baseline.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from harts.codegen.fx import linear_rows, round_schedule
from harts.runtime import TreeView
from harts.runtime.layers import GatedDeltaNet, KimiDeltaAttention
from harts.runtime.tree_view import PackedRowsView
from harts.runtime.view import BaselineView, SameRows, linear_rows as rows_of_view
from tests.helpers import batches_with_groups, make_plan, tiny_model
from tests.helpers.runtime import forked_batch


class PackedTreeView(TreeView):
    pack_linear_rows = True


def test_the_default_view_runs_linear_attention_on_its_own_rows():
    for layout in _forked_layouts():
        assert isinstance(TreeView(layout).linear_rows(), SameRows)


def _layouts(plan):
    return [plan.layout(m) for m in range(len(plan.module.microbatches))]


def _forked_layouts(chunk: int = 4):
    batch = forked_batch(chunk)
    return _layouts(make_plan(batch, chunk))


def test_forked_batch_has_replay_and_packs():
    layouts = _forked_layouts()
    assert any(layout.replay_tokens for layout in layouts)
    for layout in layouts:
        rows = PackedTreeView(layout).linear_rows()
        if layout.replay_tokens:
            assert isinstance(rows, PackedRowsView)
            assert rows.num_rows == layout.num_rows + layout.replay_tokens
        else:
            assert isinstance(rows, SameRows)


def test_views_without_linear_rows_run_on_their_own_rows():
    view = BaselineView([3, 5], chunk_size=4)
    rows = rows_of_view(view)
    x = torch.randn(8, 2, dtype=torch.float64)
    assert rows.view is view and rows.pack(x) is x and rows.unpack(x) is x


def _check_packed_order(layout):
    packed = linear_rows(layout)
    schedules = [round_schedule(layout, r) for r in range(layout.num_rounds)]
    bounds = packed["round_bounds"]
    # each round's slice is exactly what the compact program gathers for that round
    for r, schedule in enumerate(schedules):
        np.testing.assert_array_equal(packed["rows"][bounds[r] : bounds[r + 1]], schedule["rows"])
    # every compact row has one own packed row, holding that row
    np.testing.assert_array_equal(packed["rows"][packed["own"]], np.arange(layout.num_rows))
    assert np.unique(packed["own"]).size == layout.num_rows
    # the packed sequences: one per compact sequence, each replay then own rows
    lengths = np.diff(packed["sequence_bounds"])
    expected = (layout.seq_row_start[1:] - layout.seq_row_start[:-1]) + (layout.seq_start - layout.seq_replay_start)
    np.testing.assert_array_equal(lengths, expected)
    assert packed["has_replay"] == bool(layout.replay_tokens)


def _check_maps(layout):
    rows = PackedTreeView(layout).linear_rows()
    x = torch.randn(layout.num_rows, 3, dtype=torch.float64, requires_grad=True)
    packed = rows.pack(x)
    assert packed.shape[0] == rows.view.num_rows
    torch.testing.assert_close(rows.unpack(packed), x, rtol=0, atol=0)
    if isinstance(rows, PackedRowsView):
        own = torch.as_tensor(linear_rows(layout)["own"])
        torch.testing.assert_close(packed[own], x, rtol=0, atol=0)
        # backward of pack sums every read of a row; unpack hands replay rows no gradient
        weights = torch.randn_like(packed)
        (grad,) = torch.autograd.grad((packed * weights).sum(), x)
        reads = torch.zeros_like(x).index_add_(0, torch.as_tensor(linear_rows(layout)["rows"]), weights)
        torch.testing.assert_close(grad, reads, rtol=1e-12, atol=1e-12)
        y = torch.randn(rows.view.num_rows, 3, dtype=torch.float64, requires_grad=True)
        g = torch.randn(layout.num_rows, 3, dtype=torch.float64)
        (grad_y,) = torch.autograd.grad((rows.unpack(y) * g).sum(), y)
        expected = torch.zeros_like(y)
        expected[own] = g
        torch.testing.assert_close(grad_y, expected, rtol=0, atol=0)
        # row weights count each semantic position once; positions are the rows' own
        torch.testing.assert_close(rows.view.row_weight.sum(), TreeView(layout).row_weight.sum())
        np.testing.assert_array_equal(rows.view.positions.numpy(), layout.row_position[linear_rows(layout)["rows"]])


def _mixer(linear: str) -> torch.nn.Module:
    model = tiny_model(linear, "mla")
    return next(m for m in model.modules() if isinstance(m, (KimiDeltaAttention, GatedDeltaNet)))


def _check_mixer(layout, linear: str, seed: int = 0):
    view = PackedTreeView(layout)
    rows = view.linear_rows()
    mixer = _mixer(linear)
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(layout.num_rows, mixer.hidden_size, dtype=torch.float64, generator=generator, requires_grad=True)
    packed_out = rows.unpack(mixer(rows.pack(h), rows.view))
    compact_out = mixer(h, view)
    torch.testing.assert_close(packed_out, compact_out, rtol=1e-11, atol=1e-12)
    weights = torch.randn(compact_out.shape, dtype=torch.float64, generator=generator)
    inputs = [h, *mixer.parameters()]
    got = torch.autograd.grad((packed_out * weights).sum(), inputs, allow_unused=True)
    want = torch.autograd.grad((compact_out * weights).sum(), inputs, allow_unused=True)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("linear", ["kda", "gdn"])
@pytest.mark.parametrize("chunk", [2, 4, 8])
def test_forks_around_chunk_boundaries(linear, chunk):
    for layout in _forked_layouts(chunk):
        _check_packed_order(layout)
        _check_maps(layout)
        _check_mixer(layout, linear)


@settings(max_examples=20, deadline=None)
@given(case=batches_with_groups(max_trajectories=6, max_length=20))
def test_random_trees_pack_and_run_as_compact(case):
    batch, chunk_size, groups = case
    for i, layout in enumerate(_layouts(make_plan(batch, chunk_size, groups))):
        _check_packed_order(layout)
        _check_maps(layout)
        _check_mixer(layout, "kda" if i % 2 == 0 else "gdn", seed=i)
