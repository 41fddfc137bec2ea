"""Fast chunkwise gated delta rule: batched intra-chunk torch ops + one Triton state scan.

Same signature and results as :func:`harts.kernels.naive.chunk_linear_attention` (see that
module for the math and the notation G, A, P, U0, W), computed as:

(a) intra-chunk terms for all chunks of all sequences at once, in fp32, with batched torch
    ops: the pairwise decayed products ``A_ts = beta_t <k_t, e^{G_t - G_s} k_s>`` (s < t)
    and ``P_ts = scale <q_t, e^{G_t - G_s} k_s>`` (s <= t), one triangular solve of
    ``(I + A)`` for ``U0`` and ``W``, and the decayed ``Q``/``K`` of the output and of the
    chunk-end state;
(b) the cross-chunk scan as one Triton launch (:mod:`harts.kernels.state_scan`), which
    writes every state a sequence passes through (chunk starts and the final state) in fp32
    and the written values ``U``; the final and the exported states are gathers from it;
(c) backward of the scan is one reverse Triton launch, which takes the gradient of every
    state slot, so gradients sent back by consumers of exported states (later rounds that
    start from them) and of final states enter the reverse scan at their boundary;
(d) outputs ``O = (e^G * Q) h + P U`` with batched matmuls, autograd through torch.

Numerical stability of KDA's per-channel decays. ``e^{G_t - G_s}`` with s <= t is at most
1, but the factored form ``(e^{G_t}) (e^{-G_s})`` overflows when a chunk decays strongly.
Rows are therefore split into sub-chunks of (at most) 16. Inside a diagonal sub-chunk
block the exponent differences are formed pairwise ([chunks, H, sub-chunks, 16, 16, K]);
for an earlier sub-chunk j of a later sub-chunk i the product is factored through the
reference point r = the last row before sub-chunk i: ``e^{G_t - G_r} * e^{G_r - G_s}``,
both factors <= 1 because s <= r <= t, so nothing overflows and the result is exact up to
underflow of terms that are negligible anyway. These [.., K]-sized temporaries are built a
slice of chunks at a time under ``torch.utils.checkpoint`` (recomputed in backward, never
kept), so they never persist. Gated DeltaNet's scalar gates need no such care: the
[chunks, H, B, B] exponent is masked before ``exp``.

Batch invariance (opt in). cuBLAS picks GEMM and triangular-solve algorithms by shape, so
the fp32 intra-chunk terms of one chunk can round differently depending on how many other
chunks share the call; in bf16 models an occasional 1-ulp change then grows over depth.
With ``HARTS_BATCH_INVARIANT_CHUNKS=P`` (P > 0) the batched steps (a) and (d) run on pieces
of exactly P chunks (the last piece zero-padded), so every chunk is computed by the same
kernels whatever else is in the call: a sequence gives bitwise the same outputs packed
with others or alone, as in the trajectory-wise baseline. It costs one loop over pieces
and at most P - 1 padded chunks per call.

Bounds: chunk size <= 64, head dims K, V <= 256 (the scan's register tiles). Inputs may be
bf16/fp16/fp32; everything is computed in fp32, ``o`` is returned in the input dtype and
final / exported states in fp32.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from .state_scan import MAX_CHUNK_SIZE, MAX_HEAD_DIM, ScanLayout, state_scan
from .naive import _check_export_chunks

__all__ = ["chunk_linear_attention"]

#: Sub-chunk size of the stable KDA pairwise decay products.
SUB_CHUNK = 16
#: Bytes of [.., K]-sized temporaries the KDA pairwise products may use at once.
PAIRWISE_BUDGET_BYTES = 1 << 30
#: Environment variable: chunks per fixed-shape piece of the batched steps (unset or 0: one batch).
BATCH_INVARIANT_ENV = "HARTS_BATCH_INVARIANT_CHUNKS"


def invariant_piece_chunks() -> int:
    """Chunks per fixed-shape piece from ``HARTS_BATCH_INVARIANT_CHUNKS`` (0: off)."""
    value = os.environ.get(BATCH_INVARIANT_ENV, "").strip() or "0"
    try:
        piece = int(value)
    except ValueError:
        raise ValueError(f"{BATCH_INVARIANT_ENV} must be a non-negative integer, got {value!r}") from None
    if piece < 0:
        raise ValueError(f"{BATCH_INVARIANT_ENV} must be a non-negative integer, got {value!r}")
    return piece


def _in_fixed_pieces(function, tensors: Sequence[torch.Tensor], piece: int):
    """``function`` over pieces of exactly ``piece`` rows of dim 0 (the last zero-padded), results
    concatenated and trimmed; ``function`` returns a tensor or a dict of tensors, each with the
    chunk dimension first."""
    count = tensors[0].shape[0]
    if piece <= 0:
        return function(*tensors)
    padding = -count % piece
    if padding:
        tensors = [torch.cat([t, t.new_zeros(padding, *t.shape[1:])]) for t in tensors]
    results = [function(*(t[start : start + piece] for t in tensors)) for start in range(0, count + padding, piece)]
    if isinstance(results[0], dict):
        return {key: torch.cat([r[key] for r in results])[:count] for key in results[0]}
    return torch.cat(results)[:count]


def _outputs(q_decayed, starts, read, written):
    return q_decayed @ starts + read @ written  # [NT, H, B, V]
_LAYOUT_CACHE_SIZE = 64


# --------------------------------------------------------------------------- validation


def _bounds(cu_seqlens: torch.Tensor, total: int) -> np.ndarray:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a 1-D LongTensor [N+1], got {cu_seqlens!r}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must hold integers, got dtype {cu_seqlens.dtype}")
    bounds = cu_seqlens.detach().cpu().numpy().astype(np.int64)
    if bounds[0] != 0 or bounds[-1] != total or np.any(np.diff(bounds) < 0):
        raise ValueError(
            f"cu_seqlens must run non-decreasing from 0 to the packed row count {total}; got {bounds.tolist()[:8]}..."
        )
    return bounds


def _check_inputs(q, k, v, log_decay, beta, chunk_size, initial_state, num_sequences):
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [T, H, K]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    total, heads, key_dim = q.shape
    if v.dim() != 3 or v.shape[:2] != (total, heads):
        raise ValueError(f"v must be [T, H, V] = [{total}, {heads}, V]; got {tuple(v.shape)}")
    if log_decay.shape not in ((total, heads), (total, heads, key_dim)):
        raise ValueError(
            f"log_decay must be [T, H] or [T, H, K] = [{total}, {heads}(, {key_dim})]; got {tuple(log_decay.shape)}"
        )
    if beta.shape != (total, heads):
        raise ValueError(f"beta must be [T, H] = [{total}, {heads}]; got {tuple(beta.shape)}")
    if not isinstance(chunk_size, int) or not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"the fast chunk kernel supports chunk_size 1..{MAX_CHUNK_SIZE}, got {chunk_size!r}")
    value_dim = v.shape[-1]
    if key_dim > MAX_HEAD_DIM or value_dim > MAX_HEAD_DIM:
        raise ValueError(f"the fast chunk kernel supports head dims <= {MAX_HEAD_DIM}; got K {key_dim}, V {value_dim}")
    if initial_state is not None and tuple(initial_state.shape) != (num_sequences, heads, key_dim, value_dim):
        raise ValueError(
            f"initial_state must be [N, H, K, V] = [{num_sequences}, {heads}, {key_dim}, {value_dim}]; "
            f"got {tuple(initial_state.shape)}"
        )


# --------------------------------------------------------------------------- layout


class _Layout:
    """Index tensors of one (cu_seqlens, chunk size, device): chunk gathers, token scatter, state slots."""

    def __init__(self, bounds: np.ndarray, chunk_size: int, device: torch.device):
        lengths = np.diff(bounds)
        total = int(bounds[-1])
        self.num_sequences = len(lengths)
        self.chunk_counts = -(-lengths // chunk_size)
        chunk_base = np.concatenate([[0], np.cumsum(self.chunk_counts)])[:-1].astype(np.int64)
        self.num_chunks = int(self.chunk_counts.sum())
        self.state_base = chunk_base + np.arange(self.num_sequences)

        chunk_sequence = np.repeat(np.arange(self.num_sequences), self.chunk_counts)
        chunk_local = np.arange(self.num_chunks) - chunk_base[chunk_sequence]
        offsets = chunk_local[:, None] * chunk_size + np.arange(chunk_size)[None, :]
        valid = offsets < lengths[chunk_sequence][:, None]
        # row ``total`` is the zero row appended before gathering: padded rows neither decay
        # nor write, so a partial last chunk still ends in the sequence's final state
        gather = np.where(valid, bounds[chunk_sequence][:, None] + offsets, total)
        self.gather_rows = torch.as_tensor(gather.reshape(-1), dtype=torch.long, device=device)
        token_sequence = np.repeat(np.arange(self.num_sequences), lengths)
        token_local = np.arange(total) - bounds[token_sequence]
        self.token_rows = torch.as_tensor(chunk_base[token_sequence] * chunk_size + token_local, dtype=torch.long, device=device)
        self.chunk_start_slots = torch.as_tensor(self.state_base[chunk_sequence] + chunk_local, dtype=torch.long, device=device)
        self.final_slots = torch.as_tensor(self.state_base + self.chunk_counts, dtype=torch.long, device=device)
        self.scan = ScanLayout(
            torch.as_tensor(chunk_base, dtype=torch.int32, device=device),
            torch.as_tensor(self.chunk_counts, dtype=torch.int32, device=device),
            self.num_chunks,
        )

    def to_chunks(self, x: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """[T, H, ...] -> [NT, H, B, ...] (zero rows past each sequence's end)."""
        padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))], dim=0)
        chunks = padded.index_select(0, self.gather_rows).view(self.num_chunks, chunk_size, *x.shape[1:])
        return chunks.transpose(1, 2)


