"""Node tables: rollout trees on disk (JSON Lines or Parquet) and in memory.

A node table is one table whose rows each carry a ``kind``:

* ``"node"`` rows hold the trees: ``tree_id``, ``node_id``, ``parent_id`` (null for a
  root), ``token_ids`` and any per-token fields, one value per token of the node
  (``loss_mask`` defaults to ones; the column ``logprobs`` becomes the batch field
  ``rollout_logprobs``; every other list column keeps its name).
* ``"trajectory"`` rows name the trajectories: ``tree_id``, ``leaf`` (the node where the
  trajectory ends, interior nodes allowed), optional ``trajectory_id`` (the batch order)
  and any scalar fields (``group_id``, ``reward``, ``advantage``, ...).
* an optional ``"schema"`` row (written by :func:`write_node_table`) records the NumPy
  dtype of every field so that a JSON Lines round trip is exact, and the content hash of the
  batch: a table that reads back as anything else (damaged bytes, an edit) is refused. Delete
  ``content_hash`` from the schema row after editing a written table on purpose.

Reading is strict: every field is given on every node that has tokens or on none (a missing
``loss_mask`` is never filled with ones beside nodes that have one); values are cast to the
schema's dtypes only when no value changes (no integer wrap-around, no overflow to infinity);
masks must be finite and in [0, 1].

A tree without trajectory rows contributes one trajectory per leaf node, in node order.
Trajectory order: by ``trajectory_id`` when the trajectory rows carry it (trees without
trajectory rows follow, in order of appearance), otherwise by order of appearance (the
trajectory row, or the leaf node row for a tree without trajectory rows).

The format is picked by the file suffix: ``.jsonl`` or ``.parquet``. Writes are atomic:
the table goes to a temporary file in the target directory, is flushed to disk, and then
replaces the target, so an error never leaves a half-written file behind.
"""

from __future__ import annotations

import json
import logging
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import attrs
import numpy as np

from harts.rollouts.fields import TOKEN_FIELD_KINDS, TRAJECTORY_FIELD_KINDS, adopt, check_field_values, token_id_array
from harts.errors import OutputError, RolloutInputError
from harts.fsio import atomic_write_with

if TYPE_CHECKING:  # the writers read a batch's attributes; only the builder a reader is given makes one
    from harts.rollouts.batch import RolloutBatch

Batch = TypeVar("Batch")

logger = logging.getLogger(__name__)

NODE_KIND = "node"
TRAJECTORY_KIND = "trajectory"
SCHEMA_KIND = "schema"
SCHEMA_VERSION = 1
SUFFIXES = (".jsonl", ".parquet")

NODE_COLUMNS = ("tree_id", "node_id", "parent_id", "token_ids")
TRAJECTORY_COLUMNS = ("tree_id", "leaf", "trajectory_id")
RESERVED_COLUMNS = frozenset({"kind", *NODE_COLUMNS, *TRAJECTORY_COLUMNS})
#: Node-table column name -> batch field name, where the two differ.
TOKEN_COLUMN_TO_FIELD = {"logprobs": "rollout_logprobs"}
TOKEN_FIELD_TO_COLUMN = {field: column for column, field in TOKEN_COLUMN_TO_FIELD.items()}
PARQUET_SCHEMA_KEY = b"harts.schema"


# ---------------------------------------------------------------------------- parsing


@attrs.define
class _Node:
    tree: int
    node_id: int
    parent: int | None
    tokens: np.ndarray
    raw_fields: dict[str, Any]
    record: int
    fields: dict[str, np.ndarray] = attrs.field(factory=dict)


@attrs.define
class _TrajectoryRow:
    tree: int
    leaf: int
    trajectory_id: int | None
    fields: dict[str, Any]
    record: int
    implied: bool = False

    @property
    def label(self) -> str:
        return f"tree {self.tree}, {self.short_label}"

    @property
    def short_label(self) -> str:
        if self.implied:
            return f"trajectory at leaf node {self.leaf}"
        if self.trajectory_id is not None:
            return f"trajectory {self.trajectory_id}"
        return f"trajectory at record {self.record}"


def _is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple, np.ndarray))


_ID_RANGE = (int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max))


def _integer(value: Any, where: str, column: str) -> int:
    if not _is_integer(value):
        raise RolloutInputError(f"{where}: column '{column}' must be an integer, got {_shown(value)}")
    if not _ID_RANGE[0] <= value <= _ID_RANGE[1]:
        raise RolloutInputError(f"{where}: column '{column}' is {_shown(value)}, outside the 64-bit integer range of ids")
    return int(value)


def _shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages about arbitrary input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _token_array(values: Any, where: str) -> np.ndarray:
    if not _is_list(values):
        raise RolloutInputError(f"{where}: column 'token_ids' must be a list of token ids, got {_shown(values)}")
    return token_id_array(values, f"{where}: column 'token_ids'")


def _require(row: Mapping[str, Any], column: str, where: str, nullable: bool = False) -> Any:
    if column not in row or (row[column] is None and not nullable):
        hint = " (null for a root)" if nullable else ""
        raise RolloutInputError(f"{where}: missing required column '{column}'{hint}")
    return row[column]


