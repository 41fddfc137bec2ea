"""Invariants of the ``laid_out`` phase (owned by code generation).

A layout is right when the runtime, executing from its arrays alone, computes for every
member trajectory what that trajectory computes when it runs on its own. The verifier checks
that against the rounded module the layout was generated from, property by property, and
never builds a layout itself (loading a plan verifies it without re-deriving it):

* structure: array sizes and CSR offsets agree (:meth:`MicrobatchLayout.structure_problem`);
* it lays out *these* rounds: sequences in round order with the IR's trajectories, spans and
  replay starts; a sequence's rows are positions ``[start, end)`` of its trajectory, in
  order, sequences back to back, ``C`` rows in all (the microbatch's work);
* the map m: the row of member i at position p holds the token prefix of i up to p. Prefixes
  are compared through the compact trie, whose rows are exactly the distinct prefixes of the
  batch: a layout row stands for one trie row, and no two layout rows for the same one;
* multiplicities count the members through each row; a sequence's ancestor rows are its
  trajectory's rows before ``start``;
* exports and state sources encode the IR's, chunk indices counted from the replay start of
  the exporting sequence. (That the states exist, are ready and lie on the right prefix is
  an invariant of the rounds, checked by ``verify_rounded``.)
"""

from __future__ import annotations

import numpy as np

from harts.ir.layout import LaidOutModule, MicrobatchLayout, concatenated_ranges, offsets_of, state_handoffs
from harts.ir.nodes import CompactTrie, Microbatch, Module, Phase
from harts.ir.verify_common import fail


def _expect(where: str, name: str, actual: np.ndarray, expected) -> None:
    expected = np.asarray(expected, dtype=np.int64).reshape(-1)
    if actual.shape != expected.shape:
        fail(f"{where}: layout field {name} has {actual.shape[0]} entries, the rounds need {expected.shape[0]}")
    wrong = np.flatnonzero(actual != expected)
    if wrong.size:
        k = int(wrong[0])
        fail(f"{where}: layout field {name} differs from the rounds at entry {k} ({int(actual[k])}, expected {int(expected[k])})")


def _trie_rows(trie: CompactTrie, trajectory: int) -> np.ndarray:
    """The compact trie row of every position of ``trajectory`` (m over the whole batch)."""
    path = trie.path(trajectory)
    return concatenated_ranges([node.row for node in path], [node.end - node.start for node in path])


def _verify_layout(module: Module, microbatch: Microbatch, layout: MicrobatchLayout) -> None:
    where = f"microbatch {microbatch.index}"
    if not isinstance(layout, MicrobatchLayout):
        fail(f"{where}: expected a MicrobatchLayout, got {type(layout).__name__}")
    problem = layout.structure_problem()
    if problem is not None:
        fail(f"{where}: layout: {problem}")
    if (layout.microbatch, layout.chunk_size) != (microbatch.index, module.chunk_size):
        fail(
            f"{where}: the layout is of microbatch {layout.microbatch} at chunk size {layout.chunk_size}, "
            f"expected microbatch {microbatch.index} at chunk size {module.chunk_size}"
        )
    members = np.asarray(microbatch.trajectories, dtype=np.int64)
    _expect(where, "trajectories", layout.trajectories, members)
    _expect(where, "trajectory_offsets", layout.trajectory_offsets, offsets_of([module.trajectories[i].length for i in members]))

    # The rounds, sequence by sequence in layout order.
    sequences = [(round_.index, sequence) for round_ in microbatch.rounds for sequence in round_.sequences]
    _expect(where, "round_seq_start", layout.round_seq_start, offsets_of([len(r.sequences) for r in microbatch.rounds]))
    for name, value in (
        ("seq_round", lambda r, s: r),
        ("seq_trajectory", lambda r, s: s.trajectory),
        ("seq_start", lambda r, s: s.start),
        ("seq_end", lambda r, s: s.end),
        ("seq_replay_start", lambda r, s: s.replay_start),
    ):
        _expect(where, name, getattr(layout, name), [value(r, s) for r, s in sequences])
    spans = layout.seq_end - layout.seq_start
    _expect(where, "seq_row_start", layout.seq_row_start, offsets_of(spans))
    if layout.num_rows != microbatch.work:
        fail(f"{where}: the layout has {layout.num_rows} rows but the microbatch's work is {microbatch.work}")
    _expect(where, "row_trajectory", layout.row_trajectory, np.repeat(layout.seq_trajectory, spans))
    _expect(where, "row_position", layout.row_position, concatenated_ranges(layout.seq_start, spans))

    # The map m, through the trie: row r holds the prefix of (row_trajectory[r], row_position[r]).
    member_prefix = np.concatenate([_trie_rows(module.trie, int(i)) for i in members])
    member_start = layout.trajectory_offsets[:-1]
    row_prefix = member_prefix[member_start[np.searchsorted(members, layout.row_trajectory)] + layout.row_position]
    holders = np.bincount(row_prefix, minlength=module.trie.compact_tokens)
    if holders.max() > 1:
        rows = np.flatnonzero(row_prefix == int(np.argmax(holders)))[:2]
        fail(f"{where}: layout rows {int(rows[0])} and {int(rows[1])} hold the same token prefix")
    mapped = row_prefix[layout.trajectory_rows]
    wrong = np.flatnonzero(mapped != member_prefix)
    if wrong.size:
        k = int(wrong[0])
        member = int(np.searchsorted(member_start, k, side="right")) - 1
        fail(
            f"{where}: trajectory {int(members[member])}, position {k - int(member_start[member])} maps to layout row "
            f"{int(layout.trajectory_rows[k])}, which holds another token prefix"
        )
    _expect(where, "row_multiplicity", layout.row_multiplicity, np.bincount(layout.trajectory_rows, minlength=layout.num_rows))
    _expect(where, "ancestor_offsets", layout.ancestor_offsets, offsets_of(layout.seq_start))
    own_start = member_start[np.searchsorted(members, layout.seq_trajectory)]
    _expect(where, "ancestor_rows", layout.ancestor_rows, layout.trajectory_rows[concatenated_ranges(own_start, layout.seq_start)])

    # Exports and state sources (the IR's own references, encoded as indices).
    for name, expected in state_handoffs(sequences, module.chunk_size).items():
        _expect(where, name, getattr(layout, name), expected)


def verify_laid_out(laid_out: LaidOutModule) -> None:
    """Every microbatch's layout is the layout of the rounded module's rounds (see the module docstring)."""
    module = laid_out.module
    if not isinstance(module, Module) or module.phase != Phase.ROUNDED:
        phase = getattr(module, "phase", type(module).__name__)
        fail(f"a laid-out module holds a rounded module, not {phase}")
    layouts = laid_out.layouts
    if not isinstance(layouts, tuple) or len(layouts) != len(module.microbatches):
        count = len(layouts) if isinstance(layouts, tuple) else type(layouts).__name__
        fail(f"a laid-out module needs one layout per microbatch: {len(module.microbatches)} microbatches, {count} layouts")
    for microbatch, layout in zip(module.microbatches, layouts):
        _verify_layout(module, microbatch, layout)
