"""``partition-microbatches``: choose microbatch membership by J (§3.2, Eq. 4-10).

Builds every candidate (exact DP or sampled-K evolution, trie-aware greedy, refined
anchors, subtree-exchanged and slot-balanced copies of the best), ranks each by J under the
slot rule (:func:`harts.planner.schedule.slot_rule_objective`), and emits the winner's
microbatches for the module's own T and D (the compile options; the pass never changes them).
Replica and slot stay unset here: ``schedule-slots`` is the one place that assigns them, by the
rule J was ranked with, so the scheduled module has exactly the J that won.
"""

from __future__ import annotations

import logging

import attrs

from harts.ir.nodes import Microbatch, Module, Phase
from harts.ir.prefix_index import PrefixIndex
from harts.passes.base import Pass, PassContext, option
from harts.passes.registry import builtin_pass
from harts.planner import PlannerOptions, choose_microbatches

logger = logging.getLogger(__name__)


@builtin_pass("partition-microbatches")
@attrs.frozen
class PartitionMicrobatches(Pass):
    exact_threshold: int = option(512, minimum=1)
    sample_budget: int = option(32, minimum=1)
    refine: bool = option(True)
    greedy: bool = option(True)
    #: slot balancing of the best candidate (harts.planner.balance); never adds compact work
    balance: bool = option(True)
    #: subtree exchange of the best candidate (harts.planner.exchange); only lowers compact work
    exchange: bool = option(True)

    def planner_options(self, capacity: int, dp_size: int) -> PlannerOptions:
        return PlannerOptions(
            capacity=capacity,
            dp_size=dp_size,
            exact_threshold=self.exact_threshold,
            sample_budget=self.sample_budget,
            refine=self.refine,
            greedy=self.greedy,
            balance=self.balance,
            exchange=self.exchange,
        )

    def run(self, module: Module, ctx: PassContext) -> Module:
        lengths = tuple(trajectory.length for trajectory in module.trajectories)
        options = self.planner_options(module.capacity, module.dp_size)
        result = ctx.prepared_plan(module.trie, lengths, options)
        if result is None:
            result = choose_microbatches(PrefixIndex.from_module(module), options)
        ctx.report("partition-microbatches", 1.0)
        microbatches = tuple(
            Microbatch(index=position, trajectories=members, work=work)
            for position, (members, work) in enumerate(zip(result.microbatches, result.works))
        )
        logger.debug("partition-microbatches: %d candidates, chosen %s", len(result.candidates), result.source)
        return attrs.evolve(module, phase=Phase.PARTITIONED, microbatches=microbatches)
