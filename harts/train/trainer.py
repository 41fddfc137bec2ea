"""The step API: one RL optimisation step on a compiled plan (paper §3.5, §4.1, §4.3).

:meth:`Trainer.step` does what an RL trainer's actor update does, on the plan's microbatches:

1. old log-probs with the model as it is before the step, and reference log-probs with the
   reference model, under no grad, on the same plan and kernels (so the first epoch's
   ratios are exactly 1);
2. ``epochs`` times: every microbatch this rank's replica owns, in slot order, forward and
   backward with gradient accumulation, then gradient clipping and one optimizer step;
   MoE expert biases then move by the epoch's q-weighted expert loads.

Global denominators. Each microbatch's loss is its exact share of the batch loss: the
reduction's count (masked tokens for ``token-mean``, trajectories with a masked token for the
sequence means) is taken from the whole batch's masks before the first microbatch, and the
router z-loss divides by the batch's semantic-token count. The accumulated gradient, the
reported loss and the metrics are therefore those of the whole batch, whatever the
microbatching and the DP degree.

The load-balancing loss ``E sum_e f_e P_e`` couples the batch's routed fractions ``f_e``
(no gradient) with its mean router probabilities ``P_e``. ``f_e`` is measured over the whole
batch (all microbatches, all ranks) in step 1's pass; each microbatch then contributes its
q-weighted probability mass to ``P_e``. At the first epoch this is exactly the batch-level
loss; later epochs keep the step's ``f_e``.

``mode="baseline"`` runs the same microbatches trajectory-wise (every path expanded) through
the same code, so HARTS and the baseline can be compared step for step. Expanded, a microbatch
holds more raw tokens than the ``capacity`` its compact rows fit in, so the baseline runs each
as consecutive parts of its members of at most ``capacity`` raw tokens, accumulating gradients.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from harts.binding import BoundPlan
from harts.kernels import host
from harts.plan import Plan
from harts.rl import (
    ADVANTAGE_FIELDS,
    OLD_LOG_PROB_FIELDS,
    REF_LOG_PROB_FIELDS,
    loss_denominator,
    metadata_field,
    policy_loss,
    reduce_tokens,
    refuse_empty_loss_mask,
    token_metadata,
)
from harts.runtime.api import MicrobatchOutput, bind_plan, microbatch_log_probs, microbatch_log_probs_baseline, unwrap_model
from harts.runtime.moe import MoEStats, apply_expert_bias_update, load_balancing_loss, z_loss
from harts.train.config import TrainConfig, TrainingError
from harts.train.distributed import ProcessGroupInfo, gradient_sync, is_megatron_wrapper, replica_microbatches

logger = logging.getLogger(__name__)

__all__ = ["NonFiniteStepError", "StepResult", "Trainer", "train_step"]


class NonFiniteStepError(TrainingError):
    """A step's loss or gradient is NaN or infinite: the step is refused before the optimizer moves any weight."""

#: Batch-level sums behind the metrics (summed over microbatches and ranks).
_SUMS = ("loss", "policy_loss", "z_loss", "load_balancing_loss", "entropy", "kl", "tokens", "clipped",
         "neg_log_ratio", "ratio", "rows")
#: Figures taken as the maximum over ranks (``-ratio_min`` so that one MAX reduction serves).
_MAXES = ("ratio_max", "neg_ratio_min", "plan_seconds", "logprob_seconds", "fbgrad_seconds", "optimizer_seconds")

ProgressCallback = Callable[[str, int, int], None]


