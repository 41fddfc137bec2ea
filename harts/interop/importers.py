"""RL frameworks' batch dicts as :class:`harts.RolloutBatch` es.

Each importer strips padding by the framework's masks, keeps every per-token tensor token
aligned (entry ``t`` belongs to ``tokens[t]``, the HARTS convention; prompt positions of
response-only tensors hold 0) and records the prompt/response boundary as the per-trajectory
field ``prompt_length``. Trees are recovered from the token lists by exact prefix matching
(:meth:`RolloutBatch.from_trajectories`), so the rollouts of one prompt, or the turns of one
agent episode, share their rows in a compiled plan.

Field names follow :mod:`harts.rl`: ``loss_mask`` (1 on tokens the policy generated: 0 on
prompt, tool / observation and padding tokens), ``advantages``, ``old_log_probs``,
``ref_log_probs``; the inference engine's log-probs become ``rollout_logprobs`` (as the
``logprobs`` column of a node table). Other tensors keep their names. Values come as torch
tensors, numpy arrays or lists; 0-d entries (batch-level counts such as TRL's
``num_items_in_batch``) are not per trajectory and are left out (logged). ``routed_experts``
(``[B, S, layers, top_k]`` over the full sequence, as verl's router replay records them)
becomes the batch's routed experts (:attr:`RolloutBatch.routed_experts`).

verl (a ``DataProto``, its ``batch`` ``TensorDict``, or a dict; ``verl/trainer/ppo/ray_trainer.py``,
``verl/experimental/agent_loop``):
    ``input_ids`` / ``attention_mask`` / ``position_ids`` ``[B, P + R]``: the left-padded prompt
    then the right-padded response; ``responses`` ``[B, R]``; ``response_mask`` ``[B, R]`` (1 for
    LLM tokens, 0 for tool observations and padding; older multi-turn verl calls it
    ``loss_mask``); ``old_log_probs``, ``ref_log_prob``, ``rollout_log_probs``, ``advantages``,
    ``returns``, ... ``[B, R]`` label-aligned with ``responses``; ``[B]`` entries (``uid``, scores)
    are per trajectory. The worker-side form that verl's engines receive
    (``left_right_2_no_padding``, ``verl/workers/utils/padding.py``) holds nested ``input_ids`` /
    ``position_ids`` ``[B, len_i]`` beside the padded ``attention_mask``; nested fields are placed
    back by it (or, without one, by nested ``prompts`` and ``responses``).
TRL (``GRPOTrainer._generate_and_score_completions``):
    ``prompt_ids`` / ``prompt_mask`` ``[B, P]`` left-padded, ``completion_ids`` /
    ``completion_mask`` ``[B, C]`` right-padded (the mask ends at the first EOS), ``tool_mask``
    ``[B, C]`` (0 on tool tokens), ``advantages`` ``[B]`` (or ``[B, C]``), ``old_per_token_logps``,
    ``ref_per_token_logps``, ``sampling_per_token_logps`` ``[B, C]``.
AReaL (workflow output or ``PPOActor``'s batch, ``areal/trainer/ppo/actor.py``, ``areal/utils/data.py``):
    AReaL 1.0.4's ``list[dict]`` (one dict per trajectory or group, right-padded), padded
    ``input_ids`` / ``attention_mask`` (right-padded) ``[B, S]``, packed 1-D ``input_ids`` with
    ``cu_seqlens`` ``[B + 1]`` (the engine's micro-batches), or one unpadded row per trajectory;
    ``loss_mask``, ``logprobs`` (``[0.0] * input_len + output_logprobs``), ``versions`` token
    aligned; ``prox_logp`` and ``ref_logp`` (engine outputs, gathered at ``roll(input_ids, -1)``)
    next-token aligned; ``rewards`` ``[B]``. After ``PPOActor.compute_advantages`` the batch
    also holds ``advantages`` and has ``loss_mask`` / ``logprobs`` rolled by -1: the caller says
    which with ``rolled=`` (required). The prompt length is the position of the first ``loss_mask`` token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from harts.rollouts.batch import ROUTED_EXPERTS, RolloutBatch
from harts.rollouts.fields import LOG_PROB_FIELDS, check_log_prob_values
from harts.errors import RolloutInputError
from harts.interop.framework_layouts import PROMPT_LENGTH

logger = logging.getLogger(__name__)

__all__ = ["from_areal", "from_trl", "from_verl"]

ROLLOUT_LOGPROBS = "rollout_logprobs"


def _array(value: Any, where: str) -> np.ndarray:
    """A numpy view of a tensor, array or (nested) list; ragged rows stay an object array of rows."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        if getattr(value, "is_nested", False):
            return np.array([np.asarray(v.detach().cpu()) for v in value.unbind()] + [None], dtype=object)[:-1]
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        return value.numpy()
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        try:
            array = np.asarray(value)
        except ValueError:
            array = None
        if array is not None and array.dtype != object:
            return array
        rows = [np.asarray(row) for row in value]
        return np.array(rows + [None], dtype=object)[:-1]
    if np.isscalar(value):
        return np.asarray(value)
    raise RolloutInputError(f"{where}: unsupported value of type {type(value).__name__}")


