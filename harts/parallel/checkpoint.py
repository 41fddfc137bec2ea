"""Checkpoints of a tensor-parallel model in the single-process HybridModel / Hugging Face layout.

Shards are all-gathered (every rank of the tensor-parallel group takes part), then one rank
writes, so a model trained at TP = T loads back at any TP (``TensorParallelHybridModel.from_model``
of the loaded model) or in transformers.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from harts.models.checkpoint import save_pretrained as save_hybrid_pretrained
from harts.parallel.model import TensorParallelHybridModel

__all__ = ["save_pretrained"]


def save_pretrained(model: TensorParallelHybridModel | torch.nn.Module, directory: str | os.PathLike[str], *, writer_rank: int = 0,
                    **options) -> Path:
    """Gather ``model`` and write it with :func:`harts.models.save_pretrained` on global rank ``writer_rank``.

    Collective over the tensor-parallel group; every rank returns the directory. Ranks of other
    data-parallel replicas hold the same weights; only ``writer_rank`` writes, and the others
    wait for it, so that no rank reads a half-written directory.
    """
    from harts.runtime.api import unwrap_model

    whole = unwrap_model(model).to_hybrid_model()  # the shard itself, or inside torch's or megatron-core's DDP
    directory = Path(directory)
    if not dist.is_initialized() or dist.get_rank() == writer_rank:
        save_hybrid_pretrained(whole, directory, **options)
    if dist.is_initialized():
        dist.barrier()
    return directory
