"""Partitions that are contiguous in lexicographic rank order (§3.2).

A contiguous partition is given by its ``starts``: ascending ranks, ``starts[0] == 0``;
microbatch ``i`` holds ranks ``starts[i] .. starts[i+1] - 1``. By Eq. 6, cutting between
ranks ``t-1`` and ``t`` costs exactly ``lcp[t]`` compact tokens, so every operation here
reasons about cut positions and their LCP values.

* :func:`natural_partition`: recursive lowest-valley splitting of over-capacity intervals.
* :func:`unit_partition`: every batch-wide lowest valley cut (whole trees), then natural splits.
* :func:`exact_partitions`: the dynamic program of Eq. 9 for every requested K, ties on
  total work broken by the smaller heaviest microbatch.
* :func:`sampled_k_values`, :func:`evolve_partitions`: the sampled-K merge/split evolution
  of the natural partition used above the exact threshold.
* :func:`refine_boundaries`: moves each cut within a window to lower the two neighbours' work.
"""

from __future__ import annotations

import bisect

import numpy as np

from harts.planner.ranks import RankSpace

_INFINITE = np.int64(1) << np.int64(60)


def _best_split(space: RankSpace, first: int, last: int) -> tuple[int, int]:
    """The cut inside ranks ``first..last`` at the lowest LCP valley; returns ``(cut, cost)``.

    Ties on the LCP go to the cut whose heavier side is lighter, then to the more even
    cut, then to the leftmost one.
    """
    cuts = np.arange(first + 1, last + 1)
    values = space.lcp[cuts]
    lowest = values.min()
    cuts = cuts[values == lowest]
    left = space.interval_works(np.full_like(cuts, first), cuts - 1)
    right = space.interval_works(cuts, np.full_like(cuts, last))
    choice = np.lexsort((cuts, np.abs(left - right), np.maximum(left, right)))[0]
    return int(cuts[choice]), int(lowest)


def natural_partition(space: RankSpace, capacity: int) -> np.ndarray:
    """P0: split every interval above ``capacity`` at its lowest valley until all fit."""
    return np.array(sorted(_split_until_fits(space, 0, space.size - 1, capacity)), dtype=np.int64)


def _split_until_fits(space: RankSpace, first: int, last: int, capacity: int) -> list[int]:
    starts = []
    pending = [(first, last)]
    while pending:
        first, last = pending.pop()
        if space.interval_work(first, last) <= capacity:
            starts.append(first)
            continue
        cut, _ = _best_split(space, first, last)
        pending.append((cut, last))
        pending.append((first, cut - 1))
    return starts


def unit_partition(space: RankSpace, capacity: int) -> np.ndarray:
    """Cuts at every valley as low as the batch's lowest, then natural splits of the pieces above ``capacity``.

    The batch's lowest valley is usually the prompt every rollout tree shares (or nothing), so
    the pieces are whole trees where a tree fits and natural pieces of it where it does not:
    small items that a packer can combine into nearly full microbatches, paying the lowest
    valley once per microbatch instead of once per piece.
    """
    n = space.size
    if n == 1:
        return np.zeros(1, dtype=np.int64)
    floor = space.lcp[1:].min()
    bounds = np.append(np.concatenate(([0], np.flatnonzero(space.lcp[1:] <= floor) + 1)), n)
    starts: list[int] = []
    for first, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        starts.extend(_split_until_fits(space, first, end - 1, capacity))
    return np.array(sorted(starts), dtype=np.int64)


def partition_ends(starts: np.ndarray, size: int) -> np.ndarray:
    """Inclusive last rank of each microbatch of a contiguous partition."""
    return np.append(starts[1:] - 1, size - 1)


def partition_works(space: RankSpace, starts: np.ndarray) -> np.ndarray:
    return space.interval_works(starts, partition_ends(starts, space.size))


def labels_from_starts(starts: np.ndarray, size: int) -> np.ndarray:
    labels = np.zeros(size, dtype=np.int64)
    labels[starts[1:]] = 1
    return np.cumsum(labels)


