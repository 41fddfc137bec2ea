"""DP-replica assignment, slot construction, the objective J (Eq. 4) and imbalance (Eq. 23)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from harts.errors import PlanningError


def assign_slots(works: Sequence[int], keys: Sequence[int], dp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Replica and slot of every microbatch.

    Microbatches are sorted by work, heaviest first (ties: smaller ``key``; keys must be
    distinct, e.g. each microbatch's smallest rank or trajectory index, so the result does
    not depend on the order the microbatches are given in). Each consecutive block of D
    forms one slot; inside a slot the heavier microbatch goes to the replica with less
    cumulative work so far (ties: lower replica id).
    """
    works = np.asarray(works, dtype=np.int64)
    keys = np.asarray(keys, dtype=np.int64)
    count = len(works)
    if dp_size < 1 or count % dp_size:
        raise PlanningError(f"cannot schedule {count} microbatches on {dp_size} DP replicas: the count must be a multiple of dp_size")
    order = np.lexsort((keys, -works))
    replica = np.empty(count, dtype=np.int64)
    slot = np.empty(count, dtype=np.int64)
    cumulative = np.zeros(dp_size, dtype=np.int64)
    ids = np.arange(dp_size)
    for j in range(count // dp_size):
        block = order[j * dp_size : (j + 1) * dp_size]
        lightest_first = np.lexsort((ids, cumulative))
        replica[block] = lightest_first
        slot[block] = j
        cumulative[lightest_first] += works[block]
    return replica, slot


def objective_of(works: Sequence[int], replica: Sequence[int], slot: Sequence[int]) -> tuple[int, int, int]:
    """J (Eq. 4): total work, sum over slots of the heaviest microbatch, heaviest replica total."""
    works = np.asarray(works, dtype=np.int64)
    replica = np.asarray(replica, dtype=np.int64)
    slot = np.asarray(slot, dtype=np.int64)
    if works.size == 0:
        return 0, 0, 0
    slot_max = np.zeros(int(slot.max()) + 1, dtype=np.int64)
    np.maximum.at(slot_max, slot, works)
    replica_total = np.bincount(replica, weights=works).astype(np.int64)
    return int(works.sum()), int(slot_max.sum()), int(replica_total.max())


def objective(microbatches: Iterable) -> tuple[int, int, int]:
    """J (Eq. 4) of scheduled IR microbatches (each with ``work``, ``replica`` and ``slot``)."""
    microbatches = list(microbatches)
    missing = [mb.index for mb in microbatches if mb.replica is None or mb.slot is None]
    if missing:
        raise PlanningError(f"microbatch {missing[0]} has no replica/slot; run schedule-slots before computing J")
    return objective_of([mb.work for mb in microbatches], [mb.replica for mb in microbatches], [mb.slot for mb in microbatches])


def imbalance(replica_works: Sequence[float]) -> float:
    """Eq. 23: the heaviest replica's excess over the mean, ``max / mean - 1`` (0 for no work)."""
    values = np.asarray(replica_works, dtype=np.float64)
    if values.size == 0 or values.sum() == 0:
        return 0.0
    return float(values.max() / values.mean() - 1.0)


def slot_imbalances(works: Sequence[int], replica: Sequence[int], slot: Sequence[int], dp_size: int) -> list[float]:
    """Eq. 23 for every slot, with ``w_d`` the work of replica d's microbatch in that slot."""
    table = _work_table(works, replica, slot, dp_size)
    return [imbalance(row) for row in table]


def step_imbalance(works: Sequence[int], replica: Sequence[int], slot: Sequence[int], dp_size: int) -> float:
    """Eq. 23 over the step, with ``w_d`` replica d's work summed over all slots."""
    return imbalance(_work_table(works, replica, slot, dp_size).sum(axis=0))


def _work_table(works, replica, slot, dp_size) -> np.ndarray:
    slot = np.asarray(slot, dtype=np.int64)
    table = np.zeros((int(slot.max()) + 1 if slot.size else 0, dp_size), dtype=np.int64)
    np.add.at(table, (slot, np.asarray(replica, dtype=np.int64)), np.asarray(works, dtype=np.int64))
    return table
