"""The prefix-aware microbatch planner and DP slot scheduling (§3.2, Eq. 4-10, 23).

``plan(index, PlannerOptions(capacity=..., dp_size=...))`` returns the chosen microbatches
with their replica/slot assignment; the ``partition-microbatches`` and ``schedule-slots``
passes wrap it for the IR.
"""

from harts.planner.ranks import RankSpace
from harts.planner.schedule import assign_slots, imbalance, objective, objective_of, slot_imbalances, step_imbalance
from harts.planner.search import Candidate, PlannerOptions, PlanResult, check_plannable, instantiate, plan, select_best

__all__ = [
    "Candidate",
    "PlanResult",
    "PlannerOptions",
    "RankSpace",
    "assign_slots",
    "check_plannable",
    "imbalance",
    "instantiate",
    "objective",
    "objective_of",
    "plan",
    "select_best",
    "slot_imbalances",
    "step_imbalance",
]
