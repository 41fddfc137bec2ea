"""TRL plug-in: :class:`HartsGRPOTrainer`, a ``GRPOTrainer`` whose per-token log-probs come from HARTS plans.

Two lines in a TRL script::

    from harts.integrations.trl import HartsGRPOConfig as GRPOConfig, HartsGRPOTrainer as GRPOTrainer
    args = GRPOConfig(..., harts_capacity=32768)          # use_harts=True by default

Everything else is TRL's: generation, rewards, advantages, the loss, the optimizer and the
model (a Qwen3-Next or Kimi Linear transformers model). The one method replaced is
``GRPOTrainer._get_per_token_logps_and_entropies`` (TRL 1.16), through which TRL runs the
policy pass of the loss, the old-policy pass and the reference pass. Here it runs the
trainer's own model through :func:`harts.models.share_hf` (the same parameter objects, so
gradients land on them and the optimizer, checkpoints and weight sync see the trained model)
on a plan compiled once per generation batch: the batch is compiled the first time a pass
sees its rollouts, and the other passes over the same rollouts (in any order, as TRL shuffles
them) reuse that plan. With ``steps_per_generation > 1`` TRL cuts the generation batch into
training micro-batches after the old and reference passes; each micro-batch then has a plan of
its own (compiled at its first policy pass and reused by the next ``num_iterations - 1``). The router load-balancing loss of MoE models is transformers'
``load_balancing_loss_func`` over every real token, as TRL's fused head computes it.

Refused with :class:`~harts.integrations.engine.IntegrationError`: several processes (the
HARTS forward would bypass the DDP / FSDP / DeepSpeed wrapper's forward and with it the
gradient synchronisation), PEFT adapters (their modules are not part of the architecture
HARTS computes), multimodal inputs, and rows whose attention mask has holes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from accelerate.utils import is_peft_model
from trl import GRPOConfig, GRPOTrainer
from trl.extras.profiling import profiling_decorator

from harts.integrations.engine import HartsEngine, IntegrationError, scatter_next_token, trajectories_from_padded

logger = logging.getLogger(__name__)

__all__ = ["HartsGRPOConfig", "HartsGRPOTrainer"]


@dataclass
class HartsGRPOConfig(GRPOConfig):
    """``GRPOConfig`` with the HARTS options (every other field is TRL's)."""

    use_harts: bool = field(
        default=True, metadata={"help": "Compute per-token log-probs and entropies on compiled HARTS plans."}
    )
    harts_capacity: int | None = field(
        default=None,
        metadata={"help": "Compact tokens per HARTS microbatch (bounds activation memory); None: a batch in one."},
    )
    harts_chunk_size: int = field(default=64, metadata={"help": "Linear-attention chunk size HARTS plans for."})


class HartsGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose policy, old and reference log-probs come from HARTS plans (see the module docstring)."""

    _harts: HartsEngine | None = None  # None: TRL's own forward (use_harts=False)

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *positional, **keywords):
        use_harts = bool(getattr(args, "use_harts", False))
        if use_harts:
            _refuse_before_init(args, keywords)
        super().__init__(model, reward_funcs, args, *positional, **keywords)
        if use_harts:
            self._refuse_after_init()
            # room for the generation batch's plan and one per training micro-batch cut from it
            cache_size = max(4, args.steps_per_generation + 2)
            self._harts = HartsEngine(capacity=args.harts_capacity, chunk_size=args.harts_chunk_size, cache_size=cache_size)
            # share now, so a model HARTS cannot compute fails here rather than at the first step
            self._harts.model_for(self.accelerator.unwrap_model(self.model))
            if self.ref_model is not None:
                self._harts.model_for(self.ref_model)

    def _refuse_after_init(self) -> None:
        if self.accelerator.num_processes > 1:
            raise IntegrationError(
                f"use_harts: {self.accelerator.num_processes} processes; HartsGRPOTrainer runs in one process (its "
                "forward would bypass the distributed wrapper's gradient synchronisation)"
            )
        if is_peft_model(self.model):
            raise IntegrationError("use_harts: the model carries PEFT adapters, which HARTS does not compute")
        if self._is_vlm:
            raise IntegrationError("use_harts: vision-language models are not supported (HARTS computes text models)")

    @profiling_decorator
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's contract: ([B, logits_to_keep] log-probs, entropies or None, aux loss or None), 0 at padding.

        ``batch_size`` (TRL's memory chunking) plays no part: the plan's capacity bounds memory.
        """
        if self._harts is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal,
            )
        given = sorted(name for name, value in multimodal.items() if value is not None)
        if given:
            raise IntegrationError(f"use_harts: multimodal inputs {given} are not supported")
        trajectories, starts = trajectories_from_padded(input_ids, attention_mask)
        recompute = bool(self.args.gradient_checkpointing) and torch.is_grad_enabled()
        with self.accelerator.autocast():
            out = self._harts.run(
                self.accelerator.unwrap_model(model), trajectories, temperature=self.temperature,
                with_entropy=compute_entropy, with_aux_loss=compute_aux_loss, recompute=recompute,
            )
        first = input_ids.size(1) - logits_to_keep
        logps = scatter_next_token(out.log_probs, starts, first, logits_to_keep)
        entropies = scatter_next_token(out.entropy, starts, first, logits_to_keep) if compute_entropy else None
        return logps, entropies, out.aux_loss


def _refuse_before_init(args, keywords) -> None:
    if keywords.get("peft_config") is not None:
        raise IntegrationError("use_harts: peft_config is set; HARTS trains the full model, not PEFT adapters")
    if args.world_size > 1:
        raise IntegrationError(
            f"use_harts: world size {args.world_size}; HartsGRPOTrainer runs in one process (its forward would "
            "bypass the distributed wrapper's gradient synchronisation)"
        )
    if args.harts_chunk_size < 1 or (args.harts_capacity is not None and args.harts_capacity < 1):
        raise IntegrationError(
            f"use_harts: harts_chunk_size ({args.harts_chunk_size}) and harts_capacity ({args.harts_capacity}) "
            "must be positive"
        )