@attrs.frozen(eq=False)
class StepResult:
    """What :meth:`Trainer.step` did.

    ``metrics`` holds one dict per optimizer step (epoch), batch-level and equal on every rank:
    ``step``, ``epoch``, ``optimizer_step``, ``mode``, ``loss`` (the total minimised),
    ``policy_loss``, ``kl`` (k3 to the reference; None without one), ``approx_kl_old``,
    ``clip_fraction``, ``ratio_mean`` / ``ratio_min`` / ``ratio_max``, ``entropy``, ``z_loss`` and
    ``load_balancing_loss`` (None without MoE), ``grad_norm`` (before clipping), ``lr``,
    ``tokens`` (loss-masked tokens), ``semantic_tokens``, ``rows`` (hidden rows one pass
    executes: C for HARTS, S for the baseline), ``compression`` (S / rows) and the time split
    ``plan_seconds``, ``logprob_seconds`` (no-grad passes), ``fbgrad_seconds``,
    ``optimizer_seconds`` (max over ranks; a step's plan and no-grad passes are charged to its
    first epoch). ``old_log_probs`` maps each microbatch this rank ran to its old log-probs
    (member-major, as :class:`~harts.runtime.MicrobatchOutput`).
    """

    step: int
    mode: str
    metrics: tuple[dict[str, Any], ...]
    old_log_probs: dict[int, torch.Tensor] = attrs.field(factory=dict)

    @property
    def loss(self) -> float:
        """The loss of the step's first optimizer step (before any update of this step)."""
        return self.metrics[0]["loss"]


def _select(values: Any, members: Sequence[int]) -> Any:
    """The entries of per-trajectory metadata that belong to ``members`` (in that order)."""
    if values is None:
        return None
    if isinstance(values, (np.ndarray, torch.Tensor)):
        return values[list(members)]
    return [values[i] for i in members]


def _log_prob_offsets(batch) -> torch.Tensor:
    lengths = torch.as_tensor([len(t) - 1 for t in batch.tokens], dtype=torch.long)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    return offsets


@attrs.frozen
class _Part:
    """What one forward + backward runs: a whole microbatch (HARTS), or, for the baseline, a run of
    its members of at most the plan's capacity in raw tokens. The baseline expands every path, so a
    microbatch's whole membership holds compression times the rows HARTS executes for it (the
    headline's 193,589 raw tokens for 34,395 rows did not fit an H200); the loss shares carry batch
    denominators, so accumulating the parts gives the microbatch's gradient."""

    microbatch: int
    trajectories: tuple[int, ...]
    #: A pass run only so that expert-parallel ranks exchange rows in step (see _lockstep_parts).
    shadow: bool = False


def _lockstep_parts(parts: list[_Part], group, model, plan_module, batch, mode: str) -> list[_Part]:
    """Pad this rank's parts to the group's largest count with shadow passes, under expert parallelism.

    The MoE layers of a model split over an expert-parallel group that spans data-parallel
    ranks (``model.expert_parallel_lockstep``, harts.parallel) exchange rows with the other
    ranks in every forward and backward, so every rank must run as many passes. The plan gives
    each replica K / D microbatches, but the baseline's parts (runs of at most ``capacity`` raw
    tokens) may differ in number. A shadow pass reruns a part with its loss times 0: the same
    collectives, no gradient, no metric.
    """
    if not getattr(model, "expert_parallel_lockstep", False) or not group.distributed:
        return parts
    most = int(group.all_reduce(torch.tensor([len(parts)], device=model.device), "max")[0])
    if len(parts) == most:
        return parts
    rerun = parts[-1] if parts else _parts(plan_module.microbatches[:1], batch, plan_module, mode)[0]
    return parts + [attrs.evolve(rerun, shadow=True)] * (most - len(parts))


def _parts(microbatches, batch, module, mode: str) -> list[_Part]:
    if mode == "harts":
        return [_Part(mb.index, tuple(sorted(int(i) for i in mb.trajectories))) for mb in microbatches]
    parts = []
    for mb in microbatches:
        current: list[int] = []
        raw_tokens = 0
        for trajectory in sorted(int(i) for i in mb.trajectories):
            length = len(batch.tokens[trajectory])
            if current and raw_tokens + length > module.capacity:
                parts.append(_Part(mb.index, tuple(current)))
                current, raw_tokens = [], 0
            current.append(trajectory)
            raw_tokens += length
        if current:
            parts.append(_Part(mb.index, tuple(current)))
    return parts


