"""HARTS execution of compiled plans equals the trajectory-wise baseline (§3.4-3.5).

Same model, same weights: per-token log-probs, entropies, MoE statistics and every
parameter gradient agree to float64 round-off, with and without activation recomputation,
for KDA and Gated DeltaNet, MHA / GQA / MLA, dense and MoE FFNs; routing runs once per
compact row.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import harts
from harts.errors import PlanArtifactError, PlanBatchMismatchError, PlanningError, RolloutInputError
from harts.runtime import HybridConfig, HybridModel, expert_load, load_balancing_loss, log_probs, log_probs_baseline, z_loss
from harts.runtime.moe import TopKRouter
from tests.helpers import token_trees
from tests.helpers import batches_with_groups, figure_batch, nested_forks_batch
from tests.helpers import make_plan, tiny_model


def objective(out, position_weights):
    """A loss touching every output: weighted log-probs and entropies plus both router losses."""
    loss = (out.packed * position_weights).sum() + 0.3 * (out.packed_entropy * position_weights.flip(0)).sum()
    return loss + z_loss(out.moe) + load_balancing_loss(out.moe)


def compare(model, plan, batch, recompute, *, atol=1e-10, grad_rtol=1e-9, seed=0):
    out = log_probs(model, plan, batch, recompute=recompute, with_entropy=True)
    ref = log_probs_baseline(model, batch, recompute=recompute, microbatches=plan, with_entropy=True)
    assert [len(x) for x in out.log_probs] == [len(t) - 1 for t in batch.tokens]
    assert torch.equal(out.cu_seqlens, ref.cu_seqlens)
    torch.testing.assert_close(out.packed, ref.packed, rtol=0, atol=atol)
    torch.testing.assert_close(out.packed_entropy, ref.packed_entropy, rtol=0, atol=atol)
    for name in ("z_loss_sum", "prob_mass", "assign_count", "tokens"):
        torch.testing.assert_close(getattr(out.moe, name), getattr(ref.moe, name), rtol=atol, atol=atol)
    torch.testing.assert_close(expert_load(out.moe), expert_load(ref.moe), rtol=0, atol=0)
    # routing work: once per compact row for HARTS, once per semantic position for the baseline
    assert out.rows == sum(mb.work for mb in plan.module.microbatches)
    assert ref.rows == batch.semantic_tokens
    if model.config.num_moe_layers:
        assert out.moe.routed_rows == out.rows and ref.moe.routed_rows == ref.rows

    weights = torch.randn(out.packed.shape, dtype=out.packed.dtype, generator=torch.Generator().manual_seed(seed))
    parameters = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(objective(out, weights), parameters, allow_unused=True)
    want = torch.autograd.grad(objective(ref, weights), parameters, allow_unused=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, got, want):
        assert (a is None) == (b is None), name
        if a is None:
            continue
        scale = b.abs().max().clamp_min(1e-30)
        assert float((a - b).abs().max() / scale) <= grad_rtol, name
    return out, ref


@settings(max_examples=15, deadline=None)
@given(
    case=batches_with_groups(max_trajectories=6, max_length=20),
    recompute=st.booleans(),
    linear=st.sampled_from(["kda", "gdn"]),
    attention=st.sampled_from(["mla", "gqa"]),
)
def test_hypothesis_batches_match_baseline(case, recompute, linear, attention):
    batch, chunk_size, groups = case
    model = tiny_model(linear, attention)
    compare(model, make_plan(batch, chunk_size, groups), batch, recompute)


@settings(max_examples=8, deadline=None)
@given(
    trajectories=token_trees(chunk_size=4, max_trajectories=8, max_length=20),
    dp_size=st.integers(1, 2),
    fraction=st.floats(0.2, 1.0),
)
def test_plans_from_harts_compile_match_baseline(trajectories, dp_size, fraction):
    batch = harts.RolloutBatch.from_trajectories(trajectories)
    capacity = max(max(len(t) for t in trajectories), int(fraction * batch.semantic_tokens))
    dp_size = min(dp_size, len(trajectories))  # every replica needs a trajectory
    try:
        plan = harts.compile(batch, capacity=capacity, dp_size=dp_size, chunk_size=4)
    except PlanningError:
        assume(False)  # no plan meets this capacity with K a multiple of dp_size; not this test's subject
    compare(tiny_model(), plan, batch, recompute=dp_size == 2)


@pytest.mark.parametrize("ffn", ["moe", "dense"])
@pytest.mark.parametrize("attention", ["mla", "gqa", "mha"])
@pytest.mark.parametrize("linear", ["kda", "gdn"])
def test_every_model_variant_matches_baseline(linear, attention, ffn):
    batch = figure_batch()
    plan = make_plan(batch, 4, [[0, 2, 4, 5, 6], [1, 3]])
    model = tiny_model(linear, attention, ffn)
    recompute = (linear, attention, ffn) in {("kda", "mla", "moe"), ("gdn", "gqa", "dense"), ("kda", "mha", "dense"), ("gdn", "mla", "moe")}
    compare(model, plan, batch, recompute)


@pytest.mark.parametrize("linear", ["kda", "gdn"])
def test_nested_forks_and_trees_sharing_a_prompt_match_baseline(linear):
    batch = nested_forks_batch()
    for chunk_size, groups in ((8, None), (4, [[0, 2, 3, 7], [1, 4, 5, 6, 8]])):
        compare(tiny_model(linear), make_plan(batch, chunk_size, groups), batch, recompute=chunk_size == 4)


@pytest.mark.parametrize("recompute", [False, True])
def test_recomputation_gives_identical_gradients(recompute):
    batch = figure_batch()
    plan = make_plan(batch, 4)
    model = tiny_model()
    out, _ = compare(model, plan, batch, recompute)
    plain = log_probs(model, plan, batch, recompute=not recompute)
    torch.testing.assert_close(out.packed, plain.packed, rtol=0, atol=1e-12)


def test_float32_within_tolerance():
    batch = figure_batch()
    plan = make_plan(batch, 4, [[0, 1, 2, 3], [4, 5, 6]])
    model = tiny_model(dtype="float32")
    out = log_probs(model, plan, batch)
    ref = log_probs_baseline(model, batch, microbatches=plan)
    assert out.packed.dtype == torch.float32
    torch.testing.assert_close(out.packed, ref.packed, rtol=1e-4, atol=1e-5)
    weights = torch.randn(out.packed.shape, generator=torch.Generator().manual_seed(1))
    parameters = list(model.parameters())
    got = torch.autograd.grad((out.packed * weights).sum() + z_loss(out.moe), parameters)
    want = torch.autograd.grad((ref.packed * weights).sum() + z_loss(ref.moe), parameters)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_routing_runs_once_per_compact_row():
    batch = figure_batch()
    plan = make_plan(batch, 4)
    model = tiny_model()
    routed = []
    hooks = [m.register_forward_hook(lambda mod, args, out: routed.append(args[0].shape[0])) for m in model.modules() if isinstance(m, TopKRouter)]
    try:
        with torch.no_grad():
            out = log_probs(model, plan, batch)
            harts_rows = sum(routed)
            routed.clear()
            log_probs_baseline(model, batch)
            baseline_rows = sum(routed)
    finally:
        for hook in hooks:
            hook.remove()
    compact = plan.module.trie.compact_tokens
    assert harts_rows == model.config.num_moe_layers * compact == model.config.num_moe_layers * out.rows
    assert baseline_rows == model.config.num_moe_layers * batch.semantic_tokens
    assert compact < batch.semantic_tokens


def test_outputs_follow_user_order_and_alignment():
    batch = harts.RolloutBatch.from_trajectories([[5, 6, 7, 8, 9], [5, 6, 7], [3], [5, 6, 7, 8, 1, 2]])
    plan = make_plan(batch, 4, [[1, 3], [0, 2]])
    model = tiny_model()
    out = log_probs(model, plan, batch)
    assert [x.shape[0] for x in out.log_probs] == [4, 2, 0, 5]
    assert out.cu_seqlens.tolist() == [0, 4, 6, 6, 11]
    # entry t of trajectory i is log p(tokens[t+1] | tokens[:t+1]): recompute one trajectory on its own
    tokens = torch.tensor(batch.tokens[3])
    from harts.runtime import BaselineView

    hidden, _ = model.forward_hidden(tokens, BaselineView([len(tokens)], 4))
    direct = torch.log_softmax(model.logits(hidden), dim=-1)[torch.arange(len(tokens) - 1), tokens[1:]]
    torch.testing.assert_close(out.log_probs[3], direct, rtol=0, atol=1e-12)
    # shared prefix: trajectories 0 and 3 agree on their first three log-probs
    torch.testing.assert_close(out.log_probs[0][:3], out.log_probs[3][:3], rtol=0, atol=1e-12)


def test_plan_for_another_batch_is_rejected():
    batch = figure_batch()
    plan = make_plan(batch, 4)
    other = harts.RolloutBatch.from_trajectories([list(t) + [1] for t in batch.tokens])
    with pytest.raises(PlanBatchMismatchError, match="compiled for batch"):
        log_probs(tiny_model(), plan, other)


def test_kernel_chunk_size_follows_the_plan():
    """A plan with B = 8 runs on a model configured with chunk 4: rounds use the plan's grid."""
    batch = figure_batch()
    plan = make_plan(batch, 8)
    model = tiny_model()
    out = log_probs(model, plan, batch)
    ref = log_probs_baseline(model, batch, chunk_size=4)
    torch.testing.assert_close(out.packed, ref.packed, rtol=0, atol=1e-10)
    np.testing.assert_array_equal(out.cu_seqlens.numpy(), ref.cu_seqlens.numpy())