def _parse_rows(
    rows: Iterable[Mapping[str, Any]], column_dtypes: Mapping[str, np.dtype] | None = None
) -> tuple[list[_Node], list[_TrajectoryRow], dict[str, str], str | None]:
    """Split rows into nodes and trajectory rows; check ids and types row by row. Also returns the
    schema's dtypes and content hash (None without a schema record)."""
    nodes: list[_Node] = []
    trajectories: list[_TrajectoryRow] = []
    schema: dict[str, str] = {}
    content_hash: str | None = None
    schema_record: int | None = None
    for record, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise RolloutInputError(f"record {record}: expected an object with a 'kind', got {type(row).__name__}")
        kind = row.get("kind")
        if kind is None:
            raise RolloutInputError(f"record {record}: missing required column 'kind'")
        if kind == SCHEMA_KIND:
            if schema_record is not None:
                raise RolloutInputError(f"record {record}: a second schema record (the first is record {schema_record})")
            schema_record = record
            schema, content_hash = _parse_schema(row, f"record {record} (schema)")
            continue
        if kind not in (NODE_KIND, TRAJECTORY_KIND):
            raise RolloutInputError(
                f"record {record}: unknown kind {_shown(kind)}; expected '{NODE_KIND}' or '{TRAJECTORY_KIND}'"
            )
        where = f"record {record} ({kind})"
        tree = _integer(_require(row, "tree_id", where), where, "tree_id")
        foreign = TRAJECTORY_COLUMNS[1:] if kind == NODE_KIND else NODE_COLUMNS[1:]
        for column in foreign:
            if row.get(column) is not None:
                raise RolloutInputError(f"{where}: column '{column}' does not apply to {kind} rows")
        extra = {k: v for k, v in row.items() if k not in RESERVED_COLUMNS and v is not None}
        if kind == NODE_KIND:
            node_id = _integer(_require(row, "node_id", where), where, "node_id")
            where = f"tree {tree}, node {node_id}"
            parent = _require(row, "parent_id", where, nullable=True)
            parent = None if parent is None else _integer(parent, where, "parent_id")
            tokens = _token_array(_require(row, "token_ids", where), where)
            for name, values in extra.items():
                if not _is_list(values):
                    raise RolloutInputError(
                        f"{where}: field '{name}' must be a list with one value per token, got {_shown(values)}"
                    )
            nodes.append(_Node(tree=tree, node_id=node_id, parent=parent, tokens=tokens, raw_fields=extra, record=record))
        else:
            leaf = _integer(_require(row, "leaf", where), where, "leaf")
            trajectory_id = row.get("trajectory_id")
            if trajectory_id is not None:
                trajectory_id = _integer(trajectory_id, where, "trajectory_id")
            trajectory = _TrajectoryRow(tree=tree, leaf=leaf, trajectory_id=trajectory_id, fields=extra, record=record)
            for name, value in extra.items():
                if _is_list(value) or isinstance(value, Mapping):
                    raise RolloutInputError(
                        f"{trajectory.label}: field '{name}' must be a scalar (per-token values belong on node rows)"
                    )
            trajectories.append(trajectory)
    if column_dtypes:
        schema = {**{k: np.dtype(v).str for k, v in column_dtypes.items()}, **schema}
    return nodes, trajectories, schema, content_hash


_SCHEMA_KEYS = frozenset({"kind", "version", "token_fields", "trajectory_fields", "content_hash"})


def _parse_schema(row: Any, where: str) -> tuple[dict[str, str], str | None]:
    """The dtypes a schema record names, and the content hash of the batch it was written from (if recorded)."""
    if not isinstance(row, Mapping):
        raise RolloutInputError(f"{where}: the schema must be an object, got {type(row).__name__}")
    unknown = sorted(str(key) for key in row if key not in _SCHEMA_KEYS)
    if unknown:
        raise RolloutInputError(f"{where}: unknown schema entries {', '.join(_shown(key) for key in unknown[:3])}")
    content_hash = row.get("content_hash")
    if content_hash is not None and not isinstance(content_hash, str):
        raise RolloutInputError(f"{where}: 'content_hash' must be a string")
    if row.get("version") != SCHEMA_VERSION:
        raise RolloutInputError(f"{where}: unsupported schema version {_shown(row.get('version'))}")
    dtypes: dict[str, str] = {}
    for section, kinds in (("token_fields", TOKEN_FIELD_KINDS), ("trajectory_fields", TRAJECTORY_FIELD_KINDS)):
        entries = row.get(section, {})
        if not isinstance(entries, Mapping):
            raise RolloutInputError(f"{where}: '{section}' must map field names to dtypes")
        for name, dtype in entries.items():
            dtypes[name] = _schema_dtype(dtype, kinds, f"{where}: field '{name}'").str
    return dtypes, content_hash


def _schema_dtype(text: Any, kinds: str, where: str) -> np.dtype:
    """A dtype named in a schema, limited to the kinds node tables hold (never object or structured types)."""
    try:
        dtype = np.dtype(text) if isinstance(text, str) else None
    except (TypeError, ValueError, SyntaxError):
        dtype = None
    if dtype is None or dtype.kind not in kinds or dtype.fields is not None or dtype.shape:
        raise RolloutInputError(f"{where} has an unknown or unsupported dtype {_shown(text)}")
    return dtype


_PYTHON_KINDS = {frozenset({bool}): "b", frozenset({int}): "i", frozenset({float}): "f", frozenset({int, float}): "f", frozenset({str}): "U"}


