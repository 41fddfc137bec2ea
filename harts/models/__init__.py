"""Loaders for Hugging Face models: Qwen3-Next and Kimi Linear as HARTS hybrid models.

    model = harts.models.from_hf(hf_model)                  # same math, same weights
    state = harts.models.to_hf_state_dict(model)            # back to the transformers layout
    harts.models.save_pretrained(model, "ckpt/")            # a directory AutoModelForCausalLM loads
    shared = harts.models.share_hf(hf_model)                # the same math on hf_model's own parameters

transformers is imported only when a path is loaded or a transformers config is built.
"""

from harts.models.checkpoint import save_pretrained
from harts.models.shared import is_shared, share_hf
from harts.models.hf import (
    ARCHITECTURES,
    HFModelError,
    HFSource,
    from_hf,
    hf_key_map,
    hybrid_config_from_hf,
    to_hf_config,
    to_hf_state_dict,
)

__all__ = [
    "ARCHITECTURES",
    "HFModelError",
    "HFSource",
    "from_hf",
    "hf_key_map",
    "hybrid_config_from_hf",
    "is_shared",
    "save_pretrained",
    "share_hf",
    "to_hf_config",
    "to_hf_state_dict",
]
