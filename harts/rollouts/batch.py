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
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from harts.rollouts import nodetable
from harts.errors import RolloutInputError
from harts.fsio import RECORD_LINE_LIMIT, OutputKind, check_output
from harts.rollouts.fields import (
    FINITE_FIELDS,
    PER_TOKEN_FIELDS,
    ROUTED_EXPERTS,
    TOKEN_FIELD_KINDS,
    TRAJECTORY_FIELD_KINDS,
    adopt,
    as_array,
    check_field_values,
    integer_array,
    owned,
    per_trajectory_entries,
    refuse_misspelt_field,
    routed_experts_field,
    routed_experts_fields,
    routed_experts_key,
    scalar_field_array,
    token_id_array,
    trajectory_token_array,
)

_INT64 = np.iinfo(np.int64)


def _hashable(values: np.ndarray, dtype: str | None = None) -> memoryview:
    """The bytes of ``values`` (as ``dtype`` when given) for a digest: the array's own buffer when it is
    contiguous and of that dtype, a converted copy otherwise (the bytes are those of ``tobytes()``)."""
    array = np.ascontiguousarray(values, dtype=dtype)
    return memoryview(array.reshape(-1).view(np.uint8))


#: :func:`_update_with_tokens` hands the digest runs of trajectories of about this many bytes at a time
_HASH_RUN_BYTES = 1 << 23


def _update_with_tokens(digest, tokens: Sequence[np.ndarray]) -> None:
    """Feed ``digest`` each trajectory's length (8 bytes, little-endian) and then its ``<i8`` tokens.

    The bytes are those of one update per piece, but consecutive trajectories go in as one joined run of about
    :data:`_HASH_RUN_BYTES`. Why: ``harts.compile`` hashes in a worker thread while the main thread builds the
    trie and plans, and the worker must retake the GIL after each update it releases it for; one update per
    trajectory made it wait on the main thread's Python thousands of times (on the agentic bench shape the
    hash and the trie build side by side took 0.41-0.46 s, 0.34-0.39 s with these runs; the hash alone,
    0.3 s), a run of megabytes a few dozen times. The join's copy holds the GIL (CPython drops it only when
    every piece is a ``bytes`` object, and these are array views): 0.05-0.09 s of the main thread's time over
    a compile, against the waits it saves. Runs of 32 MB were slower (0.67 s), each a fresh mapping whose pages
    fault in as the join writes them.
    """
    pieces: list = []
    size = 0
    for trajectory in tokens:
        pieces.append(len(trajectory).to_bytes(8, "little"))
        if 8 * len(trajectory) >= _HASH_RUN_BYTES:
            # long enough to hash on its own, in place, without the copy a join makes
            digest.update(b"".join(pieces))
            digest.update(_hashable(trajectory, "<i8"))
            pieces, size = [], 0
            continue
        pieces.append(_hashable(trajectory, "<i8"))
        size += 8 + 8 * len(trajectory)
        if size >= _HASH_RUN_BYTES:
            digest.update(b"".join(pieces))
            pieces, size = [], 0
    if pieces:
        digest.update(b"".join(pieces))


