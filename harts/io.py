"""Node tables, the on-disk form of a rollout batch: read and write them.

The format (``"node"``, ``"trajectory"`` and ``"schema"`` rows, JSON Lines or Parquet, strict
reading, atomic writes) is specified in :mod:`harts.nodetable`, which holds the codec; this
module gives it the batch type, so that the codec never imports :mod:`harts.batch` and the
batch never imports this module.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from harts.batch import RolloutBatch
from harts.nodetable import PARQUET_SCHEMA_KEY, SUFFIXES, node_table_records, write_node_table

__all__ = ["PARQUET_SCHEMA_KEY", "SUFFIXES", "node_table_records", "read_node_table", "read_node_table_records",
           "write_node_table"]


def read_node_table(path: str | os.PathLike[str]) -> RolloutBatch:
    """Read a node table (``.jsonl`` or ``.parquet``) into a :class:`RolloutBatch`.

    Every problem with the file or its contents raises :class:`~harts.errors.RolloutInputError`
    naming the file and the record, tree, node, trajectory or field.
    """
    return RolloutBatch.read(path)


def read_node_table_records(records: Iterable[Mapping[str, Any]]) -> RolloutBatch:
    """Build a batch from in-memory node-table rows (dicts with a ``kind``, see :mod:`harts.nodetable`)."""
    return RolloutBatch.from_node_table_records(records)
