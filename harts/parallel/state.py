"""The process groups of a megatron-core run: tensor-, data- (and expert-) parallel ranks.

HARTS' plan replicas (``dp_size``, paper §3.2) are megatron-core's data-parallel ranks: with
``WORLD = TP x DP`` processes, the ranks of one tensor-parallel group run the same
microbatches (one plan on every TP rank) and each DP rank the microbatches of its replica.

Expert parallelism (``EP``, dividing the world) splits each MoE layer's experts over
megatron's expert-parallel group; expert tensor parallelism is 1 (an expert is whole on its
rank), so the expert-parallel group is ``EP`` consecutive ranks (it may span tensor-parallel
and data-parallel ranks) and the ``WORLD / EP`` ranks holding the same experts form the
expert-data-parallel group, over which expert gradients are summed.
"""

from __future__ import annotations

import attrs
import torch.distributed as dist

from harts.errors import HartsError

__all__ = ["ParallelLayout", "initialize", "layout"]


@attrs.frozen
class ParallelLayout:
    """This process's place in the megatron-core layout, and its groups."""

    tensor_parallel_size: int
    tensor_parallel_rank: int
    data_parallel_size: int
    data_parallel_rank: int
    expert_parallel_size: int
    tensor_parallel_group: object = attrs.field(repr=False)
    data_parallel_group: object = attrs.field(repr=False)
    expert_parallel_rank: int = 0
    expert_parallel_group: object = attrs.field(default=None, repr=False)
    expert_data_parallel_group: object = attrs.field(default=None, repr=False)


def layout() -> ParallelLayout:
    """The layout megatron-core's ``parallel_state`` holds (after :func:`initialize`)."""
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        tensor_parallel_size=ps.get_tensor_model_parallel_world_size(),
        tensor_parallel_rank=ps.get_tensor_model_parallel_rank(),
        data_parallel_size=ps.get_data_parallel_world_size(),
        data_parallel_rank=ps.get_data_parallel_rank(),
        expert_parallel_size=ps.get_expert_model_parallel_world_size(),
        tensor_parallel_group=ps.get_tensor_model_parallel_group(),
        data_parallel_group=ps.get_data_parallel_group(),
        expert_parallel_rank=ps.get_expert_model_parallel_rank(),
        expert_parallel_group=ps.get_expert_model_parallel_group(),
        expert_data_parallel_group=ps.get_expert_data_parallel_group(with_gtp_remat=False),
    )


def initialize(tensor_parallel: int = 1, expert_parallel: int = 1) -> ParallelLayout:
    """megatron-core's model-parallel groups over the initialised torch.distributed world (idempotent)."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise HartsError("--tp / --ep need torch.distributed: launch with torchrun (e.g. torchrun --nproc-per-node 2 -m harts train ...)")
    world = dist.get_world_size()
    for option, value in (("--tp", tensor_parallel), ("--ep", expert_parallel)):
        if not isinstance(value, int) or value < 1:
            raise HartsError(f"option '{option}' must be a positive int, got {value!r}")
    if world % tensor_parallel:
        raise HartsError(f"option '--tp' = {tensor_parallel} does not divide the {world} process(es)")
    if world % expert_parallel:
        raise HartsError(f"option '--ep' = {expert_parallel} does not divide the {world} process(es)")
    if ps.model_parallel_is_initialized():
        current = layout()
        if (current.tensor_parallel_size, current.expert_parallel_size) != (tensor_parallel, expert_parallel):
            raise HartsError(
                f"megatron-core is already initialised with TP={current.tensor_parallel_size}, "
                f"EP={current.expert_parallel_size}; asked for TP={tensor_parallel}, EP={expert_parallel}"
            )
        return current
    ps.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel, expert_model_parallel_size=expert_parallel,
                                 expert_tensor_parallel_size=1)
    return layout()
