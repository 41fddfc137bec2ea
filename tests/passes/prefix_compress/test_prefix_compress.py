"""prefix-compress: the compact trie, the map m, multiplicities and the O(1) prefix queries."""

from __future__ import annotations

import itertools

import numpy as np

from hypothesis import given, settings
from hypothesis import strategies as st

from harts.rollouts.batch import RolloutBatch
from harts.ir.prefix_index import PrefixIndex
from harts.ir.verify import verify
from harts.passes import PassContext, lower
from harts.passes.prefix_compress import PrefixCompress, _first_difference, _sorted_by_keys, build_compact_trie, sorted_order_and_lcp
from tests.helpers import token_trees


def compress(trajectories):
    batch = RolloutBatch.from_trajectories(trajectories)
    module = PrefixCompress().run(lower(batch, capacity=10_000), PassContext(batch=batch))
    verify(module)
    return module


def distinct_prefixes(trajectories):
    return {tuple(t[: i + 1]) for t in trajectories for i in range(len(t))}


@given(token_trees())
def test_compact_tokens_equal_brute_force_trie_count(trajectories):
    module = compress(trajectories)
    assert module.trie.compact_tokens == len(distinct_prefixes(trajectories))


@given(token_trees())
def test_map_m_identifies_rows_by_prefix(trajectories):
    trie = compress(trajectories).trie
    row_of_prefix = {}
    prefix_of_row = {}
    for index, tokens in enumerate(trajectories):
        rows = trie.rows(index)
        assert len(rows) == len(tokens)
        for position, row in enumerate(rows):
            prefix = tuple(tokens[: position + 1])
            assert row_of_prefix.setdefault(prefix, row) == row, "equal prefixes must share a row"
            assert prefix_of_row.setdefault(row, prefix) == prefix, "different prefixes must not share a row"
    assert sorted(prefix_of_row) == list(range(trie.compact_tokens))


@given(token_trees())
def test_multiplicities_sum_to_semantic_tokens(trajectories):
    trie = compress(trajectories).trie
    q_per_row = [0] * trie.compact_tokens
    for node in trie.nodes:
        for row in range(node.row, node.row + node.end - node.start):
            q_per_row[row] = node.multiplicity
    assert sum(q_per_row) == sum(len(t) for t in trajectories)
    counted = [0] * trie.compact_tokens
    for index in range(len(trajectories)):
        for row in trie.rows(index):
            counted[row] += 1
    assert counted == q_per_row


def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(token_trees(max_trajectories=8))
def test_interval_work_and_pairwise_lcp_match_brute_force(trajectories):
    trie = compress(trajectories).trie
    index = PrefixIndex.from_trie(trie, [len(t) for t in trajectories])
    ranked = [trajectories[i] for i in trie.order]
    assert ranked == sorted(trajectories, key=lambda t: t), "order must be lexicographic"
    for a, b in itertools.combinations_with_replacement(range(len(ranked)), 2):
        assert index.interval_work(a, b) == len(distinct_prefixes(ranked[a : b + 1]))
        assert index.lcp_ranks(a, b) == lcp(ranked[a], ranked[b])
    for x, y in itertools.combinations(range(len(trajectories)), 2):
        assert index.lcp_trajectories(x, y) == lcp(trajectories[x], trajectories[y])


@given(token_trees(max_trajectories=8), st.randoms())
def test_subset_work_is_eq5(trajectories, rng):
    trie = compress(trajectories).trie
    index = PrefixIndex.from_trie(trie, [len(t) for t in trajectories])
    members = [i for i in range(len(trajectories)) if rng.random() < 0.5] or [0]
    assert index.subset_work(members) == len(distinct_prefixes([trajectories[i] for i in members]))



@given(token_trees(max_trajectories=10), st.lists(st.lists(st.integers(0, 9), max_size=12), max_size=6))
def test_subsets_work_is_eq5_of_each_set(trajectories, groups):
    """Many sets at once (duplicates and empty sets too) give each set's own C(M): the count of its distinct prefixes."""
    trie = compress(trajectories).trie
    index = PrefixIndex.from_trie(trie, [len(t) for t in trajectories])
    groups = [[i % len(trajectories) for i in group] for group in groups]
    expected = [len(distinct_prefixes([trajectories[i] for i in set(group)])) for group in groups]
    assert index.subsets_work(groups).tolist() == expected == [index.subset_work(group) for group in groups]