@attrs.frozen(eq=False, slots=False)
class RolloutBatch:
    """The trajectories of one step, in the user's order, with their metadata.

    ``tokens[i]`` is trajectory ``i`` (an ``int64`` array). ``token_fields[name][i]`` has
    ``len(tokens[i])`` entries; ``trajectory_fields[name]`` has one entry per trajectory.
    ``tree_ids[i]`` is the rollout tree of trajectory ``i`` (from the node table, or
    recovered by token-prefix matching: trajectories sharing a first token are one tree).

    The batch owns its data: every array is a read-only copy (arrays handed over with
    :func:`adopt` excepted), so changing what it was built from changes neither the batch,
    nor its content hash, nor a plan compiled for it. Construction checks every field
    (:meth:`validate`) and adds ``loss_mask`` (all ones) when it is not given.
    """

    tokens: tuple[np.ndarray, ...]
    token_fields: Mapping[str, tuple[np.ndarray, ...]] = attrs.field(factory=dict)
    trajectory_fields: Mapping[str, np.ndarray] = attrs.field(factory=dict)
    tree_ids: np.ndarray | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.tokens, (tuple, list)):
            raise RolloutInputError("field 'tokens': expected a tuple of token arrays, one per trajectory")
        tokens = tuple(owned(token_id_array(t, f"trajectory {i}: field 'tokens'")) for i, t in enumerate(self.tokens))
        token_fields = {}
        for name, per_trajectory in dict(self.token_fields).items():
            token_fields[name] = tuple(owned(as_array(v, f"trajectory {i}: field '{name}'")) for i, v in enumerate(per_trajectory))
        if "loss_mask" not in token_fields:
            token_fields["loss_mask"] = tuple(adopt(np.ones(len(t), dtype=np.float32)) for t in tokens)
        trajectory_fields = {name: owned(as_array(v, f"field '{name}'")) for name, v in dict(self.trajectory_fields).items()}
        tree_ids = None
        if self.tree_ids is not None:
            tree_ids = owned(integer_array(self.tree_ids, "field 'tree_ids'", int(_INT64.min), int(_INT64.max), "an integer tree id"))
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "token_fields", token_fields)
        object.__setattr__(self, "trajectory_fields", trajectory_fields)
        object.__setattr__(self, "tree_ids", tree_ids)
        self.validate()

    @classmethod
    def from_trajectories(
        cls,
        token_lists: Sequence[Sequence[int]],
        tree_ids: Sequence[int] | None = None,
        routed_experts: Sequence[Any] | None = None,
        **fields: Any,
    ) -> "RolloutBatch":
        """Build a batch from token lists; each keyword is a per-token or per-trajectory field.

        Every argument may be a list, a tuple, a NumPy array or a torch tensor (entries too).
        A field whose entries are sequences is per-token and must match each trajectory's
        length; a field whose entries are scalars is per-trajectory. ``loss_mask`` is per-token
        only (finite values in [0, 1]; integers 0/1 and booleans too) and defaults to ones.
        ``routed_experts`` is one integer array ``[len, layers, top_k]`` per trajectory (router
        replay; see the module docstring). Everything is copied: later changes to the arguments
        do not reach the batch.
        """
        if isinstance(token_lists, (str, bytes)):
            raise RolloutInputError("field 'tokens': expected a list of token lists, one per trajectory")
        entries = per_trajectory_entries(token_lists, "tokens", None)
        if len(entries) == 0:
            raise RolloutInputError("field 'tokens': the batch holds no trajectories")
        if entries[0].ndim == 0:
            raise RolloutInputError(
                "field 'tokens': expected a list of token lists, one per trajectory, got a flat list of "
                f"{'token ids' if entries[0].dtype.kind in 'iu' else 'values'} (for one trajectory, wrap it: [tokens])"
            )
        tokens = tuple(adopt(np.array(trajectory_token_array(values, index), dtype=np.int64)) for index, values in enumerate(entries))
        if routed_experts is not None:
            clash = sorted(name for name in fields if name.startswith(ROUTED_EXPERTS + "."))
            if clash:
                raise RolloutInputError(f"field '{clash[0]}': give routed experts either as routed_experts= or as fields, not both")
            fields = {**fields, **routed_experts_fields(routed_experts, len(tokens))}
        token_fields: dict[str, tuple[np.ndarray, ...]] = {}
        trajectory_fields: dict[str, np.ndarray] = {}
        for name, value in fields.items():
            if value is None:
                continue
            per_trajectory = per_trajectory_entries(value, name, len(tokens))
            dims = [entry.ndim for entry in per_trajectory]
            deep = next((i for i, d in enumerate(dims) if d > 1), None)
            if deep is not None:
                raise RolloutInputError(
                    f"trajectory {deep}: field '{name}' has shape {per_trajectory[deep].shape}; give a flat list (one value per token) or a scalar"
                )
            if all(d == 1 for d in dims):
                token_fields[name] = tuple(adopt(np.array(entry)) for entry in per_trajectory)
            elif all(d == 0 for d in dims):
                if name in PER_TOKEN_FIELDS:
                    raise RolloutInputError(
                        f"field '{name}' is per-token: give one list with a value per token of each trajectory, not one "
                        f"scalar per trajectory (to mask a whole trajectory, repeat its value: [m] * len(tokens))"
                    )
                trajectory_fields[name] = adopt(scalar_field_array(per_trajectory, name))
            else:
                bad = next(i for i, d in enumerate(dims) if d != dims[0])
                raise RolloutInputError(
                    f"trajectory {bad}: field '{name}' mixes per-token lists and scalars; give one list per trajectory or one scalar each"
                )
        if tree_ids is None:
            # Trees are the components of the token trie: trajectories with one first token.
            tree_of_first_token: dict[int, int] = {}
            tree_ids_array = np.array(
                [tree_of_first_token.setdefault(int(t[0]), len(tree_of_first_token)) for t in tokens], dtype=np.int64
            )
        else:
            entries = per_trajectory_entries(tree_ids, "tree_ids", len(tokens))
            if any(entry.ndim != 0 for entry in entries):
                bad = next(i for i, entry in enumerate(entries) if entry.ndim != 0)
                raise RolloutInputError(f"trajectory {bad}: field 'tree_ids' must be one integer per trajectory")
            tree_ids_array = integer_array([entry.item() for entry in entries], "field 'tree_ids'", int(_INT64.min), int(_INT64.max),
                                           "an integer tree id")
        return cls(tokens=tokens, token_fields=token_fields, trajectory_fields=trajectory_fields, tree_ids=adopt(tree_ids_array))

    def validate(self) -> None:
        """Check names, lengths, kinds and values of every field; raise :class:`RolloutInputError` naming the culprit."""
        for name in (*self.token_fields, *self.trajectory_fields):
            refuse_misspelt_field(name)
        for index, tokens in enumerate(self.tokens):
            if tokens.ndim != 1 or tokens.size == 0:
                raise RolloutInputError(f"trajectory {index}: field 'tokens' is empty; a trajectory needs at least one token")
        for name, per_trajectory in self.token_fields.items():
            if len(per_trajectory) != len(self.tokens):
                raise RolloutInputError(f"field '{name}': expected one entry per trajectory ({len(self.tokens)}), got {len(per_trajectory)}")
            for index, (values, tokens) in enumerate(zip(per_trajectory, self.tokens)):
                if values.ndim != 1 or len(values) != len(tokens):
                    raise RolloutInputError(
                        f"trajectory {index}: field '{name}' has {values.size} entries, expected {len(tokens)} (one per token)"
                    )
                if values.dtype.kind not in TOKEN_FIELD_KINDS:
                    raise RolloutInputError(
                        f"trajectory {index}: field '{name}' holds non-numeric values (dtype {values.dtype}); per-token values must be numbers or booleans"
                    )
                check_field_values(name, values, f"trajectory {index}")
        for name, values in self.trajectory_fields.items():
            if values.shape != (len(self.tokens),):
                raise RolloutInputError(f"field '{name}': expected one entry per trajectory ({len(self.tokens)}), got shape {values.shape}")
            if values.dtype.kind not in TRAJECTORY_FIELD_KINDS:
                raise RolloutInputError(
                    f"field '{name}': per-trajectory values must be numbers, booleans or strings, got dtype {values.dtype}"
                )
            if name in FINITE_FIELDS:
                if values.dtype.kind not in "biuf":
                    raise RolloutInputError(f"field '{name}': values must be numbers, got dtype {values.dtype}")
                if values.dtype.kind == "f" and not np.isfinite(values).all():
                    bad = int(np.flatnonzero(~np.isfinite(values))[0])
                    raise RolloutInputError(f"trajectory {bad}: field '{name}' is {values[bad]}; its values must be finite")
        if self.tree_ids is not None and self.tree_ids.shape != (len(self.tokens),):
            raise RolloutInputError(f"field 'tree_ids': expected one entry per trajectory ({len(self.tokens)}), got shape {self.tree_ids.shape}")

    @classmethod
    def read(cls, path: Any) -> "RolloutBatch":
        """Read a node table (``.jsonl`` or ``.parquet``); see :mod:`harts.rollouts.nodetable` for the format."""
        return nodetable.decode_node_table(path, cls._from_node_table)

    @classmethod
    def from_node_table_records(cls, records: Any) -> "RolloutBatch":
        """A batch from in-memory node-table rows (dicts with a ``kind``; see :mod:`harts.rollouts.nodetable`)."""
        return nodetable.decode_node_table_records(records, cls._from_node_table)

    @classmethod
    def _from_node_table(cls, contents: nodetable.NodeTableContents) -> "RolloutBatch":
        batch = cls(tokens=contents.tokens, token_fields=contents.token_fields,
                    trajectory_fields=contents.trajectory_fields, tree_ids=contents.tree_ids)
        if contents.content_hash is not None and contents.content_hash != batch.content_hash():
            raise nodetable.content_hash_mismatch()
        return batch

    def write(self, path: Any) -> None:
        """Write this batch as a node table (``.jsonl`` or ``.parquet``), atomically; see :mod:`harts.rollouts.nodetable`.

        ``path`` must be new or a node table HARTS wrote (:data:`NODE_TABLE`); anything else raises
        :class:`~harts.errors.OutputError` and is left untouched.
        """
        check_output(path, NODE_TABLE)
        nodetable.write_node_table(self, path)

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
            key = routed_experts_key(name)
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

    @functools.cached_property
    def _hash(self) -> str:
        return self._compute_hash(input_only=False)

    @functools.cached_property
    def _input_hash(self) -> str:
        return self._compute_hash(input_only=True)

    def content_hash(self) -> str:
        """SHA-256 over tokens, tree ids and every metadata field (cached; the batch is immutable).

        Identifies the batch's whole contents (a node table records it to detect edits).
        """
        return self._hash

    def input_hash(self) -> str:
        """SHA-256 over what a plan computes from: tokens, tree ids and routed experts (cached).

        Plans bind to it (:mod:`harts.binding`), so fields that do not change the computation
        (loss mask, old / reference / sampling log-probs, advantages, rewards) may be added or
        changed after compiling.
        """
        return self._input_hash

    def _compute_hash(self, *, input_only: bool) -> str:
        """SHA-256 over tokens, tree ids and the metadata fields (only the routed experts when
        ``input_only``), independent of dict order."""
        digest = hashlib.sha256()
        digest.update(b"harts-batch-input-v1" if input_only else b"harts-batch-v1")
        _update_with_tokens(digest, self.tokens)
        if self.tree_ids is not None:
            digest.update(np.asarray(self.tree_ids, dtype="<i8").tobytes())
        for name in sorted(self.token_fields):
            if input_only and routed_experts_key(name) is None:
                continue
            digest.update(f"token:{name}".encode())
            for values in self.token_fields[name]:
                digest.update(str(values.dtype).encode())
                digest.update(_hashable(values))
        for name in sorted(() if input_only else self.trajectory_fields):
            values = self.trajectory_fields[name]
            digest.update(f"trajectory:{name}:{values.dtype}".encode())
            digest.update(np.ascontiguousarray(values).tobytes())
        return "sha256:" + digest.hexdigest()

    def subset(self, indices: Sequence[int]) -> "RolloutBatch":
        """A batch of the given trajectories (in the given order), metadata kept."""
        indices = integer_array(indices, "subset: trajectory indices", 0, len(self.tokens) - 1, "a trajectory index").tolist()
        return RolloutBatch(
            tokens=tuple(self.tokens[i] for i in indices),
            token_fields={k: tuple(v[i] for i in indices) for k, v in self.token_fields.items()},
            trajectory_fields={k: v[indices] for k, v in self.trajectory_fields.items()},
            tree_ids=None if self.tree_ids is None else np.asarray(self.tree_ids)[indices],
        )


