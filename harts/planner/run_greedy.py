"""The trajectory greedy of :mod:`harts.planner.greedy` one lane at a time, by prefix runs (same plans, less work).

Let ``floor`` be the smallest LCP of two rank-adjacent trajectories and cut the ranks into
*runs* wherever the adjacent LCP equals it (a batch's trees when they share at most a common
system prompt; single trajectories when nothing is shared beyond it). Two ranks in different
runs have LCP exactly ``floor`` (a cut lies between them and no adjacent LCP is smaller), and
two ranks in one run have more. So for a trajectory ``x`` Eq. 10 takes only two forms:

* a microbatch with no member in ``x``'s run shares exactly ``floor`` tokens with ``x``, so
  among those the best-fit choice is the heaviest one at most ``capacity - |x| + floor``: one
  bisection in the microbatches kept sorted by (work, lowest index);
* a microbatch with a member in the run shares more: the most ``x`` shares with one of its
  members there, which is that of its member nearest to ``x`` in rank order on either side (the
  LCP of two ranks only falls as they move apart). One bisection per such microbatch in its
  members' sorted offsets in the run, with ``x``'s row of LCPs inside the run (from the pair
  table, or running minima of the adjacent LCPs without it), finds every one that can still take
  ``x``; one that cannot, cannot take it sharing only the floor either, so the bisection never
  returns it.

A step then costs a bisection per microbatch holding members of the run, and one in all
microbatches, instead of the lockstep's array
operations over every open microbatch, and the lanes run one by one in plain Python. Runs are
bounded by :data:`RUN_LIMIT`; a batch with a larger run keeps the lockstep (``harts.planner.greedy``).
A lane can be stopped once it has more microbatches over half full than a given bound
(:func:`harts.planner.greedy.greedy_choice` uses that to drop lanes that cannot be preselected).
Lanes that must give the same plan are placed once: equal orders (the longest-first and
unique-suffix orders coincide when nothing is shared beyond the floor) and, when no run holds
two trajectories, both policies (every open microbatch then shares exactly ``floor`` tokens,
so max-shared ranks as best-fit does).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort

import numpy as np

from harts.planner.ranks import RankSpace

#: the largest run (trajectories) the lane placement handles; larger runs keep the lockstep placement
RUN_LIMIT = 256
#: the LCP rows of a batch's runs are kept across lanes when they hold at most this many entries together
KEPT_ROW_ENTRIES = 1 << 22
#: a sorted key packs a microbatch's work above its column, inverted so that equal works sort the lowest column last
_COLUMN_BITS = 32
_COLUMN_MASK = (1 << _COLUMN_BITS) - 1


def runs_fit(space: RankSpace) -> bool:
    """Whether every run is small enough for :func:`place_lanes`."""
    _, firsts, lasts = space.prefix_runs()
    return int((lasts - firsts).max(initial=0)) < RUN_LIMIT


def place_lanes(space: RankSpace, capacity: int, lanes: list[tuple[np.ndarray, str]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(labels, works)`` of every lane (column ``c`` holds work ``works[c]``), as the lockstep places them."""
    placer = RunPlacer(space, capacity)
    results = []
    for order, policy in lanes:
        labels, works = placer.place(order, policy)
        results.append((labels.copy(), works.copy()))
    return results


class RunPlacer:
    """Places lanes of one batch one at a time (see the module docstring); a lane placed exactly as an earlier
    one (the same order, and the same policy where policies can differ) is not placed again."""

    def __init__(self, space: RankSpace, capacity: int):
        floor, firsts, lasts = space.prefix_runs()
        self.alone = bool((lasts == firsts).all())
        self.context = (capacity, space.lengths.tolist(), floor, np.cumsum(firsts == np.arange(space.size)).tolist(),
                        firsts.tolist(), _RunRows(space, firsts, lasts))
        self.capacity = capacity
        self.placed: dict[tuple[bytes, bool], tuple[np.ndarray, np.ndarray] | None] = {}

    def key(self, order: np.ndarray, policy: str) -> tuple[bytes, bool]:
        """Lanes of equal keys are placed alike."""
        return np.ascontiguousarray(order).tobytes(), policy == "max-shared" and not self.alone

    def place(self, order: np.ndarray, policy: str, most_half_full: int | None = None):
        """``(labels, works)`` of the lane, or None once more than ``most_half_full`` microbatches are over half full
        (works only grow while placing, so the finished placement would have more too)."""
        key = self.key(order, policy)
        if key not in self.placed:
            placed = _place_lane(order.tolist(), key[1], *self.context,
                                 most_half_full=len(order) if most_half_full is None else most_half_full)
            self.placed[key] = None if placed is None else tuple(np.array(part, dtype=np.int64) for part in placed)
        return self.placed[key]