def _values_array(values: Any, where: str, name: str, kinds: str) -> np.ndarray:
    """A column's values (a list of Python values from JSON or Arrow, or a typed array from Parquet) as a flat array.

    Python values are typed by what they are, not by what NumPy would promote them to: booleans
    never mix with numbers, integers stay exact (int64, or uint64 above its range) and strings
    never mix with numbers.
    """
    if isinstance(values, np.ndarray):
        array = values
    else:
        values = list(values)
        kind = _PYTHON_KINDS.get(frozenset(map(type, values)), "?") if values else "f"
        if kind == "i":
            try:
                array = np.array(values, dtype=np.int64)
            except OverflowError:
                try:
                    array = np.array(values, dtype=np.uint64)
                except OverflowError:
                    bad = next(i for i, v in enumerate(values) if not _ID_RANGE[0] <= v < 2**64)
                    raise RolloutInputError(f"{where}: field '{name}' entry {bad} is {_shown(values[bad])}, too large for 64 bits") from None
        elif kind == "?":
            raise RolloutInputError(f"{where}: field '{name}' holds {_kinds_named(values)}; {_allowed(kinds)}")
        else:
            array = np.array(values, dtype={"b": bool, "f": np.float64, "U": str}[kind])
    if array.ndim != 1 or array.dtype.kind not in kinds:
        raise RolloutInputError(f"{where}: field '{name}' holds non-numeric values" if "U" not in kinds
                                else f"{where}: field '{name}' holds {array.dtype} values; {_allowed(kinds)}")
    return array


def _kinds_named(values: list) -> str:
    names = sorted({type(v).__name__ for v in values})
    return "values of several types (" + ", ".join(names) + ")" if len(names) > 1 else f"{names[0]} values"


def _allowed(kinds: str) -> str:
    return "values must be numbers, booleans or strings (one kind per field)" if "U" in kinds else "values must be numbers or booleans"


