"""A loaded plan runs from the layouts stored in its artifact: no planning, no laying out again;
what the runtime derives from a layout lives in the runtime, not in the frozen layout."""

from __future__ import annotations

import collections
import gc

import attrs
import pytest
import torch

import harts
import harts.codegen.layout
from harts.ir.layout import MicrobatchLayout
from harts.passes import PASS_REGISTRY
from harts.passes.registry import BUILTIN_PASSES
from harts.runtime import HybridConfig, HybridModel, TreeView, log_probs
from harts.runtime.programs import RUNTIME_CACHE, LayoutCache

TRAJECTORIES = [
    list(range(1, 12)),
    list(range(1, 4)) + [20, 21, 22, 23, 24],  # fork at B-1
    list(range(1, 6)) + [30, 31],  # fork at B+1
    list(range(1, 5)) + [25],  # fork at B
    list(range(1, 7)),  # a prefix of trajectory 0
    [26, 27, 28],
]


def compile_batch(batch):
    return harts.compile(batch, capacity=12, dp_size=2, chunk_size=4)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return HybridModel(HybridConfig.preset("tiny", vocab_size=32, dtype="float64"))


def count_calls(monkeypatch) -> collections.Counter:
    """Count every pass run and every layout built, from now until the test ends."""
    calls: collections.Counter = collections.Counter()

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    for name in BUILTIN_PASSES:
        pass_class = PASS_REGISTRY[name]
        monkeypatch.setattr(pass_class, "run", counted(name, pass_class.run))
    # lay_out builds every microbatch's layout in one call of this function (build_layout calls it for one)
    monkeypatch.setattr(harts.codegen.layout, "_lay_out_microbatches",
                        counted("lay out", harts.codegen.layout._lay_out_microbatches))
    return calls


@pytest.mark.parametrize("name", ["plan", "plan.safetensors"])
def test_loading_a_plan_does_no_planning_and_no_layout_and_runs_from_the_stored_tensors(tmp_path, monkeypatch, model, name):
    batch = harts.RolloutBatch.from_trajectories(TRAJECTORIES)
    plan = compile_batch(batch)
    expected = log_probs(model, plan, batch)
    path = plan.save(tmp_path / name)

    calls = count_calls(monkeypatch)
    # the counters see a compile: every pass runs once and the microbatches are laid out once, all together
    assert compile_batch(batch).stage == plan.stage
    assert calls == collections.Counter({**{name: 1 for name in BUILTIN_PASSES}, "lay out": 1})
    assert len(plan.microbatches) >= 2

    calls.clear()
    loaded = harts.load_plan(path)
    out = log_probs(model, loaded, batch)
    assert calls == collections.Counter(), f"loading or running a saved plan re-derived: {dict(calls)}"
    assert loaded.stage == plan.stage
    assert all(loaded.layout(mb.index) is loaded.layouts[mb.index] for mb in loaded.microbatches)
    for got, want in zip(out.log_probs, expected.log_probs):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_layout_is_frozen_and_holds_no_cache():
    plan = compile_batch(harts.RolloutBatch.from_trajectories(TRAJECTORIES))
    layout = plan.layouts[0]
    assert attrs.has(MicrobatchLayout) and not hasattr(layout, "cache")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        layout.row_position = layout.row_position[::-1]


def test_generated_programs_are_cached_in_the_runtime_per_layout_device_and_kernels():
    plan = compile_batch(harts.RolloutBatch.from_trajectories(TRAJECTORIES))
    cache = LayoutCache()
    layout = plan.layout(0)
    first = TreeView(layout, programs=cache).program("linear_attention")
    assert TreeView(layout, programs=cache).program("linear_attention") is first
    assert TreeView(layout, programs=cache, kernels=harts.kernels.naive).program("linear_attention") is not first
    assert TreeView(plan.layout(1), programs=cache).program("linear_attention") is not first
    assert TreeView(layout).programs is RUNTIME_CACHE
    assert len(cache) == 2
    del layout, first, plan
    gc.collect()
    assert len(cache) == 0, "entries outlive their layout"
