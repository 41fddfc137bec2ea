"""Row movement with a backward that writes each compact row's gradient once.

A plan's layer moves rows twice around each sequence kernel: it packs compact rows into the
kernel's inputs (each linear-attention round's own rows with the replay rows it re-reads from
its ancestors; each attention sequence's ancestor + own key/value view), and it assembles the
kernel outputs back into compact order. Under plain autograd every ``index_select`` returns a
zero-filled gradient the size of the whole source, filled by atomic ``index_add``, and the
gradients of a source used by several gathers (the rounds) are summed in full: per layer and
input, a few full-size writes and reads for what is mostly a permutation. Here the packing
modules know their index sets up front (they are fixed by the layout), so the backward:

* :class:`RowGather`: copies each source row's gradient from the first place it was gathered
  (a plain copy into a contiguous range where it can), then ``index_add``s only the repeats
  (replay rows, shared key/value prefixes); rows gathered nowhere get zeros. A single-output
  gather with repeats (a key/value view, the conv context) on the GPU instead sums each row's
  reads in one deterministic pass (:mod:`.segment_sum`): its repeats are the bulk of its rows,
  and ``index_add_``'s colliding atomics were the slow part;
* :class:`RowScatter`: hands each packed output the slice of the compact gradient it wrote,
  with zeros only where it wrote nothing (a round's replay positions).

The forwards equal :mod:`.naive`'s; gradients differ only in the order repeated rows' terms
are summed. Both are ``nn.Module`` s so a generated program carries them, index buffers and
all, and ``program.to(device)`` moves them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .segment_sum import csr_by_row, segment_sum, segment_sum_available

__all__ = ["RowGather", "RowScatter", "contiguous_span"]


def contiguous_span(rows: np.ndarray) -> tuple[int, int] | None:
    """(start, length) when ``rows`` is one ascending contiguous range, else None."""
    if rows.size and rows[-1] - rows[0] == rows.size - 1 and np.all(np.diff(rows) == 1):
        return int(rows[0]), int(rows.size)
    return None


class _Indices(nn.Module):
    """Index arrays as buffers (moved with the program) plus, for contiguous ones, their span."""

    def __init__(self) -> None:
        super().__init__()
        self._spans: dict[str, tuple[int, int] | None] = {}
        self._sizes: dict[str, int] = {}

    def add(self, name: str, rows: np.ndarray) -> None:
        """Register ``rows`` under ``name``."""
        rows = np.asarray(rows, dtype=np.int64)
        self._sizes[name] = int(rows.size)
        self._spans[name] = contiguous_span(rows)
        if self._spans[name] is None and rows.size:
            self.register_buffer(name, torch.tensor(rows))

    def size(self, name: str) -> int:
        return self._sizes[name]

    def is_span(self, name: str) -> bool:
        """Whether taking the rows is a view (one contiguous range, or none)."""
        return self._spans[name] is not None or not self._sizes[name]

    def covers(self, name: str, length: int) -> bool:
        """Whether the rows are exactly ``0 .. length - 1``."""
        return self._spans[name] == (0, length) or (length == 0 and not self._sizes[name])

    def take(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x[rows]``: a view for a contiguous range, else a gather."""
        span = self._spans[name]
        if span is not None:
            return x.narrow(0, *span)
        if not self._sizes[name]:
            return x.new_empty((0, *x.shape[1:]))
        return x.index_select(0, getattr(self, name))

    def take_into(self, out: torch.Tensor, x: torch.Tensor, name: str) -> None:
        """``out[:] = x[rows]`` without a temporary."""
        span = self._spans[name]
        if span is not None:
            out.copy_(x.narrow(0, *span))
        elif self._sizes[name]:
            torch.index_select(x, 0, getattr(self, name), out=out)

    def put(self, target: torch.Tensor, name: str, values: torch.Tensor) -> None:
        """``target[rows] = values``."""
        span = self._spans[name]
        if span is not None:
            target.narrow(0, *span).copy_(values)
        elif self._sizes[name]:
            target.index_copy_(0, getattr(self, name), values)

    def accumulate(self, target: torch.Tensor, name: str, values: torch.Tensor) -> None:
        """``target[rows] += values``, repeated rows summing."""
        span = self._spans[name]
        if span is not None:
            target.narrow(0, *span).add_(values)
        elif self._sizes[name]:
            target.index_add_(0, getattr(self, name), values)

    def zero(self, target: torch.Tensor, name: str) -> None:
        """``target[rows] = 0``."""
        span = self._spans[name]
        if span is not None:
            target.narrow(0, *span).zero_()
        elif self._sizes[name]:
            target.index_fill_(0, getattr(self, name), 0)

    def destination(self, target: torch.Tensor, name: str) -> torch.Tensor | None:
        """``target[rows]`` as a writable view when the rows are contiguous, else None."""
        span = self._spans[name]
        return None if span is None else target.narrow(0, *span)