def expected_order_and_lcp(trajectories):
    """Stable lexicographic order (Python's sort of the token lists) and each rank's LCP with the one before it."""
    order = sorted(range(len(trajectories)), key=lambda i: trajectories[i])
    return order, [0] + [lcp(trajectories[a], trajectories[b]) for a, b in zip(order, order[1:])]


def as_arrays(trajectories):
    return tuple(np.array(t, dtype=np.int64) for t in trajectories)


@settings(max_examples=300)
@given(token_trees(max_trajectories=14, max_length=60, vocab=3))
def test_sorted_order_and_lcp_is_the_stable_lexicographic_order(trajectories):
    """The pivot sort and the key sort it falls back to both give Python's stable sort and the adjacent LCPs,
    duplicates and prefixes of other trajectories included."""
    expected = expected_order_and_lcp(trajectories)
    assert sorted_order_and_lcp(as_arrays(trajectories)) == expected
    assert _sorted_by_keys(as_arrays(trajectories)) == expected


@given(st.integers(1, 3), st.lists(st.integers(0, 2 ** 32 - 1), min_size=1, max_size=3))
def test_sorted_order_and_lcp_of_long_shared_stretches_and_large_ids(blocks, tails):
    """Shared stretches longer than the first blocks compared, and token ids up to 2**32 - 1."""
    shared = [(7 * k) % 1000 for k in range(4096 * blocks + 5)]
    trajectories = [shared + [tail] + shared[:tail % 50] for tail in tails] + [shared, shared[:4096], shared + [0]]
    assert sorted_order_and_lcp(as_arrays(trajectories)) == expected_order_and_lcp(trajectories)


@given(st.lists(st.integers(0, 2), max_size=40), st.lists(st.integers(0, 2), max_size=40), st.integers(0, 40),
       st.integers(1, 9), st.booleans())
def test_first_difference_is_the_first_mismatch_at_any_block_size(a, b, start, block, prefix):
    """The block-wise read (any first block, fourfold growth) finds the first mismatch in ``[start, stop)`` of the
    scalar definition, ``stop`` when there is none: empty ranges, and one array a prefix of the other, included."""
    if prefix:
        b = a[: len(b)]
    stop = min(len(a), len(b))
    start = min(start, stop)
    expected = next((i for i in range(start, stop) if a[i] != b[i]), stop)
    assert _first_difference(np.array(a, dtype=np.int64), np.array(b, dtype=np.int64), start, stop, block) == expected


def test_sorted_order_and_lcp_of_a_chain_of_prefixes():
    """Each trajectory a prefix of the next: with the shortest first, every pivot splits off only itself and the key
    sort takes over; with the longest first, one pivot splits them all."""
    chain = [list(range(1, k + 1)) for k in range(1, 201)] + [list(range(1, 100)) + [0]]
    for trajectories in (chain, chain[::-1]):
        assert sorted_order_and_lcp(as_arrays(trajectories)) == expected_order_and_lcp(trajectories)
    assert sorted_order_and_lcp(()) == ([], [])


def test_split_cost_is_the_boundary_lcp():
    trajectories = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [7]]
    trie = build_compact_trie(RolloutBatch.from_trajectories(trajectories).tokens)
    index = PrefixIndex.from_trie(trie, [len(t) for t in trajectories])
    n = len(trajectories)
    for t in range(1, n):
        assert index.interval_work(0, t - 1) + index.interval_work(t, n - 1) - index.interval_work(0, n - 1) == trie.lcp[t]


def test_prefix_trajectory_and_duplicates_share_rows():
    trajectories = [[4, 5, 6, 7], [4, 5], [4, 5, 6, 7], [4, 5, 9]]
    trie = compress(trajectories).trie
    assert trie.rows(0) == trie.rows(2)
    assert trie.rows(1) == trie.rows(0)[:2]
    assert trie.compact_tokens == 5
    assert trie.nodes[trie.leaf[1]].end == 2


@given(token_trees(max_trajectories=10), st.data())
def test_lcps_of_trajectories_is_lcp_trajectories_of_each_pair(trajectories, data):
    trie = compress(trajectories).trie
    index = PrefixIndex.from_trie(trie, [len(t) for t in trajectories])
    pairs = data.draw(st.lists(st.tuples(st.integers(0, len(trajectories) - 1), st.integers(0, len(trajectories) - 1)), max_size=20))
    x = np.array([a for a, _ in pairs], dtype=np.int64)
    y = np.array([b for _, b in pairs], dtype=np.int64)
    assert index.lcps_of_trajectories(x, y).tolist() == [lcp(trajectories[a], trajectories[b]) for a, b in pairs]
