"""harts.integrations.engine: padded rows in and out, one plan per trajectory set, transformers' router aux loss.

The layout helpers are held to a per-entry reference on random left/right-padded rows; the
engine's log-probs to the trajectory-wise baseline on the same shared model, in the caller's
order whatever order the rows come in; its aux loss to transformers' ``load_balancing_loss_func``
over the router logits of the transformers model run on each trajectory alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import harts
from harts.integrations.engine import HartsEngine, IntegrationError, scatter_next_token, trajectories_from_padded
from harts.runtime import log_probs_baseline
from tests.helpers.hf import tiny_hf_model

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402


@st.composite
def padded_rows(draw):
    """[B, W] ids and mask with each row's tokens one run between left and right padding; a window [first, first + width)."""
    count = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(1, 9), min_size=count, max_size=count))
    lefts = draw(st.lists(st.integers(0, 4), min_size=count, max_size=count))
    width = max(l + n for l, n in zip(lefts, lengths)) + draw(st.integers(0, 3))
    ids = np.full((count, width), 99, dtype=np.int64)
    mask = np.zeros((count, width), dtype=np.int64)
    for row, (left, length) in enumerate(zip(lefts, lengths)):
        ids[row, left : left + length] = draw(st.lists(st.integers(0, 20), min_size=length, max_size=length))
        mask[row, left : left + length] = 1
    first = draw(st.integers(0, width - 1))
    return torch.as_tensor(ids), torch.as_tensor(mask), first, draw(st.integers(1, width - first))


@settings(max_examples=60, deadline=None)
@given(case=padded_rows())
def test_padded_rows_round_trip_and_values_land_where_the_framework_reads_them(case):
    ids, mask, first, width = case
    trajectories, starts = trajectories_from_padded(ids, mask)
    for row, (tokens, start) in enumerate(zip(trajectories, starts)):
        assert tokens == ids[row][mask[row].bool()].tolist() and mask[row, start] == 1 and mask[row, :start].sum() == 0
    values = [torch.arange(len(t) - 1, dtype=torch.float64) + 100 * row + 1 for row, t in enumerate(trajectories)]
    for v in values:
        v.requires_grad_(True)
    got = scatter_next_token(values, starts, first, width)
    want = torch.zeros(len(values), width, dtype=torch.float64)
    for row, start in enumerate(starts):
        for j in range(width):
            position = first + j - int(start)  # the token's position in its trajectory; its value is values[position - 1]
            if 1 <= position <= len(values[row]):
                want[row, j] = values[row][position - 1]
    assert torch.equal(got.detach(), want)
    got.sum().backward()
    for row, v in enumerate(values):  # each value reaches the output at most once, and only there
        assert set(v.grad.tolist()) <= {0.0, 1.0}
    assert sum(float(v.grad.sum()) for v in values) == float((want != 0).sum())


def test_rows_with_holes_or_without_tokens_are_refused_by_row():
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    with pytest.raises(IntegrationError, match="row 1: attention_mask has a hole"):
        trajectories_from_padded(ids, torch.tensor([[0, 1, 1, 1], [1, 0, 1, 0]]))
    with pytest.raises(IntegrationError, match="row 0: attention_mask has no real token"):
        trajectories_from_padded(ids, torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]]))


def transformers_model(architecture):
    return tiny_hf_model(architecture, torch.float32)


def rollouts(seed=0):
    """Two prompts, three completions each: shared prefixes, different lengths."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for prompt_length in (5, 9):
        prompt = torch.randint(0, 48, (prompt_length,), generator=generator).tolist()
        for length in (3, 7, 12):
            out.append(prompt + torch.randint(0, 48, (length,), generator=generator).tolist())
    return out


@pytest.mark.parametrize("architecture", ["qwen3_next", "kimi_linear"])
def test_one_plan_serves_every_order_of_the_same_rollouts(architecture):
    hf = transformers_model(architecture)
    engine = HartsEngine(chunk_size=8, capacity=40)  # several microbatches
    trajectories = rollouts()
    shuffled = [trajectories[i] for i in (4, 0, 5, 2, 1, 3)]
    with torch.no_grad():
        first = engine.run(hf, trajectories, with_entropy=True)
        second = engine.run(hf, shuffled, with_entropy=True)
        baseline = log_probs_baseline(engine.model_for(hf), harts.RolloutBatch.from_trajectories(shuffled), chunk_size=8)
    assert engine.plans.compiles == 1
    for k, i in enumerate((4, 0, 5, 2, 1, 3)):
        assert torch.equal(second.log_probs[k], first.log_probs[i])
        assert torch.equal(second.entropy[k], first.entropy[i])
        assert float((second.log_probs[k] - baseline.log_probs[k]).abs().max()) <= 1e-5
    engine.run(hf, trajectories[:4])
    assert engine.plans.compiles == 2


@pytest.mark.parametrize("architecture", ["qwen3_next", "kimi_linear"])
@pytest.mark.parametrize("recompute", [False, True])
def test_the_aux_loss_is_transformers_load_balancing_loss_over_every_token(architecture, recompute):
    hf = transformers_model(architecture)
    trajectories = rollouts(1)
    config = hf.config
    experts = config.num_experts if architecture == "qwen3_next" else config.num_local_experts
    per_trajectory = [hf(input_ids=torch.tensor([t]), output_router_logits=True, use_cache=False).router_logits for t in trajectories]
    layers = [torch.cat([logits[layer] for logits in per_trajectory]) for layer in range(len(per_trajectory[0]))]
    want = load_balancing_loss_func(tuple(layers), experts, config.num_experts_per_tok, None)
    (want_grad,) = torch.autograd.grad(want, [hf.model.layers[2].mlp.gate.weight])

    engine = HartsEngine(chunk_size=8, capacity=40)
    out = engine.run(hf, trajectories, with_aux_loss=True, recompute=recompute)
    assert abs(out.aux_loss.item() - want.item()) <= 1e-5 * want.item()
    (grad,) = torch.autograd.grad(out.aux_loss, [hf.model.layers[2].mlp.gate.weight])
    assert float((grad - want_grad).abs().max()) <= 1e-5 * float(want_grad.abs().max())


def test_a_model_whose_tensors_were_replaced_is_shared_again():
    hf = transformers_model("qwen3_next")
    engine = HartsEngine(chunk_size=8)
    trajectories = rollouts()
    first = engine.model_for(hf)
    hf.load_state_dict({key: value.clone() * 1.01 for key, value in hf.state_dict().items()}, assign=True)
    out = engine.run(hf, trajectories)
    again = engine.model_for(hf)
    assert again is not first
    with torch.no_grad():
        want = harts.runtime.log_probs_baseline(again, harts.RolloutBatch.from_trajectories(trajectories), chunk_size=8)
    assert all(float((g - w).abs().max()) <= 1e-5 for g, w in zip(out.log_probs, want.log_probs))
    torch.cat(out.log_probs).sum().backward()
    assert hf.lm_head.weight.grad is not None  # the gradient lands on the new tensors
