"""Slot balancing: exact subtree moves and swaps that lower J (Eq. 4) without adding compact work.

After a candidate's slot assignment (microbatches sorted by work, blocks of D per slot) the
heaviest microbatch H of each slot sets that slot's time. Each round proposes, for the H of
every slot whose maximum is strict, changes of one *subtree* of H (a run of H's members in
rank order that share more with each other than with the run's neighbours in H; single
trajectories included):

* moving it to a lighter microbatch of the same slot, or swapping it with a subtree of one;
* moving it to, or swapping it with a trajectory of, the microbatch holding one of the
  ``window`` ranks on either side (another piece of the same rollout tree, where it shares
  its root prefix);
* swapping a top-level subtree of H with a top-level subtree of any other microbatch.

Work changes are exact (Eq. 5 through pairwise LCPs of rank neighbours): removing the run
``h_i..h_j`` saves ``|run| - internal LCPs - LCP(h_{i-1}, h_i) - LCP(h_j, h_{j+1}) +
LCP(h_{i-1}, h_{j+1})``; inserting it where no remaining member of the receiver lies between
its ends costs ``C(run) - LCP(p, h_i) - LCP(h_j, q) + LCP(p, q)`` for the receiver's
neighbours ``p < h_i`` and ``q > h_j`` (other inserts are not proposed). A change is
admissible only if the two microbatches' summed work does not grow, both stay within
capacity and H keeps a member, and it either saves work or is estimated to lower the sum of
slot maxima. Per round the best admissible changes on disjoint microbatches are applied
together; the slot assignment is re-run and the round is kept only if J strictly decreases
and the slots' summed excess over their mean (``D * J2 - J1``, the numerator of Eq. 23
summed over slots) does not grow. Otherwise each change is tried alone under the same test.
K, coverage, nonemptiness and capacity are preserved; total compact work never increases.

On near-capacity microbatches that each hold a piece of one large tree (the SWE-like
benchmark steps) few changes are admissible: moving a subtree to a microbatch without its
tree duplicates the tree's root prefix, and most microbatches have no room below capacity.
"""

from __future__ import annotations

import logging

import numpy as np

from harts.planner.ranks import RankSpace
from harts.planner.schedule import assign_slots, objective_of

logger = logging.getLogger(__name__)

_RUN_CACHE: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _runs(size: int) -> tuple[np.ndarray, np.ndarray]:
    """All ``(i, j)`` with ``i <= j`` in ``0..size-1`` except the whole range."""
    if size not in _RUN_CACHE:
        first, last = np.triu_indices(size)
        keep = ~((first == 0) & (last == size - 1))
        _RUN_CACHE[size] = (first[keep].astype(np.int64), last[keep].astype(np.int64))
    return _RUN_CACHE[size]


def _first_ranks(labels: np.ndarray, count: int) -> np.ndarray:
    first = np.full(count, labels.size, dtype=np.int64)
    np.minimum.at(first, labels, np.arange(labels.size))
    return first


def _objective(works: np.ndarray, labels: np.ndarray, dp_size: int) -> tuple[int, int, int]:
    # the smallest rank orders groups exactly like canonical ids, the tie key search.py uses
    replica, slot = assign_slots(works, _first_ranks(labels, len(works)), dp_size)
    return objective_of(works, replica, slot)


def _leading_terms(works: np.ndarray, dp_size: int) -> tuple[int, int]:
    """J1 and J2 without the replica loop: slots are blocks of D in descending work order."""
    return int(works.sum()), int(np.sort(works)[::-1][::dp_size].sum())


def _better(works: np.ndarray, labels: np.ndarray, current: tuple[int, int, int], dp_size: int):
    """J of the trial (J3 left 0 unless J1 and J2 tie) if strictly lower than ``current`` and the slots'
    summed excess over their mean (D * J2 - J1) is not higher; otherwise None. J3 needs the
    sequential replica loop, so it only runs on a J1/J2 tie."""
    leading = _leading_terms(works, dp_size)
    if leading > current[:2] or dp_size * leading[1] - leading[0] > dp_size * current[1] - current[0]:
        return None
    trial = _objective(works, labels, dp_size) if leading == current[:2] else (*leading, 0)
    if trial >= current:
        return None
    return trial