_layouts: OrderedDict = OrderedDict()


def _layout(bounds: np.ndarray, chunk_size: int, device: torch.device) -> _Layout:
    # every layer of a microbatch calls with the same cu_seqlens: build its index tensors once
    key = (bounds.tobytes(), chunk_size, str(device))
    layout = _layouts.get(key)
    if layout is None:
        layout = _Layout(bounds, chunk_size, device)
        _layouts[key] = layout
        if len(_layouts) > _LAYOUT_CACHE_SIZE:
            _layouts.popitem(last=False)
    else:
        _layouts.move_to_end(key)
    return layout


# --------------------------------------------------------------------------- intra-chunk terms


def _sub_chunk(chunk_size: int) -> int:
    """Largest divisor of the chunk size that is at most SUB_CHUNK."""
    return max(d for d in range(1, min(SUB_CHUNK, chunk_size) + 1) if chunk_size % d == 0)


def _kda_pairwise(q_scaled: torch.Tensor, k: torch.Tensor, cumulative: torch.Tensor, sub: int):
    """Per-channel-decayed products of one slice of chunks, [m, H, B, K] each.

    Returns ``read`` [m, H, B, B] = sum_k q_t k_s e^{G_t - G_s} (s <= t) and ``interaction``
    [m, H, B, B] = sum_k k_t k_s e^{G_t - G_s} (s < t), both without ever forming a positive
    exponent.
    """
    m, heads, chunk_size, key_dim = k.shape
    blocks = chunk_size // sub
    qb = q_scaled.view(m, heads, blocks, sub, key_dim)
    kb = k.view(m, heads, blocks, sub, key_dim)
    gb = cumulative.view(m, heads, blocks, sub, key_dim)
    device = k.device

    inclusive = torch.ones(sub, sub, dtype=torch.bool, device=device).tril()
    pair = gb.unsqueeze(4) - gb.unsqueeze(3)  # [m, H, nb, t, s, K]: G_t - G_s
    decayed_keys = torch.exp(pair.masked_fill(~inclusive[:, :, None], float("-inf"))) * kb.unsqueeze(3)
    read_diag = (decayed_keys @ qb.unsqueeze(-1)).squeeze(-1)  # [m, H, nb, t, s]
    inter_diag = (decayed_keys @ kb.unsqueeze(-1)).squeeze(-1)
    eye = torch.eye(blocks, dtype=k.dtype, device=device)[:, None, :, None]  # place block i at columns of block i
    read = (read_diag.unsqueeze(4) * eye).reshape(m, heads, blocks, sub, chunk_size)
    inter = (inter_diag.unsqueeze(4) * eye).reshape(m, heads, blocks, sub, chunk_size)

    if blocks > 1:
        reference = gb[:, :, :-1, -1]  # [m, H, nb-1, K]: G at the last row before sub-chunk i (i >= 1)
        to_reference = torch.exp(gb[:, :, 1:] - reference.unsqueeze(3))  # [m, H, nb-1, sub, K] <= 1
        q_late = qb[:, :, 1:] * to_reference
        k_late = kb[:, :, 1:] * to_reference
        starts = torch.arange(1, blocks, device=device) * sub
        earlier = torch.arange(chunk_size, device=device)[None, :] < starts[:, None]  # [nb-1, B]
        lag = reference.unsqueeze(3) - cumulative.unsqueeze(2)  # [m, H, nb-1, B, K]: G_r - G_s
        k_at_reference = k.unsqueeze(2) * torch.exp(lag.masked_fill(~earlier[:, :, None], float("-inf")))
        read_off = q_late @ k_at_reference.transpose(-1, -2)  # [m, H, nb-1, sub, B]
        inter_off = k_late @ k_at_reference.transpose(-1, -2)
        zeros = read.new_zeros(m, heads, 1, sub, chunk_size)
        read = read + torch.cat([zeros, read_off], dim=2)
        inter = inter + torch.cat([zeros, inter_off], dim=2)

    strict = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).tril(-1)
    read = read.reshape(m, heads, chunk_size, chunk_size)
    inter = inter.reshape(m, heads, chunk_size, chunk_size) * strict
    return read, inter


