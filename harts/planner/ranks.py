"""Vectorised prefix queries over lexicographic ranks, built on :class:`~harts.ir.PrefixIndex`.

The planner works on ranks ``0 .. N-1`` (trajectories in stable token-lexicographic order).
``PrefixIndex`` answers one query at a time; the search loops need thousands of them per
step, so this wrapper answers whole arrays of queries with one numpy gather each.

The LCP array is padded with a zero at index ``N``: a query whose range reaches it (a
missing successor, encoded as rank ``N``) or ``lcp[0]`` (a missing predecessor, encoded as
rank ``-1``) then yields 0 without a mask.
"""

from __future__ import annotations

import numpy as np

from harts.ir.prefix_index import PrefixIndex

#: the all-pairs LCP table is built only when it takes at most this many bytes
PAIR_TABLE_BYTES = 64 << 20
#: the all-pairs table is filled run by run (:meth:`RankSpace.prefix_runs`) when the runs' own pairs are at most this
#: many per trajectory (runs of about this many trajectories or fewer), else row by row
RUN_PAIRS_PER_TRAJECTORY = 256


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` of a 1-D integer array, by one sort: NumPy 2's hashing ``unique`` takes several times
    longer on the int64 keys the searches deduplicate (thousands to hundreds of thousands per round)."""
    ordered = np.sort(values)
    if ordered.size < 2:
        return ordered
    keep = np.empty(ordered.size, dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


class RankSpace:
    """Interval work, pairwise LCP and group work for arrays of ranks."""

    def __init__(self, index: PrefixIndex):
        self.index = index
        self.size = n = index.size
        self.lengths = index.lengths.astype(np.int64)
        self.lcp = index.lcp.astype(np.int64)
        self.length_prefix = np.concatenate([[0], np.cumsum(self.lengths)])
        self.lcp_prefix = np.concatenate([[0], np.cumsum(self.lcp)])
        padded = np.concatenate([self.lcp, [0]])
        levels = [padded]
        width = 1
        while 2 * width <= n + 1:
            previous = levels[-1]
            levels.append(np.minimum(previous[:-width], previous[width:]))
            width *= 2
        # One rectangular table so a batch of queries at mixed levels is a single 2-D gather.
        self._table = np.zeros((len(levels), n + 1), dtype=np.int64)
        for level, values in enumerate(levels):
            self._table[level, : len(values)] = values
        # frexp's exponent is exact for integers, unlike a rounded log2
        self._floor_log2 = np.frexp(np.arange(n + 2, dtype=np.float64))[1].astype(np.int64) - 1
        self._pair_table: np.ndarray | None = None
        self._pair_table_built = False
        self._prefix_runs: tuple[int, np.ndarray, np.ndarray] | None = None
        #: subtree runs of member sets, kept by the subtree exchange and slot balancing
        self.subtree_cache: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}

    def pair_table(self) -> np.ndarray | None:
        """All pairwise LCPs, ``table[i, j] = LCP(i, j)`` for ranks ``i != j``, or None when too large.

        The table has ``N + 1`` rows and columns; row and column ``N`` are zero, so a missing
        neighbour encoded as ``N`` (successor) or ``-1`` (predecessor, which numpy reads as the
        last index) yields 0, as Eq. 10 requires. The diagonal holds each trajectory's length.
        Built once per batch when it fits :data:`PAIR_TABLE_BYTES`; the greedy search,
        :meth:`lcp_between` and :meth:`neighbour_shared` then read LCPs with one gather
        instead of range-minimum queries (the results are the same either way). When the
        prefix runs are short (many trees sharing at most a common prompt, or no sharing) the
        table is ``floor`` outside the runs' diagonal blocks, and is filled that way
        (:meth:`_pair_table_by_runs`); else one cumulative minimum per rank and direction.
        """
        if not self._pair_table_built:
            n = self.size
            dtype = np.uint16 if self.lengths.max(initial=0) <= np.iinfo(np.uint16).max else np.int32
            if (n + 1) * (n + 1) * np.dtype(dtype).itemsize <= PAIR_TABLE_BYTES:
                self._pair_table = self._pair_table_by_runs(dtype)
            if self._pair_table is None and (n + 1) * (n + 1) * np.dtype(dtype).itemsize <= PAIR_TABLE_BYTES:
                table = np.zeros((n + 1, n + 1), dtype=dtype)
                lcp = self.lcp.astype(dtype)
                # row by row, both halves written in place along the row: LCP(i, j) is the minimum of
                # lcp[i+1..j] to the right and of lcp[j+1..i] to the left (a column write per row, as
                # the symmetric copy would be, touches a cache line per entry)
                for i in range(n):
                    np.minimum.accumulate(lcp[i + 1 : n], out=table[i, i + 1 : n])
                    if i:
                        np.minimum.accumulate(lcp[i:0:-1], out=table[i, i - 1 :: -1])
                table[np.arange(n), np.arange(n)] = self.lengths
                self._pair_table = table
            self._pair_table_built = True
        return self._pair_table

    def prefix_runs(self) -> tuple[int, np.ndarray, np.ndarray]:
        """``floor``, the smallest adjacent LCP, and by rank the first and last rank of the rank's *run*: the ranks
        are cut wherever the adjacent LCP equals ``floor``. Ranks of different runs have LCP exactly ``floor`` (a cut
        lies between them and no adjacent LCP is smaller); ranks of one run have more. Computed once (the arrays are
        shared: read them only)."""
        if self._prefix_runs is not None:
            return self._prefix_runs
        n = self.size
        floor = int(self.lcp[1:].min()) if n > 1 else 0
        cut = np.ones(n, dtype=bool)
        cut[1:] = self.lcp[1:] <= floor
        firsts = np.flatnonzero(cut)
        lasts = np.append(firsts[1:] - 1, n - 1)
        run = np.cumsum(cut) - 1
        self._prefix_runs = floor, firsts[run], lasts[run]
        return self._prefix_runs

    def _pair_table_by_runs(self, dtype) -> np.ndarray | None:
        """:meth:`pair_table`'s table as ``floor`` everywhere but the runs' diagonal blocks (one vectorised range-minimum
        query for all their pairs), or None when the runs are too long for that to be cheaper."""
        n = self.size
        floor, firsts, lasts = self.prefix_runs()
        sizes = lasts - firsts + 1  # by rank: its run's length
        if int(sizes.sum()) > RUN_PAIRS_PER_TRAJECTORY * n:
            return None
        table = np.full((n + 1, n + 1), floor, dtype=dtype)
        table[n], table[:, n] = 0, 0
        heads = np.flatnonzero((firsts == np.arange(n)) & (sizes > 1))
        if heads.size:
            # every (row, column) pair of every run of two or more, row by row
            counts = sizes[heads] ** 2
            head = np.repeat(heads, counts)
            size = np.repeat(sizes[heads], counts)
            within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            rows, columns = head + within // size, head + within % size
            low, high = np.minimum(rows, columns), np.maximum(rows, columns)
            values = self.range_min(low + 1, np.maximum(high, low + 1))
            table[rows, columns] = values
        table[np.arange(n), np.arange(n)] = self.lengths
        return table

    # ------------------------------------------------------------------ scalar
    def interval_work(self, a: int, b: int) -> int:
        """W(a, b) for ranks ``a..b`` inclusive (0 if ``a > b``)."""
        if a > b:
            return 0
        return int(self.length_prefix[b + 1] - self.length_prefix[a] - (self.lcp_prefix[b + 1] - self.lcp_prefix[a + 1]))

    # ------------------------------------------------------------------ vector
    def interval_works(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """W(starts[i], ends[i]) for arrays with ``starts <= ends`` (inclusive ends)."""
        return (self.length_prefix[ends + 1] - self.length_prefix[starts]) - (self.lcp_prefix[ends + 1] - self.lcp_prefix[starts + 1])

    def range_min(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """min(padded_lcp[lo..hi]) elementwise, ``0 <= lo <= hi <= N``."""
        level = self._floor_log2[hi - lo + 1]
        return np.minimum(self._table[level, lo], self._table[level, hi - (1 << level) + 1])

    def lcp_between(self, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
        """LCP of ranks ``lower < upper`` elementwise; ``lower == -1`` or ``upper == N`` give 0."""
        table = self.pair_table()
        if table is not None:
            return table[lower, upper].astype(np.int64)
        return self.range_min(lower + 1, upper)

    def neighbour_shared(self, rank, predecessors: np.ndarray, successors: np.ndarray) -> np.ndarray:
        """max(LCP(p, x), LCP(x, q)) for trajectory rank ``x`` and arrays of neighbours.

        With ``p < x < q`` adjacent in a microbatch's sorted members, LCP(p, q) equals
        min(LCP(p, x), LCP(x, q)), so Eq. 10 reduces to ``|x| - max(LCP(p, x), LCP(x, q))``;
        this returns the subtracted maximum (``|x| - ΔC``, the tokens ``x`` shares).
        Missing neighbours are encoded as ``-1`` and ``N``.
        """
        table = self.pair_table()
        if table is not None:
            return np.maximum(table[rank, predecessors], table[rank, successors]).astype(np.int64)
        return np.maximum(self.range_min(predecessors + 1, np.broadcast_to(rank, predecessors.shape)),
                          self.range_min(np.broadcast_to(rank + 1, successors.shape), successors))

    def group_works(self, labels: np.ndarray, count: int) -> np.ndarray:
        """C(M) (Eq. 5) of every group ``0..count-1`` where ``labels[rank]`` is the rank's group."""
        order = np.lexsort((np.arange(self.size), labels))
        sorted_labels = labels[order]
        works = np.bincount(labels, weights=self.lengths, minlength=count).astype(np.int64)
        same = sorted_labels[1:] == sorted_labels[:-1]
        if np.any(same):
            shared = self.lcp_between(order[:-1][same], order[1:][same])
            works -= np.bincount(sorted_labels[1:][same], weights=shared, minlength=count).astype(np.int64)
        return works
