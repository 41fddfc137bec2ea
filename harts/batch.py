"""Rollout batches: the trajectories of one training step and the RL metadata attached to them.

A trajectory is a token list (one root-to-leaf path of a rollout tree, or any path that
ends at an interior node). Metadata comes in two shapes:

* per-token fields (loss mask, advantages, old / reference log-probs, ...) hold one value
  per token, aligned with ``tokens``: entry ``t`` belongs to ``tokens[t]``. The policy
  log-prob of ``tokens[t]`` is therefore ``log_probs[t - 1]`` in the runtime's output.
* per-trajectory fields (reward, group id, scalar advantage, ...) hold one value each.

Router replay: the experts an inference engine routed each token to (``[layers, top_k]`` per
token, layers counted over the model's MoE layers) travel as the per-token integer fields
``routed_experts.<layer>.<slot>`` (:func:`routed_experts_field`), so node tables, hashing and
subsets carry them like any other per-token field; ``from_trajectories(routed_experts=...)``
takes them as one ``[len, layers, top_k]`` array per trajectory and
:attr:`RolloutBatch.routed_experts` gives them back in that shape.

Sharing is never visible here: two trajectories that share a prefix keep their own
labels and metadata for every position.
"""

from __future__ import annotations

import functools
import hashlib
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from harts.errors import RolloutInputError

MAX_TOKEN_ID = 2**32 - 1

#: Field names a user may omit; ``loss_mask`` defaults to all ones.
DEFAULT_TOKEN_FIELDS = ("loss_mask",)

#: Prefix of the per-token fields holding replayed expert ids (see the module docstring).
ROUTED_EXPERTS = "routed_experts"


def routed_experts_field(layer: int, slot: int) -> str:
    """Name of the per-token field holding the ``slot``-th routed expert of MoE layer ``layer``."""
    return f"{ROUTED_EXPERTS}.{layer}.{slot}"


def _routed_experts_key(name: str) -> tuple[int, int] | None:
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == ROUTED_EXPERTS and parts[1].isdigit() and parts[2].isdigit():
        return int(parts[1]), int(parts[2])
    return None