def read_node_table(path: Any) -> RolloutBatch:
    """Read a node table (``.jsonl`` or ``.parquet``) into a :class:`RolloutBatch`.

    Every problem with the file or its contents raises :class:`~harts.errors.RolloutInputError`
    naming the file and the record, tree, node, trajectory or field.
    """
    return RolloutBatch.read(path)


def read_node_table_records(records: Any) -> RolloutBatch:
    """Build a batch from in-memory node-table rows (dicts with a ``kind``, see :mod:`harts.rollouts.nodetable`)."""
    return RolloutBatch.from_node_table_records(records)


def write_node_table(batch: RolloutBatch, path: Any) -> None:
    """Write ``batch`` as a node table at ``path`` (:meth:`RolloutBatch.write`: the ownership rule applies)."""
    batch.write(path)


def _node_table_schema_hash(path: Path) -> str | None:
    """The content hash a node table's schema records (None when it records none), read without reading the rows."""
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        stored = (pq.read_schema(path).metadata or {}).get(nodetable.PARQUET_SCHEMA_KEY)
        schema = json.loads(stored) if stored is not None else None
    else:
        with open(path, "rb") as handle:
            schema = json.loads(handle.readline(RECORD_LINE_LIMIT) or b"null")
        if not (isinstance(schema, dict) and schema.get("kind") == nodetable.SCHEMA_KIND):
            return None
    content_hash = schema.get("content_hash") if isinstance(schema, dict) else None
    return content_hash if isinstance(content_hash, str) else None


def _why_not_a_harts_node_table(path: Path) -> str | None:
    """None for a node table HARTS wrote and nobody edited since: its schema's content hash matches its rows."""
    try:
        content_hash = _node_table_schema_hash(path)
    except Exception:  # pyarrow and json raise several types for files that are not node tables
        return "it holds no HARTS node-table schema"
    if content_hash is None:
        return "it records no HARTS content hash"
    try:
        RolloutBatch.read(path)  # checks the rows against that hash
    except Exception:  # any failure to read it back means it is not a table HARTS wrote as it is
        return "it does not read back as HARTS wrote it: its rows and content hash disagree"
    return None


#: Node-table targets for the output-ownership rule (:func:`harts.fsio.check_outputs`): a table HARTS wrote is
#: recognised by its schema's content hash matching its rows, not by the look of its first line.
NODE_TABLE = OutputKind("a node table HARTS wrote", "the node table", False, _why_not_a_harts_node_table)
