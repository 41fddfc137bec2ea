"""Public runtime entry points: per-token log-probs of a batch, with a plan or trajectory-wise.

``log_probs(model, plan, batch)`` binds the plan to the batch once (:mod:`harts.binding`:
hash, trajectories, shared-row tokens, vocabulary, routed experts; ``plan`` may be a laid-out
:class:`~harts.Plan` or a :class:`~harts.binding.BoundPlan`), runs every microbatch of it on its compact
layout (:class:`~harts.runtime.tree_view.TreeView`), computes log-probs per compact row and
maps them to semantic positions; ``log_probs_baseline(model, batch)`` expands every
trajectory and runs it as its own packed sequence (:class:`~harts.runtime.view.BaselineView`)
through the same model and kernels. Both return a :class:`LogProbOutput` in the user's
trajectory order: ``out.log_probs[i][t] = log p(tokens_i[t+1] | tokens_i[:t+1])``.

Router replay: when the batch carries ``routed_experts`` (:attr:`harts.RolloutBatch.routed_experts`),
every MoE layer uses those experts instead of its own top-k, once per compact row for a plan
(the trajectories through a row must agree, else :class:`~harts.errors.RolloutInputError`
names both: checked when binding) and once per position for the baseline.

``temperature`` divides the logits before the log-softmax, as the rollout engine sampled.
``model`` may be a data-parallel wrapper (``DistributedDataParallel``, or a model passed to
FSDP2's ``fully_shard``): the forward runs through the wrapper's ``forward`` (see
:meth:`HybridModel.forward`'s ``head``), so its gradient synchronisation and parameter
gathering take place.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

import attrs
import numpy as np
import torch
from torch import nn

from harts.binding import BoundPlan, ModelLimits, check_routed_experts, check_vocabulary
from harts.codegen.fx import log_prob_rows
from harts.errors import ModelInputError, PlanArtifactError, RolloutInputError
from harts.kernels import host
from harts.kernels.dispatch import Dispatch
from harts.kernels.interface import Kernels
from harts.numerics import compact_log_probs, log_probs_from_logits
from harts.options import DEFAULT_OPTIONS
from harts.plan import Plan
from harts.runtime.model import HybridModel
from harts.runtime.moe import MoEStats
from harts.runtime.programs import RUNTIME_CACHE
from harts.runtime.tree_view import TreeView
from harts.runtime.view import BaselineView

logger = logging.getLogger(__name__)

#: The kernels of a plan compiled with ``fast_kernels=True`` on a GPU: fast paths, and an error where linear
#: attention has none (instead of the reference, which ``auto`` dispatch would run without a word).
_FAST_KERNELS = Dispatch("fast")

#: The chunk size of a trajectory-wise baseline run without a plan (the compiler's default B).
DEFAULT_CHUNK_SIZE = DEFAULT_OPTIONS.chunk_size

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "LogProbOutput",
    "MicrobatchOutput",
    "bind_plan",
    "log_probs",
    "log_probs_baseline",
    "microbatch_log_probs",
    "microbatch_log_probs_baseline",
    "unwrap_model",
]


@attrs.frozen(eq=False)
class LogProbOutput:
    """Per-token log-probs of a batch in original order, with the run's MoE statistics.

    ``log_probs[i]`` has ``len(tokens_i) - 1`` entries; ``packed`` is their concatenation and
    ``cu_seqlens`` [N + 1] its offsets (the list entries are views of ``packed``).
    ``entropy`` (if asked for) is laid out the same way. ``rows`` counts the hidden rows
    the model executed (C for a plan, S for the baseline). ``input_hash`` is the batch's
    (:meth:`~harts.RolloutBatch.input_hash`): framework exporters refuse to lay the output out
    against another batch.
    """

    log_probs: list[torch.Tensor]
    packed: torch.Tensor
    cu_seqlens: torch.Tensor
    moe: MoEStats
    entropy: list[torch.Tensor] | None = None
    packed_entropy: torch.Tensor | None = None
    rows: int = 0
    input_hash: str | None = None


@attrs.frozen(eq=False)
class MicrobatchOutput:
    """One microbatch's log-probs, member-major: ``trajectories[j]`` owns ``log_probs[offsets[j]:offsets[j+1]]``."""

    trajectories: tuple[int, ...]
    offsets: np.ndarray
    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    moe: MoEStats
    rows: int


