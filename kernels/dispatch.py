"""Kernel dispatch: the fast path where it covers the inputs, the pure-torch reference elsewhere.

A :class:`Dispatch` has the functions of :mod:`harts.kernels.naive` with the same names and
signatures (:class:`harts.kernels.interface.Kernels`), so it can be passed wherever a ``kernels`` namespace is expected
(``BaselineView``, ``TreeView``, ``harts.runtime.log_probs(..., kernels=...)``). This module is
itself such a namespace: its functions are those of the default dispatch, whose mode is read
once, at import, from ``HARTS_KERNELS`` (``auto`` when unset). A caller that wants another mode
builds its own: ``Dispatch("naive")``.

Modes:

* ``auto``: the fast path when it covers the inputs, else the reference;
* ``fast``: like auto, but linear attention raises instead of falling back (a benchmark must
  not time the reference by accident);
* ``naive``: always the reference.

Fast paths, by operator:

* ``chunk_linear_attention``: :mod:`.linear_attention.chunk`, flash-linear-attention's KDA
  pipeline with HARTS' state kernels (CUDA, chunk 32 / 64, bf16 / fp16 / fp32, fla installed).
  float64 and other chunk sizes run the reference, which is the exact answer for them.
* ``attention``: :mod:`.attention.varlen` (varlen FlashAttention-2 on CUDA).
* ``moe_experts``: :mod:`.moe.grouped` (grouped GEMMs on CUDA).
* ``causal_conv1d``: :mod:`.conv.fla`, flash-linear-attention's Triton kernel with each
  sequence's true-ancestor context as its initial state, where HARTS ships tuned configs (CUDA,
  bf16, no bias, silu: what the supported models run); everything else, CPU included, runs the
  reference (one gather and one einsum).
"""

from __future__ import annotations

import os

import torch

from . import naive
from .linear_attention import chunk as fla_chunk

__all__ = [
    "MODES",
    "Dispatch",
    "attention",
    "attention_backward",
    "attention_forward",
    "attention_values",
    "causal_conv1d",
    "chunk_linear_attention",
    "default",
    "mode_from_environment",
    "moe_experts",
    "recurrent_linear_attention",
]

MODES = ("auto", "fast", "naive")
ENVIRONMENT_VARIABLE = "HARTS_KERNELS"


def mode_from_environment(environ=None) -> str:
    """The dispatch mode named by ``HARTS_KERNELS`` ("auto" when unset)."""
    environ = os.environ if environ is None else environ
    mode = environ.get(ENVIRONMENT_VARIABLE, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENVIRONMENT_VARIABLE} must be one of {MODES}, got {mode!r}")
    return mode


