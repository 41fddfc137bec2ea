"""Routed SwiGLU experts as grouped GEMMs over expert-sorted rows (fast MoE path).

Same signature and math as :func:`harts.kernels.moe.naive.moe_experts` (HF 3-D expert weights
``gate_up_proj`` [E, 2I, D] and ``down_proj`` [E, D, I])::

    out[c] = sum_j weights[c, j] * down_e(silu(gate_e(x_c)) * up_e(x_c)),   e = indices[c, j]

The (row, slot) assignments are sorted by expert once, so each expert owns one contiguous
segment of the gathered rows; the two projections then run as one grouped GEMM each
(``torch._grouped_mm`` with per-expert row offsets) on CUDA in bf16 where PyTorch provides
it (segment ends found by a search in the sorted expert ids, no host sync), otherwise as one
matmul per non-empty segment (one host sync for the segment sizes, instead of the reference's
per-expert ``where``). Results return to (row, slot) order by a
gather and are combined with the routing weights in fp32; no atomic adds, so reruns are
bitwise identical. Each compact row is routed and computed once (paper §4.2).

Backward of the two row movements, where the row-sum kernel runs (CUDA with Triton, or the
interpreter): autograd's ``index_select`` backward is an ``index_add_`` of bf16 atomics, which
took 0.16 s of a 2.8 s headline pass on an H200 for what is a fixed, known pattern. Every row
is read exactly k times into the expert-sorted rows, so its gradient is the fp32 sum of those k
positions (:func:`~harts.kernels.rows.segment_sum.segment_sum`, one pass, no atomics), and the
return to (row, slot) order is a permutation, whose gradient is the inverse permutation's gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..rows.segment_sum import segment_sum, segment_sum_available

__all__ = ["grouped_mm_available", "moe_experts"]


class _ExpertSortedRows(torch.autograd.Function):
    """x [C, D] -> x[source_rows] [C*k, D]; each row's gradient is the sum of its k reads, which sit at
    ``read_positions[c*k : (c+1)*k]`` (the inverse of the expert sort)."""

    @staticmethod
    def forward(ctx, x, source_rows, read_positions, top_k):
        ctx.save_for_backward(read_positions)
        ctx.top_k, ctx.num_rows = top_k, x.shape[0]
        return x.index_select(0, source_rows)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (read_positions,) = ctx.saved_tensors
        offsets = torch.arange(0, ctx.num_rows * ctx.top_k + 1, ctx.top_k, device=grad.device)
        return segment_sum(grad, offsets, read_positions, ctx.num_rows), None, None, None


class _Permuted(torch.autograd.Function):
    """y [N, ...] -> y[permutation]; the gradient is the gather by the inverse permutation."""

    @staticmethod
    def forward(ctx, y, permutation, inverse):
        ctx.save_for_backward(inverse)
        return y.index_select(0, permutation)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can run these rows (CUDA, bf16, Hopper or newer)."""
    if not (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16):
        return False
    major, _minor = torch.cuda.get_device_capability(x.device)
    return major >= 9


def _segment_matmuls(rows: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """rows [R, D] sorted by expert, weights [E, D, N] -> [R, N], one matmul per non-empty segment."""
    pieces, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            pieces.append(rows[start : start + count] @ weights[expert])
            start += count
    if not pieces:
        return rows.new_zeros(0, weights.shape[-1])
    return torch.cat(pieces)


def moe_experts(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """x [C, D], indices/weights [C, k], gate_up_proj [E, 2I, D], down_proj [E, D, I] -> [C, D]."""
    rows, top_k = indices.shape
    num_experts = gate_up_proj.shape[0]
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    read_positions = torch.argsort(order)  # where (row, slot) c*k + j sits among the expert-sorted rows
    source_rows = torch.div(order, top_k, rounding_mode="floor")
    known_backward = segment_sum_available(x)
    if known_backward:
        gathered = _ExpertSortedRows.apply(x, source_rows, read_positions, top_k)  # [C*k, D] grouped by expert
    else:
        gathered = x.index_select(0, source_rows)
    gate_up_t = gate_up_proj.transpose(1, 2)  # [E, D, 2I]
    down_t = down_proj.transpose(1, 2)  # [E, I, D]
    if grouped_mm_available(x):
        # each expert's segment end, found in the sorted ids: bincount would read the largest id
        # on the host, a sync per layer that drains the GPU's queue
        sorted_experts = flat.index_select(0, order)
        ends = torch.arange(1, num_experts + 1, device=flat.device, dtype=flat.dtype)
        offsets = torch.searchsorted(sorted_experts, ends).to(torch.int32)
        hidden = torch._grouped_mm(gathered, gate_up_t.to(x.dtype), offs=offsets)
        gate, up = hidden.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, down_t.to(x.dtype), offs=offsets)
    else:
        sizes = torch.bincount(flat, minlength=num_experts).tolist()
        gate, up = _segment_matmuls(gathered, gate_up_t.to(x.dtype), sizes).chunk(2, dim=-1)
        y = _segment_matmuls(F.silu(gate) * up, down_t.to(x.dtype), sizes)
    # back to (row, slot) order by a gather (no atomics: deterministic), then the weighted sum
    # over the k slots in fp32
    unsorted = (_Permuted.apply(y, read_positions, order) if known_backward else y.index_select(0, read_positions))
    unsorted = unsorted.view(rows, top_k, -1)
    combined = (unsorted.float() * weights.float().unsqueeze(-1)).sum(dim=1)
    return combined.to(x.dtype)
