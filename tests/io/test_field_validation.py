"""Batch fields a loss reads are finite, misspelt field names are refused, token ids beyond int64 are blamed on
the right entry with their real value, rewards that overflow GRPO's arithmetic and masks that train on nothing
are refused (issue 24)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import harts
from harts.errors import RolloutInputError
from harts.rl import group_advantages, refuse_empty_loss_mask
from harts.rollouts.fields import FINITE_FIELDS

LOG_PROB_FIELDS = ("old_log_probs", "ref_log_probs", "rollout_logprobs", "old_logprobs", "behavior_log_probs")


@given(name=st.sampled_from(LOG_PROB_FIELDS), bad=st.sampled_from([math.nan, math.inf, -math.inf]),
       trajectory=st.integers(0, 2), position=st.integers(0, 3))
def test_non_finite_log_probs_are_refused_naming_trajectory_field_and_entry(name, bad, trajectory, position):
    tokens = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 8, 9]]
    values = [[-0.5] * 4 for _ in tokens]
    values[trajectory][position] = bad
    assert name in FINITE_FIELDS
    with pytest.raises(RolloutInputError) as caught:
        harts.RolloutBatch.from_trajectories(tokens, **{name: values})
    assert f"trajectory {trajectory}: field '{name}' entry {position} is {bad}" in str(caught.value)


def test_non_finite_log_probs_in_a_node_table_are_refused(tmp_path):
    line = {"kind": "node", "tree_id": 0, "node_id": 0, "parent_id": None, "token_ids": [1, 2, 3],
            "old_log_probs": [0.0, float("nan"), -1.0]}
    with pytest.raises(RolloutInputError, match="old_log_probs"):
        harts.RolloutBatch.from_node_table_records([line])


@pytest.mark.parametrize(("typo", "meant"), [("loss_maks", "loss_mask"), ("los_mask", "loss_mask"),
                                             ("advantagse", "advantages"), ("old_log_prob", "old_log_probs"),
                                             ("ref_logprob", "ref_log_probs"), ("grop_id", "group_id")])
def test_a_misspelt_field_is_refused_with_the_field_it_looks_like(typo, meant):
    tokens = [[1, 2, 3], [1, 2, 4]]
    value = [[0, 1, 1], [0, 1, 1]] if "mask" in typo or "log" in typo or "adv" in typo else [1.0, 0.0]
    with pytest.raises(RolloutInputError, match=f"field '{typo}' .* did you mean '{meant}"):
        harts.RolloutBatch.from_trajectories(tokens, **{typo: value})


def test_unrelated_extra_fields_are_kept():
    batch = harts.RolloutBatch.from_trajectories([[1, 2, 3]], uid=["a"], values=[[0.1, 0.2, 0.3]], score=[1.0],
                                                 rewards=[1.0], prox_logp=[[0.0, -1.0, -1.0]])
    assert set(batch.trajectory_fields) == {"uid", "score", "rewards"} and {"values", "prox_logp"} <= set(batch.token_fields)


@given(huge=st.integers(2**63, 2**80), position=st.integers(0, 4))
def test_a_token_id_beyond_int64_is_blamed_on_its_entry_with_its_value(huge, position):
    tokens = [3, 4, 5, 6, 7]
    tokens[position] = huge
    with pytest.raises(RolloutInputError) as caught:
        harts.RolloutBatch.from_trajectories([tokens])
    assert f"entry {position} is {huge}, above the largest id" in str(caught.value)


@pytest.mark.parametrize("rewards", [[1e308, 1e308, 0.0], [1e308, -1e308, 1.0], [0.0, 1e200, 3.0]])
def test_rewards_that_overflow_grpo_advantages_are_refused(rewards):
    with pytest.raises(RolloutInputError, match="field 'reward' is 1e\\+(308|200).*rescale"):
        group_advantages(rewards, [0, 0, 0])


@given(scale=st.floats(1e-6, 1e150), data=st.lists(st.floats(-1, 1), min_size=2, max_size=6))
def test_large_but_bounded_rewards_give_finite_advantages(scale, data):
    advantages = group_advantages(np.asarray(data) * scale, [0] * len(data))
    assert np.isfinite(advantages).all()


def test_the_cli_refuses_rewards_of_1e308(tmp_path):
    from typer.testing import CliRunner

    from harts.cli import USER_ERROR_EXIT, app

    table = tmp_path / "rollouts.jsonl"
    harts.RolloutBatch.from_trajectories([[1, 2, 3], [1, 2, 4]], reward=[1e308, 0.0]).write(table)
    result = CliRunner().invoke(app, ["train", str(table), "--steps", "1"])
    assert result.exit_code == USER_ERROR_EXIT, result.output
    assert "field 'reward' is 1e+308" in " ".join(result.output.split())


def test_a_mask_that_trains_on_nothing_is_refused_by_the_step():
    """Zero everywhere but the first entries, which gate no log-prob: nothing to train on."""
    masks = [np.array([1.0, 0.0, 0.0]), np.array([1.0, 0.0, 0.0, 0.0])]
    offsets = torch.tensor([0, 2, 5])
    with pytest.raises(RolloutInputError, match="'loss_mask' is 0 at every trained position"):
        refuse_empty_loss_mask(masks, offsets)
    refuse_empty_loss_mask([np.array([0.0, 0.0, 1.0]), np.array([0.0, 0.0, 0.0, 0.0])], offsets)


def test_training_on_an_all_zero_mask_is_refused_but_compiling_it_is_not():
    import copy

    from harts.train import TrainConfig, Trainer
    from tests.helpers import tiny_model

    batch = harts.RolloutBatch.from_trajectories([[1, 2, 3, 4], [1, 2, 5, 6]], advantages=[1.0, -1.0],
                                                 loss_mask=[[0, 0, 0, 0], [0, 0, 0, 0]])
    plan = harts.compile(batch, capacity=40, chunk_size=4)
    model = copy.deepcopy(tiny_model())
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), TrainConfig())
    with pytest.raises(RolloutInputError, match="train on nothing"):
        trainer.step(batch, plan)
