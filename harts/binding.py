"""Where a compiled plan meets a batch: :meth:`harts.Plan.bind` -> :class:`BoundPlan`.

A plan is compiled for one batch (its input hash, :meth:`~harts.RolloutBatch.input_hash`:
tokens, tree structure and routed experts; fields that do not change the computation, such as
old / reference log-probs or advantages, may be added after compiling). Binding checks,
once, everything the runtime relies on when it executes a plan on a batch:

* the batch's input hash is the plan's;
* the plan's trajectories are the batch's (count and lengths);
* every trajectory through a compact row carries the same token there, gathered once per
  microbatch as the rows' input ids: a plan whose hash was forged for another batch fails
  here, naming the two trajectories and the position, instead of running on the wrong tokens;
* with a model: every token id lies in its vocabulary, and the routed experts (router replay)
  have the model's MoE shape, valid ids, and agree on every shared row.

The runtime (:func:`harts.runtime.log_probs`) and :class:`harts.train.Trainer` bind a
:class:`~harts.Plan` they are given, or take a :class:`BoundPlan` bound before; nothing else
runs a plan. This module needs numpy only (compiling does not load torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from harts.errors import ModelInputError, PlanArtifactError, PlanBatchMismatchError, RolloutInputError
from harts.ir.layout import MicrobatchLayout
from harts.rollouts.batch import RolloutBatch

if TYPE_CHECKING:  # the plan module imports this one to offer Plan.bind
    from harts.plan import Plan

__all__ = ["BoundPlan", "ModelLimits", "bind"]


@attrs.frozen
class ModelLimits:
    """What binding checks a batch against on a model: its vocabulary and MoE routing shape."""

    vocab_size: int | None = None
    num_moe_layers: int = 0
    num_experts_per_tok: int = 0
    num_experts: int = 0

    @classmethod
    def of(cls, model: Any) -> "ModelLimits":
        """The limits of a model (or its config); unknown figures are not checked."""
        config = getattr(model, "config", model)
        vocab = getattr(config, "vocab_size", None)
        return cls(
            vocab_size=None if vocab is None else int(vocab),
            num_moe_layers=int(getattr(config, "num_moe_layers", 0) or 0),
            num_experts_per_tok=int(getattr(config, "num_experts_per_tok", 0) or 0),
            num_experts=int(getattr(config, "num_experts", 0) or 0),
        )


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def check_vocabulary(batch: RolloutBatch, vocab_size: int | None, trajectories=None) -> None:
    """Every token id must index the model's embedding; name the first trajectory that does not."""
    if vocab_size is None:
        return
    for trajectory in range(len(batch.tokens)) if trajectories is None else sorted(int(t) for t in trajectories):
        tokens = batch.tokens[trajectory]
        if tokens.size and int(tokens.max()) >= vocab_size:
            entry = int(np.flatnonzero(tokens >= vocab_size)[0])
            raise RolloutInputError(
                f"trajectory {trajectory}: field 'tokens' entry {entry} is {int(tokens[entry])}, "
                f"outside the model's vocabulary (vocab_size {vocab_size})"
            )


def check_routed_experts(batch: RolloutBatch, limits: ModelLimits, trajectories) -> tuple[np.ndarray, ...] | None:
    """The batch's replayed experts (``[len, L_moe, k]`` per trajectory), checked against the model; None when absent."""
    routed = batch.routed_experts
    if routed is None:
        return None
    expected = (limits.num_moe_layers, limits.num_experts_per_tok)
    for trajectory in sorted(int(t) for t in trajectories):
        experts = routed[trajectory]
        if experts.shape[1:] != expected:
            raise RolloutInputError(
                f"trajectory {trajectory}: field 'routed_experts' has [layers, top_k] = {list(experts.shape[1:])}, "
                f"the model has {expected[0]} MoE layer(s) with top_k {expected[1]}"
            )
        if experts.size == 0:
            continue
        bad = (experts < 0) | (experts >= limits.num_experts)
        ordered = np.sort(experts, axis=-1)
        repeated = np.zeros_like(bad)
        repeated[..., 1:] = ordered[..., 1:] == ordered[..., :-1]
        for problem, what in ((bad, f"outside [0, {limits.num_experts})"), (repeated, "repeated in one token's top-k")):
            if problem.any():
                position, layer, _ = (int(v) for v in np.argwhere(problem)[0])
                raise RolloutInputError(
                    f"trajectory {trajectory}: field 'routed_experts' at position {position}, MoE layer {layer}: "
                    f"experts {experts[position, layer].tolist()} hold an id {what}"
                )
    return routed