class _Layout:
    """Members sorted by (group, rank) with in-group LCP prefix sums for exact run savings."""

    def __init__(self, space: RankSpace, labels: np.ndarray, count: int):
        n = space.size
        self.order = order = np.lexsort((np.arange(n), labels))
        self.keys = labels[order] * n + order
        self.position = np.empty(n, dtype=np.int64)
        self.position[order] = np.arange(n)
        self.counts = np.bincount(labels, minlength=count)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)])
        same = labels[order[1:]] == labels[order[:-1]]
        adjacent = np.zeros(n, dtype=np.int64)  # adjacent[t]: LCP(order[t], order[t+1]) inside one group, else 0
        adjacent[:-1] = np.where(same, space.lcp_between(order[:-1], order[1:]), 0)
        self.adjacent = adjacent
        self.adjacent_prefix = np.concatenate([[0], np.cumsum(adjacent)])
        self.length_prefix = np.concatenate([[0], np.cumsum(space.lengths[order])])

    def run_saving(self, space: RankSpace, first: np.ndarray, last: np.ndarray, group_first: np.ndarray, group_last: np.ndarray):
        """Exact C(H) - C(H minus run) and C(run) for runs at sorted positions ``first..last``."""
        n = space.size
        length = self.length_prefix[last + 1] - self.length_prefix[first]
        internal = self.adjacent_prefix[last] - self.adjacent_prefix[first]
        left = np.where(first > 0, self.adjacent[np.maximum(first - 1, 0)], 0)
        right = self.adjacent[last]
        before = np.where(first > group_first, self.order[np.maximum(first - 1, 0)], -1)
        after = np.where(last < group_last, self.order[np.minimum(last + 1, n - 1)], n)
        bridge = space.lcp_between(before, after)
        return length - internal - left - right + bridge, length - internal


