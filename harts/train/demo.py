"""The main job (``harts run``, ``make demo``): compile a rollout batch, train a few GRPO steps
with HARTS and with the trajectory-wise baseline from the same weights, and report the
per-step losses of both, the F/B/Grad speedup and the fidelity of HARTS against the baseline.

The two modes alternate step by step, so load from other processes on a shared machine
falls on both alike (:mod:`harts.train.compare`).
"""

from __future__ import annotations

import copy
import logging
import statistics
from collections.abc import Callable
from typing import Any

import torch

from harts.compiler import compile as compile_batch
from harts.errors import RolloutInputError
from harts.rollouts.inputs import resolve_input
from harts.train.compare import compare_runs, mode_trainers
from harts.train.config import TrainConfig
from harts.train.loop import RunOptions, build_model, training_advantages

logger = logging.getLogger(__name__)

__all__ = ["run_demo"]

#: The baseline first in every step: it sets the reference the HARTS step is compared with.
MODES = ("baseline", "harts")


def run_demo(
    input: str = "demo",
    *,
    preset: str = "tiny",
    chunk_size: int = 16,
    capacity: int = 4096,
    steps: int = 3,
    epochs: int = 2,
    recompute: bool = True,
    seed: int = 0,
    learning_rate: float = 1e-3,
    plot: Any = None,
    on_progress: Callable[..., Any] | None = None,
) -> dict[str, Any]:
    """Run the main job and return its figures (the CLI prints them).

    ``on_progress(title, phase, done, total)`` is called after every microbatch. ``plot`` must be
    new or a figure HARTS drew, and is checked before any work (:func:`harts.fsio.check_outputs`).
    """
    from harts.fsio import PNG, check_outputs
    from harts.rollouts.inputs import input_path

    check_outputs([("--plot", plot, PNG)], [input_path(input)])
    batch = resolve_input(input)
    if all(len(tokens) < 2 for tokens in batch.tokens):
        raise RolloutInputError(f"input {input!r}: every trajectory has a single token, so no token has a log-prob to train on")
    advantages = training_advantages(batch)
    plan = compile_batch(batch, capacity=capacity, dp_size=1, chunk_size=chunk_size)
    model = build_model(RunOptions(preset=preset, chunk_size=chunk_size, seed=seed), batch)
    reference = copy.deepcopy(model).requires_grad_(False)
    config = TrainConfig(epochs=epochs, kl_coef=1e-3, aux_loss_coef=1e-3, expert_bias_rate=1e-3, recompute=recompute)
    trainers = mode_trainers(model, config, lambda trained: torch.optim.AdamW(trained.parameters(), lr=learning_rate),
                             modes=MODES, reference_model=reference)

    records: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    first_old: dict[str, dict[int, torch.Tensor]] = {}
    for step in range(steps):
        for mode in MODES:
            title = f"{mode:>8} step {step + 1}/{steps}"
            report = None if on_progress is None else (lambda phase, done, total, title=title: on_progress(title, phase, done, total))
            result = trainers[mode].step(batch, plan, advantages=advantages, on_microbatch=report)
            records[mode].extend(result.metrics)
            first_old.setdefault(mode, result.old_log_probs)
            logger.info("%s step %d: loss %s", mode, step + 1, [r["loss"] for r in result.metrics])

    per_step = [
        {"step": base["step"], "epoch": base["epoch"], "loss_baseline": base["loss"], "loss_harts": tree["loss"],
         "loss_rel_diff": abs(tree["loss"] - base["loss"]) / max(abs(base["loss"]), 1e-30),
         "fbgrad_baseline": base["fbgrad_seconds"], "fbgrad_harts": tree["fbgrad_seconds"]}
        for base, tree in zip(records["baseline"], records["harts"])
    ]
    comparison = compare_runs(records["harts"], records["baseline"],
                              tuple(trainers[mode].module.state_dict() for mode in ("harts", "baseline")))
    if plot is not None:
        from harts.train.plot import plot_metrics

        plot_metrics(records["baseline"] + records["harts"], plot, title=f"harts run {input}: baseline vs HARTS", option="--plot")

    def seconds(mode: str, key: str) -> float:
        return sum(r[key] for r in records[mode])

    base_step = sum(seconds("baseline", k) for k in ("logprob_seconds", "fbgrad_seconds", "optimizer_seconds"))
    tree_step = sum(seconds("harts", k) for k in ("plan_seconds", "logprob_seconds", "fbgrad_seconds", "optimizer_seconds"))
    base_fbgrad = statistics.median(r["fbgrad_seconds"] for r in records["baseline"])
    tree_fbgrad = statistics.median(r["fbgrad_seconds"] for r in records["harts"])
    old_diff = max(float((first_old["harts"][k] - first_old["baseline"][k]).abs().max()) for k in first_old["harts"])
    stats = plan.stats
    return {
        "input": input,
        "trajectories": stats["trajectories"],
        "trees": stats["trees"],
        "semantic_tokens": stats["semantic_tokens"],
        "compact_tokens": stats["total_work"],
        "compression": stats["compression"],
        "microbatches": stats["num_microbatches"],
        "max_rounds": stats["max_rounds"],
        "replay_tokens": stats["replay_tokens"],
        "plan_seconds": stats["plan_seconds"],
        "model": f"{preset} ({sum(p.numel() for p in model.parameters()):,} parameters, {model.config.dtype})",
        "recompute": recompute,
        "steps": steps,
        "epochs": epochs,
        "baseline_fbgrad_seconds": base_fbgrad,
        "harts_fbgrad_seconds": tree_fbgrad,
        "fbgrad_speedup": base_fbgrad / tree_fbgrad,
        "step_speedup": base_step / tree_step,
        "max_old_logprob_abs_diff": old_diff,
        "param_rel_diff": comparison["weight_rel_diff"],
        "max_loss_rel_diff": comparison["max_step_rel_loss_diff"],
        "per_step": per_step,
    }
