"""Policy-gradient losses over per-token log-probs: PPO-clip and GRPO (§3.5, Eq. 18).

These functions know nothing of prefix sharing: they take the current log-probs in
original batch order (a list of per-trajectory tensors, or a packed tensor with
``cu_seqlens``) and the batch's own metadata, so the same call serves the trajectory-wise
baseline and HARTS.

Alignment. Per-token metadata is aligned with tokens (entry t belongs to ``tokens[t]``),
while ``log_probs[t]`` scores ``tokens[t + 1]``. Metadata is therefore read from entry 1 on:
the loss term of ``log_probs[t]`` uses ``loss_mask[t + 1]``, ``advantages[t + 1]``,
``old_log_probs[t + 1]`` and ``ref_log_probs[t + 1]``. Per-trajectory metadata (one scalar
per trajectory, e.g. a GRPO advantage) is broadcast to every token of its trajectory. Old and
reference log-probs may also come in the layout the runtime returns them (one value per
log-prob, ``len(tokens) - 1``, or the output object of :func:`harts.runtime.log_probs`
itself): those are used as they are.

Reductions (``reduction``):

* ``"token-mean"``: sum of masked token losses / number of masked tokens in the batch;
* ``"seq-mean"``: mean over trajectories (with at least one masked token) of each
  trajectory's masked token mean (the GRPO paper's 1/G sum_i 1/|o_i| sum_t);
* ``"seq-mean-token-sum"``: mean over trajectories of the masked token sum;
* ``"sum"``: sum of masked token losses.

Gradient accumulation. A loss over a microbatch with ``denominator`` set to the whole
batch's count (:func:`loss_denominator`) is that microbatch's exact share of the batch
loss: the shares of any partition of the trajectories sum to the batch loss, so
accumulated gradients do not depend on the microbatching or the data-parallel degree.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from harts.errors import RolloutInputError
from harts.kernels import host

__all__ = [
    "PolicyLoss",
    "REDUCTIONS",
    "grpo_loss",
    "group_advantages",
    "loss_denominator",
    "metadata_field",
    "pack_log_probs",
    "policy_loss",
    "ppo_loss",
    "reduce_tokens",
    "refuse_empty_loss_mask",
    "token_metadata",
]

REDUCTIONS = ("token-mean", "seq-mean", "seq-mean-token-sum", "sum")
ADVANTAGE_FIELDS = ("advantages", "advantage")
OLD_LOG_PROB_FIELDS = ("old_log_probs", "old_logprobs", "behavior_log_probs")
REF_LOG_PROB_FIELDS = ("ref_log_probs", "ref_logprobs", "reference_log_probs")


@attrs.frozen(eq=False)
class PolicyLoss:
    """The scalar loss and detached diagnostics.

    ``metrics`` are means over this call's masked tokens; ``sums`` are the detached masked
    sums behind them (``tokens``, ``clipped``, ``ratio``, ``neg_log_ratio``, ``kl`` when
    a KL term is computed), and ``ratio_min`` / ``ratio_max`` over masked tokens, so that a
    training loop can combine microbatches and ranks into batch-level figures.

    The sums stay on the device; ``metrics`` reads them to the host when it is first asked for
    (a read waits for the device), so a loop that combines the sums reads them once per step.
    """

    loss: torch.Tensor
    sums: dict[str, torch.Tensor] = attrs.field(factory=dict)

    @functools.cached_property
    def metrics(self) -> dict[str, float]:
        sums = self.sums
        count = sums["tokens"].clamp_min(1)
        names = ("clip_fraction", "clipped"), ("approx_kl_old", "neg_log_ratio"), ("ratio_mean", "ratio")
        means = [sums[total] / count for _, total in names] + ([sums["kl"] / count] if "kl" in sums else [])
        values = torch.stack([*means, sums["tokens"]]).tolist()  # one read of the device for all of them
        metrics = {name: values[i] for i, (name, _) in enumerate(names)}
        if "kl" in sums:
            metrics["kl"] = values[len(names)]
        metrics["tokens"] = values[-1]
        return metrics


def pack_log_probs(log_probs: Any, cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [P], cu_seqlens [N + 1]) from a list of 1-D tensors, a packed tensor and its offsets,
    or a runtime output object with ``.packed`` and ``.cu_seqlens``."""
    if hasattr(log_probs, "packed") and hasattr(log_probs, "cu_seqlens"):
        return log_probs.packed, log_probs.cu_seqlens.to(torch.long)
    if isinstance(log_probs, torch.Tensor):
        if cu_seqlens is None:
            raise ValueError("a packed log-prob tensor needs cu_seqlens (one offset per trajectory boundary)")
        cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.long)
        bounds = host_offsets(cu_seqlens)
        if log_probs.dim() != 1 or int(bounds[-1]) != log_probs.shape[0] or int(bounds[0]) != 0:
            raise ValueError(f"cu_seqlens must run from 0 to the packed length {log_probs.shape[0]}")
        return log_probs, cu_seqlens
    pieces = list(log_probs)
    if not pieces:
        raise ValueError("no log-probs given")
    lengths = torch.tensor([p.shape[0] for p in pieces], dtype=torch.long)
    offsets = torch.zeros(len(pieces) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    return torch.cat(pieces), offsets


def host_offsets(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` on the host, where the losses read trajectory lengths: a device tensor's recorded host copy
    (:mod:`harts.kernels.host`), else read from the device once (a sync)."""
    cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.long)
    if cu_seqlens.device.type == "cpu":
        return cu_seqlens
    return torch.tensor(host.read(cu_seqlens), dtype=torch.long)


def _device_scalar(value: Any, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.as_tensor(value, dtype=dtype, device=device)``, made by a fill on the device: a copy of a host
    number to a GPU waits for the queue, a fill is queued like any kernel."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype)
    return torch.full((), value, dtype=dtype or torch.as_tensor(value).dtype, device=device)


def _field(batch, names: Sequence[str]):
    if batch is None:
        return None
    for name in names:
        if name in batch.token_fields:
            return batch.token_fields[name]
        if name in batch.trajectory_fields:
            return batch.trajectory_fields[name]
    return None


def token_metadata(
    values: Any, cu_seqlens: torch.Tensor, *, name: str, device=None, dtype=torch.float32, log_prob_layout: bool = False
) -> torch.Tensor:
    """Per-token metadata aligned with the packed log-probs.

    ``values`` is one token-aligned array per trajectory (entry t for ``tokens[t]``; entries
    1.. are used) or one scalar per trajectory (broadcast). With ``log_prob_layout`` (fields
    that hold log-probs: old and reference log-probs) an entry may also hold one value per
    log-prob (``len(tokens) - 1`` entries, the runtime's output layout), and ``values`` may be
    the packed tensor or a runtime output object (``.packed`` / ``.cu_seqlens``).
    """
    cu_seqlens = host_offsets(cu_seqlens)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    if log_prob_layout and hasattr(values, "packed") and hasattr(values, "cu_seqlens"):
        if not torch.equal(values.cu_seqlens.to("cpu", torch.long), cu_seqlens.to("cpu", torch.long)):
            raise RolloutInputError(f"field '{name}': the log-prob output covers other trajectories or lengths than the log-probs")
        return values.packed.detach().to(device=device, dtype=dtype)
    if log_prob_layout and isinstance(values, torch.Tensor) and values.dim() == 1 and values.shape[0] == sum(lengths):
        # packed log-probs; checked before the per-trajectory broadcast, which a log-prob field never means
        return values.detach().to(device=device, dtype=dtype)
    if isinstance(values, torch.Tensor) and values.dim() == 1 and values.shape[0] == len(lengths):
        values = values.detach().to(device=device, dtype=dtype)
        counts = host.upload(np.asarray(lengths, dtype=np.int64), values.device)
        return torch.repeat_interleave(values, counts, output_size=sum(lengths))  # the size given: no device read
    if len(values) != len(lengths):
        raise RolloutInputError(f"field '{name}': expected one entry per trajectory ({len(lengths)}), got {len(values)}")
    pieces = []
    for trajectory, (entry, length) in enumerate(zip(values, lengths)):
        # torch.tensor copies: batch arrays are read-only, which torch.as_tensor warns about
        array = entry.detach() if isinstance(entry, torch.Tensor) else torch.tensor(np.asarray(entry))
        if array.dim() == 0:
            pieces.append(array.to(dtype).expand(length))
            continue
        if array.dim() == 1 and array.shape[0] == length + 1:
            pieces.append(array[1:].to(dtype))
        elif log_prob_layout and array.dim() == 1 and array.shape[0] == length:
            pieces.append(array.to(dtype))
        else:
            expected = f"{length + 1} (one per token) or {length} (one per log-prob)" if log_prob_layout else f"{length + 1} (one per token)"
            raise RolloutInputError(
                f"trajectory {trajectory}: field '{name}' has {array.shape[0] if array.dim() == 1 else tuple(array.shape)} entries, "
                f"expected {expected}"
            )
    if not pieces:
        return torch.zeros(0, dtype=dtype, device=device)
    return _packed_on(pieces, device)


def _packed_on(pieces: list[torch.Tensor], device) -> torch.Tensor:
    """The pieces concatenated on ``device``: host pieces go in one copy, from pinned memory to a GPU,
    which does not wait for the queued kernels (a copy per piece from pageable memory waits each time)."""
    if device is None or any(p.device.type != "cpu" for p in pieces):
        return torch.cat([p.to(device) for p in pieces])
    return host.upload(torch.cat(pieces), device)


def loss_denominator(loss_mask: Any, cu_seqlens: torch.Tensor, reduction: str) -> float | None:
    """The count a reduction divides by, over every trajectory given (typically the whole batch).

    ``loss_mask`` is token-aligned as everywhere (entry t + 1 gates ``log_probs[t]``):
    ``token-mean`` divides by the masked tokens (sum of mask weights), the sequence means by
    the trajectories with a masked token, ``sum`` by nothing (None). Pass the result as
    ``denominator=`` to every microbatch's loss (see the module docstring).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if reduction == "sum":
        return None
    cu = torch.as_tensor(cu_seqlens, dtype=torch.long)
    mask = token_metadata(loss_mask, cu, name="loss_mask", dtype=torch.float64)
    if reduction == "token-mean":
        return float(mask.sum())
    lengths = cu[1:] - cu[:-1]
    owner = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    counts = torch.zeros(len(lengths), dtype=torch.float64).index_add(0, owner, mask)
    return float((counts > 0).sum())


def reduce_tokens(per_token: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, reduction: str, denominator: float | None = None) -> torch.Tensor:
    """Reduce per-token values [P] under ``mask`` [P] (aligned with the log-probs) as ``reduction`` does.

    ``denominator`` overrides the count (see :func:`loss_denominator`).
    """
    masked = per_token * mask
    if reduction == "token-mean":
        total = mask.sum() if denominator is None else _device_scalar(denominator, mask.device, mask.dtype)
        return masked.sum() / total.clamp_min(1)
    if reduction == "sum":
        return masked.sum()
    lengths = np.diff(host_offsets(cu_seqlens).numpy())
    owner = host.upload(np.repeat(np.arange(len(lengths), dtype=np.int64), lengths), per_token.device)
    sums = torch.zeros(len(lengths), dtype=per_token.dtype, device=per_token.device).index_add(0, owner, masked)
    counts = torch.zeros(len(lengths), dtype=mask.dtype, device=mask.device).index_add(0, owner, mask)
    active = counts > 0
    per_sequence = sums / counts.clamp_min(1) if reduction == "seq-mean" else sums
    count = active.sum() if denominator is None else _device_scalar(denominator, per_token.device)
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
    scalar per trajectory); old and reference log-probs may also be in the runtime's layout
    (see the module docstring). ``old_log_probs=None`` means on-policy (ratio 1, gradient of
    the plain policy gradient). Given reference log-probs, the k3 KL is measured (``sums``,
    ``metrics``) even when ``kl_coef`` is 0. ``denominator`` overrides the reduction's count
    (e.g. a global token count shared by every microbatch, :func:`loss_denominator`).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    packed, cu = pack_log_probs(log_probs, cu_seqlens)
    device, dtype = packed.device, packed.dtype
    cu = host_offsets(cu)  # lengths are host figures: kept there, never read back from the device
    advantage = token_metadata(advantages, cu, name="advantages", device=device, dtype=dtype)
    mask = (
        torch.ones_like(packed) if loss_mask is None else token_metadata(loss_mask, cu, name="loss_mask", device=device, dtype=dtype)
    )
    old = (
        packed.detach()
        if old_log_probs is None
        else token_metadata(old_log_probs, cu, name="old_log_probs", device=device, dtype=dtype, log_prob_layout=True)
    )
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
    sums: dict[str, torch.Tensor] = {}
    if kl_coef or (ref_log_probs is not None):
        if ref_log_probs is None:
            raise RolloutInputError("a KL penalty (kl_coef != 0) needs reference log-probs ('ref_log_probs')")
        reference = token_metadata(ref_log_probs, cu, name="ref_log_probs", device=device, dtype=dtype, log_prob_layout=True)
        delta = reference - packed
        kl = torch.exp(delta) - delta - 1.0
        if kl_coef:
            per_token = per_token + kl_coef * kl
        sums["kl"] = (kl.detach() * mask).sum()
    loss = reduce_tokens(per_token, mask, cu, reduction, denominator)
    with torch.no_grad():
        sums["tokens"] = mask.sum()
        sums["clipped"] = ((clipped > unclipped).to(dtype) * mask).sum()
        sums["neg_log_ratio"] = (-log_ratio * mask).sum()
        sums["ratio"] = (ratio * mask).sum()
        # over masked tokens by a where, not ratio[mask > 0]: a boolean selection's size is read from the device;
        # no masked token leaves inf / -inf, as an empty selection did
        masked = mask > 0
        sums["ratio_min"] = torch.where(masked, ratio, float("inf")).amin() if ratio.numel() else ratio.new_full((), float("inf"))
        sums["ratio_max"] = torch.where(masked, ratio, float("-inf")).amax() if ratio.numel() else ratio.new_full((), float("-inf"))
    return PolicyLoss(loss=loss, sums=sums)


def metadata_field(explicit: Any, batch, names: Sequence[str], label: str, required: bool = False):
    """``explicit`` if given, else the batch's first field among ``names`` (per token or per trajectory)."""
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
        advantages=metadata_field(advantages, batch, ADVANTAGE_FIELDS, "advantages", True),
        loss_mask=metadata_field(loss_mask, batch, ("loss_mask",), "loss_mask", False),
        old_log_probs=metadata_field(old_log_probs, batch, OLD_LOG_PROB_FIELDS, "old_log_probs", False),
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
        advantages=metadata_field(advantages, batch, ADVANTAGE_FIELDS, "advantages", True),
        loss_mask=metadata_field(loss_mask, batch, ("loss_mask",), "loss_mask", False),
        old_log_probs=metadata_field(old_log_probs, batch, OLD_LOG_PROB_FIELDS, "old_log_probs", False),
        ref_log_probs=metadata_field(ref_log_probs, batch, REF_LOG_PROB_FIELDS, "ref_log_probs", bool(kl_coef)),
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
    _refuse_overflow(rewards)
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


#: Largest reward magnitude group_advantages takes: the squared deviations of a group stay far inside
#: float64 (1e308) at this size; beyond it a group's mean or spread overflows (NaN or zero advantages).
MAX_REWARD_MAGNITUDE = 1e150


def _refuse_overflow(rewards: np.ndarray) -> None:
    too_large = ~(np.abs(rewards) <= MAX_REWARD_MAGNITUDE)  # NaN too
    if too_large.any():
        bad = int(np.flatnonzero(too_large)[0])
        raise RolloutInputError(
            f"trajectory {bad}: field 'reward' is {float(rewards[bad])!r}; GRPO advantages take rewards of magnitude up to "
            f"{MAX_REWARD_MAGNITUDE:g} (beyond, a group's mean or spread overflows float64): rescale the rewards"
        )


def refuse_empty_loss_mask(loss_mask: Any, cu_seqlens: torch.Tensor) -> None:
    """Refuse a loss mask that gates no log-prob at all (entry 0 of a trajectory gates none).

    Such a step has a loss of 0 and no gradient: the optimizer would only apply weight decay and
    Adam's state would still move, a silent no-op the user did not ask for. Computing log-probs or
    compiling such a batch stays allowed; only training on it is refused.
    """
    mask = token_metadata(loss_mask, torch.as_tensor(cu_seqlens, dtype=torch.long), name="loss_mask", dtype=torch.float64)
    if not bool((mask != 0).any()):
        raise RolloutInputError(
            "field 'loss_mask' is 0 at every trained position of every trajectory (its first entry gates no log-prob): "
            "the step would train on nothing; mark the tokens to train on with 1"
        )
