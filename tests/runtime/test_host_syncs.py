"""No host-device synchronisation inside a pass (issue 27): the runtime, the losses and the trainer read
nothing from the device and copy nothing to it from pageable memory, once the plan is bound.

Counted on CPU by :class:`tests.helpers.syncs.DeviceWaits`, which follows which tensors a GPU run would
hold on the device and records every call that would make its host wait (the calls are the same on
CPU and on CUDA; only CUDA waits). The checks that used to read the device now read host copies
(:mod:`harts.kernels.host`): the tests below also hold them to the errors they gave.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import harts
from harts.errors import ModelInputError, RolloutInputError
from harts.kernels import host
from harts.kernels.dispatch import Dispatch
from harts.kernels.linear_attention.chunk import chunk_indices
from harts.numerics import compact_log_probs
from harts.rl import grpo_loss, policy_loss
from harts.runtime import log_probs, log_probs_baseline
from harts.codegen.fx import build_program
from harts.runtime.programs import RUNTIME_CACHE
from harts.runtime.tree_view import TreeView
from harts.runtime.view import BaselineView
from harts.train import TrainConfig, Trainer
from harts_bench.ablation import NodeAtATimeView
from harts_bench.runtime import SequenceAtATime, baseline_pass, harts_pass
from tests.helpers import forked_batch, make_plan, tiny_model, token_trees
from tests.helpers.syncs import DeviceWaits

pytestmark = pytest.mark.usefixtures("single_thread")

CHUNK = 4
KERNELS = Dispatch("auto")


def bench_batch(trajectories, seed=0):
    """A batch as harts-bench builds it: per-trajectory advantages and a loss mask."""
    rng = np.random.default_rng(seed)
    return harts.RolloutBatch.from_trajectories(
        trajectories, advantage=rng.normal(size=len(trajectories)),
        loss_mask=[(np.arange(len(t)) >= 1).astype(np.float32) for t in trajectories],
    )


def two_microbatches(batch):
    count = len(batch.tokens)
    return make_plan(batch, CHUNK, groups=[list(range(0, count, 2)), list(range(1, count, 2))] if count > 1 else None)


def waits_of(run, *models) -> dict:
    run()  # the first pass builds the layout's programs and device tensors, once
    with DeviceWaits(*models) as waits:
        result = run()
    return dict(waits.sites), result


@settings(max_examples=6, deadline=None)
@given(trajectories=token_trees(chunk_size=CHUNK, max_trajectories=6, max_length=14, vocab=6))
def test_the_benchmarks_harts_pass_reads_the_device_once_for_its_loss(trajectories):
    model = tiny_model(dtype="float32")
    batch = bench_batch(trajectories)
    plan = two_microbatches(batch)
    sites, (loss, _) = waits_of(lambda: harts_pass(model, plan, batch, KERNELS, len(trajectories)), model)
    model.zero_grad(set_to_none=True)
    # the microbatches' losses, read together after the last backward: the pass's only wait
    assert list(sites.values()) == [1] and "torch.stack(losses)" in next(iter(sites)), sites
    assert np.isfinite(loss)


@pytest.mark.parametrize("ablation", ["sequence-at-a-time", "node-at-a-time"])
def test_the_ablations_passes_wait_as_harts_does(ablation):
    """The ablations are charged their own schedule, not syncs HARTS' pass does not make."""
    model = tiny_model(dtype="float32")
    batch = bench_batch([t.tolist() for t in forked_batch(CHUNK).tokens])
    bound = two_microbatches(batch).bind(batch, model)
    kernels, view = (SequenceAtATime("auto"), TreeView) if ablation == "sequence-at-a-time" else (KERNELS, NodeAtATimeView)
    sites, _ = waits_of(lambda: harts_pass(model, bound, batch, kernels, len(batch.tokens), view_type=view), model)
    model.zero_grad(set_to_none=True)
    assert list(sites.values()) == [1] and "torch.stack(losses)" in next(iter(sites)), sites


