"""Vocab-parallel compact log-probs and entropy (paper Eq. 17-19) over the tensor-parallel group.

Rank r holds the LM head's vocabulary shard ``[V / TP, D]`` (rows ``start .. start + V / TP``
of the full head, as megatron-core's ``VocabParallelEmbedding`` / output layer split it) and
every compact hidden row. It forms only its shard's logits, a block of rows at a time, so no
rank holds a ``[rows, V]`` tensor (the largest buffer is ``row_chunk x V / TP``). Per row it
reduces its shard to two numbers, the shard's log-sum-exp ``l_r`` and its softmax mean logit
``e_r``; one all-gather of ``[2, C]`` then gives every rank the row's normaliser and expected
logit::

    lse = logsumexp_r l_r,        E_p[z] = sum_r exp(l_r - lse) * e_r,     H = lse - E_p[z]

and one all-reduce of ``[P]`` brings each position's target logit from the shard that owns
its token. Backward recomputes each block's shard logits and forms their gradient with the
global normaliser (``p = exp(z - lse)``), as :class:`harts.numerics.CompactLogProbs` does for
the full vocabulary; the hidden gradient it returns is this shard's part, which the caller's
row gather (:func:`harts.parallel.mappings.gather_rows`) sums over ranks in its backward.

megatron-core's ``vocab_parallel_cross_entropy`` takes ``[rows, V / TP]`` logits, once per
position: it would expand compact rows back to positions (the saving HARTS exists for) and
hold the logits for backward; hence this function.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harts.numerics import block_logits, checked_head_inputs, compute_dtype, head_backward, row_block_bounds, row_blocks

__all__ = ["vocab_parallel_compact_log_probs"]


def _row_blocks(rows: torch.Tensor, num_rows: int, row_chunk: int):
    """Positions sorted by row and where each block of rows starts among them (from the rows' host copy when
    they have one, else one host sync: :func:`harts.numerics.row_block_bounds`)."""
    order = torch.argsort(rows, stable=True)
    sorted_rows = rows.index_select(0, order)
    return order, sorted_rows, row_block_bounds(rows, sorted_rows, num_rows, row_chunk)


class VocabParallelCompactLogProbs(torch.autograd.Function):
    """(hidden [C, D], shard weight [V/TP, D], shard bias | None, rows [P], targets [P]) -> (log-probs [P], entropy [P] | None)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, targets, vocab_start, with_entropy, row_chunk, group):
        ctx.set_materialize_grads(False)  # a measured-only entropy reaches backward as None (as in harts.numerics)
        dtype = compute_dtype(hidden.dtype)
        num_rows, shard = hidden.shape[0], weight.shape[0]
        head_weight = weight.to(dtype)
        head_bias = None if bias is None else bias.to(dtype)
        order, sorted_rows, bounds = _row_blocks(rows, num_rows, row_chunk)
        # Positions whose target another shard owns read a clamped column and are masked to zero.
        local_target = targets - vocab_start
        owned = (local_target >= 0) & (local_target < shard)
        column = local_target.clamp(0, shard - 1)
        stats = hidden.new_zeros((2, num_rows), dtype=dtype)  # this shard's [lse_r; E_r[z]] per row
        target_logits = hidden.new_zeros(rows.shape[0], dtype=dtype)
        for block, (start, end) in enumerate(row_blocks(num_rows, row_chunk)):
            logits = block_logits(hidden[start:end], head_weight, head_bias, dtype)
            block_lse = torch.logsumexp(logits, dim=-1)
            stats[0, start:end] = block_lse
            if with_entropy:
                stats[1, start:end] = (torch.exp(logits - block_lse[:, None]) * logits).sum(-1)
            first, last = bounds[block], bounds[block + 1]
            if last > first:
                positions = order[first:last]
                picked = logits[sorted_rows[first:last] - start, column.index_select(0, positions)]
                target_logits[positions] = torch.where(owned.index_select(0, positions), picked, 0.0)
            del logits
        size = dist.get_world_size(group)
        if size > 1:
            gathered = stats.new_empty((size * 2, num_rows))
            dist.all_gather_into_tensor(gathered, stats, group=group)
            gathered = gathered.view(size, 2, num_rows)
            dist.all_reduce(target_logits, group=group)
        else:
            gathered = stats[None]
        lse = torch.logsumexp(gathered[:, 0], dim=0)
        expected = (torch.exp(gathered[:, 0] - lse) * gathered[:, 1]).sum(0) if with_entropy else None
        log_probs = target_logits - lse.index_select(0, rows)
        entropy = (lse - expected).index_select(0, rows) if with_entropy else None
        ctx.save_for_backward(hidden, weight, bias, rows, column, owned, lse, expected, order, sorted_rows)
        ctx.bounds, ctx.row_chunk, ctx.with_entropy = bounds, row_chunk, with_entropy
        return log_probs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, bias, rows, column, owned, lse, expected, order, sorted_rows = ctx.saved_tensors
        # this shard's logits against the whole vocabulary's normaliser and E_p[z] (harts.numerics.head_backward)
        grads = head_backward(
            hidden, weight, bias, ctx.needs_input_grad[:3], rows=rows, lse=lse, grad_log_probs=grad_log_probs,
            grad_entropy=grad_entropy if ctx.with_entropy else None, expected=expected, target_columns=column,
            owned=owned, order=order, sorted_rows=sorted_rows, bounds=ctx.bounds, row_chunk=ctx.row_chunk,
        )
        return (*grads, None, None, None, None, None, None)


def vocab_parallel_compact_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group,
    with_entropy: bool = False,
    row_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of ``P`` positions read from ``C`` compact rows, the head split by vocabulary.

    Args:
        hidden: [C, D], the same on every rank of ``group``; weight / bias: this rank's shard
            ``[V / TP, D]`` / ``[V / TP]`` of the (temperature-scaled) LM head, starting at
            token ``vocab_start``; rows / targets: [P] compact row and next token (full
            vocabulary ids in ``[0, vocab_size)``) of each position.
    Returns:
        log_probs [P] and entropy [P] or None, equal on every rank; differentiable w.r.t.
        hidden (this shard's part of its gradient) and the shard.
    """
    rows, targets, chunk = checked_head_inputs(hidden, weight, rows, targets, vocab_size=vocab_size, row_chunk=row_chunk)
    return VocabParallelCompactLogProbs.apply(
        hidden, weight, bias, rows, targets, int(vocab_start), bool(with_entropy), chunk, group
    )
