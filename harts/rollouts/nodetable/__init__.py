"""Node tables: rollout trees on disk (JSON Lines or Parquet) and in memory.

Three modules: :mod:`.schema` (the format: row kinds, columns, the schema row, dtype rules),
:mod:`.read` (strict parsing) and :mod:`.write` (a batch back to its trees, atomically).

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

from harts.rollouts.nodetable.read import NodeTableContents, content_hash_mismatch, decode_node_table, decode_node_table_records
from harts.rollouts.nodetable.schema import (
    NODE_COLUMNS,
    NODE_KIND,
    PARQUET_SCHEMA_KEY,
    RESERVED_COLUMNS,
    SCHEMA_KIND,
    SCHEMA_VERSION,
    SUFFIXES,
    TRAJECTORY_COLUMNS,
    TRAJECTORY_KIND,
)
from harts.rollouts.nodetable.write import node_table_records, write_node_table

__all__ = [
    "NODE_COLUMNS",
    "NODE_KIND",
    "PARQUET_SCHEMA_KEY",
    "RESERVED_COLUMNS",
    "SCHEMA_KIND",
    "SCHEMA_VERSION",
    "SUFFIXES",
    "TRAJECTORY_COLUMNS",
    "TRAJECTORY_KIND",
    "NodeTableContents",
    "content_hash_mismatch",
    "decode_node_table",
    "decode_node_table_records",
    "node_table_records",
    "write_node_table",
]
