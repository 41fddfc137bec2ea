"""Pure-torch reference of the packed varlen chunkwise gated delta rule (KDA, Gated DeltaNet).

All functions take packed ("varlen") inputs: the rows of N sequences are concatenated
along dim 0 and ``cu_seqlens`` ([N+1], starting at 0) marks where each sequence starts.
They run in the dtype of their inputs on any device and are differentiable end to end.

Gated delta rule (one recurrence for KDA and Gated DeltaNet). For each head, with the
state ``S`` of shape [K, V], per token t::

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = scale * S_t^T q_t

``g_t = log_decay_t`` is per key channel ([T, H, K], KDA) or one scalar per head ([T, H],
Gated DeltaNet, broadcast over K).

Chunkwise form (``chunk_linear_attention``). Each sequence is cut into chunks of B tokens
at multiples of B of its own positions. Inside a chunk with start state S0, let G_t be
the within-chunk cumulative log decay (inclusive) and write ``u_t = beta_t (v_t -
(Diag(e^{G_t - G_{t-1}}) S_{t-1})^T k_t)`` for the effective value written at t. Then::

    S_t = Diag(e^{G_t}) S0 + sum_{s<=t} Diag(e^{G_t - G_s}) k_s u_s^T
    (I + A) U = Diag(beta) V - Diag(beta) (e^{G} * K) S0,  A_ts = beta_t <k_t, e^{G_t-G_s} k_s>  (s < t)

so ``U = U0 - W S0`` with ``U0 = (I+A)^{-1} Diag(beta) V`` and ``W = (I+A)^{-1} Diag(beta)
(e^G * K)`` (the WY / UT transform, a unit lower-triangular solve), and::

    O      = scale * ((e^{G} * Q) S0 + P U),  P_ts = <q_t, e^{G_t-G_s} k_s>  (s <= t)
    S_next = Diag(e^{G_B}) S0 + (e^{G_B - G} * K)^T U

All intra-chunk quantities are computed for every chunk of every sequence at once; only
the short recurrence over chunk index runs sequentially, batched over the sequences that
still have a chunk at that index. The states after chosen chunks can be exported; they
stay in the autograd graph, so a later call that starts from one sends its gradient back
here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .._checks import sequence_bounds

__all__ = ["check_export_chunks", "check_linear_attention_inputs", "chunk_linear_attention", "recurrent_linear_attention"]


def check_linear_attention_inputs(q, k, v, log_decay, beta, cu_seqlens, chunk_size, initial_state):
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [T, H, K]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    total, heads, key_dim = q.shape
    if v.dim() != 3 or v.shape[:2] != (total, heads):
        raise ValueError(f"v must be [T, H, V] = [{total}, {heads}, V]; got {tuple(v.shape)}")
    if log_decay.shape not in ((total, heads), (total, heads, key_dim)):
        raise ValueError(
            f"log_decay must be [T, H] (per head) or [T, H, K] (per key channel) = [{total}, {heads}(, {key_dim})]; "
            f"got {tuple(log_decay.shape)}"
        )
    if beta.shape != (total, heads):
        raise ValueError(f"beta must be [T, H] = [{total}, {heads}]; got {tuple(beta.shape)}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    bounds = sequence_bounds(cu_seqlens, total, "cu_seqlens")
    num_sequences = len(bounds) - 1
    value_dim = v.shape[-1]
    if initial_state is not None and tuple(initial_state.shape) != (num_sequences, heads, key_dim, value_dim):
        raise ValueError(
            f"initial_state must be [N, H, K, V] = [{num_sequences}, {heads}, {key_dim}, {value_dim}]; "
            f"got {tuple(initial_state.shape)}"
        )
    return bounds


def check_export_chunks(export_chunks, num_chunks: np.ndarray) -> list[tuple[int, int]]:
    """Flatten export requests to (sequence, chunk count) pairs, sequence-major in the given order."""
    if export_chunks is None:
        return []
    if len(export_chunks) != len(num_chunks):
        raise ValueError(f"export_chunks must hold one list per sequence ({len(num_chunks)}), got {len(export_chunks)}")
    requests = []
    for sequence, wanted in enumerate(export_chunks):
        for chunk in wanted:
            if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)):
                raise ValueError(f"export_chunks[{sequence}] holds {chunk!r}, not an int chunk count")
            if not 1 <= chunk <= num_chunks[sequence]:
                raise ValueError(
                    f"export_chunks[{sequence}] asks for the state after chunk {chunk}, "
                    f"but sequence {sequence} has {int(num_chunks[sequence])} chunk(s)"
                )
            requests.append((sequence, int(chunk)))
    return requests


# --------------------------------------------------------------------------- chunk layout


class _ChunkLayout:
    """Index tensors that cut packed rows into per-sequence chunks of B rows (padded at the tail)."""

    def __init__(self, bounds: np.ndarray, chunk_size: int, device: torch.device):
        lengths = np.diff(bounds)
        total = int(bounds[-1])
        self.num_sequences = len(lengths)
        self.num_chunks_per_sequence = -(-lengths // chunk_size)
        self.chunk_base = np.concatenate([[0], np.cumsum(self.num_chunks_per_sequence)])[:-1]
        self.num_chunks = int(self.num_chunks_per_sequence.sum())
        self.max_chunks = int(self.num_chunks_per_sequence.max(initial=0))

        chunk_sequence = np.repeat(np.arange(self.num_sequences), self.num_chunks_per_sequence)
        chunk_local = np.arange(self.num_chunks) - self.chunk_base[chunk_sequence]
        offsets = chunk_local[:, None] * chunk_size + np.arange(chunk_size)[None, :]
        valid = offsets < lengths[chunk_sequence][:, None]
        # row index ``total`` points at the zero row appended by _to_chunks
        gather = np.where(valid, bounds[chunk_sequence][:, None] + offsets, total)
        self.gather_rows = torch.as_tensor(gather.reshape(-1), dtype=torch.long, device=device)

        token_sequence = np.repeat(np.arange(self.num_sequences), lengths)
        token_local = np.arange(total) - bounds[token_sequence]
        self.token_flat = torch.as_tensor(
            self.chunk_base[token_sequence] * chunk_size + token_local, dtype=torch.long, device=device
        )

        # Scan order: sequences sorted by chunk count (longest first) so that the ones still
        # active at chunk index c are a prefix of the state tensor.
        order = np.argsort(-self.num_chunks_per_sequence, kind="stable")
        self.order = torch.as_tensor(order, dtype=torch.long, device=device)
        self.inverse_order = torch.as_tensor(np.argsort(order, kind="stable"), dtype=torch.long, device=device)
        sorted_counts = self.num_chunks_per_sequence[order]
        self.active_per_step = [int(np.sum(sorted_counts > c)) for c in range(self.max_chunks)]
        step_chunks = [self.chunk_base[order[:active]] + c for c, active in enumerate(self.active_per_step)]
        step_major = np.concatenate(step_chunks) if step_chunks else np.zeros(0, dtype=np.int64)
        self.step_chunk_ids = [torch.as_tensor(ids, dtype=torch.long, device=device) for ids in step_chunks]
        # position of each chunk id in the step-major concatenation of per-step results
        self.step_position = np.empty(self.num_chunks, dtype=np.int64)
        self.step_position[step_major] = np.arange(self.num_chunks)
        self.step_position_tensor = torch.as_tensor(self.step_position, dtype=torch.long, device=device)

    def to_chunks(self, x: torch.Tensor, chunk_size: int) -> torch.Tensor:
        """[T, H, ...] -> [num_chunks, H, B, ...], zero rows past each sequence's end."""
        padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))], dim=0)
        chunks = padded.index_select(0, self.gather_rows).view(self.num_chunks, chunk_size, *x.shape[1:])
        return chunks.transpose(1, 2)


