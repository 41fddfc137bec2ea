"""Write a :class:`~harts.runtime.HybridModel` as a transformers checkpoint directory.

``save_pretrained(model, DIR)`` writes ``DIR/config.json`` (a ``Qwen3NextConfig`` or
``KimiLinearConfig``, see :func:`harts.models.to_hf_config`) and ``DIR/model.safetensors``
(:func:`harts.models.to_hf_state_dict`, tied ``lm_head.weight`` left out as transformers does),
so ``AutoModelForCausalLM.from_pretrained(DIR)`` loads the same weights and computes the same
log-probs. Fields HARTS does not model (token ids, ``max_position_embeddings``) come from the
config the model was loaded from, when it was.

The directory is written as a whole and swapped in atomically (:func:`harts.fsio.replace_directory`).
An existing ``DIR`` is replaced only when it is empty or is a checkpoint this function wrote
(its files are the two above and the safetensors metadata carries ``harts_version``); anything
else is refused and left untouched.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

from harts.errors import OutputError
from harts.fsio import OutputKind, check_output, foreign_entries, replace_directory
from harts.models.hf import (
    ARCHITECTURES,
    HFModelError,
    HFSource,
    _architecture_of,
    _source_architecture,
    hybrid_config_from_hf,
    to_hf_config,
    to_hf_state_dict,
)
from harts.runtime.config import HybridConfig
from harts.runtime.model import HybridModel

__all__ = ["save_pretrained"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
#: safetensors metadata key marking a checkpoint written by HARTS.
MARKER = "harts_version"
#: Transformers config fields HARTS does not model, carried over from the source config.
KEPT_FIELDS = ("bos_token_id", "eos_token_id", "max_position_embeddings")


def _why_not_ours(path: Path) -> str | None:
    """None when ``path`` may be replaced (empty, or a checkpoint HARTS wrote), else the reason."""
    why, names = foreign_entries(path, {CONFIG_FILE, WEIGHTS_FILE}, "a HARTS checkpoint")
    if why is not None or not names:
        return why
    if WEIGHTS_FILE not in names:
        return f"it has no {WEIGHTS_FILE}"
    from safetensors import safe_open

    try:
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except Exception:  # safetensors raises several types for files that are not its own
        return f"its {WEIGHTS_FILE} is not a readable safetensors file"
    if MARKER not in metadata:
        return f"its {WEIGHTS_FILE} was not written by HARTS"
    return None


#: Checkpoint targets for the output-ownership rule (:func:`harts.fsio.check_outputs`).
CHECKPOINT = OutputKind("a checkpoint HARTS wrote", "the checkpoint", True, _why_not_ours)


def _differing_fields(a: HybridConfig, b: HybridConfig) -> list[str]:
    return [field.name for field in attrs.fields(HybridConfig) if getattr(a, field.name) != getattr(b, field.name)]


def save_pretrained(model: HybridModel, directory: str | os.PathLike[str], *, architecture: str | None = None, **config_fields: Any) -> Path:
    """Write ``model`` as a transformers checkpoint in ``directory``; returns the path.

    ``architecture`` ("qwen3_next" or "kimi_linear") defaults to the one the model was loaded
    from, else is inferred from its config. ``config_fields`` are passed on to the
    transformers config (e.g. ``eos_token_id``). Raises :class:`HFModelError` when the config
    cannot be expressed exactly or ``directory`` is not ours to replace.
    """
    from safetensors.torch import save as save_tensors

    from harts import __version__

    path = Path(directory)
    try:
        check_output(path, CHECKPOINT)  # the output-ownership rule: new, empty, or a checkpoint HARTS wrote
    except OutputError as error:
        raise HFModelError(str(error)) from None
    chosen = _architecture_of(model.config, architecture or _source_architecture(model))
    source = getattr(model, "hf_source", None)
    kept = dict(source.config) if isinstance(source, HFSource) else {}
    fields = {name: kept[name] for name in KEPT_FIELDS if kept.get(name) is not None}
    fields["pad_token_id"] = model.embed_tokens.padding_idx
    fields.update(config_fields)
    hf_config = to_hf_config(model.config, chosen, **fields)
    hf_config.architectures = [ARCHITECTURES[chosen]]
    described = hybrid_config_from_hf(hf_config, dtype=model.config.dtype)
    differing = _differing_fields(described, model.config)
    if differing:
        raise HFModelError(f"the transformers config of this model would describe another model (fields {', '.join(differing)} differ)")

    state = to_hf_state_dict(model, chosen)
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]  # tied to the embedding; transformers re-ties it on load
    tensors = {key: tensor.detach().to("cpu").contiguous() for key, tensor in state.items()}
    weights = save_tensors(tensors, metadata={"format": "pt", MARKER: __version__})
    files = {CONFIG_FILE: hf_config.to_json_string().encode(), WEIGHTS_FILE: weights}
    try:
        replace_directory(path, files, is_ours=lambda target: _why_not_ours(target) is None)
    except FileExistsError:
        raise HFModelError(f"cannot save the checkpoint to {path}: it changed while saving and is not ours; left untouched") from None
    except OSError as error:
        raise HFModelError(f"cannot save the checkpoint to {path}: {error.strerror or error}") from None
    return path

