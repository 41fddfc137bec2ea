"""The tree IR: frozen attrs nodes, one root (:class:`Module`) that records its phase.

Coordinates. A *position* is an index into one trajectory's own token list (0-based);
every span ``[start, end)`` below is in the coordinates of the trajectory it names.
Tokens themselves are not part of the IR: they live in the :class:`~harts.RolloutBatch`
whose hash the module records, so the IR stays small and prints in full.

Phases, in order: ``lowered``, ``compressed``, ``partitioned``, ``scheduled``, ``segmented``,
``rounded``, ``laid_out``. Which pass produces each, what it adds and which verifier checks it
is one table, the pass registry (:data:`harts.passes.registry.BUILTIN_PASSES`; ``harts passes``
prints it).

The first six phases are phases of one root, :class:`Module`. Code generation changes the
root: a :class:`~harts.ir.layout.LaidOutModule` holds the rounded module and one
:class:`~harts.ir.layout.MicrobatchLayout` per microbatch, the index arrays the runtime
executes.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Iterable

import attrs
import numpy as np


class Phase(enum.IntEnum):
    LOWERED = 0
    COMPRESSED = 1
    PARTITIONED = 2
    SCHEDULED = 3
    SEGMENTED = 4
    ROUNDED = 5
    LAID_OUT = 6

    def __str__(self) -> str:
        return self.name.lower()


@attrs.frozen
class Trajectory:
    """Trajectory ``index`` of the batch (user order), in rollout tree ``tree``, ``length`` tokens."""

    index: int
    tree: int
    length: int


@attrs.frozen
class TrieNode:
    """One node of the compact trie: a maximal run of shared tokens with one multiplicity.

    The node covers positions ``[start, end)`` of every trajectory through it. Nodes are
    numbered in preorder with children in token order, so a node's compact rows are
    ``row .. row + (end - start) - 1`` and preorder equals lexicographic order.
    ``multiplicity`` is q: the number of trajectories that pass through the node.
    A node boundary falls at every fork and at every trajectory end.
    """

    id: int
    parent: int  # -1 for a root (one root per first token)
    start: int
    end: int
    multiplicity: int
    row: int


#: CompactTrie.node_arrays of the tries alive, by id: (a weak reference to the trie, its arrays)
_NODE_ARRAYS: dict[int, tuple[weakref.ref, tuple[np.ndarray, ...]]] = {}


@attrs.frozen
class CompactTrie:
    """The prefix-compressed batch (Eq. 3, 5, 6).

    ``nodes``: preorder. ``leaf``: for trajectory i, the node where it ends (``end == length``).
    ``order``: trajectory indices in stable lexicographic order of their tokens.
    ``lcp``: ``lcp[r]`` = LCP(order[r-1], order[r]) (``lcp[0] == 0``).
    ``compact_tokens`` = C(X) = G = sum of node lengths.
    """

    nodes: tuple[TrieNode, ...]
    leaf: tuple[int, ...]
    order: tuple[int, ...]
    lcp: tuple[int, ...]
    compact_tokens: int

    def path(self, trajectory: int) -> list[TrieNode]:
        """The nodes from the root to where ``trajectory`` ends."""
        nodes = []
        node = self.leaf[trajectory]
        while node >= 0:
            nodes.append(self.nodes[node])
            node = self.nodes[node].parent
        return nodes[::-1]

    def used_nodes(self, trajectories: Iterable[int]) -> list[int]:
        """Ids of the nodes on the paths of ``trajectories``, ascending (= preorder)."""
        used: set[int] = set()
        for trajectory in trajectories:
            node = self.leaf[trajectory]
            # Paths share their upper part; stop at the first node another path already marked.
            while node >= 0 and node not in used:
                used.add(node)
                node = self.nodes[node].parent
        return sorted(used)

    def smallest_through(self, trajectories: Iterable[int]) -> dict[int, int]:
        """For every node on the paths of ``trajectories``: the smallest of them whose path runs through it
        (the keys are :meth:`used_nodes`, unordered).

        Members walk up from their leaves in ascending order, each until a node an earlier one reached: the
        first to reach a node is the smallest through it and through all of its ancestors as well."""
        smallest: dict[int, int] = {}
        for trajectory in sorted(trajectories):
            node = self.leaf[trajectory]
            while node >= 0 and node not in smallest:
                smallest[node] = trajectory
                node = self.nodes[node].parent
        return smallest

    def segment_starts(self) -> list[bool]:
        """For every node: does a maximal fork-free segment begin there (a root, or a child of a fork)?"""
        children = [0] * len(self.nodes)
        for node in self.nodes:
            if node.parent >= 0:
                children[node.parent] += 1
        return [node.parent < 0 or children[node.parent] > 1 for node in self.nodes]

    def node_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every node's ``parent``, ``start``, ``end`` and ``row`` as read-only int64 arrays (indexed by node id).

        Code generation and the verifiers ask for them once per microbatch; they are built once per trie
        and kept beside it (keyed by identity, dropped with the trie), since the trie itself is frozen.
        """
        key = id(self)
        held = _NODE_ARRAYS.get(key)
        if held is not None and held[0]() is self:
            return held[1]
        count = len(self.nodes)
        arrays = tuple(np.fromiter((getattr(node, name) for node in self.nodes), dtype=np.int64, count=count)
                       for name in ("parent", "start", "end", "row"))
        for array in arrays:
            array.flags.writeable = False
        _NODE_ARRAYS[key] = (weakref.ref(self, lambda _, key=key: _NODE_ARRAYS.pop(key, None)), arrays)
        return arrays

    def paths_of(self, trajectories: np.ndarray, parent: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The root-to-leaf paths of ``trajectories`` at once: (position in ``trajectories``, node) pairs,
        ordered by position and then root first. ``parent``: :meth:`node_arrays`' first array, when at hand.

        Climbs from every leaf in one numpy step per level; a path's nodes ascend in preorder from
        its root, so sorting the pairs puts each path root first.
        """
        parent = self.node_arrays()[0] if parent is None else parent
        owners, nodes = [], []
        owner = np.arange(len(trajectories), dtype=np.int64)
        node = np.asarray(self.leaf, dtype=np.int64)[np.asarray(trajectories, dtype=np.int64)]
        while owner.size:
            owners.append(owner)
            nodes.append(node)
            keep = parent[node] >= 0
            owner, node = owner[keep], parent[node[keep]]
        if not owners:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        owner, node = np.concatenate(owners), np.concatenate(nodes)
        order = np.lexsort((node, owner))
        return owner[order], node[order]

    def rows(self, trajectory: int) -> list[int]:
        """The map m for one trajectory: the compact row of each of its positions."""
        rows: list[int] = []
        for node in self.path(trajectory):
            rows.extend(range(node.row, node.row + node.end - node.start))
        return rows


@attrs.frozen
class Segment:
    """A maximal fork-free token path of one microbatch's trie (§3.3).

    Segment ``id`` (0-based inside its microbatch, preorder) covers positions
    ``[start, end)`` of every trajectory through it; ``parent`` is -1 for a root segment.
    ``nodes`` are the compact-trie nodes it merges, root to leaf. ``trajectory`` is the
    smallest index among the microbatch's trajectories that reach ``end`` (length >= end),
    a representative whose token path covers the whole segment.
    Anchors: a_v = B*floor(start/B), b_v = B*floor(end/B) with B the module's chunk size.
    """

    id: int
    parent: int
    start: int
    end: int
    nodes: tuple[int, ...]
    trajectory: int


@attrs.frozen
class StateRef:
    """The boundary state at ``position`` exported in round ``round`` by the sequence of ``trajectory``."""

    round: int
    trajectory: int
    position: int


@attrs.frozen
class InputSequence:
    """One input sequence of a packed linear-attention call.

    It runs positions ``[replay_start, end)`` of ``trajectory``: rows ``[replay_start, start)``
    are replay (state updates only, no outputs), rows ``[start, end)`` produce outputs.
    ``state_from`` is None for a zero initial state (then ``replay_start == 0``), else
    the exported boundary state it starts from (``state_from.position == replay_start``).
    ``segments`` are the segment ids it executes, in order (a direct-continuation chain).
    ``trajectory`` is the smallest index among the microbatch's trajectories whose length is
    at least ``end`` and that pass through its last segment (a leaf segment).
    ``exports`` are the boundary positions (multiples of B, inside ``(replay_start, end]``)
    whose states later sequences start from.
    """

    trajectory: int
    start: int
    end: int
    replay_start: int
    state_from: StateRef | None
    segments: tuple[int, ...]
    exports: tuple[int, ...] = ()


@attrs.frozen
class Round:
    """One packed linear-attention call: its input sequences, numbered from 0 within a microbatch."""

    index: int
    sequences: tuple[InputSequence, ...]


@attrs.frozen
class Microbatch:
    """A set of trajectories executed together.

    ``trajectories`` are batch indices in ascending order; ``work`` is C(M), its compact
    tokens. ``replica`` and ``slot`` are set from phase ``scheduled`` on; ``segments`` from
    ``segmented``; ``rounds`` and ``replay_tokens`` (R, Eq. 15) from ``rounded``.
    """

    index: int
    trajectories: tuple[int, ...]
    work: int
    replica: int | None = None
    slot: int | None = None
    segments: tuple[Segment, ...] | None = None
    rounds: tuple[Round, ...] | None = None
    replay_tokens: int | None = None


@attrs.frozen
class Module:
    """The IR root. ``input_hash`` identifies the batch the IR was lowered from.

    ``capacity`` (T, compact tokens per microbatch), ``dp_size`` (D) and ``chunk_size`` (B)
    are the targets every pass plans for.
    """

    phase: Phase
    input_hash: str
    capacity: int
    dp_size: int
    chunk_size: int
    trajectories: tuple[Trajectory, ...]
    trie: CompactTrie | None = None
    microbatches: tuple[Microbatch, ...] | None = None


#: Every node class of the module phases, by name (the printer and parser use it, with the layout's).
NODE_CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (Trajectory, TrieNode, CompactTrie, Segment, StateRef, InputSequence, Round, Microbatch, Module)
}
