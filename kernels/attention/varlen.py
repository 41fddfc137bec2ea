"""Fast packed softmax attention with separate query/key spans, bottom-right causal (GPU).

Same signature and result as :func:`harts.kernels.attention.naive.attention`. Paths, in order:

1. **Varlen FlashAttention-2** (``torch.ops.aten._flash_attention_forward`` /
   ``_flash_attention_backward``, the kernels behind PyTorch's SDPA) when the inputs are on
   CUDA in bf16/fp16 with head dims <= 256. It takes the packed rows and ``cu_seqlens`` of
   queries and keys directly (one launch for all sequences, no padding, no mask tensor),
   supports GQA natively (kv heads divide query heads) and aligns ``is_causal`` to the
   bottom right when a sequence has fewer queries than keys, which is exactly the HARTS
   contract ``j <= h_i + i`` (paper Eq. 22). FlashAttention needs one head dim for q, k and
   v, so MLA's narrower values (Dv < Dk) are zero-padded to Dk and the padding columns of
   the output dropped; head dims are padded to a multiple of 8.
   This was chosen over FlexAttention because it needs neither ``torch.compile`` (whose
   recompilation on every new packed length would land inside the timed region) nor a
   block mask built from O(Tq * Tk) mask evaluations per call, and over a per-sequence
   SDPA loop because it is one launch regardless of the number of sequences.
2. **Per-sequence SDPA** (``F.scaled_dot_product_attention`` with a lower-right causal
   bias) otherwise (fp32 on CUDA, or CPU when forced): exact, one call per sequence.

The alternative "one shared KV buffer with a tree mask" (no duplicated ancestor KV per
branch) is :func:`harts.kernels.attention.tree_mask.tree_attention`; it needs the plan's tree
structure rather than this packed-span signature.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .._checks import sequence_bounds

__all__ = ["attention", "attention_backward", "attention_forward", "flash_head_dim", "flash_parts_available", "flash_values",
           "flash_varlen_available"]

_FLASH_DTYPES = (torch.bfloat16, torch.float16)
_MAX_FLASH_HEAD_DIM = 256


def flash_varlen_available(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the varlen FlashAttention path covers these inputs."""
    return (
        q.is_cuda
        and q.dtype in _FLASH_DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and max(q.shape[-1], v.shape[-1]) <= _MAX_FLASH_HEAD_DIM
        and hasattr(torch.ops.aten, "_flash_attention_forward")
    )


class _FlashVarlen(torch.autograd.Function):
    """Differentiable wrapper of the varlen FlashAttention-2 forward / backward ops."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state, unused)
        ctx.settings = (max_q, max_k, scale, causal)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, cu_q, cu_k, rng_state, unused = ctx.saved_tensors
        max_q, max_k, scale, causal = ctx.settings
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            d_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale
        )
        return dq, dk, dv, None, None, None, None, None, None


def flash_head_dim(query_dim: int, value_dim: int) -> int:
    """The one head dim FlashAttention computes q, k and v with: the wider of the two, rounded up to 8."""
    return -(-max(query_dim, value_dim) // 8) * 8


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def flash_values(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``v`` zero-padded to the head dim :func:`attention`'s FlashAttention path computes with (``v`` itself
    when it is that wide already), so that path pads nothing more."""
    return _pad_last(v, flash_head_dim(q.shape[-1], v.shape[-1]))


def _flash(q, k, v, q_bounds, k_bounds, cu_q, cu_k, scale, causal):
    value_dim = v.shape[-1]
    head_dim = flash_head_dim(q.shape[-1], value_dim)
    q, k, v = (_pad_last(t, head_dim).contiguous() for t in (q, k, v))
    max_q = int(np.diff(q_bounds).max(initial=0))
    max_k = int(np.diff(k_bounds).max(initial=0))
    out = _FlashVarlen.apply(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, scale, causal)
    return out[..., :value_dim]


