"""``verify(module)``: check every invariant of the module's phase and of the phases before it.

One verifier per phase: ``verify_lowered`` and ``verify_compressed`` here, the planner's
(``verify_plan``), the min-call planner's (``verify_rounds``) and code generation's
(``verify_layout``); every pass's output goes through :func:`verify`.
"""

from __future__ import annotations

from harts.ir.layout import LaidOutModule
from harts.ir.nodes import Module, Phase
from harts.ir.verify_common import fail
from harts.ir.verify_layout import verify_laid_out
from harts.ir.verify_plan import verify_partitioned, verify_scheduled
from harts.ir.verify_rounds import verify_rounded, verify_segmented


def verify_lowered(module: Module) -> None:
    for field in ("capacity", "dp_size", "chunk_size"):
        if getattr(module, field) < 1:
            fail(f"module field '{field}' must be positive, got {getattr(module, field)}")
    if not module.trajectories:
        fail("the module holds no trajectories")
    for position, trajectory in enumerate(module.trajectories):
        if trajectory.index != position:
            fail(f"trajectory at position {position} has index {trajectory.index}; indices must be 0..N-1 in order")
        if trajectory.length < 1:
            fail(f"trajectory {trajectory.index}: length {trajectory.length} must be at least 1")


def verify_compressed(module: Module) -> None:
    trie = module.trie
    if trie is None:
        fail(f"phase {module.phase} needs a compact trie")
    count = len(module.trajectories)
    if sorted(trie.order) != list(range(count)):
        fail("trie.order is not a permutation of the trajectories")
    if len(trie.lcp) != count or len(trie.leaf) != count or (count and trie.lcp[0] != 0):
        fail("trie.lcp and trie.leaf need one entry per trajectory, and lcp[0] must be 0")
    lengths = [t.length for t in module.trajectories]
    row = 0
    through = [0] * len(trie.nodes)
    for position, node in enumerate(trie.nodes):
        if node.id != position:
            fail(f"trie node at position {position} has id {node.id}; ids must be preorder 0..n-1")
        if node.parent >= node.id:
            fail(f"trie node {node.id}: parent {node.parent} must precede it in preorder")
        expected_start = 0 if node.parent < 0 else trie.nodes[node.parent].end
        if node.start != expected_start or node.end <= node.start:
            fail(f"trie node {node.id}: span [{node.start}, {node.end}) does not continue its parent (expected start {expected_start})")
        if node.row != row:
            fail(f"trie node {node.id}: row {node.row}, expected {row} (rows follow preorder)")
        row += node.end - node.start
    if row != trie.compact_tokens:
        fail(f"trie.compact_tokens is {trie.compact_tokens} but the nodes hold {row} rows")
    for trajectory, leaf in enumerate(trie.leaf):
        if not 0 <= leaf < len(trie.nodes):
            fail(f"trajectory {trajectory}: leaf node {leaf} does not exist")
        if trie.nodes[leaf].end != lengths[trajectory]:
            fail(f"trajectory {trajectory}: ends at node {leaf} whose end {trie.nodes[leaf].end} != length {lengths[trajectory]}")
        node = leaf
        while node >= 0:
            through[node] += 1
            node = trie.nodes[node].parent
    for node in trie.nodes:
        if node.multiplicity != through[node.id]:
            fail(f"trie node {node.id}: multiplicity {node.multiplicity}, but {through[node.id]} trajectories pass through it")
    if sum(node.multiplicity * (node.end - node.start) for node in trie.nodes) != sum(lengths):
        fail("sum of multiplicities over compact rows differs from the semantic token count")
    for rank in range(1, count):
        a, b = trie.order[rank - 1], trie.order[rank]
        if trie.lcp[rank] > min(lengths[a], lengths[b]):
            fail(f"trie.lcp[{rank}] = {trie.lcp[rank]} exceeds the shorter of trajectories {a} and {b}")


_CHECKS = (
    (Phase.LOWERED, verify_lowered),
    (Phase.COMPRESSED, verify_compressed),
    (Phase.PARTITIONED, verify_partitioned),
    (Phase.SCHEDULED, verify_scheduled),
    (Phase.SEGMENTED, verify_segmented),
    (Phase.ROUNDED, verify_rounded),
)


def verify(module: Module | LaidOutModule) -> None:
    """Raise :class:`IRVerificationError` unless ``module`` satisfies the invariants of its phase."""
    if isinstance(module, LaidOutModule):
        verify(module.module)
        verify_laid_out(module)
        return
    if not isinstance(module, Module):
        fail(f"expected an IR Module, got {type(module).__name__}")
    if module.phase > Phase.ROUNDED:
        fail(f"a Module cannot be at phase {module.phase}: code generation returns a LaidOutModule")
    for phase, check in _CHECKS:
        if module.phase >= phase:
            check(module)
    if module.phase < Phase.PARTITIONED and module.microbatches is not None:
        fail(f"phase {module.phase} must not carry microbatches")
