"""Sparse repair: single moves and swaps between nearby ranks that strictly lower compact work.

A partition is a label per rank. Per iteration every trajectory's removal saving
``C(A) - C(A \\ {x})`` comes from its neighbours inside its own microbatch, and every
insertion cost ``ΔC`` (Eq. 10) from the neighbours it would have in the destination;
both are evaluated for all candidate pairs at once.
"""

from __future__ import annotations

import numpy as np

from harts.planner.ranks import RankSpace


def _neighbour_tables(space: RankSpace, labels: np.ndarray):
    """Members sorted by (label, rank), their keys, and each rank's neighbours in its own group."""
    n = space.size
    ranks = np.arange(n)
    order = np.lexsort((ranks, labels))
    keys = labels[order] * n + order
    position = np.empty(n, dtype=np.int64)
    position[order] = ranks
    previous = np.where(position > 0, order[np.maximum(position - 1, 0)], -1)
    previous = np.where((previous >= 0) & (labels[np.maximum(previous, 0)] == labels), previous, -1)
    following = np.where(position < n - 1, order[np.minimum(position + 1, n - 1)], n)
    following = np.where((following < n) & (labels[np.minimum(following, n - 1)] == labels), following, n)
    return order, keys, previous, following


def _neighbours_in(space: RankSpace, labels: np.ndarray, order: np.ndarray, keys: np.ndarray, ranks: np.ndarray, groups: np.ndarray):
    """Predecessor and successor of each ``ranks[i]`` among the members of ``groups[i]`` (rank not a member)."""
    n = space.size
    slot = np.searchsorted(keys, groups * n + ranks, side="left")
    previous = np.where(slot > 0, order[np.maximum(slot - 1, 0)], -1)
    previous = np.where((previous >= 0) & (labels[np.maximum(previous, 0)] == groups), previous, -1)
    following = np.where(slot < n, order[np.minimum(slot, n - 1)], n)
    following = np.where((following < n) & (labels[np.minimum(following, n - 1)] == groups), following, n)
    return previous, following


def _best_move(space: RankSpace, capacity: int, labels: np.ndarray, works: np.ndarray, counts: np.ndarray, window: int):
    n = space.size
    order, keys, previous, following = _neighbour_tables(space, labels)
    ranks = np.arange(n)
    saving = space.lengths - space.neighbour_shared(ranks, previous, following)
    sources, destinations = [], []
    for offset in range(-window, window + 1):
        if offset == 0:
            continue
        lo = max(0, -offset)
        hi = max(lo, min(n, n - offset))
        mover = ranks[lo:hi]
        target = labels[mover + offset]
        keep = (target != labels[mover]) & (counts[labels[mover]] > 1)
        sources.append(mover[keep])
        destinations.append(target[keep])
    movers = np.concatenate(sources)
    if movers.size == 0:
        return None
    # a (mover, target) pair can repeat (several nearby ranks in one microbatch); repeats score alike and
    # the pick below is a total order on distinct pairs, so they need no removal
    targets = np.concatenate(destinations)
    before, after = _neighbours_in(space, labels, order, keys, movers, targets)
    cost = space.lengths[movers] - space.neighbour_shared(movers, before, after)
    source_after = works[labels[movers]] - saving[movers]
    target_after = works[targets] + cost
    gain = saving[movers] - cost
    usable = np.flatnonzero((target_after <= capacity) & (gain > 0))
    if usable.size == 0:
        return None
    pick = usable[np.lexsort((targets[usable], movers[usable], np.maximum(source_after, target_after)[usable], -gain[usable]))[0]]
    return int(movers[pick]), int(targets[pick])


def _best_swap(space: RankSpace, capacity: int, labels: np.ndarray, works: np.ndarray, window: int):
    n = space.size
    order, keys, previous, following = _neighbour_tables(space, labels)
    ranks = np.arange(n)
    saving = space.lengths - space.neighbour_shared(ranks, previous, following)
    lows, highs = [], []
    for offset in range(1, window + 1):
        low = ranks[: max(0, n - offset)]
        high = low + offset
        keep = labels[low] != labels[high]
        lows.append(low[keep])
        highs.append(high[keep])
    low, high = np.concatenate(lows), np.concatenate(highs)
    if low.size == 0:
        return None
    group_low, group_high = labels[low], labels[high]
    # high joins low's group without low: low can only be high's predecessor there
    before, after = _neighbours_in(space, labels, order, keys, high, group_low)
    before = np.where(before == low, previous[low], before)
    high_cost = space.lengths[high] - space.neighbour_shared(high, before, after)
    # low joins high's group without high: high can only be low's successor there
    before, after = _neighbours_in(space, labels, order, keys, low, group_high)
    after = np.where(after == high, following[high], after)
    low_cost = space.lengths[low] - space.neighbour_shared(low, before, after)
    low_group_after = works[group_low] - saving[low] + high_cost
    high_group_after = works[group_high] - saving[high] + low_cost
    gain = works[group_low] + works[group_high] - low_group_after - high_group_after
    usable = np.flatnonzero((low_group_after <= capacity) & (high_group_after <= capacity) & (gain > 0))
    if usable.size == 0:
        return None
    pick = usable[np.lexsort((high[usable], low[usable], np.maximum(low_group_after, high_group_after)[usable], -gain[usable]))[0]]
    return int(low[pick]), int(high[pick])


def sparse_repair(space: RankSpace, capacity: int, labels: np.ndarray, window: int = 8, iterations: int = 4) -> np.ndarray:
    """Up to ``iterations`` single best moves (or, when no move improves, swaps) within ``window`` ranks.

    A move takes a trajectory out of a microbatch of two or more into one holding a
    trajectory within ``window`` ranks; a swap exchanges two trajectories at most
    ``window`` ranks apart. Only strict decreases of the two microbatches' total work are
    taken (the largest, ties to the lighter heavier side); K, coverage, nonemptiness and
    capacity are preserved.
    """
    labels = labels.copy()
    for _ in range(iterations):
        count = int(labels.max()) + 1
        works = space.group_works(labels, count)
        counts = np.bincount(labels, minlength=count)
        move = _best_move(space, capacity, labels, works, counts, window)
        if move is not None:
            labels[move[0]] = move[1]
            continue
        swap = _best_swap(space, capacity, labels, works, window)
        if swap is None:
            break
        low, high = swap
        labels[low], labels[high] = labels[high], labels[low]
    return labels
