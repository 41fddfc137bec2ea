"""Online RL on a task (`harts train --task`): sampled trees fork where they should, and HARTS
learns exactly as the trajectory-wise baseline from one seed (float64).

The trees of the ``count`` task fork at the prompt's end, inside the first turn and after the
observation; loss masks cover the sampled tokens only; the plan shares rows (compression > 1)
and its log-probs are the sampler's. A few steps with ``--mode harts`` and ``--mode baseline``
give the same rewards, losses to 1e-9 relative and weights to 1e-9; a mode run alone repeats
its run beside the other mode.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import harts
from harts.cli import app
from harts.runtime import log_probs
from harts.runtime.decode import IncrementalDecoder
from harts.tasks import CountingTask, Episode, get_task, rollout_batch, sample_rollouts
from harts.tasks.counting import OBS, SEP
from harts.train.loop import load_options
from harts.train.online import build_task_model, run_online

pytestmark = pytest.mark.usefixtures("single_thread")

runner = CliRunner()


def fork_positions(tokens: list[tuple[int, ...]]) -> set[int]:
    """Positions p at which paths that agree on tokens[:p] take different tokens."""
    positions = set()
    for p in range(max(len(t) for t in tokens)):
        children: dict[tuple[int, ...], set[int]] = {}
        for t in tokens:
            if len(t) > p:
                children.setdefault(t[:p], set()).add(t[p])
        if any(len(c) > 1 for c in children.values()):
            positions.add(p)
    return positions


def test_counting_reward_and_observation():
    task = CountingTask()
    episode = Episode(prompt=(), data={"step": 3, "starts": (6, 1)})
    d = task.digit
    perfect = [[d(1), d(4), d(7), d(2)], [d(4), d(7), d(2), d(5)]]
    assert task.reward(episode, perfect) == 1.0
    # each digit is judged against its predecessor: one slip costs one digit, not the rest of the turn
    slipped = [[d(1), d(5), d(0), d(3)], [d(4), d(7), SEP, d(5)]]
    assert task.right(episode, slipped) == [3, 2]
    assert task.reward(episode, slipped) == 5 / 8
    assert tuple(task.observation(episode, slipped[:1])) == (OBS, d(3), d(1), SEP)


def test_sampled_trees_fork_at_turn_boundaries_and_inside_turns():
    task = get_task("count")
    options = load_options({"task": "count"})
    model = build_task_model(options, task)
    episodes = task.episodes(np.random.default_rng(0), 3)
    rollouts = sample_rollouts(IncrementalDecoder(model), task, episodes, torch.Generator().manual_seed(0))
    length, prompt = task.turn_length, len(episodes[0].prompt)
    first_turn = range(prompt, prompt + length)
    observation = range(prompt + length, prompt + length + 4)
    second_turn = range(observation.stop, observation.stop + length)
    assert len(rollouts) == 3 * task.shape.leaves(length) == 3 * 16
    for rollout in rollouts:
        episode = episodes[rollout.tree]
        assert rollout.tokens[:prompt] == episode.prompt
        assert rollout.tokens[prompt:] == (*rollout.turns[0], *task.observation(episode, rollout.turns[:1]), *rollout.turns[1])
        sampled = [p for p, m in enumerate(rollout.loss_mask) if m]
        assert sampled == [*first_turn, *second_turn]
        assert rollout.reward == task.reward(episode, rollout.turns)
    forks = set()
    for tree in range(3):
        forks |= fork_positions([r.tokens for r in rollouts if r.tree == tree])
    assert prompt in forks                                   # the first turn's branches, right after the prompt
    assert forks & set(first_turn[1:])                        # inner forks, from the middle of the first turn
    assert second_turn.start in forks                         # the second turn's branches, after the observation

    batch = rollout_batch(rollouts)
    for tree in range(3):
        assert abs(batch.trajectory_fields["advantages"][batch.tree_ids == tree].sum()) < 1e-9
    plan = harts.compile(batch, capacity=4096, chunk_size=4)
    assert plan.stats["compression"] > 1.5
    with torch.no_grad():
        out = log_probs(model, plan, batch)
    for rollout, values in zip(rollouts, out.log_probs):
        mask = np.asarray(rollout.loss_mask[1:]) > 0
        np.testing.assert_allclose(values.numpy()[mask], np.asarray(rollout.rollout_log_probs[1:])[mask], rtol=0, atol=1e-10)


def test_harts_and_baseline_learn_identically_from_one_seed():
    both = run_online(load_options({"task": "count:prompts=4", "steps": 3, "mode": "both", "epochs": 2}), progress=False)
    comparison = both.comparison
    assert comparison["optimizer_steps"] == 6  # 3 steps of 2 epochs
    assert comparison["identical_rewards"] and comparison["identical_rewards_through_step"] == 3
    assert comparison["max_rel_loss_diff"] <= 1e-9 and comparison["max_abs_entropy_diff"] <= 1e-9
    assert comparison["max_abs_weight_diff"] <= 1e-9
    records = {mode: [r for r in both.records if r["mode"] == mode] for mode in ("harts", "baseline")}
    # not a vacuous comparison: the weights moved, later epochs leave ratio 1, the plan shares rows
    assert len({r["loss"] for r in records["harts"]}) == 6
    assert max(r["ratio_max"] for r in records["harts"] if r["epoch"] == 2) > 1.0
    assert all(r["compression"] > 1.5 for r in records["harts"]) and all(r["compression"] == 1.0 for r in records["baseline"])
    assert all(r["rollout_logprob_gap"] < 1e-10 for r in both.records)
    initial = build_task_model(load_options({"task": "count"}), get_task("count"))
    assert any(not torch.equal(p, q) for p, q in zip(initial.parameters(), both.models["harts"].parameters()))

    alone = run_online(load_options({"task": "count:prompts=4", "steps": 3, "mode": "baseline", "epochs": 2}), progress=False)
    for a, b in zip(alone.records, records["baseline"]):
        assert a["reward_mean"] == b["reward_mean"] and a["loss"] == b["loss"]


def test_train_task_command(tmp_path):
    metrics, plot = tmp_path / "m.jsonl", tmp_path / "curves.png"
    result = runner.invoke(app, ["train", "--task", "count:prompts=3", "--steps", "2", "--mode", "both",
                                 "--metrics", str(metrics), "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    assert "identical_rewards" in result.output and "reward last steps" in result.output
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["mode"], r["step"]) for r in records] == [("harts", 1), ("baseline", 1), ("harts", 2), ("baseline", 2)]
    assert all(r["task"] == "count" and 0 <= r["reward_mean"] <= 1 for r in records)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("arguments, message", [
    (["train", "demo", "--mode", "both"], "give --task"),
    (["train", "--task", "sorting"], "unknown task 'sorting'"),
    (["train", "--task", "count:prompts=0"], "prompts must be an int in [1, 1024], got 0"),
    (["train", "--task", "count:branches=3"], "task 'count': unknown option 'branches=3'"),
    (["train", "demo", "--task", "count"], "drop INPUT"),
    (["train", "--task", "count", "--mode", "both", "--save", "w.safetensors"], "single --mode"),
])
def test_train_task_errors(arguments, message):
    result = runner.invoke(app, arguments)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