def _kda_products(q_scaled, k, cumulative):
    """``_kda_pairwise`` over slices of chunks, each checkpointed when it records a graph."""
    num_chunks, heads, chunk_size, key_dim = k.shape
    sub = _sub_chunk(chunk_size)
    blocks = chunk_size // sub
    # temporaries per chunk: the diagonal [B, sub, K] pairs (a few copies) and the [nb-1, B, K] lags
    per_chunk = heads * chunk_size * key_dim * 4 * (3 * sub + 2 * max(blocks - 1, 0) + 4)
    step = max(1, PAIRWISE_BUDGET_BYTES // max(per_chunk, 1))
    needs_graph = torch.is_grad_enabled() and any(t.requires_grad for t in (q_scaled, k, cumulative))
    reads, inters = [], []
    for start in range(0, num_chunks, step):
        piece = (q_scaled[start : start + step], k[start : start + step], cumulative[start : start + step])
        if needs_graph:
            read, inter = checkpoint(_kda_pairwise, *piece, sub, use_reentrant=False)
        else:
            read, inter = _kda_pairwise(*piece, sub)
        reads.append(read)
        inters.append(inter)
    if len(reads) == 1:
        return reads[0], inters[0]
    return torch.cat(reads), torch.cat(inters)


def _intra_chunk_terms(q_scaled, k, v, log_decay, beta):
    """Chunked fp32 inputs -> the scan inputs (W, U0, Kend, gamma_last) and the output terms (Q decayed, P)."""
    num_chunks, heads, chunk_size, key_dim = k.shape
    cumulative = log_decay.cumsum(dim=2)  # G: [NT, H, B, K] or [NT, H, B]
    if log_decay.dim() == 4:
        read, interaction = _kda_products(q_scaled, k, cumulative)
        gamma = cumulative.exp()  # [NT, H, B, K]
        gamma_last = gamma[:, :, -1]  # [NT, H, K]
        to_end = (cumulative[:, :, -1:] - cumulative).exp()
    else:
        inclusive = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device).tril()
        pair = cumulative.unsqueeze(3) - cumulative.unsqueeze(2)  # [NT, H, t, s]
        decay = torch.exp(pair.masked_fill(~inclusive, float("-inf")))
        read = (q_scaled @ k.transpose(-1, -2)) * decay
        interaction = (k @ k.transpose(-1, -2)) * decay.tril(-1)
        gamma = cumulative.exp().unsqueeze(-1)  # [NT, H, B, 1]
        gamma_last = gamma[:, :, -1].expand(num_chunks, heads, key_dim)
        to_end = (cumulative[:, :, -1:] - cumulative).exp().unsqueeze(-1)
    beta_col = beta.unsqueeze(-1)  # [NT, H, B, 1]
    unit_lower = interaction * beta_col + torch.eye(chunk_size, dtype=k.dtype, device=k.device)
    value_dim = v.shape[-1]
    # one solve for both right-hand sides: U0 = (I+A)^-1 diag(beta) V, W = (I+A)^-1 diag(beta) (e^G * K)
    solved = torch.linalg.solve_triangular(
        unit_lower, torch.cat([v * beta_col, k * gamma * beta_col], dim=-1), upper=False, unitriangular=True
    )
    values, state_weights = solved.split([value_dim, key_dim], dim=-1)
    return {
        "values": values,  # U0 [NT, H, B, V]
        "state_weights": state_weights,  # W [NT, H, B, K]
        "keys_to_end": k * to_end,  # Kend [NT, H, B, K]
        "gamma_last": gamma_last,  # [NT, H, K]
        "q_decayed": q_scaled * gamma,  # [NT, H, B, K]
        "read": read,  # P [NT, H, B, B]
    }


