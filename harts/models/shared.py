"""A HARTS model over a Hugging Face model's own parameters: :func:`share_hf`.

A trainer (TRL, verl, AReaL) owns a transformers model: it generates with it, steps its
optimizer on its parameters, checkpoints it and syncs it to vLLM / SGLang. :func:`from_hf`
copies that model's weights into a new :class:`HybridModel`, so HARTS would train a second
copy. :func:`share_hf` instead builds the HybridModel's modules on the meta device (no
storage) and then puts the transformers model's Parameter and buffer objects into them, one
to one by :func:`~harts.models.hf_key_map`. Both module trees then hold the same tensors:

* a HARTS forward reads the trainer's current weights (an optimizer step on the transformers
  parameters is seen by the next HARTS pass, with nothing to sync);
* a HARTS backward accumulates into the transformers parameters' ``.grad``;
* no weight is stored twice (:func:`is_shared` checks the identity).

The module structure and the math are the HybridModel's; only the tensors are shared. Tensors
keep the transformers dtypes (HARTS' own models widen routers and decay biases to float32;
the HARTS layers cast them to the compute dtype when they are read, so the math is the same).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from harts.models.hf import HFModelError, checked_hf_config, finish_from_hf, hf_key_map, mapped_hf_state
from harts.runtime.model import HybridModel

logger = logging.getLogger(__name__)

__all__ = ["is_shared", "share_hf"]


def share_hf(hf_model: nn.Module) -> HybridModel:
    """A :class:`HybridModel` computing ``hf_model``'s function on ``hf_model``'s own parameters and buffers.

    ``hf_model`` is a ``Qwen3NextForCausalLM`` or ``KimiLinearForCausalLM`` (the checks of
    :func:`~harts.models.from_hf` apply: adapters, quantised or foreign modules are refused
    with :class:`~harts.models.HFModelError`). A compiled plan runs at the chunk size it was
    compiled for. Nothing is copied: see the module docstring.
    """
    config, model_type = checked_hf_config(hf_model)
    with torch.device("meta"):
        model = HybridModel(config)
    tensors = mapped_hf_state(hf_model, model, model_type, keep_vars=True)
    for name, tensor in tensors.items():
        owner_name, _, attribute = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if attribute in owner._parameters:
            if not isinstance(tensor, nn.Parameter):
                raise HFModelError(f"{type(hf_model).__name__} state {name!r} is not a Parameter; HARTS trains it as one")
            owner._parameters[attribute] = tensor
        else:
            owner._buffers[attribute] = tensor
    left_on_meta = [name for name, tensor in _state(model) if tensor.is_meta]
    if left_on_meta:
        raise HFModelError(f"share_hf: {left_on_meta[:5]} of the HARTS model have no transformers counterpart")
    finish_from_hf(model, hf_model, model_type)
    logger.debug("share_hf: %d tensors of %s shared", len(tensors), type(hf_model).__name__)
    return model


def is_shared(model: HybridModel, hf_model: nn.Module) -> bool:
    """True when every parameter and buffer of ``model`` is the very tensor object ``hf_model`` holds under its name.

    False once either side's tensors were replaced (``load_state_dict(assign=True)``, a wrapper
    that re-registers parameters, ``to()`` under ``torch.__future__.set_overwrite_module_params_on_conversion``).
    """
    hf_state = hf_model.state_dict(keep_vars=True)
    try:
        names = hf_key_map(model)
    except HFModelError:
        return False
    ours = dict(_state(model))
    return all(names[name] in hf_state and hf_state[names[name]] is tensor for name, tensor in ours.items())


def _state(model: nn.Module):
    """(name, tensor) of every parameter and buffer, tied entries under each of their names."""
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)
