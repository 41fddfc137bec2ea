"""`harts-bench --train-step`'s step on either optimizer: the same F/B/Grad objective, no weight moved."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import harts

from harts_bench.train_step import train_step_figures
from tests.helpers import forked_batch, make_plan, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")


def bench_batch():
    """The forked test batch with the benchmark's field name for the advantages."""
    trajectories = [tokens.tolist() for tokens in forked_batch().tokens]
    rng = np.random.default_rng(0)
    return harts.RolloutBatch.from_trajectories(trajectories, advantage=rng.normal(size=len(trajectories)))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_step_computes_the_same_loss_on_either_optimizer_and_moves_no_weight(optimizer):
    batch = bench_batch()
    plan = make_plan(batch, 4)
    model = tiny_model()
    # parameters only: the step's expert-bias balancing moves the routers' bias buffers on purpose
    before = {name: value.detach().clone() for name, value in model.named_parameters()}
    figures = train_step_figures(model, plan, batch, kernels=None, baseline_kernels=None, warmup=0, repeats=1,
                                 say=lambda message: None, optimizer=optimizer)
    reference = train_step_figures(tiny_model(), plan, batch, kernels=None, baseline_kernels=None, warmup=0,
                                   repeats=1, say=lambda message: None, optimizer="adamw")
    assert figures["optimizer"] == optimizer
    for mode in ("harts", "baseline"):
        assert figures[mode]["loss"] == pytest.approx(reference[mode]["loss"], rel=1e-12)
    assert figures["harts"]["loss"] == pytest.approx(figures["baseline"]["loss"], rel=1e-9)
    for name, value in model.named_parameters():
        assert torch.equal(value, before[name]), name


def test_an_unknown_optimizer_is_refused_by_name():
    batch = bench_batch()
    with pytest.raises(ValueError, match="'lion'"):
        train_step_figures(tiny_model(), make_plan(batch, 4), batch, kernels=None, baseline_kernels=None, warmup=0,
                           repeats=1, say=lambda message: None, optimizer="lion")
