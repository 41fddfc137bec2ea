"""Router replay: a per-token ``routed_experts`` field forces every MoE layer's experts.

A plan replays each compact row's experts once; it must equal the trajectory-wise baseline
replaying the same experts at every position (log-probs, gradients, MoE statistics), replaying
the model's own choices must change nothing, the weights must be the router's at the given
experts, and trajectories that share a row but disagree on its experts are an error.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import harts
from harts.errors import RolloutInputError
from harts.rollouts import read_node_table, write_node_table
from harts.runtime import HybridConfig, HybridModel, log_probs, log_probs_baseline
from harts.runtime.moe import TopKRouter
from tests.helpers import token_trees
from tests.helpers import tiny_model

CHUNK = 4


@functools.lru_cache(maxsize=None)
def softmax_model() -> HybridModel:
    """Qwen3-Next-style routing: softmax router, normalised top-k, no expert bias."""
    torch.manual_seed(1)
    return HybridModel(HybridConfig.preset(
        "tiny", dtype="float64", vocab_size=64, layer_types=["linear", "full", "linear"], hidden_size=32,
        intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        num_attention_heads=2, head_dim=8, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, moe_router="softmax", moe_expert_bias=False,
        norm_topk_prob=True, routed_scaling_factor=1.0, num_experts=6, num_experts_per_tok=2,
    ))


MODELS = {"sigmoid": lambda: tiny_model(), "softmax": softmax_model}


def prefix_routing(trajectories, config, salt=0):
    """Expert ids that depend only on each token's prefix (what one inference engine would pick), distinct per token."""
    layers, top_k, experts = config.num_moe_layers, config.num_experts_per_tok, config.num_experts
    out = []
    for tokens in trajectories:
        rows = []
        for t in range(len(tokens)):
            digest = hashlib.sha256(f"{salt}:{tokens[: t + 1]}".encode()).digest()
            rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
            rows.append([rng.permutation(experts)[:top_k] for _ in range(layers)])
        out.append(np.asarray(rows, dtype=np.int64).reshape(len(tokens), layers, top_k))
    return out


def own_routing(model, batch):
    """The experts the model itself picks in the baseline, recorded per MoE layer."""
    recorded = []
    hooks = [m.register_forward_hook(lambda m, args, out: recorded.append(out[3].detach()))
             for m in model.modules() if isinstance(m, TopKRouter)]
    try:
        with torch.no_grad():
            log_probs_baseline(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    stacked = torch.stack(recorded, dim=1).numpy()  # [S, L, k] over the packed trajectories
    return np.split(stacked, np.cumsum(batch.lengths)[:-1])


def test_replaying_the_models_own_choice_changes_nothing(single_thread):
    trajectories = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9], [4, 4, 4, 4, 4, 4, 4, 4, 4]]
    for make in MODELS.values():
        model = make()
        batch = harts.RolloutBatch.from_trajectories(trajectories)
        replay = harts.RolloutBatch.from_trajectories(trajectories, routed_experts=own_routing(model, batch))
        free, forced = log_probs_baseline(model, batch), log_probs_baseline(model, replay)
        assert torch.equal(free.packed, forced.packed)
        assert torch.equal(free.moe.assign_count, forced.moe.assign_count)


@pytest.mark.parametrize("router", ["sigmoid", "softmax"])
def test_weights_are_the_routers_at_the_given_experts(router):
    model = MODELS[router]()
    gate = next(m for m in model.modules() if isinstance(m, TopKRouter))
    x = torch.randn(7, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    routed = torch.stack([torch.randperm(gate.num_experts, generator=torch.Generator().manual_seed(r))[: gate.top_k] for r in range(7)])
    logits, probs, weights, indices = gate(x, routed)
    assert torch.equal(indices, routed)
    scores = torch.softmax(logits, -1) if router == "softmax" else torch.sigmoid(logits)
    for row in range(7):
        picked = torch.stack([scores[row, int(e)] for e in routed[row]])
        if gate.norm_topk_prob:
            picked = picked / (picked.sum() + (0 if router == "softmax" else 1e-20))
        torch.testing.assert_close(weights[row], picked * gate.routed_scaling_factor, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="routed expert ids must lie in"):
        gate(x, torch.full_like(routed, gate.num_experts))


def _gradients(model, out):
    weights = torch.linspace(-1, 1, out.packed.shape[0], dtype=out.packed.dtype)
    loss = (weights * out.packed).sum() + harts.runtime.z_loss(out.moe) + harts.runtime.load_balancing_loss(out.moe)
    parameters = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, parameters, allow_unused=True)