@attrs.frozen(eq=False)
class _Step:
    """What :meth:`Trainer._prepare` reads once per step: the bound plan, this rank's parts and the loss inputs."""

    batch: Any
    plan: BoundPlan
    config: TrainConfig
    group: ProcessGroupInfo
    parts: list[_Part]
    advantages: Any
    old_field: Any
    ref_field: Any
    denominator: Any
    semantic_tokens: int
    moe_layers: int
    no_grad_passes: int


@attrs.frozen(eq=False)
class _NoGrad:
    """The no-grad passes' results: old and reference log-probs by part position, and routed expert counts."""

    old_by_part: dict[int, torch.Tensor]
    ref_by_part: dict[int, torch.Tensor]
    routed: torch.Tensor | None


class _Progress:
    """Counts finished microbatches and reports them to the step's ``on_microbatch`` callback."""

    def __init__(self, callback: ProgressCallback | None, total: int) -> None:
        self.callback, self.total, self.done = callback, total, 0

    def __call__(self, phase: str) -> None:
        self.done += 1
        if self.callback is not None:
            self.callback(phase, self.done, self.total)


def _checked_denominator(batch, reduction: str):
    """The loss denominator over the whole batch, refusing a loss mask that gates no log-prob."""
    refuse_empty_loss_mask(batch.loss_mask, _log_prob_offsets(batch))
    return loss_denominator(batch.loss_mask, _log_prob_offsets(batch), reduction)


