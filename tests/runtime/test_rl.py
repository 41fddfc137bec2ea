"""PPO-clip and GRPO losses over per-token log-probs; equal for HARTS and the baseline."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import harts
from harts.errors import RolloutInputError
from harts.rl import group_advantages, grpo_loss, pack_log_probs, policy_loss, ppo_loss
from harts.runtime import log_probs, log_probs_baseline
from tests.helpers import figure_batch
from tests.helpers import make_plan, tiny_model


def explicit_loss(log_probs, advantages, mask, old, ref, clip_low, clip_high, kl_coef, reduction):
    """The textbook formulas, one token at a time (metadata entry t + 1 for log-prob t)."""
    sums, counts = [], []
    for i, values in enumerate(log_probs):
        total, count = 0.0, 0.0
        for t in range(values.shape[0]):
            advantage = float(advantages[i] if np.ndim(advantages[i]) == 0 else advantages[i][t + 1])
            ratio = torch.exp(values[t] - float(old[i][t + 1]))
            term = torch.maximum(-advantage * ratio, -advantage * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
            if kl_coef:
                delta = float(ref[i][t + 1]) - values[t]
                term = term + kl_coef * (torch.exp(delta) - delta - 1)
            total = total + float(mask[i][t + 1]) * term
            count += float(mask[i][t + 1])
        sums.append(total)
        counts.append(count)
    if reduction == "token-mean":
        return sum(sums) / max(sum(counts), 1)
    if reduction == "sum":
        return sum(sums)
    active = [k for k, c in enumerate(counts) if c > 0]
    if reduction == "seq-mean":
        return sum(sums[k] / counts[k] for k in active) / max(len(active), 1)
    return sum(sums[k] for k in active) / max(len(active), 1)


@st.composite
def loss_cases(draw):
    count = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(1, 7), min_size=count, max_size=count))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    token_level = draw(st.booleans())
    advantages = [rng.normal(size=n) for n in lengths] if token_level else rng.normal(size=count)
    return dict(
        lengths=lengths,
        log_probs=[torch.tensor(-rng.random(n - 1) * 3, dtype=torch.float64, requires_grad=True) for n in lengths],
        advantages=advantages,
        mask=[(rng.random(n) < 0.7).astype(np.float64) for n in lengths],
        old=[-rng.random(n) * 3 for n in lengths],
        ref=[-rng.random(n) * 3 for n in lengths],
        clip_low=draw(st.sampled_from([0.1, 0.2])),
        clip_high=draw(st.sampled_from([0.2, 0.28])),
        kl_coef=draw(st.sampled_from([0.0, 0.05])),
        reduction=draw(st.sampled_from(["token-mean", "seq-mean", "seq-mean-token-sum", "sum"])),
    )


@settings(max_examples=40, deadline=None)
@given(loss_cases())
def test_policy_loss_matches_explicit_formulas(case):
    got = policy_loss(
        case["log_probs"], advantages=case["advantages"], loss_mask=case["mask"], old_log_probs=case["old"],
        ref_log_probs=case["ref"], clip_eps=case["clip_low"], clip_eps_high=case["clip_high"],
        kl_coef=case["kl_coef"], reduction=case["reduction"],
    ).loss
    want = explicit_loss(case["log_probs"], case["advantages"], case["mask"], case["old"], case["ref"],
                         case["clip_low"], case["clip_high"], case["kl_coef"], case["reduction"])
    want = torch.as_tensor(want, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if not want.requires_grad:
        return
    grads = torch.autograd.grad(got, case["log_probs"], allow_unused=True)
    expected = torch.autograd.grad(want, case["log_probs"], allow_unused=True)
    for a, b, values in zip(grads, expected, case["log_probs"]):
        zeros = torch.zeros_like(values)
        torch.testing.assert_close(zeros if a is None else a, zeros if b is None else b, rtol=1e-12, atol=1e-12)


def test_list_and_packed_inputs_agree():
    values = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5]), torch.zeros(0)]
    packed, cu = pack_log_probs(values)
    assert cu.tolist() == [0, 2, 3, 3]
    advantages = np.array([1.0, -1.0, 2.0])
    a = policy_loss(values, advantages=advantages).loss
    b = policy_loss(packed, cu_seqlens=cu, advantages=advantages).loss
    torch.testing.assert_close(a, b)


def test_metadata_is_read_from_entry_one():
    """loss_mask[t + 1] gates log_probs[t]: masking only token 3 leaves one log-prob with a gradient."""
    values = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    mask = [np.array([0, 0, 0, 1, 0, 0], dtype=np.float64)]
    advantages = [np.arange(6, dtype=np.float64)]
    loss = policy_loss([values], advantages=advantages, loss_mask=mask, reduction="sum").loss
    (grad,) = torch.autograd.grad(loss, values)
    assert grad.tolist() == [0.0, 0.0, -3.0, 0.0, 0.0]


def test_group_advantages():
    rewards = [1.0, 0.0, 1.0, 5.0, 3.0, 7.0]
    groups = [0, 0, 0, "b", "b", 9]
    got = group_advantages(rewards, groups, eps=0.0)
    first = np.array([1.0, 0.0, 1.0])
    expected_first = (first - first.mean()) / first.std(ddof=1)
    np.testing.assert_allclose(got[:3], expected_first)
    np.testing.assert_allclose(got[3:5], [1 / math.sqrt(2), -1 / math.sqrt(2)])
    assert got[5] == 0.0
    np.testing.assert_allclose(group_advantages(rewards, groups, normalize_std=False)[:3], first - first.mean())


def test_missing_or_misaligned_metadata_is_reported():
    values = [torch.zeros(2), torch.zeros(3)]
    with pytest.raises(RolloutInputError, match="advantages"):
        ppo_loss(values, None)
    with pytest.raises(RolloutInputError, match="trajectory 1: field 'loss_mask' has 3 entries, expected 4"):
        policy_loss(values, advantages=np.ones(2), loss_mask=[np.ones(3), np.ones(3)])
    with pytest.raises(RolloutInputError, match="ref_log_probs"):
        grpo_loss(values, None, advantages=np.ones(2), kl_coef=0.1)
    with pytest.raises(ValueError, match="reduction"):
        policy_loss(values, advantages=np.ones(2), reduction="mean")


def rl_batch():
    """The figure batch with RL metadata: rewards grouped by tree, token advantages, old/ref log-probs."""
    tokens = [t.tolist() for t in figure_batch().tokens]
    rng = np.random.default_rng(7)
    rewards = rng.normal(size=len(tokens))
    groups = [0, 0, 0, 0, 0, 0, 1]
    return harts.RolloutBatch.from_trajectories(
        tokens,
        loss_mask=[(np.arange(len(t)) >= 2).astype(np.float32) for t in tokens],
        advantages=group_advantages(rewards, groups),
        old_log_probs=[-rng.random(len(t)) * 4 for t in tokens],
        ref_log_probs=[-rng.random(len(t)) * 4 for t in tokens],
        token_advantages=[rng.normal(size=len(t)) for t in tokens],
    )


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_losses_and_gradients_equal_for_harts_and_baseline(algorithm):
    batch = rl_batch()
    plan = make_plan(batch, 4, [[0, 1, 2, 6], [3, 4, 5]])
    model = tiny_model()
    out = log_probs(model, plan, batch)
    ref = log_probs_baseline(model, batch, microbatches=plan)
    if algorithm == "grpo":
        compute = lambda lp: grpo_loss(lp, batch, kl_coef=0.04, clip_eps_high=0.28).loss  # noqa: E731
    else:
        compute = lambda lp: ppo_loss(lp, batch, advantages=batch.token_fields["token_advantages"], dual_clip=3.0).loss  # noqa: E731
    loss, reference = compute(out), compute(ref)
    torch.testing.assert_close(loss, reference, rtol=1e-12, atol=1e-12)
    assert compute(out.log_probs).item() == pytest.approx(loss.item(), rel=1e-14, abs=1e-14)
    parameters = list(model.parameters())
    got = torch.autograd.grad(loss, parameters, allow_unused=True)
    want = torch.autograd.grad(reference, parameters, allow_unused=True)
    for a, b in zip(got, want):
        if b is None:
            assert a is None
            continue
        assert float((a - b).abs().max()) <= 1e-9 * float(b.abs().max().clamp_min(1e-30))
