"""Writing node tables: a batch's trees recovered as radix forests, written atomically."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from harts.errors import OutputError, RolloutInputError
from harts.fsio import atomic_write_with
from harts.rollouts.nodetable.read import _suffix
from harts.rollouts.nodetable.schema import (
    NODE_KIND,
    PARQUET_SCHEMA_KEY,
    RESERVED_COLUMNS,
    SCHEMA_KIND,
    SCHEMA_VERSION,
    TOKEN_COLUMN_TO_FIELD,
    TOKEN_FIELD_TO_COLUMN,
    TRAJECTORY_KIND,
)

if TYPE_CHECKING:  # the writers read a batch's attributes
    from harts.rollouts.batch import RolloutBatch

logger = logging.getLogger(__name__)


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