def _items(d: Any, framework: str) -> dict[str, Any]:
    """The entries of a dict, a ``TensorDict`` or a verl ``DataProto`` (its ``batch`` and ``non_tensor_batch``).

    A ``TensorDict``'s ``NonTensorData`` entries are batch-level metadata (verl's ``temperature``,
    ``max_seq_len``, ...) and are left out; its ``NonTensorStack`` entries are per trajectory.
    Duck-typed: neither verl nor tensordict is imported.
    """
    if hasattr(d, "non_tensor_batch") and hasattr(d, "batch") and hasattr(d, "meta_info"):  # verl DataProto
        items = {} if d.batch is None else _items(d.batch, framework)
        items.update(d.non_tensor_batch or {})
        return items
    if hasattr(d, "batch_size") and hasattr(d, "items") and hasattr(d, "keys"):  # TensorDict (before Mapping: it is one)
        items = {}
        for key, value in d.items():
            kind = type(value).__name__
            if kind == "NonTensorData":
                logger.info("%s batch: key '%s' is batch-level metadata, not per trajectory; left out", framework, key)
            elif kind == "NonTensorStack":
                items[key] = value.tolist()
            else:
                items[key] = value
        return items
    if isinstance(d, Mapping):
        return dict(d)
    raise RolloutInputError(f"{framework} batch: expected a dict of tensors, a TensorDict or a DataProto, got {type(d).__name__}")


def _columns(d: Any, framework: str, ignore: Iterable[str]) -> dict[str, np.ndarray]:
    skipped = set(ignore)
    items = _items(d, framework)
    unknown = sorted(skipped - set(items))
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], [str(key) for key in items], n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"keys: {', '.join(sorted(map(str, items)))}"
        raise RolloutInputError(f"{framework} batch: --ignore '{unknown[0]}' names no key of the batch; {hint}")
    out = {}
    for key, value in items.items():
        if key in skipped or value is None:
            continue
        array = _array(value, f"{framework} batch, key '{key}'")
        if array.ndim == 0:
            logger.info("%s batch: key '%s' is a batch-level scalar, not per trajectory; left out", framework, key)
            continue
        out[key] = array
    return out


def _require(columns: Mapping[str, np.ndarray], key: str, framework: str) -> np.ndarray:
    if key not in columns:
        raise RolloutInputError(f"{framework} batch: missing required key '{key}' (keys: {sorted(columns)})")
    return columns[key]


def _check_shape(array: np.ndarray, shape: tuple[int, ...], key: str, framework: str) -> None:
    if array.shape[: len(shape)] != shape:
        raise RolloutInputError(f"{framework} batch, key '{key}': shape {list(array.shape)}, expected {list(shape)}")


def _run(mask_row: np.ndarray, *, left: bool, where: str) -> int:
    """Length of the valid run of a padded row: a suffix (left padding) or a prefix (right padding).

    Every entry must be 0 or 1: read as booleans, -1, 2 or 0.5 would count padding as real tokens."""
    if mask_row.dtype.kind != "b":
        with np.errstate(invalid="ignore"):
            outside = (mask_row != 0) & (mask_row != 1)
        if outside.any():
            column = int(np.flatnonzero(outside)[0])
            raise RolloutInputError(f"{where}: column {column} is {mask_row[column].item()!r}; a mask holds 0 (padding) or 1 (token)")
    valid = mask_row.astype(bool)
    count = int(valid.sum())
    width = len(valid)
    expected = np.arange(width) >= width - count if left else np.arange(width) < count
    if not np.array_equal(valid, expected):
        column = int(np.flatnonzero(valid != expected)[0])
        side = "left" if left else "right"
        raise RolloutInputError(f"{where} is not {side}-padded: a gap at column {column}")
    return count


