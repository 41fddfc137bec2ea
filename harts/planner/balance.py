"""Slot balancing: exact subtree moves and swaps that lower J (Eq. 4) without adding compact work.

After a candidate's slot assignment (microbatches sorted by work, blocks of D per slot) the
heaviest microbatch of each slot sets that slot's time, and J2 is the sum of those maxima.
With the total work J1 fixed, a lower J2 means less summed excess of the slot maxima over
the slot means (``D * J2 - J1``, the numerator of Eq. 23 summed over slots).

Each round evaluates a pool of changes that move one run of a microbatch's members (a
*subtree*) to another microbatch, or swap two such runs. Every neighbourhood is bounded, so a
round costs time linear in the batch (all pairs of units, as an earlier version tried, cost
N^2 per round on a batch without sharing or with one very wide tree):

* *units*: the runs of a microbatch that share only the batch-wide common prefix with the
  rest of it (for the SWE-like steps, one task's trajectories; a microbatch holding one task
  is one unit; without any sharing, one trajectory). While every unit move (from a microbatch
  of several units to any other) and every swap of two units fit in
  :data:`EXHAUSTIVE_UNIT_CHANGES` and a quarter of the budget, a round takes them all. With
  more units (no sharing, one very wide tree) it narrows them: a change of units costs no work, so it
  alters J2 only where a slot maximum falls: units leave the *critical* microbatches (each
  slot's heaviest and those tied with it). A unit of size s in critical u moves to the
  ``reach`` heaviest microbatches of work at most w(u) - s, and to the ``reach`` whose room
  below their own slot's maximum fits s most tightly (filling a heavy slot lets u's slot get
  lighter without any slot getting heavier); it swaps with the ``reach`` units just smaller
  than it, anywhere (the finest transfers);
* *subtrees* (LCP intervals of a microbatch's sorted members, single trajectories included):
  moves to the microbatches holding a rank that shares more than the batch-wide prefix and
  at least as much with the subtree as its own microbatch does (another piece of the same
  tree; the ``window`` nearest runs of equal labels on either side), and swaps with that
  microbatch's ``reach`` subtrees nearest in work on either side, when the move alone already
  saves work or either microbatch is a slot's heaviest or lightest (else the swap changes
  neither J2 nor L). With ``exchange`` these include the work-saving changes of
  :mod:`harts.planner.exchange`: balancing frees capacity that lets more subtrees go home; in
  the free rounds (below) the subtree changes are not narrowed to critical microbatches.

Work changes are exact (Eq. 5 through pairwise LCPs; inserts are proposed only where no
remaining member of the receiver lies between the run's ends). The new J2 of every change is
exact too (:func:`harts.planner.schedule.slot_critical_after`: the slot rule is in effect
re-run, so a change that moves a microbatch past others and re-forms slots is scored
correctly). A change is admissible when both microbatches stay within capacity, the summed
work does not grow, the summed slot excess ``D * J2 - J1`` does not grow and (J1, J2, -L)
strictly falls, where L is the sum of the slot minima (also exact, by the same lookups). L is
the tie-breaker that crosses plateaus of J2: when two microbatches of a slot tie at its
maximum, no single change lowers J2, but raising the slot's lightest one (L grows, J is
unchanged) makes the next change possible. In the first ``free_rounds`` rounds a change that
saves work is admissible even when the excess grows (J1 comes first in J). A round ranks the
pool by (work change, new J2, -new L) and applies changes in that order on microbatches no
earlier change of the round touched, re-checking each (at most K per round) against the current works; the next
round rebuilds the pool. Balancing stops after ``rounds`` rounds, after a round that changes
nothing, or once its work budget (:mod:`harts.planner.budget`) is spent. K, coverage, nonemptiness and capacity are preserved; total compact work never
increases and (J1, J2, -L) strictly falls with every applied change, so the search cannot
cycle. The result is returned only when its J is strictly lower than the input's (plateau
changes alone leave J1 and J2 equal and may move J3 either way); otherwise the input is.
"""

from __future__ import annotations

import logging

import numpy as np

