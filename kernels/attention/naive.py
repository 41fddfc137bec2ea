"""Pure-torch reference of packed softmax attention with separate query/key spans, bottom-right causal."""

from __future__ import annotations

import numpy as np
import torch

from .._checks import sequence_bounds

__all__ = ["attention", "attention_backward", "attention_forward", "merge_attention_parts"]


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
    q_bounds, k_bounds = _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    pieces = [(torch.softmax(scores, dim=-1) @ values).transpose(0, 1).to(q.dtype)  # [l, Hq, Dv]
              for _, _, scores, _, values in _sequences(q, k, v, q_bounds, k_bounds, scale, causal)]
    if not pieces:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    return torch.cat(pieces, dim=0)


def attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale: float, causal: bool = True):
    """:func:`attention` and each query's log-sum-exp of scores, so that attention over a split key set can
    be merged (:mod:`harts.kernels.attention.cascade`).

    Returns:
        (o [Tq, Hq, Dv] in q's dtype, lse [Hq, Tq] in at least float32, ``None``: what
        :func:`attention_backward` is handed back, where the fast path keeps its kernel's state).
        A query with no keys gets o = 0 and lse = -inf.
    """
    q_bounds, k_bounds = _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    o = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32),
                     device=q.device)
    for rows, _, scores, _, values in _sequences(q, k, v, q_bounds, k_bounds, scale, causal):
        if scores.shape[-1]:
            o[rows] = (torch.softmax(scores, dim=-1) @ values).transpose(0, 1).to(q.dtype)
            lse[:, rows] = torch.logsumexp(scores, dim=-1)
    return o, lse, None


def attention_backward(d_o, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, state=None, *, scale: float,
                       causal: bool = True):
    """Gradients of q, k, v for attention whose softmax normaliser ``lse`` and output ``o`` may cover more keys
    than these: the probabilities are ``exp(scores - lse)`` and ``D = rowsum(d_o * o)``, exactly FlashAttention's
    backward given its saved output and log-sum-exp. With this call's own ``o`` and ``lse`` it is the plain
    attention backward; with the merged ``o`` and ``lse`` of a split key set, each part's call gives that part's
    share of the full softmax's gradients (their q gradients sum to the full one).

    Args:
        d_o, o: [Tq, Hq, Dv]; q: [Tq, Hq, Dk]; k: [Tk, Hkv, Dk]; v: [Tk, Hkv, Dv]; lse: [Hq, Tq];
        ``state``: what :func:`attention_forward` returned (unused here).
    Returns:
        dq, dk, dv in the dtypes of q, k, v.
    """
    q_bounds, k_bounds = _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    group = q.shape[1] // k.shape[1]
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    dk = torch.zeros((k.shape[0], q.shape[1], k.shape[2]), dtype=compute_dtype, device=q.device)
    dv = torch.zeros((v.shape[0], q.shape[1], v.shape[2]), dtype=compute_dtype, device=q.device)
    for rows, key_rows, scores, keys, values in _sequences(q, k, v, q_bounds, k_bounds, scale, causal):
        probabilities = torch.exp(scores - lse[:, rows, None].to(compute_dtype))  # [Hq, l, Lk]
        grad = d_o[rows].transpose(0, 1).to(compute_dtype)  # [Hq, l, Dv]
        delta = (grad * o[rows].transpose(0, 1).to(compute_dtype)).sum(-1, keepdim=True)  # [Hq, l, 1]
        d_scores = probabilities * (grad @ values.transpose(-1, -2) - delta)  # [Hq, l, Lk]
        queries = q[rows].transpose(0, 1).to(compute_dtype)
        dq[rows] += (d_scores @ keys * scale).transpose(0, 1)
        dk[key_rows] += (d_scores.transpose(-1, -2) @ queries * scale).transpose(0, 1)
        dv[key_rows] += (probabilities.transpose(-1, -2) @ grad).transpose(0, 1)
    # query head h read kv head h // group: its key/value gradients sum over the group
    dk = dk.unflatten(1, (k.shape[1], group)).sum(2)
    dv = dv.unflatten(1, (k.shape[1], group)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k) -> tuple[np.ndarray, np.ndarray]:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be 3-D; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[2] != q.shape[2] or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    q_bounds = sequence_bounds(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    k_bounds = sequence_bounds(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if len(q_bounds) != len(k_bounds):
        raise ValueError(f"cu_seqlens_q has {len(q_bounds) - 1} sequences but cu_seqlens_k has {len(k_bounds) - 1}")
    return q_bounds, k_bounds


def _sequences(q, k, v, q_bounds, k_bounds, scale, causal):
    """Per sequence with queries: (its query rows, its key rows, masked scores [Hq, l, Lk], keys [Hq, Lk, Dk], values
    [Hq, Lk, Dv]), key/value heads repeated to the query heads, in at least float32."""
    group = q.shape[1] // k.shape[1]
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
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
        yield slice(q_start, q_end), slice(k_start, k_end), scores, keys, values


def merge_attention_parts(o, lse, o_parts, lse_parts, offsets, positions):
    """Merge each row's attention over its own keys with its attention over further key sets.

    Row r's further parts are ``positions[offsets[r]:offsets[r+1]]`` of ``o_parts`` / ``lse_parts``. The merged
    output is the softmax-weighted mean of the parts' outputs, weights ``exp(lse_part - lse_merged)``, and the
    merged log-sum-exp is ``logsumexp`` of the parts': together, attention over the union of the key sets.
    Computed in at least float32; every row's own ``lse`` must be finite (a causal row sees itself).

    Args:
        o: [C, H, D]; lse: [H, C]; o_parts: [N, H, D]; lse_parts: [H, N]; offsets: [C + 1]; positions: [N].
    Returns:
        (o [C, H, D] in o's dtype, lse [H, C]).
    """
    num_rows = o.shape[0]
    dtype = torch.promote_types(torch.promote_types(o.dtype, lse.dtype), torch.float32)
    positions = positions.to(torch.long)
    counts = (offsets[1:] - offsets[:-1]).to(torch.long)
    owner = torch.repeat_interleave(torch.arange(num_rows, device=o.device), counts)  # [N] row of each part
    part_lse = lse_parts.index_select(1, positions).to(dtype)  # [H, N]
    peak = lse.to(dtype).clone()
    peak.scatter_reduce_(1, owner[None].expand_as(part_lse), part_lse, reduce="amax")  # [H, C]
    own_weight = torch.exp(lse.to(dtype) - peak)  # [H, C]
    part_weight = torch.exp(part_lse - peak.index_select(1, owner))  # [H, N]
    total = own_weight.index_add(1, owner, part_weight)  # [H, C]
    weighted = o_parts.index_select(0, positions).to(dtype) * part_weight.T[..., None]  # [N, H, D]
    merged = (o.to(dtype) * own_weight.T[..., None]).index_add(0, owner, weighted) / total.T[..., None]
    return merged.to(o.dtype), (peak + torch.log(total)).to(lse.dtype)
