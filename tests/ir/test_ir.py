"""IR text form and verification."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given

from harts.rollouts.batch import RolloutBatch
from harts.errors import IRParseError, IRVerificationError
from harts.ir.nodes import Module, Phase, Trajectory
from harts.ir.text import parse_ir, print_ir
from harts.ir.verify import verify
from harts.passes import PassContext, lower
from harts.passes.prefix_compress import PrefixCompress
from tests.helpers import token_trees


def compressed(trajectories) -> Module:
    batch = RolloutBatch.from_trajectories(trajectories)
    return PrefixCompress().run(lower(batch), PassContext(batch=batch))


@given(token_trees())
def test_print_parse_round_trip(trajectories):
    module = compressed(trajectories)
    text = print_ir(module)
    assert parse_ir(text) == module
    assert print_ir(parse_ir(text)) == text, "printing is deterministic"


def test_print_is_readable_and_stable():
    text = print_ir(compressed([[1, 2, 3], [1, 2, 4]]))
    assert text.startswith("Module(\n  phase=compressed,")
    assert "TrieNode(id=0, parent=-1, start=0, end=2, multiplicity=2, row=0)" in text


@pytest.mark.parametrize(
    "text, message",
    [
        ("Module(phase=lowered", "end of IR text"),
        ("Trajectory(index=0, tree=0, length=1, color=3)", "no field 'color'"),
        ("Trajectory(index=0, tree=0)", "lacks field(s) length"),
        ("Trajectory(index=0, index=1, tree=0, length=1)", "given twice"),
        ("Banana(x=1)", "unknown name 'Banana'"),
        ("[1, 2] 3", "trailing text"),
        ("[1, 2 ; 3]", "unexpected character"),
    ],
)
def test_parse_errors_are_clear(text, message):
    with pytest.raises(IRParseError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_ir(text)


def corrupt_node(module, node_id, **changes):
    nodes = list(module.trie.nodes)
    nodes[node_id] = attrs.evolve(nodes[node_id], **changes)
    return attrs.evolve(module, trie=attrs.evolve(module.trie, nodes=tuple(nodes)))


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda m: corrupt_node(m, 1, multiplicity=5), "multiplicity 5"),
        (lambda m: corrupt_node(m, 1, row=0), "row 0, expected"),
        (lambda m: corrupt_node(m, 2, start=1), "does not continue its parent"),
        (lambda m: corrupt_node(m, 1, parent=3), "must precede it"),
        (lambda m: attrs.evolve(m, trie=attrs.evolve(m.trie, order=(0, 0, 2))), "not a permutation"),
        (lambda m: attrs.evolve(m, trie=attrs.evolve(m.trie, compact_tokens=99)), "compact_tokens is 99"),
        (lambda m: attrs.evolve(m, trie=attrs.evolve(m.trie, leaf=(2, 1, 3))), "trajectory 0: ends at node 2"),
        (lambda m: attrs.evolve(m, trajectories=(Trajectory(1, 0, 4),) + m.trajectories[1:]), "has index 1"),
        (lambda m: attrs.evolve(m, trie=None), "needs a compact trie"),
        (lambda m: attrs.evolve(m, chunk_size=0), "'chunk_size' must be positive"),
    ],
)
def test_verify_catches_corruption(corrupt, message):
    module = compressed([[1, 2, 3, 4], [1, 2, 3, 5, 6], [7, 8]])
    verify(module)
    with pytest.raises(IRVerificationError, match=message):
        verify(corrupt(module))


def test_verify_rejects_microbatches_before_partitioning():
    module = compressed([[1, 2]])
    from harts.ir.nodes import Microbatch

    with pytest.raises(IRVerificationError, match="must not carry microbatches"):
        verify(attrs.evolve(module, microbatches=(Microbatch(0, (0,), 2),)))


def test_phase_order():
    assert Phase.LOWERED < Phase.COMPRESSED < Phase.PARTITIONED < Phase.SCHEDULED < Phase.SEGMENTED < Phase.ROUNDED