from harts.planner.exchange import Layout, around, nearest_runs, sharing_receivers, subtree_runs
from harts.planner.budget import WorkBudget, unlimited
from harts.planner.ranks import RankSpace, sorted_unique
from harts.planner.schedule import slot_rule_objective, slot_sums_after

logger = logging.getLogger(__name__)

#: a round takes every unit move and swap when there are at most this many (a few hundred units, e.g. whole
#: task trees); more units get the bounded neighbourhoods. A constant, so a round stays linear in the batch
EXHAUSTIVE_UNIT_CHANGES = 1 << 16


def _first_ranks(labels: np.ndarray, count: int) -> np.ndarray:
    first = np.full(count, labels.size, dtype=np.int64)
    np.minimum.at(first, labels, np.arange(labels.size))
    return first


def _objective(works: np.ndarray, labels: np.ndarray, dp_size: int) -> tuple[int, int, int]:
    # the smallest rank orders groups exactly like canonical ids, the tie key search.py uses
    return slot_rule_objective(works, _first_ranks(labels, len(works)), dp_size)


def _slot_extremes(works: np.ndarray, dp_size: int) -> tuple[int, int]:
    """J2 and L: the sums of the slot maxima and of the slot minima under the slot rule."""
    descending = np.sort(works)[::-1]
    return int(descending[::dp_size].sum()), int(descending[dp_size - 1 :: dp_size].sum())


