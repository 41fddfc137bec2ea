"""``lower``: a :class:`~harts.RolloutBatch` becomes a ``lowered`` IR module.

The first pass of every pipeline: it records each trajectory's tree and length, the batch's
content hash (tokens stay in the batch) and the compile options every later pass plans for.
"""

from __future__ import annotations

import attrs

from harts.rollouts.batch import RolloutBatch
from harts.errors import PipelineError
from harts.ir.nodes import Module, Phase, Trajectory
from harts.options import DEFAULT_OPTIONS, CompileOptions
from harts.passes.base import Pass, PassContext
from harts.passes.registry import builtin_pass


def lower_batch(batch: RolloutBatch, options: CompileOptions) -> Module:
    tree_ids = batch.tree_ids
    trajectories = tuple(
        Trajectory(index=i, tree=int(tree_ids[i]), length=len(tokens)) for i, tokens in enumerate(batch.tokens)
    )
    return Module(
        phase=Phase.LOWERED,
        input_hash=batch.input_hash(),
        capacity=options.capacity,
        dp_size=options.dp_size,
        chunk_size=options.chunk_size,
        trajectories=trajectories,
    )


def lower(
    batch: RolloutBatch,
    *,
    capacity: int = DEFAULT_OPTIONS.capacity,
    dp_size: int = DEFAULT_OPTIONS.dp_size,
    chunk_size: int = DEFAULT_OPTIONS.chunk_size,
) -> Module:
    """Lower ``batch`` for the given targets (checked by :class:`~harts.options.CompileOptions`)."""
    return lower_batch(batch, CompileOptions(capacity=capacity, dp_size=dp_size, chunk_size=chunk_size))


@builtin_pass("lower")
@attrs.frozen
class Lower(Pass):
    def run(self, module: None, ctx: PassContext) -> Module:
        if not isinstance(ctx.batch, RolloutBatch):
            raise PipelineError(f"pass 'lower' needs the rollout batch in the pass context, got {type(ctx.batch).__name__}")
        return lower_batch(ctx.batch, ctx.options)
