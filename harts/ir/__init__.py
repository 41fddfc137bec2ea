"""The tree IR: nodes, text form, verification, prefix queries."""

from harts.ir.nodes import (
    CompactTrie,
    InputSequence,
    Microbatch,
    Module,
    Phase,
    Round,
    Segment,
    StateRef,
    Trajectory,
    TrieNode,
)
from harts.ir.prefix_index import PrefixIndex

__all__ = [
    "CompactTrie",
    "InputSequence",
    "Microbatch",
    "Module",
    "Phase",
    "PrefixIndex",
    "Round",
    "Segment",
    "StateRef",
    "Trajectory",
    "TrieNode",
]