def _units(layout: Layout, floor: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted positions of each group's units: runs split where the in-group adjacent LCP is at most ``floor``."""
    ends = np.flatnonzero(~layout.same_next | (layout.adjacent <= floor))
    return np.concatenate([[0], ends[:-1] + 1]).astype(np.int64), ends.astype(np.int64)


class _Pool:
    """Changes as parallel arrays: run ``a..b`` of microbatch u moves to v, run ``c..d`` of v (if any) to u."""

    def __init__(self):
        self.parts: list[tuple[np.ndarray, ...]] = []

    def add(self, u, v, a, b, c, d, new_u, new_v, keep) -> None:
        if np.any(keep):
            self.parts.append(tuple(np.asarray(x)[keep] for x in (u, v, a, b, c, d, new_u, new_v)))

    def arrays(self):
        if not self.parts:
            return None
        return tuple(np.concatenate(p) for p in zip(*self.parts))


def _swap_works(layout: Layout, works, u, v, a, b, c, d, saving_a, work_a, saving_c, work_c):
    """Exact new works of u and v when u's run a..b and v's run c..d trade places, and whether both inserts are exact."""
    cost_a, fits_a = layout.insert_cost(v, a, b, work_a, c, d)
    cost_c, fits_c = layout.insert_cost(u, c, d, work_c, a, b)
    return works[u] - saving_a + cost_c, works[v] - saving_c + cost_a, fits_a & fits_c


def _holds(held: np.ndarray, trees: int, group: np.ndarray, tree: np.ndarray) -> np.ndarray:
    """Whether microbatch ``group[i]`` holds a unit of tree ``tree[i]``; ``held`` is the sorted unique ``group * trees + tree``
    of every unit (a lookup table of size units, not microbatches x trees)."""
    keys = group * trees + tree
    if held.size == 0:
        return np.zeros(keys.shape, dtype=bool)
    return held[np.minimum(np.searchsorted(held, keys), held.size - 1)] == keys


def _all_unit_changes(pool: _Pool, capacity: int, works, unit_first, unit_last, unit_group, unit_tree, unit_size, held,
                      trees: int, per_group) -> None:
    """Every unit move (from a microbatch of several units, to any microbatch) and every swap of two units."""
    count = works.size
    movable = np.flatnonzero(per_group[unit_group] >= 2)
    if movable.size:
        unit, target = np.repeat(movable, count), np.tile(np.arange(count), movable.size)
        source = unit_group[unit]
        new_u, new_v = works[source] - unit_size[unit], works[target] + unit_size[unit]
        none = np.ones_like(unit), np.zeros_like(unit)
        pool.add(source, target, unit_first[unit], unit_last[unit], *none, new_u, new_v,
                 (target != source) & ~_holds(held, trees, target, unit_tree[unit]) & (new_v <= capacity))
    if unit_first.size > 1:
        mine, theirs = np.triu_indices(unit_first.size, 1)
        _add_unit_swaps(pool, capacity, works, mine, theirs, unit_first, unit_last, unit_group, unit_tree, unit_size, held, trees)


def _add_unit_swaps(pool: _Pool, capacity: int, works, mine, theirs, unit_first, unit_last, unit_group, unit_tree, unit_size,
                    held, trees: int) -> None:
    """Swaps of units ``mine[i]`` and ``theirs[i]`` that keep every microbatch's trees distinct (so they are exact)."""
    u, v = unit_group[mine], unit_group[theirs]
    difference = unit_size[theirs] - unit_size[mine]
    new_u, new_v = works[u] + difference, works[v] - difference
    distinct = (unit_tree[mine] == unit_tree[theirs]) | (~_holds(held, trees, v, unit_tree[mine]) & ~_holds(held, trees, u, unit_tree[theirs]))
    pool.add(u, v, unit_first[mine], unit_last[mine], unit_first[theirs], unit_last[theirs], new_u, new_v,
             (u != v) & distinct & (difference != 0) & (new_u <= capacity) & (new_v <= capacity))


def _pool(space: RankSpace, capacity: int, labels: np.ndarray, works: np.ndarray, layout: Layout, window: int,
          dp_size: int, reach: int, saving_work: bool, allowance: int):
    """This round's changes. Every part is bounded by (units or subtrees) x ``reach`` or ``window``, so a round costs
    time linear in the batch, never the square of it; when every unit move and swap fits in ``allowance`` entries
    (a few hundred units: whole trees), all of them are taken instead. ``saving_work``: also the subtree changes that only
    a work-saving swap partner makes worth it, wherever they are (the free rounds, where J1 may fall)."""
    n, count = space.size, works.size
    floor = int(space.lcp[1:].min()) if n > 1 else 0
    pool = _Pool()

    # Units: a change of units alters J2 only through a slot maximum that falls, so units leave the critical
    # microbatches (each slot's heaviest, and those tied with it). Units of different trees share exactly
    # ``floor`` tokens, so a microbatch holding units of distinct trees has work floor + sum(C(unit) - floor),
    # and a change that keeps every microbatch's trees distinct moves exactly C(unit) - floor (the others are
    # left to the exact subtree changes below).
    unit_first, unit_last = _units(layout, floor)
    unit_group = layout.group_of_position[unit_first]
    tree_of_rank = np.cumsum(space.lcp <= floor) - 1 if n else np.zeros(0, dtype=np.int64)
    trees = int(tree_of_rank[-1]) + 1 if n else 0
    unit_tree = tree_of_rank[layout.order[unit_first]]
    unit_size = (layout.length_prefix[unit_last + 1] - layout.length_prefix[unit_first]
                 - (layout.adjacent_prefix[unit_last] - layout.adjacent_prefix[unit_first])) - floor
    held = sorted_unique(unit_group * trees + unit_tree)
    descending = np.lexsort((_first_ranks(labels, count), -works))  # the slot rule's order
    position = np.empty(count, dtype=np.int64)
    position[descending] = np.arange(count)
    slot_start = (position // dp_size) * dp_size
    critical = works == works[descending][slot_start]
    # slot minima (and ties): raising one lifts L, which crosses plateaus of J2 (see the module docstring)
    pivotal = critical | (works == works[descending][np.minimum(slot_start + dp_size - 1, count - 1)])
    per_group = np.bincount(unit_group, minlength=count)
    units = unit_first.size
    if int((per_group[unit_group] >= 2).sum()) * count + units * (units - 1) // 2 <= allowance:
        _all_unit_changes(pool, capacity, works, unit_first, unit_last, unit_group, unit_tree, unit_size, held, trees, per_group)
        leaving = np.zeros(0, dtype=np.int64)  # the bounded neighbourhoods below are subsets of these
    else:
        leaving = np.flatnonzero(critical[unit_group] & (unit_size > 0))

    # moves: to the ``reach`` heaviest microbatches that stay at or below the source's old work, and to the
    # ``reach`` whose room below their own slot's maximum fits the unit most tightly (filling a heavy slot
    # lets the unit's old slot get lighter without any slot getting heavier)
    movable = leaving[per_group[unit_group[leaving]] >= 2]
    if movable.size:
        source = unit_group[movable]
        landing = np.searchsorted(-works[descending], -(works[source] - unit_size[movable]), side="left")
        owner, at = around(landing, landing, np.full_like(landing, count), reach)
        room = works[descending][slot_start] - works
        by_room = np.lexsort((np.arange(count), room))
        fitting = np.searchsorted(room[by_room], unit_size[movable], side="left")
        owner_room, at_room = around(fitting, fitting, np.full_like(fitting, count), reach)
        unit = movable[np.concatenate([owner, owner_room])]
        target = np.concatenate([descending[at], by_room[at_room]])
        source = unit_group[unit]
        new_u, new_v = works[source] - unit_size[unit], works[target] + unit_size[unit]
        none = np.ones_like(unit), np.zeros_like(unit)
        pool.add(source, target, unit_first[unit], unit_last[unit], *none, new_u, new_v,
                 (target != source) & ~_holds(held, trees, target, unit_tree[unit]) & (new_v <= capacity))
    # swaps: with the ``reach`` units just smaller (by size, anywhere), the finest transfers of work
    if leaving.size and unit_first.size > 1:
        by_size = np.lexsort((np.arange(unit_size.size), unit_size))
        below = np.searchsorted(unit_size[by_size], unit_size[leaving], side="left")
        owner, at = around(below, np.zeros_like(below), below, reach)
        _add_unit_swaps(pool, capacity, works, leaving[owner], by_size[at], unit_first, unit_last, unit_group, unit_tree,
                        unit_size, held, trees)

    # subtrees: moves to microbatches holding ranks that share as much; swaps with the ``reach`` subtrees of
    # such a microbatch nearest in work on either side, when the move alone already saves work or the
    # partner is of the same tree (the swap makes room for it)
    first, last = subtree_runs(layout)
    if first.size:
        group = layout.group_of_position[first]
        saving, run_work = layout.run_saving(first, last)
        # a run that shares only ``floor`` with its own microbatch is a unit: the unit changes above place it
        shared = run_work - saving - 1
        run, target = sharing_receivers(space, labels, layout, first, last, shared if saving_work else np.maximum(shared, floor), window)
        cost, fits = layout.insert_cost(target, first[run], last[run], run_work[run], np.ones_like(run), np.zeros_like(run))
        source = group[run]
        new_u, new_v = works[source] - saving[run], works[target] + cost
        change = new_u + new_v - works[source] - works[target]
        free = fits & (change <= 0)
        none = np.ones_like(run), np.zeros_like(run)
        pool.add(source, target, first[run], last[run], *none, new_u, new_v, free & (new_v <= capacity))
        # a swap that saves no work changes J2 or L only through a slot's heaviest or lightest microbatch
        promising = np.flatnonzero(free & (saving_work | (change < 0) | pivotal[source] | pivotal[target]))
        # a swap whose move alone saves no work is kept below only with a partner of the subtree's own tree, so the
        # receiver must hold a member of that tree (``held``: every microbatch's trees, from the units); a move that
        # fails this has no partner kept, and leaving it out spares its partner lookups (most of them, on free rounds)
        promising = promising[(change[promising] < 0) | _holds(held, trees, target[promising],
                                                                 tree_of_rank[layout.order[first[run[promising]]]])]
        if promising.size:
            pick, partner = nearest_runs(group, run_work, target[promising], run_work[run[promising]], count, reach)
            pick = promising[pick]
            mine = run[pick]
            keep = change[pick] < 0
            # two ranks share more than ``floor`` exactly when they are of one tree (no adjacent LCP of ``floor``
            # between them): a lookup instead of a pairwise LCP per swap
            keep |= tree_of_rank[layout.order[first[mine]]] == tree_of_rank[layout.order[first[partner]]]
            mine, partner = mine[keep], partner[keep]
            u, v = group[mine], group[partner]
            new_u, new_v, fits = _swap_works(layout, works, u, v, first[mine], last[mine], first[partner], last[partner],
                                             saving[mine], run_work[mine], saving[partner], run_work[partner])
            pool.add(u, v, first[mine], last[mine], first[partner], last[partner], new_u, new_v,
                     fits & (new_u <= capacity) & (new_v <= capacity) & (new_u + new_v <= works[u] + works[v]))
    return pool.arrays()


def balance_slots(space: RankSpace, capacity: int, labels: np.ndarray, dp_size: int, rounds: int = 64, window: int = 4,
                  exchange: bool = False, exchange_window: int = 8, free_rounds: int = 0, reach: int = 8,
                  budget: WorkBudget | None = None) -> np.ndarray:
    """Labels whose J is strictly lower than the input's, or the input labels unchanged; see the module docstring.

    With ``exchange`` every round's pool also holds the work-saving subtree moves and swaps of
    :mod:`harts.planner.exchange` (``exchange_window``): balancing changes free capacity that lets
    more subtrees go home. In the first ``free_rounds`` rounds a change that saves work is taken
    even when it raises the summed slot excess (J1 comes first in J); later rounds keep the rule.
    ``reach`` bounds each unit's and subtree's partners (see the module docstring); ``budget``
    (:mod:`harts.planner.budget`) is charged each round's trajectories, pool entries and K
    re-checks, and no round starts once it is spent.
    """
    budget = unlimited() if budget is None else budget
    original = labels
    labels = np.asarray(labels, dtype=np.int64).copy()
    count = int(labels.max()) + 1
    if count % dp_size or dp_size < 2:
        return labels
    works = space.group_works(labels, count)
    if works.max() > capacity:
        return labels
    initial = _objective(works, labels, dp_size)
    total, (critical, low) = initial[0], _slot_extremes(works, dp_size)
    n = space.size
    for round_index in range(rounds):
        if budget.spent:
            break
        layout = Layout(space, labels, count)
        found = _pool(space, capacity, labels, works, layout, max(window, exchange_window) if exchange else window, dp_size, reach,
                      saving_work=round_index < free_rounds, allowance=min(budget.limit // 4, EXHAUSTIVE_UNIT_CHANGES))
        # a round costs its tables, its pool and at most ``count`` re-checks of pool entries
        budget.charge_round(n + (0 if found is None else found[0].size) + count)
        if found is None:
            break
        u, v, a, b, c, d, new_u, new_v = found
        change = new_u + new_v - works[u] - works[v]
        after, after_low = slot_sums_after(works, dp_size, u, new_u, v, new_v, (0, dp_size - 1))
        excess = dp_size * critical - total
        free = round_index < free_rounds
        better = (change < 0) | (after < critical) | ((change == 0) & (after == critical) & (after_low > low))
        useful = better & ((dp_size * after - (total + change) <= excess) | (free & (change < 0)))
        useful = np.flatnonzero(useful)
        if useful.size == 0:
            break
        ranked = useful[np.lexsort((d[useful], c[useful], b[useful], a[useful], -after_low[useful], after[useful], change[useful]))]
        touched = [False] * count
        applied = 0
        tries = count
        # most entries are skipped for a microbatch an earlier change touched: plain lists, no numpy scalar per entry
        for k, first_group, second_group in zip(ranked.tolist(), u[ranked].tolist(), v[ranked].tolist()):
            if touched[first_group] or touched[second_group]:
                continue
            if tries == 0:
                break
            tries -= 1
            trial = works.copy()
            trial[first_group], trial[second_group] = new_u[k], new_v[k]
            trial_total, (trial_critical, trial_low) = total + int(change[k]), _slot_extremes(trial, dp_size)
            if (trial_total, trial_critical, -trial_low) >= (total, critical, -low):
                continue
            if dp_size * trial_critical - trial_total > dp_size * critical - total and not (free and trial_total < total):
                continue
            labels[layout.order[a[k] : b[k] + 1]] = second_group
            if c[k] <= d[k]:
                labels[layout.order[c[k] : d[k] + 1]] = first_group
            works, total, critical, low = trial, trial_total, trial_critical, trial_low
            touched[first_group] = touched[second_group] = True
            applied += 1
        if not applied:
            break
    final = _objective(works, labels, dp_size)
    logger.debug("slot balancing: J %s -> %s", initial, final)
    if final >= initial:  # only plateau changes applied (J1 and J2 equal): J3 alone decides, keep the input
        return np.asarray(original, dtype=np.int64).copy()
    return labels