def bind_plan(plan: Plan | BoundPlan, batch, model: nn.Module) -> BoundPlan:
    """``plan`` bound to ``batch`` and checked against ``model`` (the binding's checks run once per plan and batch)."""
    if isinstance(plan, BoundPlan):
        bound = plan.for_batch(batch)
    elif isinstance(plan, Plan):
        bound = plan.bind(batch)
    else:
        raise ModelInputError(
            f"expected a harts.Plan (from harts.compile or harts.load_plan) or a BoundPlan (Plan.bind), got {type(plan).__name__}"
        )
    return bound.for_model(unwrap_model(model))


def _has_linear_head(model: nn.Module) -> bool:
    """True when logits are exactly ``lm_head(hidden)`` with an ``nn.Linear`` head."""
    logits = getattr(type(model), "logits", None)
    return isinstance(getattr(model, "lm_head", None), nn.Linear) and (logits is None or logits is HybridModel.logits)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module a data-parallel or compile wrapper holds (itself for FSDP2, which wraps in place).

    Read attributes (``config``, ``lm_head``) from it; call the wrapper itself for forward.
    """
    import sys

    from torch.nn.parallel import DataParallel, DistributedDataParallel

    # megatron-core's DDP (harts.parallel.optim), recognised without importing megatron-core
    megatron = sys.modules.get("megatron.core.distributed")
    wrappers = (DistributedDataParallel, DataParallel) + ((megatron.DistributedDataParallel,) if megatron else ())
    while True:
        if isinstance(model, wrappers):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def _check_temperature(temperature: float) -> float:
    temperature = float(temperature)
    if not (temperature > 0 and np.isfinite(temperature)):
        raise ModelInputError(f"temperature must be a positive finite number, got {temperature!r}")
    return temperature


def _head_weights(model: nn.Module, temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head's weight and bias, divided by the temperature: logits / T = h (W / T)^T + b / T.

    Scaling the [V, D] weight once per call keeps the compact log-prob program unchanged
    (it never holds a [C, V] logit tensor to divide).
    """
    head = model.lm_head
    if temperature == 1.0:
        return head.weight, head.bias
    return head.weight / temperature, None if head.bias is None else head.bias / temperature


def _forward_with_head(model: nn.Module, input_ids: torch.Tensor, view, recompute: bool, head, routed_experts=None):
    """Run ``model`` (or its wrapper's forward) with ``head`` in place of the LM head: (head output, MoEStats)."""
    if model is unwrap_model(model) and not isinstance(model, HybridModel):
        # another model class offering forward_hidden (its forward may not take a head); nothing wraps it
        hidden, moe = model.forward_hidden(input_ids, view, recompute=recompute, routed_experts=routed_experts)
        return head(model, hidden), moe
    output, moe_fields = model(input_ids, view, recompute=recompute, routed_experts=routed_experts, head=head)
    return output, MoEStats(*moe_fields)


