"""Trie-aware greedy placement (§3.2, Eq. 10), independent of contiguity and of K.

Every open microbatch keeps, for every rank ``r``, its largest member below ``r`` and its
smallest member above ``r`` (``before[m, r]`` / ``after[m, r]``, with ``-1`` and ``N`` for
none). Evaluating Eq. 10 for one trajectory against all open microbatches is then one
gather from each table at the trajectory's rank and one vectorised range-minimum query;
inserting or removing a member rewrites one slice of its microbatch's rows between its
neighbours. The eight (order, policy) plans run in lockstep over one 3-D table each.
When the batch's prefix runs are short (:mod:`harts.planner.run_greedy`, the usual case) the
same placement runs lane by lane with one bisection and one walk over a run per step instead,
and :func:`greedy_choice` finishes only the lanes that can be preselected.

:func:`place_pieces` is the same placement with natural-partition intervals as the unit
(an extension beyond the paper; see :mod:`harts.planner.search`).
"""

from __future__ import annotations

import logging

import attrs
import numpy as np

from harts.planner import run_greedy
from harts.planner.ranks import RankSpace

logger = logging.getLogger(__name__)

ORDERS = ("ascending", "descending", "longest", "unique-suffix")
POLICIES = ("best-fit", "max-shared")


class Packing:
    """Microbatches under construction over the ranks of one batch (one greedy plan).

    Columns ``0 .. used-1`` have been opened; ``alive`` marks those still holding members.
    """

    def __init__(self, space: RankSpace, capacity: int, before: np.ndarray, after: np.ndarray,
                 work: np.ndarray, used: int, labels: np.ndarray):
        self.space = space
        self.capacity = capacity
        self.before = before
        self.after = after
        self.used = used
        self.work = np.where(np.arange(len(work)) < used, work, 0).astype(np.int64)
        self.labels = labels
        self.count = np.bincount(labels[labels >= 0], minlength=len(work)).astype(np.int64)
        self.alive = self.count > 0

    @property
    def live_count(self) -> int:
        return int(self.alive[: self.used].sum())

    def shared_with_open(self, rank: int) -> np.ndarray:
        """|x| - ΔC (Eq. 10) of ``rank`` against every used column; dead columns included."""
        return self.space.neighbour_shared(rank, self.before[: self.used, rank], self.after[: self.used, rank])

    def insert(self, rank: int, column: int) -> None:
        before, after = int(self.before[column, rank]), int(self.after[column, rank])
        shared = self.space.neighbour_shared(rank, np.array([before]), np.array([after]))[0]
        self.before[column, rank + 1 : after + 1] = rank
        self.after[column, max(before, 0) : rank] = rank
        self.work[column] += self.space.lengths[rank] - shared
        self.count[column] += 1
        self.labels[rank] = column

    def insert_run(self, first: int, last: int, column: int, delta: int) -> None:
        """Insert ranks ``first..last``, none of whose range holds a member of ``column``; ``delta`` is its ΔC."""
        before, after = int(self.before[column, first]), int(self.after[column, last])
        self.before[column, first + 1 : last + 1] = np.arange(first, last, dtype=self.before.dtype)
        self.before[column, last + 1 : after + 1] = last
        self.after[column, first:last] = np.arange(first + 1, last + 1, dtype=self.after.dtype)
        self.after[column, max(before, 0) : first] = first
        self.work[column] += delta
        self.count[column] += last - first + 1
        self.labels[first : last + 1] = column

    def remove(self, rank: int) -> None:
        column = int(self.labels[rank])
        before, after = int(self.before[column, rank]), int(self.after[column, rank])
        shared = self.space.neighbour_shared(rank, np.array([before]), np.array([after]))[0]
        self.before[column, rank + 1 : after + 1] = before
        self.after[column, max(before, 0) : rank] = after
        self.work[column] -= self.space.lengths[rank] - shared
        self.count[column] -= 1
        self.labels[rank] = -1

    def open(self, rank: int) -> int:
        """Start a new microbatch holding ``rank``; reuses an emptied column when there is one."""
        empty = np.flatnonzero(~self.alive[: self.used])
        if empty.size:
            column = int(empty[0])
        else:
            if self.used == self.work.shape[0]:
                self._grow()
            column = self.used
            self.used += 1
        self.alive[column] = True
        self.insert(rank, column)
        return column

    def _grow(self) -> None:
        extra = self.work.shape[0]
        n = self.space.size
        self.before = np.concatenate([self.before, np.full((extra, n), -1, dtype=self.before.dtype)])
        self.after = np.concatenate([self.after, np.full((extra, n), n, dtype=self.after.dtype)])
        self.work = np.concatenate([self.work, np.zeros(extra, dtype=np.int64)])
        self.count = np.concatenate([self.count, np.zeros(extra, dtype=np.int64)])
        self.alive = np.concatenate([self.alive, np.zeros(extra, dtype=bool)])

    def total_work(self) -> int:
        return int(self.work[: self.used][self.alive[: self.used]].sum())

    def canonical_labels(self) -> np.ndarray:
        return canonical_labels(self.labels)


