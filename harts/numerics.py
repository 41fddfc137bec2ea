"""Numerics shared by code generation and the runtime: the compute dtype and the
compact-to-semantic log-probabilities (§3.5, Eq. 17-19).

Both the generated log-prob program (:mod:`harts.codegen.fx`) and the runtime
(:mod:`harts.runtime`) import this module; it imports neither, so neither import order
makes a cycle.

A compact row c holds the hidden state of every semantic position s with m(s) = c. Its
logit row z_c is needed once for the vocabulary-wide normaliser; each position then only
reads one scalar, its own target's logit::

    lambda_s = z[m(s), y_s] - logsumexp(z[m(s)])

:class:`CompactLogProbs` computes this straight from the hidden rows and the LM-head
weight, a block of rows at a time, so the largest vocabulary-sized buffer is
``row_chunk x V`` (never ``S x V``, not even ``C x V`` unless one block covers every row).
Backward recomputes each block's logits and forms its gradient once, accumulating the
contributions of every position that reads the row (Eq. 19)::

    dL/dz_c = sum_{s: m(s)=c} g_s * (onehot(y_s) - softmax(z_c))

The optional entropy of each row's distribution, H_c = logsumexp(z_c) - E_p[z_c], is mapped
to positions the same way (its gradient is -p * (z - E_p[z])).
"""

from __future__ import annotations

import numpy as np
import torch

from harts.kernels import host
from harts.kernels.head import naive as softmax_reference
from harts.kernels.head import softmax as softmax_kernels

#: Vocabulary-sized elements of one row block (with ~3 such buffers alive in backward: 768 MiB in
#: fp32). Every block costs a dozen kernel launches and a thin GEMM, so the block is as large as
#: that memory allows: on an H200 (ling-3.0-tiny, 157K vocabulary) 106-row blocks (2^24) took
#: 2.79 s per F/B/Grad pass, 426-row blocks (2^26) 2.44 s and 853-row blocks 2.43 s.
DEFAULT_BLOCK_ELEMENTS = 1 << 26

#: Rows of a block are a multiple of this when the block holds more (whole GEMM tiles).
ROW_BLOCK_MULTIPLE = 64


def default_row_chunk(num_rows: int, vocab_size: int) -> int:
    """Rows per vocabulary block: as many as ``DEFAULT_BLOCK_ELEMENTS`` allow, at most ``num_rows``."""
    rows = DEFAULT_BLOCK_ELEMENTS // max(vocab_size, 1)
    if rows > ROW_BLOCK_MULTIPLE:
        rows -= rows % ROW_BLOCK_MULTIPLE
    return max(1, min(max(num_rows, 1), rows))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype numerically sensitive parts run in: at least float32, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def block_logits(hidden_block, weight, bias, dtype):
    """One block's logits; ``weight`` and ``bias`` are already in ``dtype``."""
    logits = hidden_block.to(dtype) @ weight.t()
    if bias is not None:
        logits = logits + bias
    return logits


def _head_in(dtype, weight, bias):
    """The LM head in the compute dtype, cast once per pass: a bf16 vocabulary matrix cast per
    block of rows was the largest copy of a training pass (hundreds of blocks, each reading the
    whole matrix)."""
    return weight.to(dtype), (None if bias is None else bias.to(dtype))


def _softmax_ops(logits: torch.Tensor):
    """(row lse / entropy, logits' gradient) for this block: the Triton kernels (the gradient written over the
    logits) for fp32 blocks on CUDA, else the torch ops of the reference; both take the same arguments."""
    if softmax_kernels.available(logits):
        return softmax_kernels.row_lse_entropy, softmax_kernels.softmax_backward_
    return softmax_reference.row_lse_entropy, softmax_reference.softmax_backward


def row_blocks(num_rows: int, row_chunk: int):
    for start in range(0, num_rows, row_chunk):
        yield start, min(num_rows, start + row_chunk)


def row_block_bounds(rows: torch.Tensor, sorted_rows: torch.Tensor, num_rows: int, row_chunk: int) -> list[int]:
    """Where each block of ``row_chunk`` rows starts among the positions sorted by row (``sorted_rows``:
    ``rows`` sorted), and where the last ends: from the host copy of ``rows`` when it has one (a plan's
    rows, :mod:`harts.kernels.host`), once per row chunk; else read from the device (a sync)."""

    def on_host(values: np.ndarray) -> list[int]:
        return np.searchsorted(np.sort(values), np.arange(0, num_rows + row_chunk, row_chunk)).tolist()

    known = host.cached(rows, ("row_block_bounds", num_rows, row_chunk), on_host)
    if known is not None:
        return known
    return torch.searchsorted(sorted_rows, torch.arange(0, num_rows + row_chunk, row_chunk, device=rows.device)).tolist()


