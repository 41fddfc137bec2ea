"""Sequence-parallel row collectives over the tensor-parallel group, on any device.

megatron-core's sequence-parallel mappings (``gather_from_sequence_parallel_region``,
``reduce_scatter_to_sequence_parallel_region``) allocate their output with
``torch.cuda.current_device()``, so they cannot run on the CPU (gloo) where HARTS' multi-rank
tests run. These three autograd functions are the same collectives with the output on the
input's device; they split along dim 0, the compact-row dim. Rows must divide by the group
size (:func:`padded_rows`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["gather_rows", "padded_rows", "reduce_scatter_rows", "scatter_rows"]


def padded_rows(rows: int, group_size: int) -> int:
    """The row count sequence parallelism runs on: ``rows`` rounded up to a multiple of the group size."""
    return -(-rows // group_size) * group_size


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * size, *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


def _local_rows(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    return x.chunk(size, dim=0)[dist.get_rank(group)].contiguous()


class _GatherRows(torch.autograd.Function):
    """Forward all-gather of every rank's rows; backward reduce-scatter of the (partial) gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatterRows(torch.autograd.Function):
    """Forward sum over ranks, each keeping its rows; backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group), None


class _ScatterRows(torch.autograd.Function):
    """Forward: this rank's rows of a tensor every rank holds whole; backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _local_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group), None


def gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """[R / TP, ...] on each rank -> [R, ...] on every rank; gradients summed back per rank's rows."""
    return _GatherRows.apply(x, group)


def reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Partial sums [R, ...] on each rank -> this rank's rows [R / TP, ...] of their sum."""
    return _ReduceScatterRows.apply(x, group)


def scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """A replicated [R, ...] -> this rank's rows [R / TP, ...]."""
    return _ScatterRows.apply(x, group)
