"""What every trainer plug-in does, independent of the framework: :class:`HartsEngine`.

A plug-in hands the engine its Hugging Face model and the token lists of a batch; the engine

1. shares the model (:func:`harts.models.share_hf`, once per model object, re-shared if the
   framework replaced its tensors), so gradients land on the framework's parameters;
2. compiles the batch once (:class:`PlanCache`): trajectories are put in a canonical order,
   so the policy, old and reference passes over the same rollouts, shuffled or not, hit the
   same plan;
3. runs log-probs (and entropies, and the MoE router statistics) on the plan;
4. returns them per trajectory in the caller's order; :func:`scatter_next_token` places them
   in a padded [rows, columns] layout.

Padded rows come in as ``input_ids`` and ``attention_mask`` [B, W] (:func:`trajectories_from_padded`):
each row's real tokens must be one contiguous run (left and right padding only), since a
hole would change what a transformers forward computes on the tokens after it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Sequence

import attrs
import numpy as np
import torch
from torch import nn

from harts.compiler import compile as compile_plan
from harts.errors import HartsError
from harts.models import is_shared, share_hf
from harts.plan import Plan
from harts.rollouts import RolloutBatch
from harts.runtime import HybridModel, log_probs
from harts.runtime.moe import SparseMoeBlock

logger = logging.getLogger(__name__)

__all__ = [
    "EngineOutput",
    "SharedModels",
    "compile_for",
    "scalar_temperature",
    "HartsEngine",
    "IntegrationError",
    "PlanCache",
    "plan_key",
    "router_aux_loss",
    "scatter_next_token",
    "trajectories_from_padded",
]


class IntegrationError(HartsError, ValueError):
    """A trainer configuration or batch a HARTS plug-in cannot run exactly; names the option or row."""


def plan_key(batch: RolloutBatch) -> str:
    """What a cached plan is looked up by: the batch's tokens and structure (its input hash, the one a
    plan binds to), so fields added later, such as old or reference log-probs, find the same plan."""
    return batch.input_hash()


@attrs.frozen(eq=False)
class CompiledBatch:
    """A batch in canonical order, its plan, and ``order``: canonical entry k is the caller's trajectory ``order[k]``."""

    batch: RolloutBatch
    plan: Plan
    order: np.ndarray


class PlanCache:
    """Compiled plans of the most recent distinct trajectory sets (least recently used dropped first).

    A hand-kept OrderedDict rather than functools.lru_cache: the key is computed from the batch
    built here, and the value needs the batch and the permutation along with the plan.
    """

    def __init__(self, *, capacity: int | None, chunk_size: int, size: int = 4):
        if size < 1:
            raise IntegrationError(f"PlanCache: size must be at least 1, got {size}")
        self.capacity = capacity
        self.chunk_size = chunk_size
        self.size = size
        self.compiles = 0
        self._plans: collections.OrderedDict[str, CompiledBatch] = collections.OrderedDict()

    def get(self, trajectories: Sequence[Sequence[int]]) -> CompiledBatch:
        """The compiled batch of ``trajectories`` (any order), compiling it on a miss."""
        order = np.array(sorted(range(len(trajectories)), key=lambda i: tuple(trajectories[i])), dtype=np.int64)
        batch = RolloutBatch.from_trajectories([list(trajectories[i]) for i in order])
        key = plan_key(batch)
        hit = self._plans.get(key)
        if hit is not None:
            self._plans.move_to_end(key)
            return CompiledBatch(hit.batch, hit.plan, order)
        longest = max(len(t) for t in batch.tokens)
        capacity = max(longest, self.capacity or batch.semantic_tokens)
        if self.capacity is not None and capacity > self.capacity:
            # a trajectory never splits across microbatches: the longest one sets the floor
            logger.warning("HARTS capacity %d is below the longest trajectory (%d tokens); planning with %d",
                           self.capacity, longest, capacity)
        plan = compile_plan(batch, capacity=capacity, chunk_size=self.chunk_size)
        self.compiles += 1
        logger.info("HARTS plan %d: %d trajectories, %d tokens", self.compiles, len(batch.tokens), batch.semantic_tokens)
        compiled = CompiledBatch(batch, plan, order)
        self._plans[key] = compiled
        while len(self._plans) > self.size:
            self._plans.popitem(last=False)
        return compiled