class RowGather(nn.Module):
    """``x [C, ...] -> (x[rows_0], x[rows_1], ...)``, the index sets fixed at construction.

    Contiguous index sets come back as views. See the module docstring for the backward.
    """

    def __init__(self, num_rows: int, rows: Sequence[np.ndarray]):
        super().__init__()
        rows = [np.asarray(r, dtype=np.int64).reshape(-1) for r in rows]
        flat = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= num_rows):
            raise ValueError(f"RowGather: rows must lie in [0, {num_rows}); got [{flat.min()}, {flat.max()}]")
        self.num_rows = int(num_rows)
        self.num_outputs = len(rows)
        self.index = _Indices()
        # each source row's gradient is copied from the first place it was gathered; the others add
        _, first = np.unique(flat, return_index=True)
        is_first = np.zeros(flat.size, dtype=bool)
        is_first[first] = True
        self.covers_all_rows = first.size == self.num_rows
        offsets = np.concatenate([[0], np.cumsum([r.size for r in rows])]).astype(np.int64)
        for i, r in enumerate(rows):
            mine = is_first[offsets[i] : offsets[i + 1]]
            self.index.add(f"rows{i}", r)
            self.index.add(f"first_positions{i}", np.flatnonzero(mine))
            self.index.add(f"first_rows{i}", r[mine])
            self.index.add(f"repeat_positions{i}", np.flatnonzero(~mine))
            self.index.add(f"repeat_rows{i}", r[~mine])
        self.only_spans = all(self.index.is_span(f"rows{i}") for i in range(self.num_outputs))
        # the row-major sums need every read of a row in one tensor: one output
        self.sums_rows = self.num_outputs == 1 and flat.size > first.size
        if self.sums_rows:
            offsets, positions = csr_by_row(flat, self.num_rows)
            self.register_buffer("row_offsets", torch.tensor(offsets))
            self.register_buffer("row_positions", torch.tensor(positions))

    def extra_repr(self) -> str:
        sizes = [self.index.size(f"rows{i}") for i in range(self.num_outputs)]
        repeats = sum(self.index.size(f"repeat_rows{i}") for i in range(self.num_outputs))
        return f"num_rows={self.num_rows}, outputs={sizes}, repeats={repeats}"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if x.shape[0] != self.num_rows:
            raise ValueError(f"RowGather was built for {self.num_rows} rows, got a tensor of {x.shape[0]}")
        return _GatherFunction.apply(x, self)

    def gradient(self, grads: Sequence[torch.Tensor | None], like: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The source's gradient from its outputs' (None: no gradient); ``like`` gives dtype and device."""
        if self.sums_rows and grads[0] is not None and segment_sum_available(grads[0]):
            return segment_sum(grads[0], self.row_offsets, self.row_positions, self.num_rows)
        index = self.index
        grad = like.new_empty(shape) if self.covers_all_rows else like.new_zeros(shape)
        for i, g in enumerate(grads):
            if not index.size(f"first_rows{i}"):
                continue
            if g is None:
                index.zero(grad, f"first_rows{i}")
                continue
            target = index.destination(grad, f"first_rows{i}")
            if target is not None:
                index.take_into(target, g, f"first_positions{i}")
            else:
                index.put(grad, f"first_rows{i}", index.take(g, f"first_positions{i}"))
        for i, g in enumerate(grads):
            if g is not None:
                index.accumulate(grad, f"repeat_rows{i}", index.take(g, f"repeat_positions{i}"))
        return grad


class _GatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, module: RowGather):
        ctx.module = module
        ctx.like = x.new_empty(0)
        ctx.shape = x.shape
        ctx.set_materialize_grads(False)
        if not x.is_contiguous() and not module.only_spans:
            # index_select from a strided source (a split of a fused projection) takes an elementwise
            # kernel several times slower than the vectorised one a contiguous source gets
            x = x.contiguous()
        return tuple(module.index.take(x, f"rows{i}") for i in range(module.num_outputs))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        return ctx.module.gradient(grads, ctx.like, ctx.shape), None


class RowScatter(nn.Module):
    """``(p_0, p_1, ...) -> y [C, ...]`` with ``y[destinations_i] = p_i[positions_i]``.

    The destinations tile the C rows (each written once); ``lengths[i]`` is ``p_i``'s row count.
    """

    def __init__(self, num_rows: int, destinations: Sequence[np.ndarray], positions: Sequence[np.ndarray],
                 lengths: Sequence[int]):
        super().__init__()
        destinations = [np.asarray(d, dtype=np.int64).reshape(-1) for d in destinations]
        positions = [np.asarray(p, dtype=np.int64).reshape(-1) for p in positions]
        if not (len(destinations) == len(positions) == len(lengths)):
            raise ValueError("RowScatter: one destination, position list and length per packed input")
        where = np.concatenate(destinations) if destinations else np.zeros(0, dtype=np.int64)
        if where.size != num_rows or not np.array_equal(np.sort(where), np.arange(num_rows)):
            raise ValueError(f"RowScatter: the destinations must name each of the {num_rows} rows exactly once")
        self.num_rows = int(num_rows)
        self.lengths = [int(n) for n in lengths]
        self.index = _Indices()
        for i, (dst, pos, length) in enumerate(zip(destinations, positions, self.lengths)):
            if dst.size != pos.size or (pos.size and (pos.min() < 0 or pos.max() >= length)):
                raise ValueError(f"RowScatter: input {i} has {dst.size} destinations for {pos.size} positions "
                                 f"in [0, {length})")
            self.index.add(f"destinations{i}", dst)
            self.index.add(f"positions{i}", pos)
            unwritten = np.ones(length, dtype=bool)
            unwritten[pos] = False
            self.index.add(f"unwritten{i}", np.flatnonzero(unwritten))

    def extra_repr(self) -> str:
        return f"num_rows={self.num_rows}, inputs={self.lengths}"

    def forward(self, *packed: torch.Tensor) -> torch.Tensor:
        if [p.shape[0] for p in packed] != self.lengths:
            raise ValueError(f"RowScatter expects inputs of {self.lengths} rows, got {[p.shape[0] for p in packed]}")
        return _ScatterFunction.apply(self, *packed)


class _ScatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module: RowScatter, *packed):
        ctx.module = module
        first = packed[0]
        y = first.new_empty((module.num_rows, *first.shape[1:]))
        for i, p in enumerate(packed):
            target = module.index.destination(y, f"destinations{i}")
            if target is not None:  # a contiguous block of y: gathered straight into it
                module.index.take_into(target, p, f"positions{i}")
            else:
                module.index.put(y, f"destinations{i}", module.index.take(p, f"positions{i}"))
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        module, index = ctx.module, ctx.module.index
        grads = []
        for i, length in enumerate(module.lengths):
            mine = index.take(grad, f"destinations{i}")  # [n_i, ...] rows this input wrote
            if index.covers(f"positions{i}", length):
                grads.append(mine)
                continue
            g = grad.new_empty((length, *grad.shape[1:]))
            index.put(g, f"positions{i}", mine)
            index.zero(g, f"unwritten{i}")
            grads.append(g)
        return (None, *grads)