def _clades(space: RankSpace, layout: _Layout, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted positions ``first..last`` of the group's subtrees (runs whose members share more with each
    other than with the run's neighbours in the group); single trajectories included, the whole group not."""
    size = int(layout.counts[group])
    if size < 2:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    first, last = _runs(size)
    first, last = first + layout.starts[group], last + layout.starts[group]
    left = np.where(first > layout.starts[group], layout.adjacent[np.maximum(first - 1, 0)], 0)
    inside = space.lcp_between(layout.order[first], layout.order[last])
    keep = (first == last) | (inside > np.maximum(left, layout.adjacent[last]))
    return first[keep], last[keep]


def _top_clades(layout: _Layout, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted positions of every group's top-level subtrees (split where the in-group LCP is the group's
    minimum); groups with a single top-level subtree contribute none."""
    n = layout.order.size
    group_of = np.repeat(np.arange(count), layout.counts)
    inside = np.zeros(n, dtype=bool)
    inside[:-1] = group_of[:-1] == group_of[1:]
    lowest = np.full(count, np.iinfo(np.int64).max)
    np.minimum.at(lowest, group_of[inside], layout.adjacent[inside])
    cut = inside & (layout.adjacent == lowest[group_of])
    # a top-level subtree ends at every cut and at every group end
    ends = np.flatnonzero(cut | ~inside)
    starts = np.concatenate([[0], ends[:-1] + 1])
    several = np.bincount(group_of[ends], minlength=count) > 1
    keep = several[group_of[ends]]
    return starts[keep], ends[keep]


def _insert_cost(space: RankSpace, layout: _Layout, labels: np.ndarray, group, first, last, run_work, removed_first, removed_last):
    """Exact C(G minus removed + run) - C(G minus removed) for the run at sorted positions ``first..last``
    joining ``group`` after the group's own run ``removed_first..removed_last`` left it (empty when first > last).

    Returns the cost and whether it is exact (no remaining member of the group lies between the run's ends).
    """
    n = space.size
    low, high = layout.order[first], layout.order[last]
    at_low = np.searchsorted(layout.keys, group * n + low)
    at_high = np.searchsorted(layout.keys, group * n + high)
    overlap = np.maximum(0, np.minimum(at_high, removed_last + 1) - np.maximum(at_low, removed_first))
    fits = (at_high - at_low - overlap) == 0
    group_first, group_last = layout.starts[group], layout.starts[group + 1] - 1
    before = at_low - 1
    before = np.where((before >= removed_first) & (before <= removed_last), removed_first - 1, before)
    after = np.where((at_high >= removed_first) & (at_high <= removed_last), removed_last + 1, at_high)
    before_rank = np.where(before >= group_first, layout.order[np.clip(before, 0, n - 1)], -1)
    after_rank = np.where(after <= group_last, layout.order[np.clip(after, 0, n - 1)], n)
    cost = run_work - space.lcp_between(before_rank, low) - space.lcp_between(high, after_rank) + space.lcp_between(before_rank, after_rank)
    return cost, fits


def _proposals(space: RankSpace, capacity: int, labels: np.ndarray, works: np.ndarray, slot: np.ndarray,
               first_rank: np.ndarray, window: int):
    """Admissible changes that lower a slot maximum, with disjoint microbatches, best first; and their layout.

    A change is ``(gain, H, M, kind, a, b, c, d, new H work, new M work)``: H's run at sorted positions
    ``a..b`` moves to M; kind 1 also moves M's run ``c..d`` to H (swaps only inside H's slot).
    Receivers M: the other microbatches of H's slot, and the microbatches holding one of the ``window``
    ranks on either side of the run (where a subtree's siblings live, so the move adds no work).
    """
    n, count = space.size, len(works)
    layout = _Layout(space, labels, count)
    slot_count = int(slot.max()) + 1
    by_slot = np.lexsort((first_rank, -works, slot)).reshape(slot_count, -1)  # heaviest first within each slot
    slot_max = works[by_slot[:, 0]]
    second = works[by_slot[:, 1]] if by_slot.shape[1] > 1 else np.zeros(slot_count, dtype=np.int64)
    third = works[by_slot[:, 2]] if by_slot.shape[1] > 2 else np.zeros(slot_count, dtype=np.int64)
    second_id = by_slot[:, 1] if by_slot.shape[1] > 1 else np.full(slot_count, -1)
    parts = []
    for row in by_slot:
        heavy = int(row[0])
        if row.size < 2 or works[row[1]] >= works[heavy]:
            continue
        heavy_first, heavy_last = _clades(space, layout, heavy)
        if heavy_first.size == 0:
            continue
        receivers = [labels[np.clip(layout.order[heavy_first] - k, 0, n - 1)] for k in range(1, window + 1)]
        receivers += [labels[np.clip(layout.order[heavy_last] + k, 0, n - 1)] for k in range(1, window + 1)]
        receivers = np.stack(receivers, axis=1)
        reps = receivers.shape[1]
        far = receivers.reshape(-1)
        far_first, far_last = np.repeat(heavy_first, reps), np.repeat(heavy_last, reps)
        keep = far != heavy
        # a move is a swap with an empty run of M (first > last)
        parts.append((far[keep], far_first[keep], far_last[keep], np.ones(int(keep.sum()), dtype=np.int64),
                      np.zeros(int(keep.sum()), dtype=np.int64)))
        # swaps with the nearby trajectory itself: siblings exchanged between two pieces of one tree
        partner = np.concatenate([np.clip(layout.order[heavy_first][:, None] - np.arange(1, window + 1), 0, n - 1),
                                  np.clip(layout.order[heavy_last][:, None] + np.arange(1, window + 1), 0, n - 1)], axis=1).reshape(-1)
        partner_position = layout.position[partner]
        keep = labels[partner] != heavy
        parts.append((labels[partner][keep], far_first[keep], far_last[keep], partner_position[keep], partner_position[keep]))
        for light in row[1:][works[row[1:]] < works[heavy]].tolist():
            light_first, light_last = _clades(space, layout, light)
            size = heavy_first.size * (1 + light_first.size)
            parts.append((np.full(size, light), np.concatenate([heavy_first, np.repeat(heavy_first, light_first.size)]),
                          np.concatenate([heavy_last, np.repeat(heavy_last, light_first.size)]),
                          np.concatenate([np.ones(heavy_first.size, dtype=np.int64), np.tile(light_first, heavy_first.size)]),
                          np.concatenate([np.zeros(heavy_first.size, dtype=np.int64), np.tile(light_last, heavy_first.size)])))
    heavies = by_slot[:, 0][(by_slot.shape[1] > 1) & (second < slot_max)]
    if heavies.size:
        # whole-tree swaps with every microbatch: trees share at most the common root prefix, so
        # exchanging them costs no work, and there are enough pairs for fine-grained transfers
        top_first, top_last = _top_clades(layout, count)
        top_group = labels[layout.order[top_first]]
        is_heavy = np.zeros(count, dtype=bool)
        is_heavy[heavies] = True
        mine = np.flatnonzero(is_heavy[top_group])
        theirs = np.arange(top_first.size)
        mine, theirs = np.repeat(mine, theirs.size), np.tile(theirs, mine.size)
        keep = top_group[mine] != top_group[theirs]
        mine, theirs = mine[keep], theirs[keep]
        parts.append((top_group[theirs], top_first[mine], top_last[mine], top_first[theirs], top_last[theirs]))
    if not parts:
        return None
    light, mine_first, mine_last, theirs_first, theirs_last = (np.concatenate(p) for p in zip(*parts))
    heavy = labels[layout.order[mine_first]]
    swapped = theirs_first <= theirs_last
    mine_saving, mine_work = layout.run_saving(space, mine_first, mine_last, layout.starts[heavy], layout.starts[heavy + 1] - 1)
    safe_first, safe_last = np.where(swapped, theirs_first, 0), np.where(swapped, theirs_last, 0)
    theirs_saving, theirs_work = layout.run_saving(space, safe_first, safe_last, layout.starts[light], layout.starts[light + 1] - 1)
    theirs_saving, theirs_work = np.where(swapped, theirs_saving, 0), np.where(swapped, theirs_work, 0)
    mine_cost, mine_fits = _insert_cost(space, layout, labels, light, mine_first, mine_last, mine_work,
                                        np.where(swapped, theirs_first, 1), np.where(swapped, theirs_last, 0))
    theirs_cost, theirs_fits = _insert_cost(space, layout, labels, heavy, safe_first, safe_last, theirs_work, mine_first, mine_last)
    theirs_cost, theirs_fits = np.where(swapped, theirs_cost, 0), np.where(swapped, theirs_fits, True)
    new_heavy = works[heavy] - mine_saving + theirs_cost
    new_light = works[light] - theirs_saving + mine_cost
    change = new_heavy + new_light - works[heavy] - works[light]
    home, away = slot[heavy], slot[light]
    # same slot: the slot's new maximum; other slot: H's slot drops, M's slot may rise above its maximum
    rest_same = np.where(second_id[home] == light, third[home], second[home])
    gain_same = works[heavy] - np.maximum(np.maximum(new_heavy, new_light), rest_same)
    gain_other = works[heavy] - np.maximum(new_heavy, second[home]) - np.maximum(0, new_light - slot_max[away])
    gain = np.where(home == away, gain_same, gain_other)
    admissible = mine_fits & theirs_fits & (change <= 0) & (new_light <= capacity) & (new_heavy <= capacity)
    keep = np.flatnonzero(admissible & ((gain > 0) | (change < 0)))
    if keep.size == 0:
        return None
    ranked = keep[np.lexsort((keep, change[keep], -gain[keep]))]
    used: set[int] = set()
    changes = []
    for c in ranked.tolist():
        h, m = int(heavy[c]), int(light[c])
        if h in used or m in used:
            continue
        used.update((h, m))
        changes.append((int(gain[c]), h, m, int(swapped[c]), int(mine_first[c]), int(mine_last[c]), int(theirs_first[c]),
                        int(theirs_last[c]), int(new_heavy[c]), int(new_light[c])))
    return changes, layout


def _apply(labels: np.ndarray, works: np.ndarray, layout: _Layout, proposal) -> None:
    _, heavy, light, kind, a, b, c, d, new_heavy, new_light = proposal
    labels[layout.order[a : b + 1]] = light
    if kind == 1:
        labels[layout.order[c : d + 1]] = heavy
    works[heavy], works[light] = new_heavy, new_light


def balance_slots(space: RankSpace, capacity: int, labels: np.ndarray, dp_size: int, rounds: int = 8, window: int = 4) -> np.ndarray:
    """Labels whose J is strictly lower than the input's, or the input labels unchanged; see the module docstring."""
    labels = np.asarray(labels, dtype=np.int64).copy()
    count = int(labels.max()) + 1
    if count % dp_size or dp_size < 2:
        return labels
    works = space.group_works(labels, count)
    if works.max() > capacity:
        return labels
    current = initial = _objective(works, labels, dp_size)
    for _ in range(rounds):
        first_rank = _first_ranks(labels, count)
        _, slot = assign_slots(works, first_rank, dp_size)
        result = _proposals(space, capacity, labels, works, slot, first_rank, window)
        if result is None:
            break
        proposals, layout = result
        trial_labels, trial_works = labels.copy(), works.copy()
        for proposal in proposals:
            _apply(trial_labels, trial_works, layout, proposal)
        if _better(trial_works, trial_labels, current, dp_size) is not None:
            labels, works, current = trial_labels, trial_works, _objective(trial_works, trial_labels, dp_size)
            continue
        improved = False
        for proposal in proposals:
            # proposals touch disjoint microbatches, so each stays exact after others are applied
            trial_labels, trial_works = labels.copy(), works.copy()
            _apply(trial_labels, trial_works, layout, proposal)
            if _better(trial_works, trial_labels, current, dp_size) is not None:
                labels, works, improved = trial_labels, trial_works, True
                current = _objective(works, labels, dp_size)
        if not improved:
            break
    logger.debug("slot balancing: J %s -> %s", initial, current)
    return labels