@attrs.frozen(eq=False)
class EngineOutput:
    """Per trajectory, in the caller's order: ``log_probs[i][t] = log p(tokens_i[t+1] | tokens_i[:t+1])``."""

    log_probs: list[torch.Tensor]
    entropy: list[torch.Tensor] | None
    aux_loss: torch.Tensor | None


class SharedModels:
    """The HARTS model of each framework Hugging Face model, sharing its tensors (:func:`harts.models.share_hf`).

    Built once per model object and rebuilt when the framework replaced that model's tensors
    (``load_state_dict(assign=True)``, a re-wrapping), so the HARTS model never computes on
    stale weights and never holds a second copy of them.
    """

    def __init__(self):
        self._shared: dict[int, tuple[nn.Module, HybridModel]] = {}

    def __call__(self, hf_model: nn.Module) -> HybridModel:
        held = self._shared.get(id(hf_model))
        if held is not None and held[0] is hf_model and is_shared(held[1], hf_model):
            held[1].train(hf_model.training)
            return held[1]
        if held is not None:
            logger.info("HARTS: %s's tensors were replaced; sharing them again", type(hf_model).__name__)
        for parameter in hf_model.parameters():
            if type(parameter).__name__ == "DTensor":  # HARTS' forward does not run FSDP's unsharding hooks
                raise IntegrationError(
                    "the framework's model is sharded (FSDP2 DTensor parameters); the HARTS engine runs on the "
                    "unsharded model (world size 1, or a replicated model) until it gathers shards itself"
                )
        model = share_hf(hf_model)
        model.train(hf_model.training)
        self._shared[id(hf_model)] = (hf_model, model)
        return model


def scalar_temperature(value, where: str) -> float:
    """The sampling temperature as one number (HARTS scales one LM head for the whole batch)."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().flatten()
        if flat.numel() == 0 or not bool((flat == flat[0]).all()):
            raise IntegrationError(f"{where}: per-trajectory temperatures differ; HARTS runs one temperature per batch")
        return float(flat[0])
    return float(value)


def compile_for(batch: RolloutBatch, capacity: int | None) -> Plan:
    """One plan for a framework's batch: microbatches of at most ``capacity`` compact rows (all in one when None)."""
    longest = int(batch.lengths.max(initial=1))
    capacity = max(int(capacity or batch.semantic_tokens), longest)
    return compile_plan(batch, capacity=capacity, dp_size=1)


class HartsEngine:
    """Shares Hugging Face models, caches plans and runs passes (see the module docstring).

    ``capacity``: compact tokens per microbatch (None: the whole batch in one); ``chunk_size``:
    the linear-attention chunk size plans are compiled for; ``cache_size``: how many distinct
    trajectory sets keep their plan.
    """

    def __init__(self, *, capacity: int | None = None, chunk_size: int = 64, cache_size: int = 4):
        self.plans = PlanCache(capacity=capacity, chunk_size=chunk_size, size=cache_size)
        self.model_for = SharedModels()
        """The HARTS model sharing a Hugging Face model's tensors (built once; rebuilt if they were replaced)."""

    def run(
        self,
        hf_model: nn.Module,
        trajectories: Sequence[Sequence[int]],
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        with_aux_loss: bool = False,
        recompute: bool = False,
    ) -> EngineOutput:
        """Log-probs (entropies, transformers' router aux loss) of ``trajectories`` under ``hf_model``, on one cached plan."""
        model = self.model_for(hf_model)
        compiled = self.plans.get(trajectories)
        with capture_router_logits(model, enabled=with_aux_loss) as captured:
            out = log_probs(model, compiled.plan, compiled.batch, recompute, with_entropy=with_entropy,
                            temperature=temperature)
        aux = router_aux_loss(captured, model.config.num_experts, model.config.num_experts_per_tok) if with_aux_loss else None
        caller = np.empty_like(compiled.order)
        caller[compiled.order] = np.arange(len(compiled.order))
        values = [out.log_probs[k] for k in caller]
        entropy = [out.entropy[k] for k in caller] if with_entropy else None
        return EngineOutput(values, entropy, aux)


