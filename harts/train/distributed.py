"""Data parallelism of the step API on torch.distributed (paper §3.2, §4.3).

The plan assigns every microbatch to a DP replica and a slot; rank ``d`` of the process
group runs the microbatches of replica ``d`` in slot order. HARTS reduces no gradient
itself: the model's wrapper does, once per optimizer step. During gradient accumulation
the wrapper is told not to synchronise (DDP ``no_sync()``, FSDP2
``set_requires_gradient_sync(False)``), and the backward of a rank's last microbatch
reduces everything accumulated. Every replica holds K / D microbatches (the planner
guarantees it), so every rank issues the same collectives in the same order.

Both wrappers average gradients over ranks, while the step's loss terms are already divided
by whole-batch denominators; the trainer therefore scales each rank's loss by the world size
so that the average it gets back is the batch gradient. Collectives run on tensors on the
model's device, so the same code runs on gloo (CPU) and NCCL (GPU).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from harts.errors import PlanArtifactError
from harts.ir.nodes import Microbatch
from harts.train.config import TrainingError

__all__ = [
    "DP_ENGINES",
    "ProcessGroupInfo",
    "dp_engine",
    "is_megatron_wrapper",
    "gradient_sync",
    "init_from_environment",
    "replica_microbatches",
    "wrap_model",
    "wrapper_kind",
]


def wrapper_kind(model: nn.Module) -> str | None:
    """``"ddp"``, ``"megatron"`` (megatron-core's DDP), ``"fsdp2"`` (a module passed to ``fully_shard``),
    ``"fsdp1"`` or None (a plain module)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "ddp"
    if is_megatron_wrapper(model):
        return "megatron"
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        FSDPModule = ()  # noqa: N806
    if FSDPModule and isinstance(model, FSDPModule):
        return "fsdp2"
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        return "fsdp1"
    return None


def is_megatron_wrapper(model: nn.Module) -> bool:
    """Whether ``model`` is megatron-core's ``DistributedDataParallel`` (megatron is not imported for the answer)."""
    megatron = sys.modules.get("megatron.core.distributed")
    return megatron is not None and isinstance(model, megatron.DistributedDataParallel)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Forward and backward inside this context synchronise gradients only if ``enabled``.

    (megatron DDP's ``no_sync`` matters only with ``overlap_grad_reduce``: otherwise it reduces in
    ``finalize_model_grads``, after the last microbatch.)"""
    kind = wrapper_kind(model)
    if enabled or kind is None:
        yield
    elif kind == "fsdp2":
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with model.no_sync():
            yield


@attrs.frozen
class ProcessGroupInfo:
    """The data-parallel group a trainer runs in (world size 1 without torch.distributed)."""

    rank: int
    world_size: int
    group: Any = None

    @classmethod
    def of(cls, model: nn.Module, group: Any = None) -> ProcessGroupInfo:
        if not (dist.is_available() and dist.is_initialized()):
            return cls(0, 1, None)
        info = cls(dist.get_rank(group), dist.get_world_size(group), group)
        if info.world_size > 1 and wrapper_kind(model) is None:
            raise TrainingError(
                f"torch.distributed runs {info.world_size} processes but the model is not wrapped: "
                "wrap it in DistributedDataParallel or pass it to torch.distributed.fsdp.fully_shard, "
                "or gradients would never be synchronised"
            )
        return info

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place over the group (``op``: "sum" or "max"); a no-op for one process."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return tensor

    def check_same(self, value: Any, what: str) -> None:
        """Raise unless every rank passes an equal ``value`` (e.g. the plan it is about to run)."""
        if not self.distributed:
            return
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        different = [rank for rank, other in enumerate(values) if other != values[0]]
        if different:
            raise TrainingError(f"rank {different[0]} has another {what} than rank 0; every rank must run the same step")


def replica_microbatches(module, rank: int, world_size: int) -> list[Microbatch]:
    """The microbatches replica ``rank`` executes, in slot order (plans without a schedule: one replica)."""
    microbatches = module.microbatches
    if microbatches is None:
        raise PlanArtifactError(f"the plan at phase {module.phase} has no microbatches")
    if module.dp_size != world_size:
        raise TrainingError(
            f"the plan was compiled for {module.dp_size} data-parallel replica(s) (dp_size) but the process group has "
            f"{world_size} rank(s); compile with dp_size={world_size} or run with {module.dp_size} process(es)"
        )
    scheduled = all(mb.replica is not None for mb in microbatches)
    if not scheduled and world_size > 1:
        raise TrainingError("the plan assigns no DP replicas (compile it with the schedule-slots pass)")
    per_replica: dict[int, list[Microbatch]] = {}
    for mb in microbatches:
        per_replica.setdefault(mb.replica if scheduled else 0, []).append(mb)
    counts = {replica: len(per_replica.get(replica, [])) for replica in range(world_size)}
    if len(set(counts.values())) != 1:
        raise TrainingError(f"the plan gives the replicas unequal microbatch counts {counts}; each needs K / D")
    return sorted(per_replica[rank], key=lambda mb: (mb.slot if mb.slot is not None else mb.index, mb.index))


def init_from_environment() -> tuple[ProcessGroupInfo, torch.device, bool]:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1), if not joined already.

    Returns (group info, this rank's device, whether this call created the group). NCCL and
    ``cuda:LOCAL_RANK`` when CUDA is available, gloo and the CPU otherwise.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    created = False
    if world > 1 and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if cuda else "gloo")
        created = True
    if dist.is_initialized():
        info = ProcessGroupInfo(dist.get_rank(), dist.get_world_size())
    else:
        info = ProcessGroupInfo(0, 1)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return info, device, created


def wrap_model(model: nn.Module, parallel: str, device: torch.device) -> nn.Module:
    """Wrap ``model`` for data parallelism: ``"ddp"`` or ``"fsdp"`` (FSDP2: every decoder layer, then the root).

    MoE models route rows to different experts on different ranks: DDP then looks for
    unused parameters, and FSDP2 reduce-scatters zeros for them, so that every rank joins
    every reduction.
    """
    has_moe = getattr(getattr(model, "config", None), "num_moe_layers", 0) > 0
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=has_moe)
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in getattr(model, "layers", ()):
            fully_shard(layer)
        fully_shard(model)
        if has_moe and hasattr(model, "set_reduce_scatter_unused_params"):
            model.set_reduce_scatter_unused_params(True)
        return model
    raise TrainingError(f"parallel must be 'ddp' or 'fsdp', got {parallel!r}")


# ---------------------------------------------------------------- which data-parallel engine

#: ``torch``: torch DDP / FSDP2 and a torch optimizer; ``megatron``: megatron-core's DDP,
#: ``finalize_model_grads`` and distributed optimizer (harts.parallel.optim; CUDA only).
DP_ENGINES = ("torch", "megatron")


def refuse_megatron_off_cuda(device: torch.device, source: str) -> None:
    """A :class:`TrainingError` naming ``source`` unless ``device`` is a CUDA device (see harts.parallel.optim for why)."""
    if torch.device(device).type != "cuda":
        raise TrainingError(
            f"{source}: megatron-core's DistributedDataParallel and distributed optimizer run on CUDA only (their "
            f"gradient buffers, streams and norm tensors are allocated on torch.cuda.current_device()); this run is on "
            f"{torch.device(device)}. Use --dp-engine torch (torch DDP over megatron's data-parallel group) on the CPU"
        )


def dp_engine(engine: str | None, *, tp: int, ep: int, device: torch.device, source: str = "option --dp-engine") -> str:
    """The run's data-parallel engine: ``engine``, or by default ``megatron`` for a megatron-core layout
    (``--tp`` / ``--ep`` > 1) on CUDA and ``torch`` otherwise. ``megatron`` off CUDA is refused here,
    before megatron-core is imported."""
    if engine is None:
        return "megatron" if (tp > 1 or ep > 1) and torch.device(device).type == "cuda" else "torch"
    if engine not in DP_ENGINES:
        raise TrainingError(f"{source} must be one of {', '.join(DP_ENGINES)}, got {engine!r}")
    if engine == "megatron":
        refuse_megatron_off_cuda(device, f"{source} megatron")
    return engine