@settings(max_examples=14, deadline=None)
@given(trajectories=token_trees(chunk_size=CHUNK, max_trajectories=6, max_length=16, vocab=5), router=st.sampled_from(sorted(MODELS)))
def test_plan_replay_equals_the_baseline_with_the_same_forced_routing(trajectories, router, single_thread):
    model = MODELS[router]()
    routed = prefix_routing(trajectories, model.config, salt=len(router))
    batch = harts.RolloutBatch.from_trajectories(trajectories, routed_experts=routed)
    plan = harts.compile(batch, capacity=max(map(len, trajectories)) + 6, chunk_size=CHUNK)
    out = log_probs(model, plan, batch, recompute=True)
    ref = log_probs_baseline(model, batch, microbatches=plan)
    torch.testing.assert_close(out.packed, ref.packed, rtol=0, atol=1e-10)
    # every semantic position counts its replayed experts once, weighted by multiplicity on the plan side
    expected = np.zeros(ref.moe.assign_count.shape)
    for experts in routed:
        for layer in range(experts.shape[1]):
            np.add.at(expected[layer], experts[:, layer].reshape(-1), 1.0)
    assert np.array_equal(out.moe.assign_count.numpy(), expected)
    assert np.array_equal(ref.moe.assign_count.numpy(), expected)
    torch.testing.assert_close(out.moe.prob_mass, ref.moe.prob_mass, rtol=0, atol=1e-10)
    for got, want in zip(_gradients(model, out), _gradients(model, ref)):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)


def test_forced_routing_changes_the_result():
    model = softmax_model()
    trajectories = [[3, 1, 4, 1, 5, 9, 2, 6], [3, 1, 4, 1, 7, 7]]
    free = log_probs_baseline(model, harts.RolloutBatch.from_trajectories(trajectories))
    forced = log_probs_baseline(model, harts.RolloutBatch.from_trajectories(trajectories, routed_experts=prefix_routing(trajectories, model.config)))
    assert not torch.allclose(free.packed, forced.packed)


def test_a_shared_row_with_two_routings_names_both_trajectories_and_the_position():
    model = tiny_model()
    trajectories = [[1, 2, 3, 4, 5, 6], [7, 7, 7], [1, 2, 3, 4, 8]]
    routed = prefix_routing(trajectories, model.config)
    routed[2] = routed[2].copy()
    routed[2][2] = (routed[2][2] + 1) % model.config.num_experts  # position 2 is shared with trajectory 0
    batch = harts.RolloutBatch.from_trajectories(trajectories, routed_experts=routed)
    plan = harts.compile(batch, capacity=64, chunk_size=CHUNK)
    with pytest.raises(RolloutInputError, match="trajectories 0 and 2 share the token at position 2"):
        log_probs(model, plan, batch)
    log_probs_baseline(model, batch)  # no sharing, no conflict


def test_bad_routed_experts_name_the_trajectory():
    model = tiny_model()
    trajectories = [[1, 2, 3], [1, 5]]
    routed = prefix_routing(trajectories, model.config)
    routed[1] = routed[1].copy()
    routed[1][1, 1, 0] = model.config.num_experts
    with pytest.raises(RolloutInputError, match="trajectory 1: field 'routed_experts' at position 1, MoE layer 1"):
        log_probs_baseline(model, harts.RolloutBatch.from_trajectories(trajectories, routed_experts=routed))
    routed[1][1, 1] = routed[1][1, 1, 1]
    with pytest.raises(RolloutInputError, match="repeated"):
        log_probs_baseline(model, harts.RolloutBatch.from_trajectories(trajectories, routed_experts=routed))
    wrong = [r[:, :1] for r in prefix_routing(trajectories, model.config)]
    with pytest.raises(RolloutInputError, match=r"\[layers, top_k\] = \[1, 2\], the model has 2 MoE layer"):
        log_probs_baseline(model, harts.RolloutBatch.from_trajectories(trajectories, routed_experts=wrong))


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_routed_experts_survive_a_node_table(tmp_path, suffix):
    model = tiny_model()
    trajectories = [[1, 2, 3, 4], [1, 2, 9]]
    routed = prefix_routing(trajectories, model.config)
    batch = harts.RolloutBatch.from_trajectories(trajectories, routed_experts=routed)
    write_node_table(batch, tmp_path / f"t{suffix}")
    back = read_node_table(tmp_path / f"t{suffix}")
    assert back.content_hash() == batch.content_hash()
    for mine, want in zip(back.routed_experts, routed):
        assert np.array_equal(mine, want)


def test_routed_experts_from_a_verl_batch_are_replayed(single_thread):
    from harts.interop import from_verl
    from tests.helpers import fixed_episodes, verl_batch

    model = tiny_model()
    episodes = fixed_episodes()
    trajectories = [tokens for tokens, _, _ in episodes]
    routed = prefix_routing(trajectories, model.config)
    d = verl_batch(episodes, [np.zeros(len(t) - 1) for t in trajectories])
    full = np.zeros((*d["input_ids"].shape, model.config.num_moe_layers, model.config.num_experts_per_tok), np.int64)
    for b, experts in enumerate(routed):
        full[b, np.flatnonzero(d["attention_mask"][b])] = experts  # verl records them over the whole padded sequence
    batch = from_verl(dict(d, routed_experts=full))
    assert all(np.array_equal(mine, want) for mine, want in zip(batch.routed_experts, routed))
    plan = harts.compile(batch, capacity=60, chunk_size=CHUNK)
    torch.testing.assert_close(log_probs(model, plan, batch).packed, log_probs_baseline(model, batch).packed, rtol=0, atol=1e-10)
