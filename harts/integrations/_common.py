"""What the verl and AReaL engines share: the HARTS model of the framework's Hugging Face model, and the plan.

``hybrid_model_of`` is the one place the model is constructed: :func:`harts.models.share_hf`,
a HARTS model on the framework's own parameters, so gradients land on them and the framework's
optimizer, checkpointing and weight sync see the update as if its own forward had run.
:func:`sync_weights` and :func:`land_gradients` copy weights in and gradients out for any
parameter that is not the framework's own tensor (a model built by :func:`harts.models.from_hf`
instead); for a shared model they do nothing.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

import harts
from harts.integrations.engine import IntegrationError

logger = logging.getLogger(__name__)

__all__ = ["IntegrationError", "compile_for", "hybrid_model_of", "land_gradients", "scalar_temperature", "sync_weights"]


def hybrid_model_of(hf_model: nn.Module) -> nn.Module:
    """The HARTS model computing on ``hf_model`` (a transformers Qwen3-Next / Kimi Linear causal LM), sharing its parameters."""
    from harts.models import share_hf

    for parameter in hf_model.parameters():
        _local(parameter)  # HARTS' forward does not run FSDP's unsharding hooks
    return share_hf(hf_model)


def _pairs(hybrid: nn.Module, hf_model: nn.Module):
    """(HARTS parameter, the framework's parameter it mirrors) for every parameter of ``hybrid``."""
    from harts.models import hf_key_map

    names = hf_key_map(hybrid)
    for name, parameter in hybrid.named_parameters():
        yield parameter, hf_model.get_parameter(names[name])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    if type(tensor).__name__ == "DTensor":
        raise IntegrationError(
            "the framework's model is sharded (FSDP2 DTensor parameters); the HARTS engine runs on the unsharded "
            "model (world size 1, or a replicated model) until it gathers shards itself"
        )
    return tensor


def sync_weights(hybrid: nn.Module, hf_model: nn.Module) -> None:
    """Copy the framework's current weights into ``hybrid`` (nothing for parameters they share)."""
    with torch.no_grad():
        for ours, theirs in _pairs(hybrid, hf_model):
            if ours is not theirs:
                ours.copy_(_local(theirs))


def land_gradients(hybrid: nn.Module, hf_model: nn.Module) -> None:
    """Add ``hybrid``'s gradients onto the framework's parameters and clear them on ``hybrid``."""
    for ours, theirs in _pairs(hybrid, hf_model):
        if ours is theirs or ours.grad is None:
            continue
        grad = ours.grad.to(theirs.dtype)
        theirs.grad = grad if theirs.grad is None else _local(theirs.grad) + grad
        ours.grad = None


def scalar_temperature(value, where: str) -> float:
    """The sampling temperature as one number (HARTS scales one LM head for the whole batch)."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().flatten()
        if flat.numel() == 0 or not bool((flat == flat[0]).all()):
            raise IntegrationError(f"{where}: per-trajectory temperatures differ; HARTS runs one temperature per batch")
        return float(flat[0])
    return float(value)


def compile_for(batch: harts.RolloutBatch, capacity: int | None) -> harts.Plan:
    """One plan for the framework's batch: microbatches of at most ``capacity`` compact rows (all in one when None)."""
    longest = int(batch.lengths.max(initial=1))
    capacity = max(int(capacity or batch.semantic_tokens), longest)
    return harts.compile(batch, capacity=capacity, dp_size=1)
