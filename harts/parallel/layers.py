"""megatron-core tensor-parallel projections and the per-rank layers of a HybridModel.

A rank's layer is the native layer of :mod:`harts.runtime.layers` built at ``1 / TP`` of the
heads (linear-attention key and value heads, attention heads, the FFN's intermediate
channels), with its projections replaced by megatron-core's tensor-parallel linears. The
math is therefore the native code itself, per local head; only the layout is megatron's:

* a *column* projection (``ColumnParallelLinear``) maps rows every rank holds whole to this
  rank's heads. Its input comes from one row gather per block (as megatron's fused QKV
  gathers once), so it does no input-gradient all-reduce of its own (``disable_grad_reduce``):
  the gather's backward reduce-scatter sums the ranks' partial gradients;
* a *row* projection (``RowParallelLinear``) maps this rank's heads back to the model width;
  the ranks' partial sums are reduce-scattered over rows (sequence parallelism), and its bias,
  if any, is added to this rank's rows only;
* the low-rank down projections whose output all heads share (KDA's ``f_a_proj``/``g_a_proj``,
  MLA's ``q_a_proj``/``kv_a_proj_with_mqa``) stay replicated ``nn.Linear`` (megatron's
  "duplicated" mode), as do norms over a head's dims.

Every replicated parameter then gets from each rank only the gradient of its local heads or
rows; :meth:`TensorParallelHybridModel.finalize_gradients` sums them over the group, as
megatron's ``finalize_model_grads`` does for sequence-parallel norms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import nn

from harts.parallel.mappings import padded_rows, reduce_scatter_rows

__all__ = ["COLUMN_PROJECTIONS", "ROW_PROJECTIONS", "ColumnProjection", "RowProjection", "to_megatron_projections"]

#: Leaf names of the projections that split their outputs by head (or FFN channel).
COLUMN_PROJECTIONS = frozenset({
    "in_proj_qkvz", "in_proj_ba", "q_proj", "k_proj", "v_proj", "b_proj", "f_b_proj", "g_b_proj",
    "q_b_proj", "kv_b_proj", "gate_proj", "up_proj",
})
#: Leaf names of the projections that read split heads and write the model width.
ROW_PROJECTIONS = frozenset({"out_proj", "o_proj", "down_proj"})


def keep_uninitialised(weight: torch.Tensor) -> None:
    """Weights are loaded from a single-process model's state dict (see ``TensorParallelHybridModel.from_model``)."""


class ColumnProjection(ColumnParallelLinear):
    """``ColumnParallelLinear`` on rows every rank holds, returning only its output ``[rows, out / TP]``."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, config, group):
        super().__init__(in_features, out_features, config=config, init_method=keep_uninitialised, bias=bias,
                         gather_output=False, disable_grad_reduce=True, tp_group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        output, _ = super().forward(x)
        return output


class RowProjection(RowParallelLinear):
    """``RowParallelLinear`` from this rank's heads to this rank's rows: ``[R, in / TP]`` -> ``[R' / TP, out]``.

    R' is R padded to a multiple of TP (padding rows are zero before the bias). megatron's own
    sequence-parallel reduce-scatter allocates on CUDA, so the sum goes through
    :func:`~harts.parallel.mappings.reduce_scatter_rows`.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, config, group):
        super().__init__(in_features, out_features, config=config, init_method=keep_uninitialised, bias=bias,
                         input_is_parallel=True, skip_bias_add=True, tp_group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        partial = self._forward_impl(
            input=x, weight=self.weight, bias=None, gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=False, sequence_parallel=False, tp_group=None, grad_output_buffer=None,
            gtp_remat_size=self.gtp_remat_size,
        )
        size = self.tp_group.size()
        rows = x.shape[0]
        if padded_rows(rows, size) != rows:
            partial = F.pad(partial, (0, 0, 0, padded_rows(rows, size) - rows))
        output = reduce_scatter_rows(partial, self.tp_group)
        return output if self.bias is None else output + self.bias


def to_megatron_projections(module: nn.Module, config, group) -> nn.Module:
    """Replace, in place, every column / row projection ``nn.Linear`` under ``module`` by megatron's.

    ``module`` is a native layer built at the local head count, so each ``nn.Linear``'s shape
    already is this rank's shard; the full in / out width is recovered from the group size.
    """
    size = group.size()
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and name in COLUMN_PROJECTIONS:
            replacement = ColumnProjection(child.in_features, child.out_features * size, bias=child.bias is not None,
                                           config=config, group=group)
        elif isinstance(child, nn.Linear) and name in ROW_PROJECTIONS:
            replacement = RowProjection(child.in_features * size, child.out_features, bias=child.bias is not None,
                                        config=config, group=group)
        else:
            to_megatron_projections(child, config, group)
            continue
        setattr(module, name, replacement)
    return module
