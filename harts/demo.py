"""The main job: compile a rollout batch, run one GRPO training step with HARTS and with the
trajectory-wise baseline on the same model, and report compression, speed and fidelity."""

from __future__ import annotations

import copy
import logging
import statistics
import time
from typing import Any

import numpy as np
import torch

import harts
from harts.batch import RolloutBatch
from harts.errors import RolloutInputError

logger = logging.getLogger(__name__)


def _advantages(batch: RolloutBatch):
    """The batch's advantages, or GRPO group-relative ones from its rewards when it has none."""
    from harts.rl import ADVANTAGE_FIELDS, group_advantages

    if any(name in batch.trajectory_fields or name in batch.token_fields for name in ADVANTAGE_FIELDS):
        return None
    rewards = batch.trajectory_fields.get("reward", np.zeros(len(batch)))
    groups = batch.trajectory_fields.get("group_id", np.asarray(batch.tree_ids))
    return group_advantages(rewards, groups)


def _grpo_step(model, batch: RolloutBatch, plan, mode: str, recompute: bool, advantages) -> tuple[float, Any, dict[str, torch.Tensor], float]:
    """One forward/backward of the GRPO loss; returns (seconds, log-probs, grads, loss)."""
    from harts.rl import grpo_loss
    from harts.runtime import load_balancing_loss, log_probs, log_probs_baseline

    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    if mode == "harts":
        out = log_probs(model, plan, batch, recompute=recompute)
    else:
        out = log_probs_baseline(model, batch, recompute=recompute, microbatches=plan)
    loss = grpo_loss(out.log_probs, batch, advantages=advantages).loss
    if out.moe is not None and out.moe.num_layers:
        loss = loss + 1e-3 * load_balancing_loss(out.moe)
    loss.backward()
    seconds = time.perf_counter() - started
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return seconds, [lp.detach() for lp in out.log_probs], grads, float(loss.detach())


def run_demo(
    input: str = "demo",
    *,
    preset: str = "tiny",
    chunk_size: int = 16,
    capacity: int = 4096,
    dp_size: int = 1,
    repeats: int = 3,
    recompute: bool = True,
    seed: int = 0,
    learning_rate: float = 1e-3,
) -> dict[str, Any]:
    """Run the main job and return its figures (the CLI prints them)."""
    from harts.runtime import HybridConfig, HybridModel
    from harts.workloads import resolve_input

    batch = resolve_input(input)
    if all(len(tokens) < 2 for tokens in batch.tokens):
        raise RolloutInputError(f"input {input!r}: every trajectory has a single token, so no token has a log-prob to train on")
    plan = harts.compile(batch, capacity=capacity, dp_size=dp_size, chunk_size=chunk_size)
    vocab_size = int(max(int(t.max()) for t in batch.tokens)) + 1
    torch.manual_seed(seed)
    config = HybridConfig.preset(preset, vocab_size=max(vocab_size, 2), chunk_size=chunk_size)
    model = HybridModel(config)
    advantages = _advantages(batch)

    timings: dict[str, list[float]] = {"baseline": [], "harts": []}
    results: dict[str, Any] = {}
    for repeat in range(repeats + 1):
        for mode in ("baseline", "harts"):
            seconds, values, grads, loss = _grpo_step(model, batch, plan, mode, recompute, advantages)
            if repeat > 0 or repeats == 0:
                timings[mode].append(seconds)
            results[mode] = (values, grads, loss)
            logger.info("%s step %d: %.3f s", mode, repeat, seconds)

    base_values, base_grads, base_loss = results["baseline"]
    tree_values, tree_grads, tree_loss = results["harts"]
    max_logprob_diff = max(float((a - b).abs().max()) for a, b in zip(base_values, tree_values) if a.numel())
    max_grad_rel = max(
        float((tree_grads[name] - grad).norm() / grad.norm().clamp_min(1e-30)) for name, grad in base_grads.items()
    )

    trained = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=learning_rate)
    for parameter in trained.parameters():
        parameter.grad = None
    _, _, _, loss_before = _grpo_step(trained, batch, plan, "harts", recompute, advantages)
    optimizer.step()
    _, _, _, loss_after = _grpo_step(trained, batch, plan, "harts", recompute, advantages)

    baseline_seconds = statistics.median(timings["baseline"])
    harts_seconds = statistics.median(timings["harts"])
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
        "model": f"{preset} ({sum(p.numel() for p in model.parameters()):,} parameters, {config.dtype})",
        "recompute": recompute,
        "baseline_fbgrad_seconds": baseline_seconds,
        "harts_fbgrad_seconds": harts_seconds,
        "fbgrad_speedup": baseline_seconds / harts_seconds,
        "core_speedup": baseline_seconds / (harts_seconds + stats["plan_seconds"]),
        "max_logprob_abs_diff": max_logprob_diff,
        "max_grad_rel_diff": max_grad_rel,
        "loss_baseline": base_loss,
        "loss_harts": tree_loss,
        "loss_after_adamw_step": loss_after,
        "loss_before_adamw_step": loss_before,
    }