def _per_sequence(q, k, v, q_bounds, k_bounds, scale, causal):
    from torch.nn.attention.bias import causal_lower_right

    group = q.shape[1] // k.shape[1]
    pieces = []
    for sequence in range(len(q_bounds) - 1):
        q_start, q_end = int(q_bounds[sequence]), int(q_bounds[sequence + 1])
        k_start, k_end = int(k_bounds[sequence]), int(k_bounds[sequence + 1])
        if q_end == q_start:
            continue
        queries = q[q_start:q_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, l, Dk]
        keys = k[k_start:k_end].repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
        values = v[k_start:k_end].repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
        mask = causal_lower_right(q_end - q_start, k_end - k_start) if causal else None
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        pieces.append(out[0].transpose(0, 1))
    return torch.cat(pieces, dim=0)


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
    """Packed attention, bottom-right causal per sequence; see :func:`harts.kernels.attention.naive.attention`.

    Args:
        q: [Tq, Hq, Dk]; k: [Tk, Hkv, Dk]; v: [Tk, Hkv, Dv]; cu_seqlens_q, cu_seqlens_k: [N+1].
    Returns:
        o [Tq, Hq, Dv] in q's dtype.
    """
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
    q_lengths, k_lengths = np.diff(q_bounds), np.diff(k_bounds)
    if causal and np.any(k_lengths < q_lengths):
        bad = int(np.flatnonzero(k_lengths < q_lengths)[0])
        raise ValueError(
            f"sequence {bad}: {int(q_lengths[bad])} queries but only {int(k_lengths[bad])} keys; "
            "bottom-right causal attention needs len_k >= len_q"
        )
    if q.shape[0] == 0:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    if flash_varlen_available(q, k, v):
        return _flash(q, k, v, q_bounds, k_bounds, cu_seqlens_q, cu_seqlens_k, scale, causal)
    return _per_sequence(q, k, v, q_bounds, k_bounds, scale, causal).to(q.dtype)


# ----------------------------------------------------------------------------- parts with their log-sum-exp


def flash_parts_available(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`attention_forward` / :func:`attention_backward` run FlashAttention on these inputs: the
    varlen path's conditions, and one head dim for q, k and v that FlashAttention takes as it is."""
    width = q.shape[-1]
    return flash_varlen_available(q, k, v) and v.shape[-1] == width and width % 8 == 0


def _rows_lse(lse: torch.Tensor, q_bounds: np.ndarray, heads: int) -> torch.Tensor:
    """The kernel's log-sum-exp as [Hq, Tq] (FlashAttention-2's varlen layout since 2.4; the older
    [B, Hq, max_q] padded layout is read row by row)."""
    total = int(q_bounds[-1])
    if lse.shape == (heads, total):
        return lse
    if lse.dim() == 3 and lse.shape[:2] == (len(q_bounds) - 1, heads):
        sequence, position = _padded_index(q_bounds, lse.device)
        return lse[sequence, :, position].T.contiguous()
    raise RuntimeError(f"unexpected FlashAttention log-sum-exp shape {tuple(lse.shape)} for {heads} heads, {total} rows")


def _kernel_lse(lse: torch.Tensor, q_bounds: np.ndarray, shape: torch.Size) -> torch.Tensor:
    """[Hq, Tq] back into the layout (``shape``) the kernel returned."""
    if lse.shape == shape:
        return lse.contiguous()
    sequence, position = _padded_index(q_bounds, lse.device)
    out = lse.new_zeros(shape)
    out[sequence, :, position] = lse.T
    return out


def _padded_index(q_bounds: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = np.diff(q_bounds)
    sequence = np.repeat(np.arange(lengths.size), lengths)
    position = np.arange(int(q_bounds[-1])) - np.repeat(q_bounds[:-1], lengths)
    return torch.as_tensor(sequence, device=device), torch.as_tensor(position, device=device)


def attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale: float, causal: bool = True):
    """FlashAttention-2's varlen forward with its log-sum-exp (see :func:`harts.kernels.attention.naive.attention_forward`).

    q, k, v share one head dim, a multiple of 8 (:func:`flash_parts_available`). Returns (o [Tq, Hq, D], lse
    [Hq, Tq] float32, the kernel state :func:`attention_backward` needs). Not differentiable: the caller
    runs the backward (:mod:`.cascade`).
    """
    q_bounds = sequence_bounds(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    k_bounds = sequence_bounds(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    max_q = int(np.diff(q_bounds).max(initial=0))
    max_k = int(np.diff(k_bounds).max(initial=0))
    cu_q, cu_k = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
    )
    state = (rng_state, unused, cu_q, cu_k, max_q, max_k, q_bounds, lse.shape)
    return out, _rows_lse(lse, q_bounds, q.shape[1]), state


def attention_backward(d_o, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, state, *, scale: float, causal: bool = True):
    """FlashAttention-2's varlen backward given an output and log-sum-exp [Hq, Tq], which may be those of attention
    over more keys than these (see :func:`harts.kernels.attention.naive.attention_backward`)."""
    rng_state, unused, cu_q, cu_k, max_q, max_k, q_bounds, kernel_lse_shape = state
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        d_o.contiguous(), q, k, v, o, _kernel_lse(lse, q_bounds, kernel_lse_shape), cu_q, cu_k, max_q, max_k, 0.0, causal,
        rng_state, unused, scale=scale,
    )
    return dq, dk, dv
