"""``prefix-compress``: the compact trie over every trajectory of the batch (§3.1, Eq. 3, 5, 6).

Trajectories are sorted stably in token-lexicographic order; adjacent LCPs then give the
trie directly (a stack walk, as for a suffix tree built from a suffix array): each new
trajectory shares exactly ``lcp[r]`` tokens with the current path.
"""

from __future__ import annotations

import itertools

import attrs
import numpy as np

from harts.errors import PipelineError
from harts.ir.nodes import CompactTrie, Module, Phase, TrieNode
from harts.passes.base import Pass, PassContext
from harts.passes.registry import builtin_pass


#: a trajectory is first compared with the pivot over this many tokens, each further block four times longer: a
#: difference soon after the shared stretch costs a short read, and a long shared stretch few numpy calls (each one
#: hands the GIL to the thread hashing the batch meanwhile and back, see ``harts.compiler``)
_FIRST_BLOCK = 4096
#: the pivot sort visits each trajectory a few times on rollout trees (once per pivot it is compared with); past this
#: many visits per trajectory (chains of prefixes, which it splits one trajectory at a time) the key sort takes over
_VISITS_PER_TRAJECTORY = 32


def sorted_order_and_lcp(tokens: tuple[np.ndarray, ...]) -> tuple[list[int], list[int]]:
    """Stable lexicographic order of token arrays and the LCP of each rank with the previous one.

    A three-way radix quicksort on whole shared stretches: a group of trajectories that share their first
    ``depth`` tokens is split by each member's LCP with a pivot (its first member) and the token after it.
    Members that leave the pivot at the same position with the same token form a subgroup, which shares one
    token more than that LCP; those below the pivot come first, the earlier they leave it the sooner, and those
    above it last, the later they leave it the sooner. Each comparison starts at ``depth``, past what the group
    is known to share, so a token is read about once however long the prefixes the batch shares, in place
    (no copy of the batch's tokens), and the LCPs of adjacent ranks fall out of the splits. Falls back to
    :func:`_sorted_by_keys` when the splits stop shrinking the groups (see :data:`_VISITS_PER_TRAJECTORY`).
    """
    if not tokens:
        return [], []
    lengths = [len(trajectory) for trajectory in tokens]
    order: list[int] = []
    lcp: list[int] = []
    visits = _VISITS_PER_TRAJECTORY * len(tokens)
    # (members in index order, the tokens they all share or None for a single trajectory, LCP of its first rank)
    stack: list[tuple[list[int], int | None, int]] = [(list(range(len(tokens))), 0, 0)]
    while stack:
        members, depth, lead = stack.pop()
        if depth is None or len(members) == 1:
            order.append(members[0])
            lcp.append(lead)
            continue
        visits -= len(members)
        if visits < 0:
            return _sorted_by_keys(tokens)
        pivot = members[0]
        pivot_tokens, pivot_length = tokens[pivot], lengths[pivot]
        # the first block of every comparison, read here once per group (most members leave the pivot in it)
        block_end = min(depth + _FIRST_BLOCK, pivot_length)
        pivot_block = pivot_tokens[depth:block_end]
        equal = [pivot]
        below: dict[tuple[int, int], list[int]] = {}
        above: dict[tuple[int, int], list[int]] = {}
        for member in members[1:]:
            array, length = tokens[member], lengths[member]
            if length >= block_end > depth:
                differs = array[depth:block_end] != pivot_block
                first = differs.argmax()
                shared = depth + int(first) if differs[first] else _first_difference(
                    array, pivot_tokens, block_end, min(length, pivot_length), 4 * _FIRST_BLOCK)
            else:
                shared = _first_difference(array, pivot_tokens, depth, min(length, pivot_length))
            if shared == length:
                # a prefix of the pivot (the token after it is "none", below every token), or the pivot itself
                (equal if shared == pivot_length else below.setdefault((shared, -1), [])).append(member)
            elif shared == pivot_length:
                above.setdefault((-shared, int(array[shared])), []).append(member)
            else:
                token = int(array[shared])
                if token < int(pivot_tokens[shared]):
                    below.setdefault((shared, token), []).append(member)
                else:
                    above.setdefault((-shared, token), []).append(member)
        buckets = [(shared, token, group) for (shared, token), group in sorted(below.items())]
        buckets.append((pivot_length, -1, equal))
        buckets.extend((-negated, token, group) for (negated, token), group in sorted(above.items()))
        # two ranks of different buckets share exactly the smaller of the buckets' LCPs with the pivot
        parts: list[tuple[list[int], int | None, int]] = []
        previous = None
        for shared, token, group in buckets:
            first_lcp = lead if previous is None else min(previous, shared)
            if token < 0:
                # one trajectory repeated (the pivot, or a prefix of it): its copies follow in index order
                parts.append(([group[0]], None, first_lcp))
                parts.extend(([member], None, shared) for member in group[1:])
            else:
                parts.append((group, shared + 1, first_lcp))
            previous = shared
        stack.extend(reversed(parts))
    return order, lcp


