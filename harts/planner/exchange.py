"""Subtree exchange: moves and swaps of whole subtrees between microbatches that lower compact work.

Sparse repair (``harts.planner.repair``, the paper's refinement) moves or swaps single
trajectories between microbatches that hold a trajectory within ``H`` lexicographic
positions. A rollout tree split over several microbatches often keeps a whole subtree in a
microbatch that shares less with it than another piece of the same tree does; moving one of
its trajectories alone then duplicates the subtree's own shared prefix, so no single move
improves. This pass moves (or swaps) the subtree as a unit.

A *subtree* of microbatch A is a run of A's members in rank order whose members share more
with each other than with the run's neighbours in A (an LCP interval of A's sorted members,
single trajectories included, A itself excluded). Each round evaluates, for every subtree R
of every microbatch A:

* moving R to each microbatch B that holds a rank sharing more with R than R's own
  microbatch does (another piece of the same tree, where R's siblings live). Those ranks form
  one range on each side of R (LCPs only fall with rank distance), found by binary search;
  the receivers are the microbatches of the ``window`` nearest runs of equal labels in it;
* swapping R with the subtrees S of such a B nearest to R in work (``reach`` on either side),
  when moving R alone would already save work ignoring capacity (the swap makes room, or S is
  better off in A).

Every neighbourhood is capped (``window`` receivers, ``reach`` partners), so a round costs time
linear in the number of subtrees; rounds stop when the stage's work budget
(:mod:`harts.planner.budget`) is spent.

Costs are exact (Eq. 5 through pairwise LCPs): removing a run saves ``|run| - internal LCPs -
LCP(left, first) - LCP(last, right) + LCP(left, right)`` for its neighbours in A, and
inserting it where no remaining member of B lies between its ends costs ``C(run) -
LCP(p, first) - LCP(last, q) + LCP(p, q)`` for its neighbours p, q in B (other inserts are
not proposed). A change is admissible when both microbatches stay within capacity and the
two microbatches' summed work strictly falls. Per round the best admissible changes on
disjoint microbatch pairs are applied together, largest saving first (each stays exact, since
it touches only its own two microbatches); rounds repeat until none is admissible. K, coverage, nonemptiness and capacity are preserved; total compact
work strictly falls with every change.
"""

from __future__ import annotations

import numpy as np

from harts.planner.budget import WorkBudget, unlimited
from harts.planner.ranks import RankSpace, sorted_unique