def _cast(array: np.ndarray, dtype: np.dtype, where: str, name: str) -> np.ndarray:
    """``array`` as ``dtype``, refusing every cast that would change a value: no wrap-around, no overflow to
    infinity, no integer that the float type cannot hold exactly, no truncated string."""
    source = array.dtype
    if source == dtype:
        return array
    target_kind = dtype.kind

    def refuse(bad: np.ndarray, why: str) -> RolloutInputError:
        index = int(np.flatnonzero(bad)[0])
        return RolloutInputError(f"{where}: field '{name}' entry {index} is {array[index].item()!r}, {why} its dtype {dtype}")

    if source.kind == "b" and target_kind in "biuf":
        return array.astype(dtype)
    if source.kind in "iu" and target_kind == "b":
        bad = (array != 0) & (array != 1)
        if bad.any():
            raise refuse(bad, "which is not a boolean (0 or 1) as required by")
        return array.astype(dtype)
    if source.kind in "iu" and target_kind in "iu":
        info = np.iinfo(dtype)
        bad = (array < info.min) | (array > info.max)
        if bad.any():
            raise refuse(bad, f"outside the range {info.min}..{info.max} of")
        return array.astype(dtype)
    if source.kind in "iu" and target_kind == "f":
        cast = array.astype(dtype)
        with np.errstate(invalid="ignore", over="ignore"):
            bad = ~np.isfinite(cast) | (cast.astype(source) != array)
        if bad.any():
            raise refuse(bad, "an integer that cannot be held exactly by")
        return cast
    if source.kind == "f" and target_kind == "f":
        with np.errstate(over="ignore"):
            cast = array.astype(dtype)
        bad = np.isfinite(array) & ~np.isfinite(cast)
        if bad.any():
            raise refuse(bad, "outside the range of")
        return cast
    if source.kind == "U" and target_kind == "U":
        if array.size and np.char.str_len(array).max() > dtype.itemsize // 4:
            raise refuse(np.char.str_len(array) > dtype.itemsize // 4, "a string longer than")
        return array.astype(dtype)
    raise RolloutInputError(f"{where}: field '{name}' holds {source} values that do not fit its dtype {dtype}")


def _token_field_dtypes(nodes: list[_Node], schema: Mapping[str, str]) -> dict[str, np.dtype]:
    """One dtype per per-token column: the schema's, else inferred over every node."""
    inferred: dict[str, np.dtype | None] = {}
    for node in nodes:
        for name, values in node.raw_fields.items():
            current = inferred.setdefault(name, None)
            if name in schema or name == "loss_mask" or len(values) == 0:
                continue
            array = _values_array(values, f"tree {node.tree}, node {node.node_id}", name, TOKEN_FIELD_KINDS)
            kind_dtype = np.dtype(bool) if array.dtype.kind == "b" else np.dtype(np.int64) if array.dtype.kind in "iu" else np.dtype(np.float64)
            inferred[name] = kind_dtype if current is None else np.result_type(current, kind_dtype)
    dtypes = {}
    for name, dtype in inferred.items():
        if name in schema:
            dtypes[name] = np.dtype(schema[name])
        elif name == "loss_mask":
            dtypes[name] = np.dtype(np.float32)
        else:
            dtypes[name] = dtype if dtype is not None else np.dtype(np.float64)
    return dtypes


def _convert_node_fields(nodes: list[_Node], dtypes: Mapping[str, np.dtype]) -> None:
    for node in nodes:
        where = f"tree {node.tree}, node {node.node_id}"
        for name, values in node.raw_fields.items():
            array = _values_array(values, where, name, TOKEN_FIELD_KINDS) if len(values) else np.empty(0, dtype=dtypes[name])
            if len(array) != len(node.tokens):
                raise RolloutInputError(
                    f"{where}: field '{name}' has {len(array)} entries, expected {len(node.tokens)} (one per token in 'token_ids')"
                )
            node.fields[name] = _cast(array, dtypes[name], where, name)
            check_field_values(TOKEN_COLUMN_TO_FIELD.get(name, name), node.fields[name], where)


def _check_field_presence(nodes: list[_Node]) -> None:
    """A per-token field is on every node that has tokens or on none: a node without it would be
    read with made-up values (a mask of ones trains on tokens the user meant to mask)."""
    names = list(dict.fromkeys(name for node in nodes for name in node.raw_fields))
    for name in names:
        lacking = [node for node in nodes if name not in node.raw_fields and len(node.tokens)]
        if lacking:
            shown = "; ".join(f"tree {node.tree}, node {node.node_id}" for node in lacking[:5])
            more = f" (and {len(lacking) - 5} more)" if len(lacking) > 5 else ""
            raise RolloutInputError(
                f"{shown}{more}: missing field '{name}' that other nodes have; give '{name}' on every node with tokens or on none"
            )


def _check_tree_shapes(nodes: list[_Node]) -> dict[int, dict[int, _Node]]:
    """Group nodes by tree; reject duplicate ids, missing parents and parent cycles."""
    trees: dict[int, dict[int, _Node]] = {}
    for node in nodes:
        tree = trees.setdefault(node.tree, {})
        if node.node_id in tree:
            raise RolloutInputError(
                f"tree {node.tree}: duplicate node_id {node.node_id} (records {tree[node.node_id].record} and {node.record})"
            )
        tree[node.node_id] = node
    for tree_id, tree in trees.items():
        for node in tree.values():
            if node.parent is not None and node.parent not in tree:
                raise RolloutInputError(f"tree {tree_id}, node {node.node_id}: parent_id {node.parent} is not a node of tree {tree_id}")
        settled: set[int] = set()
        for start in tree:
            chain: list[int] = []
            on_chain: set[int] = set()
            current: int | None = start
            while current is not None and current not in settled:
                if current in on_chain:
                    cycle = chain[chain.index(current):] + [current]
                    links = " -> ".join(f"node {n}" for n in cycle)
                    raise RolloutInputError(f"tree {tree_id}: parent_id links form a cycle: {links}")
                on_chain.add(current)
                chain.append(current)
                current = tree[current].parent
            settled.update(chain)
    return trees


def _ordered_trajectories(
    trees: dict[int, dict[int, _Node]], rows: list[_TrajectoryRow]
) -> list[_TrajectoryRow]:
    with_id = [row for row in rows if row.trajectory_id is not None]
    if with_id and len(with_id) != len(rows):
        missing = next(row for row in rows if row.trajectory_id is None)
        raise RolloutInputError(
            f"{missing.label}: trajectory_id is given on some trajectory rows but not on this one (record {missing.record})"
        )
    seen: dict[int, _TrajectoryRow] = {}
    for row in with_id:
        if row.trajectory_id in seen:
            first = seen[row.trajectory_id]
            raise RolloutInputError(
                f"trajectory {row.trajectory_id}: duplicate trajectory_id (records {first.record} in tree {first.tree} and {row.record} in tree {row.tree})"
            )
        seen[row.trajectory_id] = row
    for row in rows:
        tree = trees.get(row.tree)
        if tree is None or row.leaf not in tree:
            raise RolloutInputError(f"{row.label}: leaf {row.leaf} is not a node of tree {row.tree}")
    trees_with_rows = {row.tree for row in rows}
    implied: list[_TrajectoryRow] = []
    for tree_id, tree in trees.items():
        if tree_id in trees_with_rows:
            continue
        parents = {node.parent for node in tree.values()}
        implied.extend(
            _TrajectoryRow(tree=tree_id, leaf=node_id, trajectory_id=None, fields={}, record=node.record, implied=True)
            for node_id, node in tree.items()
            if node_id not in parents
        )
    if with_id:
        return sorted(rows, key=lambda row: row.trajectory_id) + sorted(implied, key=lambda row: row.record)
    return sorted(rows + implied, key=lambda row: row.record)


def _trajectory_field_arrays(ordered: list[_TrajectoryRow], schema: Mapping[str, str]) -> dict[str, np.ndarray]:
    names: dict[str, None] = {}
    for row in ordered:
        names.update(dict.fromkeys(row.fields))
    arrays: dict[str, np.ndarray] = {}
    for name in names:
        values = []
        for row in ordered:
            if name not in row.fields:
                reason = " (its tree has no trajectory rows)" if row.implied else ""
                raise RolloutInputError(f"{row.label}: missing field '{name}' that other trajectories have{reason}")
            values.append(row.fields[name])
        array = _values_array(values, "trajectory rows", name, TRAJECTORY_FIELD_KINDS)
        if name in schema:
            array = _cast(array, np.dtype(schema[name]), "trajectory rows", name)
        arrays[name] = adopt(array)
    return arrays


@attrs.frozen
class NodeTableContents:
    """What a node table holds, in batch order: the arrays a batch is built from, and the stored hash."""

    tokens: tuple[np.ndarray, ...]
    token_fields: dict[str, tuple[np.ndarray, ...]]
    trajectory_fields: dict[str, np.ndarray]
    tree_ids: np.ndarray
    #: the schema's ``content_hash`` (None when the table records none): the built batch must match it
    content_hash: str | None


def content_hash_mismatch() -> RolloutInputError:
    return RolloutInputError(
        "node table: the contents differ from what HARTS wrote (the schema's content_hash does not match): the file "
        "is damaged, or was edited; if the edit is intended, delete 'content_hash' from the schema record"
    )


def _refuse_wider_than_the_file(schema: Mapping[str, str], file_bytes: int | None) -> None:
    """A string dtype wider than the whole file is no width a writer can have needed: casting to it would
    allocate width x entries (a 6 KB table declaring ``<U20000000`` asked for gigabytes), so it is refused."""
    if file_bytes is None:
        return
    for name, text in schema.items():
        dtype = np.dtype(text)
        if dtype.kind == "U" and dtype.itemsize // 4 > max(file_bytes, 1):
            raise RolloutInputError(
                f"schema: field '{name}' declares strings of {dtype.itemsize // 4:,} characters ({text}), more than the "
                f"whole file holds ({file_bytes:,} bytes): the schema is damaged"
            )


def _batch_from_rows(rows: Iterable[Mapping[str, Any]], build: Callable[[NodeTableContents], Batch],
                     column_dtypes: Mapping[str, np.dtype] | None = None, stored_hash: str | None = None,
                     file_bytes: int | None = None) -> Batch:
    nodes, trajectory_rows, schema, content_hash = _parse_rows(rows, column_dtypes)
    _refuse_wider_than_the_file(schema, file_bytes)
    content_hash = content_hash if content_hash is not None else stored_hash
    if not nodes:
        raise RolloutInputError("node table: no node rows, so the batch holds no trajectories")
    _check_field_presence(nodes)
    _convert_node_fields(nodes, _token_field_dtypes(nodes, schema))
    trees = _check_tree_shapes(nodes)
    ordered = _ordered_trajectories(trees, trajectory_rows)
    token_columns = list(dict.fromkeys(name for node in nodes for name in node.fields))
    for column, field in TOKEN_COLUMN_TO_FIELD.items():
        if column in token_columns and field in token_columns:
            raise RolloutInputError(f"node rows: columns '{column}' and '{field}' name the same batch field '{field}'; give one")
    column_dtypes_resolved = {name: next(n.fields[name].dtype for n in nodes if name in n.fields) for name in token_columns}
    if "loss_mask" not in column_dtypes_resolved:
        token_columns.append("loss_mask")
        column_dtypes_resolved["loss_mask"] = np.dtype(np.float32)

    tokens: list[np.ndarray] = []
    token_values: dict[str, list[np.ndarray]] = {name: [] for name in token_columns}
    for row in ordered:
        tree = trees[row.tree]
        path: list[_Node] = []
        current: int | None = row.leaf
        while current is not None:
            path.append(tree[current])
            current = tree[current].parent
        path.reverse()
        if not any(len(node.tokens) for node in path):
            raise RolloutInputError(f"{row.label}: empty trajectory (no node on the path from the root to node {row.leaf} has tokens)")
        tokens.append(np.concatenate([node.tokens for node in path]))
        for name in token_columns:
            pieces = []
            # the presence check leaves only nodes without tokens lacking a field, or a loss mask given nowhere
            pieces = [node.fields[name] if name in node.fields else np.ones(len(node.tokens), dtype=column_dtypes_resolved[name])
                      for node in path]
            token_values[name].append(adopt(np.concatenate(pieces).astype(column_dtypes_resolved[name], copy=False)))
        adopt(tokens[-1])

    batch = build(NodeTableContents(
        tokens=tuple(tokens),
        token_fields={TOKEN_COLUMN_TO_FIELD.get(name, name): tuple(values) for name, values in token_values.items()},
        trajectory_fields=_trajectory_field_arrays(ordered, schema),
        tree_ids=adopt(np.array([row.tree for row in ordered], dtype=np.int64)),
        content_hash=content_hash,
    ))
    logger.debug("node table: %d nodes in %d trees, %d trajectories", len(nodes), len(trees), len(ordered))
    return batch


def decode_node_table_records(records: Iterable[Mapping[str, Any]], build: Callable[[NodeTableContents], Batch]) -> Batch:
    """``build`` applied to the contents of in-memory node-table rows (dicts with a ``kind``, see the module docs)."""
    return _batch_from_rows(records, build)


def _read_jsonl_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise RolloutInputError(f"{path}: line {line_number} is not UTF-8 text (byte {error.start}); node tables are UTF-8 JSON Lines") from None
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise RolloutInputError(f"{path}: line {line_number} is not valid JSON ({error.msg})") from None
            except RecursionError:
                raise RolloutInputError(f"{path}: line {line_number} nests lists or objects too deeply") from None
    return rows


def _read_parquet_rows(path: Path) -> tuple[list[dict[str, Any]], dict[str, np.dtype], str | None]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError, ValueError) as error:  # Arrow raises its own types, OSError and ValueError for damaged files
        raise RolloutInputError(f"{path}: not a readable Parquet file ({_shown(str(error), 200)})") from None
    if "kind" not in table.column_names:
        raise RolloutInputError(f"{path}: missing required column 'kind'")
    metadata = table.schema.metadata or {}
    dtypes: dict[str, np.dtype] = {}
    columns: dict[str, list[Any]] = {}
    if len(set(table.column_names)) != len(table.column_names):
        raise RolloutInputError(f"{path}: a column name appears twice")
    for name in table.column_names:
        try:
            column = table.column(name).combine_chunks()
        except pa.ArrowException as error:
            raise RolloutInputError(f"{path}: column '{name}' cannot be read ({_shown(str(error), 200)})") from None
        if pa.types.is_dictionary(column.type):
            column = column.dictionary_decode()
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            values = column.values
            if values.null_count:
                raise RolloutInputError(f"{path}: column '{name}' holds null entries inside a list")
            if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type) or pa.types.is_boolean(values.type)):
                raise RolloutInputError(f"{path}: column '{name}' holds lists of {values.type}; per-token values must be numbers or booleans")
            flat = values.to_numpy(zero_copy_only=False)
            if name != "token_ids" and flat.dtype.kind in "biuf":
                dtypes[name] = flat.dtype
            offsets = column.offsets.to_numpy()
            valid = column.is_valid().to_numpy(zero_copy_only=False)
            columns[name] = [flat[offsets[i]:offsets[i + 1]] if valid[i] else None for i in range(len(column))]
        elif pa.types.is_nested(column.type):
            raise RolloutInputError(f"{path}: column '{name}' has unsupported type {column.type}")
        else:
            plain = pa.types.is_integer(column.type) or pa.types.is_floating(column.type) or pa.types.is_boolean(column.type)
            text = pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
            if not (plain or text or pa.types.is_null(column.type)):
                raise RolloutInputError(f"{path}: column '{name}' has unsupported type {column.type}")
            if name not in RESERVED_COLUMNS and plain:
                dtypes[name] = np.dtype(column.type.to_pandas_dtype())
            columns[name] = column.to_pylist()
    if PARQUET_SCHEMA_KEY in metadata:
        try:
            stored = json.loads(metadata[PARQUET_SCHEMA_KEY])
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise RolloutInputError(f"{path}: the stored HARTS schema is not valid JSON") from None
        stored_dtypes, content_hash = _parse_schema(stored, f"{path}: stored HARTS schema")
        dtypes.update({k: np.dtype(v) for k, v in stored_dtypes.items()})
    else:
        content_hash = None
    names = list(columns)
    rows = [dict(zip(names, values)) for values in zip(*(columns[n] for n in names))]
    return rows, dtypes, content_hash


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise RolloutInputError(f"{path}: unsupported node-table format '{suffix}'; use one of {', '.join(SUFFIXES)}")
    return suffix


