"""Online RL on a task (``harts train --task NAME``): sample rollout trees with the policy, train on them.

Each step, for each mode asked for (``harts`` and / or ``baseline``):

1. prompts from the task (a NumPy generator seeded with ``seed``), one rollout tree per prompt
   grown by the current policy through :class:`~harts.runtime.decode.IncrementalDecoder`
   (forks at turn boundaries and inside turns; noise from a ``torch.Generator`` seeded with
   ``seed``), the task's reward per leaf, GRPO advantages per tree
   (:func:`harts.tasks.rollout_batch`);
2. one plan compiled for the batch (the baseline runs the plan's microbatches trajectory-wise);
3. one :meth:`harts.train.Trainer.step`. Old log-probs are recomputed by the trainer before the
   update (on the plan in ``harts`` mode, trajectory-wise in ``baseline`` mode), as verl and
   AReaL do; the sampler's own log-probs travel in the batch as ``rollout_log_probs`` and the
   step records their largest gap to the trainer's (``rollout_logprob_gap``).

Nothing in sampling depends on the mode: given the same seed, both modes see the same
prompts and the same noise, so they sample the same trees as long as their weights agree,
and their losses and rewards can be compared step for step. With ``modes=("harts",
"baseline")`` the two runs alternate step by step in one process (load from other processes
falls on both alike) and :attr:`OnlineRun.comparison` holds the differences.

Sensitivity. The two modes compute the same math in different orders (HARTS computes a shared
row once where the baseline computes every copy, and sums gradients in another order), so
their steps differ by round-off (float64: ~1e-16 relative). RL training amplifies any such
difference, HARTS' or not: while the policy learns fast the gap between two runs can grow
tenfold per step (two baseline runs that only cut their microbatches differently do the same,
see ``benchmarks/online_rl.py --control``), and once it reaches the decision margin of one
sampled token the runs sample different trees and go their own ways, each still learning.
``benchmarks/RESULTS.md`` shows how far that is; the ``count`` task's defaults (one update
per batch; Adam eps 1e-4, which bounds how much Adam magnifies differences of near-zero
gradients, lr / eps) keep the growth slow.

Each record is the trainer's (one per optimizer step) plus the step's rollout figures:
``task``, ``dtype``, ``reward_mean``, ``reward_std``, ``trajectories``, ``trees``, ``plan_compression``
(the plan's S / work), ``microbatches``, ``rollout_logprob_gap``, ``sampling_seconds`` (prompts, trees,
rewards, batch) and ``step_seconds`` (all of the step, plan and update included).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist

from harts.compiler import compile as compile_batch
from harts.runtime import HybridConfig, HybridModel
from harts.runtime.decode import IncrementalDecoder
from harts.tasks import get_task, rollout_batch, sample_rollouts
from harts.train.compare import compare_modes, mode_trainers
from harts.train.config import MODES, TrainingError
from harts.train.loop import MetricsFile, RunOptions, check_run_outputs, make_optimizer, save_weights, step_progress
from harts.train.plot import ONLINE_PANELS, plot_metrics
from harts.train.trainer import Trainer

logger = logging.getLogger(__name__)

__all__ = ["OnlineRun", "build_task_model", "rollout_logprob_gap", "run_online", "summarize"]


@attrs.frozen(eq=False)
class OnlineRun:
    """What :func:`run_online` did: records of every mode (one per optimizer step), per-mode summaries, the models."""

    task: str
    modes: tuple[str, ...]
    records: tuple[dict[str, Any], ...]
    summary: dict[str, dict[str, Any]]
    comparison: dict[str, Any] | None
    models: dict[str, torch.nn.Module]
    model_description: str


def build_task_model(options: RunOptions, task) -> HybridModel:
    """The policy: the preset with the task's model overrides, then the user's, seeded with ``options.seed``."""
    if options.hf is not None:
        raise TrainingError("--task trains the task's own small policy; --hf does not apply")
    overrides = {**task.model, **dict(options.model)}
    if options.dtype is not None:
        overrides["dtype"] = options.dtype
    if overrides.get("vocab_size", task.vocab_size) < task.vocab_size:
        raise TrainingError(f"task {task.name!r} needs vocab_size >= {task.vocab_size}, got {overrides['vocab_size']}")
    torch.manual_seed(options.seed)
    return HybridModel(HybridConfig.preset(options.preset, **overrides))


def rollout_logprob_gap(batch, plan, old_log_probs: dict[int, torch.Tensor]) -> float:
    """Largest |sampler log-prob - trainer's old log-prob| over the loss tokens of the microbatches given."""
    module = plan.module if hasattr(plan, "module") else plan
    sampled = batch.token_fields["rollout_log_probs"]
    gap = 0.0
    for mb in module.microbatches:
        if mb.index not in old_log_probs:
            continue
        values = old_log_probs[mb.index].detach().to("cpu", torch.float64).numpy()
        offset = 0
        for trajectory in sorted(mb.trajectories):  # member-major, members ascending
            count = len(batch.tokens[trajectory]) - 1
            mask = batch.loss_mask[trajectory][1:] > 0
            if mask.any():
                diff = np.abs(values[offset : offset + count] - sampled[trajectory][1:])[mask]
                gap = max(gap, float(diff.max()))
            offset += count
    return gap