class _Rows:
    """Trajectories collected row by row: tokens, token-aligned fields, per-trajectory fields."""

    def __init__(self, framework: str):
        self.framework = framework
        self.tokens: list[np.ndarray] = []
        self.prompt_lengths: list[int] = []
        self.token_fields: dict[str, list[np.ndarray]] = {}
        self.trajectory_fields: dict[str, np.ndarray] = {}
        self.routed: list[np.ndarray] | None = None

    def add(self, tokens: np.ndarray, prompt_length: int, fields: Mapping[str, np.ndarray], routed: np.ndarray | None):
        row = len(self.tokens)
        if tokens.size == 0:
            raise RolloutInputError(f"{self.framework} batch: row {row} holds no tokens after removing padding")
        self.tokens.append(np.asarray(tokens, dtype=np.int64))
        self.prompt_lengths.append(int(prompt_length))
        for name, values in fields.items():
            self.token_fields.setdefault(name, []).append(values)
        if routed is not None:
            if self.routed is None:
                self.routed = []
            self.routed.append(np.asarray(routed, dtype=np.int64))

    def batch(self) -> RolloutBatch:
        # what the importers hand on feeds a loss: no NaN or +inf log-probs (a stored batch may hold them)
        for name, per_row in self.token_fields.items():
            if name in LOG_PROB_FIELDS:
                for row, values in enumerate(per_row):
                    check_log_prob_values(name, np.asarray(values), f"{self.framework} batch: row {row} (trajectory {row})")
        if PROMPT_LENGTH in self.token_fields or PROMPT_LENGTH in self.trajectory_fields:
            raise RolloutInputError(
                f"{self.framework} batch: key '{PROMPT_LENGTH}' is the field the importer writes the prompt lengths to; "
                "rename it or pass ignore=[...]"
            )
        return RolloutBatch.from_trajectories(
            self.tokens,
            routed_experts=self.routed,
            **{PROMPT_LENGTH: np.asarray(self.prompt_lengths, dtype=np.int64)},
            **self.token_fields,
            **self.trajectory_fields,
        )


def _token_ids(array: np.ndarray, key: str, framework: str) -> np.ndarray:
    if array.dtype.kind not in "iu":
        raise RolloutInputError(f"{framework} batch, key '{key}': token ids must be integers, got {array.dtype}")
    return array


def _per_trajectory(columns: Mapping[str, np.ndarray], used: set[str], count: int, framework: str, rows: _Rows) -> set[str]:
    """Move the [B] entries, and the sequence-level [B, 1] ones (vLLM's ``importance_sampling_ratio``), into
    per-trajectory fields; return their keys. Called after the per-token keys are taken, so a [B, 1] field of a
    batch whose rows are one token wide stays per token."""
    taken = set()
    for key, array in columns.items():
        if key in used or array.dtype == object:
            continue
        if array.ndim == 2 and array.shape[1] == 1:
            array = array[:, 0]
        if array.ndim != 1:
            continue
        if array.shape[0] != count:
            raise RolloutInputError(f"{framework} batch, key '{key}': {array.shape[0]} entries for {count} rows")
        rows.trajectory_fields[key] = array.astype(str) if array.dtype.kind in "OSU" else array
        taken.add(key)
    for key, array in columns.items():
        if key not in used and key not in taken and array.dtype == object and array.ndim == 1 and len(array) == count:
            if all(isinstance(v, (str, bytes)) for v in array):
                rows.trajectory_fields[key] = array.astype(str)
                taken.add(key)
    return taken


def _unplaced(columns: Mapping[str, np.ndarray], placed: set[str], framework: str) -> None:
    left = sorted(set(columns) - placed)
    if left:
        shapes = ", ".join(f"'{k}' {list(columns[k].shape)}" for k in left)
        raise RolloutInputError(
            f"{framework} batch: cannot place {shapes} (neither per token nor per trajectory); pass ignore=[...] to leave them out"
        )


def _rename(key: str, renames: Mapping[str, str]) -> str:
    return renames.get(key, key)


# ----------------------------------------------------------------------------------- verl

