"""Pure-torch reference of packed softmax attention with separate query/key spans, bottom-right causal."""

from __future__ import annotations

import torch

from .._checks import sequence_bounds

__all__ = ["attention"]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
) -> torch.Tensor:
    """Packed softmax attention with separate query and key spans per sequence.

    Sequence i has l_i queries and len_k_i keys. With ``causal``, alignment is bottom-right:
    query j (0-based in its span) sees keys 0 .. h_i + j where h_i = len_k_i - l_i, i.e. the
    queries are the last l_i positions of the key span. Key/value heads are repeated to the
    query heads (query head h reads kv head h // (Hq / Hkv)). Scores and softmax run in at
    least float32.

    Args:
        q: [Tq, Hq, Dk]; k: [Tk, Hkv, Dk]; v: [Tk, Hkv, Dv]; cu_seqlens_q, cu_seqlens_k: [N+1].
    Returns:
        o [Tq, Hq, Dv].
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be 3-D; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    query_heads, kv_heads = q.shape[1], k.shape[1]
    if k.shape[2] != q.shape[2] or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if query_heads % kv_heads:
        raise ValueError(f"query heads ({query_heads}) must be a multiple of key/value heads ({kv_heads})")
    q_bounds = sequence_bounds(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    k_bounds = sequence_bounds(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if len(q_bounds) != len(k_bounds):
        raise ValueError(f"cu_seqlens_q has {len(q_bounds) - 1} sequences but cu_seqlens_k has {len(k_bounds) - 1}")
    group = query_heads // kv_heads
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    pieces = []
    for sequence in range(len(q_bounds) - 1):
        q_start, q_end = int(q_bounds[sequence]), int(q_bounds[sequence + 1])
        k_start, k_end = int(k_bounds[sequence]), int(k_bounds[sequence + 1])
        num_queries, num_keys = q_end - q_start, k_end - k_start
        if num_queries == 0:
            continue
        if causal and num_keys < num_queries:
            raise ValueError(
                f"sequence {sequence}: {num_queries} queries but only {num_keys} keys; "
                "bottom-right causal attention needs len_k >= len_q"
            )
        queries = q[q_start:q_end].transpose(0, 1).to(compute_dtype)  # [Hq, l, Dk]
        keys = k[k_start:k_end].repeat_interleave(group, dim=1).transpose(0, 1).to(compute_dtype)  # [Hq, Lk, Dk]
        values = v[k_start:k_end].repeat_interleave(group, dim=1).transpose(0, 1).to(compute_dtype)  # [Hq, Lk, Dv]
        scores = (queries @ keys.transpose(-1, -2)) * scale  # [Hq, l, Lk]
        if causal:
            ancestors = num_keys - num_queries
            visible = torch.arange(num_keys, device=q.device)[None, :] <= (
                ancestors + torch.arange(num_queries, device=q.device)[:, None]
            )
            scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        pieces.append((weights @ values).transpose(0, 1).to(q.dtype))  # [l, Hq, Dv]
    if not pieces:
        return q.new_zeros(0, query_heads, v.shape[-1])
    return torch.cat(pieces, dim=0)