def test_a_repeated_pass_on_a_bound_plan_copies_no_runtime_tensor_to_the_device(monkeypatch):
    """Row tokens (per bound plan) and row positions, multiplicities and program buffers (per layout) go to the
    device once; what a repeated pass still copies is the loss's own metadata, from pinned memory."""
    model = tiny_model(dtype="float32")
    batch = bench_batch([t.tolist() for t in forked_batch(CHUNK).tokens])
    bound = two_microbatches(batch).bind(batch, model)
    harts_pass(model, bound, batch, KERNELS, len(batch.tokens))
    callers = []
    upload = host.upload
    monkeypatch.setattr(host, "upload", lambda *a, **k: callers.append(sys._getframe(1).f_code.co_filename) or upload(*a, **k))
    harts_pass(model, bound, batch, KERNELS, len(batch.tokens))
    model.zero_grad(set_to_none=True)
    assert callers and all(name.endswith("/harts/rl.py") for name in callers), callers


def test_the_benchmarks_passes_keep_their_loss():
    """The loss a pass reports is still the float64 sum of its microbatches' losses, in order."""
    model = tiny_model(dtype="float32")
    batch = bench_batch([t.tolist() for t in forked_batch(CHUNK).tokens])
    plan = two_microbatches(batch)
    members = [list(mb.trajectories) for mb in plan.module.microbatches]
    baseline, _ = baseline_pass(model, batch, members, CHUNK, KERNELS, len(batch.tokens))
    model.zero_grad(set_to_none=True)
    harts_loss, _ = harts_pass(model, plan, batch, KERNELS, len(batch.tokens))
    model.zero_grad(set_to_none=True)
    expected = 0.0
    for group in members:
        sub = batch.subset(group)
        out = log_probs_baseline(model, sub, chunk_size=CHUNK)
        expected += float(grpo_loss(out, sub, advantages=sub.trajectory_fields["advantage"], denominator=len(batch.tokens)).loss.detach())
    assert baseline == expected
    assert abs(harts_loss - baseline) <= 1e-5 * abs(baseline)


def test_the_baseline_pass_reads_the_device_once_for_its_loss():
    model = tiny_model(dtype="float32")
    batch = bench_batch([t.tolist() for t in forked_batch(CHUNK).tokens])
    groups = [list(range(0, len(batch.tokens), 2)), list(range(1, len(batch.tokens), 2))]
    sites, _ = waits_of(lambda: baseline_pass(model, batch, groups, CHUNK, KERNELS, len(batch.tokens)), model)
    model.zero_grad(set_to_none=True)
    assert list(sites.values()) == [1] and "torch.stack(losses)" in next(iter(sites)), sites


@pytest.mark.parametrize("mode", ["harts", "baseline"])
@pytest.mark.parametrize("reduction", ["token-mean", "seq-mean"])
def test_a_training_step_reads_the_device_twice_per_epoch(mode, reduction):
    """Old and reference log-probs, entropy, router losses and two epochs: the only waits are each epoch's
    finiteness check before the optimizer moves (loss and gradient norm, one read) and its metrics (one read)."""
    model = tiny_model(dtype="float32", seed=1)
    reference = tiny_model(dtype="float32", seed=2)
    batch = bench_batch([t.tolist() for t in forked_batch(CHUNK).tokens])
    plan = two_microbatches(batch)
    config = TrainConfig(epochs=2, reduction=reduction, kl_coef=0.01, entropy_coef=0.01, z_loss_coef=0.001,
                         aux_loss_coef=0.01, expert_bias_rate=0.001, recompute=True, max_grad_norm=1.0)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config, reference_model=reference)
    sites, result = waits_of(lambda: trainer.step(batch, plan, mode=mode), model, reference)
    assert sum(sites.values()) == 2 * config.epochs, sites
    assert all("trainer.py" in site and "tolist" in site for site in sites), sites
    assert all(np.isfinite(record["loss"]) and record["kl"] is not None for record in result.metrics)


