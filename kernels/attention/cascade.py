"""Tree attention split at the forks: each sequence's own rows in place, each shared prefix read once per fork.

A plan's sequence attends to its true ancestors' rows and then its own rows, causally. Gathering one
key/value view per sequence (:func:`harts.codegen.fx.build_attention_program`) copies every shared
prefix once for every branch that reads it: on the headline plan 184,284 view rows for 34,395 compact
rows, each a key and a value row, gathered twice per layer (forward and recompute) and summed back in
the backward. The attention of a query over its keys splits exactly into parts over disjoint key sets
merged by their log-sum-exps, so here it runs as:

* **own part**: every sequence's queries against its own rows, causal, straight on the compact q, k, v
  (they are contiguous per sequence): one call, nothing gathered;
* **prefix part**: one entry per distinct ancestor run (a contiguous range of compact rows that some
  sequences see whole, from the start of an ancestor sequence to their fork from it): the queries of
  every sequence that sees that run, against it, non-causal (all of it precedes them): one call over
  all entries. On the headline plan 36 entries gather about 50K query rows and 54K key/value rows;
* **merge**: each row's parts combined by their log-sum-exps (:func:`merge_attention_parts`; the
  reference is :func:`harts.kernels.attention.naive.merge_attention_parts`).

The backward is exact without differentiating the merge: FlashAttention's backward recomputes the
probabilities as ``exp(scores - lse)`` from the log-sum-exp it is handed and takes ``D = rowsum(dO * O)``
from the output it is handed. Given the merged output and log-sum-exp, each part's backward therefore
yields that part's share of the full softmax's gradients; the parts' query, key and value gradients
are summed (:func:`harts.kernels.rows.segment_sum.segment_sum`, one deterministic pass per tensor).

This is the cascade (shared-prefix) decomposition that inference engines use for decoding, applied to
training: HARTS needs it with a backward and for many nested prefixes at once, which none of the
libraries we build on provides, so it is written here on top of the kernel set's attention forward and
backward (FlashAttention-2 on the GPU, :mod:`.naive` elsewhere).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..linear_attention.state import TRITON_AVAILABLE, interpreter_enabled, tl, triton
from ..rows.naive import segment_sum_reference
from ..rows.segment_sum import csr_by_row, segment_sum, segment_sum_available
from . import naive

__all__ = ["CascadeAttention", "merge_attention_parts", "prefix_split"]


def prefix_split(seq_row_start: np.ndarray, ancestor_rows: np.ndarray, ancestor_offsets: np.ndarray) -> dict[str, np.ndarray]:
    """The prefix part's entries for a layout's sequences (rows contiguous per sequence, ``seq_row_start``)
    whose true-ancestor rows are ``ancestor_rows[ancestor_offsets[s]:ancestor_offsets[s + 1]]``.

    Each sequence's ancestor rows split into maximal runs of consecutive rows; an entry is one distinct run,
    and its queries are the rows of every sequence whose ancestors contain that run, in sequence order.
    Entries are ordered by (first row, end). Returns ``query_rows`` [Q], ``query_bounds`` [E + 1],
    ``key_rows`` [K] and ``key_bounds`` [E + 1] (int64).
    """
    entries: dict[tuple[int, int], list[int]] = {}
    for sequence in range(len(seq_row_start) - 1):
        rows = ancestor_rows[ancestor_offsets[sequence] : ancestor_offsets[sequence + 1]]
        if not rows.size:
            continue
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        starts = np.concatenate([[0], breaks])
        ends = np.concatenate([breaks, [rows.size]])
        for start, end in zip(starts.tolist(), ends.tolist()):
            entries.setdefault((int(rows[start]), int(rows[end - 1]) + 1), []).append(sequence)
    query_parts, key_parts, query_lengths, key_lengths = [], [], [], []
    for (first, end), sequences in sorted(entries.items()):
        queries = [np.arange(seq_row_start[s], seq_row_start[s + 1], dtype=np.int64) for s in sequences]
        query_parts.extend(queries)
        query_lengths.append(sum(q.size for q in queries))
        key_parts.append(np.arange(first, end, dtype=np.int64))
        key_lengths.append(end - first)

    def bounds(lengths):
        out = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=out[1:])
        return out

    empty = np.zeros(0, dtype=np.int64)
    return {
        "query_rows": np.concatenate(query_parts) if query_parts else empty,
        "query_bounds": bounds(query_lengths),
        "key_rows": np.concatenate(key_parts) if key_parts else empty,
        "key_bounds": bounds(key_lengths),
    }


# ----------------------------------------------------------------------------- merge


def merge_available(o: torch.Tensor) -> bool:
    """Whether :func:`merge_attention_parts`' Triton kernel runs here: Triton, and CUDA or the interpreter."""
    return TRITON_AVAILABLE and (o.is_cuda or (interpreter_enabled() and o.device.type == "cpu"))