def starts_from_labels(labels: np.ndarray) -> np.ndarray | None:
    """The starts of a partition whose canonical labels are non-decreasing, else None."""
    if np.any(np.diff(labels) < 0):
        return None
    return np.flatnonzero(np.diff(labels, prepend=-1) != 0).astype(np.int64)


# ---------------------------------------------------------------------------- exact DP
def exact_partitions(space: RankSpace, capacity: int, k_values: list[int]) -> dict[int, np.ndarray]:
    """Minimum-work contiguous partitions into exactly K nonempty feasible microbatches (Eq. 9).

    Returns ``{K: starts}`` for every requested K that admits a feasible partition. State
    ``(total, heaviest)`` is compared lexicographically; that order is preserved by adding
    a last interval, so the recursion stays exact for the tie-break too.
    """
    n = space.size
    k_values = sorted({k for k in k_values if 1 <= k <= n})
    if not k_values:
        return {}
    k_last = k_values[-1]
    ends = np.arange(1, n + 1)  # e: the partition covers ranks 0..e-1
    # W(s, e-1) = (LP[e] - CP[e]) - (LP[s] - CP[s+1]); the subtracted term grows with s,
    # so the feasible starts for endpoint e are exactly s >= first_start[e].
    growing = space.length_prefix[:n] - space.lcp_prefix[1 : n + 1]
    first_start = np.searchsorted(growing, space.length_prefix[ends] - space.lcp_prefix[ends] - capacity, side="left")
    band = int((ends - first_start).max())
    offsets = np.arange(band)
    split = ends[:, None] - 1 - offsets[None, :]  # s for row e-1, column j
    valid = split >= first_start[:, None]
    split_clipped = np.where(valid, split, 0)
    last_work = np.where(valid, space.interval_works(split_clipped, np.broadcast_to(ends[:, None] - 1, split.shape)), _INFINITE)

    total = np.full(n + 1, _INFINITE, dtype=np.int64)
    heaviest = np.full(n + 1, _INFINITE, dtype=np.int64)
    total[0] = heaviest[0] = 0
    choices = np.zeros((k_last + 1, n + 1), dtype=np.int64)
    finals: dict[int, tuple[int, int]] = {}
    rows = np.arange(n)
    for k in range(1, k_last + 1):
        candidate_total = np.minimum(total[split_clipped] + last_work, _INFINITE)
        best_total = candidate_total.min(axis=1)
        candidate_heaviest = np.where(candidate_total == best_total[:, None], np.maximum(heaviest[split_clipped], last_work), _INFINITE)
        column = candidate_heaviest.argmin(axis=1)
        new_total = np.full(n + 1, _INFINITE, dtype=np.int64)
        new_heaviest = np.full(n + 1, _INFINITE, dtype=np.int64)
        new_total[1:] = best_total
        new_heaviest[1:] = candidate_heaviest[rows, column]
        new_total[new_total >= _INFINITE] = _INFINITE
        choices[k, 1:] = split_clipped[rows, column]
        total, heaviest = new_total, new_heaviest
        if k in k_values and total[n] < _INFINITE:
            finals[k] = (int(total[n]), int(heaviest[n]))
    result = {}
    for k in finals:
        starts = []
        end = n
        for level in range(k, 0, -1):
            end = int(choices[level, end])
            starts.append(end)
        result[k] = np.array(starts[::-1], dtype=np.int64)
    return result