class _ModeRun:
    """One mode's trainer (policy and optimizer) and generators (seeded alike for every mode)."""

    def __init__(self, trainer: Trainer, options: RunOptions):
        self.trainer = trainer
        self.model = trainer.model
        self.prompts = np.random.default_rng(options.seed)
        self.noise = torch.Generator().manual_seed(options.seed)

    def step(self, task, options: RunOptions) -> list[dict[str, Any]]:
        started = time.perf_counter()
        episodes = task.episodes(self.prompts)
        decoder = IncrementalDecoder(self.model, temperature=options.train.temperature, chunk_size=options.chunk_size)
        rollouts = sample_rollouts(decoder, task, episodes, self.noise)
        batch = rollout_batch(rollouts)
        sampling_seconds = time.perf_counter() - started
        plan = compile_batch(batch, capacity=options.capacity, dp_size=1, chunk_size=options.chunk_size)
        result = self.trainer.step(batch, plan)
        rewards = batch.trajectory_fields["reward"]
        figures = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "trajectories": len(batch),
            "trees": len(episodes),
            "plan_compression": float(plan.stats["compression"]),
            "microbatches": len(plan.module.microbatches),
            "rollout_logprob_gap": rollout_logprob_gap(batch, plan, result.old_log_probs),
            "sampling_seconds": sampling_seconds,
            "step_seconds": time.perf_counter() - started,
        }
        return [{**record, "task": task.name, "dtype": self.model.config.dtype, **figures} for record in result.metrics]


def summarize(records: list[dict[str, Any]], window: int = 10) -> dict[str, Any]:
    """One mode's run in figures: steps, seconds, reward at the start and the end (means over ``window`` steps)."""
    first = [r for r in records if r["epoch"] == 1]
    rewards = [r["reward_mean"] for r in first]
    window = max(1, min(window, len(rewards)))
    return {
        "steps": len(first),
        "wall_seconds": sum(r["step_seconds"] for r in first),
        "sampling_seconds": sum(r["sampling_seconds"] for r in first),
        "reward_step_1": rewards[0],
        "reward_last_step": rewards[-1],
        "reward_first_steps": float(np.mean(rewards[:window])),
        "reward_last_steps": float(np.mean(rewards[-window:])),
        "plan_compression_mean": float(np.mean([r["plan_compression"] for r in first])),
        "rollout_logprob_gap_max": max(r["rollout_logprob_gap"] for r in first),
    }


def run_online(options: RunOptions, *, modes: tuple[str, ...] | None = None, console=None,
               progress: bool = True) -> OnlineRun:
    """Run ``options.steps`` online RL steps of ``options.task`` in each of ``modes`` (see the module docstring)."""
    if options.task is None:
        raise TrainingError("no task: give --task NAME")
    if options.input is not None:
        raise TrainingError(f"--task {options.task} samples its own rollouts; drop INPUT ({options.input})")
    if (dist.is_available() and dist.is_initialized()) or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise TrainingError("--task runs in one process; start it without torchrun")
    modes = tuple(modes or (MODES if options.both_modes else (options.train.mode,)))
    unknown = [m for m in modes if m not in MODES]
    if unknown or len(set(modes)) != len(modes):
        raise TrainingError(f"modes must be distinct names among {MODES}, got {modes}")
    if options.save is not None and len(modes) > 1:
        raise TrainingError("--save writes one model; run a single --mode to save its weights")
    check_run_outputs(options)
    task = get_task(options.task)
    initial = build_task_model(options, task)
    description = f"{options.preset} policy ({sum(p.numel() for p in initial.parameters()):,} parameters, {initial.config.dtype})"
    reference = copy.deepcopy(initial).requires_grad_(False) if options.train.kl_coef else None
    trainers = mode_trainers(initial, options.train, lambda model: make_optimizer(model, options), modes=modes,
                             reference_model=reference)
    runs = {mode: _ModeRun(trainer, options) for mode, trainer in trainers.items()}
    metrics_file = MetricsFile(options.metrics, option="--metrics") if options.metrics is not None else None
    records: list[dict[str, Any]] = []
    logger.info("online RL: %s, %d step(s), modes %s", description, options.steps, ", ".join(modes))
    try:
        with step_progress(progress, console) as update:
            for step in range(options.steps):
                for mode, run in runs.items():
                    new = run.step(task, options)
                    records.extend(new)
                    last = new[-1]
                    update(mode, "steps", step + 1, options.steps, f"reward {last['reward_mean']:.3f}  loss {last['loss']:.4g}")
                    if metrics_file is not None:
                        for record in new:
                            metrics_file.write(record)
    finally:
        if metrics_file is not None:
            metrics_file.close()
    models = {mode: run.model for mode, run in runs.items()}
    summary = {mode: summarize([r for r in records if r["mode"] == mode]) for mode in modes}
    comparison = None
    if set(modes) == set(MODES):
        comparison = compare_modes(records, {mode: model.state_dict() for mode, model in models.items()})
    if options.plot is not None:
        plot_metrics(records, options.plot, panels=ONLINE_PANELS, x="step",
                     title=f"harts train --task {task.name}: {description}", option="--plot")
    if options.save is not None:
        save_weights(models[modes[0]], options.save, option="--save")
    return OnlineRun(task.name, modes, tuple(records), summary, comparison, models, description)
