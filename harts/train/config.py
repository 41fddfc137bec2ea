"""What one RL optimisation step does: :class:`TrainConfig` (objective, epochs, clipping, MoE terms)."""

from __future__ import annotations

import math
from typing import Any

import attrs

from harts.errors import HartsError
from harts.rl import REDUCTIONS

__all__ = ["ALGORITHMS", "MODES", "TrainConfig", "TrainingError"]

ALGORITHMS = ("grpo", "ppo")
MODES = ("harts", "baseline")
#: The reduction each objective uses unless told otherwise (as :func:`harts.rl.grpo_loss` / ``ppo_loss``).
DEFAULT_REDUCTION = {"grpo": "seq-mean", "ppo": "token-mean"}


class TrainingError(HartsError, ValueError):
    """A training step cannot run as configured (options, plan, process group or model wrapper)."""


def _non_negative(instance, attribute, value) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise TrainingError(f"TrainConfig.{attribute.name} must be a finite number >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class TrainConfig:
    """Options of :meth:`harts.train.Trainer.step`.

    Attributes:
        algorithm: ``"grpo"`` (clipped surrogate + k3 KL to a reference, :func:`harts.rl.grpo_loss`)
            or ``"ppo"`` (clipped surrogate with optional dual clip, :func:`harts.rl.ppo_loss`).
        mode: ``"harts"`` runs the compiled plan; ``"baseline"`` runs the same microbatches
            trajectory-wise (every path expanded), for step-by-step comparison.
        epochs: optimizer steps per RL step, each over every microbatch of the plan.
        reduction: one of :data:`harts.rl.REDUCTIONS`; None: the algorithm's default
            (GRPO ``seq-mean``, PPO ``token-mean``). Its denominator is taken over the whole
            batch, so the loss is the same whatever the microbatching and DP degree.
        clip_eps, clip_eps_high, dual_clip, kl_coef: as in :func:`harts.rl.policy_loss`.
        entropy_coef: subtracts ``entropy_coef * entropy`` (reduced like the loss).
        temperature: logits are divided by it before every log-softmax (old, reference, current).
        max_grad_norm: clip the global gradient norm to it (None: measure only).
        z_loss_coef, aux_loss_coef: router z-loss and load-balancing loss weights (MoE; q-weighted).
        expert_bias_rate: auxiliary-loss-free expert-bias step after each optimizer step (0: off).
        recompute: full-layer activation recomputation in the training passes.
        recompute_old_log_probs: compute old log-probs with the model before the step, on the
            same plan and kernels (False: read them from the batch, field ``old_log_probs``,
            or train on-policy if it has none).
        with_entropy: measure the entropy of the current policy (needed when ``entropy_coef`` != 0).
        row_chunk: rows per vocabulary block of the log-prob computation (None: automatic).
    """

    algorithm: str = "grpo"
    mode: str = "harts"
    epochs: int = 1
    reduction: str | None = None
    clip_eps: float = attrs.field(default=0.2, validator=_non_negative)
    clip_eps_high: float | None = attrs.field(default=None, validator=_non_negative)
    dual_clip: float | None = None
    kl_coef: float = attrs.field(default=0.0, validator=_non_negative)
    entropy_coef: float = 0.0
    temperature: float = 1.0
    max_grad_norm: float | None = attrs.field(default=1.0, validator=_non_negative)
    z_loss_coef: float = attrs.field(default=0.0, validator=_non_negative)
    aux_loss_coef: float = attrs.field(default=0.0, validator=_non_negative)
    expert_bias_rate: float = attrs.field(default=0.0, validator=_non_negative)
    recompute: bool = False
    recompute_old_log_probs: bool = True
    with_entropy: bool = True
    row_chunk: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise TrainingError(f"TrainConfig.algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.mode not in MODES:
            raise TrainingError(f"TrainConfig.mode must be one of {MODES}, got {self.mode!r}")
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise TrainingError(f"TrainConfig.epochs must be a positive int, got {self.epochs!r}")
        if self.reduction is not None and self.reduction not in REDUCTIONS:
            raise TrainingError(f"TrainConfig.reduction must be one of {REDUCTIONS} or None, got {self.reduction!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0):
            raise TrainingError(f"TrainConfig.temperature must be a positive finite number, got {self.temperature!r}")
        if self.algorithm == "grpo" and self.dual_clip is not None:
            raise TrainingError("TrainConfig.dual_clip belongs to the PPO objective; GRPO (harts.rl.grpo_loss) has none")
        if self.algorithm == "ppo" and self.kl_coef:
            raise TrainingError("TrainConfig.kl_coef: the PPO objective (harts.rl.ppo_loss) has no KL term; use algorithm='grpo'")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise TrainingError(f"TrainConfig.dual_clip must exceed 1, got {self.dual_clip!r}")
        if self.entropy_coef and not self.with_entropy:
            raise TrainingError("TrainConfig.entropy_coef needs with_entropy=True")
        if self.row_chunk is not None and (not isinstance(self.row_chunk, int) or self.row_chunk < 1):
            raise TrainingError(f"TrainConfig.row_chunk must be a positive int or None, got {self.row_chunk!r}")

    @property
    def loss_reduction(self) -> str:
        return self.reduction or DEFAULT_REDUCTION[self.algorithm]

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in attrs.fields(cls))

    def replace(self, **changes: Any) -> TrainConfig:
        return attrs.evolve(self, **changes)
