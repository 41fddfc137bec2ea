"""Kernel dispatch: a drop-in replacement for :mod:`harts.kernels.naive` that picks the fast path.

Every function here has the name and signature of its reference in ``harts.kernels.naive``,
so this module can be passed wherever a ``kernels`` module is expected (``BaselineView``,
``TreeView``, ``harts.runtime.log_probs(..., kernels=dispatch)``).

Selection, per call:

* ``HARTS_KERNELS=naive``: always the pure-torch reference;
* ``HARTS_KERNELS=fast``: always the fast path (on CPU this needs the Triton interpreter,
  ``TRITON_INTERPRET=1``, for the state scan);
* unset or ``auto``: the fast path when the inputs are on CUDA and Triton imports (for
  attention: when the inputs are on CUDA), otherwise the reference.

Inputs the fast paths do not cover fall back to the reference whatever the mode says only
where the reference is the one correct answer: float64 linear attention (the fast path
computes in fp32), chunk sizes above 64 and head dims above 256.

``causal_conv1d`` and ``recurrent_linear_attention`` always run the reference (the first is
one gather and one einsum, already fast on GPU; the second is the test oracle).
``moe_experts`` is the grouped-GEMM expert computation of :mod:`harts.kernels.moe_fast`.
"""

from __future__ import annotations

import logging
import os

import torch

from . import naive
from .naive import causal_conv1d, recurrent_linear_attention
from .state_scan import MAX_CHUNK_SIZE, MAX_HEAD_DIM, TRITON_AVAILABLE

logger = logging.getLogger(__name__)

__all__ = [
    "attention",
    "causal_conv1d",
    "chunk_linear_attention",
    "kernel_mode",
    "moe_experts",
    "recurrent_linear_attention",
    "uses_fast_attention",
    "uses_fast_linear_attention",
]

_MODES = ("auto", "fast", "naive")
_FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_mode() -> str:
    """The selection mode from ``HARTS_KERNELS`` ("auto" when unset)."""
    mode = os.environ.get("HARTS_KERNELS", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"HARTS_KERNELS must be one of {_MODES}, got {mode!r}")
    return mode


def uses_fast_linear_attention(q: torch.Tensor, v: torch.Tensor, chunk_size: int) -> bool:
    """Whether :func:`chunk_linear_attention` takes the Triton path for these inputs."""
    mode = kernel_mode()
    if mode == "naive":
        return False
    supported = (
        q.dtype in _FAST_DTYPES
        and isinstance(chunk_size, int)
        and 1 <= chunk_size <= MAX_CHUNK_SIZE
        and q.dim() == 3
        and q.shape[-1] <= MAX_HEAD_DIM
        and v.dim() == 3
        and v.shape[-1] <= MAX_HEAD_DIM
    )
    if mode == "fast":
        if not TRITON_AVAILABLE:
            raise RuntimeError("HARTS_KERNELS=fast but Triton is not installed")
        if not supported:
            logger.debug("fast linear attention does not cover these inputs; using the reference")
        return supported
    return supported and TRITON_AVAILABLE and q.is_cuda


def uses_fast_attention(q: torch.Tensor) -> bool:
    """Whether :func:`attention` takes the fast path for these inputs."""
    mode = kernel_mode()
    if mode == "naive":
        return False
    return mode == "fast" or q.is_cuda


def chunk_linear_attention(
    q,
    k,
    v,
    log_decay,
    beta,
    cu_seqlens,
    *,
    chunk_size,
    scale,
    initial_state=None,
    export_chunks=None,
):
    """See :func:`harts.kernels.naive.chunk_linear_attention`; the fast path returns states in fp32."""
    if uses_fast_linear_attention(q, v, chunk_size):
        from .chunk_fast import chunk_linear_attention as fast

        return fast(
            q, k, v, log_decay, beta, cu_seqlens,
            chunk_size=chunk_size, scale=scale, initial_state=initial_state, export_chunks=export_chunks,
        )
    return naive.chunk_linear_attention(
        q, k, v, log_decay, beta, cu_seqlens,
        chunk_size=chunk_size, scale=scale, initial_state=initial_state, export_chunks=export_chunks,
    )


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal=True):
    """See :func:`harts.kernels.naive.attention`."""
    if uses_fast_attention(q):
        from .attention_fast import attention as fast

        return fast(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal)
    return naive.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal)


def moe_experts(x, indices, weights, gate_up_proj, down_proj):
    """Routed SwiGLU experts (see :func:`harts.kernels.moe_fast.moe_experts`)."""
    from .moe_fast import moe_experts as experts

    return experts(x, indices, weights, gate_up_proj, down_proj)
