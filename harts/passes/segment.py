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

from harts.errors import PlanningError
from harts.ir.nodes import CompactTrie, Microbatch, Module, Phase, Segment
from harts.passes.base import Pass, PassContext
from harts.passes.registry import builtin_pass

logger = logging.getLogger(__name__)


def build_segments(trie: CompactTrie, trajectories: Sequence[int]) -> tuple[Segment, ...]:
    """The segment forest of the sub-trie used by ``trajectories`` (batch indices)."""
    nodes = trie.nodes
    # Representative: the smallest member index whose path runs through a node (its subtree); its keys are the
    # used nodes
    smallest_member = trie.smallest_through(trajectories)
    used = sorted(smallest_member)  # ascending = preorder
    used_child_count = dict.fromkeys(used, 0)
    for node in used:
        parent = nodes[node].parent
        if parent >= 0:
            used_child_count[parent] += 1

    segment_of_node: dict[int, int] = {}
    chains: list[list[int]] = []
    segment_parent: list[int] = []
    for node in used:
        parent = nodes[node].parent
        if parent >= 0 and used_child_count[parent] == 1:
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


@builtin_pass("segment")
@attrs.frozen
class SegmentPass(Pass):
    # Segmenting reads only membership and the trie, but phases form a chain: a ``segmented``
    # module is also ``scheduled`` (verify checks replica and slot), and the runtime runs
    # microbatches in slot order, so the replica x slot assignment has to exist already.

    def run(self, module: Module, ctx: PassContext) -> Module:
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
