"""The tree IR: nodes (the laid-out phase's layouts included), text form, verification, prefix queries."""

from harts.ir.layout import LaidOutModule, MicrobatchLayout
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
    "LaidOutModule",
    "Microbatch",
    "MicrobatchLayout",
    "Module",
    "Phase",
    "PrefixIndex",
    "Round",
    "Segment",
    "StateRef",
    "Trajectory",
    "TrieNode",
]
