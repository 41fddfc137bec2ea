"""The incremental decoder computes what teacher forcing computes (float64), whatever the forks.

Sampled tokens' log-probs under :class:`harts.runtime.decode.IncrementalDecoder` equal their
teacher-forced log-probs from :func:`harts.runtime.log_probs_baseline` on the finished
trajectories (KDA + MLA + MoE, Gated DeltaNet + gated GQA + softmax MoE with a gated shared
expert and grouped value heads, Gated DeltaNet + MHA + dense), and the full next-token
distribution after any split of any tree's tokens into extend calls (prefills crossing chunk
boundaries, forks before, on and after them) equals the model's own full-sequence forward.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import harts
from harts.runtime import BaselineView, HybridConfig, HybridModel, log_probs_baseline
from harts.runtime.decode import IncrementalDecoder, gumbel_sample
from harts.tasks import CountingTask, TreeShape, sample_rollouts
from tests.helpers import tiny_model, token_trees

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 16


@functools.lru_cache(maxsize=None)
def qwen3_next_like() -> HybridModel:
    """Gated DeltaNet with 2 key / 4 value heads, gated GQA with q/k norm and partial RoPE, softmax MoE with a gated shared expert."""
    torch.manual_seed(1)
    config = HybridConfig.preset(
        "tiny", linear="gdn", attention="gqa", dtype="float64", vocab_size=VOCAB, layer_types=["linear", "full", "linear"],
        hidden_size=32, intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        moe_intermediate_size=16, moe_router="softmax", moe_expert_bias=False, routed_scaling_factor=1.0,
        shared_expert_intermediate_size=16, shared_expert_gate=True, norm_zero_centered=True,
    )
    return HybridModel(config)


MODELS = {
    "kda-mla-moe": lambda: tiny_model("kda", "mla", "moe", "float64", vocab_size=VOCAB),
    "gdn-gqa-moe": qwen3_next_like,
    "gdn-mha-dense": lambda: tiny_model("gdn", "mha", "dense", "float64", vocab_size=VOCAB),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sampled_log_probs_equal_teacher_forcing(name):
    model = MODELS[name]()
    task = CountingTask(turn_length=5, shape=TreeShape(branches=(2, 2), inner_forks=(2, 1)), prompts=2)
    for temperature in (1.0, 0.7):
        decoder = IncrementalDecoder(model, temperature=temperature)
        rollouts = sample_rollouts(decoder, task, task.episodes(np.random.default_rng(0)), torch.Generator().manual_seed(0))
        batch = harts.RolloutBatch.from_trajectories([list(r.tokens) for r in rollouts])
        with torch.no_grad():
            forced = log_probs_baseline(model, batch, temperature=temperature)
        for rollout, teacher in zip(rollouts, forced.log_probs):
            mask = np.asarray(rollout.loss_mask[1:]) > 0
            sampled = np.asarray(rollout.rollout_log_probs[1:])[mask]
            assert mask.sum() == task.turn_length * task.turns
            np.testing.assert_allclose(sampled, teacher.detach().numpy()[mask], rtol=0, atol=1e-10)


@settings(max_examples=12, deadline=None)
@given(trajectories=token_trees(chunk_size=4, max_trajectories=5, max_length=14, vocab=VOCAB),
       pieces=st.lists(st.integers(1, 6), min_size=30, max_size=30), model_name=st.sampled_from(sorted(MODELS)))
def test_next_token_distributions_equal_the_full_forward(trajectories, pieces, model_name):
    """Trajectories decoded by forking from the longest prefix decoded so far, in pieces of random length."""
    model = MODELS[model_name]()
    decoder = IncrementalDecoder(model)
    states = {(): decoder.start()}
    draws = iter(pieces * 10)
    for trajectory in trajectories:
        tokens = tuple(trajectory)
        fork = max((prefix for prefix in states if tokens[: len(prefix)] == prefix), key=len)
        state = states[fork]
        while state.length < len(tokens):
            end = min(len(tokens), state.length + next(draws))
            state = decoder.extend([state], [tokens[state.length : end]])[0]
            states[state.tokens] = state
        with torch.no_grad():
            view = BaselineView([len(tokens)], 4)
            logits, _ = model(torch.tensor(tokens), view)
            full = torch.log_softmax(logits, dim=-1)
        for prefix, decoded in states.items():
            if prefix and tokens[: len(prefix)] == prefix:
                torch.testing.assert_close(decoded.next_log_probs, full[len(prefix) - 1], rtol=0, atol=1e-10)


def test_extend_leaves_its_input_state_as_it_was():
    model = MODELS["kda-mla-moe"]()
    decoder = IncrementalDecoder(model)
    root = decoder.extend([decoder.start()], [[0, 3, 4, 5, 6, 7]])[0]
    before = root.next_log_probs.clone()
    first, second = decoder.extend([root, root], [[8], [9, 10]])
    again = decoder.extend([root], [[8]])[0]
    assert root.tokens == (0, 3, 4, 5, 6, 7) and torch.equal(root.next_log_probs, before)
    assert first.tokens == (0, 3, 4, 5, 6, 7, 8) and second.length == 8
    torch.testing.assert_close(again.next_log_probs, first.next_log_probs, rtol=0, atol=1e-12)


def test_gumbel_sampling_is_fixed_by_the_generator_and_follows_the_distribution():
    log_probs = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0, -1.0]], dtype=torch.float64).repeat(4000, 1), dim=-1)
    log_probs[:, 3] = float("-inf")
    draws = gumbel_sample(log_probs, torch.Generator().manual_seed(3))
    assert torch.equal(draws, gumbel_sample(log_probs.float(), torch.Generator().manual_seed(3)))
    assert not (draws == 3).any()
    frequencies = torch.bincount(draws, minlength=4).double() / len(draws)
    torch.testing.assert_close(frequencies[:3], log_probs[0, :3].exp(), rtol=0, atol=0.03)


def test_decoder_rejects_bad_input():
    decoder = IncrementalDecoder(MODELS["kda-mla-moe"]())
    with pytest.raises(ValueError, match="gets no token"):
        decoder.extend([decoder.start()], [[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decoder.extend([decoder.start()], [[VOCAB]])
    with pytest.raises(ValueError, match="consumed no token"):
        decoder.sample([decoder.start()], torch.Generator())
    with pytest.raises(ValueError, match="temperature"):
        IncrementalDecoder(MODELS["kda-mla-moe"](), temperature=0.0)