def decode_node_table(path: str | os.PathLike[str], build: Callable[[NodeTableContents], Batch]) -> Batch:
    """Read a node table (``.jsonl`` or ``.parquet``) and return ``build`` of its contents.

    Every problem with the file or its contents, those ``build`` finds included, raises
    :class:`RolloutInputError` naming the file and the record, tree, node, trajectory or field.
    """
    path = Path(path)
    suffix = _suffix(path)
    if path.is_dir():
        raise RolloutInputError(f"{path}: is a directory, not a node-table file")
    if not path.is_file():
        raise RolloutInputError(f"{path}: no such node-table file")
    try:
        file_bytes = path.stat().st_size
        if suffix == ".jsonl":
            return _batch_from_rows(_read_jsonl_rows(path), build, file_bytes=file_bytes)
        rows, dtypes, content_hash = _read_parquet_rows(path)
        return _batch_from_rows(rows, build, dtypes, content_hash, file_bytes=file_bytes)
    except RolloutInputError as error:
        message = str(error)
        raise RolloutInputError(message if message.startswith(str(path)) else f"{path}: {message}") from None
    except OSError as error:
        raise RolloutInputError(f"{path}: cannot read the node table ({error.strerror or error})") from None
    except UnicodeDecodeError:
        raise RolloutInputError(f"{path}: holds text that is not UTF-8 (a damaged file?)") from None


