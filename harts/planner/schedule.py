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
    slot = np.empty(count, dtype=np.int64)
    slot[order] = np.arange(count) // dp_size
    # the replica loop is sequential (each block sees the totals so far) and D is small: plain Python
    ordered_works = works[order].tolist()
    cumulative = [0] * dp_size
    replicas = list(range(dp_size))
    assigned = []
    for start in range(0, count, dp_size):
        lightest_first = sorted(replicas, key=lambda d: (cumulative[d], d))
        assigned.extend(lightest_first)
        for d, work in zip(lightest_first, ordered_works[start : start + dp_size]):
            cumulative[d] += work
    replica = np.empty(count, dtype=np.int64)
    replica[order] = assigned
    return replica, slot


def slot_rule_objective(works: Sequence[int], keys: Sequence[int], dp_size: int) -> tuple[int, int, int]:
    """J (Eq. 4) of microbatches of these works under the slot rule (:func:`assign_slots`): what the
    planner ranks candidates by, without keeping an assignment (``schedule-slots`` makes the one kept)."""
    return objective_of(works, *assign_slots(works, keys, dp_size))


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


def slot_critical_after(works: Sequence[int], dp_size: int, first: np.ndarray, first_new: np.ndarray,
                        second: np.ndarray, second_new: np.ndarray, rank_in_slot: int = 0) -> np.ndarray:
    """J2 (the sum of slot maxima under the slot rule) after ``works[first] = first_new`` and
    ``works[second] = second_new``, for arrays of such two-microbatch changes (``first != second``).

    Slots are consecutive blocks of D in descending work order, so J2 is the sum of the sorted
    works at positions 0, D, 2D, ...; it depends on the works alone, not on how ties are
    ordered. Removing two works and inserting two shifts every other work's position by a
    step function with at most four steps, so each change costs a few lookups in per-residue
    prefix sums of the sorted works. ``rank_in_slot = r`` sums the r-th heaviest work of every
    slot instead (positions r, D + r, ...; ``D - 1`` gives the sum of the slot minima).
    """
    return slot_sums_after(works, dp_size, first, first_new, second, second_new, (rank_in_slot,))[0]


def slot_sums_after(works: Sequence[int], dp_size: int, first: np.ndarray, first_new: np.ndarray,
                    second: np.ndarray, second_new: np.ndarray, ranks_in_slot: Sequence[int]) -> list[np.ndarray]:
    """:func:`slot_critical_after` for several ``rank_in_slot`` at once (slot balancing asks for the slot
    maxima and minima of the same changes): the sort, the shift steps and the prefix sums are shared."""
    works = np.asarray(works, dtype=np.int64)
    first, second = np.asarray(first, dtype=np.int64), np.asarray(second, dtype=np.int64)
    first_new, second_new = np.asarray(first_new, dtype=np.int64), np.asarray(second_new, dtype=np.int64)
    count = works.size
    order = np.argsort(-works, kind="stable")
    values = works[order]
    position = np.empty(count, dtype=np.int64)
    position[order] = np.arange(count)
    residues = np.zeros((dp_size, count + 1), dtype=np.int64)
    for residue in range(dp_size):
        residues[residue, 1:] = np.cumsum(np.where(np.arange(count) % dp_size == residue, values, 0))
    flat = residues.reshape(-1)
    p1, p2 = position[first], position[second]
    # a new work is inserted after every work strictly greater than it
    t1 = np.searchsorted(-values, -first_new, side="left")
    t2 = np.searchsorted(-values, -second_new, side="left")
    # where each removal / insertion starts shifting, sorted per change by a four-input sorting network (whole
    # columns, no per-row sort); the column (0, 1: removals, 2, 3: insertions) rides in the low bits. Equal events
    # bound an empty segment, so their order is immaterial
    events = [(p1 + 1) << 2, ((p2 + 1) << 2) | 1, (t1 << 2) | 2, (t2 << 2) | 3]
    for i, j in ((0, 1), (2, 3), (0, 2), (1, 3), (1, 2)):
        events[i], events[j] = np.minimum(events[i], events[j]), np.maximum(events[i], events[j])
    # segment k runs from bounds[k] to bounds[k + 1] with every kept work shifted by shifts[k]
    bounds = [0] + [event >> 2 for event in events] + [count]
    shifts = [0]
    for event in events:
        shifts.append(shifts[-1] + np.where((event & 3) < 2, -1, 1))
    moved = [(t1 <= removed).astype(np.int64) + (t2 <= removed) - (p1 < removed) - (p2 < removed) for removed in (p1, p2)]
    second_ahead = (t2 < t1) | ((t2 == t1) & (second_new > first_new))
    index_first = t1 - (p1 < t1) - (p2 < t1) + second_ahead
    index_second = t2 - (p1 < t2) - (p2 < t2) + ~second_ahead
    sums = []
    for rank_in_slot in ranks_in_slot:
        # a kept work at sorted position j lands at j + shift and counts when that is rank_in_slot modulo D
        # the prefix-sum row of each shift (at most two either way), looked up instead of a modulo per entry
        rows_of_shift = (rank_in_slot - np.arange(-2, 3)) % dp_size * (count + 1)
        total = np.zeros(first.shape, dtype=np.int64)
        for k, shift in enumerate(shifts):
            offset = rows_of_shift[2] if k == 0 else rows_of_shift.take(shift + 2)
            total += flat.take(offset + bounds[k + 1]) - flat.take(offset + bounds[k])
        for removed, shifted in zip((p1, p2), moved):  # the segment sums above include the two removed works
            total -= np.where((removed + shifted) % dp_size == rank_in_slot, values[removed], 0)
        sums.append(total + np.where(index_first % dp_size == rank_in_slot, first_new, 0)
                    + np.where(index_second % dp_size == rank_in_slot, second_new, 0))
    return sums


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