def _first_difference(a: np.ndarray, b: np.ndarray, start: int, stop: int, block: int = _FIRST_BLOCK) -> int:
    """The first position in ``[start, stop)`` where ``a`` and ``b`` differ, else ``stop``; read in blocks that
    grow fourfold from ``block``, so a difference soon after ``start`` costs a short read."""
    while start < stop:
        end = min(stop, start + block)
        differs = a[start:end] != b[start:end]
        first = int(differs.argmax())
        if differs[first]:
            return start + first
        start, block = end, 4 * block
    return stop


def _sorted_by_keys(tokens: tuple[np.ndarray, ...]) -> tuple[list[int], list[int]]:
    """:func:`sorted_order_and_lcp` by sorting byte keys: a copy of every trajectory, but no case it splits slowly.

    Token ids are below 2**32 (:data:`harts.rollouts.fields.MAX_TOKEN_ID`), so their big-endian 4-byte
    strings compare as the arrays do. The LCPs compare adjacent ranks' arrays (:func:`_first_difference`).
    """
    keys = [trajectory.astype(">u4").tobytes() for trajectory in tokens]
    order = sorted(range(len(tokens)), key=keys.__getitem__)  # sorted is stable: ties keep index order
    lcp = [0] * len(order)
    for rank in range(1, len(order)):
        previous, current = tokens[order[rank - 1]], tokens[order[rank]]
        lcp[rank] = _first_difference(previous, current, 0, min(len(previous), len(current)))
    return order, lcp


def build_compact_trie(tokens: tuple[np.ndarray, ...]) -> CompactTrie:
    """The compact trie of ``tokens``: a stack walk over the ranks (each shares ``lcp[rank]`` tokens with the path
    so far), then the nodes numbered in preorder with children in rank order.

    Nodes under construction are indices into parallel lists (span, children, trajectories ending there), not
    objects: the walk touches each node a few times, and for thousands of trajectories object creation and
    attribute access were most of its time after the sort."""
    order, lcp = sorted_order_and_lcp(tokens)
    lengths = [len(trajectory) for trajectory in tokens]
    starts: list[int] = []
    ends: list[int] = []
    children: list[list[int]] = []
    ending: list[list[int]] = []  # the trajectories that end at a node's ``end``
    roots: list[int] = []
    path: list[int] = []
    for rank, trajectory in enumerate(order):
        shared, length = lcp[rank], lengths[trajectory]
        while path and starts[path[-1]] >= shared:
            path.pop()
        if path and ends[path[-1]] > shared:
            # the path's last node splits at ``shared``: its lower part (a new node) keeps its children and endings
            top, tail = path[-1], len(starts)
            starts.append(shared)
            ends.append(ends[top])
            children.append(children[top])
            ending.append(ending[top])
            ends[top], children[top], ending[top] = shared, [tail], []
        if length > shared:
            node = len(starts)
            starts.append(shared)
            ends.append(length)
            children.append([])
            ending.append([trajectory])
            (children[path[-1]] if path else roots).append(node)
            path.append(node)
        else:
            ending[path[-1]].append(trajectory)

    count = len(starts)
    preorder: list[int] = []
    parent = [-1] * count
    number = [0] * count  # node -> its preorder id
    stack = roots[::-1]
    while stack:
        node = stack.pop()
        number[node] = len(preorder)
        preorder.append(node)
        kids = children[node]
        if kids:
            for kid in kids:
                parent[kid] = node
            stack.extend(reversed(kids))
    node_starts = [starts[node] for node in preorder]
    node_ends = [ends[node] for node in preorder]
    parents = [-1 if parent[node] < 0 else number[parent[node]] for node in preorder]
    through = [len(ending[node]) for node in preorder]
    leaf = [0] * len(tokens)
    for node_id, node in enumerate(preorder):
        for trajectory in ending[node]:
            leaf[trajectory] = node_id
    # Children follow their parent in preorder, so one reverse sweep accumulates subtree counts.
    for node_id in range(count - 1, 0, -1):
        if parents[node_id] >= 0:
            through[parents[node_id]] += through[node_id]
    rows = list(itertools.accumulate(map(int.__sub__, node_ends, node_starts), initial=0))
    nodes = tuple(map(TrieNode, range(count), parents, node_starts, node_ends, through, rows))
    return CompactTrie(nodes=nodes, leaf=tuple(leaf), order=tuple(order), lcp=tuple(lcp), compact_tokens=rows[-1])


@builtin_pass("prefix-compress")
@attrs.frozen
class PrefixCompress(Pass):
    def run(self, module: Module, ctx: PassContext) -> Module:
        batch = ctx.batch
        if batch is None or batch.input_hash() != module.input_hash:
            raise PipelineError("prefix-compress needs the rollout batch the module was lowered from (input hash differs)")
        trie = ctx.batch_trie if ctx.batch_trie is not None else build_compact_trie(batch.tokens)
        return attrs.evolve(module, phase=Phase.COMPRESSED, trie=trie)
