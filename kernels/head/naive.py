"""Reference row statistics of a block of logits, in torch ops (CPU, float64-capable).

``logits`` [b, V] are one row block of the log-prob head (harts.numerics). The forward needs each
row's normaliser and, when the entropy is measured, its entropy; the backward turns the per-row
gradients of the log-probs and the entropy into the logits' gradient (up to the one-hot target
terms, which the head adds by position)::

    lse     = log sum_v exp(z_v)                 p = exp(z - lse)
    entropy = lse - sum_v p_v z_v
    dz      = -row_grad * p - entropy_grad * p * (z - E_p[z])
"""

from __future__ import annotations

import torch

__all__ = ["row_lse_entropy", "softmax_backward"]


def row_lse_entropy(logits: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [b, V] -> (lse [b], entropy [b] or None)."""
    lse = torch.logsumexp(logits, dim=-1)
    if not with_entropy:
        return lse, None
    probs = torch.exp(logits - lse[:, None])
    return lse, lse - (probs * logits).sum(-1)


def softmax_backward(logits: torch.Tensor, lse: torch.Tensor, row_grad: torch.Tensor,
                     entropy_grad: torch.Tensor | None, expected: torch.Tensor | None) -> torch.Tensor:
    """The logits' gradient [b, V] (a new tensor); ``expected`` [b] is E_p[z] (None: from these logits)."""
    probs = torch.exp(logits - lse[:, None])
    grad = probs * (-row_grad[:, None])
    if entropy_grad is not None:
        expected = (probs * logits).sum(-1) if expected is None else expected
        grad -= entropy_grad[:, None] * probs * (logits - expected[:, None])
    return grad
