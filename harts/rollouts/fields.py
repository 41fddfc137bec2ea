"""Per-token and per-trajectory field values: conversion from user input, checks, ownership.

The layer below :mod:`harts.rollouts.batch` (which builds batches from these values) and
:mod:`harts.rollouts.nodetable` (which reads and writes them): it knows field names, kinds and value
rules, never a batch. Conversions accept lists, NumPy arrays and torch tensors and raise
:class:`~harts.errors.RolloutInputError` naming the trajectory, field and entry.
"""

from __future__ import annotations

import numbers
import sys
import weakref
from typing import Any

import numpy as np

from harts.errors import RolloutInputError

MAX_TOKEN_ID = 2**32 - 1

#: Field names a user may omit; ``loss_mask`` defaults to all ones.
DEFAULT_TOKEN_FIELDS = ("loss_mask",)
#: Fields that only make sense per token: one scalar per trajectory is refused, never broadcast.
PER_TOKEN_FIELDS = ("loss_mask",)
#: Mask fields: every value finite and in [0, 1] (floats anywhere in the range; integers 0 or 1; booleans).
MASK_FIELDS = ("loss_mask",)
#: Log-prob fields (old, reference, and the rollout engine's, under the names harts.rl and the
#: importers use). They are finite too: NaN or +inf makes the loss NaN, and -inf makes the
#: importance ratio infinite (a loss of -inf for a negative advantage).
LOG_PROB_FIELDS = ("old_log_probs", "old_logprobs", "behavior_log_probs", "ref_log_probs", "ref_logprobs",
                   "reference_log_probs", "rollout_logprobs", "rollout_log_probs")
#: Fields a loss multiplies by or exponentiates: every value must be finite (a NaN would make the whole loss NaN).
FINITE_FIELDS = ("loss_mask", "advantages", "advantage", "reward", "importance_sampling_ratio", *LOG_PROB_FIELDS)
#: Field names HARTS reads.
KNOWN_FIELDS = (*FINITE_FIELDS, "group_id")
#: The fields whose misspelling would go unnoticed (the real one silently defaults: a mask of ones, log-probs
#: recomputed, no reference KL, trees as groups); another name this close to one (difflib ratio) is refused.
#: Frameworks' own plurals (AReaL's ``rewards``) are not near these and pass as extra fields.
MISSPELLING_TARGETS = ("loss_mask", "advantages", "old_log_probs", "ref_log_probs", "group_id")
MISSPELLING_CUTOFF = 0.8
#: NumPy kinds a per-token field may have (what node tables store and read back).
TOKEN_FIELD_KINDS = "biuf"
#: NumPy kinds a per-trajectory field may have.
TRAJECTORY_FIELD_KINDS = "biufU"
_KIND_NAMES = {"b": "booleans", "i": "integers", "u": "integers", "f": "floats", "U": "strings"}