class Dispatch:
    """A kernels namespace that picks each operator's fast path or reference per call."""

    def __init__(self, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"kernel mode must be one of {MODES}, got {mode!r}")
        self.mode = mode

    def __repr__(self) -> str:
        return f"Dispatch(mode={self.mode!r})"

    # ------------------------------------------------------------------ selection
    def uses_fast_linear_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int) -> bool:
        if self.mode == "naive" or q.dtype == torch.float64:
            return False
        covered = fla_chunk.supports(q, k, v, chunk_size)
        if self.mode == "fast" and not covered:
            raise RuntimeError(
                "HARTS kernel mode 'fast': the fla linear-attention path does not cover these inputs "
                f"(device {q.device}, dtypes {q.dtype}/{k.dtype}/{v.dtype}, chunk size {chunk_size}, "
                f"head dims {q.shape[-1]}/{v.shape[-1]}, fla installed: {fla_chunk.fla_available()}); "
                "it needs CUDA, chunk size 32 or 64, one dtype for q/k/v and head dims <= 256"
            )
        return covered

    def uses_fast_attention(self, q: torch.Tensor) -> bool:
        return self.mode != "naive" and q.is_cuda

    def uses_fast_conv(self, x: torch.Tensor, weight: torch.Tensor, bias, activation) -> bool:
        from .conv import fla as fla_conv

        return self.mode != "naive" and fla_conv.fla_conv_available(x, weight, bias, activation)

    def uses_grouped_experts(self, x: torch.Tensor) -> bool:
        return self.mode != "naive" and x.is_cuda

    # ------------------------------------------------------------------ operators
    def chunk_linear_attention(self, q, k, v, log_decay, beta, cu_seqlens, *, chunk_size, scale,
                               initial_state=None, export_chunks=None):
        """See :func:`harts.kernels.linear_attention.naive.chunk_linear_attention`."""
        kernel = fla_chunk if self.uses_fast_linear_attention(q, k, v, chunk_size) else naive
        return kernel.chunk_linear_attention(
            q, k, v, log_decay, beta, cu_seqlens,
            chunk_size=chunk_size, scale=scale, initial_state=initial_state, export_chunks=export_chunks,
        )

    def recurrent_linear_attention(self, *args, **kwargs):
        """The token-by-token oracle (always the reference)."""
        return naive.recurrent_linear_attention(*args, **kwargs)

    def causal_conv1d(self, x, weight, bias, cu_seqlens, *, context=None, activation="silu"):
        """See :func:`harts.kernels.conv.naive.causal_conv1d`."""
        if self.uses_fast_conv(x, weight, bias, activation):
            from .conv import fla as fla_conv

            return fla_conv.causal_conv1d(x, weight, bias, cu_seqlens, context=context, activation=activation)
        return naive.causal_conv1d(x, weight, bias, cu_seqlens, context=context, activation=activation)

    def attention(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal=True):
        """See :func:`harts.kernels.attention.naive.attention`."""
        if self.uses_fast_attention(q):
            from .attention import varlen

            return varlen.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal)
        return naive.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal)

    def attention_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal=True):
        """See :func:`harts.kernels.attention.naive.attention_forward` (FlashAttention where
        :func:`~harts.kernels.attention.varlen.flash_parts_available`)."""
        return self._attention_parts(q, k, v).attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale,
                                                                 causal=causal)

    def attention_backward(self, d_o, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, state, *, scale, causal=True):
        """See :func:`harts.kernels.attention.naive.attention_backward`; the same path as :meth:`attention_forward`."""
        return self._attention_parts(q, k, v).attention_backward(d_o, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                                                                  state, scale=scale, causal=causal)

    def _attention_parts(self, q, k, v):
        if self.uses_fast_attention(q):
            from .attention import varlen

            if varlen.flash_parts_available(q, k, v):
                return varlen
        return naive

    def attention_values(self, q, k, v):
        """``v`` zero-padded to the head dim :meth:`attention` computes with (unchanged where it pads nothing).

        The varlen FlashAttention path pads narrower values (MLA) to the query head dim itself. A caller
        that gathers each sequence's keys and values from fewer compact rows pads those rows once here,
        before the gather, so the kernel pads nothing; it then keeps the output's first ``v.shape[-1]``
        columns (zero values give zero columns, and the others are unchanged, bit for bit).
        """
        if self.uses_fast_attention(q):
            from .attention import varlen

            if varlen.flash_varlen_available(q, k, v):
                return varlen.flash_values(q, v)
        return v

    def moe_experts(self, x, indices, weights, gate_up_proj, down_proj):
        """See :func:`harts.kernels.moe.naive.moe_experts`."""
        if self.uses_grouped_experts(x):
            from .moe import grouped

            return grouped.moe_experts(x, indices, weights, gate_up_proj, down_proj)
        return naive.moe_experts(x, indices, weights, gate_up_proj, down_proj)


default = Dispatch(mode_from_environment())

chunk_linear_attention = default.chunk_linear_attention
recurrent_linear_attention = default.recurrent_linear_attention
causal_conv1d = default.causal_conv1d
attention = default.attention
attention_values = default.attention_values
attention_forward = default.attention_forward
attention_backward = default.attention_backward
moe_experts = default.moe_experts