# ---------------------------------------------------------------------------- writing


@attrs.define
class _RadixNode:
    owner: int  # a trajectory through the node: its arrays hold the node's values
    start: int
    end: int
    children: dict[tuple[int, ...], "_RadixNode"] = attrs.field(factory=dict)
    ending: list[int] = attrs.field(factory=list)


def _comparable(array: np.ndarray) -> np.ndarray:
    """Integers that are equal exactly when the values are bit-identical (NaN equals NaN)."""
    array = np.ascontiguousarray(array)
    if array.dtype.kind == "f":
        return array.view(f"u{array.dtype.itemsize}")
    if array.dtype.kind == "b":
        return array.view(np.uint8)
    return array


def _common_prefix(a: list[np.ndarray], a_start: int, b: list[np.ndarray], b_start: int, count: int) -> int:
    differs = np.zeros(count, dtype=bool)
    for column_a, column_b in zip(a, b):
        differs |= column_a[a_start:a_start + count] != column_b[b_start:b_start + count]
    mismatch = np.flatnonzero(differs)
    return int(mismatch[0]) if mismatch.size else count


def _position_key(columns: list[np.ndarray], position: int) -> tuple[int, ...]:
    return tuple(int(column[position]) for column in columns)


def _radix_forest(members: list[int], columns: list[list[np.ndarray]], lengths: np.ndarray) -> _RadixNode:
    """The radix forest of one tree's trajectories, keyed by (token, per-token values) per position."""
    root = _RadixNode(owner=-1, start=0, end=0)
    for trajectory in members:
        mine, length = columns[trajectory], int(lengths[trajectory])
        node, position = root, 0
        while True:
            if position == length:
                node.ending.append(trajectory)
                break
            key = _position_key(mine, position)
            child = node.children.get(key)
            if child is None:
                node.children[key] = _RadixNode(owner=trajectory, start=position, end=length, ending=[trajectory])
                break
            span = child.end - child.start
            matched = _common_prefix(mine, position, columns[child.owner], child.start, min(span, length - position))
            if matched < span:
                upper = _RadixNode(owner=child.owner, start=child.start, end=child.start + matched)
                child.start += matched
                upper.children[_position_key(columns[child.owner], child.start)] = child
                node.children[key] = upper
                child = upper
            position += matched
            node = child
    return root


