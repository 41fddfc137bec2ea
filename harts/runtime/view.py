"""Execution views: how a layer's sequence operators see the rows of one (micro)batch.

A layer of :class:`harts.runtime.model.HybridModel` holds C hidden rows and never knows how
they relate to trajectories. Token-wise work (projections, norms, RoPE, MoE) runs once per
row; the three sequence operators go through the view, which knows each row's true history:

* ``causal_conv(x, weight, bias, activation)``: depthwise causal convolution where row r
  reads the W-1 rows that precede it in its own trajectory;
* ``linear_attention(q, k, v, log_decay, beta, scale=)``: the gated delta rule of
  :mod:`harts.kernels.dispatch` (the references on CPU, fast kernels on CUDA), with each
  trajectory's chunks aligned to multiples of ``chunk_size`` of its own positions;
* ``attention(q, k, v, scale=)``: causal softmax attention of each row over the rows of
  its trajectory up to and including itself.

``positions`` gives the RoPE position of each row in its own trajectory and ``row_weight``
the multiplicity q_c of each row (how many semantic positions it stands for; MoE statistics
are weighted by it).

:class:`BaselineView` is the trajectory-wise baseline: every row is one position of one
independent packed sequence, q_c = 1, and each operator is one packed kernel call from zero
state / zero context. The prefix-sharing implementation (``TreeView``) lives in
``harts.runtime.tree_view``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from harts.errors import ModelInputError
from harts.kernels import host
from harts.kernels import dispatch as default_kernels
from harts.kernels.interface import Kernels

__all__ = ["BaselineView", "ExecutionView", "LinearRows", "SameRows", "linear_rows"]


@runtime_checkable
class ExecutionView(Protocol):
    """What a layer needs to know about the rows it processes (see the module docstring)."""

    num_rows: int  # C
    positions: torch.LongTensor  # [C]
    row_weight: torch.Tensor  # [C] float multiplicity q_c
    chunk_size: int

    def causal_conv(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
    ) -> torch.Tensor:
        """x [C, D], weight [D, W], bias [D] or None -> [C, D]."""
        ...

    def linear_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        log_decay: torch.Tensor,
        beta: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor:
        """q, k [C, H, K]; v [C, H, V]; log_decay [C, H, K] or [C, H]; beta [C, H] -> [C, H, V]."""
        ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
        """q [C, Hq, Dk], k [C, Hkv, Dk], v [C, Hkv, Dv] -> [C, Hq, Dv]."""
        ...


class LinearRows(Protocol):
    """The rows a view's linear-attention layers run on: ``view`` over them, and the maps into and out of them.

    ``pack(x [C, ...]) -> [P, ...]`` and ``unpack(y [P, ...]) -> [C, ...]`` with ``unpack(pack(x)) == x``;
    a layer run as ``unpack(mixer(pack(h), view))`` gives what ``mixer(h, outer_view)`` gives.
    """

    view: ExecutionView

    def pack(self, x: torch.Tensor) -> torch.Tensor: ...

    def unpack(self, y: torch.Tensor) -> torch.Tensor: ...


class SameRows:
    """A view whose linear-attention layers run on its own rows: both maps are the identity."""

    def __init__(self, view: ExecutionView):
        self.view = view

    @staticmethod
    def pack(x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def unpack(y: torch.Tensor) -> torch.Tensor:
        return y


def linear_rows(view: ExecutionView) -> LinearRows:
    """The rows ``view``'s linear-attention layers run on: its ``linear_rows()`` where it has one (a
    :class:`~harts.runtime.tree_view.TreeView` with replay packs them in round order), else its own rows."""
    method = getattr(view, "linear_rows", None)
    return SameRows(view) if method is None else method()


class BaselineView:
    """Trajectory-wise view over packed independent sequences (no sharing).

    Args:
        lengths: length of each sequence; rows are the sequences' tokens back to back.
        chunk_size: B of the chunkwise linear-attention kernel.
        device: where the index tensors live.
        kernels: module providing ``chunk_linear_attention``, ``causal_conv1d`` and
            ``attention`` with the signatures of :mod:`harts.kernels.naive` (a fast GPU
            backend can be passed here).
    """

    def __init__(
        self,
        lengths: Sequence[int],
        chunk_size: int,
        device: torch.device | str | None = None,
        *,
        kernels: Kernels | None = None,
    ):
        lengths = [int(n) for n in lengths]
        if any(n < 0 for n in lengths):
            bad = next(i for i, n in enumerate(lengths) if n < 0)
            raise ModelInputError(f"BaselineView: sequence {bad} has negative length {lengths[bad]}")
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ModelInputError(f"BaselineView: chunk_size must be a positive int, got {chunk_size!r}")
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.lengths = lengths
        self.chunk_size = chunk_size
        self.device = device
        self.kernels = kernels if kernels is not None else default_kernels
        self.num_rows = sum(lengths)
        # built on the host and copied without waiting for the device; the kernels read the offsets' host copy
        bounds = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=bounds[1:])
        self.cu_seqlens = host.upload(bounds, device)
        self.positions = host.upload(np.arange(self.num_rows, dtype=np.int64) - np.repeat(bounds[:-1], lengths), device)
        self.row_weight = torch.ones(self.num_rows, device=device)

    def __repr__(self) -> str:
        return f"BaselineView(sequences={len(self.lengths)}, rows={self.num_rows}, chunk_size={self.chunk_size})"

    def causal_conv(self, x, weight, bias, activation):
        return self.kernels.causal_conv1d(x, weight, bias, self.cu_seqlens, context=None, activation=activation)

    def linear_attention(self, q, k, v, log_decay, beta, *, scale):
        o, _final, _exported = self.kernels.chunk_linear_attention(
            q, k, v, log_decay, beta, self.cu_seqlens, chunk_size=self.chunk_size, scale=scale
        )
        return o

    def attention(self, q, k, v, *, scale):
        return self.kernels.attention(q, k, v, self.cu_seqlens, self.cu_seqlens, scale=scale, causal=True)
