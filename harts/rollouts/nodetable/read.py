"""Reading node tables (JSON Lines or Parquet, or records in memory): strict parsing into a batch."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Callable, TypeVar

import attrs
import numpy as np

from harts.rollouts.fields import TOKEN_FIELD_KINDS, TRAJECTORY_FIELD_KINDS, adopt, check_field_values
from harts.errors import RolloutInputError
from harts.rollouts.nodetable.schema import (
    NODE_COLUMNS,
    NODE_KIND,
    PARQUET_SCHEMA_KEY,
    RESERVED_COLUMNS,
    SCHEMA_KIND,
    SUFFIXES,
    TOKEN_COLUMN_TO_FIELD,
    TRAJECTORY_COLUMNS,
    TRAJECTORY_KIND,
    _cast,
    _integer,
    _is_list,
    _parse_schema,
    _shown,
    _token_array,
    _values_array,
)

Batch = TypeVar("Batch")

logger = logging.getLogger(__name__)


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
