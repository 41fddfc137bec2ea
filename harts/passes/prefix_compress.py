"""``prefix-compress``: the compact trie over every trajectory of the batch (§3.1, Eq. 3, 5, 6).

Trajectories are sorted stably in token-lexicographic order; adjacent LCPs then give the
trie directly (a stack walk, as for a suffix tree built from a suffix array): each new
trajectory shares exactly ``lcp[r]`` tokens with the current path.
"""

from __future__ import annotations

import attrs
import numpy as np

from harts.errors import PipelineError
from harts.ir.nodes import CompactTrie, Module, Phase, TrieNode
from harts.passes.base import Pass, PassContext
from harts.passes.registry import builtin_pass


def sorted_order_and_lcp(tokens: tuple[np.ndarray, ...]) -> tuple[list[int], list[int]]:
    """Stable lexicographic order of token arrays and the LCP of each rank with the previous one.

    Token ids are below 2**32 (:data:`harts.rollouts.fields.MAX_TOKEN_ID`), so their big-endian 4-byte
    strings compare as the arrays do. The LCPs compare those same bytes, read in place as 4-byte words
    (equality needs no byte order), and stop at the first mismatch.
    """
    keys = [trajectory.astype(">u4").tobytes() for trajectory in tokens]
    order = sorted(range(len(tokens)), key=keys.__getitem__)  # sorted is stable: ties keep index order
    lcp = [0] * len(order)
    previous = np.frombuffer(keys[order[0]], dtype=np.uint32) if order else None
    for rank in range(1, len(order)):
        current = np.frombuffer(keys[order[rank]], dtype=np.uint32)
        n = min(len(previous), len(current))
        differs = previous[:n] != current[:n]
        first = int(differs.argmax())
        lcp[rank] = first if differs[first] else n
        previous = current
    return order, lcp


@attrs.define
class _Building:
    start: int
    end: int
    children: list["_Building"] = attrs.field(factory=list)
    ending: list[int] = attrs.field(factory=list)  # trajectories that end at ``end``


def build_compact_trie(tokens: tuple[np.ndarray, ...]) -> CompactTrie:
    order, lcp = sorted_order_and_lcp(tokens)
    roots: list[_Building] = []
    path: list[_Building] = []
    for rank, trajectory in enumerate(order):
        shared, length = lcp[rank], len(tokens[trajectory])
        while path and path[-1].start >= shared:
            path.pop()
        if path and path[-1].end > shared:
            top = path[-1]
            tail = _Building(shared, top.end, top.children, top.ending)
            top.end, top.children, top.ending = shared, [tail], []
        if length > shared:
            node = _Building(shared, length, ending=[trajectory])
            (path[-1].children if path else roots).append(node)
            path.append(node)
        else:
            path[-1].ending.append(trajectory)

    preorder: list[tuple[_Building, int, int]] = []  # (node, parent id, row)
    leaf = [0] * len(tokens)
    row = 0
    stack: list[tuple[_Building, int]] = [(node, -1) for node in reversed(roots)]
    subtree_ends: list[int] = []
    while stack:
        node, parent = stack.pop()
        node_id = len(preorder)
        preorder.append((node, parent, row))
        subtree_ends.append(len(node.ending))
        row += node.end - node.start
        for trajectory in node.ending:
            leaf[trajectory] = node_id
        stack.extend((child, node_id) for child in reversed(node.children))
    # Children follow their parent in preorder, so one reverse sweep accumulates subtree counts.
    for node_id in range(len(preorder) - 1, -1, -1):
        parent = preorder[node_id][1]
        if parent >= 0:
            subtree_ends[parent] += subtree_ends[node_id]
    nodes = tuple(TrieNode(id=node_id, parent=parent, start=node.start, end=node.end, multiplicity=subtree_ends[node_id], row=node_row)
                  for node_id, (node, parent, node_row) in enumerate(preorder))
    return CompactTrie(nodes=nodes, leaf=tuple(leaf), order=tuple(order), lcp=tuple(lcp), compact_tokens=row)


@builtin_pass("prefix-compress")
@attrs.frozen
class PrefixCompress(Pass):
    def run(self, module: Module, ctx: PassContext) -> Module:
        batch = ctx.batch
        if batch is None or batch.input_hash() != module.input_hash:
            raise PipelineError("prefix-compress needs the rollout batch the module was lowered from (input hash differs)")
        trie = ctx.batch_trie if ctx.batch_trie is not None else build_compact_trie(batch.tokens)
        return attrs.evolve(module, phase=Phase.COMPRESSED, trie=trie)