def test_router_replay_reads_nothing_from_the_device():
    """Replayed experts are checked on the host (binding, and their uploaded copy at every MoE layer)."""
    model = tiny_model(dtype="float32")
    trajectories = [t.tolist() for t in forked_batch(CHUNK).tokens]
    config = model.config
    slots, layers = np.arange(config.num_experts_per_tok), np.arange(config.num_moe_layers)[:, None]
    # trajectories through a shared row must agree there: experts by position, token and layer only
    routed = [np.stack([(slots + 3 * p + token + layers) % config.num_experts for p, token in enumerate(t)])
              for t in trajectories]
    batch = harts.RolloutBatch.from_trajectories(trajectories, routed_experts=routed)
    bound = two_microbatches(batch).bind(batch, model)

    def run():
        out = log_probs(model, bound, batch, recompute=True, with_entropy=True)
        (out.packed.sum() + out.packed_entropy.sum()).backward()

    sites, _ = waits_of(run, model)
    model.zero_grad(set_to_none=True)
    assert sites == {}


def test_views_share_their_layouts_device_tensors():
    batch = forked_batch(CHUNK)
    layout = make_plan(batch, CHUNK).layouts[0]
    first, second = TreeView(layout, "cpu"), TreeView(layout, "cpu")
    assert first.positions is second.positions and first.row_weight is second.row_weight
    assert torch.equal(first.positions, torch.tensor(layout.row_position))
    assert torch.equal(first.row_weight, torch.tensor(layout.row_multiplicity, dtype=torch.get_default_dtype()))
    for kind, options in (("linear_attention", {}), ("conv", {"width": 4}), ("attention", {}), ("log_probs", {})):
        program = RUNTIME_CACHE.program(layout, kind, "cpu", None, **options)
        buffers = dict(program.named_buffers())
        assert buffers and all(np.array_equal(host.host_values(b), b.numpy()) for b in buffers.values()), kind
        assert dict(build_program(layout, kind, **options).named_buffers()).keys() == buffers.keys()
    baseline = BaselineView([3, 1, 4], CHUNK)
    assert baseline.cu_seqlens.tolist() == [0, 3, 4, 8] and baseline.positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert host.host_values(baseline.cu_seqlens).tolist() == [0, 3, 4, 8]


# ----------------------------------------------------------------------------- the checks, moved to the host


def test_bad_token_ids_still_name_their_range():
    model = tiny_model(dtype="float32")
    view = BaselineView([3], CHUNK)
    uploaded = host.upload(np.array([1, 2, 3]), "cpu", torch.long)
    model.forward_hidden(uploaded, view)
    uploaded[1] = model.config.vocab_size + 4  # an in-place write makes the host copy stale: the device is read
    with pytest.raises(ModelInputError, match=rf"input_ids must lie in \[0, {model.config.vocab_size}\); got range \[1, {model.config.vocab_size + 4}\]"):
        model.forward_hidden(uploaded, view)
    with pytest.raises(ModelInputError, match=r"got range \[-1, 2\]"):
        model.forward_hidden(torch.tensor([-1, 2, 0]), view)  # a tensor nobody uploaded: checked on the device


def test_a_plan_bound_for_a_larger_vocabulary_is_checked_again_for_the_model():
    batch = harts.RolloutBatch.from_trajectories([[1, 2, 90, 3], [1, 2, 5]])
    plan = make_plan(batch, CHUNK)
    bound = plan.bind(batch, tiny_model(dtype="float32", vocab_size=128))
    with pytest.raises(RolloutInputError, match="trajectory 0: field 'tokens' entry 2 is 90"):
        log_probs(tiny_model(dtype="float32", vocab_size=64), bound, batch)


def test_head_targets_outside_the_vocabulary_are_named_with_or_without_a_host_copy():
    hidden, weight = torch.randn(3, 4), torch.randn(5, 4)
    rows = host.upload(np.array([0, 2, 1]), "cpu")
    ids = host.upload(np.array([1, 7, 2]), "cpu")  # 7 >= V: the host range does not settle it, the device names it
    targets = host.index_select(ids, torch.tensor([0, 1, 2]))
    assert host.value_range(targets) == (1, 7)
    with pytest.raises(ValueError, match=r"target token 7 is outside the vocabulary \[0, 5\)"):
        compact_log_probs(hidden, weight, None, rows, targets)
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 3\)"):
        compact_log_probs(hidden, weight, None, host.upload(np.array([0, 3, 1]), "cpu"), torch.tensor([1, 2, 3]))
    good = host.upload(np.array([1, 4, 2]), "cpu")
    got, _ = compact_log_probs(hidden, weight, None, rows, good, row_chunk=2)
    want = torch.log_softmax(hidden @ weight.t(), -1)[torch.tensor([0, 2, 1]), torch.tensor([1, 4, 2])]
    torch.testing.assert_close(got, want)


