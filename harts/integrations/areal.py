"""AReaL: a HARTS actor engine for AReaL's PPO / GRPO trainer (AReaL 1.0.4, ``areal/engine/fsdp_engine.py``).

In a training script, in place of AReaL's FSDP actor::

    from harts.integrations.areal import HartsPPOActor
    actor = HartsPPOActor(config=config.actor)        # was: FSDPPPOActor(config=config.actor)

:class:`HartsPPOActor` is AReaL's ``FSDPPPOActor`` (model, optimizer, checkpoints, weight sync to
the rollout engine, ``PPOActor``'s advantages and ``ppo_update``) with ``train_batch``,
``eval_batch`` and ``forward_batch`` computed by HARTS: the batch ``PPOActor`` hands the engine
(padded ``[B, S]`` after ``compute_advantages``, or AReaL's ``list[dict]``) is compiled once
(:func:`harts.interop.from_areal` with ``rolled=True``), each microbatch of the plan is packed as
AReaL packs its micro-batches (``pack_tensor_dict``: ``input_ids`` ``[T]``, ``cu_seqlens``, the
rolled ``loss_mask``, ``logprobs``, ``advantages``, ...) and AReaL's own loss (``grpo_loss_fn``)
receives log-probs and entropies in the ``"areal"`` layout, next-token aligned as its engine
gathers them at ``roll(input_ids, -1)``. Each microbatch's loss is scaled by its share of the
batch's ``loss_weight_fn`` total times the data-parallel size, as ``FSDPEngine.train_batch`` does.
The capacity of a microbatch is the engine's ``mb_spec.max_tokens_per_mb``, else the batch's tokens
over ``mb_spec.n_mbs``: never more than one of AReaL's micro-batches would hold.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from harts.integrations.engine import SharedModels, compile_for
from harts.interop import from_areal, layout_spec
from harts.runtime import microbatch_log_probs

from areal.engine.fsdp_engine import FSDPPPOActor
from areal.utils.data import pack_tensor_dict, pad_and_stack_tensors_along_first_dim, split_batch

logger = logging.getLogger(__name__)

__all__ = ["HartsPPOActor", "actor_batch"]


def actor_batch(data: dict[str, Any]):
    """The :class:`harts.RolloutBatch` of the padded batch ``PPOActor.ppo_update`` hands its engine (rolled)."""
    return from_areal(data, rolled=True, ignore=[key for key, value in data.items() if not torch.is_tensor(value)])


def _rows(data: dict[str, Any], members: list[int], device: torch.device) -> dict[str, Any]:
    """The trajectories ``members`` of a padded batch, packed as AReaL packs a micro-batch, on ``device``."""
    count = data["attention_mask"].shape[0]
    index = torch.as_tensor(members, device=data["attention_mask"].device)
    selected = {key: value.index_select(0, index) if torch.is_tensor(value) and value.ndim and value.shape[0] == count else value
                for key, value in data.items()}
    return {key: value.to(device) if torch.is_tensor(value) else value for key, value in pack_tensor_dict(selected).items()}


class HartsPPOActor(FSDPPPOActor):
    """AReaL's FSDP PPO actor with HARTS' prefix-sharing forward and backward (see the module docstring)."""

    _shared_models: SharedModels | None = None

    def harts_model(self) -> nn.Module:
        """The HARTS model on the engine's Hugging Face model's own tensors (its gradients land there)."""
        if self._shared_models is None:
            self._shared_models = SharedModels()
        return self._shared_models(self.model)

    def _capacity(self, batch) -> int:
        """Compact rows per microbatch: ``mb_spec.max_tokens_per_mb``, else the batch's tokens over ``mb_spec.n_mbs``."""
        spec = self.config.mb_spec
        if spec.max_tokens_per_mb is not None:
            return int(spec.max_tokens_per_mb)
        return -(-int(batch.semantic_tokens) // max(int(spec.n_mbs or 1), 1))

    def _microbatches(self, data: dict[str, Any], *, with_entropy: bool, grad: bool):
        """(packed micro-batch dict, log-probs, entropies) per microbatch of one plan over ``data``."""
        model = self.harts_model()
        batch = actor_batch(data)
        plan = compile_for(batch, self._capacity(batch))
        for microbatch in plan.module.microbatches:
            members = list(microbatch.trajectories)
            with torch.enable_grad() if grad else torch.no_grad():
                out = microbatch_log_probs(model, plan, batch, microbatch.index, with_entropy=with_entropy,
                                           temperature=self.config.temperature)
            spec = layout_spec(batch.subset(members), "areal")
            pieces = [slice(int(out.offsets[j]), int(out.offsets[j + 1])) for j in range(len(members))]
            log_probs = spec.log_probs([out.log_probs[p] for p in pieces])
            entropy = spec.log_probs([out.entropy[p] for p in pieces]) if with_entropy else None
            yield members, _rows(data, members, log_probs.device), log_probs, entropy

    def _loss_weights(self, data, loss_weight_fn) -> torch.Tensor:
        """``loss_weight_fn`` of the whole batch, summed over data-parallel ranks (AReaL's ``compute_total_loss_weight``)."""
        total = loss_weight_fn(pack_tensor_dict(data)).detach().clone().to(torch.float32)
        dist.all_reduce(total, group=self.dp_group)
        return total

    def train_batch(
        self,
        input_: list[dict[str, Any]] | dict[str, Any],
        loss_fn: Callable[..., torch.Tensor],
        loss_weight_fn: Callable[[dict[str, Any]], torch.Tensor],
    ) -> dict[str, float]:
        self._ensure_ready()
        self.optimizer_zero_grad()
        data, _ = self._normalize_batch_input(input_)
        total = self._loss_weights(data, loss_weight_fn)
        count = 0
        for _, mb_input, log_probs, entropy in self._microbatches(data, with_entropy=True, grad=True):
            count += 1
            weight = loss_weight_fn(mb_input)
            if weight == 0:
                continue
            loss = loss_fn(log_probs, entropy, mb_input)
            (loss * (weight / total * self.parallel_helper.dp_size)).backward()
        stats = self.optimizer_step()
        stats["num_micro_batches"] = count
        return stats

    @torch.no_grad()
    def eval_batch(self, input_, loss_fn, loss_weight_fn) -> torch.Tensor | None:
        self._ensure_ready()
        data, _ = self._normalize_batch_input(input_)
        total = self._loss_weights(data, loss_weight_fn)
        loss = torch.zeros((), dtype=torch.float32)
        for _, mb_input, log_probs, entropy in self._microbatches(data, with_entropy=True, grad=False):
            loss = loss + loss_fn(log_probs, entropy, mb_input).float() * (loss_weight_fn(mb_input) / total)
        dist.all_reduce(loss, group=self.dp_group)
        return loss

    @torch.no_grad()
    def forward_batch(self, input_, output_seqlens: list[int] | None = None, aggregate_fn=torch.cat):
        """Per-trajectory next-token log-probs, padded and stacked ``[B, max len]`` as AReaL's engine returns them."""
        self._ensure_ready()
        data, meta = self._normalize_batch_input(input_)
        rows: list[torch.Tensor | None] = [None] * data["attention_mask"].shape[0]
        for members, mb_input, log_probs, _ in self._microbatches(data, with_entropy=False, grad=False):
            lengths = np.diff(mb_input["cu_seqlens"].cpu().numpy())
            for member, row in zip(members, log_probs.split(lengths.tolist())):
                rows[member] = row
        result = pad_and_stack_tensors_along_first_dim(rows)
        return result if meta is None else split_batch(result, meta)