def _routed_experts_fields(values: Any, count: int) -> dict[str, tuple[np.ndarray, ...]]:
    """Split one ``[len, layers, top_k]`` integer array per trajectory into per-token fields."""
    if not _is_per_token(values) or len(values) != count:
        got = len(values) if _is_per_token(values) else "a scalar"
        raise RolloutInputError(f"field '{ROUTED_EXPERTS}': expected one entry per trajectory ({count}), got {got}")
    arrays = [np.asarray(entry) for entry in values]
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
    array = np.asarray(values)
    if array.ndim != 1:
        raise RolloutInputError(f"{where} must be a flat list of token ids, got shape {array.shape}")
    if array.size == 0:
        return np.empty(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        entries = list(values) if isinstance(values, (list, tuple)) else array.tolist()
        bad = next(
            (i for i, v in enumerate(entries) if isinstance(v, bool) or not isinstance(v, numbers.Integral)), 0
        )
        raise RolloutInputError(f"{where} entry {bad} is {entries[bad]!r}, not an integer token id")
    if array.min() < 0:
        bad = int(np.flatnonzero(array < 0)[0])
        raise RolloutInputError(f"{where} entry {bad} is {int(array[bad])}, token ids must be >= 0")
    if array.max() > MAX_TOKEN_ID:
        bad = int(np.flatnonzero(array > MAX_TOKEN_ID)[0])
        raise RolloutInputError(f"{where} entry {bad} is {int(array[bad])}, above the largest id {MAX_TOKEN_ID}")
    return array.astype(np.int64, copy=False)


def _as_token_array(values: Any, trajectory: int) -> np.ndarray:
    array = token_id_array(values, f"trajectory {trajectory}: field 'tokens'")
    if array.size == 0:
        raise RolloutInputError(f"trajectory {trajectory}: field 'tokens' is empty; a trajectory needs at least one token")
    return array


def _is_per_token(value: Any) -> bool:
    return isinstance(value, (Sequence, np.ndarray)) and not isinstance(value, (str, bytes))


@attrs.frozen(eq=False, slots=False)
class RolloutBatch:
    """The trajectories of one step, in the user's order, with their metadata.

    ``tokens[i]`` is trajectory ``i`` (an ``int64`` array). ``token_fields[name][i]`` has
    ``len(tokens[i])`` entries; ``trajectory_fields[name]`` has one entry per trajectory.
    ``tree_ids[i]`` is the rollout tree of trajectory ``i`` (from the node table, or
    recovered by token-prefix matching: trajectories sharing a first token are one tree).
    """

    tokens: tuple[np.ndarray, ...]
    token_fields: Mapping[str, tuple[np.ndarray, ...]] = attrs.field(factory=dict)
    trajectory_fields: Mapping[str, np.ndarray] = attrs.field(factory=dict)
    tree_ids: np.ndarray | None = None

    @classmethod
    def from_trajectories(
        cls,
        token_lists: Sequence[Sequence[int]],
        tree_ids: Sequence[int] | None = None,
        routed_experts: Sequence[Any] | None = None,
        **fields: Any,
    ) -> "RolloutBatch":
        """Build a batch from token lists; each keyword is a per-token or per-trajectory field.

        A field whose entries are sequences is per-token and must match each trajectory's
        length; a field whose entries are scalars is per-trajectory. ``routed_experts`` is
        one integer array ``[len, layers, top_k]`` per trajectory (router replay; see the
        module docstring).
        """
        if isinstance(token_lists, (str, bytes)) or not isinstance(token_lists, (Sequence, np.ndarray)):
            raise RolloutInputError("field 'tokens': expected a list of token lists, one per trajectory")
        if len(token_lists) == 0:
            raise RolloutInputError("field 'tokens': the batch holds no trajectories")
        tokens = tuple(_as_token_array(values, index) for index, values in enumerate(token_lists))
        if routed_experts is not None:
            clash = sorted(name for name in fields if name.startswith(ROUTED_EXPERTS + "."))
            if clash:
                raise RolloutInputError(f"field '{clash[0]}': give routed experts either as routed_experts= or as fields, not both")
            fields = {**fields, **_routed_experts_fields(routed_experts, len(tokens))}
        token_fields: dict[str, tuple[np.ndarray, ...]] = {}
        trajectory_fields: dict[str, np.ndarray] = {}
        for name, value in fields.items():
            if value is None:
                continue
            if not _is_per_token(value) or len(value) != len(tokens):
                count = len(value) if _is_per_token(value) else "a scalar"
                raise RolloutInputError(f"field '{name}': expected one entry per trajectory ({len(tokens)}), got {count}")
            if all(_is_per_token(entry) for entry in value):
                token_fields[name] = tuple(np.asarray(entry) for entry in value)
            elif not any(_is_per_token(entry) for entry in value):
                trajectory_fields[name] = np.asarray(value)
            else:
                bad = next(i for i, entry in enumerate(value) if not _is_per_token(entry))
                raise RolloutInputError(
                    f"trajectory {bad}: field '{name}' mixes per-token lists and scalars; give one list per trajectory or one scalar each"
                )
        if "loss_mask" not in token_fields:
            token_fields["loss_mask"] = tuple(np.ones(len(t), dtype=np.float32) for t in tokens)
        if tree_ids is None:
            # Trees are the components of the token trie: trajectories with one first token.
            tree_of_first_token: dict[int, int] = {}
            tree_ids_array = np.array(
                [tree_of_first_token.setdefault(int(t[0]), len(tree_of_first_token)) for t in tokens], dtype=np.int64
            )
        else:
            tree_ids_array = np.asarray(tree_ids, dtype=np.int64)
            if tree_ids_array.shape != (len(tokens),):
                raise RolloutInputError(f"field 'tree_ids': expected one entry per trajectory ({len(tokens)}), got shape {tree_ids_array.shape}")
        batch = cls(tokens=tokens, token_fields=token_fields, trajectory_fields=trajectory_fields, tree_ids=tree_ids_array)
        batch.validate()
        return batch

    def validate(self) -> None:
        """Check lengths and types of every field; raise :class:`RolloutInputError` naming the culprit."""
        for name, per_trajectory in self.token_fields.items():
            if len(per_trajectory) != len(self.tokens):
                raise RolloutInputError(f"field '{name}': expected one entry per trajectory ({len(self.tokens)}), got {len(per_trajectory)}")
            for index, (values, tokens) in enumerate(zip(per_trajectory, self.tokens)):
                if values.ndim != 1 or len(values) != len(tokens):
                    raise RolloutInputError(
                        f"trajectory {index}: field '{name}' has {values.size} entries, expected {len(tokens)} (one per token)"
                    )
                if values.dtype == object:
                    raise RolloutInputError(f"trajectory {index}: field '{name}' holds non-numeric values")
        for name, values in self.trajectory_fields.items():
            if values.shape[:1] != (len(self.tokens),):
                raise RolloutInputError(f"field '{name}': expected one entry per trajectory ({len(self.tokens)}), got shape {values.shape}")

    @classmethod
    def read(cls, path: Any) -> "RolloutBatch":
        """Read a node table (``.jsonl`` or ``.parquet``); see :mod:`harts.io`."""
        from harts.io import read_node_table

        return read_node_table(path)

    def write(self, path: Any) -> None:
        """Write this batch as a node table (``.jsonl`` or ``.parquet``), atomically; see :mod:`harts.io`."""
        from harts.io import write_node_table

        write_node_table(self, path)

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_trajectories(self) -> int:
        return len(self.tokens)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(t) for t in self.tokens], dtype=np.int64)

    @property
    def semantic_tokens(self) -> int:
        return int(sum(len(t) for t in self.tokens))

    @property
    def loss_mask(self) -> tuple[np.ndarray, ...]:
        return self.token_fields["loss_mask"]

    @functools.cached_property
    def routed_experts(self) -> tuple[np.ndarray, ...] | None:
        """Per trajectory the replayed expert ids ``[len, layers, top_k]`` (int64), or None when absent."""
        keys = {}
        for name in self.token_fields:
            key = _routed_experts_key(name)
            if key is not None:
                keys[key] = name
        if not keys:
            return None
        layers = 1 + max(layer for layer, _ in keys)
        top_k = 1 + max(slot for _, slot in keys)
        missing = [routed_experts_field(l, k) for l in range(layers) for k in range(top_k) if (l, k) not in keys]
        if missing:
            raise RolloutInputError(
                f"field '{missing[0]}' is missing: routed experts need every field {ROUTED_EXPERTS}.<layer>.<slot> "
                f"for layers 0..{layers - 1} and slots 0..{top_k - 1}"
            )
        out = []
        for index in range(len(self.tokens)):
            columns = [self.token_fields[keys[l, k]][index] for l in range(layers) for k in range(top_k)]
            array = np.stack(columns, axis=-1) if columns else np.zeros((len(self.tokens[index]), 0), dtype=np.int64)
            if array.dtype.kind not in "iu":
                raise RolloutInputError(f"trajectory {index}: field '{keys[0, 0]}' holds {array.dtype} values, not expert ids")
            out.append(array.astype(np.int64, copy=False).reshape(len(self.tokens[index]), layers, top_k))
        return tuple(out)

    def token_keys(self) -> list[bytes]:
        """Big-endian uint32 encodings: bytes order equals token-lexicographic order, prefixes sort first."""
        return [t.astype(">u4").tobytes() for t in self.tokens]

    @functools.cached_property
    def _hash(self) -> str:
        return self._compute_hash()

    def content_hash(self) -> str:
        """SHA-256 over tokens, tree ids and every metadata field (cached; the batch is immutable)."""
        return self._hash

    def _compute_hash(self) -> str:
        """SHA-256 over tokens, tree ids and every metadata field, independent of dict order."""
        digest = hashlib.sha256()
        digest.update(b"harts-batch-v1")
        for tokens in self.tokens:
            digest.update(len(tokens).to_bytes(8, "little"))
            digest.update(tokens.astype("<i8").tobytes())
        if self.tree_ids is not None:
            digest.update(np.asarray(self.tree_ids, dtype="<i8").tobytes())
        for name in sorted(self.token_fields):
            digest.update(f"token:{name}".encode())
            for values in self.token_fields[name]:
                digest.update(str(values.dtype).encode())
                digest.update(np.ascontiguousarray(values).tobytes())
        for name in sorted(self.trajectory_fields):
            values = self.trajectory_fields[name]
            digest.update(f"trajectory:{name}:{values.dtype}".encode())
            digest.update(np.ascontiguousarray(values).tobytes())
        return "sha256:" + digest.hexdigest()

    def subset(self, indices: Sequence[int]) -> "RolloutBatch":
        """A batch of the given trajectories (in the given order), metadata kept."""
        indices = list(indices)
        return RolloutBatch(
            tokens=tuple(self.tokens[i] for i in indices),
            token_fields={k: tuple(v[i] for i in indices) for k, v in self.token_fields.items()},
            trajectory_fields={k: v[indices] for k, v in self.trajectory_fields.items()},
            tree_ids=None if self.tree_ids is None else np.asarray(self.tree_ids)[indices],
        )