def _field_columns(batch: RolloutBatch) -> tuple[dict[str, str], dict[str, str]]:
    """Batch field name -> table column name, for per-token and per-trajectory fields."""
    token_columns: dict[str, str] = {}
    for name in batch.token_fields:
        column = TOKEN_FIELD_TO_COLUMN.get(name, name)
        if column in RESERVED_COLUMNS or name in TOKEN_COLUMN_TO_FIELD:
            raise RolloutInputError(f"field '{name}': the name is reserved in node tables; rename the field")
        token_columns[name] = column
    trajectory_columns: dict[str, str] = {}
    for name in batch.trajectory_fields:
        if name in RESERVED_COLUMNS or name in TOKEN_COLUMN_TO_FIELD:
            raise RolloutInputError(f"field '{name}': the name is reserved in node tables; rename the field")
        if name in token_columns.values():
            raise RolloutInputError(f"field '{name}': used both as a per-token and as a per-trajectory field")
        trajectory_columns[name] = name
    return token_columns, trajectory_columns


def _default_tree_ids(batch: RolloutBatch) -> np.ndarray:
    tree_of_first_token: dict[int, int] = {}
    return np.array([tree_of_first_token.setdefault(int(t[0]), len(tree_of_first_token)) for t in batch.tokens], dtype=np.int64)


@attrs.define
class _Table:
    """A node table in columns ready for either file format."""

    node_tree: list[int]
    node_id: list[int]
    node_parent: list[int | None]
    node_tokens: list[np.ndarray]
    node_fields: dict[str, list[np.ndarray]]
    trajectory_tree: list[int]
    trajectory_leaf: list[int]
    trajectory_fields: dict[str, np.ndarray]
    token_dtypes: dict[str, np.dtype]
    trajectory_dtypes: dict[str, np.dtype]
    content_hash: str

    def schema_record(self) -> dict[str, Any]:
        return {
            "kind": SCHEMA_KIND,
            "version": SCHEMA_VERSION,
            "token_fields": {name: dtype.str for name, dtype in self.token_dtypes.items()},
            "trajectory_fields": {name: dtype.str for name, dtype in self.trajectory_dtypes.items()},
            "content_hash": self.content_hash,
        }