class Layout:
    """Members sorted by (group, rank), in-group adjacent LCPs, and exact run savings and insert costs."""

    def __init__(self, space: RankSpace, labels: np.ndarray, count: int):
        n = space.size
        self.space = space
        self.labels = labels
        self.order = order = np.lexsort((np.arange(n), labels))
        self.keys = labels[order] * n + order
        self.position = np.empty(n, dtype=np.int64)
        self.position[order] = np.arange(n)
        self.counts = np.bincount(labels, minlength=count)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)])
        self.group_of_position = labels[order]
        same = self.group_of_position[1:] == self.group_of_position[:-1]
        adjacent = np.zeros(n, dtype=np.int64)  # adjacent[t]: LCP(order[t], order[t+1]) inside one group, else 0
        adjacent[:-1] = np.where(same, space.lcp_between(order[:-1], order[1:]), 0)
        self.same_next = np.append(same, False)
        self.adjacent = adjacent
        self.adjacent_prefix = np.concatenate([[0], np.cumsum(adjacent)])
        self.length_prefix = np.concatenate([[0], np.cumsum(space.lengths[order])])

    def first_at_or_after(self, group: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """Sorted position of the first member of ``group`` with rank at least ``rank`` (the group's end if none)."""
        return np.searchsorted(self.keys, group * self.space.size + rank)

    def group_bounds(self, group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.starts[group], self.starts[group + 1] - 1

    def run_saving(self, first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Exact C(G) - C(G minus run) and C(run) for runs at sorted positions ``first..last`` of their group G."""
        n = self.space.size
        group_first, group_last = self.group_bounds(self.group_of_position[first])
        length = self.length_prefix[last + 1] - self.length_prefix[first]
        internal = self.adjacent_prefix[last] - self.adjacent_prefix[first]
        left = np.where(first > group_first, self.adjacent[np.maximum(first - 1, 0)], 0)
        right = np.where(last < group_last, self.adjacent[last], 0)
        before = np.where(first > group_first, self.order[np.maximum(first - 1, 0)], -1)
        after = np.where(last < group_last, self.order[np.minimum(last + 1, n - 1)], n)
        bridge = self.space.lcp_between(before, after)
        return length - internal - left - right + bridge, length - internal

    def insert_cost(self, group, first, last, run_work, removed_first, removed_last):
        """Exact C(G minus removed + run) - C(G minus removed) for the run at sorted positions ``first..last``
        joining ``group`` after the group's own run ``removed_first..removed_last`` left it (none when first > last).

        Returns the cost and whether it is exact (no remaining member of the group lies between the run's ends).
        """
        n = self.space.size
        low, high = self.order[first], self.order[last]
        at_low = self.first_at_or_after(group, low)
        at_high = self.first_at_or_after(group, high)
        overlap = np.maximum(0, np.minimum(at_high, removed_last + 1) - np.maximum(at_low, removed_first))
        fits = (at_high - at_low - overlap) == 0
        group_first, group_last = self.group_bounds(group)
        before = at_low - 1
        before = np.where((before >= removed_first) & (before <= removed_last), removed_first - 1, before)
        after = np.where((at_high >= removed_first) & (at_high <= removed_last), removed_last + 1, at_high)
        before_rank = np.where(before >= group_first, self.order[np.clip(before, 0, n - 1)], -1)
        after_rank = np.where(after <= group_last, self.order[np.clip(after, 0, n - 1)], n)
        lcp = self.space.lcp_between
        cost = run_work - lcp(before_rank, low) - lcp(high, after_rank) + lcp(before_rank, after_rank)
        return cost, fits


def _group_subtrees(adjacent: list[int], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Relative ``first..last`` of the subtrees of one group of ``size`` sorted members with in-group adjacent
    LCPs ``adjacent``, ordered by first position then length (the whole group excluded)."""
    if size < 2:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    firsts = list(range(size))
    lasts = list(range(size))
    stack: list[tuple[int, int]] = []  # (lcp value, first position) of open intervals
    for position in range(size):
        value = adjacent[position] if position < size - 1 else -1
        first = position
        while stack and stack[-1][0] > value:
            _, first = stack.pop()
            if not (first == 0 and value < 0):
                firsts.append(first)
                lasts.append(position)
        if value >= 0 and (not stack or stack[-1][0] < value):
            stack.append((value, first))
    first, last = np.array(firsts, dtype=np.int64), np.array(lasts, dtype=np.int64)
    order = np.lexsort((last - first, first))
    return first[order], last[order]


def subtree_runs(layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """Sorted positions ``first..last`` of every group's subtrees: LCP intervals of its sorted members
    (runs sharing more inside than with their neighbours in the group), single members included, whole
    groups excluded. Ordered by group, then first position, then length.

    A group's subtrees depend on its members alone, so they are kept per member set on the rank
    space and reused while a group is unchanged (the search rounds change a few groups at a time).
    """
    cache = layout.space.subtree_cache
    starts = layout.starts.tolist()
    order = layout.order
    adjacent = layout.adjacent
    firsts, lasts, offsets, counts = [], [], [], []
    for group in range(len(starts) - 1):
        low, high = starts[group], starts[group + 1]
        key = order[low:high].tobytes()
        runs = cache.get(key)
        if runs is None:
            runs = cache[key] = _group_subtrees(adjacent[low : high - 1].tolist(), high - low)
        if runs[0].size:
            firsts.append(runs[0])
            lasts.append(runs[1])
            offsets.append(low)
            counts.append(runs[0].size)
    if not firsts:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    # cached positions are relative to the group's first member: shift them all at once
    shift = np.repeat(np.array(offsets, dtype=np.int64), counts)
    return np.concatenate(firsts) + shift, np.concatenate(lasts) + shift


def _sharing_range(space: RankSpace, ranks: np.ndarray, threshold: np.ndarray, upward: bool) -> np.ndarray:
    """The farthest rank on one side of each rank whose LCP with it exceeds ``threshold`` (the rank itself if none).

    ``LCP(r, x) = min(lcp[r+1..x])`` only falls as ``r`` moves away from ``x``, so a binary search
    on range minima finds the end of the range. The range is empty exactly when the adjacent rank
    already shares no more than ``threshold`` (on batches without sharing, every range); only the
    nonempty ones are searched, and each step only those still open. Ranks outside the rank's prefix run
    share exactly ``floor`` (:meth:`RankSpace.prefix_runs`): below ``floor`` the range is the whole batch on
    that side, else it ends inside the run, so the search spans the run only.
    """
    n = space.size
    floor, run_firsts, run_lasts = space.prefix_runs()
    result = ranks.copy()
    if upward:
        neighbour_lcp = space.lcp[np.minimum(ranks + 1, n - 1)]
        searching = np.flatnonzero((ranks < n - 1) & (neighbour_lcp > threshold))
        everything = threshold[searching] < floor
        result[searching[everything]] = n - 1
        searching = searching[~everything]
        low, high = ranks[searching] + 1, run_lasts[ranks[searching]]  # answer in [low, high]
    else:
        searching = np.flatnonzero((ranks > 0) & (space.lcp[ranks] > threshold))
        everything = threshold[searching] < floor
        result[searching[everything]] = 0
        searching = searching[~everything]
        low, high = run_firsts[ranks[searching]], ranks[searching] - 1
    anchors, bound = ranks[searching], threshold[searching]
    while searching.size:
        if upward:
            middle = (low + high + 1) // 2
            ok = space.lcp_between(anchors, middle) > bound
            low, high = np.where(ok, middle, low), np.where(ok, high, middle - 1)
        else:
            middle = (low + high) // 2
            ok = space.lcp_between(middle, anchors) > bound
            low, high = np.where(ok, low, middle + 1), np.where(ok, middle, high)
        done = low >= high
        result[searching[done]] = low[done]
        open_ = ~done
        searching, low, high, anchors, bound = searching[open_], low[open_], high[open_], anchors[open_], bound[open_]
    return result


def sharing_receivers(space: RankSpace, labels: np.ndarray, layout: Layout, first: np.ndarray, last: np.ndarray,
               shared: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """(subtree, microbatch) pairs worth evaluating: microbatches other than the subtree's own that hold a rank
    sharing more than ``shared`` tokens with the subtree's first (last) member, among the ``window`` nearest
    runs of equal labels below (above) it.

    With ``shared`` the tokens the subtree shares with the rest of its own microbatch, only such a
    microbatch can take it for less than its removal saves (the ranks sharing more form one range
    on each side, since LCPs only fall with rank distance).
    """
    n = space.size
    low, high = layout.order[first], layout.order[last]
    group = layout.group_of_position[first]
    run_of_rank = np.concatenate([[0], np.cumsum(labels[1:] != labels[:-1])])
    run_label = labels[np.flatnonzero(np.diff(labels, prepend=-1) != 0)]
    pieces_run, pieces_label = [], []
    for upward in (False, True):
        anchor = high if upward else low
        end = _sharing_range(space, anchor, shared, upward)
        if upward:
            start_run = np.where(anchor < n - 1, run_of_rank[np.minimum(anchor + 1, n - 1)], 0)
            runs = np.where(end > anchor, run_of_rank[end] - start_run + 1, 0)
        else:
            start_run = np.where(anchor > 0, run_of_rank[np.maximum(anchor - 1, 0)], 0)
            runs = np.where(end < anchor, start_run - run_of_rank[end] + 1, 0)
        runs = np.minimum(runs, window)
        owner = np.repeat(np.arange(first.size), runs)
        step = np.arange(owner.size) - np.repeat(np.cumsum(runs) - runs, runs)
        run = np.repeat(start_run, runs) + (step if upward else -step)
        pieces_run.append(owner)
        pieces_label.append(run_label[run])
    owner = np.concatenate(pieces_run)
    receiver = np.concatenate(pieces_label)
    keep = receiver != group[owner]
    count = int(labels.max()) + 1
    pair = sorted_unique(owner[keep] * count + receiver[keep])
    return pair // count, pair % count


def expand(owners: np.ndarray, counts: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each owner i, the indices ``starts[i] .. starts[i] + counts[i] - 1``: (repeated owner, index)."""
    owner = np.repeat(owners, counts)
    offset = np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, np.repeat(starts, counts) + offset


def around(centre: np.ndarray, low: np.ndarray, high: np.ndarray, reach: int) -> tuple[np.ndarray, np.ndarray]:
    """For each i, the positions ``centre[i] - reach .. centre[i] + reach - 1`` clipped to ``[low[i], high[i])``:
    (repeated i, position). Bounds every neighbourhood the searches evaluate to ``2 * reach`` entries."""
    start = np.maximum(centre - reach, low)
    counts = np.maximum(np.minimum(centre + reach, high) - start, 0)
    return expand(np.arange(centre.size), counts, start)


def nearest_runs(group: np.ndarray, run_work: np.ndarray, receivers: np.ndarray, wanted: np.ndarray, count: int,
                 reach: int) -> tuple[np.ndarray, np.ndarray]:
    """For each query i, the subtrees of microbatch ``receivers[i]`` nearest to work ``wanted[i]``, ``reach`` on either
    side (``group[j]`` / ``run_work[j]``: subtree j's microbatch and work): (query i, subtree j) pairs.

    Swapping a subtree for one of similar work changes both microbatches' works the least, which is
    what a swap that makes room for a move needs; the cap keeps swaps linear in the subtrees."""
    scale = int(run_work.max(initial=0)) + 1
    order = np.lexsort((np.arange(group.size), run_work, group))
    keys = group[order] * scale + run_work[order]
    bounds = np.searchsorted(group[order], np.arange(count + 1))
    centre = np.searchsorted(keys, receivers * scale + np.minimum(wanted, scale - 1))
    owner, at = around(centre, bounds[receivers], bounds[receivers + 1], reach)
    return owner, order[at]


def _candidates(space: RankSpace, capacity: int, labels: np.ndarray, works: np.ndarray, layout: Layout, window: int, reach: int):
    """Admissible work-saving moves and swaps: arrays (saving, A, B, a..b run of A, c..d run of B or empty, new A, new B),
    and the number of changes evaluated."""
    first, last = subtree_runs(layout)
    if first.size == 0:
        return None, 0
    group = layout.group_of_position[first]
    saving, run_work = layout.run_saving(first, last)
    run_index, receivers = sharing_receivers(space, labels, layout, first, last, run_work - saving, window)
    empty = np.ones(run_index.size, dtype=np.int64), np.zeros(run_index.size, dtype=np.int64)
    cost, fits = layout.insert_cost(receivers, first[run_index], last[run_index], run_work[run_index], *empty)
    move_gain = saving[run_index] - cost
    source = group[run_index]
    parts = []
    ok = fits & (move_gain > 0)
    take = ok & (works[receivers] + cost <= capacity)
    parts.append((move_gain[take], source[take], receivers[take], first[run_index][take], last[run_index][take],
                  np.ones(int(take.sum()), dtype=np.int64), np.zeros(int(take.sum()), dtype=np.int64),
                  works[source[take]] - saving[run_index][take], works[receivers[take]] + cost[take]))
    # swaps with the subtrees S of B nearest in work (``reach`` on either side), for the moves that save work
    # ignoring capacity
    promising = np.flatnonzero(ok)
    if promising.size:
        pick, theirs = nearest_runs(group, run_work, receivers[promising], run_work[run_index[promising]], works.size, reach)
        mine = promising[pick]
        a_group, b_group = source[mine], receivers[mine]
        r_first, r_last = first[run_index[mine]], last[run_index[mine]]
        s_first, s_last = first[theirs], last[theirs]
        r_saving, r_work = saving[run_index[mine]], run_work[run_index[mine]]
        s_saving, s_work = saving[theirs], run_work[theirs]
        r_cost, r_fits = layout.insert_cost(b_group, r_first, r_last, r_work, s_first, s_last)
        s_cost, s_fits = layout.insert_cost(a_group, s_first, s_last, s_work, r_first, r_last)
        new_a = works[a_group] - r_saving + s_cost
        new_b = works[b_group] - s_saving + r_cost
        gain = works[a_group] + works[b_group] - new_a - new_b
        take = r_fits & s_fits & (gain > 0) & (new_a <= capacity) & (new_b <= capacity)
        parts.append((gain[take], a_group[take], b_group[take], r_first[take], r_last[take], s_first[take], s_last[take],
                      new_a[take], new_b[take]))
    evaluated = int(run_index.size + (mine.size if promising.size else 0))
    return tuple(np.concatenate(p) for p in zip(*parts)), evaluated


def exchange_subtrees(space: RankSpace, capacity: int, labels: np.ndarray, rounds: int = 16, window: int = 8,
                      reach: int = 8, budget: WorkBudget | None = None) -> np.ndarray:
    """Labels after up to ``rounds`` rounds of work-saving subtree moves and swaps; see the module docstring.

    ``reach`` bounds the swap partners of each move; ``budget`` (:mod:`harts.planner.budget`) is
    charged each round's trajectories and candidates, and no round starts that it cannot afford."""
    budget = unlimited() if budget is None else budget
    labels = np.asarray(labels, dtype=np.int64).copy()
    count = int(labels.max()) + 1
    works = space.group_works(labels, count)
    if works.max() > capacity:
        return labels
    n = space.size
    for _ in range(rounds):
        if budget.spent:
            break
        layout = Layout(space, labels, count)
        found, evaluated = _candidates(space, capacity, labels, works, layout, window, reach)
        budget.charge_round(n + evaluated)
        if found is None or found[0].size == 0:
            break
        gain, a_group, b_group, r_first, r_last, s_first, s_last, new_a, new_b = found
        ranked = np.lexsort((s_last, s_first, r_last, r_first, np.maximum(new_a, new_b), -gain))
        used = [False] * count
        applied = 0
        for c, a, b in zip(ranked.tolist(), a_group[ranked].tolist(), b_group[ranked].tolist()):
            if used[a] or used[b]:
                continue
            used[a] = used[b] = True
            labels[layout.order[r_first[c] : r_last[c] + 1]] = b
            if s_first[c] <= s_last[c]:
                labels[layout.order[s_first[c] : s_last[c] + 1]] = a
            works[a], works[b] = new_a[c], new_b[c]
            applied += 1
        if not applied:
            break
    return labels
