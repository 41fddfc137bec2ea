"""Policy-gradient losses over per-token log-probs: PPO-clip and GRPO (§3.5, Eq. 18).

These functions know nothing of prefix sharing: they take the current log-probs in
original batch order (a list of per-trajectory tensors, or a packed tensor with
``cu_seqlens``) and the batch's own metadata, so the same call serves the trajectory-wise
baseline and HARTS.

Alignment. Per-token metadata is aligned with tokens (entry t belongs to ``tokens[t]``),
while ``log_probs[t]`` scores ``tokens[t + 1]``. Metadata is therefore read from entry 1 on:
the loss term of ``log_probs[t]`` uses ``loss_mask[t + 1]``, ``advantages[t + 1]``,
``old_log_probs[t + 1]`` and ``ref_log_probs[t + 1]``. Per-trajectory metadata (one scalar
per trajectory, e.g. a GRPO advantage) is broadcast to every token of its trajectory.

Reductions (``reduction``):

* ``"token-mean"``: sum of masked token losses / number of masked tokens in the batch;
* ``"seq-mean"``: mean over trajectories (with at least one masked token) of each
  trajectory's masked token mean (the GRPO paper's 1/G sum_i 1/|o_i| sum_t);
* ``"seq-mean-token-sum"``: mean over trajectories of the masked token sum;
* ``"sum"``: sum of masked token losses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from harts.errors import RolloutInputError

__all__ = [
    "PolicyLoss",
    "REDUCTIONS",
    "grpo_loss",
    "group_advantages",
    "pack_log_probs",
    "policy_loss",
    "ppo_loss",
    "token_metadata",
]

REDUCTIONS = ("token-mean", "seq-mean", "seq-mean-token-sum", "sum")
ADVANTAGE_FIELDS = ("advantages", "advantage")
OLD_LOG_PROB_FIELDS = ("old_log_probs", "old_logprobs", "behavior_log_probs")
REF_LOG_PROB_FIELDS = ("ref_log_probs", "ref_logprobs", "reference_log_probs")


@attrs.frozen(eq=False)
class PolicyLoss:
    """The scalar loss and detached diagnostics (means over masked tokens)."""

    loss: torch.Tensor
    metrics: dict[str, float]


def pack_log_probs(log_probs: Any, cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [P], cu_seqlens [N + 1]) from a list of 1-D tensors, a packed tensor and its offsets,
    or a runtime output object with ``.packed`` and ``.cu_seqlens``."""
    if hasattr(log_probs, "packed") and hasattr(log_probs, "cu_seqlens"):
        return log_probs.packed, log_probs.cu_seqlens.to(torch.long)
    if isinstance(log_probs, torch.Tensor):
        if cu_seqlens is None:
            raise ValueError("a packed log-prob tensor needs cu_seqlens (one offset per trajectory boundary)")
        cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.long)
        if log_probs.dim() != 1 or int(cu_seqlens[-1]) != log_probs.shape[0] or int(cu_seqlens[0]) != 0:
            raise ValueError(f"cu_seqlens must run from 0 to the packed length {log_probs.shape[0]}")
        return log_probs, cu_seqlens
    pieces = list(log_probs)
    if not pieces:
        raise ValueError("no log-probs given")
    lengths = torch.tensor([p.shape[0] for p in pieces], dtype=torch.long)
    offsets = torch.zeros(len(pieces) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    return torch.cat(pieces), offsets


def _field(batch, names: Sequence[str]):
    if batch is None:
        return None
    for name in names:
        if name in batch.token_fields:
            return batch.token_fields[name]
        if name in batch.trajectory_fields:
            return batch.trajectory_fields[name]
    return None


def token_metadata(values: Any, cu_seqlens: torch.Tensor, *, name: str, device=None, dtype=torch.float32) -> torch.Tensor:
    """Per-token metadata aligned with the packed log-probs.

    ``values`` is one token-aligned array per trajectory (entry t for ``tokens[t]``; entries
    1.. are used) or one scalar per trajectory (broadcast).
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    if isinstance(values, torch.Tensor) and values.dim() == 1 and values.shape[0] == len(lengths):
        values = values.detach().to(device=device, dtype=dtype)
        return torch.repeat_interleave(values, torch.as_tensor(lengths, dtype=torch.long, device=values.device))
    if len(values) != len(lengths):
        raise RolloutInputError(f"field '{name}': expected one entry per trajectory ({len(lengths)}), got {len(values)}")
    pieces = []
    for trajectory, (entry, length) in enumerate(zip(values, lengths)):
        # torch.tensor copies: batch arrays are read-only, which torch.as_tensor warns about
        array = entry.detach() if isinstance(entry, torch.Tensor) else torch.tensor(np.asarray(entry))
        if array.dim() == 0:
            pieces.append(array.to(dtype).expand(length))
            continue
        if array.dim() != 1 or array.shape[0] != length + 1:
            raise RolloutInputError(
                f"trajectory {trajectory}: field '{name}' has {array.shape[0] if array.dim() == 1 else tuple(array.shape)} entries, "
                f"expected {length + 1} (one per token)"
            )
        pieces.append(array[1:].to(dtype))
    return torch.cat([p.to(device) for p in pieces]) if pieces else torch.zeros(0, dtype=dtype, device=device)


def _reduce(per_token: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, reduction: str, denominator: float | None) -> torch.Tensor:
    masked = per_token * mask
    if reduction == "token-mean":
        total = mask.sum() if denominator is None else torch.as_tensor(denominator, dtype=mask.dtype, device=mask.device)
        return masked.sum() / total.clamp_min(1)
    if reduction == "sum":
        return masked.sum()
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=per_token.device), lengths.to(per_token.device))
    sums = torch.zeros(len(lengths), dtype=per_token.dtype, device=per_token.device).index_add(0, owner, masked)
    counts = torch.zeros(len(lengths), dtype=mask.dtype, device=mask.device).index_add(0, owner, mask)
    active = counts > 0
    per_sequence = sums / counts.clamp_min(1) if reduction == "seq-mean" else sums
    count = active.sum() if denominator is None else torch.as_tensor(denominator, device=per_token.device)
    return (per_sequence * active).sum() / torch.as_tensor(count, dtype=per_token.dtype).clamp_min(1)


def policy_loss(
    log_probs: Any,
    *,
    advantages: Any,
    cu_seqlens: torch.Tensor | None = None,
    loss_mask: Any = None,
    old_log_probs: Any = None,
    ref_log_probs: Any = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    kl_coef: float = 0.0,
    reduction: str = "token-mean",
    denominator: float | None = None,
) -> PolicyLoss:
    """Clipped surrogate loss with an optional k3 KL penalty to a reference policy.

    Metadata arguments follow the batch convention (token-aligned per trajectory, or one
    scalar per trajectory); see the module docstring. ``old_log_probs=None`` means on-policy
    (ratio 1, gradient of the plain policy gradient). ``denominator`` overrides the
    reduction's count (e.g. a global token count shared by every microbatch).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    packed, cu = pack_log_probs(log_probs, cu_seqlens)
    device, dtype = packed.device, packed.dtype
    cu = cu.to(device)
    advantage = token_metadata(advantages, cu, name="advantages", device=device, dtype=dtype)
    mask = (
        torch.ones_like(packed) if loss_mask is None else token_metadata(loss_mask, cu, name="loss_mask", device=device, dtype=dtype)
    )
    old = packed.detach() if old_log_probs is None else token_metadata(old_log_probs, cu, name="old_log_probs", device=device, dtype=dtype)
    log_ratio = packed - old
    ratio = torch.exp(log_ratio)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = -advantage * ratio
    clipped = -advantage * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must exceed 1, got {dual_clip}")
        per_token = torch.where(advantage < 0, torch.minimum(per_token, -advantage * dual_clip), per_token)
    metrics: dict[str, float] = {}
    if kl_coef:
        if ref_log_probs is None:
            raise RolloutInputError("a KL penalty (kl_coef != 0) needs reference log-probs ('ref_log_probs')")
        reference = token_metadata(ref_log_probs, cu, name="ref_log_probs", device=device, dtype=dtype)
        delta = reference - packed
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
        metrics["kl"] = float(_reduce(kl.detach(), mask, cu, "token-mean", None))
    loss = _reduce(per_token, mask, cu, reduction, denominator)
    with torch.no_grad():
        count = mask.sum().clamp_min(1)
        metrics["clip_fraction"] = float(((clipped > unclipped).to(dtype) * mask).sum() / count)
        metrics["approx_kl_old"] = float((-log_ratio * mask).sum() / count)
        metrics["ratio_mean"] = float((ratio * mask).sum() / count)
        metrics["tokens"] = float(mask.sum())
    return PolicyLoss(loss=loss, metrics=metrics)


def _metadata_or_field(explicit: Any, batch, names: Sequence[str], label: str, required: bool):
    if explicit is not None:
        return explicit
    found = _field(batch, names)
    if found is None and required:
        raise RolloutInputError(f"field '{label}' is missing: pass it or put it in the batch (as one of {', '.join(names)})")
    return found


def ppo_loss(
    log_probs: Any,
    batch=None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    advantages: Any = None,
    loss_mask: Any = None,
    old_log_probs: Any = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    reduction: str = "token-mean",
    denominator: float | None = None,
) -> PolicyLoss:
    """PPO-clip policy loss; metadata from the arguments or from the batch's fields
    (``advantages``, ``loss_mask``, ``old_log_probs``)."""
    return policy_loss(
        log_probs,
        cu_seqlens=cu_seqlens,
        advantages=_metadata_or_field(advantages, batch, ADVANTAGE_FIELDS, "advantages", True),
        loss_mask=_metadata_or_field(loss_mask, batch, ("loss_mask",), "loss_mask", False),
        old_log_probs=_metadata_or_field(old_log_probs, batch, OLD_LOG_PROB_FIELDS, "old_log_probs", False),
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        dual_clip=dual_clip,
        reduction=reduction,
        denominator=denominator,
    )


def grpo_loss(
    log_probs: Any,
    batch=None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    advantages: Any = None,
    loss_mask: Any = None,
    old_log_probs: Any = None,
    ref_log_probs: Any = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_coef: float = 0.0,
    reduction: str = "seq-mean",
    denominator: float | None = None,
) -> PolicyLoss:
    """GRPO loss: clipped surrogate with group-relative advantages (see :func:`group_advantages`)
    and a k3 KL penalty to the reference policy, averaged per trajectory by default."""
    return policy_loss(
        log_probs,
        cu_seqlens=cu_seqlens,
        advantages=_metadata_or_field(advantages, batch, ADVANTAGE_FIELDS, "advantages", True),
        loss_mask=_metadata_or_field(loss_mask, batch, ("loss_mask",), "loss_mask", False),
        old_log_probs=_metadata_or_field(old_log_probs, batch, OLD_LOG_PROB_FIELDS, "old_log_probs", False),
        ref_log_probs=_metadata_or_field(ref_log_probs, batch, REF_LOG_PROB_FIELDS, "ref_log_probs", bool(kl_coef)),
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        kl_coef=kl_coef,
        reduction=reduction,
        denominator=denominator,
    )


def group_advantages(rewards: Any, groups: Any, *, normalize_std: bool = True, eps: float = 1e-6) -> np.ndarray:
    """GRPO advantages per trajectory: reward minus its group's mean, over the group's std if asked."""
    rewards = np.asarray(rewards, dtype=np.float64)
    groups = np.asarray(groups)
    if rewards.shape != groups.shape or rewards.ndim != 1:
        raise RolloutInputError(f"rewards and groups need one entry per trajectory; got shapes {rewards.shape} and {groups.shape}")
    _, group_index = np.unique(groups, return_inverse=True)
    counts = np.bincount(group_index)
    means = np.bincount(group_index, weights=rewards) / counts
    centred = rewards - means[group_index]
    if not normalize_std:
        return centred
    # unbiased std as in the GRPO reference implementations; single-member groups get 0 advantage
    squares = np.bincount(group_index, weights=centred**2)
    std = np.sqrt(squares / np.maximum(counts - 1, 1))
    scale = std[group_index] + eps
    # a group whose rewards are all equal carries no signal: advantage 0, never 0/0
    return np.divide(centred, scale, out=np.zeros_like(centred), where=scale > 0)