# --------------------------------------------------------------------------- entry point


def chunk_linear_attention(
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
    export_chunks: Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunkwise gated delta rule over packed sequences (fast path; see the module docstring).

    Arguments and results as :func:`harts.kernels.naive.chunk_linear_attention`; ``o`` comes
    back in the input dtype, ``final_state`` and ``exported`` in fp32.
    """
    total = q.shape[0] if q.dim() == 3 else -1
    bounds = _bounds(cu_seqlens, total)
    num_sequences = len(bounds) - 1
    _check_inputs(q, k, v, log_decay, beta, chunk_size, initial_state, num_sequences)
    _, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    layout = _layout(bounds, chunk_size, q.device)
    requests = _check_export_chunks(export_chunks, layout.chunk_counts)
    out_dtype = q.dtype
    f32 = torch.float32

    if initial_state is not None:
        initial_state = initial_state.to(f32)
    if layout.num_chunks == 0:
        # no rows at all: every state is its initial state, no request can be valid
        final = initial_state if initial_state is not None else q.new_zeros(num_sequences, heads, key_dim, value_dim, dtype=f32)
        return v.new_zeros(0, heads, value_dim, dtype=out_dtype), final, q.new_zeros(0, heads, key_dim, value_dim, dtype=f32)

    piece = invariant_piece_chunks()
    terms = _in_fixed_pieces(
        _intra_chunk_terms,
        [
            layout.to_chunks((q.to(f32) * scale), chunk_size),
            layout.to_chunks(k.to(f32), chunk_size),
            layout.to_chunks(v.to(f32), chunk_size),
            layout.to_chunks(log_decay.to(f32), chunk_size),
            layout.to_chunks(beta.to(f32), chunk_size),
        ],
        piece,
    )
    states, written = state_scan(
        terms["state_weights"], terms["values"], terms["keys_to_end"], terms["gamma_last"], initial_state, layout.scan
    )
    starts = states.index_select(0, layout.chunk_start_slots)  # h: [NT, H, K, V]
    outputs = _in_fixed_pieces(_outputs, [terms["q_decayed"], starts, terms["read"], written], piece)
    outputs = outputs.transpose(1, 2).reshape(layout.num_chunks * chunk_size, heads, value_dim)
    o = outputs.index_select(0, layout.token_rows).to(out_dtype)
    final_state = states.index_select(0, layout.final_slots)
    if requests:
        slots = torch.as_tensor(
            [int(layout.state_base[seq]) + chunk for seq, chunk in requests], dtype=torch.long, device=q.device
        )
        exported = states.index_select(0, slots)
    else:
        exported = states.new_zeros(0, heads, key_dim, value_dim)
    return o, final_state, exported
