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
    weight = weight.to(x.dtype).contiguous()
    bias = None if bias is None else bias.to(x.dtype)
    activation = None if activation == "identity" else activation
    if context is None or weight.shape[1] < 2 or x.shape[0] == 0:
        return _packed_call(fla_causal_conv1d, x, weight, bias, bounds, activation)
    if CONTEXT_BY_HEAD_WINDOWS:
        return _with_head_windows(x, weight, bias, bounds, context, activation)
    num_sequences, channels = len(bounds) - 1, x.shape[1]
    unread_slot = x.new_zeros(num_sequences, channels, 1)
    initial_state = torch.cat([unread_slot, context.to(x.dtype).transpose(1, 2)], dim=2)  # [N, D, W]
    return _packed_call(fla_causal_conv1d, x, weight, bias, bounds, activation, initial_state)


#: how a context reaches the kernel: False, as fla's per-sequence initial state; True, by recomputing each
#: sequence's first W-1 rows from windows of [context; own rows] (see :func:`_with_head_windows`)
CONTEXT_BY_HEAD_WINDOWS = True


def _packed_call(fla_causal_conv1d, x, weight, bias, bounds, activation, initial_state=None) -> torch.Tensor:
    device_bounds, host_bounds, block_table = _call_layout(bounds, x.device)
    y, _ = fla_causal_conv1d(
        x.unsqueeze(0),  # [1, T, D]
        weight=weight,
        bias=bias,
        initial_state=initial_state,
        activation=activation,
        cu_seqlens=device_bounds,
        cu_seqlens_cpu=host_bounds,
        chunk_indices=block_table,
        chunk_size=_BLOCK_ROWS,
    )
    return y.squeeze(0)


