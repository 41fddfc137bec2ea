"""Reference row movement: plain ``index_select`` / ``cat``, differentiated by autograd.

:func:`gather_rows` packs rows of one source into several outputs (a plan's rounds, or one key /
value view); :func:`scatter_rows` assembles a compact tensor from pieces of several packed
outputs, each compact row taken from exactly one of them. :mod:`.packed` has the same results
with a cheaper backward; :func:`segment_sum_reference` is the reference of
:func:`harts.kernels.rows.segment_sum.segment_sum`, the per-row gradient sum of a gather.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["gather_rows", "scatter_rows", "segment_sum_reference"]


def gather_rows(x: torch.Tensor, rows: Sequence[np.ndarray]) -> tuple[torch.Tensor, ...]:
    """x [C, ...], rows: one int array per output -> (x[rows_0], x[rows_1], ...)."""
    return tuple(x.index_select(0, torch.tensor(np.asarray(r, dtype=np.int64), device=x.device)) for r in rows)


def scatter_rows(
    packed: Sequence[torch.Tensor], destinations: Sequence[np.ndarray], positions: Sequence[np.ndarray], num_rows: int
) -> torch.Tensor:
    """y [num_rows, ...] with ``y[destinations[i]] = packed[i][positions[i]]``; the destinations tile the rows."""
    pieces, order = [], []
    for tensor, dst, pos in zip(packed, destinations, positions):
        pieces.append(tensor.index_select(0, torch.tensor(np.asarray(pos, dtype=np.int64), device=tensor.device)))
        order.append(np.asarray(dst, dtype=np.int64))
    stacked = torch.cat(pieces)
    where = np.concatenate(order) if order else np.zeros(0, dtype=np.int64)
    if sorted(where.tolist()) != list(range(num_rows)):
        raise ValueError(f"the destinations must name each of the {num_rows} rows exactly once")
    inverse = np.empty_like(where)
    inverse[where] = np.arange(where.size)
    return stacked.index_select(0, torch.as_tensor(inverse, device=stacked.device))


def segment_sum_reference(grad: torch.Tensor, offsets: torch.Tensor, positions: torch.Tensor, num_rows: int,
                          base: torch.Tensor | None = None) -> torch.Tensor:
    """grad [N, ...] -> [num_rows, ...]: row r sums ``grad[positions[offsets[r]:offsets[r+1]]]`` in fp32 (at least),
    starting from ``base[r]`` when given (written back into ``base``)."""
    counts = (offsets[1:] - offsets[:-1]).to(torch.long)
    owner = torch.repeat_interleave(torch.arange(num_rows, device=grad.device), counts)  # [N]
    dtype = torch.promote_types(grad.dtype, torch.float32)
    if base is None:
        out = torch.zeros((num_rows, *grad.shape[1:]), dtype=dtype, device=grad.device)
    else:
        out = base.to(dtype)
    out.index_add_(0, owner, grad.index_select(0, positions.to(torch.long)).to(dtype))
    if base is None:
        return out.to(grad.dtype)
    return base.copy_(out)