def _check_trajectories(plan: "Plan", batch: RolloutBatch) -> None:
    """The plan's trajectories are the batch's: same count, same lengths."""
    planned = plan.module.trajectories
    if len(planned) != len(batch.tokens):
        raise PlanBatchMismatchError(f"the plan holds {len(planned)} trajectories, the batch {len(batch.tokens)}")
    for index, (trajectory, tokens) in enumerate(zip(planned, batch.tokens)):
        if trajectory.length != len(tokens):
            raise PlanBatchMismatchError(
                f"trajectory {index}: the plan was compiled for {trajectory.length} tokens, the batch holds {len(tokens)}"
            )


def _row_tokens(layout: MicrobatchLayout, batch: RolloutBatch) -> np.ndarray:
    """The token of every compact row, gathered once; trajectories sharing a row must agree on it."""
    try:
        return _read_only(layout.gather_rows(batch.tokens, "tokens"))
    except RolloutInputError as error:
        raise PlanBatchMismatchError(
            f"microbatch {layout.microbatch}: {error}; the plan does not fit this batch (was its input hash edited?)"
        ) from None


@attrs.frozen(eq=False)
class BoundPlan:
    """A laid-out plan bound to the batch it runs on (see the module docstring).

    ``row_tokens[k]`` [C_k] are microbatch k's input ids; ``row_experts[k]`` [C_k, L_moe, top_k]
    its replayed experts per row (None without router replay, or before a model was checked);
    ``limits`` the model figures the batch was checked against (None: no model yet).
    """

    plan: "Plan"
    batch: RolloutBatch
    row_tokens: tuple[np.ndarray, ...]
    row_experts: tuple[np.ndarray | None, ...] | None = None
    limits: ModelLimits | None = None

    @property
    def module(self):
        return self.plan.module

    @property
    def layouts(self) -> tuple[MicrobatchLayout, ...]:
        return self.plan.layouts

    @property
    def microbatches(self):
        return self.plan.microbatches

    @property
    def input_hash(self) -> str:
        return self.plan.input_hash

    @property
    def stats(self) -> dict[str, Any]:
        return self.plan.stats

    def layout(self, microbatch: int) -> MicrobatchLayout:
        return self.plan.layout(microbatch)

    def for_batch(self, batch: RolloutBatch) -> "BoundPlan":
        """This binding, for ``batch``: the same one when the batch is the bound one or has its input
        hash (a copy with fields added after compiling), else :class:`PlanBatchMismatchError`."""
        if batch is self.batch:
            return self
        _check_hash(self.plan, batch)
        return attrs.evolve(self, batch=batch)

    def for_model(self, model: Any) -> "BoundPlan":
        """This binding checked against a model's vocabulary and routing (once per distinct set of limits)."""
        limits = ModelLimits.of(model)
        if limits == self.limits:
            return self
        if limits.vocab_size is not None and any(t.size and int(t.max()) >= limits.vocab_size for t in self.row_tokens):
            check_vocabulary(self.batch, limits.vocab_size)  # the rows hold every token; this names the first trajectory
        routed = check_routed_experts(self.batch, limits, range(len(self.batch.tokens)))
        experts = None
        if routed is not None:
            # one decision per compact row: every trajectory through a row must replay the same experts
            experts = tuple(_read_only(layout.gather_rows(routed, "routed_experts")) for layout in self.layouts)
        return attrs.evolve(self, row_experts=experts, limits=limits)


def _check_hash(plan: "Plan", batch: RolloutBatch) -> None:
    if batch.input_hash() != plan.input_hash:
        raise PlanBatchMismatchError(
            f"the plan was compiled for batch {plan.input_hash[:20]}..., not for this batch ({batch.input_hash()[:20]}...): "
            "compile it for this batch"
        )


def bind(plan: "Plan", batch: RolloutBatch, model: Any = None) -> BoundPlan:
    """Bind a laid-out plan to ``batch`` (and, given ``model``, check the batch against it)."""
    if not isinstance(batch, RolloutBatch):
        raise ModelInputError(f"a plan binds to a harts.RolloutBatch, got {type(batch).__name__}")
    if plan.layouts is None:
        raise PlanArtifactError(
            f"the plan is at phase {plan.module.phase}; running it needs a laid-out plan (compile with the full pipeline)"
        )
    _check_hash(plan, batch)
    _check_trajectories(plan, batch)
    bound = BoundPlan(plan=plan, batch=batch, row_tokens=tuple(_row_tokens(layout, batch) for layout in plan.layouts))
    return bound if model is None else bound.for_model(model)