_VERL_RENAMES = {"ref_log_prob": "ref_log_probs", "rollout_log_probs": ROLLOUT_LOGPROBS}
_VERL_STRUCTURE = {"input_ids", "attention_mask", "position_ids", "responses", "prompts", "response_mask", "loss_mask", ROUTED_EXPERTS}


def _ragged(array: np.ndarray) -> bool:
    """True for a list of per-trajectory rows (a nested tensor's rows), not of strings."""
    return array.dtype == object and array.ndim == 1 and not any(isinstance(v, (str, bytes)) for v in array)


def _padded_rows(rows: list[np.ndarray], width: int, left: bool) -> np.ndarray:
    """Rows of different lengths, left- or right-padded with 0 to ``width`` columns."""
    trailing, dtype = (rows[0].shape[1:], rows[0].dtype) if rows else ((), np.int64)
    out = np.zeros((len(rows), width, *trailing), dtype=dtype)
    for b, row in enumerate(rows):
        if left:
            out[b, width - len(row) :] = row
        else:
            out[b, : len(row)] = row
    return out


def _verl_attention(columns: dict[str, np.ndarray]) -> np.ndarray:
    """The [B, P + R] attention mask of a batch without one: from its nested ``prompts`` and ``responses``."""
    prompts, responses = columns.get("prompts"), columns.get("responses")
    if prompts is None or responses is None or not (_ragged(prompts) and _ragged(responses)):
        raise RolloutInputError(
            "verl batch: nested 'input_ids' need the padded 'attention_mask' (as left_right_2_no_padding keeps it) "
            "or nested 'prompts' and 'responses' to find each prompt/response boundary"
        )
    prompt_rows, response_rows = [np.asarray(r) for r in prompts], [np.asarray(r) for r in responses]
    prompt_width = max((len(r) for r in prompt_rows), default=0)
    width = max((len(r) for r in response_rows), default=0)
    columns["prompts"] = _padded_rows(prompt_rows, prompt_width, left=True)
    columns["responses"] = _padded_rows(response_rows, width, left=False)
    ones = [np.ones(len(r), np.int64) for r in prompt_rows], [np.ones(len(r), np.int64) for r in response_rows]
    return np.concatenate([_padded_rows(ones[0], prompt_width, left=True), _padded_rows(ones[1], width, left=False)], axis=1)


