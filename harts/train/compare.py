"""HARTS against the trajectory-wise baseline, side by side: the one comparator every driver uses.

The main job (``harts run``, :mod:`harts.train.demo`) and online RL in both modes
(:mod:`harts.train.online`) train each mode from the same initial weights with its own
:class:`~harts.train.Trainer` (:func:`mode_trainers`), alternate the modes step by step in one
process (so load from other processes falls on both alike) and compare the per-step records
and the final weights (:func:`compare_runs`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from harts.train.config import MODES, TrainConfig, TrainingError
from harts.train.trainer import Trainer

__all__ = ["compare_modes", "compare_runs", "mode_trainers", "weight_rel_diff"]


def mode_trainers(
    model: nn.Module,
    config: TrainConfig,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    *,
    modes: tuple[str, ...] = MODES,
    reference_model: nn.Module | None = None,
) -> dict[str, Trainer]:
    """One trainer per mode, each on its own copy of ``model`` (the same initial weights), sharing ``reference_model``."""
    trainers = {}
    for mode in modes:
        trained = copy.deepcopy(model)
        trainers[mode] = Trainer(trained, make_optimizer(trained), config.replace(mode=mode), reference_model=reference_model)
    return trainers


def weight_rel_diff(one: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor]) -> float:
    """||theta_one - theta_other|| / ||theta_other|| over all weights of two state dicts.

    A norm over the whole model rather than the largest single difference: Adam's first steps
    move every weight by about lr whatever its gradient's size, so weights whose gradients are
    round-off differ by lr in one run and not the other.
    """
    first = torch.cat([one[name].detach().flatten().double() for name in other])
    second = torch.cat([other[name].detach().flatten().double() for name in other])
    return float((first - second).norm() / second.norm().clamp_min(1e-300))


def compare_runs(first: list[dict[str, Any]], second: list[dict[str, Any]],
                 states: tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]] | None = None) -> dict[str, Any]:
    """Step-by-step differences of two runs' records (one per optimizer step), and of their final weights given both state dicts.

    Relative loss differences come two ways: over the run's largest |loss| (``max_rel_loss_diff``:
    a loss that crosses 0 makes per-step ratios meaningless) and per step
    (``max_step_rel_loss_diff``: |a - b| / |b| of each step). Records with ``reward_mean``
    (online RL) also say whether, and up to which step, the runs sampled the same rewards.
    """
    if not first or len(first) != len(second):
        raise TrainingError(f"compare_runs: {len(first)} record(s) against {len(second)}")
    pairs = list(zip(first, second))

    def largest(key: str, relative: bool = False) -> float:
        known = [(a[key], b[key]) for a, b in pairs if a.get(key) is not None and b.get(key) is not None]
        if not known:
            return 0.0
        diff = max(abs(x - y) for x, y in known)
        return diff / max(max(abs(y) for _, y in known), 1e-300) if relative else diff

    comparison: dict[str, Any] = {
        "optimizer_steps": len(pairs),
        "max_abs_loss_diff": largest("loss"),
        "max_rel_loss_diff": largest("loss", relative=True),
        "max_step_rel_loss_diff": max(abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-30) for a, b in pairs),
        "max_abs_entropy_diff": largest("entropy"),
        "max_rel_grad_norm_diff": largest("grad_norm", relative=True),
    }
    if all("reward_mean" in record for record in first + second):
        same = [a["reward_mean"] == b["reward_mean"] for a, b in pairs if a["epoch"] == 1]
        comparison.update({
            "max_abs_reward_diff": largest("reward_mean"),
            "identical_rewards": all(same),
            # the last RL step up to which every step's mean reward is the same (the runs sampled the same trees)
            "identical_rewards_through_step": same.index(False) if False in same else len(same),
        })
    if states is not None:
        one, other = states
        comparison["max_abs_weight_diff"] = max(float((one[name].double() - other[name].double()).abs().max()) for name in one)
        comparison["weight_rel_diff"] = weight_rel_diff(one, other)
    return comparison


def compare_modes(records: list[dict[str, Any]], states: Mapping[str, Mapping[str, torch.Tensor]] | None = None) -> dict[str, Any]:
    """:func:`compare_runs` of the ``harts`` records against the ``baseline`` ones (and weights, given per mode)."""
    by_mode = [[r for r in records if r["mode"] == mode] for mode in MODES]
    if not by_mode[0] or not by_mode[1]:
        raise TrainingError("compare_modes needs records of both modes, 'harts' and 'baseline'")
    return compare_runs(*by_mode, None if states is None else tuple(states[mode] for mode in MODES))
