"""Row statistics of the log-prob head's logit blocks in Triton, for fp32 blocks on CUDA.

In torch ops the forward reads a ``[b, V]`` block about ten times (``logsumexp`` is a max, a
subtraction, an exp and a sum; the entropy another exp, product and sum) and the backward writes
three temporaries of its size. At a 157K vocabulary those passes were most of the head's non-GEMM
time. Here:

* :func:`row_lse_entropy`: one program per row streams its logits once, keeping an online
  maximum ``m``, ``s = sum exp(z - m)`` and ``t = sum exp(z - m) z``; lse = m + log s and the
  entropy is lse - t / s;
* :func:`softmax_backward_`: one program per (row, column tile) overwrites the logits with their
  gradient ``-row_grad p - entropy_grad p (z - E_p[z])`` in one pass.

:mod:`.naive` is the reference; on CPU the kernels run under the Triton interpreter
(``TRITON_INTERPRET=1``), which is how CI holds them to it.
"""

from __future__ import annotations

import torch

from ..linear_attention.state import TRITON_AVAILABLE, interpreter_enabled, tl, triton

__all__ = ["available", "row_lse_entropy", "softmax_backward_"]

#: Columns per step of the forward's stream and per program of the backward.
FORWARD_BLOCK = 4096
BACKWARD_BLOCK = 4096


def available(logits: torch.Tensor) -> bool:
    """Whether the kernels can run this block: fp32, contiguous rows, Triton on CUDA or the interpreter."""
    return (TRITON_AVAILABLE and logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_contiguous()
            and (logits.is_cuda or (interpreter_enabled() and logits.device.type == "cpu")))


if TRITON_AVAILABLE:

    @triton.jit
    def _lse_entropy_kernel(logits, lse, entropy, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * width
        m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)  # per-lane running maximum
        s = tl.zeros([BLOCK], dtype=tl.float32)  # per lane: sum exp(z - m)
        t = tl.zeros([BLOCK], dtype=tl.float32)  # per lane: sum exp(z - m) z
        for start in range(0, width, BLOCK):
            columns = start + tl.arange(0, BLOCK)
            inside = columns < width
            z = tl.load(base + columns, mask=inside, other=float("-inf"))
            m_new = tl.maximum(m, z)
            # lanes that have seen only -inf keep s = t = 0 (no inf - inf)
            rescale = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
            e = tl.where(inside & (z > float("-inf")), tl.exp(z - m_new), 0.0)
            s = s * rescale + e
            t = t * rescale + tl.where(e > 0.0, e * z, 0.0)
            m = m_new
        row_max = tl.max(m, axis=0)
        lane = tl.where(m == float("-inf"), 0.0, tl.exp(m - row_max))
        total = tl.sum(s * lane, axis=0)
        weighted = tl.sum(t * lane, axis=0)
        row_lse = row_max + tl.log(total)
        tl.store(lse + row, row_lse)
        tl.store(entropy + row, row_lse - weighted / total)

    @triton.jit
    def _softmax_backward_kernel(logits, lse, row_grad, entropy_grad, expected, width,
                                 HAS_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = columns < width
        pointers = logits + row * width + columns
        z = tl.load(pointers, mask=inside, other=0.0)
        p = tl.exp(z - tl.load(lse + row))
        grad = -tl.load(row_grad + row) * p
        if HAS_ENTROPY:
            grad -= tl.load(entropy_grad + row) * p * (z - tl.load(expected + row))
        tl.store(pointers, grad, mask=inside)


def row_lse_entropy(logits: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [b, V] fp32 -> (lse [b], entropy [b] or None), as :func:`.naive.row_lse_entropy`."""
    rows, width = logits.shape
    lse = logits.new_empty(rows)
    entropy = logits.new_empty(rows)
    if rows:
        _lse_entropy_kernel[(rows,)](logits, lse, entropy, width, BLOCK=min(FORWARD_BLOCK, triton.next_power_of_2(width)),
                                     num_warps=8)
    return lse, (entropy if with_entropy else None)


def softmax_backward_(logits: torch.Tensor, lse: torch.Tensor, row_grad: torch.Tensor,
                      entropy_grad: torch.Tensor | None, expected: torch.Tensor | None) -> torch.Tensor:
    """Overwrite ``logits`` [b, V] fp32 with their gradient (see :func:`.naive.softmax_backward`) and return it;
    ``expected`` [b] is E_p[z] (None: from these logits, by :func:`row_lse_entropy`, before they are overwritten)."""
    rows, width = logits.shape
    has_entropy = entropy_grad is not None
    if has_entropy and expected is None:
        block_lse, block_entropy = row_lse_entropy(logits, True)
        expected = block_lse - block_entropy
    if rows:
        block = min(BACKWARD_BLOCK, triton.next_power_of_2(width))
        grid = (rows, triton.cdiv(width, block))
        _softmax_backward_kernel[grid](logits, lse, row_grad, entropy_grad if has_entropy else lse,
                                       expected if has_entropy else lse, width,
                                       HAS_ENTROPY=has_entropy, BLOCK=block, num_warps=4)
    return logits
