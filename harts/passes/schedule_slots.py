"""``schedule-slots``: a DP replica and a slot for every microbatch (§3.2, "DP-replica assignment").

Microbatches sorted by work (heaviest first, ties to the one with the lexicographically
smallest member) form slots of D; inside a slot the heavier microbatch goes to the
replica with less work so far. The output lists microbatches by (slot, replica) and
renumbers them 0..K-1.
"""

from __future__ import annotations

import attrs
import numpy as np

from harts.errors import PlanningError
from harts.ir.nodes import Module, Phase
from harts.passes.base import Pass, PassContext
from harts.passes.registry import builtin_pass
from harts.planner import assign_slots


@builtin_pass("schedule-slots")
@attrs.frozen
class ScheduleSlots(Pass):
    def run(self, module: Module, ctx: PassContext) -> Module:
        microbatches = module.microbatches
        if len(microbatches) % module.dp_size:
            raise PlanningError(
                f"cannot schedule {len(microbatches)} microbatches on dp_size {module.dp_size} replicas: "
                "the microbatch count must be a multiple of dp_size"
            )
        empty = [mb.index for mb in microbatches if not mb.trajectories]
        if empty:
            raise PlanningError(f"microbatch {empty[0]} holds no trajectories; every microbatch needs at least one")
        rank = np.empty(len(module.trajectories), dtype=np.int64)
        rank[np.asarray(module.trie.order, dtype=np.int64)] = np.arange(len(module.trajectories))
        # the smallest lexicographic rank identifies a microbatch by content alone
        keys = [int(rank[list(mb.trajectories)].min()) for mb in microbatches]
        replica, slot = assign_slots([mb.work for mb in microbatches], keys, module.dp_size)
        order = sorted(range(len(microbatches)), key=lambda i: (int(slot[i]), int(replica[i])))
        scheduled = tuple(
            attrs.evolve(microbatches[i], index=position, replica=int(replica[i]), slot=int(slot[i]))
            for position, i in enumerate(order)
        )
        return attrs.evolve(module, phase=Phase.SCHEDULED, microbatches=scheduled)
