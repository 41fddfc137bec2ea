"""verl: a HARTS engine for verl's engine workers (verl 0.9.1, ``verl/workers/engine``).

In the actor config (Hydra overrides of ``ppo_trainer.yaml``)::

    actor_rollout_ref.actor.strategy=harts
    actor_rollout_ref.model.external_lib=harts.integrations.verl   # imported on every worker: registers the engine

``import harts.integrations.verl`` registers :class:`HartsEngine` in verl's ``EngineRegistry``
as backend ``"harts"`` of ``model_type="language_model"``, the way verl registers its FSDP
engine; ``TrainingWorker`` then builds it from the same ``FSDPActorConfig`` (``actor.strategy``
is copied into the engine config, ``verl/workers/config/actor.py``). Everything but the
forward-backward is verl's FSDP engine: the Hugging Face model, its optimizer, checkpoints and
the weight sync to the rollout engine.

:meth:`HartsEngine.forward_backward_batch` receives what verl's workers hand an engine: the
``TensorDict`` after ``left_right_2_no_padding`` (nested ``input_ids`` / ``position_ids``, the
padded ``attention_mask``, ``prompts``, ``responses``, ``response_mask``, ``old_log_probs``,
``advantages``, ...; ``verl/trainer/ppo/ray_trainer.py``). It compiles the batch once
(:func:`harts.interop.from_verl`, :func:`harts.compile`), runs each microbatch of the plan in
place of verl's micro-batches, and hands verl's own loss function (``ppo_loss``,
``verl/workers/utils/losses.py``) ``model_output["log_probs"]`` / ``["entropy"]`` as verl's
engine makes them: nested ``[B, len_i]``, entry ``t`` = log p(token ``t + 1``), the layout
``ppo_loss`` slices with ``no_padding_2_padding``. Losses are normalised by verl's global
``batch_num_tokens`` / ``dp_size`` / ``global_batch_size`` exactly as in its engine, so the
microbatches' gradients add up to the batch's.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from harts.integrations.engine import IntegrationError, SharedModels, compile_for, scalar_temperature
from harts.interop import from_verl, layout_spec
from harts.runtime import microbatch_log_probs

from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id
from verl.workers.engine import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import postprocess_batch_func

logger = logging.getLogger(__name__)

__all__ = ["BACKEND", "HartsEngine", "worker_batch"]

#: The ``actor.strategy`` that selects the HARTS engine.
BACKEND = "harts"
#: The FSDP wrapping the engine keeps from verl (for the model, optimizer and checkpoints).
FSDP_STRATEGY = "fsdp2"
def worker_batch(data):
    """The :class:`harts.RolloutBatch` of a batch as verl's engine workers receive it (or a padded DataProto)."""
    return from_verl(data)


def _unwrapped(module: nn.Module) -> nn.Module:
    if type(module).__name__ == "FullyShardedDataParallel":
        raise IntegrationError(
            f"actor.strategy={BACKEND} keeps verl's FSDP2 wrapping ({FSDP_STRATEGY}); FSDP1's flat parameters are not supported"
        )
    return module


def _next_token_nested(batch, values: torch.Tensor, offsets) -> torch.Tensor:
    """``values`` (member-major, ``len_i - 1`` each) as verl's nested model output: entry t = token t + 1, last 0."""
    pieces = [values[int(offsets[j]) : int(offsets[j + 1])] for j in range(len(offsets) - 1)]
    return layout_spec(batch, "nested").log_probs(pieces)


@EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cuda", "npu", "cpu"])
class HartsEngine(FSDPEngineWithLMHead):
    """verl's FSDP engine with HARTS' prefix-sharing forward-backward (see the module docstring)."""

    _shared_models: SharedModels | None = None

    def _build_fsdp_module(self, module):
        with self._fsdp_strategy():
            return super()._build_fsdp_module(module)

    @contextmanager
    def _fsdp_strategy(self):
        # verl's FSDP builder branches on the engine config's strategy, which names this backend
        strategy = self.engine_config.strategy
        object.__setattr__(self.engine_config, "strategy", FSDP_STRATEGY)
        try:
            yield
        finally:
            object.__setattr__(self.engine_config, "strategy", strategy)

    def harts_model(self) -> nn.Module:
        """The HARTS model on the engine's Hugging Face model's own tensors (its gradients land there)."""
        if self._shared_models is None:
            self._shared_models = SharedModels()
        return self._shared_models(_unwrapped(self.module))

    def _global_batch_info(self, data) -> None:
        """``batch_num_tokens`` and ``dp_size`` as verl's FSDP engine sets them before its loss runs."""
        if self.ulysses_sequence_parallel_size > 1:
            raise IntegrationError(f"actor.strategy={BACKEND} does not run Ulysses sequence parallelism; set ulysses_sequence_parallel_size=1")
        tu.assign_non_tensor(data, sp_size=1)
        batch_num_tokens = data["loss_mask"].sum().to(get_device_id())
        torch.distributed.all_reduce(batch_num_tokens, op=torch.distributed.ReduceOp.SUM, group=self.get_data_parallel_group())
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())

    @staticmethod
    def _capacity(data, batch) -> int | None:
        """Compact rows per microbatch: at most the tokens one of verl's micro-batches would hold."""
        if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
            return tu.get_non_tensor_data(data=data, key="max_token_len_per_gpu", default=None)
        size = tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=None)
        return None if size is None else int(size) * int(batch.lengths.max(initial=1))

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        self._global_batch_info(data)
        model = self.harts_model()
        batch = worker_batch(data)
        plan = compile_for(batch, self._capacity(data, batch))
        temperature = scalar_temperature(data["temperature"], "verl batch, key 'temperature'")
        with_entropy = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
        per_trajectory: dict[str, list[torch.Tensor | None]] = {"log_probs": [None] * len(batch)}
        if with_entropy:
            per_trajectory["entropy"] = [None] * len(batch)
        output_lst = []
        for microbatch in plan.module.microbatches:
            members = list(microbatch.trajectories)
            with torch.no_grad() if forward_only else nullcontext():
                out = microbatch_log_probs(model, plan, batch, microbatch.index, with_entropy=with_entropy, temperature=temperature)
                model_output = {"log_probs": _next_token_nested(batch.subset(members), out.log_probs, out.offsets)}
                if with_entropy:
                    model_output["entropy"] = _next_token_nested(batch.subset(members), out.entropy, out.offsets)
                micro_batch = tu.index_select_tensor_dict(data, members)
                if loss_function is not None:
                    loss, metrics = loss_function(model_output=model_output, data=micro_batch, dp_group=self.get_data_parallel_group())
                else:
                    if not forward_only:
                        raise IntegrationError("forward_backward_batch: a backward pass needs a loss function")
                    loss, metrics = torch.tensor(1.0), {}
                if not forward_only:
                    loss.backward()
            for key, nested in model_output.items():
                for member, row in zip(members, nested.detach().unbind()):
                    per_trajectory[key][member] = row
            output_lst.append({"loss": loss.detach().item(), "metrics": metrics})
        output = postprocess_batch_func(output_lst=output_lst, indices=None, data=data)
        output["model_output"] = {key: torch.nested.as_nested_tensor(rows, layout=torch.jagged) for key, rows in per_trajectory.items()}
        return output
