"""Lowering: a :class:`~harts.RolloutBatch` becomes a ``lowered`` IR module."""

from __future__ import annotations

from harts.batch import RolloutBatch
from harts.errors import PipelineError
from harts.ir.nodes import Module, Phase, Trajectory


def lower(batch: RolloutBatch, *, capacity: int = 65536, dp_size: int = 1, chunk_size: int = 64) -> Module:
    for name, value in (("capacity", capacity), ("dp_size", dp_size), ("chunk_size", chunk_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PipelineError(f"option '{name}' must be a positive integer, got {value!r}")
    tree_ids = batch.tree_ids
    trajectories = tuple(
        Trajectory(index=i, tree=int(tree_ids[i]), length=len(tokens)) for i, tokens in enumerate(batch.tokens)
    )
    return Module(
        phase=Phase.LOWERED,
        input_hash=batch.content_hash(),
        capacity=capacity,
        dp_size=dp_size,
        chunk_size=chunk_size,
        trajectories=trajectories,
    )