def _log_probs_from_hidden(model, hidden, input_ids, rows, next_rows, with_entropy, row_chunk, temperature=1.0):
    """Compact-to-semantic log-probs of positions whose logit rows are ``rows`` and next tokens sit at ``next_rows``."""
    targets = host.index_select(input_ids, next_rows)
    own_head = getattr(model, "head_log_probs", None)
    if own_head is not None:
        # a model that lays out its own LM head (harts.parallel's vocabulary shards) maps rows to positions itself
        return own_head(hidden, rows, targets, with_entropy=with_entropy, row_chunk=row_chunk, temperature=temperature)
    if _has_linear_head(model):
        weight, bias = _head_weights(model, temperature)
        return compact_log_probs(hidden, weight, bias, rows, targets, with_entropy=with_entropy, row_chunk=row_chunk)
    # A custom head: its logits are still formed once per row, never per position.
    logits = model.logits(hidden)
    if temperature != 1.0:
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    return log_probs_from_logits(logits, rows, targets, with_entropy=with_entropy)


def microbatch_log_probs(
    model: nn.Module,
    plan: Plan | BoundPlan,
    batch,
    microbatch: int,
    *,
    recompute: bool = False,
    with_entropy: bool = False,
    row_chunk: int | None = None,
    kernels: Kernels | None = None,
    view_type: type[TreeView] = TreeView,
    temperature: float = 1.0,
) -> MicrobatchOutput:
    """Run one microbatch of a compiled plan (e.g. one step of gradient accumulation).

    ``plan`` is a laid-out :class:`~harts.Plan` or one already bound to ``batch``
    (:meth:`harts.Plan.bind`: the checks then run once for all microbatches).
    ``view_type`` builds the execution view from the microbatch's layout; a subclass of
    :class:`TreeView` changes how sequence operators are scheduled on the same rows (the
    node-at-a-time ablation, :class:`harts_bench.ablation.NodeAtATimeView`).
    """
    temperature = _check_temperature(temperature)
    bound = bind_plan(plan, batch, model)
    return _run_microbatch(model, bound, microbatch, recompute=recompute, with_entropy=with_entropy, row_chunk=row_chunk,
                           kernels=kernels, view_type=view_type, temperature=temperature)