@contextlib.contextmanager
def capture_router_logits(model: HybridModel, *, enabled: bool):
    """Per MoE layer, the (router logits [C, E], row weights [C]) of every forward inside the block.

    Hooks live only inside the block, so a backward that recomputes checkpointed layers later
    records nothing.
    """
    captured: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    if not enabled:
        yield captured
        return
    handles = []
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            layer: list[tuple[torch.Tensor, torch.Tensor]] = []
            captured.append(layer)
            pending: list[torch.Tensor] = []
            handles.append(block.register_forward_pre_hook(
                lambda _m, args, kwargs, pending=pending: pending.append(args[1] if len(args) > 1 else kwargs["row_weight"]),
                with_kwargs=True))
            handles.append(block.gate.register_forward_hook(
                lambda _m, _args, output, layer=layer, pending=pending: layer.append((output[0], pending.pop()))))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def router_aux_loss(captured: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]], num_experts: int, top_k: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` over compact rows, each row weighted by the positions it stands for.

    ``captured``: per MoE layer, (router logits, row weights) of each microbatch run. transformers'
    function weights rows by its ``attention_mask``; a compact row stands for ``row_weight``
    semantic positions, so the row weights are passed as that mask, and the loss is the one the
    trajectory-wise forward computes over every real token. Every MoE layer routes the same
    rows (the microbatches' rows, in order), as the function assumes of its one mask.
    """
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    if not captured or not captured[0]:
        raise IntegrationError("router aux loss asked for, but the model routed no rows (no MoE layer ran)")
    rows = [weight for _, weight in captured[0]]
    for layer in captured[1:]:
        if len(layer) != len(rows) or any(weight is not first for (_, weight), first in zip(layer, rows)):
            raise IntegrationError("router aux loss: the MoE layers of one pass routed different rows")
    logits = tuple(torch.cat([layer_logits for layer_logits, _ in layer]) for layer in captured)
    return load_balancing_loss_func(logits, num_experts, top_k, torch.cat(rows)[None, :])


def trajectories_from_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[list[list[int]], np.ndarray]:
    """Each row's real tokens and the column of its first one: ``(token lists, starts [B])``.

    Raises :class:`IntegrationError` naming the row for a row without tokens or whose real
    tokens are not one contiguous run.
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise IntegrationError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must be one [B, W] shape"
        )
    ids = input_ids.detach().cpu().numpy()
    mask = attention_mask.detach().cpu().numpy() != 0
    trajectories, starts = [], np.zeros(len(ids), dtype=np.int64)
    for row, (tokens, real) in enumerate(zip(ids, mask)):
        columns = np.flatnonzero(real)
        if columns.size == 0:
            raise IntegrationError(f"row {row}: attention_mask has no real token")
        if columns[-1] - columns[0] + 1 != columns.size:
            raise IntegrationError(
                f"row {row}: attention_mask has a hole (real tokens at columns {columns[0]}..{columns[-1]} but "
                f"{columns[-1] - columns[0] + 1 - columns.size} masked in between); HARTS reads left and right padding only"
            )
        starts[row] = columns[0]
        trajectories.append(tokens[columns[0] : columns[-1] + 1].tolist())
    return trajectories, starts


def scatter_next_token(
    values: Sequence[torch.Tensor], starts: np.ndarray, first_column: int, width: int
) -> torch.Tensor:
    """[B, width]: entry (i, j) holds the value of the token at padded column ``first_column + j`` of row i.

    ``values[i][t]`` belongs to trajectory position ``t + 1`` (the token it predicts), and row
    i's position 0 sits at column ``starts[i]``; entries without a value (padding, a row's
    first token) are 0. Differentiable with respect to ``values``.
    """
    rows, columns, flat = [], [], []
    offset = 0
    for row, (row_values, start) in enumerate(zip(values, starts)):
        count = len(row_values)
        first_position = max(1, first_column - int(start))  # positions t + 1 >= 1 that fall inside the window
        last_position = min(count, first_column + width - 1 - int(start))
        if last_position >= first_position:
            positions = np.arange(first_position, last_position + 1)
            rows.append(np.full(positions.size, row))
            columns.append(positions + int(start) - first_column)
            flat.append(offset + positions - 1)
        offset += count
    packed = torch.cat([v.reshape(-1) for v in values]) if values else torch.zeros(0)
    out = packed.new_zeros(len(values), width)
    if not rows:
        return out + 0 * packed.sum()  # keeps the graph connected, as the framework's forward does
    device = packed.device
    index = (torch.as_tensor(np.concatenate(rows), device=device), torch.as_tensor(np.concatenate(columns), device=device))
    return out.index_put(index, packed[torch.as_tensor(np.concatenate(flat), device=device)])

