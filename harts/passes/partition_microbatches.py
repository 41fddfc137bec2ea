"""``partition-microbatches``: choose microbatch membership by J (§3.2, Eq. 4-10).

Builds every candidate (exact DP or sampled-K evolution, trie-aware greedy, refined
anchors, subtree-exchanged and slot-balanced copies of the best), instantiates each candidate's replica/slot assignment to rank it by J, and emits
the winner's microbatches. Replica and slot stay unset here; ``schedule-slots`` sets them
with the same deterministic rule, so the scheduled module has exactly the J that won.
"""

from __future__ import annotations

import logging

import attrs

from harts.ir.nodes import Microbatch, Module, Phase
from harts.ir.prefix_index import PrefixIndex
from harts.passes.base import Pass, PassContext, option
from harts.passes.registry import builtin_pass
from harts.planner import PlannerOptions, plan

logger = logging.getLogger(__name__)


@builtin_pass("partition-microbatches")
@attrs.frozen
class PartitionMicrobatches(Pass):
    #: T for this pass; none: the module's (the compile option)
    capacity: int | None = option(None, kind=int, minimum=1)
    #: D for this pass; none: the module's
    dp_size: int | None = option(None, kind=int, minimum=1)
    exact_threshold: int = option(512, minimum=1)
    sample_budget: int = option(32, minimum=1)
    refine: bool = option(True)
    greedy: bool = option(True)
    #: slot balancing of the best candidate (harts.planner.balance); never adds compact work
    balance: bool = option(True)
    #: subtree exchange of the best candidate (harts.planner.exchange); only lowers compact work
    exchange: bool = option(True)

    def run(self, module: Module, ctx: PassContext) -> Module:
        capacity = module.capacity if self.capacity is None else self.capacity
        dp_size = module.dp_size if self.dp_size is None else self.dp_size
        index = PrefixIndex.from_module(module)
        result = plan(
            index,
            PlannerOptions(
                capacity=capacity,
                dp_size=dp_size,
                exact_threshold=self.exact_threshold,
                sample_budget=self.sample_budget,
                refine=self.refine,
                greedy=self.greedy,
                balance=self.balance,
                exchange=self.exchange,
            ),
        )
        ctx.report("partition-microbatches", 1.0)
        microbatches = tuple(
            Microbatch(index=position, trajectories=members, work=work)
            for position, (members, work) in enumerate(zip(result.microbatches, result.works))
        )
        logger.debug("partition-microbatches: %d candidates, chosen %s", len(result.candidates), result.source)
        return attrs.evolve(module, phase=Phase.PARTITIONED, capacity=capacity, dp_size=dp_size, microbatches=microbatches)
