"""Work budgets for the planner stages that go beyond the paper.

Planning latency is charged to the Core speedup (§3.2), so a stage that only adds candidates
must not cost more than it can return. Each such stage (the extra piece and unit greedies,
subtree exchange, slot balancing) receives a :class:`WorkBudget` proportional to the number of
trajectories and stops once it is spent; what it found so far still competes under J, so the
plan is never worse than the paper's candidates alone.

One unit of work is one candidate change or placement evaluated, or one trajectory visited
when a stage rebuilds its per-round tables. The count is deterministic (it depends on the
input alone, never on the clock), so tests can assert it; the planner reports it per stage in
``PlanResult.work``.
"""

from __future__ import annotations

import attrs


@attrs.define
class WorkBudget:
    """A stage's allowance of work units and what it has used.

    Stages work in rounds and start a round only while the budget is not spent, so a stage
    uses at most ``limit + largest_round``; a round's cost is linear in the batch by the
    stage's construction (bounded neighbourhoods), which keeps the whole stage near-linear.
    """

    limit: int
    used: int = 0
    largest_round: int = 0

    @property
    def spent(self) -> bool:
        return self.used >= self.limit

    def charge_round(self, amount: int) -> None:
        """Record one round's work (tables rebuilt plus candidates evaluated)."""
        self.used += int(amount)
        self.largest_round = max(self.largest_round, int(amount))


def unlimited() -> WorkBudget:
    """A budget that never runs out (direct calls of a stage outside the planner)."""
    return WorkBudget(limit=1 << 62)