class _RunRows:
    """LCP of a rank with every rank of its run, as a list indexed from the run's first rank."""

    def __init__(self, space: RankSpace, firsts: np.ndarray, lasts: np.ndarray):
        self.lcp = space.lcp
        self.pairs = space.pair_table()
        self.firsts, self.lasts = firsts.tolist(), lasts.tolist()
        # rows are kept for the other lanes while all of them together stay small
        self.rows: dict[int, list[int]] = {}
        self.keep = int((lasts - firsts + 1).sum()) <= KEPT_ROW_ENTRIES
        if self.pairs is not None and self.keep:
            # the rows of a run of two or more are its diagonal block of the pair table: one slice per run, not
            # one per rank (a trajectory alone in its run never reads its row)
            heads = np.flatnonzero((firsts == np.arange(firsts.size)) & (lasts > firsts))
            for head, last in zip(heads.tolist(), lasts[heads].tolist()):
                self.rows.update(zip(range(head, last + 1), self.pairs[head : last + 1, head : last + 1].tolist()))

    def __call__(self, x: int) -> list[int]:
        row = self.rows.get(x)
        if row is None:
            row = self._row(x)
            if self.keep:
                self.rows[x] = row
        return row

    def _row(self, x: int) -> list[int]:
        first, last = self.firsts[x], self.lasts[x]
        if self.pairs is not None:
            return self.pairs[x, first : last + 1].tolist()
        # LCP(x, r) is the minimum adjacent LCP between them: running minima outward from x
        below = np.minimum.accumulate(self.lcp[x:first:-1])[::-1].tolist()
        above = np.minimum.accumulate(self.lcp[x + 1 : last + 1]).tolist()
        return below + [0] + above


def _place_lane(order: list[int], max_shared: bool, capacity: int, lengths: list[int], floor: int, run_of: list[int],
                firsts: list[int], run_rows: _RunRows, most_half_full: int) -> tuple[list[int], list[int]] | None:
    """One lane of the lockstep greedy (:func:`harts.planner.greedy.place_all`): best-fit takes the feasible
    column heaviest after insertion, max-shared the one sharing most, then heaviest; ties to the lowest column.
    None as soon as more than ``most_half_full`` columns hold more than half the capacity.

    The loop runs once per trajectory per lane, so the ranking keys are compared field by field instead of as
    tuples built per candidate, and a run's cached LCP rows are read from the dict directly: on the agentic
    bench shape (runs of 16 trajectories on average, 12 of them placed when one comes, in 1.5 columns) the
    lanes took a quarter less time than with one pass over the run's placed members."""
    half_full = 0
    labels = [-1] * len(lengths)
    works: list[int] = []
    keys: list[int] = []  # (work << bits) | (mask - column), ascending
    # per run: column -> the offsets in the run of its placed members there, ascending
    placed: list[dict[int, list[int]]] = [{} for _ in range(run_of[-1])]
    cached_rows = run_rows.rows
    for x in order:
        length, offset = lengths[x], x - firsts[x]
        in_run = placed[run_of[x] - 1]
        # column -> tokens shared with x, for every column with a member in x's run that can take x: the most x
        # shares with one of its members. A column that cannot take x with what it shares cannot take it sharing
        # only the floor either, so the bisection below never returns it: it is left out. LCP(x, r) only falls as
        # r moves away from x in rank order, so a column's most is that of its nearest member on either side
        shared: dict[int, int] = {}
        if in_run:
            row = cached_rows.get(x)
            if row is None:
                row = run_rows(x)
            slack = capacity - length
            for column, offsets in in_run.items():
                at = bisect_left(offsets, offset)
                if at == 0:
                    tokens = row[offsets[0]]
                elif at == len(offsets):
                    tokens = row[offsets[-1]]
                else:
                    tokens = max(row[offsets[at - 1]], row[offsets[at]])
                if tokens + slack >= works[column]:
                    shared[column] = tokens
        # the best so far ranks by (tokens, after, -column) under max-shared, by (after, -column) under best-fit
        choice = best_tokens = best_after = -1
        for column, tokens in shared.items():
            after = works[column] + length - tokens
            if max_shared and tokens != best_tokens:
                better = tokens > best_tokens
            else:
                better = after > best_after or (after == best_after and column < choice)
            if better:
                choice, best_tokens, best_after = column, tokens, after
        if choice < 0 or not max_shared:
            # the heaviest column sharing only the floor that still fits; skip those of the run (evaluated above)
            position = bisect_right(keys, ((capacity - length + floor) << _COLUMN_BITS) | _COLUMN_MASK) - 1
            while position >= 0 and _COLUMN_MASK - (keys[position] & _COLUMN_MASK) in shared:
                position -= 1
            if position >= 0:
                column = _COLUMN_MASK - (keys[position] & _COLUMN_MASK)
                after = (keys[position] >> _COLUMN_BITS) + length - floor
                if choice < 0 or after > best_after or (after == best_after and column < choice):
                    choice = column
        was_half_full = False
        if choice < 0:
            choice = len(works)
            works.append(length)
        else:
            was_half_full = 2 * works[choice] > capacity
            del keys[bisect_left(keys, (works[choice] << _COLUMN_BITS) | (_COLUMN_MASK - choice))]
            works[choice] += length - shared.get(choice, floor)
        if not was_half_full and 2 * works[choice] > capacity:
            half_full += 1
            if half_full > most_half_full:
                return None
        insort(keys, (works[choice] << _COLUMN_BITS) | (_COLUMN_MASK - choice))
        labels[x] = choice
        offsets = in_run.get(choice)
        if offsets is None:
            in_run[choice] = [offset]
        else:
            insort(offsets, offset)
    return labels, works
