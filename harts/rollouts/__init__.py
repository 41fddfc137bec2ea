"""Rollout data: the batch of one training step, its fields, the node-table format and named inputs.

    batch = harts.RolloutBatch.from_trajectories(token_lists, loss_mask=..., advantages=...)
    batch = harts.rollouts.read_node_table("rollouts.jsonl")     # or RolloutBatch.read(path)
    batch.write("rollouts.parquet")                              # atomic; read back exactly
    batch = harts.rollouts.resolve_input("swe-like:seed=3")      # a node table path or a preset

* :mod:`harts.rollouts.batch`: :class:`RolloutBatch` and the node-table readers;
* :mod:`harts.rollouts.fields`: field values, checks and ownership of the arrays a batch holds;
* :mod:`harts.rollouts.nodetable`: the node-table codec (JSON Lines / Parquet);
* :mod:`harts.rollouts.inputs`: inputs named on the command line (node tables and presets);
* :mod:`harts.rollouts.workloads`: the generators behind the presets (SWE-like steps, GRPO groups, ...).
"""

from harts.rollouts.batch import NODE_TABLE, RolloutBatch, read_node_table, read_node_table_records, write_node_table
from harts.rollouts.inputs import Preset, demo_batch, presets, resolve_input
from harts.rollouts.nodetable import PARQUET_SCHEMA_KEY, SUFFIXES, node_table_records

__all__ = [
    "NODE_TABLE",
    "PARQUET_SCHEMA_KEY",
    "SUFFIXES",
    "Preset",
    "RolloutBatch",
    "demo_batch",
    "node_table_records",
    "presets",
    "read_node_table",
    "read_node_table_records",
    "resolve_input",
    "write_node_table",
]