class CompactLogProbs(torch.autograd.Function):
    """(hidden [C, D], weight [V, D], bias [V] | None, rows [P], targets [P]) -> (log-probs [P], entropy [P] | None)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, targets, with_entropy, row_chunk):
        # An output the loss does not use (the entropy, when it is only measured) must reach backward
        # as None, not as materialised zeros: zeros would run the entropy's [rows, V] gradient terms
        # for nothing, block by block.
        ctx.set_materialize_grads(False)
        dtype = compute_dtype(hidden.dtype)
        num_rows = hidden.shape[0]
        order = torch.argsort(rows, stable=True)
        sorted_rows = rows.index_select(0, order)
        block_bounds = row_block_bounds(rows, sorted_rows, num_rows, row_chunk)
        lse = hidden.new_empty(num_rows, dtype=dtype)
        entropy_rows = hidden.new_empty(num_rows, dtype=dtype) if with_entropy else None
        target_logits = hidden.new_empty(rows.shape[0], dtype=dtype)
        head_weight, head_bias = _head_in(dtype, weight, bias)
        for block, (start, end) in enumerate(row_blocks(num_rows, row_chunk)):
            logits = block_logits(hidden[start:end], head_weight, head_bias, dtype)  # [b, V]
            block_lse, block_entropy = _softmax_ops(logits)[0](logits, with_entropy)
            lse[start:end] = block_lse
            if with_entropy:
                entropy_rows[start:end] = block_entropy
            first, last = block_bounds[block], block_bounds[block + 1]
            if last > first:
                positions = order[first:last]
                target_logits[positions] = logits[sorted_rows[first:last] - start, targets.index_select(0, positions)]
            del logits
        del head_weight, head_bias
        log_probs = target_logits - lse.index_select(0, rows)
        entropy = entropy_rows.index_select(0, rows) if with_entropy else None
        ctx.save_for_backward(hidden, weight, bias, rows, targets, lse, order, sorted_rows)
        ctx.block_bounds = block_bounds
        ctx.row_chunk = row_chunk
        ctx.with_entropy = with_entropy
        return log_probs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, bias, rows, targets, lse, order, sorted_rows = ctx.saved_tensors
        grads = head_backward(
            hidden, weight, bias, ctx.needs_input_grad[:3], rows=rows, lse=lse, grad_log_probs=grad_log_probs,
            grad_entropy=grad_entropy if ctx.with_entropy else None, expected=None, target_columns=targets, owned=None,
            order=order, sorted_rows=sorted_rows, bounds=ctx.block_bounds, row_chunk=ctx.row_chunk,
        )
        return (*grads, None, None, None, None)


def head_backward(hidden, weight, bias, needs, *, rows, lse, grad_log_probs, grad_entropy, expected, target_columns,
                  owned, order, sorted_rows, bounds, row_chunk):
    """Gradients (hidden, weight, bias) of compact log-probs and entropies through an LM head, whole or one
    vocabulary shard of it, recomputing its logits block by block of ``row_chunk`` rows.

    ``lse`` [C] is each row's normaliser over the whole vocabulary and ``expected`` [C] its E_p[z] over
    the whole vocabulary (None: taken from the block's own logits, exact when the head is whole);
    ``target_columns`` [P] is each position's target column in this head and ``owned`` [P] (None: all)
    whether this head holds that column. ``order`` / ``sorted_rows`` / ``bounds`` place the positions
    by row block, as the forward sorted them. ``needs``: which of hidden, weight, bias want gradients.
    """
    dtype = lse.dtype
    num_rows = hidden.shape[0]
    row_grad = torch.zeros(num_rows, dtype=dtype, device=hidden.device)
    if grad_log_probs is not None:
        grad_log_probs = grad_log_probs.to(dtype)
        row_grad.index_add_(0, rows, grad_log_probs)
        if owned is not None:  # a target another shard holds gets its one-hot term there
            grad_log_probs = torch.where(owned, grad_log_probs, 0.0)
    entropy_grad = None
    if grad_entropy is not None:
        entropy_grad = torch.zeros(num_rows, dtype=dtype, device=hidden.device)
        entropy_grad.index_add_(0, rows, grad_entropy.to(dtype))
    need_hidden, need_weight, need_bias = needs
    grad_hidden = torch.zeros_like(hidden) if need_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
    grad_bias = torch.zeros(weight.shape[0], dtype=dtype, device=weight.device) if (need_bias and bias is not None) else None
    head_weight, head_bias = _head_in(dtype, weight, bias)
    for block, (start, end) in enumerate(row_blocks(num_rows, row_chunk)):
        block_hidden = hidden[start:end].to(dtype)
        logits = block_logits(block_hidden, head_weight, head_bias, dtype)
        block_entropy_grad = None if entropy_grad is None else entropy_grad[start:end]
        block_expected = None if expected is None else expected[start:end]
        softmax_backward = _softmax_ops(logits)[1]
        grad_logits = softmax_backward(logits, lse[start:end], row_grad[start:end], block_entropy_grad, block_expected)
        del logits
        first, last = bounds[block], bounds[block + 1]
        if grad_log_probs is not None and last > first:
            positions = order[first:last]
            grad_logits.index_put_(
                (sorted_rows[first:last] - start, target_columns.index_select(0, positions)),
                grad_log_probs.index_select(0, positions),
                accumulate=True,
            )
        if grad_hidden is not None:
            grad_hidden[start:end] = (grad_logits @ head_weight).to(hidden.dtype)
        if grad_weight is not None:
            # accumulated by the GEMM itself (beta = 1): `grad_weight += grad_logits.t() @ block_hidden` wrote a
            # [V, D] fp32 temporary per block and read it back, 0.74 ms a block on an H200 at a 157K vocabulary
            grad_weight.addmm_(grad_logits.t(), block_hidden)
        if grad_bias is not None:
            grad_bias += grad_logits.sum(0)
        del grad_logits
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias


def outside(values: torch.Tensor, low: int, high: int) -> bool:
    """Whether a value of the (non-empty) integer tensor lies outside ``[low, high)``.

    Decided on the host when the tensor's values are known there (:func:`harts.kernels.host.value_range`:
    a plan's rows, token ids put on the device by the runtime, or ids gathered from those); otherwise,
    or when that range does not settle it, by reading the minimum and maximum from the device (a sync).
    """
    known = host.value_range(values)
    if known is not None and low <= known[0] and known[1] < high:
        return False
    return int(values.min()) < low or int(values.max()) >= high


def checked_head_inputs(hidden, weight, rows, targets, *, vocab_size: int, row_chunk: int | None):
    """The log-prob head's inputs checked (shapes, row and token ranges) and put on ``hidden``'s device as
    longs, with the row chunk to use: (rows, targets, row_chunk). ``weight`` may be a vocabulary shard."""
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden must be [C, D] and weight [V, D] (or a shard of V); got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if rows.shape != targets.shape or rows.dim() != 1:
        raise ValueError(f"rows and targets must be 1-D of one length; got {tuple(rows.shape)} and {tuple(targets.shape)}")
    rows = rows.to(device=hidden.device, dtype=torch.long)
    targets = targets.to(device=hidden.device, dtype=torch.long)
    if rows.numel():
        if outside(rows, 0, hidden.shape[0]):
            raise ValueError(f"rows must lie in [0, {hidden.shape[0]})")
        if outside(targets, 0, vocab_size):
            bad = int(targets.max()) if int(targets.max()) >= vocab_size else int(targets.min())
            raise ValueError(f"target token {bad} is outside the vocabulary [0, {vocab_size})")
    chunk = row_chunk if row_chunk is not None else default_row_chunk(hidden.shape[0], weight.shape[0])
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"row_chunk must be a positive int, got {row_chunk!r}")
    return rows, targets, chunk


def compact_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: torch.Tensor,
    targets: torch.Tensor,
    *,
    with_entropy: bool = False,
    row_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally entropies) of ``P`` positions read from ``C`` compact rows.

    Args:
        hidden: [C, D] final hidden rows; weight: [V, D] and bias: [V] or None, the LM head.
        rows: [P] the compact row m(s) of each position; targets: [P] its next token y_s.
        with_entropy: also return each position's predictive entropy.
        row_chunk: rows per vocabulary block (default: about 16M logits per block).
    Returns:
        log_probs [P] (in at least float32), entropy [P] or None; differentiable w.r.t.
        hidden, weight and bias.
    """
    rows, targets, chunk = checked_head_inputs(hidden, weight, rows, targets, vocab_size=weight.shape[0], row_chunk=row_chunk)
    return CompactLogProbs.apply(hidden, weight, bias, rows, targets, bool(with_entropy), chunk)


def log_probs_from_logits(
    logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, *, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same mapping for a head whose logits are already formed, once per row ([C, V]).

    Used when the model's head is not a plain linear layer, so :func:`compact_log_probs`
    cannot recompute the logits block by block; the normaliser is still one per row.
    """
    logits = logits.to(compute_dtype(logits.dtype))
    normaliser = torch.logsumexp(logits, dim=-1)
    log_probs = logits[rows, targets] - normaliser.index_select(0, rows)
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = (normaliser - (probs * logits).sum(-1)).index_select(0, rows)
    return log_probs, entropy
