"""``verify(module)``: check every invariant of the module's phase and of the phases before it.

One verifier per phase, named in the phase's row of the pass registry
(:data:`harts.passes.registry.BUILTIN_PASSES`): ``verify_lowered`` and ``verify_compressed``
here, the planner's (``verify_plan``), the min-call planner's (``verify_rounds``) and code
generation's (``verify_layout``); every pass's output goes through :func:`verify`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from harts.ir.layout import LaidOutModule
from harts.ir.nodes import Module, Phase
from harts.ir.verify_common import fail


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


@functools.cache
def phase_checks() -> tuple[tuple[Phase, Callable], ...]:
    """Each phase and the verifier of the invariants it adds, in phase order: read from the pass registry's
    rows (:data:`harts.passes.registry.BUILTIN_PASSES`), the one list of passes and phases."""
    from harts.passes.registry import BUILTIN_PASSES, load  # the registry is pure data; its passes load lazily

    rows = sorted((row for row in BUILTIN_PASSES.values() if row.verifier), key=lambda row: row.produces)
    return tuple((row.produces, load(row.verifier)) for row in rows)


#: what each module phase adds, per microbatch (the module-wide parts are compared in :func:`_unchanged_through`)
_MICROBATCH_FIELDS = (
    (Phase.PARTITIONED, ("index", "trajectories", "work")),
    (Phase.SCHEDULED, ("replica", "slot")),
    (Phase.SEGMENTED, ("segments",)),
    (Phase.ROUNDED, ("rounds", "replay_tokens")),
)


def _same(a, b) -> bool:
    return a is b or (isinstance(a, int) and isinstance(b, int) and a == b)


def _unchanged_through(module: Module, verified: Module | None) -> int:
    """The last phase whose parts ``module`` shares, object for object, with the already verified module
    ``verified`` (-1: none). A phase's check reads only the parts of its own and earlier phases, so checks up
    to that phase hold for ``module`` as they did for ``verified``: passes evolve modules and keep what they
    do not change, so a pass's output needs the checks of what it added (and of anything it rebuilt)."""
    if not isinstance(verified, Module) or module.trajectories is not verified.trajectories or (
            module.input_hash, module.capacity, module.dp_size, module.chunk_size) != (
            verified.input_hash, verified.capacity, verified.dp_size, verified.chunk_size):
        return -1
    if verified.phase < Phase.COMPRESSED or module.trie is not verified.trie:
        return Phase.LOWERED
    same = Phase.COMPRESSED
    ours, theirs = module.microbatches, verified.microbatches
    if ours is None or theirs is None or len(ours) != len(theirs):
        return same
    for phase, fields in _MICROBATCH_FIELDS:
        if verified.phase < phase or not all(_same(getattr(a, f), getattr(b, f)) for a, b in zip(ours, theirs) for f in fields):
            return same
        same = phase
    return same


def verify(module: Module | LaidOutModule, *, verified: Module | None = None) -> None:
    """Raise :class:`IRVerificationError` unless ``module`` satisfies the invariants of its phase.

    ``verified``: a module that passed :func:`verify` before (the pass manager hands in a pass's input); the
    checks of the phases whose parts ``module`` shares with it, object for object, are not run again.
    """
    if isinstance(module, LaidOutModule):
        verify(module.module, verified=verified)
        dict(phase_checks())[Phase.LAID_OUT](module)
        return
    if not isinstance(module, Module):
        fail(f"expected an IR Module, got {type(module).__name__}")
    if module.phase > Phase.ROUNDED:
        fail(f"a Module cannot be at phase {module.phase}: code generation returns a LaidOutModule")
    unchanged = _unchanged_through(module, verified)
    for phase, check in phase_checks():
        if phase == Phase.LAID_OUT:
            break
        if unchanged < phase <= module.phase:
            check(module)
    if module.phase < Phase.PARTITIONED and module.microbatches is not None:
        fail(f"phase {module.phase} must not carry microbatches")