def test_saved_and_loaded_plan_runs_identically(tmp_path):
    batch = nested_forks_batch()
    plan = harts.compile(batch, capacity=40, dp_size=2, chunk_size=8)
    loaded = harts.load_plan(plan.save(tmp_path / "plan"))
    model = tiny_model()
    torch.testing.assert_close(log_probs(model, loaded, batch).packed, log_probs(model, plan, batch).packed, rtol=0, atol=0)


def test_tokens_outside_the_vocabulary_name_the_trajectory():
    batch = harts.RolloutBatch.from_trajectories([[1, 2, 3], [1, 2, 70, 4]])
    plan = harts.compile(batch, capacity=64, chunk_size=4)
    model = HybridModel(HybridConfig.preset("tiny", vocab_size=64))
    with pytest.raises(RolloutInputError, match=r"trajectory 1: field 'tokens' entry 2 is 70, outside the model's vocabulary \(vocab_size 64\)"):
        log_probs(model, plan, batch)
    with pytest.raises(RolloutInputError, match="trajectory 1: field 'tokens' entry 2 is 70"):
        log_probs_baseline(model, batch)


@pytest.mark.parametrize("packed_linear_rows", [False, True])
@pytest.mark.parametrize("attention", ["mla", "gqa", "mha"])
def test_attention_split_at_the_forks_matches_baseline(attention, packed_linear_rows, monkeypatch):
    """The full-attention layers on the cascade program (own rows in place, ancestor runs once per fork, merged
    by log-sum-exp, with its own backward) hold the whole model to the baseline as the gathered views do; so do
    the linear-attention layers on packed rows."""
    from harts.runtime.tree_view import TreeView

    monkeypatch.setattr(TreeView, "attention_program", "cascade_attention")
    monkeypatch.setattr(TreeView, "pack_linear_rows", packed_linear_rows)
    for batch, chunk_size, groups in ((figure_batch(), 4, [[0, 2, 4, 5, 6], [1, 3]]), (nested_forks_batch(), 4, None)):
        compare(tiny_model("kda", attention), make_plan(batch, chunk_size, groups), batch, recompute=attention == "mla")


@settings(max_examples=10, deadline=None)
@given(case=batches_with_groups(max_trajectories=6, max_length=20), attention=st.sampled_from(["mla", "gqa"]))
def test_hypothesis_batches_with_attention_split_at_the_forks_match_baseline(case, attention):
    from harts.runtime.tree_view import TreeView

    batch, chunk_size, groups = case
    original = TreeView.attention_program
    TreeView.attention_program = "cascade_attention"
    try:
        compare(tiny_model("gdn", attention), make_plan(batch, chunk_size, groups), batch, recompute=True)
    finally:
        TreeView.attention_program = original