def _intra_chunk_terms(q, k, v, log_decay, beta):
    """Per-chunk WY terms. Inputs are chunked: q,k [n,H,B,K], v [n,H,B,V], log_decay [n,H,B(,K)], beta [n,H,B]."""
    chunk_size = q.shape[2]
    per_channel = log_decay.dim() == 4
    cumulative = log_decay.cumsum(dim=2)  # G: [n, H, B, K] or [n, H, B]
    ones = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device)
    inclusive = torch.tril(ones)
    strict = torch.tril(ones, diagonal=-1)
    if per_channel:
        pairwise = cumulative.unsqueeze(3) - cumulative.unsqueeze(2)  # [n, H, B(t), B(s), K]: G_t - G_s
        decay_incl = torch.where(inclusive[:, :, None], pairwise, float("-inf")).exp()
        decay_strict = decay_incl * strict[:, :, None]
        interaction = torch.einsum("nhtk,nhsk,nhtsk->nhts", k, k, decay_strict)
        read = torch.einsum("nhtk,nhsk,nhtsk->nhts", q, k, decay_incl)
        gamma = cumulative.exp()  # [n, H, B, K]
        gamma_last = gamma[:, :, -1]  # [n, H, K]
        to_end = (cumulative[:, :, -1:] - cumulative).exp()  # [n, H, B, K]
    else:
        pairwise = cumulative.unsqueeze(3) - cumulative.unsqueeze(2)  # [n, H, B(t), B(s)]
        decay_incl = torch.where(inclusive, pairwise, float("-inf")).exp()
        interaction = (k @ k.transpose(-1, -2)) * decay_incl * strict
        read = (q @ k.transpose(-1, -2)) * decay_incl
        gamma = cumulative.exp().unsqueeze(-1)  # [n, H, B, 1]
        gamma_last = gamma[:, :, -1]  # [n, H, 1]
        to_end = (cumulative[:, :, -1:] - cumulative).exp().unsqueeze(-1)  # [n, H, B, 1]
    beta_col = beta.unsqueeze(-1)  # [n, H, B, 1]
    unit_lower = interaction * beta_col + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    values = torch.linalg.solve_triangular(unit_lower, v * beta_col, upper=False, unitriangular=True)  # U0
    state_weights = torch.linalg.solve_triangular(
        unit_lower, k * gamma * beta_col, upper=False, unitriangular=True
    )  # W
    return {
        "values": values,  # [n, H, B, V]
        "state_weights": state_weights,  # [n, H, B, K]
        "read": read,  # [n, H, B, B]
        "q_decayed": q * gamma,  # [n, H, B, K]
        "k_to_end": k * to_end,  # [n, H, B, K]
        "gamma_last": gamma_last.unsqueeze(-1),  # [n, H, K or 1, 1]
    }


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
    """Chunkwise gated delta rule over packed sequences.

    Args:
        q, k: [T, H, K] (used as given; normalise them before the call if the model does).
        v: [T, H, V].
        log_decay: [T, H, K] (KDA) or [T, H] (Gated DeltaNet); log of the per-step state decay.
        beta: [T, H] write strength.
        cu_seqlens: [N+1] sequence starts in the packed rows.
        chunk_size: B; chunk c of sequence i covers its local positions [c*B, (c+1)*B).
        scale: output scale (usually K ** -0.5).
        initial_state: None (zeros) or [N, H, K, V].
        export_chunks: None or N lists of chunk counts c (1 <= c <= n_chunks_i): the state after
            the first min(c*B, len_i) tokens of sequence i.

    Returns:
        o [T, H, V] in v's dtype; final_state [N, H, K, V]; exported [E, H, K, V] in request
        order. Everything is computed in at least float32 (bf16 / fp16 inputs are upcast, as
        the fast kernels accumulate), so the states come back in float32 or float64.
    """
    bounds = check_linear_attention_inputs(q, k, v, log_decay, beta, cu_seqlens, chunk_size, initial_state)
    output_dtype = v.dtype
    work = torch.promote_types(q.dtype, torch.float32)
    q, k, v, log_decay, beta = (t.to(work) for t in (q, k, v, log_decay, beta))
    total, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    layout = _ChunkLayout(bounds, chunk_size, q.device)
    requests = check_export_chunks(export_chunks, layout.num_chunks_per_sequence)

    if initial_state is None:
        state = q.new_zeros(layout.num_sequences, heads, key_dim, value_dim)
    else:
        state = initial_state.to(q.dtype).index_select(0, layout.order)
    if layout.num_chunks == 0:
        # every sequence is empty, so no export request can be valid either
        exported = q.new_zeros(0, heads, key_dim, value_dim)
        return v.new_zeros(total, heads, value_dim, dtype=output_dtype), state.index_select(0, layout.inverse_order), exported

    terms = _intra_chunk_terms(
        layout.to_chunks(q * scale, chunk_size),
        layout.to_chunks(k, chunk_size),
        layout.to_chunks(v, chunk_size),
        layout.to_chunks(log_decay, chunk_size),
        layout.to_chunks(beta, chunk_size),
    )

    step_outputs, step_states = [], []
    for step, active in enumerate(layout.active_per_step):
        ids = layout.step_chunk_ids[step]
        start = state[:active]  # [m, H, K, V]
        written = terms["values"][ids] - terms["state_weights"][ids] @ start  # U: [m, H, B, V]
        step_outputs.append(terms["q_decayed"][ids] @ start + terms["read"][ids] @ written)
        after = start * terms["gamma_last"][ids] + terms["k_to_end"][ids].transpose(-1, -2) @ written
        step_states.append(after)
        state = after if active == layout.num_sequences else torch.cat([after, state[active:]], dim=0)

    outputs = torch.cat(step_outputs, dim=0).index_select(0, layout.step_position_tensor)  # [n, H, B, V]
    outputs = outputs.transpose(1, 2).reshape(layout.num_chunks * chunk_size, heads, value_dim)
    o = outputs.index_select(0, layout.token_flat)
    final_state = state.index_select(0, layout.inverse_order)
    if requests:
        chunk_ids = [int(layout.chunk_base[seq]) + chunk - 1 for seq, chunk in requests]
        positions = torch.as_tensor(layout.step_position[chunk_ids], dtype=torch.long, device=q.device)
        exported = torch.cat(step_states, dim=0).index_select(0, positions)
    else:
        exported = q.new_zeros(0, heads, key_dim, value_dim)
    return o.to(output_dtype), final_state, exported