# ---------------------------------------------------------------------------- sampled K
def k_range(compact_total: int, natural_count: int, size: int, capacity: int, dp_size: int) -> list[int]:
    """Eq. 7-8: the DP-compatible K from K_min to K_max in steps of D."""
    k_min = dp_size * max(1, -(-compact_total // (capacity * dp_size)))
    k_max = max(k_min, min(dp_size * -(-natural_count // dp_size), dp_size * (size // dp_size)))
    return list(range(k_min, k_max + 1, dp_size))


def sampled_k_values(k_values: list[int], budget: int) -> list[int]:
    """At most ``budget`` of ``k_values``: both ends, the smallest densely, the rest evenly."""
    if len(k_values) <= budget:
        return list(k_values)
    dense = max(1, budget // 2)
    # the sparse part spans the remaining values up to and including the top endpoint
    spread = np.linspace(dense, len(k_values) - 1, max(1, budget - dense)).round().astype(int)
    return sorted(set(k_values[:dense]) | {k_values[i] for i in spread})


def _best_recut(space: RankSpace, capacity: int, starts: np.ndarray) -> tuple[int, int, int] | None:
    """The best re-cut of three adjacent microbatches into two: ``(first of the three, new cut, saving)``.

    Used when no two adjacent microbatches fit together. By Eq. 6 the two new parts cost
    W(a, b) + lcp[t] for a cut t, so each window needs the lowest LCP among the cuts whose
    two sides both fit; those cuts form one range, found by binary search on the
    monotone prefix-work terms, and its minimum comes from the sparse table.
    """
    if len(starts) < 3:
        return None
    n = space.size
    ends = partition_ends(starts, n)
    first, last = starts[:-2], ends[2:]
    # W(a, e) = rising[e] - falling[a]: both terms grow with their argument
    rising = space.length_prefix[1:] - space.lcp_prefix[1:]
    falling = space.length_prefix[:n] - space.lcp_prefix[1 : n + 1]
    highest = np.minimum(np.searchsorted(rising, capacity + falling[first], side="right"), last)
    lowest = np.maximum(np.searchsorted(falling, rising[last] - capacity, side="left"), first + 1)
    usable = np.flatnonzero(lowest <= highest)
    if usable.size == 0:
        return None
    cost = space.range_min(lowest[usable], highest[usable])
    old = space.interval_works(starts[:-2], ends[:-2]) + space.interval_works(starts[1:-1], ends[1:-1]) + space.interval_works(starts[2:], ends[2:])
    saving = old[usable] - (space.interval_works(first[usable], last[usable]) + cost)
    pick = usable[np.lexsort((usable, -saving))[0]]
    cuts = np.arange(lowest[pick], highest[pick] + 1)
    values = space.lcp[cuts]
    cuts = cuts[values == values.min()]
    left = space.interval_works(np.full_like(cuts, first[pick]), cuts - 1)
    right = space.interval_works(cuts, np.full_like(cuts, last[pick]))
    cut = cuts[np.lexsort((cuts, np.abs(left - right), np.maximum(left, right)))[0]]
    return int(pick), int(cut), int(saving[np.flatnonzero(usable == pick)[0]])


RECUT_MODES = ("never", "fallback", "always")


def evolve_partitions(space: RankSpace, capacity: int, natural: np.ndarray, targets: list[int],
                      recut: str = "fallback") -> dict[int, np.ndarray]:
    """Merge (K < K0) or split (K > K0) the natural partition greedily, snapshotting each target K.

    A merge joins the feasible adjacent pair that saves the most (the LCP at their cut,
    Eq. 6), ties to the lighter result then the leftmost. ``recut`` chooses when a re-cut
    of three adjacent microbatches into two (:func:`_best_recut`) replaces a merge:
    ``never`` (the paper's rule: the chain stops when no pair fits together),
    ``fallback`` (only when no pair fits) or ``always`` (also when it saves more).
    A split takes the cheapest cut of any microbatch, ties to the heavier microbatch then
    the leftmost. A target that the chain cannot reach has no entry.

    Each step changes at most three adjacent microbatches, so the chains keep every pair's
    merged work and every window's best re-cut and recompute only the entries next to the
    change (plain Python on prefix sums: the per-step work is a few scalar queries).
    """
    if recut not in RECUT_MODES:
        raise ValueError(f"unknown re-cut mode {recut!r}; known: {', '.join(RECUT_MODES)}")
    result: dict[int, np.ndarray] = {}
    k_natural = len(natural)
    if k_natural in targets:
        result[k_natural] = natural.copy()
    below = sorted((k for k in targets if k < k_natural), reverse=True)
    above = sorted(k for k in targets if k > k_natural)
    if below:
        result.update(_merge_chain(space, capacity, natural, below, recut))
    if above:
        result.update(_split_chain(space, natural, above))
    return result


def _merge_chain(space: RankSpace, capacity: int, natural: np.ndarray, below: list[int], recut: str) -> dict[int, np.ndarray]:
    n = space.size
    length_prefix = space.length_prefix.tolist()
    lcp_prefix = space.lcp_prefix.tolist()
    lcp = space.lcp.tolist()
    lcp_min = space.index.lcp_min
    # W(a, e) = rising[e] - falling[a]; both only grow with their argument
    rising = [length_prefix[e + 1] - lcp_prefix[e + 1] for e in range(n)]
    falling = [length_prefix[a] - lcp_prefix[a + 1] for a in range(n)]
    starts = [int(a) for a in natural]

    def end(i: int) -> int:
        return starts[i + 1] - 1 if i + 1 < len(starts) else n - 1

    def pair_work(i: int) -> int:  # the work of microbatches i and i+1 merged
        return rising[end(i + 1)] - falling[starts[i]]

    def window(i: int):
        """(saving, lowest, highest) of the best re-cut of microbatches i..i+2, None if no cut fits."""
        a, e = starts[i], end(i + 2)
        highest = min(bisect.bisect_right(rising, capacity + falling[a]), e)
        lowest = max(bisect.bisect_left(falling, rising[e] - capacity), a + 1)
        if lowest > highest:
            return None
        return works[i] + works[i + 1] + works[i + 2] - (rising[e] - falling[a] + lcp_min(lowest, highest)), lowest, highest

    works = [rising[end(i)] - falling[starts[i]] for i in range(len(starts))]
    pairs = [pair_work(i) for i in range(len(starts) - 1)]
    windows = [window(i) for i in range(len(starts) - 2)] if recut != "never" else []
    result: dict[int, np.ndarray] = {}
    for target in below:
        while len(starts) > target:
            count = len(starts)
            best_merge = None  # (saving, -merged work, -position)
            for i in range(count - 1):
                if pairs[i] <= capacity:
                    key = (lcp[starts[i + 1]], -pairs[i], -i)
                    if best_merge is None or key > best_merge:
                        best_merge = key
            best_recut = None  # (saving, -position)
            if recut == "always" or (recut == "fallback" and best_merge is None):
                for i, value in enumerate(windows):
                    if value is not None and (best_recut is None or value[0] > best_recut[0]):
                        best_recut = (value[0], -i)
            if best_recut is not None and (best_merge is None or best_recut[0] > best_merge[0]):
                first = -best_recut[1]
                _, lowest, highest = windows[first]
                cut = _recut_position(space, starts[first], end(first + 2), lowest, highest)
                last = end(first + 2)
                starts[first + 1 : first + 3] = [cut]
                works[first : first + 3] = [rising[cut - 1] - falling[starts[first]], rising[last] - falling[cut]]
                count -= 1
                # entries overlapping the three old microbatches give way to those overlapping the two new ones
                low = max(0, first - 1)
                pairs[low : min(count, first + 3)] = [pair_work(i) for i in range(low, min(count - 1, first + 2))]
                low = max(0, first - 2)
                windows[low : min(count - 1, first + 3)] = [window(i) for i in range(low, min(count - 2, first + 2))] if windows else []
                continue
            if best_merge is None:
                break
            pick = -best_merge[2]
            works[pick : pick + 2] = [pairs[pick]]
            del starts[pick + 1]
            count -= 1
            # entries overlapping the two old microbatches give way to those overlapping the merged one
            low = max(0, pick - 1)
            pairs[low : min(count, pick + 2)] = [pair_work(i) for i in range(low, min(count - 1, pick + 1))]
            low = max(0, pick - 2)
            windows[low : min(count - 1, pick + 2)] = [window(i) for i in range(low, min(count - 2, pick + 1))] if windows else []
        if len(starts) != target:
            break
        result[target] = np.array(starts, dtype=np.int64)
    return result


def _recut_position(space: RankSpace, first: int, last: int, lowest: int, highest: int) -> int:
    """The cut of a re-cut of ranks first..last within [lowest, highest]: the lowest LCP, then the lighter heavier side,
    then the more even cut, then the leftmost (as :func:`_best_recut`)."""
    cuts = np.arange(lowest, highest + 1)
    values = space.lcp[cuts]
    cuts = cuts[values == values.min()]
    left = space.interval_works(np.full_like(cuts, first), cuts - 1)
    right = space.interval_works(cuts, np.full_like(cuts, last))
    return int(cuts[np.lexsort((cuts, np.abs(left - right), np.maximum(left, right)))[0]])


def _split_chain(space: RankSpace, natural: np.ndarray, above: list[int]) -> dict[int, np.ndarray]:
    n = space.size
    bounds = [(int(a), int(b)) for a, b in zip(natural, partition_ends(natural, n))]
    costs: dict[tuple[int, int], int] = {}
    result: dict[int, np.ndarray] = {}
    for target in above:
        while len(bounds) < target:
            best = None  # (cheapest cut's LCP, -work, position): the cut itself is fixed by the interval
            for position, (first, last) in enumerate(bounds):
                if first == last:
                    continue
                cost = costs.get((first, last))
                if cost is None:
                    cost = costs[(first, last)] = space.index.lcp_min(first + 1, last)
                key = (cost, -space.interval_work(first, last), position)
                if best is None or key < best:
                    best = key
            if best is None:
                break
            position = best[2]
            first, last = bounds[position]
            cut, _ = _best_split(space, first, last)
            bounds[position : position + 1] = [(first, cut - 1), (cut, last)]
        if len(bounds) != target:
            break
        result[target] = np.array([first for first, _ in bounds], dtype=np.int64)
    return result


# ---------------------------------------------------------------------------- refinement
def refine_boundaries(space: RankSpace, capacity: int, starts: np.ndarray, window: int = 8, sweeps: int = 2) -> np.ndarray:
    """Move each cut within ``window`` ranks when that lowers (sum, max) of its two neighbours.

    At most ``sweeps`` left-to-right sweeps; stops after a sweep that moves nothing. Among the
    feasible positions the lowest (sum, max, distance from the current cut, position) wins.
    The windows are a few ranks wide, so plain Python on the prefix sums beats array calls.
    """
    starts = starts.copy()
    n = space.size
    length_prefix = space.length_prefix.tolist()
    lcp_prefix = space.lcp_prefix.tolist()
    # W(a, b) = rising[b] - falling[a]
    rising = [length_prefix[b + 1] - lcp_prefix[b + 1] for b in range(n)]
    falling = [length_prefix[a] - lcp_prefix[a + 1] for a in range(n)]
    cuts = starts.tolist()
    for _ in range(sweeps):
        moved = False
        for i in range(1, len(cuts)):
            first = cuts[i - 1]
            last = cuts[i + 1] - 1 if i + 1 < len(cuts) else n - 1
            current = cuts[i]
            head, tail = -falling[first], rising[last]
            left, right = rising[current - 1] + head, tail - falling[current]
            here = (left + right, max(left, right))
            best = None
            for cut in range(max(first + 1, current - window), min(last, current + window) + 1):
                left, right = rising[cut - 1] + head, tail - falling[cut]
                if left <= capacity and right <= capacity:
                    key = (left + right, max(left, right), abs(cut - current), cut)
                    if best is None or key < best:
                        best = key
            if best is not None and best[:2] < here:
                cuts[i] = best[3]
                moved = True
        if not moved:
            break
    return np.array(cuts, dtype=starts.dtype)