class Trainer:
    """Runs RL optimisation steps of ``model`` on compiled plans.

    Args:
        model: a :class:`~harts.runtime.HybridModel`, or the same wrapped for data parallelism
            (``DistributedDataParallel``, or passed to FSDP2's ``fully_shard``); a
            :class:`~harts.parallel.TensorParallelHybridModel`, alone, in torch DDP or in
            megatron-core's (:func:`harts.parallel.optim.wrap_megatron`).
        optimizer: any ``torch.optim`` optimizer over the model's parameters; for a model in
            megatron-core's ``DistributedDataParallel``, megatron-core's optimizer
            (:func:`harts.parallel.optim.megatron_optimizer`), which then reduces, clips and steps.
        config: :class:`TrainConfig`.
        reference_model: frozen model for reference log-probs (KL); None: the batch's
            ``ref_log_probs`` field, if any.
        scheduler: an LR scheduler stepped after every optimizer step.
        process_group: the data-parallel group (default: the world, when torch.distributed
            is initialised); its size must equal the plan's ``dp_size``.
        kernels: kernel module override, as for :func:`harts.runtime.log_probs`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: TrainConfig | None = None,
        *,
        reference_model: nn.Module | None = None,
        scheduler: Any = None,
        process_group: Any = None,
        kernels: Any = None,
    ) -> None:
        self.model = model
        self.module = unwrap_model(model)
        self.optimizer = optimizer
        self.config = config or TrainConfig()
        self.reference_model = reference_model
        self.scheduler = scheduler
        self.process_group = process_group
        self.kernels = kernels
        self.steps_done = 0
        self.optimizer_steps = 0
        self._megatron = _megatron_stepper(model, optimizer)

    # ------------------------------------------------------------------ helpers

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _run(self, model: nn.Module, batch, plan: BoundPlan, part: _Part, config: TrainConfig, *, grad: bool) -> MicrobatchOutput:
        options = dict(
            recompute=config.recompute and grad,
            with_entropy=config.with_entropy and grad,
            row_chunk=config.row_chunk,
            kernels=self.kernels,
            temperature=config.temperature,
        )
        if config.mode == "harts":
            return microbatch_log_probs(model, plan, batch, part.microbatch, **options)
        return microbatch_log_probs_baseline(model, batch, part.trajectories, chunk_size=plan.plan.chunk_size, **options)

    def _moe_layers(self) -> int:
        return int(getattr(getattr(self.module, "config", None), "num_moe_layers", 0))

    # ------------------------------------------------------------------ the step

    def step(
        self,
        batch,
        plan: Plan | BoundPlan,
        *,
        advantages: Any = None,
        mode: str | None = None,
        on_microbatch: ProgressCallback | None = None,
    ) -> StepResult:
        """One RL optimisation step of ``batch`` on ``plan`` (see the module docstring).

        ``plan``: a laid-out :class:`~harts.Plan` (from :func:`harts.compile` or
        :func:`harts.load_plan`) or one bound to ``batch`` (:meth:`harts.Plan.bind`); it is
        bound once, here. ``advantages`` default to the batch's ``advantages`` / ``advantage``
        field (one per trajectory or per token). ``mode`` overrides ``config.mode``.
        ``on_microbatch(phase, done, total)`` is called after every microbatch (progress display).
        """
        config = self.config if mode is None else self.config.replace(mode=mode)
        step = self._prepare(batch, plan, config, advantages)
        progress = _Progress(on_microbatch, (step.no_grad_passes + config.epochs) * len(step.parts))
        self._zero_grad()
        started = self._now()
        no_grad = self._no_grad_passes(step, progress)
        logprob_seconds = self._now() - started
        metrics = tuple(
            self._epoch(step, no_grad, epoch, progress, logprob_seconds=logprob_seconds if epoch == 0 else 0.0)
            for epoch in range(config.epochs)
        )
        self.steps_done += 1
        old_by_microbatch: dict[int, list[torch.Tensor]] = {}
        for position, part in enumerate(step.parts):  # a microbatch's parts are consecutive runs of its sorted members
            if position in no_grad.old_by_part and not part.shadow:
                old_by_microbatch.setdefault(part.microbatch, []).append(no_grad.old_by_part[position])
        old_log_probs = {index: torch.cat(pieces) for index, pieces in old_by_microbatch.items()}
        return StepResult(step=self.steps_done, mode=config.mode, metrics=metrics, old_log_probs=old_log_probs)

    def _prepare(self, batch, plan: Plan | BoundPlan, config: TrainConfig, advantages: Any) -> "_Step":
        """Bind the plan, pick this rank's parts and read what the losses need from the batch."""
        bound = bind_plan(plan, batch, self.model)
        module = bound.module
        group = ProcessGroupInfo.of(self.model, self.process_group)
        parts = _parts(replica_microbatches(module, group.rank, group.world_size), batch, module, config.mode)
        parts = _lockstep_parts(parts, group, self.module, module, batch, config.mode)
        step_key = (module.input_hash, [(mb.index, mb.replica, mb.slot) for mb in module.microbatches], config)
        group.check_same(step_key, "plan or config")
        tensor_group = getattr(self.module, "tensor_parallel_group", None)
        if tensor_group is not None:
            # one plan on every rank of a tensor-parallel group: they execute the same rows
            ProcessGroupInfo(dist.get_rank(tensor_group), dist.get_world_size(tensor_group), tensor_group).check_same(
                step_key, "plan or config in its tensor-parallel group")
        old_field = None if config.recompute_old_log_probs else metadata_field(None, batch, OLD_LOG_PROB_FIELDS, "old_log_probs")
        ref_field = None
        if self.reference_model is None:
            ref_field = metadata_field(None, batch, REF_LOG_PROB_FIELDS, "ref_log_probs", required=bool(config.kl_coef))
        moe_layers = self._moe_layers()
        no_grad_passes = int(config.recompute_old_log_probs or bool(config.aux_loss_coef and moe_layers))
        no_grad_passes += int(self.reference_model is not None)
        return _Step(
            batch=batch, plan=bound, config=config, group=group, parts=parts,
            advantages=metadata_field(advantages, batch, ADVANTAGE_FIELDS, "advantages", required=True),
            old_field=old_field, ref_field=ref_field,
            denominator=_checked_denominator(batch, config.loss_reduction),
            semantic_tokens=batch.semantic_tokens, moe_layers=moe_layers, no_grad_passes=no_grad_passes,
        )

    def _no_grad_passes(self, step: "_Step", progress: "_Progress") -> "_NoGrad":
        """Old log-probs, reference log-probs (by position in the step's parts) and the batch's routed
        expert counts, under no grad."""
        config, batch, plan = step.config, step.batch, step.plan
        old_by_part: dict[int, torch.Tensor] = {}
        ref_by_part: dict[int, torch.Tensor] = {}
        routed = None
        with torch.no_grad():
            for position, part in enumerate(step.parts):
                if config.recompute_old_log_probs or (config.aux_loss_coef and step.moe_layers):
                    out = self._run(self.model, batch, plan, part, config, grad=False)
                    if config.recompute_old_log_probs:
                        old_by_part[position] = out.log_probs
                    if not part.shadow:
                        routed = out.moe.assign_count if routed is None else routed + out.moe.assign_count
                    progress("old log-probs")
                if self.reference_model is not None:
                    ref_by_part[position] = self._run(self.reference_model, batch, plan, part, config,
                                                      grad=False).log_probs
                    progress("reference log-probs")
        if routed is not None and step.moe_layers:
            routed = step.group.all_reduce(routed.clone())
        return _NoGrad(old_by_part, ref_by_part, routed)

    def _epoch(self, step: "_Step", no_grad: "_NoGrad", epoch: int, progress: "_Progress", *,
               logprob_seconds: float) -> dict[str, Any]:
        """One epoch: forward and backward of every part with gradient accumulation, then one optimizer step."""
        config, batch, device = step.config, step.batch, self.device
        sums = torch.zeros(len(_SUMS), dtype=torch.float64, device=device)
        maxes = torch.full((len(_MAXES),), float("-inf"), dtype=torch.float64, device=device)
        loads = None
        started = self._now()
        for position, part in enumerate(step.parts):
            with gradient_sync(self.model, enabled=position == len(step.parts) - 1):
                out = self._run(self.model, batch, step.plan, part, config, grad=True)
                terms = self._microbatch_loss(
                    out, batch, config, advantages=step.advantages, denominator=step.denominator,
                    old=no_grad.old_by_part.get(position, _select(step.old_field, out.trajectories)),
                    ref=no_grad.ref_by_part.get(position, _select(step.ref_field, out.trajectories)),
                    routed=no_grad.routed, semantic_tokens=step.semantic_tokens,
                )
                # DDP and FSDP2 average gradients over ranks; the shares already carry batch denominators.
                (terms["loss"] * (0 if part.shadow else step.group.world_size)).backward()
            if part.shadow:
                progress(f"epoch {epoch + 1}")
                continue
            for index, name in enumerate(_SUMS):
                if name in terms:
                    sums[index] += terms[name].detach().to(torch.float64)
            sums[_SUMS.index("rows")] += out.rows
            maxes[0] = torch.maximum(maxes[0], terms["ratio_max"].to(torch.float64))
            maxes[1] = torch.maximum(maxes[1], -terms["ratio_min"].to(torch.float64))
            if step.moe_layers:
                loads = out.moe.assign_count if loads is None else loads + out.moe.assign_count
            progress(f"epoch {epoch + 1}")
        fbgrad_seconds = self._now() - started

        started = self._now()
        lr = float(self.optimizer.param_groups[0]["lr"])
        grad_norm = self._clip_and_step(config, sums[_SUMS.index("loss")], step.group, epoch)
        if config.expert_bias_rate and step.moe_layers:
            self._update_expert_bias(step.group.all_reduce(loads.clone()), config.expert_bias_rate)
        optimizer_seconds = self._now() - started
        self.optimizer_steps += 1
        plan_seconds = 0.0
        if config.mode == "harts" and epoch == 0:
            plan_seconds = float(step.plan.stats.get("plan_seconds") or 0.0)
        maxes[2:] = host.upload(np.array([plan_seconds, logprob_seconds, fbgrad_seconds, optimizer_seconds]), device)
        return self._reduce(step, no_grad, epoch, sums, maxes, grad_norm=grad_norm, lr=lr)

    def _reduce(self, step: "_Step", no_grad: "_NoGrad", epoch: int, sums: torch.Tensor, maxes: torch.Tensor, *,
                grad_norm: float, lr: float) -> dict[str, Any]:
        """The epoch's batch-level metrics: sums and maxima reduced over ranks, then recorded."""
        step.group.all_reduce(sums)
        step.group.all_reduce(maxes, "max")
        has_kl = bool(no_grad.ref_by_part) or step.ref_field is not None
        return self._record(epoch, step.config, sums, maxes, grad_norm, lr, step.semantic_tokens, step.moe_layers,
                            has_kl=has_kl, routed=no_grad.routed)

    def _microbatch_loss(self, out, batch, config, *, advantages, denominator, old, ref, routed, semantic_tokens):
        """This microbatch's share of the batch loss, and the detached sums behind the metrics."""
        members = list(out.trajectories)
        cu = torch.as_tensor(out.offsets, dtype=torch.long)  # on the host, where the losses read lengths
        loss_mask = _select(batch.loss_mask, members)
        terms = policy_loss(
            out.log_probs, cu_seqlens=cu, advantages=_select(advantages, members), loss_mask=loss_mask,
            old_log_probs=old, ref_log_probs=ref, clip_eps=config.clip_eps, clip_eps_high=config.clip_eps_high,
            dual_clip=config.dual_clip, kl_coef=config.kl_coef, reduction=config.loss_reduction, denominator=denominator,
        )
        loss = terms.loss
        parts = {"policy_loss": terms.loss.detach(), **terms.sums}
        if out.entropy is not None:
            mask = token_metadata(loss_mask, cu, name="loss_mask", device=out.entropy.device, dtype=out.entropy.dtype)
            parts["entropy"] = (out.entropy.detach() * mask).sum()
            if config.entropy_coef:
                loss = loss - config.entropy_coef * reduce_tokens(out.entropy, mask, cu, config.loss_reduction, denominator)
        if out.moe.num_layers:
            # The microbatch's statistics over the batch's token count (and routed fractions):
            # shares that sum to the batch-level router losses.
            share = MoEStats(
                z_loss_sum=out.moe.z_loss_sum,
                prob_mass=out.moe.prob_mass,
                assign_count=routed if routed is not None else out.moe.assign_count,
                tokens=torch.full_like(out.moe.tokens, float(semantic_tokens)),
            )
            z_share = z_loss(share)
            parts["z_loss"] = z_share.detach()
            if config.z_loss_coef:
                loss = loss + config.z_loss_coef * z_share
            if routed is not None:
                balance_share = load_balancing_loss(share)
                parts["load_balancing_loss"] = balance_share.detach()
                if config.aux_loss_coef:
                    loss = loss + config.aux_loss_coef * balance_share
        parts["loss"] = loss
        return parts

    def _zero_grad(self) -> None:
        (self._megatron or self.optimizer).zero_grad(set_to_none=True)

    def _gradient_norm(self, max_norm: float) -> torch.Tensor | float:
        """Reduce the accumulated gradients, measure the whole model's norm and (torch path) clip to ``max_norm``."""
        if self._megatron is not None:
            # megatron-core's DDP: finalize_model_grads does the DP reduction and the TP sum of the
            # replicated parameters (harts.parallel.optim), so HARTS' own sum must not run as well
            return self._megatron.gradient_norm()
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        # A model split over a tensor-parallel group (harts.parallel) sums its replicated parameters'
        # gradients over the group and measures the norm of the whole model, shards and replicas once.
        finalize = getattr(self.module, "finalize_gradients", None)
        if finalize is not None:
            finalize()
        clip = getattr(self.module, "clip_grad_norm_", None)
        if clip is not None:
            norm = clip(max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm) if parameters else torch.zeros(())
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
            norm = norm.full_tensor()
        return norm

    def _clip_and_step(self, config: TrainConfig, local_loss: torch.Tensor, group: ProcessGroupInfo, epoch: int) -> float:
        max_norm = float("inf") if config.max_grad_norm is None else config.max_grad_norm
        norm = self._gradient_norm(max_norm)
        # the batch loss over every rank, so that all ranks refuse the same step together
        loss = group.all_reduce(local_loss.detach().clone().reshape(1))[0]
        if isinstance(norm, torch.Tensor):  # both read in one wait for the device, the step's only one before its metrics
            loss, norm = torch.stack([loss, norm.to(loss)]).tolist()
        loss = float(loss)
        if not (math.isfinite(loss) and math.isfinite(float(norm))):
            self._zero_grad()
            raise NonFiniteStepError(
                f"step {self.steps_done + 1}, epoch {epoch + 1}: the loss is {loss} and the gradient norm {float(norm)}; "
                "the optimizer step was not taken (the weights are those before it). Check the learning rate, the "
                "temperature and the batch's advantages, rewards and log-probs"
            )
        if self._megatron is not None:
            self._megatron.clip_and_step(float(norm), config.max_grad_norm)
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self._zero_grad()
        return float(norm)

    def _update_expert_bias(self, loads: torch.Tensor, rate: float) -> None:
        zeros = torch.zeros(loads.shape[0], dtype=loads.dtype, device=loads.device)
        stats = MoEStats(z_loss_sum=zeros, prob_mass=torch.zeros_like(loads), assign_count=loads, tokens=zeros)
        apply_expert_bias_update(self.module, stats, rate=rate)

    def _record(self, epoch, config, sums, maxes, grad_norm, lr, semantic_tokens, moe_layers, *, has_kl, routed):
        values = torch.cat([sums, maxes]).tolist()  # the epoch's figures, read from the device in one go
        total = dict(zip(_SUMS, values[: len(_SUMS)]))
        peak = dict(zip(_MAXES, values[len(_SUMS):]))
        count = max(total["tokens"], 1.0)
        return {
            "step": self.steps_done + 1,
            "epoch": epoch + 1,
            "optimizer_step": self.optimizer_steps,
            "mode": config.mode,
            "loss": total["loss"],
            "policy_loss": total["policy_loss"],
            "kl": total["kl"] / count if has_kl else None,
            "approx_kl_old": total["neg_log_ratio"] / count,
            "clip_fraction": total["clipped"] / count,
            "ratio_mean": total["ratio"] / count,
            "ratio_min": -peak["neg_ratio_min"],
            "ratio_max": peak["ratio_max"],
            "entropy": total["entropy"] / count if config.with_entropy else None,
            "z_loss": total["z_loss"] if moe_layers else None,
            "load_balancing_loss": total["load_balancing_loss"] if moe_layers and routed is not None else None,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": total["tokens"],
            "semantic_tokens": semantic_tokens,
            "rows": int(total["rows"]),
            "compression": semantic_tokens / max(total["rows"], 1.0),
            "plan_seconds": peak["plan_seconds"],
            "logprob_seconds": peak["logprob_seconds"],
            "fbgrad_seconds": peak["fbgrad_seconds"],
            "rows_per_second": total["rows"] / peak["fbgrad_seconds"] if peak["fbgrad_seconds"] > 0 else None,
            "optimizer_seconds": peak["optimizer_seconds"],
        }