# ----------------------------------------------------------------------------- harts.kernels.host


@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.integers(-50, 50), min_size=1, max_size=20), dtype=st.sampled_from([None, torch.long, torch.float64]))
def test_an_upload_carries_its_host_copy_until_written(values, dtype):
    array = np.array(values)
    tensor = host.upload(array, "cpu", dtype)
    assert torch.equal(tensor, torch.tensor(array, dtype=dtype))
    assert np.array_equal(host.host_values(tensor), array)
    assert host.value_range(tensor) == (min(values), max(values))
    column = tensor[1:]
    assert host.host_values(column) is None and host.value_range(column) == (min(values), max(values))
    assert host.value_range(tensor.view(torch.int32) if tensor.dtype == torch.long else tensor.view(torch.uint8)) is None
    assert host.cached(tensor, "sum", lambda v: v.sum()) == sum(values)
    array[0] = 99  # the caller's array may change: the record is the upload's own copy
    assert host.host_values(tensor)[0] == values[0]
    tensor.add_(1)
    assert host.host_values(tensor) is None and host.value_range(column) is None and host.cached(tensor, "sum", sum) is None


def test_policy_loss_metrics_are_the_sums_over_the_masked_tokens():
    rng = np.random.default_rng(3)
    lengths = [4, 1, 6]
    log_probs = [torch.tensor(-rng.random(n - 1), dtype=torch.float64) for n in lengths]
    mask = [(rng.random(n) < 0.6).astype(np.float64) for n in lengths]
    old = [-rng.random(n) for n in lengths]
    ref = [-rng.random(n) for n in lengths]
    result = policy_loss(log_probs, advantages=rng.normal(size=3), loss_mask=mask, old_log_probs=old, ref_log_probs=ref)
    sums = result.sums
    count = sums["tokens"].clamp_min(1)
    assert result.metrics == {"clip_fraction": float(sums["clipped"] / count), "approx_kl_old": float(sums["neg_log_ratio"] / count),
                              "ratio_mean": float(sums["ratio"] / count), "kl": float(sums["kl"] / count),
                              "tokens": float(sums["tokens"])}
    packed = torch.cat(log_probs)
    trained = torch.cat([torch.as_tensor(m[1:]) for m in mask]) > 0
    ratio = torch.exp(packed - torch.cat([torch.as_tensor(o[1:]) for o in old]))
    assert sums["ratio_min"] == ratio[trained].min() and sums["ratio_max"] == ratio[trained].max()
    nothing = policy_loss(log_probs, advantages=np.ones(3), loss_mask=[np.zeros(n) for n in lengths])
    assert nothing.sums["ratio_min"] == float("inf") and nothing.sums["ratio_max"] == float("-inf")


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 200), min_size=1, max_size=8).filter(lambda n: sum(n) > 0),
       chunk_size=st.sampled_from([32, 64]))
def test_the_chunk_table_is_flas_formula(lengths, chunk_size):
    """``chunk_indices`` against fla 0.6's ``prepare_chunk_indices`` (fla.ops.utils.index: a segmented arange,
    so an empty sequence keeps its number), transcribed: the GPU test in
    tests/kernels/test_linear_attention_chunk.py compares it with fla itself."""
    counts = [-(-n // chunk_size) for n in lengths]
    within = torch.cat([torch.arange(n) for n in counts])
    want = torch.stack([torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts)), within], 1)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    assert torch.equal(torch.from_numpy(chunk_indices(offsets, int(offsets[-1]))), want)
