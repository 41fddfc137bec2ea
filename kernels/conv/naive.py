"""Pure-torch reference of the packed varlen depthwise causal convolution with per-sequence context."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .._checks import sequence_bounds

__all__ = ["causal_conv1d", "check_conv_inputs"]


_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, None: None, "identity": None}


def check_conv_inputs(x, weight, bias, cu_seqlens, context, activation) -> np.ndarray:
    """The shape and option checks every causal-convolution path makes; returns the sequence bounds."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, D], got {tuple(x.shape)}")
    total, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"weight must be [D, W] = [{channels}, W], got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"bias must be [D] = [{channels}], got {tuple(bias.shape)}")
    if activation not in _ACTIVATIONS:
        known = sorted(a for a in _ACTIVATIONS if a)
        raise ValueError(f"activation must be one of {known} or None, got {activation!r}")
    history = weight.shape[1] - 1
    bounds = sequence_bounds(cu_seqlens, total, "cu_seqlens")
    num_sequences = len(bounds) - 1
    if context is not None and tuple(context.shape) != (num_sequences, history, channels):
        raise ValueError(
            f"context must be [N, W-1, D] = [{num_sequences}, {history}, {channels}], got {tuple(context.shape)}"
        )
    return bounds


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    *,
    context: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal convolution over packed sequences.

    ``y_t[d] = act(bias[d] + sum_w weight[d, w] * z[t - (W-1) + w][d])`` where ``z`` is the
    sequence's inputs preceded by its W-1 context rows, so the last tap (w = W-1) reads the
    current row. Rows of a neighbouring packed sequence are never read.

    Args:
        x: [T, D]; weight: [D, W]; bias: [D] or None; cu_seqlens: [N+1];
        context: None (zeros) or [N, W-1, D], the W-1 inputs preceding each sequence (oldest first).
        activation: "silu" or None.
    Returns:
        y [T, D].
    """
    bounds = check_conv_inputs(x, weight, bias, cu_seqlens, context, activation)
    total, channels = x.shape
    width = weight.shape[1]
    history = width - 1
    num_sequences = len(bounds) - 1
    if context is None:
        context = x.new_zeros(num_sequences, history, channels)

    lengths = np.diff(bounds)
    token_sequence = np.repeat(np.arange(num_sequences), lengths)
    token_local = np.arange(total) - bounds[token_sequence]
    source_local = token_local[:, None] - history + np.arange(width)[None, :]  # [T, W]
    # rows of x first, then the context rows of sequence i at total + i*(W-1) + j
    rows = np.where(
        source_local >= 0,
        bounds[token_sequence][:, None] + source_local,
        total + token_sequence[:, None] * history + history + source_local,
    )
    source = torch.cat([x, context.to(x.dtype).reshape(num_sequences * history, channels)], dim=0)
    index = torch.as_tensor(rows.reshape(-1), dtype=torch.long, device=x.device)
    windows = source.index_select(0, index).view(total, width, channels)  # [T, W, D]
    y = torch.einsum("twd,dw->td", windows, weight.to(x.dtype))
    if bias is not None:
        y = y + bias.to(x.dtype)
    act = _ACTIVATIONS[activation]
    return act(y) if act is not None else y