if TRITON_AVAILABLE:

    @triton.jit
    def _merge_kernel(o, lse, o_parts, lse_parts, offsets, positions, num_rows, num_parts, heads, width,
                      BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        start = tl.load(offsets + row)
        end = tl.load(offsets + row + 1)
        if end > start:
            columns = tl.arange(0, BLOCK)
            inside = columns < width
            peak = tl.load(lse + head * num_rows + row)
            acc = tl.load(o + (row * heads + head) * width + columns, mask=inside, other=0.0).to(tl.float32)
            total = peak * 0.0 + 1.0
            for j in range(start, end):
                part = tl.load(positions + j).to(tl.int64)
                part_lse = tl.load(lse_parts + head * num_parts + part)
                new_peak = tl.maximum(peak, part_lse)
                keep = tl.exp(peak - new_peak)
                weight = tl.exp(part_lse - new_peak)
                values = tl.load(o_parts + (part * heads + head) * width + columns, mask=inside, other=0.0)
                acc = acc * keep + values.to(tl.float32) * weight
                total = total * keep + weight
                peak = new_peak
            tl.store(o + (row * heads + head) * width + columns, (acc / total).to(o.dtype.element_ty), mask=inside)
            tl.store(lse + head * num_rows + row, peak + tl.log(total))


def merge_attention_parts(o, lse, o_parts, lse_parts, offsets, positions):
    """:func:`harts.kernels.attention.naive.merge_attention_parts` in one Triton launch, written into ``o`` and
    ``lse``: one program per (row, head) folds the row's parts into its own in fp32, online (running maximum),
    in ``positions`` order; rows with no further parts are left as they are. Same arguments; ``o`` and
    ``o_parts`` contiguous, ``lse`` and ``lse_parts`` contiguous float32."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("merge_attention_parts needs Triton")
    num_rows, heads, width = o.shape
    if lse.dtype != torch.float32 or lse_parts.dtype != torch.float32:
        raise ValueError(f"merge_attention_parts: log-sum-exps must be float32, got {lse.dtype} and {lse_parts.dtype}")
    for name, tensor in (("o", o), ("lse", lse), ("o_parts", o_parts), ("lse_parts", lse_parts)):
        if not tensor.is_contiguous():
            raise ValueError(f"merge_attention_parts: {name} must be contiguous")
    if num_rows and heads and width:
        block = triton.next_power_of_2(width)
        _merge_kernel[(num_rows, heads)](o, lse, o_parts, lse_parts, offsets, positions, num_rows, o_parts.shape[0],
                                         heads, width, BLOCK=block, num_warps=4 if block >= 128 else 1)
    return o, lse


def _merge(o, lse, o_parts, lse_parts, offsets, positions):
    if merge_available(o) and lse.dtype == torch.float32:
        return merge_attention_parts(o, lse, o_parts.contiguous(), lse_parts.contiguous(), offsets, positions)
    return naive.merge_attention_parts(o, lse, o_parts, lse_parts, offsets, positions)


def _sum_into(base, grad, offsets, positions):
    """``base[r] += sum of grad[positions[offsets[r]:offsets[r+1]]]`` in one pass, into ``base``."""
    if segment_sum_available(grad) and base.is_contiguous():
        return segment_sum(grad, offsets, positions, base.shape[0], base=base)
    return segment_sum_reference(grad, offsets, positions, base.shape[0], base=base)


# ----------------------------------------------------------------------------- module


class CascadeAttention(nn.Module):
    """``(q, k, v, scale) -> o``: a layout's tree attention as an own part, a prefix part and their merge.

    Built from the layout's arrays (``seq_row_start`` [S + 1], its sequences' true-ancestor rows) and the
    kernel set whose ``attention_forward`` / ``attention_backward`` run the parts. q: [C, Hq, Dk]; k: [C, Hkv, Dk];
    v: [C, Hkv, Dv] on the compact rows. Values wider than the keys (a kernel set's padded MLA values) have
    the queries and keys padded to their width, which leaves every score unchanged.
    """

    def __init__(self, num_rows: int, seq_row_start: np.ndarray, ancestor_rows: np.ndarray,
                 ancestor_offsets: np.ndarray, kernels):
        super().__init__()
        split = prefix_split(seq_row_start, ancestor_rows, ancestor_offsets)
        self.num_rows = int(num_rows)
        self.kernels = kernels
        self.num_entries = len(split["query_bounds"]) - 1
        self.register_buffer("own_bounds", torch.tensor(np.asarray(seq_row_start, dtype=np.int64)))
        self.register_buffer("query_rows", torch.tensor(split["query_rows"]))
        self.register_buffer("query_bounds", torch.tensor(split["query_bounds"]))
        self.register_buffer("key_rows", torch.tensor(split["key_rows"]))
        self.register_buffer("key_bounds", torch.tensor(split["key_bounds"]))
        # each compact row's entries (the merge, and the query gradients) and each key row's reads
        for name, rows in (("query", split["query_rows"]), ("key", split["key_rows"])):
            offsets, positions = csr_by_row(rows, self.num_rows)
            self.register_buffer(f"{name}_offsets", torch.tensor(offsets))
            self.register_buffer(f"{name}_positions", torch.tensor(positions))

    def extra_repr(self) -> str:
        return (f"num_rows={self.num_rows}, entries={self.num_entries}, query_rows={self.query_rows.numel()}, "
                f"key_rows={self.key_rows.numel()}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        if q.shape[0] != self.num_rows:
            raise ValueError(f"CascadeAttention was built for {self.num_rows} rows, got q of {q.shape[0]}")
        width = v.shape[-1]
        if width > q.shape[-1]:
            q = nn.functional.pad(q, (0, width - q.shape[-1]))
            k = nn.functional.pad(k, (0, width - k.shape[-1]))
        return _CascadeFunction.apply(q, k, v, self, float(scale))


class _CascadeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, module: CascadeAttention, scale: float):
        kernels = module.kernels
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        own = module.own_bounds
        o, lse, own_state = kernels.attention_forward(q, k, v, own, own, scale=scale, causal=True)
        prefix_state = None
        if module.num_entries:
            q_prefix = q.index_select(0, module.query_rows)  # [Q, Hq, D]
            k_prefix = k.index_select(0, module.key_rows)  # [K, Hkv, D]
            v_prefix = v.index_select(0, module.key_rows)
            o_prefix, lse_prefix, prefix_state = kernels.attention_forward(
                q_prefix, k_prefix, v_prefix, module.query_bounds, module.key_bounds, scale=scale, causal=False
            )
            o, lse = _merge(o, lse, o_prefix, lse_prefix, module.query_offsets, module.query_positions)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.module, ctx.scale, ctx.states = module, scale, (own_state, prefix_state)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, d_o):
        q, k, v, o, lse = ctx.saved_tensors
        module, scale = ctx.module, ctx.scale
        own_state, prefix_state = ctx.states
        kernels = module.kernels
        d_o = d_o.contiguous()
        own = module.own_bounds
        dq, dk, dv = kernels.attention_backward(d_o, q, k, v, o, lse, own, own, own_state, scale=scale, causal=True)
        if module.num_entries:
            rows, keys = module.query_rows, module.key_rows
            dq_prefix, dk_prefix, dv_prefix = kernels.attention_backward(
                d_o.index_select(0, rows), q.index_select(0, rows), k.index_select(0, keys), v.index_select(0, keys),
                o.index_select(0, rows), lse.index_select(1, rows).contiguous(), module.query_bounds, module.key_bounds,
                prefix_state, scale=scale, causal=False,
            )
            dq = _sum_into(dq.contiguous(), dq_prefix, module.query_offsets, module.query_positions)
            dk = _sum_into(dk.contiguous(), dk_prefix, module.key_offsets, module.key_positions)
            dv = _sum_into(dv.contiguous(), dv_prefix, module.key_offsets, module.key_positions)
        return dq, dk, dv, None, None