@functools.lru_cache(maxsize=64)
def _cached_head_rows(bounds_bytes: bytes, history: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bounds = np.frombuffer(bounds_bytes, dtype=np.int64)
    starts, lengths = bounds[:-1], np.diff(bounds)
    offset = np.arange(history)
    reads = np.minimum(starts[:, None] + offset, max(int(bounds[-1]) - 1, 0))  # [N, W-1]; past a short end: unused
    exists = (offset[None, :] < lengths[:, None]).reshape(-1)
    rows = (starts[:, None] + offset).reshape(-1)[exists]
    return host.upload(reads.reshape(-1), device), host.upload(np.flatnonzero(exists), device), host.upload(rows, device)


def _head_rows(bounds: np.ndarray, history: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the rows read as each sequence's first ``history`` rows, clamped into x; which of those reads are
    rows of their sequence; the rows they are), uploaded once per bounds."""
    return _cached_head_rows(np.ascontiguousarray(bounds, dtype=np.int64).tobytes(), history, str(device))


def _fla_ops():
    from fla.modules.causal_conv1d import causal_conv1d_bwd, causal_conv1d_fwd
    return causal_conv1d_fwd, causal_conv1d_bwd


def _plain_forward(x, weight, bias, bounds, activation) -> torch.Tensor:
    """fla's forward kernel over packed sequences from zeros: x [T, D] -> a fresh y [T, D]."""
    device_bounds, host_bounds, block_table = _call_layout(bounds, x.device)
    y, _ = _fla_ops()[0](x.unsqueeze(0), weight, bias, None, None, False, activation, device_bounds, host_bounds,
                         block_table, _BLOCK_ROWS)
    return y.squeeze(0)


def _plain_backward(x, dy, weight, bias, bounds, activation):
    """fla's backward of :func:`_plain_forward`: (dx [T, D], d weight, d bias or None)."""
    device_bounds, host_bounds, block_table = _call_layout(bounds, x.device)
    dx, dw, db, _, _ = _fla_ops()[1](x.unsqueeze(0), dy.unsqueeze(0), None, weight, bias, None, None, activation,
                                     device_bounds, host_bounds, block_table, _BLOCK_ROWS)
    return dx.squeeze(0), dw, db


class _HeadWindowsConv(torch.autograd.Function):
    """The convolution with context as two plain calls of fla's kernels (see :func:`_with_head_windows`).

    An autograd function of its own because the composition of fla's autograd calls cannot write the
    head rows into fla's output (autograd forbids writing into that view), so it copied the whole
    output once per forward and summed two full-size input gradients: about 16 ms per headline pass on
    an H200. Here the forward writes the head rows into the output it owns, and the backward adds the
    head windows' input gradient into the rows it reached.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, context, bounds, activation):
        history = weight.shape[1] - 1
        num_sequences, channels = len(bounds) - 1, x.shape[1]
        reads, valid, rows = _head_rows(bounds, history, x.device)
        y = _plain_forward(x, weight, bias, bounds, activation)
        own_heads = x.index_select(0, reads).view(num_sequences, history, channels)
        windows = torch.cat([context.to(x.dtype), own_heads], dim=1).view(num_sequences * 2 * history, channels)
        window_bounds = np.arange(num_sequences + 1, dtype=np.int64) * 2 * history
        heads = _plain_forward(windows, weight, bias, window_bounds, activation)
        heads = heads.view(num_sequences, 2 * history, channels)[:, history:].reshape(num_sequences * history, channels)
        y.index_copy_(0, rows, heads.index_select(0, valid))
        ctx.save_for_backward(x, weight, bias, windows, valid, rows)
        ctx.call = (bounds, window_bounds, history, num_sequences, activation, context.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, windows, valid, rows = ctx.saved_tensors
        bounds, window_bounds, history, num_sequences, activation, context_dtype = ctx.call
        channels = x.shape[1]
        dy = dy.contiguous()
        dy_heads = dy.index_select(0, rows)
        # The head rows' outputs came from the windows: the packed call's gradient excludes them. Outside a
        # differentiable backward nothing else reads dy while this runs (nodes run one at a time), so those
        # rows are zeroed in place and put back before returning, instead of masking a full-size copy of dy
        # (0.44 GB a headline call); under create_graph dy may be saved for a higher-order gradient.
        in_place = not torch.is_grad_enabled()
        masked = dy.index_fill_(0, rows, 0) if in_place else dy.index_fill(0, rows, 0)
        dx, dw, db = _plain_backward(x, masked, weight, bias, bounds, activation)
        if in_place:
            dy.index_copy_(0, rows, dy_heads)
        window_dy = dy.new_zeros(num_sequences, 2 * history, channels)  # the context rows' outputs are not kept
        window_dy[:, history:] = dy.new_zeros(num_sequences * history, channels).index_copy_(0, valid, dy_heads).view(
            num_sequences, history, channels)
        d_windows, dw_windows, db_windows = _plain_backward(
            windows, window_dy.view(-1, channels), weight, bias, window_bounds, activation)
        d_windows = d_windows.view(num_sequences, 2 * history, channels)
        own = d_windows[:, history:].reshape(num_sequences * history, channels).index_select(0, valid)
        dx.index_add_(0, rows, own)  # the valid reads are exactly the head rows
        d_context = d_windows[:, :history].to(context_dtype)
        d_bias = None if bias is None else db + db_windows
        return dx, dw + dw_windows, d_bias, d_context, None, None


def _with_head_windows(x, weight, bias, bounds, context, activation) -> torch.Tensor:
    """The convolution with context, as two calls of fla's kernel without initial states.

    One call runs every packed sequence from zeros; its first ``W - 1`` rows per sequence miss their
    context and are replaced by a second call over one short sequence per input sequence, its context
    rows then its own first rows (``[N, 2(W-1), D]``), whose last ``W - 1`` outputs are those rows. Both
    run the kernel's plain path, the one a trajectory-wise run takes through the same windows, so every
    output equals fla's initial-state path bit for bit (a masked zero added is exact). On an H200 (fla
    0.6.0, the headline plan's 34,395 rows x 6,144 channels) the initial-state forward took 0.662 ms and
    the plain one 0.341 ms; forward and backward 6.79 ms against 5.50 ms. Gradients reach x, the weight
    and the context through both calls.
    """
    return _HeadWindowsConv.apply(x, weight, bias, context, bounds, activation)
