"""Packed varlen causal convolution on flash-linear-attention's Triton kernel (GPU).

Same signature and result as :func:`harts.kernels.conv.naive.causal_conv1d`. fla's
``causal_conv1d`` takes one cache per sequence as ``initial_state`` [N, D, W]: slot ``W-1``
holds the input just before the sequence, slot ``1`` the oldest one its window reaches, and
slot ``0`` is never read by the forward. HARTS' context [N, W-1, D] (oldest first) is exactly
slots ``1 .. W-1`` transposed, so it is placed there behind one zero column; fla's backward
returns the gradient of that cache, which flows back to the ancestor rows the context was
gathered from.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .. import host
from ..fla_setup import configure_fla
from ..linear_attention.chunk import chunk_indices
from .naive import check_conv_inputs

__all__ = ["causal_conv1d", "fla_conv_available"]

# fla keys its autotuning on the dtypes of every tensor argument, so each combination of dtype,
# bias and activation is its own entry; HARTS ships tuned entries (kernels/fla_configs) only for
# what the supported models run: bf16, no conv bias, silu (Kimi Linear, Qwen3-Next, Ling). On an
# H200 (Triton 3.6, fla 0.6.0) an untuned combination autotunes, and autotuning the width-4
# backward with a bias never returned; float32 with a context hung the same way. Everything
# outside the tuned set therefore runs the reference.
_DTYPES = (torch.bfloat16,)
_TUNED_ACTIVATIONS = ("silu", "swish")
_fla_causal_conv1d = None

#: fla's kernels tile each sequence into blocks of this many rows (its default ``chunk_size``)
_BLOCK_ROWS = 64


@functools.lru_cache(maxsize=64)
def _cached_layout(bounds_bytes: bytes, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bounds = np.frombuffer(bounds_bytes, dtype=np.int64)
    block_offsets = np.concatenate([[0], np.cumsum(-(-np.diff(bounds) // _BLOCK_ROWS))]).astype(np.int64)
    table = chunk_indices(block_offsets, int(block_offsets[-1])).astype(np.int32)  # the same table as the KDA calls'
    return (  # uploaded from pinned memory: a copy from pageable memory would wait for the GPU
        host.upload(bounds.astype(np.int32), device),
        torch.as_tensor(bounds.astype(np.int32)),
        host.upload(table, device),
    )


def _call_layout(bounds: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu_seqlens int32 on device, its host copy, fla's [blocks, 2] (sequence, block) table), built once per bounds.

    Without the table fla builds it on every call from a fresh host copy of the bounds, and that
    copy to the device waits for the whole queue: a sync per call, in the baseline's layers and
    HARTS' alike. Every layer of a microbatch makes the same calls, so the tensors are cached.
    """
    return _cached_layout(np.ascontiguousarray(bounds, dtype=np.int64).tobytes(), str(device))


def _load():
    global _fla_causal_conv1d
    if _fla_causal_conv1d is None:
        configure_fla()
        try:
            from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d
        except ImportError:
            _fla_causal_conv1d = False
        else:
            _fla_causal_conv1d = fla_causal_conv1d
    return _fla_causal_conv1d or None


def fla_conv_available(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       activation: str | None = "silu") -> bool:
    """Whether fla's kernel runs these inputs with a tuned config (CUDA, bf16, no bias, silu, fla installed)."""
    return (
        x.is_cuda
        and x.dim() == 2
        and x.dtype in _DTYPES
        and weight.dim() == 2
        and weight.shape[1] >= 2
        and bias is None
        and activation in _TUNED_ACTIVATIONS
        and _load() is not None
    )


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    *,
    context: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """See :func:`harts.kernels.conv.naive.causal_conv1d`; x [T, D], weight [D, W], context [N, W-1, D]."""
    fla_causal_conv1d = _load()
    if fla_causal_conv1d is None:
        raise RuntimeError("flash-linear-attention is not installed: pip install 'harts[gpu]'")
    bounds = check_conv_inputs(x, weight, bias, cu_seqlens, context, activation)
    num_sequences, channels = len(bounds) - 1, x.shape[1]
    initial_state = None
    if context is not None:
        unread_slot = x.new_zeros(num_sequences, channels, 1)
        initial_state = torch.cat([unread_slot, context.to(x.dtype).transpose(1, 2)], dim=2)  # [N, D, W]
    device_bounds, host_bounds, block_table = _call_layout(bounds, x.device)
    y, _ = fla_causal_conv1d(
        x.unsqueeze(0),  # [1, T, D]
        weight=weight.to(x.dtype).contiguous(),
        bias=None if bias is None else bias.to(x.dtype),
        initial_state=initial_state,
        activation=None if activation == "identity" else activation,
        cu_seqlens=device_bounds,
        cu_seqlens_cpu=host_bounds,
        chunk_indices=block_table,
        chunk_size=_BLOCK_ROWS,
    )
    return y.squeeze(0)
