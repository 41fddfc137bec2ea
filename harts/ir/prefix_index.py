"""Constant-time prefix-sharing queries over lexicographically sorted trajectories (Eq. 5-6).

Ranks ``0 .. N-1`` index trajectories in lexicographic order. With ``lcp[r]`` the LCP of
ranks ``r-1`` and ``r``, the compact work of a contiguous rank interval is

    W(a, b) = sum(len[a..b]) - sum(lcp[a+1..b])

and the LCP of any two ranks ``i < j`` is ``min(lcp[i+1..j])``, answered by a sparse table.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np

from harts.ir.nodes import CompactTrie, Module


class PrefixIndex:
    """Interval work, pairwise LCP and subset work on one batch's lexicographic order."""

    def __init__(self, order: Iterable[int], lengths_by_trajectory: Iterable[int], lcp: Iterable[int]):
        self.order = np.asarray(list(order), dtype=np.int64)
        lengths_by_trajectory = np.asarray(list(lengths_by_trajectory), dtype=np.int64)
        self.lcp = np.asarray(list(lcp), dtype=np.int64)
        n = len(self.order)
        if self.lcp.shape != (n,):
            raise ValueError(f"lcp has {self.lcp.shape} entries, expected {n}")
        self.size = n
        self.lengths = lengths_by_trajectory[self.order]  # by rank
        self.rank = np.empty(n, dtype=np.int64)
        self.rank[self.order] = np.arange(n)
        self._length_prefix = np.concatenate([[0], np.cumsum(self.lengths)])
        self._lcp_prefix = np.concatenate([[0], np.cumsum(self.lcp)])
        self._sparse = [self.lcp.copy()]
        width = 1
        while 2 * width <= n:
            previous = self._sparse[-1]
            self._sparse.append(np.minimum(previous[:-width], previous[width:]))
            width *= 2

    @classmethod
    def from_trie(cls, trie: CompactTrie, lengths_by_trajectory: Iterable[int]) -> "PrefixIndex":
        return cls(trie.order, lengths_by_trajectory, trie.lcp)

    @classmethod
    def from_module(cls, module: Module) -> "PrefixIndex":
        if module.trie is None:
            raise ValueError("the module has no compact trie; run prefix-compress first")
        return cls.from_trie(module.trie, [t.length for t in module.trajectories])

    def lcp_min(self, lo: int, hi: int) -> int:
        """min(lcp[lo..hi]) for ``lo <= hi`` (inclusive)."""
        level = int(hi - lo + 1).bit_length() - 1
        table = self._sparse[level]
        return int(min(table[lo], table[hi - (1 << level) + 1]))

    def lcp_ranks(self, i: int, j: int) -> int:
        """LCP of the trajectories at ranks ``i`` and ``j``."""
        if i == j:
            return int(self.lengths[i])
        if i > j:
            i, j = j, i
        return self.lcp_min(i + 1, j)

    def lcp_trajectories(self, x: int, y: int) -> int:
        """LCP of trajectories ``x`` and ``y`` (batch indices)."""
        return self.lcp_ranks(int(self.rank[x]), int(self.rank[y]))

    def lcps_of_trajectories(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """:meth:`lcp_trajectories` of every pair ``x[i], y[i]`` (batch indices), at once."""
        ranks_x, ranks_y = self.rank[x], self.rank[y]
        lo, hi = np.minimum(ranks_x, ranks_y), np.maximum(ranks_x, ranks_y)
        shared = self.lengths[lo].copy()  # a trajectory shares all of itself
        apart = lo < hi
        shared[apart] = self._range_min(lo[apart] + 1, hi[apart])
        return shared

    def interval_work(self, a: int, b: int) -> int:
        """W(a, b): compact tokens of ranks ``a..b`` inclusive (0 if ``a > b``)."""
        if a > b:
            return 0
        return int(self._length_prefix[b + 1] - self._length_prefix[a] - (self._lcp_prefix[b + 1] - self._lcp_prefix[a + 1]))

    def subset_work(self, trajectories: Iterable[int]) -> int:
        """C(M) of Eq. 5 for any set of trajectories (batch indices)."""
        ranks = np.sort(self.rank[np.asarray(list(trajectories), dtype=np.int64)])
        if len(ranks) == 0:
            return 0
        return self.ranks_work(ranks)

    def subsets_work(self, groups: Sequence[Sequence[int]]) -> np.ndarray:
        """C(M) of Eq. 5 of every set in ``groups`` (batch indices), as :meth:`subset_work` of each, at once.

        Each set's work is its lengths less the LCP of each pair of rank-adjacent members: the pairs of all
        sets are answered together by the sparse table, one numpy expression per step (a verifier asks for
        every microbatch of a step, hundreds of them).
        """
        sizes = np.fromiter((len(group) for group in groups), dtype=np.int64, count=len(groups))
        members = np.fromiter(itertools.chain.from_iterable(groups), dtype=np.int64, count=int(sizes.sum()))
        owner = np.repeat(np.arange(len(groups)), sizes)
        ranks = self.rank[members]
        by_rank = np.lexsort((ranks, owner))
        ranks, owner = ranks[by_rank], owner[by_rank]
        work = np.zeros(len(groups), dtype=np.int64)
        np.add.at(work, owner, self.lengths[ranks])
        pair = np.flatnonzero(owner[1:] == owner[:-1])
        previous, current = ranks[pair], ranks[pair + 1]
        shared = self.lengths[current].copy()  # a member given twice shares all of itself
        apart = previous < current
        shared[apart] = self._range_min(previous[apart] + 1, current[apart])
        np.subtract.at(work, owner[pair + 1], shared)
        return work

    def _range_min(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """min(lcp[lo..hi]) for arrays of ``lo <= hi`` (inclusive), as :meth:`lcp_min` of each pair."""
        if lo.size == 0:
            return np.zeros(0, dtype=np.int64)
        level = np.frexp((hi - lo + 1).astype(np.float64))[1] - 1  # floor(log2) of exact small integers
        out = np.empty(lo.size, dtype=np.int64)
        for k in range(int(level.max()) + 1):
            at = np.flatnonzero(level == k)
            table = self._sparse[k]
            out[at] = np.minimum(table[lo[at]], table[hi[at] - (1 << k) + 1])
        return out

    def ranks_work(self, sorted_ranks: np.ndarray) -> int:
        """C(M) for a set given as ascending ranks."""
        total = int(self.lengths[sorted_ranks].sum())
        for previous, current in zip(sorted_ranks[:-1], sorted_ranks[1:]):
            total -= self.lcp_ranks(int(previous), int(current))
        return total
