"""What one RL optimisation step does: :class:`TrainConfig` (objective, epochs, clipping, MoE terms)."""

from __future__ import annotations

import math
from typing import Any

import attrs

from harts.errors import HartsError
from harts.rl import REDUCTIONS

__all__ = ["ALGORITHMS", "MAX_SEED", "MIN_TEMPERATURE", "MODES", "OptionRule", "TrainConfig", "TrainingError", "option_problem"]

ALGORITHMS = ("grpo", "ppo")
MODES = ("harts", "baseline")
#: The reduction each objective uses unless told otherwise (as :func:`harts.rl.grpo_loss` / ``ppo_loss``).
DEFAULT_REDUCTION = {"grpo": "seq-mean", "ppo": "token-mean"}


class TrainingError(HartsError, ValueError):
    """A training step cannot run as configured (options, plan, process group or model wrapper)."""


#: Below this, softmax(z / T) is one-hot to float32 precision: every other token's log-prob is -inf
#: and the step's gradient NaN (greedy decoding leaves no log-probs to train on).
MIN_TEMPERATURE = 1e-3
#: torch.manual_seed takes a 64-bit seed; a signed one keeps it the same in NumPy and every framework.
MAX_SEED = 2**63 - 1


@attrs.frozen
class OptionRule:
    """An attrs validator that can also say, without raising, what is wrong with a value.

    The library (``TrainConfig(...)``, ``RunOptions(...)``) raises a :class:`TrainingError` naming
    ``Class.field``; the YAML and flag reader (:func:`harts.train.loop.load_options`) asks
    :meth:`problem` first so that its message names the file and key or the flag instead.
    """

    kind: str  # "int", "number", "bool" or "text"
    minimum: float | None = None  # inclusive
    above: float | None = None  # exclusive lower bound
    maximum: float | None = None  # inclusive
    optional: bool = False
    choices: tuple[str, ...] | None = None
    hint: str = ""

    def problem(self, value: Any) -> str | None:
        if value is None and self.optional:
            return None
        if self.kind == "bool":
            if isinstance(value, bool):
                return None
            quoted = " (a quoted string: write true or false without quotes)" if isinstance(value, str) else ""
            return f"must be true or false, got {value!r}{quoted}"
        if self.kind == "text":
            if not isinstance(value, str):
                return f"must be a string, got {value!r} ({type(value).__name__})"
            if self.choices is not None and value not in self.choices:
                return f"must be one of {', '.join(self.choices)}, got {value!r}"
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be {'an integer' if self.kind == 'int' else 'a number'}, got {value!r}"
        if self.kind == "int" and not isinstance(value, int):
            return f"must be an integer, got {value!r}"
        if not math.isfinite(value):
            return f"must be a finite number, got {value!r}"
        if self.minimum is not None and value < self.minimum:
            return f"must be >= {self.minimum:g}, got {value!r}{self.hint}"
        if self.above is not None and not value > self.above:
            return f"must be > {self.above:g}, got {value!r}{self.hint}"
        if self.maximum is not None and value > self.maximum:
            return f"must be <= {self.maximum:g}, got {value!r}{self.hint}"
        return None

    def __call__(self, instance, attribute, value) -> None:
        problem = self.problem(value)
        if problem is not None:
            raise TrainingError(f"{type(instance).__name__}.{attribute.name} {problem}")


def option_problem(cls, name: str, value: Any) -> str | None:
    """What :class:`OptionRule` of field ``name`` of the attrs class ``cls`` finds wrong with ``value`` (None: fine)."""
    rule = attrs.fields_dict(cls)[name].validator
    return rule.problem(value) if isinstance(rule, OptionRule) else None


_non_negative = OptionRule("number", minimum=0)
_optional_non_negative = OptionRule("number", minimum=0, optional=True)
_flag = OptionRule("bool")


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

    algorithm: str = attrs.field(default="grpo", validator=OptionRule("text", choices=ALGORITHMS))
    mode: str = attrs.field(default="harts", validator=OptionRule("text", choices=MODES))
    epochs: int = attrs.field(default=1, validator=OptionRule("int", minimum=1))
    reduction: str | None = attrs.field(default=None, validator=OptionRule("text", choices=REDUCTIONS, optional=True))
    clip_eps: float = attrs.field(default=0.2, validator=_non_negative)
    clip_eps_high: float | None = attrs.field(default=None, validator=_optional_non_negative)
    dual_clip: float | None = attrs.field(default=None, validator=OptionRule("number", above=1.0, optional=True))
    kl_coef: float = attrs.field(default=0.0, validator=_non_negative)
    entropy_coef: float = attrs.field(default=0.0, validator=OptionRule("number"))
    temperature: float = attrs.field(default=1.0, validator=OptionRule(
        "number", minimum=MIN_TEMPERATURE, hint=" (below it the softmax is one-hot in float32 and the log-probs -inf)"))
    max_grad_norm: float | None = attrs.field(default=1.0, validator=OptionRule(
        "number", above=0.0, optional=True, hint=" (0 would zero every update; leave it unset (null) to only measure the norm)"))
    z_loss_coef: float = attrs.field(default=0.0, validator=_non_negative)
    aux_loss_coef: float = attrs.field(default=0.0, validator=_non_negative)
    expert_bias_rate: float = attrs.field(default=0.0, validator=_non_negative)
    recompute: bool = attrs.field(default=False, validator=_flag)
    recompute_old_log_probs: bool = attrs.field(default=True, validator=_flag)
    with_entropy: bool = attrs.field(default=True, validator=_flag)
    row_chunk: int | None = attrs.field(default=None, validator=OptionRule("int", minimum=1, optional=True))

    def __attrs_post_init__(self) -> None:
        if self.algorithm == "grpo" and self.dual_clip is not None:
            raise TrainingError("TrainConfig.dual_clip belongs to the PPO objective; GRPO (harts.rl.grpo_loss) has none")
        if self.algorithm == "ppo" and self.kl_coef:
            raise TrainingError("TrainConfig.kl_coef: the PPO objective (harts.rl.ppo_loss) has no KL term; use algorithm='grpo'")
        if self.entropy_coef and not self.with_entropy:
            raise TrainingError("TrainConfig.entropy_coef needs with_entropy=True")

    @property
    def loss_reduction(self) -> str:
        return self.reduction or DEFAULT_REDUCTION[self.algorithm]

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in attrs.fields(cls))

    def replace(self, **changes: Any) -> TrainConfig:
        return attrs.evolve(self, **changes)