def _megatron_stepper(model: nn.Module, optimizer: Any):
    """harts.parallel.optim's stepper when ``model`` is in megatron-core's DDP (its optimizer must be megatron's), else None."""
    megatron_optimizers = sys.modules.get("megatron.core.optimizer")
    megatron_optimizer = megatron_optimizers is not None and isinstance(optimizer, megatron_optimizers.MegatronOptimizer)
    if not is_megatron_wrapper(model):
        if megatron_optimizer:
            raise TrainingError("a megatron-core optimizer needs the model in megatron-core's DistributedDataParallel "
                                "(harts.parallel.optim.wrap_megatron)")
        return None
    if not megatron_optimizer:
        # megatron DDP moves every gradient into its buffers (param.main_grad) and leaves param.grad None:
        # a torch optimizer would silently step nothing
        raise TrainingError(f"a model in megatron-core's DistributedDataParallel needs megatron-core's optimizer "
                            f"(harts.parallel.optim.megatron_optimizer), got {type(optimizer).__name__}")
    from harts.parallel.optim import MegatronStepper

    return MegatronStepper(model, optimizer)


def train_step(model, optimizer, batch, plan, config: TrainConfig | None = None, **options) -> StepResult:
    """One step with a throw-away :class:`Trainer` (``options``: its keyword arguments and ``step``'s)."""
    step_options = {key: options.pop(key) for key in ("advantages", "mode", "on_microbatch") if key in options}
    return Trainer(model, optimizer, config, **options).step(batch, plan, **step_options)
