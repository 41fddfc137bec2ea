"""``segment``: each microbatch's segment forest (§3.3, "Execution model").

A microbatch uses the part of the compact trie that its own trajectories pass through.
In that sub-trie a segment is a maximal fork-free path: it runs down from a root, or from
a child of a node where the microbatch forks, and stops at the first node that has two or
more children *used by this microbatch* (or none). Two subtleties follow from restricting
the trie to the microbatch:

* a fork of the whole batch is no fork here when only one branch belongs to the microbatch,
  so segments can merge several trie nodes;
* a trajectory that ends at a node which another member continues does not end a segment
  (the trie splits nodes at trajectory ends, segments do not), because nothing forks there.

Segments are numbered in preorder of the segment forest with children in token order; the
trie is itself numbered that way, so sorting by first trie node gives that order.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs

from harts.errors import PipelineError, PlanningError
from harts.ir.nodes import CompactTrie, Microbatch, Module, Phase, Segment
from harts.passes.base import Pass, PassContext, register_pass

logger = logging.getLogger(__name__)


def used_trie_nodes(trie: CompactTrie, trajectories: Sequence[int]) -> list[int]:
    """Ids of the trie nodes on the paths of ``trajectories``, ascending (= preorder)."""
    nodes = trie.nodes
    seen: set[int] = set()
    for trajectory in trajectories:
        node = trie.leaf[trajectory]
        # Paths share their upper part; stop at the first node another member already marked.
        while node >= 0 and node not in seen:
            seen.add(node)
            node = nodes[node].parent
    return sorted(seen)


def build_segments(trie: CompactTrie, trajectories: Sequence[int]) -> tuple[Segment, ...]:
    """The segment forest of the sub-trie used by ``trajectories`` (batch indices)."""
    nodes = trie.nodes
    used = used_trie_nodes(trie, trajectories)
    used_children: dict[int, list[int]] = {node: [] for node in used}
    for node in used:
        parent = nodes[node].parent
        if parent >= 0:
            used_children[parent].append(node)

    # Representative: the smallest member index whose path runs through a node (its subtree).
    smallest_member: dict[int, int] = {}
    for trajectory in trajectories:
        leaf = trie.leaf[trajectory]
        if trajectory < smallest_member.get(leaf, trajectory + 1):
            smallest_member[leaf] = trajectory
    for node in reversed(used):
        parent = nodes[node].parent
        if parent >= 0 and node in smallest_member:
            if smallest_member[node] < smallest_member.get(parent, smallest_member[node] + 1):
                smallest_member[parent] = smallest_member[node]

    segment_of_node: dict[int, int] = {}
    chains: list[list[int]] = []
    segment_parent: list[int] = []
    for node in used:
        parent = nodes[node].parent
        if parent >= 0 and len(used_children[parent]) == 1:
            # A single used child continues its parent's fork-free path.
            segment = segment_of_node[parent]
            chains[segment].append(node)
        else:
            segment = len(chains)
            chains.append([node])
            segment_parent.append(-1 if parent < 0 else segment_of_node[parent])
        segment_of_node[node] = segment

    return tuple(
        Segment(
            id=segment,
            parent=segment_parent[segment],
            start=nodes[chain[0]].start,
            end=nodes[chain[-1]].end,
            nodes=tuple(chain),
            trajectory=smallest_member[chain[-1]],
        )
        for segment, chain in enumerate(chains)
    )


def segment_microbatch(trie: CompactTrie, microbatch: Microbatch) -> Microbatch:
    if not microbatch.trajectories:
        raise PlanningError(f"microbatch {microbatch.index} holds no trajectories; nothing to segment")
    segments = build_segments(trie, microbatch.trajectories)
    return attrs.evolve(microbatch, segments=segments, rounds=None, replay_tokens=None)


@register_pass
class SegmentPass(Pass):
    name = "segment"
    summary = "per-microbatch segment forest: maximal fork-free paths of the microbatch's sub-trie"
    requires = Phase.SCHEDULED
    produces = Phase.SEGMENTED

    @attrs.frozen
    class Options:
        pass

    def run(self, module: Module, options: Options, ctx: PassContext) -> Module:
        if module.phase < self.requires or module.trie is None or module.microbatches is None:
            raise PipelineError(
                f"pass 'segment' needs a {self.requires} module with a compact trie and microbatches; got phase {module.phase}"
            )
        for microbatch in module.microbatches:
            for trajectory in microbatch.trajectories:
                if not 0 <= trajectory < len(module.trajectories):
                    raise PlanningError(
                        f"microbatch {microbatch.index}: trajectory {trajectory} is not in the batch "
                        f"({len(module.trajectories)} trajectories)"
                    )
        microbatches = tuple(segment_microbatch(module.trie, microbatch) for microbatch in module.microbatches)
        logger.debug("segment: %d segments over %d microbatches", sum(len(m.segments) for m in microbatches), len(microbatches))
        return attrs.evolve(module, phase=Phase.SEGMENTED, microbatches=microbatches)
