"""The training step a user runs, timed beside the benchmark's pass on the same model, plan and batch.

``harts train`` drives :class:`harts.train.Trainer`, whose step adds loss assembly, metrics,
the old-log-prob pass and the optimizer to the F/B/Grad pass that ``harts-bench`` times. This
module runs that step here, in the benchmark's process, for HARTS and for the trajectory-wise
baseline (on the stock kernels the baseline pass uses), so that the loop's F/B/Grad and the
benchmark's pass are two figures of one run rather than of two commands.
"""

from __future__ import annotations

import numpy as np
import torch

from harts.train import TrainConfig, Trainer
from harts.train.loop import CLI_TRAIN_DEFAULTS

__all__ = ["TRAIN_STEP_CONFIG", "train_step_figures", "headline_train_line"]

#: `harts train --recompute --kl-coef 0 --epochs 1` on the benchmark's batch: the issue's command.
TRAIN_STEP_CONFIG = TrainConfig(**{**CLI_TRAIN_DEFAULTS, "epochs": 1, "kl_coef": 0.0, "recompute": True})


def _timed_steps(trainer: Trainer, batch, plan, mode: str, warmup: int, repeats: int, say) -> dict:
    advantages = batch.trajectory_fields["advantage"]
    records = []
    for index in range(warmup + repeats):
        result = trainer.step(batch, plan, advantages=advantages, mode=mode)
        record = result.metrics[0]
        if index >= warmup:
            records.append(record)
        say(f"train step ({mode}) {'warm-up' if index < warmup else 'timed'} {index + 1}: "
            f"F/B/Grad {record['fbgrad_seconds']:.3f} s, old log-probs {record['logprob_seconds']:.3f} s, "
            f"optimizer {record['optimizer_seconds']:.3f} s, loss {record['loss']:.6e}")
    fbgrad = [r["fbgrad_seconds"] for r in records]
    return {
        "fbgrad_seconds": fbgrad,
        "mean_fbgrad_seconds": float(np.mean(fbgrad)),
        "mean_logprob_seconds": float(np.mean([r["logprob_seconds"] for r in records])),
        "mean_optimizer_seconds": float(np.mean([r["optimizer_seconds"] for r in records])),
        "rows_per_second": float(np.mean([r["rows_per_second"] for r in records])),
        "loss": float(records[-1]["loss"]),
    }


def train_step_figures(model, plan, batch, *, kernels, baseline_kernels, warmup: int, repeats: int, say,
                       optimizer: str = "adamw") -> dict:
    """``Trainer.step`` in both modes on the benchmark's model, plan and batch.

    The optimizer runs at learning rate 0, so the parameters the rest of the benchmark measures
    do not move; its update still runs, as in a real step (the routers' expert biases, which the
    step's load balancing moves, are not the optimizer's). ``optimizer="sgd"`` (no momentum)
    keeps no per-parameter state: the step then needs the memory of the weights and their
    gradients only, not AdamW's two moments beside them.
    """
    if optimizer == "adamw":
        step_optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    elif optimizer == "sgd":
        step_optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    else:
        raise ValueError(f"train-step optimizer must be adamw or sgd, got {optimizer!r}")
    figures = {}
    for mode, step_kernels in (("harts", kernels), ("baseline", baseline_kernels)):
        trainer = Trainer(model, step_optimizer, TRAIN_STEP_CONFIG, kernels=step_kernels)
        figures[mode] = _timed_steps(trainer, batch, plan, mode, warmup, repeats, say)
    model.zero_grad(set_to_none=True)
    figures["optimizer"] = optimizer
    return figures


def headline_train_line(results: dict) -> str:
    """The RESULTS line of issue 27: the benchmark's pass and the training step's F/B/Grad, both modes,
    and, when ``--profile`` ran, the refined limit and the headline's fraction of it."""
    train = results["train_step"]
    fields = {
        "compression": results["compression"],
        "bench_harts_s": results["harts"]["mean_seconds"],
        "train_harts_s": train["harts"]["mean_fbgrad_seconds"],
        "bench_baseline_s": results["baseline_fla"]["mean_seconds"],
        "train_baseline_s": train["baseline"]["mean_fbgrad_seconds"],
        "train_vs_bench_harts": train["harts"]["mean_fbgrad_seconds"] / results["harts"]["mean_seconds"],
        "train_vs_bench_baseline": train["baseline"]["mean_fbgrad_seconds"] / results["baseline_fla"]["mean_seconds"],
    }
    if "refined_limit" in results:
        fields["refined_limit"] = results["refined_limit"]
        fields["fraction_of_limit"] = results["fraction_of_refined_limit"]
    return "headline-train: " + " ".join(f"{key}={value:.4g}" for key, value in fields.items())