#: Per bound plan, its microbatches' row tokens and replayed experts on a device: copied once per
#: binding (:func:`harts.kernels.host.upload`, no wait for the device), then reused by every pass
#: over it (the no-grad and training passes of a step, its epochs), and dropped with the binding.
_BOUND_ROWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _bound_rows(bound: BoundPlan, microbatch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input ids [C], routed experts [C, L_moe, k] or None) of one microbatch of ``bound`` on ``device``."""
    per_device = _BOUND_ROWS.setdefault(bound, {})
    key = (microbatch, str(device))
    if key not in per_device:
        routed = bound.row_experts
        per_device[key] = (
            host.upload(bound.row_tokens[microbatch], device, torch.long),
            None if routed is None else host.upload(routed[microbatch], device),
        )
    return per_device[key]


def _run_microbatch(model, bound: BoundPlan, microbatch: int, *, recompute, with_entropy, row_chunk, kernels, view_type,
                    temperature) -> MicrobatchOutput:
    layout = bound.layout(microbatch)
    device = next(unwrap_model(model).parameters()).device
    if kernels is None and bound.plan.fast_kernels and device.type == "cuda":
        kernels = _FAST_KERNELS  # compiled for the fast kernels: a fallback to the reference raises
    view = view_type(layout, device=device, kernels=kernels)
    input_ids, routed = _bound_rows(bound, microbatch, device)
    rows, next_rows, offsets = RUNTIME_CACHE.get(layout, "log_prob_rows", lambda: log_prob_rows(layout))

    def head(network: nn.Module, hidden: torch.Tensor):
        if _has_linear_head(network):
            weight, bias = _head_weights(network, temperature)
            program = RUNTIME_CACHE.program(layout, "log_probs", device)
            return program(hidden, input_ids, weight, bias, with_entropy, row_chunk)
        rows_t = RUNTIME_CACHE.tensor(layout, "logit_rows", lambda: rows, device)
        next_t = RUNTIME_CACHE.tensor(layout, "next_token_rows", lambda: next_rows, device)
        return _log_probs_from_hidden(network, hidden, input_ids, rows_t, next_t, with_entropy, row_chunk, temperature)

    (values, entropy), moe = _forward_with_head(model, input_ids, view, recompute, head, routed)
    return MicrobatchOutput(
        trajectories=tuple(int(t) for t in layout.trajectories),
        offsets=offsets,
        log_probs=values,
        entropy=entropy,
        moe=moe,
        rows=layout.num_rows,
    )


def _assemble(batch, outputs: list[MicrobatchOutput], with_entropy: bool) -> LogProbOutput:
    count = len(batch.tokens)
    owner: list[tuple[int, int] | None] = [None] * count
    for k, output in enumerate(outputs):
        for j, trajectory in enumerate(output.trajectories):
            if owner[trajectory] is not None:
                raise PlanArtifactError(f"trajectory {trajectory} belongs to two microbatches")
            owner[trajectory] = (k, j)
    missing = [i for i, o in enumerate(owner) if o is None]
    if missing:
        raise PlanArtifactError(f"trajectory {missing[0]} belongs to no microbatch of the plan")

    def gather(select) -> torch.Tensor:
        pieces = []
        for k, j in owner:
            output = outputs[k]
            pieces.append(select(output)[int(output.offsets[j]) : int(output.offsets[j + 1])])
        return torch.cat(pieces)

    packed = gather(lambda o: o.log_probs)
    lengths = [len(t) - 1 for t in batch.tokens]
    cu_seqlens = torch.zeros(count + 1, dtype=torch.long)
    cu_seqlens[1:] = torch.cumsum(torch.as_tensor(lengths, dtype=torch.long), 0)
    packed_entropy = gather(lambda o: o.entropy) if with_entropy else None
    moe = outputs[0].moe
    for output in outputs[1:]:
        moe = MoEStats.merge(moe, output.moe)
    return LogProbOutput(
        log_probs=list(packed.split(lengths)),
        packed=packed,
        cu_seqlens=cu_seqlens,
        moe=moe,
        entropy=list(packed_entropy.split(lengths)) if with_entropy else None,
        packed_entropy=packed_entropy,
        rows=sum(o.rows for o in outputs),
        input_hash=batch.input_hash(),
    )


def log_probs(
    model: nn.Module,
    plan: Plan | BoundPlan,
    batch,
    recompute: bool = False,
    *,
    with_entropy: bool = False,
    row_chunk: int | None = None,
    kernels: Kernels | None = None,
    view_type: type[TreeView] = TreeView,
    temperature: float = 1.0,
) -> LogProbOutput:
    """Per-token log-probs of ``batch`` under ``model``, executing the compiled ``plan``.

    ``plan``: a laid-out :class:`~harts.Plan` (:func:`harts.compile`, :func:`harts.load_plan`)
    or a :class:`~harts.binding.BoundPlan`; it is bound to ``batch`` once (see :mod:`harts.binding`).
    Every microbatch runs on its compact layout; each trajectory's log-probs come from the
    one microbatch that holds it. Differentiable w.r.t. the model's parameters; MoE
    statistics are summed over microbatches. ``view_type``: see :func:`microbatch_log_probs`.
    """
    temperature = _check_temperature(temperature)
    bound = bind_plan(plan, batch, model)
    outputs = [
        _run_microbatch(
            model, bound, mb.index, recompute=recompute, with_entropy=with_entropy, row_chunk=row_chunk,
            kernels=kernels, view_type=view_type, temperature=temperature,
        )
        for mb in bound.microbatches
    ]
    return _assemble(batch, outputs, with_entropy)


def _baseline_groups(batch, microbatches) -> tuple[list[list[int]], int | None]:
    if microbatches is None:
        return [list(range(len(batch.tokens)))], None
    if isinstance(microbatches, (Plan, BoundPlan)):
        module = microbatches.module
        if module.microbatches is None:
            raise PlanArtifactError(f"the plan at phase {module.phase} has no microbatches")
        return [list(mb.trajectories) for mb in module.microbatches], module.chunk_size
    groups = [[int(i) for i in group] for group in microbatches]
    for group in groups:
        for i in group:
            if not 0 <= i < len(batch.tokens):
                raise RolloutInputError(f"microbatch membership names trajectory {i}, but the batch has {len(batch.tokens)}")
    return groups, None


def microbatch_log_probs_baseline(
    model: nn.Module,
    batch,
    trajectories,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    recompute: bool = False,
    with_entropy: bool = False,
    row_chunk: int | None = None,
    kernels: Kernels | None = None,
    temperature: float = 1.0,
) -> MicrobatchOutput:
    """The trajectory-wise baseline of one microbatch: ``trajectories`` expanded, one packed sequence each.

    ``chunk_size`` is the linear-attention chunk of every expanded sequence (the baseline has
    no plan; pass the plan's to compare with it chunk for chunk). The output is laid out as :func:`microbatch_log_probs`' (members in ascending order), so a
    training loop runs either on the same microbatch membership.
    """
    temperature = _check_temperature(temperature)
    inner = unwrap_model(model)
    members = sorted(int(i) for i in trajectories)
    for i in members:
        if not 0 <= i < len(batch.tokens):
            raise RolloutInputError(f"microbatch membership names trajectory {i}, but the batch has {len(batch.tokens)}")
    limits = ModelLimits.of(inner)
    check_vocabulary(batch, limits.vocab_size, members)
    device = next(inner.parameters()).device
    lengths = [len(batch.tokens[i]) for i in members]
    view = BaselineView(lengths, chunk_size, device, kernels=kernels)
    input_ids = host.upload(np.concatenate([batch.tokens[i] for i in members]), device, torch.long)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    row_of = np.concatenate([s + np.arange(n - 1) for s, n in zip(starts, lengths)]).astype(np.int64)
    rows, next_rows = host.upload(row_of, device), host.upload(row_of + 1, device)
    offsets = np.zeros(len(members) + 1, dtype=np.int64)
    np.cumsum([n - 1 for n in lengths], out=offsets[1:])

    routed = check_routed_experts(batch, limits, members)
    if routed is not None:
        routed = host.upload(np.concatenate([routed[i] for i in members]), device)

    def head(network: nn.Module, hidden: torch.Tensor):
        return _log_probs_from_hidden(network, hidden, input_ids, rows, next_rows, with_entropy, row_chunk, temperature)

    (values, entropy), moe = _forward_with_head(model, input_ids, view, recompute, head, routed)
    return MicrobatchOutput(tuple(members), offsets, values, entropy, moe, int(sum(lengths)))


def log_probs_baseline(
    model: nn.Module,
    batch,
    recompute: bool = False,
    microbatches: Plan | BoundPlan | Sequence[Sequence[int]] | None = None,
    *,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    row_chunk: int | None = None,
    kernels: Kernels | None = None,
    temperature: float = 1.0,
) -> LogProbOutput:
    """Trajectory-wise baseline: every trajectory expanded and run as its own packed sequence.

    ``microbatches``: None (one microbatch), a plan (its microbatch membership and chunk
    size) or a list of trajectory-index lists. ``chunk_size`` defaults to the plan's, else
    :data:`DEFAULT_CHUNK_SIZE` (64).
    """
    check_vocabulary(batch, ModelLimits.of(unwrap_model(model)).vocab_size)
    groups, plan_chunk = _baseline_groups(batch, microbatches)
    outputs = [
        microbatch_log_probs_baseline(
            model, batch, group, chunk_size=chunk_size or plan_chunk or DEFAULT_CHUNK_SIZE, recompute=recompute, with_entropy=with_entropy,
            row_chunk=row_chunk, kernels=kernels, temperature=temperature,
        )
        for group in groups
    ]
    return _assemble(batch, outputs, with_entropy)
