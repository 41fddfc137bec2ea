"""The prefix-aware microbatch planner and DP slot scheduling (§3.2, Eq. 4-10, 23).

``choose_microbatches(index, PlannerOptions(capacity=..., dp_size=...))`` returns the chosen
microbatches and their J under the slot rule; the ``partition-microbatches`` pass wraps it for
the IR, and ``schedule-slots`` assigns replicas and slots by that rule (:func:`assign_slots`).
"""

from harts.planner.ranks import RankSpace
from harts.planner.schedule import (
    assign_slots,
    imbalance,
    objective,
    objective_of,
    slot_imbalances,
    slot_rule_objective,
    step_imbalance,
)
from harts.planner.search import Candidate, PlannerOptions, PlanResult, check_plannable, choose_microbatches, instantiate, select_best

__all__ = [
    "Candidate",
    "PlanResult",
    "PlannerOptions",
    "RankSpace",
    "assign_slots",
    "check_plannable",
    "choose_microbatches",
    "imbalance",
    "instantiate",
    "objective",
    "objective_of",
    "select_best",
    "slot_imbalances",
    "slot_rule_objective",
    "step_imbalance",
]