def _build_table(batch: RolloutBatch) -> _Table:
    batch.validate()
    token_columns, trajectory_columns = _field_columns(batch)
    token_dtypes: dict[str, np.dtype] = {}
    field_values: dict[str, list[np.ndarray]] = {}
    for name, column in token_columns.items():
        arrays = batch.token_fields[name]
        dtype = np.result_type(*(a.dtype for a in arrays))
        if dtype.kind not in "biuf":
            raise RolloutInputError(f"field '{name}': per-token values must be numeric, got dtype {dtype}")
        token_dtypes[column] = dtype
        field_values[column] = [np.ascontiguousarray(a, dtype=dtype) for a in arrays]
    trajectory_dtypes = {}
    for name in trajectory_columns:
        values = np.asarray(batch.trajectory_fields[name])
        if values.dtype.kind not in "biufU" or values.ndim != 1:
            raise RolloutInputError(f"field '{name}': per-trajectory values must be scalars (numbers, booleans or strings)")
        trajectory_dtypes[name] = values.dtype
    tree_ids = _default_tree_ids(batch) if batch.tree_ids is None else np.asarray(batch.tree_ids, dtype=np.int64)
    lengths = batch.lengths
    comparable = [
        [_comparable(np.asarray(batch.tokens[i], dtype=np.int64))] + [_comparable(field_values[c][i]) for c in field_values]
        for i in range(len(batch))
    ]
    members: dict[int, list[int]] = {}
    for index, tree in enumerate(tree_ids.tolist()):
        members.setdefault(tree, []).append(index)

    # the hash of the batch as it reads back: with the tree ids the table records
    read_back = batch if batch.tree_ids is not None else attrs.evolve(batch, tree_ids=tree_ids)
    table = _Table([], [], [], [], {c: [] for c in field_values}, [], [], {}, token_dtypes, trajectory_dtypes,
                   read_back.content_hash())
    leaf_of = np.zeros(len(batch), dtype=np.int64)
    for tree, tree_members in members.items():
        root = _radix_forest(tree_members, comparable, lengths)
        stack: list[tuple[_RadixNode, int | None]] = [(child, None) for child in reversed(root.children.values())]
        next_id = 0
        while stack:
            node, parent = stack.pop()
            node_id, next_id = next_id, next_id + 1
            table.node_tree.append(tree)
            table.node_id.append(node_id)
            table.node_parent.append(parent)
            table.node_tokens.append(batch.tokens[node.owner][node.start:node.end])
            for column, values in field_values.items():
                table.node_fields[column].append(values[node.owner][node.start:node.end])
            for trajectory in node.ending:
                leaf_of[trajectory] = node_id
            stack.extend((child, node_id) for child in reversed(node.children.values()))
    table.trajectory_tree = tree_ids.tolist()
    table.trajectory_leaf = leaf_of.tolist()
    table.trajectory_fields = {name: np.asarray(batch.trajectory_fields[name]) for name in trajectory_columns}
    return table


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def node_table_records(batch: RolloutBatch) -> list[dict[str, Any]]:
    """The node-table rows of a batch (schema row first), as plain Python values."""
    table = _build_table(batch)
    records: list[dict[str, Any]] = [table.schema_record()]
    for i in range(len(table.node_id)):
        record: dict[str, Any] = {
            "kind": NODE_KIND,
            "tree_id": table.node_tree[i],
            "node_id": table.node_id[i],
            "parent_id": table.node_parent[i],
            "token_ids": table.node_tokens[i].tolist(),
        }
        record.update({column: values[i].tolist() for column, values in table.node_fields.items()})
        records.append(record)
    for index in range(len(table.trajectory_tree)):
        record = {
            "kind": TRAJECTORY_KIND,
            "tree_id": table.trajectory_tree[index],
            "leaf": table.trajectory_leaf[index],
            "trajectory_id": index,
        }
        record.update({name: _plain(values[index]) for name, values in table.trajectory_fields.items()})
        records.append(record)
    return records


def _write_jsonl(records: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, separators=(",", ":")))
            handle.write("\n")


def _list_array(arrays: Sequence[np.ndarray | None], dtype: np.dtype):
    import pyarrow as pa

    lengths = np.array([0 if a is None else len(a) for a in arrays], dtype=np.int64)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    present = [a for a in arrays if a is not None]
    values = np.concatenate(present).astype(dtype, copy=False) if present else np.empty(0, dtype=dtype)
    mask = pa.array(np.array([a is None for a in arrays], dtype=bool))
    if offsets[-1] < 2**31:
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values), mask=mask)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values), mask=mask)


def _write_parquet(table: _Table, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    node_count, trajectory_count = len(table.node_id), len(table.trajectory_tree)
    no_nodes: list[None] = [None] * node_count
    no_trajectories: list[None] = [None] * trajectory_count
    columns = {
        "kind": pa.array([NODE_KIND] * node_count + [TRAJECTORY_KIND] * trajectory_count, type=pa.string()),
        "tree_id": pa.array(table.node_tree + table.trajectory_tree, type=pa.int64()),
        "node_id": pa.array(table.node_id + no_trajectories, type=pa.int64()),
        "parent_id": pa.array(table.node_parent + no_trajectories, type=pa.int64()),
        "token_ids": _list_array(table.node_tokens + no_trajectories, np.dtype(np.int64)),
    }
    for column, values in table.node_fields.items():
        columns[column] = _list_array(values + no_trajectories, table.token_dtypes[column])
    columns["leaf"] = pa.array(no_nodes + table.trajectory_leaf, type=pa.int64())
    columns["trajectory_id"] = pa.array(no_nodes + list(range(trajectory_count)), type=pa.int64())
    for name, values in table.trajectory_fields.items():
        arrow_type = pa.string() if values.dtype.kind == "U" else pa.from_numpy_dtype(values.dtype)
        columns[name] = pa.array(no_nodes + [_plain(v) for v in values], type=arrow_type)
    arrow_table = pa.table(columns)
    schema = table.schema_record()
    del schema["kind"]
    arrow_table = arrow_table.replace_schema_metadata({PARQUET_SCHEMA_KEY: json.dumps(schema).encode()})
    pq.write_table(arrow_table, path)


def write_node_table(batch: RolloutBatch, path: str | os.PathLike[str]) -> None:
    """Write ``batch`` as a node table (format from the suffix); ``harts.rollouts.read_node_table`` gives it back exactly.

    Each tree's nodes form the radix forest of its trajectories, keyed per position by the
    token and every per-token field value, so positions whose metadata differ between
    trajectories go to separate nodes. Trajectory rows carry ``trajectory_id`` = batch index.
    """
    path = Path(path)
    suffix = _suffix(path)
    if path.is_dir():
        raise OutputError(f"cannot write the node table to {path}: it is a directory")
    try:
        if suffix == ".jsonl":
            records = node_table_records(batch)
            atomic_write_with(path, lambda target: _write_jsonl(records, target))
        else:
            table = _build_table(batch)
            atomic_write_with(path, lambda target: _write_parquet(table, target))
    except OutputError:
        raise
    except OSError as error:
        raise OutputError(f"cannot write the node table to {path}: {error.strerror or error}") from error
    logger.debug("wrote node table %s (%d trajectories)", path, len(batch))
