"""The kernel interface: what every kernels namespace offers, and each operator's signature.

The runtime calls operators through a namespace (``kernels=`` of the execution views and of
:func:`harts.runtime.log_probs`): :mod:`harts.kernels.naive` (the references),
:mod:`harts.kernels.dispatch` (the default dispatch, as a module), a
:class:`~harts.kernels.dispatch.Dispatch`, or any object with the same functions (the
benchmarks' kernel sets). :class:`Kernels` states that contract once; each operator's
implementations (``naive``, and the fast ones: ``linear_attention.chunk``, ``conv.fla``,
``attention.varlen``, ``moe.grouped``) keep the signature of its protocol below, and
``tests/kernels/test_interface.py`` holds every implementation to it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "AttentionKernel",
    "CausalConvKernel",
    "Kernels",
    "LinearAttentionKernel",
    "MoEExpertsKernel",
    "OPERATORS",
]


class LinearAttentionKernel(Protocol):
    """Packed varlen chunkwise gated delta rule: returns (output, final states, exported states).

    See :func:`harts.kernels.linear_attention.naive.chunk_linear_attention`."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        log_decay: torch.Tensor,
        beta: torch.Tensor,
        cu_seqlens: torch.Tensor,
        *,
        chunk_size: int,
        scale: float,
        initial_state: torch.Tensor | None = None,
        export_chunks=None,
    ): ...


class CausalConvKernel(Protocol):
    """Packed varlen depthwise causal convolution with per-sequence context.

    See :func:`harts.kernels.conv.naive.causal_conv1d`."""

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        cu_seqlens: torch.Tensor,
        *,
        context: torch.Tensor | None = None,
        activation: str | None = "silu",
    ) -> torch.Tensor: ...


class AttentionKernel(Protocol):
    """Packed softmax attention with separate query and key spans, bottom-right causal.

    See :func:`harts.kernels.attention.naive.attention`."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        *,
        scale: float,
        causal: bool = True,
    ) -> torch.Tensor: ...


class MoEExpertsKernel(Protocol):
    """Routed SwiGLU experts. See :func:`harts.kernels.moe.naive.moe_experts`."""

    def __call__(
        self,
        x: torch.Tensor,
        indices: torch.Tensor,
        weights: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
    ) -> torch.Tensor: ...


@runtime_checkable
class Kernels(Protocol):
    """A kernels namespace: one function per operator the runtime calls."""

    chunk_linear_attention: LinearAttentionKernel
    causal_conv1d: CausalConvKernel
    attention: AttentionKernel
    moe_experts: MoEExpertsKernel


#: Each operator of :class:`Kernels` and the protocol its implementations follow.
OPERATORS: dict[str, type] = {
    "chunk_linear_attention": LinearAttentionKernel,
    "causal_conv1d": CausalConvKernel,
    "attention": AttentionKernel,
    "moe_experts": MoEExpertsKernel,
}