def canonical_labels(labels: np.ndarray) -> np.ndarray:
    """Relabel groups 0..K-1 in order of their smallest rank."""
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    renumber = np.empty(len(first), dtype=np.int64)
    renumber[np.argsort(first, kind="stable")] = np.arange(len(first))
    return renumber[inverse.reshape(-1)]


def unique_suffix(space: RankSpace) -> np.ndarray:
    """u(x) = |x| - max(LCP with its global lexicographic neighbours), by rank."""
    padded = np.append(space.lcp, 0)
    return space.lengths - np.maximum(padded[:-1], padded[1:])


def processing_order(space: RankSpace, name: str) -> np.ndarray:
    ranks = np.arange(space.size)
    if name == "ascending":
        return ranks
    if name == "descending":
        return ranks[::-1].copy()
    if name == "longest":
        return np.lexsort((ranks, -space.lengths))
    if name == "unique-suffix":
        return np.lexsort((ranks, -unique_suffix(space)))
    raise ValueError(f"unknown greedy processing order {name!r}; known: {', '.join(ORDERS)}")


def place_all(space: RankSpace, capacity: int, lanes: list[tuple[np.ndarray, str]], columns: int = 16,
              memory_budget: int = 1 << 29) -> list[Packing]:
    """Greedy placement for several (order, policy) lanes at once.

    Each lane inserts its trajectories in its own order into the open microbatch its
    policy prefers, or opens a new one when none can take it. best-fit: the feasible
    microbatch heaviest after insertion. max-shared: the feasible microbatch sharing the
    most tokens with the trajectory, ties to the heaviest after insertion.

    Lanes advance in lockstep so each step evaluates Eq. 10 for every lane and every open
    microbatch in one set of array operations; lanes are processed in groups whose
    neighbour tables fit ``memory_budget`` bytes.
    """
    for _, policy in lanes:
        if policy not in POLICIES:
            raise ValueError(f"unknown greedy placement policy {policy!r}; known: {', '.join(POLICIES)}")
    per_lane = 2 * 4 * space.size * max(columns, 1)
    group = max(1, min(len(lanes), memory_budget // per_lane))
    packings = []
    for first in range(0, len(lanes), group):
        packings.extend(_place_group(space, capacity, lanes[first : first + group], columns))
    return packings


def _place_group(space: RankSpace, capacity: int, lanes: list[tuple[np.ndarray, str]], columns: int) -> list[Packing]:
    if run_greedy.runs_fit(space):
        return _place_group_runs(space, capacity, lanes)
    pairs = space.pair_table()
    if pairs is None:
        return _place_group_ranges(space, capacity, lanes, columns)
    return _place_group_pairs(space, capacity, lanes, columns, pairs)


def _place_group_runs(space: RankSpace, capacity: int, lanes: list[tuple[np.ndarray, str]]) -> list[Packing]:
    """:func:`place_all` lane by lane over prefix runs (:mod:`harts.planner.run_greedy`; the same plans)."""
    return [_placed_packing(space, capacity, labels, works) for labels, works in run_greedy.place_lanes(space, capacity, lanes)]


def _placed_packing(space: RankSpace, capacity: int, labels: np.ndarray, works: np.ndarray) -> Packing:
    """The packing of a finished placement: ``labels`` by rank, ``works`` by column (every column opened)."""
    dtype = np.int16 if space.size < np.iinfo(np.int16).max else np.int32
    # room for a few more microbatches (DP alignment opens some) before the tables grow
    before, after = neighbour_tables_by_column(labels, len(works) + 8, dtype)
    return Packing(space, capacity, before, after, np.append(works, np.zeros(8, dtype=np.int64)), len(works), labels)


def neighbour_tables_by_column(labels: np.ndarray, columns: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_neighbour_tables_from_labels` built column by column (``(columns, N)`` arrays of the same values).

    A column's ``before`` row is -1 up to its first member, then each member repeated up to the next one;
    its ``after`` row each member repeated over the ranks below it down to the previous one, then N: one
    ``np.repeat`` for every column at once instead of a cumulative extremum over every rank and column.
    """
    n = labels.size
    members = np.lexsort((np.arange(n), labels))  # by (column, rank)
    column_of = labels[members]
    counts = np.bincount(labels, minlength=columns)
    starts = np.concatenate([[0], np.cumsum(counts)])
    position = np.arange(n)
    first = position == starts[column_of]
    last = position == starts[column_of + 1] - 1
    empty = counts == 0
    lowest = np.where(empty, n, members[np.minimum(starts[:-1], max(n - 1, 0))] if n else n)
    highest = np.where(empty, 0, members[np.maximum(starts[1:] - 1, 0)] if n else 0)
    values = np.empty(n + columns, dtype=dtype)
    repeats = np.empty(n + columns, dtype=np.int64)
    # before: per column a head of -1, then its members
    head, member = starts[:-1] + np.arange(columns), position + column_of + 1
    values[head], repeats[head] = -1, np.where(empty, n, lowest + 1)
    values[member], repeats[member] = members, np.where(last, n - 1 - members, np.append(members[1:], n)[:n] - members)
    before = np.repeat(values, repeats).reshape(columns, n)
    # after: per column its members, then a tail of N
    member, tail = position + column_of, starts[1:] + np.arange(columns)
    values[member], repeats[member] = members, members - np.where(first, 0, np.append(0, members[:-1])[:n])
    values[tail], repeats[tail] = n, np.where(empty, n, n - highest)
    after = np.repeat(values, repeats).reshape(columns, n)
    return before, after


def _neighbour_tables_from_labels(labels: np.ndarray, columns: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """``before[c, r]`` / ``after[c, r]``: the largest member of ``c`` below ``r`` / smallest above (-1 / N if none).

    Built rank-major (cumulative max/min down the ranks, one row per rank) and returned as
    ``(columns, N)`` views.
    """
    n = labels.size
    before = np.full((n, columns), -1, dtype=dtype)
    after = np.full((n, columns), n, dtype=dtype)  # row n-1-r holds rank r
    if n > 1:
        ranks = np.arange(n, dtype=dtype)
        before[ranks[1:], labels[:-1]] = ranks[:-1]
        after[n - 1 - ranks[:-1], labels[1:]] = ranks[1:]
        np.maximum.accumulate(before, axis=0, out=before)
        np.minimum.accumulate(after, axis=0, out=after)
    return before.T, after[::-1].T


def _place_group_pairs(space: RankSpace, capacity: int, lanes: list[tuple[np.ndarray, str]], columns: int,
                       pairs: np.ndarray) -> list[Packing]:
    """:func:`place_all` with Eq. 10's two LCPs read from the all-pairs table (same plans, fewer operations).

    A lane in ascending rank order always inserts above every member, so each microbatch's
    only neighbour is its largest member (and in descending order its smallest); those lanes
    keep one rank per microbatch, in the rows of ``neighbours`` that persist from step to step.
    Other lanes keep the full ``before``/``after`` tables, rank major (``table[lane, rank,
    before/after, column]``), and copy the row of the rank they insert into ``neighbours`` each
    step. Every step is then a fixed set of whole-array operations over all lanes (the greedy is
    sequential in its steps, so the per-step operation count is its cost): only the tabled lanes'
    slice updates and opening a microbatch loop over lanes. The tables of the ordered lanes are
    rebuilt from the labels at the end.
    """
    n = space.size
    kinds = _lane_kinds(lanes, n)
    internal = sorted(range(len(lanes)), key=lambda lane: kinds[lane] == 2)  # ordered lanes first, stable
    count = len(lanes)
    ordered = sum(kind < 2 for kind in kinds)
    state = _PairLanes(space, capacity, [lanes[lane] for lane in internal], [kinds[lane] for lane in internal], ordered,
                       columns, pairs)
    for step in range(n):
        state.step(step)
    return _pair_packings(space, capacity, internal, ordered, state.columns, state.table, state.work, state.used,
                          state.labels, state.dtype)


class _PairLanes:
    """The state of :func:`_place_group_pairs`' lanes (ordered lanes first) and one lockstep step of all of them."""

    def __init__(self, space: RankSpace, capacity: int, lanes: list[tuple[np.ndarray, str]], kinds: list[int], ordered: int,
                 columns: int, pairs: np.ndarray):
        n = space.size
        self.n, self.capacity, self.ordered = n, capacity, ordered
        self.count = count = len(lanes)
        self.tabled = count - ordered
        self.lengths = space.lengths
        orders = np.stack([order for order, _ in lanes])
        self.orders = orders.T.copy()  # [step, lane]
        self.multiplier = np.array([0 if policy == "best-fit" else capacity + 1 for _, policy in lanes], dtype=np.int64)[:, None]
        self.dtype = np.int16 if n < np.iinfo(np.int16).max else np.int32
        self.unopened = np.int64(1) << np.int64(40)  # an unopened column can take nothing
        self.columns = 0
        self.neighbours = np.empty((count, 2, 0), dtype=self.dtype)
        self.table = np.empty((self.tabled, n, 2, 0), dtype=self.dtype)
        self.work = np.empty((count, 0), dtype=np.int64)
        self._widen(columns)
        self.labels = np.full((count, n), -1, dtype=np.int64)
        self.used = [0] * count
        self.widest = 0
        self.lane_ids = np.arange(count)
        self.ordered_ids = np.arange(ordered)
        self.ordered_kinds = np.array(kinds[:ordered], dtype=np.int64)
        self.tabled_ids = np.arange(ordered, count)
        self.flat_pairs = pairs.reshape(-1)
        # per step: the flat offset of each lane's row in the pair table, the inserted length, and the flat row of
        # each tabled lane's inserted rank in its table
        self.row_offsets = (self.orders * (n + 1))[:, :, None, None]
        self.step_lengths = self.lengths[self.orders][:, :, None]
        self.tabled_rows = (np.arange(self.tabled)[None, :] * n + self.orders[:, ordered:]).copy()

    def _widen(self, columns: int) -> None:
        """Room for ``columns`` microbatches per lane; new columns have no members (-1 / N neighbours)."""
        old = self.columns
        neighbours = np.empty((self.count, 2, columns), dtype=self.dtype)
        neighbours[:, 0], neighbours[:, 1] = -1, self.n
        neighbours[:, :, :old] = self.neighbours
        table = np.empty((self.tabled, self.n, 2, columns), dtype=self.dtype)
        table[:, :, 0], table[:, :, 1] = -1, self.n
        table[:, :, :, :old] = self.table
        work = np.full((self.count, columns), self.unopened, dtype=np.int64)
        work[:, :old] = self.work
        self.neighbours, self.table, self.work, self.columns = neighbours, table, work, columns
        self.flat_table = table.reshape(self.tabled * self.n, 2, columns)

    def step(self, step: int) -> None:
        ordered, lane_ids = self.ordered, self.lane_ids
        width = max(self.widest, 1)
        if self.tabled:
            self.flat_table.take(self.tabled_rows[step], axis=0, out=self.neighbours[ordered:])
        # max(LCP(p, x), LCP(x, q)) for every lane and open column: |x| - ΔC of Eq. 10
        shared = self.flat_pairs.take(self.neighbours[:, :, :width] + self.row_offsets[step]).max(axis=1)
        work_after = self.work[:, :width] - shared
        work_after += self.step_lengths[step]
        # best-fit ranks by the work after insertion; max-shared by shared tokens, then that work
        score = shared * self.multiplier
        score += work_after
        score[work_after > self.capacity] = -1
        choice = score.argmax(axis=1)
        new_work = work_after[lane_ids, choice]
        ranks = self.orders[step]
        if score[lane_ids, choice].min() < 0:
            self._open(np.flatnonzero(score[lane_ids, choice] < 0).tolist(), ranks, choice, new_work)
        self.work[lane_ids, choice] = new_work
        self.labels[lane_ids, ranks] = choice
        if ordered:
            self.neighbours[self.ordered_ids, self.ordered_kinds, choice[:ordered]] = ranks[:ordered]
        if self.tabled:
            tabled_choice = choice[ordered:]
            lows = self.neighbours[self.tabled_ids, 0, tabled_choice].tolist()
            highs = self.neighbours[self.tabled_ids, 1, tabled_choice].tolist()
            table = self.table
            for lane, rank, column, low, high in zip(range(self.tabled), ranks[ordered:].tolist(), tabled_choice.tolist(), lows, highs):
                table[lane, rank + 1 : high + 1, 0, column] = rank
                table[lane, max(low, 0) : rank, 1, column] = rank

    def _open(self, lanes: list[int], ranks: np.ndarray, choice: np.ndarray, new_work: np.ndarray) -> None:
        """Lanes whose trajectory fits no open microbatch open a new one (its neighbours: none)."""
        for lane in lanes:
            column = self.used[lane]
            self.used[lane] += 1
            if column == self.columns:
                self._widen(2 * self.columns)
            choice[lane] = column
            new_work[lane] = self.lengths[ranks[lane]]
        self.widest = max(self.used)


def _lane_kinds(lanes: list[tuple[np.ndarray, str]], n: int) -> list[int]:
    """Each lane's order: 0 ascending ranks, 1 descending, 2 any other."""
    ascending = np.arange(n)
    return [0 if np.array_equal(order, ascending) else 1 if np.array_equal(order, ascending[::-1]) else 2 for order, _ in lanes]


def _pair_packings(space: RankSpace, capacity: int, internal: list[int], ordered: int, columns: int, table: np.ndarray,
                   work: np.ndarray, used: list[int], labels: np.ndarray, dtype) -> list[Packing]:
    """The packings of :func:`_place_group_pairs`' lanes, in the callers' lane order (``internal`` maps back); the
    ordered lanes' neighbour tables are rebuilt from their labels."""
    packings: list[Packing | None] = [None] * len(internal)
    for position, lane in enumerate(internal):
        if position < ordered:
            # room for a few more microbatches (DP alignment opens some) before the tables grow
            width = min(columns, used[position] + 8)
            before, after = _neighbour_tables_from_labels(labels[position], width, dtype)
            packings[lane] = Packing(space, capacity, before, after, work[position, :width], used[position], labels[position])
        else:
            before, after = table[position - ordered, :, 0].T, table[position - ordered, :, 1].T
            packings[lane] = Packing(space, capacity, before, after, work[position], used[position], labels[position])
    return packings


def _place_group_ranges(space: RankSpace, capacity: int, lanes: list[tuple[np.ndarray, str]], columns: int) -> list[Packing]:
    """Lockstep placement with range-minimum queries (used when the pair table would be too large)."""
    n = space.size
    count = len(lanes)
    orders = np.stack([order for order, _ in lanes])
    best_fit = np.array([policy == "best-fit" for _, policy in lanes])[:, None]
    before = np.full((count, columns, n), -1, dtype=np.int32)
    after = np.full((count, columns, n), n, dtype=np.int32)
    unopened = np.int64(1) << np.int64(40)  # an unopened column can take nothing
    work = np.full((count, columns), unopened, dtype=np.int64)
    labels = np.full((count, n), -1, dtype=np.int64)
    used = [0] * count
    lane_ids = np.arange(count)
    lengths = space.lengths
    scale = np.int64(capacity) + 1
    # No microbatch can give x more than its global neighbours do, so a column with less
    # slack than u(x) cannot take x: evaluate Eq. 10 only on the columns that might.
    least_cost = unique_suffix(space)
    lane_best_fit = best_fit[:, 0]
    for step in range(n):
        ranks = orders[:, step]
        width = max(max(used), 1)
        open_work = work[:, :width]
        lane_of, column_of = np.nonzero(open_work <= (capacity - least_cost[ranks])[:, None])
        score = np.full((count, width), -1, dtype=np.int64)
        if lane_of.size:
            rank_of = ranks[lane_of]
            flat = (lane_of * before.shape[1] + column_of) * n + rank_of
            shared = np.maximum(space.range_min(before.reshape(-1).take(flat) + 1, rank_of),
                                space.range_min(rank_of + 1, after.reshape(-1).take(flat)))
            work_after = open_work[lane_of, column_of] + (lengths[rank_of] - shared)
            # best-fit ranks by the work after insertion; max-shared by shared tokens, then that work
            lane_score = np.where(lane_best_fit[lane_of], work_after, shared * scale + work_after)
            score[lane_of, column_of] = np.where(work_after <= capacity, lane_score, -1)
        choice = score.argmax(axis=1)
        best = score[lane_ids, choice]
        # both scores end in the work after insertion, modulo ``scale``
        gained = np.where(best >= 0, best % scale - work[lane_ids, choice], lengths[ranks]).tolist()
        for lane, rank, column, fits, delta in zip(range(count), ranks.tolist(), choice.tolist(), (best >= 0).tolist(), gained):
            if not fits:
                column = used[lane]
                used[lane] += 1
                if column == before.shape[1]:
                    before = np.concatenate([before, np.full_like(before, -1)], axis=1)
                    after = np.concatenate([after, np.full_like(after, n)], axis=1)
                    work = np.concatenate([work, np.full_like(work, unopened)], axis=1)
                work[lane, column] = 0
            low = int(before[lane, column, rank])
            high = int(after[lane, column, rank])
            before[lane, column, rank + 1 : high + 1] = rank
            after[lane, column, max(low, 0) : rank] = rank
            work[lane, column] += delta
            labels[lane, rank] = column
    return [Packing(space, capacity, before[lane], after[lane], work[lane], used[lane], labels[lane]) for lane in range(count)]


def place_pieces(space: RankSpace, capacity: int, starts: np.ndarray, policy: str) -> Packing:
    """Greedy placement of contiguous rank intervals (pieces), heaviest first.

    The unit is a piece of a contiguous partition (the natural partition) instead of one
    trajectory: a piece ``[a, b]`` that lands between members ``p`` and ``q`` of a
    microbatch costs ``W(a, b) - LCP(p, a) - LCP(b, q) + LCP(p, q)``, which is Eq. 10
    with the piece in place of ``x``. Policies are those of :func:`place_all`.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown greedy placement policy {policy!r}; known: {', '.join(POLICIES)}")
    n = space.size
    ends = np.append(starts[1:] - 1, n - 1)
    works = space.interval_works(starts, ends)
    # room for twice the microbatches the whole batch needs (the tables grow if that is short): one
    # column per piece would make the tables pieces x N, quadratic when pieces are single trajectories
    columns = min(len(starts), max(16, 2 * -(-space.interval_work(0, n - 1) // capacity) + 8))
    packing = Packing(space, capacity, np.full((columns, n), -1, dtype=np.int32), np.full((columns, n), n, dtype=np.int32),
                      np.zeros(columns, dtype=np.int64), 0, np.full(n, -1, dtype=np.int64))
    scale = np.int64(capacity) + 1
    pairs = space.pair_table()
    # a piece that is a whole prefix run (a whole tree, in the unit partition) shares exactly the floor with every
    # nonempty microbatch, whatever its neighbours there (see RankSpace.prefix_runs), so Eq. 10 is work - floor
    floor, run_firsts, run_lasts = space.prefix_runs()
    whole_run = ((run_firsts[starts] == starts) & (run_lasts[starts] == ends)).tolist()
    for piece in np.lexsort((starts, -works)).tolist():
        first, last, work = int(starts[piece]), int(ends[piece]), int(works[piece])
        if packing.used:
            if whole_run[piece]:
                delta = np.full(packing.used, work - floor, dtype=np.int64)
            else:
                below = packing.before[: packing.used, first].astype(np.int64)
                above = packing.after[: packing.used, last].astype(np.int64)
                if pairs is not None:  # Eq. 10 for the piece: LCP(p, a), LCP(b, q), LCP(p, q) from the pair table
                    delta = work - pairs[first, below].astype(np.int64) - pairs[last, above] + pairs[below, above]
                else:
                    delta = (work - space.range_min(below + 1, np.full_like(below, first))
                             - space.range_min(np.full_like(above, last + 1), above) + space.range_min(below + 1, above))
            work_after = packing.work[: packing.used] + delta
            feasible = work_after <= capacity
            if feasible.any():
                score = work_after if policy == "best-fit" else (work - delta) * scale + work_after
                column = int(np.where(feasible, score, -1).argmax())
                packing.insert_run(first, last, column, int(delta[column]))
                continue
        if packing.used == packing.work.shape[0]:
            packing._grow()
        column = packing.used
        packing.used += 1
        packing.alive[column] = True
        packing.insert_run(first, last, column, work)
    return packing


def eliminate_small(packing: Packing) -> Packing:
    """Dissolve microbatches filled to at most half capacity whose members all fit elsewhere.

    Members move, longest first, to the feasible microbatch with the smallest ΔC (ties: the
    heaviest after insertion). A dissolution that cannot place every member is undone.
    """
    capacity = packing.capacity
    lengths = packing.space.lengths
    scale = np.int64(2 * capacity + 2)
    never = np.iinfo(np.int64).max
    columns = [c for c in np.lexsort((np.arange(packing.used), packing.work[: packing.used])).tolist() if packing.alive[c]]
    for column in columns:
        if not packing.alive[column] or packing.work[column] * 2 > capacity or packing.live_count <= 1:
            continue
        members = np.flatnonzero(packing.labels == column)
        members = members[np.lexsort((members, -lengths[members]))].tolist()
        packing.alive[column] = False
        moved: list[int] = []
        for rank in members:
            packing.remove(rank)
            delta = lengths[rank] - packing.shared_with_open(rank)
            work_after = packing.work[: packing.used] + delta
            feasible = (work_after <= capacity) & packing.alive[: packing.used]
            if not feasible.any():
                packing.insert(rank, column)
                for placed in reversed(moved):
                    packing.remove(placed)
                    packing.insert(placed, column)
                packing.alive[column] = True
                break
            packing.insert(rank, int(np.where(feasible, delta * scale - work_after, never).argmin()))
            moved.append(rank)
    return packing


def align_to_dp(packing: Packing, dp_size: int) -> Packing | None:
    """Raise K to a multiple of D by moving single trajectories out to new microbatches.

    Each split takes the trajectory whose removal duplicates the fewest tokens (the
    tokens it shares with its neighbours in its microbatch), ties to the heavier
    microbatch then the lowest rank. None when there are too few trajectories.
    """
    missing = -packing.live_count % dp_size
    if packing.live_count + missing > packing.space.size:
        return None
    for _ in range(missing):
        ranks = np.flatnonzero(packing.labels >= 0)
        columns = packing.labels[ranks]
        movable = packing.count[columns] > 1
        ranks, columns = ranks[movable], columns[movable]
        shared = packing.space.neighbour_shared(ranks, packing.before[columns, ranks], packing.after[columns, ranks])
        pick = np.lexsort((ranks, -packing.work[columns], shared))[0]
        rank = int(ranks[pick])
        packing.remove(rank)
        packing.open(rank)
    return packing


@attrs.frozen
class GreedyPlan:
    labels: np.ndarray = attrs.field(eq=False)
    count: int
    total_work: int
    source: str


def greedy_plans(space: RankSpace, capacity: int, dp_size: int) -> list[GreedyPlan]:
    """The eight order x policy plans, each after elimination and DP alignment (failures dropped)."""
    # Room for twice the bins the whole-batch trie needs; the tables grow if that is short.
    columns = min(space.size, max(16, 2 * -(-space.interval_work(0, space.size - 1) // capacity) + 8))
    names = [(order_name, policy) for order_name in ORDERS for policy in POLICIES]
    lanes = [(processing_order(space, order_name), policy) for order_name, policy in names]
    plans = []
    for (order_name, policy), packing in zip(names, place_all(space, capacity, lanes, columns)):
        packing = align_to_dp(eliminate_small(packing), dp_size)
        if packing is None:
            logger.debug("greedy %s/%s: cannot align K to D=%d", order_name, policy, dp_size)
            continue
        plans.append(GreedyPlan(packing.canonical_labels(), packing.live_count, packing.total_work(), f"greedy/{order_name}/{policy}"))
    return plans


def greedy_choice(space: RankSpace, capacity: int, dp_size: int) -> GreedyPlan | None:
    """``preselect(greedy_plans(space, capacity, dp_size))``, finishing only the lanes that can win.

    A microbatch more than half full is never dissolved by :func:`eliminate_small` and alignment only
    adds microbatches, so a placement with ``h`` of them ends with at least ``h`` rounded up to a
    multiple of D. Once a lane is finished with K microbatches (a multiple of D), a later lane that
    gets more than K microbatches over half full cannot be preselected: its placement stops there
    (works only grow while placing). A lane placed exactly as an earlier one gives the earlier one's
    plan, which wins the tie. Neither is finished (placing and the neighbour tables are a lane's
    cost), so the choice is the same. Batches with a run beyond :data:`run_greedy.RUN_LIMIT`
    finish every lane.
    """
    if not run_greedy.runs_fit(space):
        return preselect(greedy_plans(space, capacity, dp_size))
    placer = run_greedy.RunPlacer(space, capacity)
    best: GreedyPlan | None = None
    seen: set = set()
    for order_name in ORDERS:
        order = processing_order(space, order_name)
        for policy in POLICIES:
            key = placer.key(order, policy)
            if key in seen:
                continue
            seen.add(key)
            placed = placer.place(order, policy, None if best is None else best.count)
            if placed is None or placed[0].tobytes() in seen:
                continue
            seen.add(placed[0].tobytes())
            packing = align_to_dp(eliminate_small(_placed_packing(space, capacity, *placed)), dp_size)
            if packing is not None:
                plan = GreedyPlan(packing.canonical_labels(), packing.live_count, packing.total_work(), f"greedy/{order_name}/{policy}")
                if best is None or (plan.count, plan.total_work) < (best.count, best.total_work):
                    best = plan
    return best


def piece_plans(space: RankSpace, capacity: int, dp_size: int, starts: np.ndarray, name: str = "pieces") -> list[GreedyPlan]:
    """Both policies over the pieces of a contiguous partition, after elimination and DP alignment."""
    plans = []
    for policy in POLICIES:
        packing = align_to_dp(eliminate_small(place_pieces(space, capacity, starts, policy)), dp_size)
        if packing is not None:
            plans.append(GreedyPlan(packing.canonical_labels(), packing.live_count, packing.total_work(), f"{name}/{policy}"))
    return plans


def preselect(plans: list[GreedyPlan]) -> GreedyPlan | None:
    """The greedy candidate: fewest microbatches, then least total work, then first generated."""
    if not plans:
        return None
    return min(enumerate(plans), key=lambda item: (item[1].count, item[1].total_work, item[0]))[1]