def recurrent_linear_attention(
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
    """Token-by-token gated delta rule, the test oracle of ``chunk_linear_attention``.

    Same arguments and results; ``chunk_size`` only fixes where exported states are taken
    (after min(c * chunk_size, len_i) tokens).
    """
    bounds = check_linear_attention_inputs(q, k, v, log_decay, beta, cu_seqlens, chunk_size, initial_state)
    total, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    lengths = np.diff(bounds)
    num_chunks = -(-lengths // chunk_size)
    requests = check_export_chunks(export_chunks, num_chunks)
    per_channel = log_decay.dim() == 3

    outputs, finals, boundary_states = [], [], []
    for sequence in range(len(lengths)):
        if initial_state is None:
            state = q.new_zeros(heads, key_dim, value_dim)
        else:
            state = initial_state[sequence].to(q.dtype)
        after_chunk = {}
        start = int(bounds[sequence])
        for local in range(int(lengths[sequence])):
            t = start + local
            decay = log_decay[t].exp()
            decay = decay.unsqueeze(-1) if per_channel else decay[:, None, None]
            state = state * decay
            predicted = torch.einsum("hk,hkv->hv", k[t], state)
            correction = (v[t] - predicted) * beta[t].unsqueeze(-1)
            state = state + k[t].unsqueeze(-1) * correction.unsqueeze(-2)
            outputs.append(torch.einsum("hk,hkv->hv", q[t] * scale, state))
            if (local + 1) % chunk_size == 0:
                after_chunk[(local + 1) // chunk_size] = state
        if lengths[sequence] % chunk_size:
            after_chunk[int(num_chunks[sequence])] = state
        finals.append(state)
        boundary_states.append(after_chunk)

    o = torch.stack(outputs) if outputs else v.new_zeros(0, heads, value_dim)
    final_state = torch.stack(finals) if finals else q.new_zeros(0, heads, key_dim, value_dim)
    if requests:
        exported = torch.stack([boundary_states[seq][chunk] for seq, chunk in requests])
    else:
        exported = q.new_zeros(0, heads, key_dim, value_dim)
    return o, final_state, exported