def _tensor_as_array(value: Any) -> np.ndarray | None:
    """A torch tensor as a NumPy array (detached, on the CPU), or None when ``value`` is no tensor.

    Checked through ``sys.modules`` so that plain NumPy use never imports torch. Floating types
    NumPy lacks (bfloat16, float8) widen exactly to float32.
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return None
    tensor = value.detach().cpu()
    if tensor.is_floating_point() and tensor.dtype not in (torch.float16, torch.float32, torch.float64):
        tensor = tensor.to(torch.float32)
    return tensor.numpy()


def as_array(value: Any, where: str) -> np.ndarray:
    """``value`` (a list, tuple, NumPy array, torch tensor or scalar) as a NumPy array, or a clear error.

    Nested lists of different lengths (ragged input) and objects that are not numbers or
    strings are refused, naming ``where``.
    """
    tensor = _tensor_as_array(value)
    if tensor is not None:
        return tensor
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        converted = [_tensor_as_array(entry) for entry in value]
        if any(entry is not None for entry in converted):
            value = [entry if entry is not None else original for entry, original in zip(converted, value)]
        try:
            array = np.asarray(value)
        except (ValueError, TypeError, OverflowError):
            array = None
        if array is None or (array.dtype == object and any(isinstance(entry, (list, tuple, np.ndarray)) for entry in value)):
            raise RolloutInputError(f"{where} is ragged: its entries are lists of different lengths or mix lists and scalars")
        if array.dtype.kind == "f" and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value):
            # Python ints beyond int64 beside small ones: NumPy would make every entry a float and a range
            # check would blame the wrong entry with a rounded value; keep the exact integers instead.
            return np.array(value, dtype=object)
        return array
    if isinstance(value, (numbers.Number, np.generic, str)) or value is None:
        return np.asarray(value)
    raise RolloutInputError(f"{where} must be a list, a NumPy array or a torch tensor, got {type(value).__name__}")


def _first_bad(entries: list, test) -> int:
    return next((i for i, v in enumerate(entries) if test(v)), 0)


def integer_array(values: Any, where: str, minimum: int, maximum: int, what: str = "an integer", *,
                  below: str | None = None, above: str | None = None, items: str = "") -> np.ndarray:
    """``values`` as a flat int64 array whose entries lie in ``[minimum, maximum]``, or an error naming ``where``
    and the entry (``below`` / ``above``: how to say that an entry is out of range; ``items``: what the list holds)."""
    below = below or f"below the smallest allowed {minimum}"
    above = above or f"above the largest allowed {maximum}"
    array = as_array(values, where)
    if array.ndim != 1:
        raise RolloutInputError(f"{where} must be a flat list{items}, got shape {array.shape}")
    if array.size == 0:
        return np.empty(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        # the caller's own entries: NumPy would show an int beside a float as a float
        entries = list(values) if isinstance(values, (list, tuple)) and len(values) == array.size else array.tolist()
        bad = _first_bad(entries, lambda v: isinstance(v, bool) or not isinstance(v, numbers.Integral))
        value = entries[bad]
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # integers too large for NumPy
            bad = _first_bad(entries, lambda v: not minimum <= v <= maximum)
            raise RolloutInputError(f"{where} entry {bad} is {entries[bad]}, {below if entries[bad] < minimum else above}")
        raise RolloutInputError(f"{where} entry {bad} is {value!r}, not {what}")
    if array.min() < minimum:
        bad = int(np.flatnonzero(array < minimum)[0])
        raise RolloutInputError(f"{where} entry {bad} is {int(array[bad])}, {below}")
    if array.max() > maximum:
        bad = int(np.flatnonzero(array > maximum)[0])
        raise RolloutInputError(f"{where} entry {bad} is {int(array[bad])}, {above}")
    return array.astype(np.int64, copy=False)


#: Prefix of the per-token fields holding replayed expert ids (router replay: see :mod:`harts.rollouts.batch`).
ROUTED_EXPERTS = "routed_experts"


def routed_experts_field(layer: int, slot: int) -> str:
    """Name of the per-token field holding the ``slot``-th routed expert of MoE layer ``layer``."""
    return f"{ROUTED_EXPERTS}.{layer}.{slot}"


def routed_experts_key(name: str) -> tuple[int, int] | None:
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == ROUTED_EXPERTS and parts[1].isdigit() and parts[2].isdigit():
        return int(parts[1]), int(parts[2])
    return None


def routed_experts_fields(values: Any, count: int) -> dict[str, tuple[np.ndarray, ...]]:
    """Split one ``[len, layers, top_k]`` integer array per trajectory into per-token fields."""
    arrays = per_trajectory_entries(values, ROUTED_EXPERTS, count)
    shape = None
    for index, array in enumerate(arrays):
        if array.ndim != 3 or array.dtype.kind not in "iu":
            raise RolloutInputError(
                f"trajectory {index}: field '{ROUTED_EXPERTS}' must be an integer array [len, layers, top_k], "
                f"got {array.dtype} of shape {array.shape}"
            )
        if shape is None:
            shape = array.shape[1:]
        elif array.shape[1:] != shape:
            raise RolloutInputError(
                f"trajectory {index}: field '{ROUTED_EXPERTS}' has [layers, top_k] = {list(array.shape[1:])}, "
                f"trajectory 0 has {list(shape)}"
            )
    layers, top_k = shape if shape is not None else (0, 0)
    return {
        routed_experts_field(layer, slot): tuple(np.ascontiguousarray(a[:, layer, slot], dtype=np.int64) for a in arrays)
        for layer in range(layers)
        for slot in range(top_k)
    }


def token_id_array(values: Any, where: str) -> np.ndarray:
    """``values`` as an int64 array of token ids, or an error naming ``where`` and the bad entry.

    ``where`` names the place, e.g. ``"trajectory 3: field 'tokens'"``.
    """
    return integer_array(values, where, 0, MAX_TOKEN_ID, "an integer token id", below="token ids must be >= 0",
                         above=f"above the largest id {MAX_TOKEN_ID}", items=" of token ids")


def trajectory_token_array(values: Any, trajectory: int) -> np.ndarray:
    array = token_id_array(values, f"trajectory {trajectory}: field 'tokens'")
    if array.size == 0:
        raise RolloutInputError(f"trajectory {trajectory}: field 'tokens' is empty; a trajectory needs at least one token")
    return array


#: the arrays handed to batches through :func:`adopt`, by id (entries vanish with their arrays)
_ADOPTED: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()


def adopt(array: np.ndarray) -> np.ndarray:
    """Mark a freshly built array as a batch's own (read-only, not copied).

    Only for arrays nobody else holds: readers and generators use it to hand over what they
    built without a second copy (a view is copied, since its base may be written through).
    Anything else a batch receives is copied.
    """
    if array.base is not None:
        array = np.array(array, copy=True)
    array.flags.writeable = False
    _ADOPTED[id(array)] = array
    return array


def _is_immutable(array: np.ndarray) -> bool:
    """True for an adopted array or a view of one: read-only, and no caller holds a writable alias.

    A read-only flag alone is not enough: the caller may own the array and switch it back.
    """
    while array.base is not None:
        if not isinstance(array.base, np.ndarray):
            return False  # a buffer someone else owns (bytes, mmap, a torch tensor)
        array = array.base
    return _ADOPTED.get(id(array)) is array and not array.flags.writeable


def owned(array: np.ndarray) -> np.ndarray:
    """A read-only array in native byte order that no caller can change: ``array`` itself when it is one, else a copy."""
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    elif _is_immutable(array):
        return array
    else:
        array = np.array(array, copy=True)
    return adopt(array)


def per_trajectory_entries(value: Any, name: str, count: int | None) -> list[np.ndarray]:
    """A field (or the token lists) split into one NumPy array per trajectory."""
    where = f"field '{name}'"
    tensor = _tensor_as_array(value)
    if tensor is not None:
        value = tensor
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise RolloutInputError(f"{where}: expected one entry per trajectory, got a single value {value.item()!r}")
        entries = list(value) if value.dtype != object else list(value.tolist())
    elif isinstance(value, (list, tuple)):
        entries = list(value)
    else:
        expected = "a list with one entry per trajectory" + (f" ({count})" if count is not None else "")
        raise RolloutInputError(f"{where}: expected {expected}, got {type(value).__name__}")
    if count is not None and len(entries) != count:
        raise RolloutInputError(f"{where}: expected one entry per trajectory ({count}), got {len(entries)}")
    return [as_array(entry, f"trajectory {index}: {where}") for index, entry in enumerate(entries)]


def scalar_field_array(entries: list[np.ndarray], name: str) -> np.ndarray:
    """One value per trajectory from 0-d arrays; kinds may not mix (strings with numbers, booleans with numbers)."""
    groups = {"b" if e.dtype.kind == "b" else "n" if e.dtype.kind in "iuf" else e.dtype.kind for e in entries}
    bad = [e.dtype.kind for e in entries if e.dtype.kind not in TRAJECTORY_FIELD_KINDS]
    if bad:
        index = next(i for i, e in enumerate(entries) if e.dtype.kind not in TRAJECTORY_FIELD_KINDS)
        raise RolloutInputError(
            f"trajectory {index}: field '{name}' is {entries[index].item()!r}; per-trajectory values must be numbers, booleans or strings"
        )
    if len(groups) > 1:
        kinds = sorted({_KIND_NAMES[e.dtype.kind] for e in entries})
        raise RolloutInputError(f"field '{name}': per-trajectory values mix {' and '.join(kinds)}; give values of one kind")
    return np.stack(entries)


def refuse_misspelt_field(name: str) -> None:
    """Refuse a field name that is not one HARTS reads but is one letter or two from one (``loss_maks``):
    kept, it would be an extra field while the real one takes its default (a loss mask of ones)."""
    import difflib

    if name in KNOWN_FIELDS or routed_experts_key(name) is not None:
        return
    close = difflib.get_close_matches(name, MISSPELLING_TARGETS, n=1, cutoff=MISSPELLING_CUTOFF)
    if close:
        raise RolloutInputError(
            f"field '{name}' is not one HARTS reads and looks like a misspelling: did you mean '{close[0]}'? "
            f"(kept, '{close[0]}' would take its default; rename the field)"
        )


def check_log_prob_values(name: str, values: np.ndarray, where: str) -> None:
    """Log-probs a loss will read: finite (see :data:`LOG_PROB_FIELDS`)."""
    if values.dtype.kind != "f":
        return
    invalid = ~np.isfinite(values)
    if invalid.any():
        bad = int(np.flatnonzero(invalid.reshape(-1))[0])
        raise RolloutInputError(f"{where}: field '{name}' entry {bad} is {values.reshape(-1)[bad]}; log-probs must be finite")


def check_field_values(name: str, values: np.ndarray, where: str) -> None:
    """Masks (:data:`MASK_FIELDS`) finite and in [0, 1]; loss factors and log-probs (:data:`FINITE_FIELDS`) finite."""
    if values.dtype.kind == "b" or values.size == 0:
        return
    if name in FINITE_FIELDS and values.dtype.kind == "f":
        finite = np.isfinite(values)
        if not finite.all():
            bad = int(np.flatnonzero(~finite)[0])
            raise RolloutInputError(f"{where}: field '{name}' entry {bad} is {values[bad]}; its values must be finite")
    if name in MASK_FIELDS:
        outside = (values < 0) | (values > 1)
        if outside.any():
            bad = int(np.flatnonzero(outside)[0])
            raise RolloutInputError(f"{where}: field '{name}' entry {bad} is {values[bad]}; mask values must lie in [0, 1]")