def _verl_padded(columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """verl's worker-side batch (nested ``input_ids`` / ``position_ids`` / ... as its engines receive it,
    ``verl/workers/utils/padding.py``: ``left_right_2_no_padding``) scattered back into the padded form.

    A nested row of ``len_i`` entries fills the valid columns of ``attention_mask`` (the tokens
    ``unpad_input`` took them from); a nested row of ``R_i`` entries is a right-padded response field.
    """
    if "input_ids" not in columns or not _ragged(columns["input_ids"]):
        return columns
    columns = dict(columns)
    attention = columns["attention_mask"] if "attention_mask" in columns else _verl_attention(columns)
    columns["attention_mask"] = attention
    valid = attention.astype(bool)
    responses = columns.get("responses")
    if responses is None or _ragged(responses):
        raise RolloutInputError("verl batch: nested 'input_ids' need 'responses' beside them")
    prompt_width = attention.shape[1] - responses.shape[1]
    response_lengths = valid[:, prompt_width:].sum(axis=1)
    for key, array in list(columns.items()):
        if not _ragged(array) or key == "attention_mask":
            continue
        rows = [np.asarray(row) for row in array]
        if len(rows) != len(valid):
            raise RolloutInputError(f"verl batch, key '{key}': {len(rows)} nested rows for {len(valid)} trajectories")
        if all(len(row) == int(v.sum()) for row, v in zip(rows, valid)):
            dense = np.zeros((len(rows), valid.shape[1], *rows[0].shape[1:]), dtype=rows[0].dtype)
            for b, row in enumerate(rows):
                dense[b, valid[b]] = row
        elif all(len(row) == int(n) for row, n in zip(rows, response_lengths)):
            dense = _padded_rows(rows, responses.shape[1], left=False)
        else:
            raise RolloutInputError(
                f"verl batch, key '{key}': nested rows match neither each trajectory's tokens nor its response"
            )
        columns[key] = dense
    return columns


def from_verl(d: Any, *, ignore: Iterable[str] = ()) -> RolloutBatch:
    """A batch from verl: a padded ``DataProto`` (or its ``batch``), or the nested ``TensorDict`` its engine
    workers receive (see the module docstring); ``ignore`` names keys to leave out."""
    framework = "verl"
    columns = _verl_padded(_columns(d, framework, ignore))
    input_ids = _token_ids(_require(columns, "input_ids", framework), "input_ids", framework)
    attention = _require(columns, "attention_mask", framework)
    responses = _token_ids(_require(columns, "responses", framework), "responses", framework)
    if input_ids.ndim != 2 or responses.ndim != 2:
        raise RolloutInputError(f"verl batch: 'input_ids' and 'responses' must be [B, S] and [B, R], got {list(input_ids.shape)} and {list(responses.shape)}")
    count, total = input_ids.shape
    width = responses.shape[1]
    prompt_width = total - width
    if prompt_width < 0 or responses.shape[0] != count:
        raise RolloutInputError(f"verl batch: 'responses' {list(responses.shape)} does not fit 'input_ids' {list(input_ids.shape)}")
    _check_shape(attention, (count, total), "attention_mask", framework)
    if "response_mask" in columns:
        response_mask, mask_key = columns["response_mask"], "response_mask"
    elif "loss_mask" in columns:
        response_mask, mask_key = columns["loss_mask"][:, -width:] if columns["loss_mask"].ndim == 2 else columns["loss_mask"], "loss_mask"
    else:
        response_mask, mask_key = attention[:, prompt_width:], "attention_mask"
    _check_shape(response_mask, (count, width), mask_key, framework)
    positions = columns.get("position_ids")
    routed = columns.get(ROUTED_EXPERTS)
    if routed is not None:
        _check_shape(routed, (count, total), ROUTED_EXPERTS, framework)
    prompts = columns.get("prompts")
    if prompts is not None:
        _check_shape(prompts, (count, prompt_width), "prompts", framework)

    response_keys, full_keys = [], []
    for key, array in columns.items():
        if key in _VERL_STRUCTURE or array.dtype == object or array.ndim != 2 or array.shape[0] != count:
            continue
        if array.shape[1] == width:
            response_keys.append(key)
        elif array.shape[1] == total:
            full_keys.append(key)
    rows = _Rows(framework)
    for b in range(count):
        where = f"verl batch: row {b}"
        prompt = _run(attention[b, :prompt_width], left=True, where=f"{where}: attention_mask of the prompt")
        response = _run(attention[b, prompt_width:], left=False, where=f"{where}: attention_mask of the response")
        columns_b = np.arange(prompt_width - prompt, prompt_width + response)
        tokens = input_ids[b, columns_b]
        mismatch = np.flatnonzero(responses[b, :response] != input_ids[b, prompt_width : prompt_width + response])
        if mismatch.size:
            raise RolloutInputError(f"{where}: 'responses' column {int(mismatch[0])} differs from 'input_ids' column {prompt_width + int(mismatch[0])}")
        if prompts is not None and not np.array_equal(prompts[b, prompt_width - prompt :], tokens[:prompt]):
            raise RolloutInputError(f"{where}: 'prompts' differs from the prompt part of 'input_ids'")
        if response_mask[b, response:].any():
            column = response + int(np.flatnonzero(response_mask[b, response:])[0])
            raise RolloutInputError(f"{where}: '{mask_key}' is set on padding column {column} of the response")
        if positions is not None and positions.ndim == 2 and not np.array_equal(positions[b, columns_b], np.arange(len(tokens))):
            raise RolloutInputError(
                f"{where}: 'position_ids' of the valid tokens are not 0..{len(tokens) - 1}; HARTS places every token at its "
                "position in its own trajectory"
            )
        fields = {"loss_mask": np.concatenate([np.zeros(prompt, np.float32), response_mask[b, :response].astype(np.float32)])}
        for key in response_keys:
            values = columns[key][b, :response]
            fields[_rename(key, _VERL_RENAMES)] = np.concatenate([np.zeros(prompt, values.dtype), values])
        for key in full_keys:
            fields[_rename(key, _VERL_RENAMES)] = columns[key][b, columns_b]
        rows.add(tokens, prompt, fields, None if routed is None else routed[b, columns_b])
    placed = _VERL_STRUCTURE & set(columns) | set(response_keys) | set(full_keys)
    placed |= _per_trajectory(columns, placed, count, framework, rows)
    _unplaced(columns, placed, framework)
    return rows.batch()


# ----------------------------------------------------------------------------------- TRL

_TRL_RENAMES = {
    "old_per_token_logps": "old_log_probs",
    "ref_per_token_logps": "ref_log_probs",
    "sampling_per_token_logps": ROLLOUT_LOGPROBS,
}
_TRL_STRUCTURE = {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", ROUTED_EXPERTS}


def from_trl(d: Mapping[str, Any], *, ignore: Iterable[str] = ()) -> RolloutBatch:
    """A batch from the inputs TRL's ``GRPOTrainer`` builds for its loss (see the module docstring)."""
    framework = "trl"
    columns = _columns(d, framework, ignore)
    prompt_ids = _token_ids(_require(columns, "prompt_ids", framework), "prompt_ids", framework)
    completion_ids = _token_ids(_require(columns, "completion_ids", framework), "completion_ids", framework)
    if prompt_ids.ndim != 2 or completion_ids.ndim != 2 or prompt_ids.shape[0] != completion_ids.shape[0]:
        raise RolloutInputError(
            f"trl batch: 'prompt_ids' and 'completion_ids' must be [B, P] and [B, C], got {list(prompt_ids.shape)} and {list(completion_ids.shape)}"
        )
    count, prompt_width = prompt_ids.shape
    width = completion_ids.shape[1]
    prompt_mask = columns.get("prompt_mask", np.ones_like(prompt_ids))
    completion_mask = columns.get("completion_mask", np.ones_like(completion_ids))
    tool_mask = columns.get("tool_mask", np.ones_like(completion_ids))
    for key, array, shape in (("prompt_mask", prompt_mask, (count, prompt_width)), ("completion_mask", completion_mask, (count, width)),
                              ("tool_mask", tool_mask, (count, width))):
        _check_shape(array, shape, key, framework)
    routed = columns.get(ROUTED_EXPERTS)
    if routed is not None:
        _check_shape(routed, (count, prompt_width + width), ROUTED_EXPERTS, framework)
    completion_keys = [
        key for key, array in columns.items()
        if key not in _TRL_STRUCTURE and array.dtype != object and array.ndim == 2 and array.shape == (count, width)
    ]
    rows = _Rows(framework)
    for b in range(count):
        where = f"trl batch: row {b}"
        prompt = _run(prompt_mask[b], left=True, where=f"{where}: prompt_mask")
        completion = _run(completion_mask[b], left=False, where=f"{where}: completion_mask")
        tokens = np.concatenate([prompt_ids[b, prompt_width - prompt :], completion_ids[b, :completion]])
        generated = (completion_mask[b, :completion] * tool_mask[b, :completion]).astype(np.float32)
        fields = {"loss_mask": np.concatenate([np.zeros(prompt, np.float32), generated])}
        for key in completion_keys:
            values = columns[key][b, :completion]
            fields[_rename(key, _TRL_RENAMES)] = np.concatenate([np.zeros(prompt, values.dtype), values])
        kept = np.concatenate([np.arange(prompt_width - prompt, prompt_width), prompt_width + np.arange(completion)])
        rows.add(tokens, prompt, fields, None if routed is None else routed[b, kept])
    placed = _TRL_STRUCTURE & set(columns) | set(completion_keys)
    placed |= _per_trajectory(columns, placed, count, framework, rows)
    _unplaced(columns, placed, framework)
    return rows.batch()


# ----------------------------------------------------------------------------------- AReaL

_AREAL_RENAMES = {"logprobs": ROLLOUT_LOGPROBS, "prox_logp": "old_log_probs", "ref_logp": "ref_log_probs"}
#: Per-token outputs of AReaL's engine (gathered at roll(input_ids, -1)): next-token aligned.
_AREAL_NEXT_TOKEN = {"prox_logp", "ref_logp"}
#: What PPOActor.compute_advantages adds or rolls by -1.
_AREAL_AFTER_ADVANTAGES = {"loss_mask", "logprobs", "advantages", "returns", "values", "kl_rewards", "tot_rewards"}
_AREAL_STRUCTURE = {"input_ids", "attention_mask", "cu_seqlens", "position_ids", ROUTED_EXPERTS}


def _integer_offsets(values: np.ndarray, where: str) -> np.ndarray:
    """Offsets as int64, refusing entries that are not whole numbers (2.7 would be truncated silently)."""
    if values.dtype.kind in "iu":
        return values.astype(np.int64)
    if values.dtype.kind != "f":
        raise RolloutInputError(f"{where}: expected integer offsets, got dtype {values.dtype}")
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(values) | (values != np.round(values)) | (np.abs(values) > 2**53)
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        raise RolloutInputError(f"{where}: entry {index} is {values[index].item()!r}, not a whole number of tokens")
    return values.astype(np.int64)


def _areal_rows(columns: Mapping[str, np.ndarray]) -> tuple[list[np.ndarray], str]:
    """Token index lists (into the flattened per-token arrays) of every trajectory, and the batch's form."""
    input_ids = _require(columns, "input_ids", "areal")
    if input_ids.dtype == object:  # one unpadded row per trajectory
        lengths = [len(row) for row in input_ids]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        return [np.arange(offsets[i], offsets[i + 1]) for i in range(len(lengths))], "rows"
    if input_ids.ndim == 1:
        cu = _integer_offsets(_require(columns, "cu_seqlens", "areal"), "areal batch, key 'cu_seqlens'")
        if cu.ndim != 1 or cu[0] != 0 or cu[-1] != input_ids.shape[0] or np.any(np.diff(cu) < 0):
            raise RolloutInputError(f"areal batch, key 'cu_seqlens': not offsets from 0 to the {input_ids.shape[0]} packed tokens")
        return [np.arange(cu[i], cu[i + 1]) for i in range(len(cu) - 1)], "packed"
    if input_ids.ndim != 2:
        raise RolloutInputError(f"areal batch, key 'input_ids': expected [B, S], packed [T] or a list of rows, got {list(input_ids.shape)}")
    count, total = input_ids.shape
    attention = columns.get("attention_mask", np.ones_like(input_ids))
    _check_shape(attention, (count, total), "attention_mask", "areal")
    rows = []
    for b in range(count):
        length = _run(attention[b], left=False, where=f"areal batch: row {b}: attention_mask")
        rows.append(b * total + np.arange(length))
    return rows, "padded"


def _flat(array: np.ndarray, form: str, key: str, token_count: int, trailing: int = 0) -> np.ndarray | None:
    """The per-token values of ``array`` flattened over tokens, or None when it is not per token."""
    if form == "rows":
        if array.dtype != object and array.ndim < 2 or array.dtype == object and len(array) and isinstance(array[0], (str, bytes)):
            return None  # per trajectory
        try:
            flat = np.concatenate([np.asarray(row) for row in array]) if len(array) else np.zeros(0)
        except ValueError:
            shapes = sorted({np.shape(row)[1:] for row in array}, key=str)
            raise RolloutInputError(
                f"areal batch, key '{key}': its rows are ragged (per-token entries of shapes {', '.join(map(str, shapes))}); "
                "give one value (or one array of one shape) per token"
            ) from None
    elif form == "packed":
        flat = array
    else:
        if array.ndim < 2:
            return None
        flat = array.reshape(array.shape[0] * array.shape[1], *array.shape[2:])
    if flat.shape[0] != token_count or flat.ndim != 1 + trailing:
        raise RolloutInputError(f"areal batch, key '{key}': shape {list(array.shape)} does not match 'input_ids'")
    return flat


def _areal_entry(item: Any, index: int, ignore: Iterable[str]) -> dict[str, list[Any]]:
    """One entry of AReaL's ``list[dict]``: right-padded ``[g, S]`` tensors (or one unpadded ``[S]`` trajectory)."""
    skipped = set(ignore)
    columns = {key: _array(value, f"areal batch, entry {index}, key '{key}'")
               for key, value in _items(item, "areal").items() if key not in skipped and value is not None}
    ids = _require(columns, "input_ids", "areal")
    if ids.ndim == 1:  # one trajectory: its per-token values are [S], its scalars belong to it
        columns = {key: (array[None] if array.ndim >= 1 and len(array) == len(ids) else array.reshape(1, *array.shape))
                   for key, array in columns.items()}
        ids = columns["input_ids"]
    attention = columns.pop("attention_mask", np.ones_like(ids))
    _check_shape(attention, ids.shape, "attention_mask", "areal")
    lengths = [_run(attention[g], left=False, where=f"areal batch, entry {index}, row {g}: attention_mask") for g in range(len(ids))]
    rows: dict[str, list[Any]] = {}
    for key, array in columns.items():
        if array.ndim >= 2 and array.shape[:2] == ids.shape:
            rows[key] = [array[g, :n] for g, n in enumerate(lengths)]
        elif array.ndim >= 1 and len(array) == len(ids):
            rows[key] = list(array)
        else:
            raise RolloutInputError(f"areal batch, entry {index}, key '{key}': shape {list(array.shape)} fits neither its tokens nor its rows")
    return rows


def _areal_list(items: Sequence[Any], ignore: Iterable[str]) -> dict[str, np.ndarray]:
    """AReaL 1.0.4's ``list[dict]`` batch (one dict per trajectory or group, as ``concat_batch`` in
    ``areal/utils/data.py`` takes it) as one unpadded row per trajectory."""
    if not items:
        raise RolloutInputError("areal batch: an empty list")
    rows: dict[str, list[Any]] = {}
    for index, item in enumerate(items):
        entry = _areal_entry(item, index, ignore)
        if rows and set(entry) != set(rows):
            differ = ", ".join(sorted(set(entry) ^ set(rows)))
            raise RolloutInputError(f"areal batch, entry {index}: keys differ from entry 0 ({differ})")
        for key, values in entry.items():
            rows.setdefault(key, []).extend(values)
    ragged = {key for key, values in rows.items() if np.ndim(values[0]) >= 1}
    return {key: np.array(values + [None], dtype=object)[:-1] if key in ragged else np.asarray(values) for key, values in rows.items()}


def from_areal(d: Any, *, rolled: bool, ignore: Iterable[str] = ()) -> RolloutBatch:
    """A batch from AReaL: padded, packed with ``cu_seqlens``, one row per trajectory, or AReaL's ``list[dict]``.

    ``rolled`` says whether ``PPOActor.compute_advantages`` has run on the batch (``loss_mask`` and
    ``logprobs`` rolled by -1, ``advantages`` next-token aligned): True for what ``ppo_update`` and
    the engine's ``train_batch`` receive, False for workflow output. It is not guessed, since
    nothing in the batch tells a rolled ``loss_mask`` from an unrolled one. See the module docstring.
    """
    if not isinstance(rolled, bool):
        raise RolloutInputError(f"from_areal: rolled= must be True or False, got {rolled!r}")
    if isinstance(d, (list, tuple)):
        d, ignore = _areal_list(d, ignore), ()  # the ignored keys are left out entry by entry
    framework = "areal"
    columns = _columns(d, framework, ignore)
    token_rows, form = _areal_rows(columns)
    count = len(token_rows)
    input_ids = columns["input_ids"]
    token_count = sum(len(row) for row in input_ids) if form == "rows" else input_ids.size
    flat_ids = _token_ids(_flat(input_ids, form, "input_ids", token_count), "input_ids", framework)
    per_token: dict[str, np.ndarray] = {}
    for key, array in columns.items():
        if key in _AREAL_STRUCTURE:
            continue
        if form == "packed" and (array.ndim != 1 or array.shape[0] != token_count):
            continue
        if form == "padded" and (array.ndim != 2 or array.shape[:2] != input_ids.shape):
            continue
        flat = _flat(array, form, key, token_count)
        if flat is not None:
            per_token[key] = flat
    next_token = _AREAL_NEXT_TOKEN | (_AREAL_AFTER_ADVANTAGES if rolled else set())
    routed = columns.get(ROUTED_EXPERTS)
    flat_routed = None if routed is None else _flat(routed, form, ROUTED_EXPERTS, token_count, trailing=2)
    if "loss_mask" not in per_token:
        raise RolloutInputError("areal batch: missing required key 'loss_mask' (1 on generated tokens)")
    rows = _Rows(framework)
    for b, index in enumerate(token_rows):
        fields = {}
        for key, flat in per_token.items():
            values = flat[index]
            if key in next_token:  # entry t scores token t + 1: shift to token alignment, entry 0 = 0
                values = np.concatenate([np.zeros(1, values.dtype), values[:-1]]) if len(values) else values
            fields[_rename(key, _AREAL_RENAMES)] = values
        fields["loss_mask"] = fields["loss_mask"].astype(np.float32)
        generated = np.flatnonzero(fields["loss_mask"])
        prompt = int(generated[0]) if generated.size else len(index)
        rows.add(flat_ids[index], prompt, fields, None if flat_routed is None else flat_routed[index])
    placed = _AREAL_STRUCTURE & set(columns) | set(per_token)
    placed |= _per_trajectory(columns, placed, count, framework, rows)
    _unplaced(columns, placed, framework)
    return rows.batch()
