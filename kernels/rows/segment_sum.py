"""Deterministic per-row gradient sums of a gather, in one Triton launch (GPU).

The backward of ``y = x[rows]`` is ``dx[r] = sum of dy[p] over the positions p with rows[p] = r``.
Where rows repeat heavily, as in an attention key/value view where every branch re-reads its
whole shared prefix (the headline plan: 184,284 view rows over 34,395 compact rows, a prompt
row read up to 46 times), PyTorch's ``index_add_`` runs atomic bf16 adds that collide on the
same rows and ran at a fraction of memory bandwidth. Here the positions are sorted by the row
they read once, when the layout is built (``offsets``/``positions``, CSR), so one program per
row and column block reads its rows' gradients, sums them in fp32 and writes the row once:
no atomics, no zero fill, each input read once, and the same bits on every run.

:func:`harts.kernels.rows.naive.segment_sum_reference` is the pure-torch reference. On CPU the
kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``), which is how CI holds it to
the reference.
"""

from __future__ import annotations

import numpy as np
import torch

# Triton is optional on CPU machines; the state kernels' module already imports it or not
from ..linear_attention.state import TRITON_AVAILABLE, interpreter_enabled, tl, triton

__all__ = ["TRITON_AVAILABLE", "csr_by_row", "segment_sum", "segment_sum_available"]

#: Columns one program sums (a power of two); wider rows take several column blocks.
MAX_BLOCK_COLUMNS = 1024


def csr_by_row(rows: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [num_rows + 1], positions [len(rows)]): the positions of ``rows`` grouped by the row
    they name, ascending within each row, so row r's positions are ``positions[offsets[r]:offsets[r+1]]``."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    positions = np.argsort(rows, kind="stable")
    offsets = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=num_rows), out=offsets[1:])
    return offsets, positions


def segment_sum_available(grad: torch.Tensor) -> bool:
    """Whether :func:`segment_sum` can run this gradient: Triton present, and CUDA or the interpreter."""
    return TRITON_AVAILABLE and (grad.is_cuda or (interpreter_enabled() and grad.device.type == "cpu"))


if TRITON_AVAILABLE:

    @triton.jit
    def _segment_sum_kernel(grad, out, base, offsets, positions, width, HAS_BASE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = columns < width
        start = tl.load(offsets + row)
        end = tl.load(offsets + row + 1)
        if HAS_BASE:
            total = tl.load(base + row.to(tl.int64) * width + columns, mask=inside, other=0.0).to(tl.float32)
        else:
            total = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(start, end):
            position = tl.load(positions + j).to(tl.int64)
            total += tl.load(grad + position * width + columns, mask=inside, other=0.0).to(tl.float32)
        tl.store(out + row.to(tl.int64) * width + columns, total.to(out.dtype.element_ty), mask=inside)


def segment_sum(grad: torch.Tensor, offsets: torch.Tensor, positions: torch.Tensor, num_rows: int,
                base: torch.Tensor | None = None) -> torch.Tensor:
    """grad [N, ...] -> [num_rows, ...] with row r = the fp32 sum of ``grad[positions[offsets[r]:offsets[r+1]]]``.

    ``offsets`` [num_rows + 1] and ``positions`` [N] (int64, on grad's device) come from
    :func:`csr_by_row`; rows with no positions come back zero. With ``base`` ([num_rows, ...], grad's dtype)
    each row's sum starts from that row of ``base`` (in the same fp32 sum), and the result is written into
    ``base``: a gradient that already holds other terms takes the gather's in one pass, with no full-size add.
    """
    if not TRITON_AVAILABLE:
        raise RuntimeError("segment_sum needs Triton")
    if offsets.numel() != num_rows + 1 or positions.numel() != grad.shape[0]:
        raise ValueError(f"segment_sum: {offsets.numel()} offsets and {positions.numel()} positions "
                         f"for {num_rows} rows and a gradient of {grad.shape[0]}")
    flat = grad.contiguous().view(grad.shape[0], -1)  # [N, W]
    width = flat.shape[1]
    if base is not None:
        if base.shape != (num_rows, *grad.shape[1:]) or base.dtype != grad.dtype or not base.is_contiguous():
            raise ValueError(f"segment_sum: base must be a contiguous {grad.dtype} tensor of shape "
                             f"{(num_rows, *grad.shape[1:])}, got {base.dtype} {tuple(base.shape)}")
        out = base.view(num_rows, width)  # each program reads its row of base before it writes it
    else:
        out = flat.new_empty((num_rows, width))  # [num_rows, W]
    if num_rows and width:
        block = min(MAX_BLOCK_COLUMNS, triton.next_power_of_2(width))
        grid = (num_rows, triton.cdiv(width, block))
        _segment_sum_kernel[grid](flat, out, out, offsets, positions, width, HAS_BASE=base is not None, BLOCK=block,
                                  num_warps=4)
    return out.view(num_rows, *grad.shape[1:])
