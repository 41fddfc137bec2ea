"""``partition-microbatches``: choose microbatch membership by J (§3.2, Eq. 4-10).

Builds every candidate (exact DP or sampled-K evolution, trie-aware greedy, refined
anchors, subtree-exchanged and slot-balanced copies of the best), instantiates each candidate's replica/slot assignment to rank it by J, and emits
the winner's microbatches. Replica and slot stay unset here; ``schedule-slots`` sets them
with the same deterministic rule, so the scheduled module has exactly the J that won.
"""

from __future__ import annotations

import logging

import attrs

from harts.errors import PipelineError
from harts.ir.nodes import Microbatch, Module, Phase
from harts.ir.prefix_index import PrefixIndex
from harts.passes.base import Pass, PassContext, register_pass
from harts.planner import PlannerOptions, plan

logger = logging.getLogger(__name__)


def _positive_or_none(instance, attribute, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise PipelineError(f"pass 'partition-microbatches': option '{attribute.name}' must be a positive integer, got {value!r}")


def _positive(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PipelineError(f"pass 'partition-microbatches': option '{attribute.name}' must be a positive integer, got {value!r}")


@register_pass
class PartitionMicrobatches(Pass):
    name = "partition-microbatches"
    summary = "candidate microbatch sets (exact DP / sampled-K / trie greedy / refinement / subtree exchange / slot balancing) ranked by J"
    requires = Phase.COMPRESSED
    produces = Phase.PARTITIONED

    @attrs.frozen
    class Options:
        capacity: int | None = attrs.field(default=None, validator=_positive_or_none)
        dp_size: int | None = attrs.field(default=None, validator=_positive_or_none)
        exact_threshold: int = attrs.field(default=512, validator=_positive)
        sample_budget: int = attrs.field(default=32, validator=_positive)
        refine: bool = True
        greedy: bool = True
        #: slot balancing of the best candidate (harts.planner.balance); never adds compact work
        balance: bool = True
        #: subtree exchange of the best candidate (harts.planner.exchange); only lowers compact work
        exchange: bool = True

    def run(self, module: Module, options: Options, ctx: PassContext) -> Module:
        if module.phase < self.requires or module.trie is None:
            raise PipelineError(
                f"pass 'partition-microbatches' needs a {self.requires} module with a compact trie; got phase {module.phase}"
            )
        capacity = module.capacity if options.capacity is None else options.capacity
        dp_size = module.dp_size if options.dp_size is None else options.dp_size
        index = PrefixIndex.from_module(module)
        result = plan(
            index,
            PlannerOptions(
                capacity=capacity,
                dp_size=dp_size,
                exact_threshold=options.exact_threshold,
                sample_budget=options.sample_budget,
                refine=options.refine,
                greedy=options.greedy,
                balance=options.balance,
                exchange=options.exchange,
            ),
        )
        ctx.report("partition-microbatches", 1.0)
        microbatches = tuple(
            Microbatch(index=position, trajectories=members, work=work)
            for position, (members, work) in enumerate(zip(result.microbatches, result.works))
        )
        logger.debug("partition-microbatches: %d candidates, chosen %s", len(result.candidates), result.source)
        return attrs.evolve(module, phase=Phase.PARTITIONED, capacity=capacity, dp_size=dp_size, microbatches=microbatches)
