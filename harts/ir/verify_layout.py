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

Compiling verifies every plan, so the checks are vectorised over all microbatches at once
(one numpy expression per invariant over the layouts' arrays laid end to end) instead of
looping over microbatches, sequences and trajectories: the per-microbatch Python overhead was
most of a compile's verification time. Arrays of one entry per semantic token (the map m,
ancestor rows) are checked microbatch by microbatch, to avoid copying them end to end.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from harts.ir.layout import (
    ARRAY_FIELDS,
    RUNS_FIELDS,
    LaidOutModule,
    MicrobatchLayout,
    RunsArray,
    concatenated_ranges,
    offsets_of,
    sequence_columns,
)
from harts.ir.nodes import Module, Phase
from harts.ir.verify_common import fail

#: arrays with one entry per row, semantic token or ancestor position: checked per microbatch as runs, never
#: concatenated (nor expanded, when a layout holds them as runs)
_TOKEN_FIELDS = RUNS_FIELDS


class _Flat:
    """Every layout's arrays laid end to end, with per-microbatch offsets (``bounds[name]``, K + 1 entries)."""

    def __init__(self, layouts: tuple[MicrobatchLayout, ...]):
        self.layouts = layouts
        self.arrays: dict[str, np.ndarray] = {}
        self.bounds: dict[str, np.ndarray] = {}
        for name in ARRAY_FIELDS:
            self.bounds[name] = offsets_of([layout.array_length(name) for layout in layouts])
            if name not in _TOKEN_FIELDS:
                parts = [getattr(layout, name) for layout in layouts]
                self.arrays[name] = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def expect(self, name: str, expected: np.ndarray, expected_bounds: np.ndarray) -> None:
        """``name`` of every layout equals the rounds' ``expected`` (laid end to end the same way)."""
        actual, bounds = self.arrays[name], self.bounds[name]
        sizes, expected_sizes = np.diff(bounds), np.diff(expected_bounds)
        wrong = np.flatnonzero(sizes != expected_sizes)
        if wrong.size:
            k = int(wrong[0])
            fail(f"microbatch {k}: layout field {name} has {int(sizes[k])} entries, the rounds need {int(expected_sizes[k])}")
        wrong = np.flatnonzero(actual != expected)
        if wrong.size:
            entry = int(wrong[0])
            k = int(np.searchsorted(bounds, entry, side="right")) - 1
            local = entry - int(bounds[k])
            fail(f"microbatch {k}: layout field {name} differs from the rounds at entry {local} "
                 f"({int(actual[entry])}, expected {int(expected[entry])})")


def _grouped_offsets(lengths: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR offsets of every group of ``lengths`` (groups of ``counts`` consecutive entries), laid end to end,
    and the bounds of each group's offsets (``counts + 1`` entries per group)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    bounds = offsets_of(counts + 1)
    out = np.zeros(int(bounds[-1]), dtype=np.int64)
    if lengths.size:
        group = np.repeat(np.arange(counts.size), counts)
        inclusive = np.cumsum(lengths)
        base = (inclusive - lengths)[offsets_of(counts)[:-1][counts > 0]]
        group_base = np.zeros(counts.size, dtype=np.int64)
        group_base[counts > 0] = base
        out[np.arange(lengths.size) + group + 1] = inclusive - group_base[group]
    return out, bounds


#: entries of a long array read per step of :func:`_breaks`: the step's temporaries stay in the core's cache
_SCAN_BLOCK = 1 << 16

#: the layout arrays checked as runs, and the step inside their runs: one row or token position per entry (1) or
#: one value repeated over a sequence's or trie node's rows (0)
_RUN_STEPS = {"trajectory_rows": 1, "ancestor_rows": 1, "row_position": 1, "row_trajectory": 0, "row_multiplicity": 0}


def _breaks(values: np.ndarray, step: int) -> np.ndarray:
    """The entries ``i`` where ``values[i] - values[i - 1] != step``: where ``values`` stops being one run.

    The one read of a long array the verifier makes (its range and its runs are read off the breaks), a block
    at a time into reused buffers: a whole-array difference would first write (and fault in) an array as long.
    """
    count = values.shape[0]
    if count < 2:
        return np.zeros(0, dtype=np.int64)
    block = min(_SCAN_BLOCK, count - 1)
    expected, broken = np.empty(block, dtype=np.int64), np.empty(block, dtype=bool)
    found = []
    for first in range(0, count - 1, block):
        size = min(block, count - 1 - first)
        previous = values[first:first + size]
        if step:
            previous = np.add(previous, step, out=expected[:size])
        np.not_equal(values[first + 1:first + 1 + size], previous, out=broken[:size])
        found.append(np.flatnonzero(broken[:size]) + (first + 1))
    return np.concatenate(found)


def _extremes(values: np.ndarray, breaks: np.ndarray) -> tuple[int, int] | None:
    """The least and largest entry of an array whose runs between ``breaks`` go up by 1 (None when empty): each
    run's first and last entries."""
    if not values.shape[0]:
        return None
    firsts = values[np.concatenate(([0], breaks))]
    lasts = values[np.concatenate((breaks - 1, [values.shape[0] - 1]))]
    return int(firsts.min()), int(lasts.max())


class _RunView:
    """A long layout array as the checks read it: ``breaks``, the entries where it stops going up by ``step``
    (the run checks need nothing else, besides a few entries' values: :meth:`at`), and ``extremes``.

    Read off its runs when the layout holds it as runs of that step, as ``lay-out`` builds it (a run that just
    continues the one before is no break: :func:`_run_views`, for every layout at once); otherwise off one
    scan of the array (:func:`_breaks`).
    """

    def __init__(self, step: int, breaks: np.ndarray, extremes: tuple[int, int] | None, *, array: np.ndarray | None = None,
                 starts: np.ndarray | None = None, offsets: np.ndarray | None = None):
        self.step, self.breaks, self.extremes = step, breaks, extremes
        self._array, self._starts, self._offsets = array, starts, offsets

    @classmethod
    def scanned(cls, held: RunsArray, step: int) -> "_RunView":
        array = held.array()
        breaks = _breaks(array, step)
        return cls(step, breaks, _extremes(array, breaks) if step == 1 else None, array=array)

    def at(self, entries: np.ndarray | int) -> np.ndarray | int:
        if self._array is not None:
            return self._array[entries]
        run = np.searchsorted(self._offsets, entries, side="right") - 1
        return self._starts[run] + self.step * (entries - self._offsets[run])


def _run_views(layouts: Sequence[MicrobatchLayout], name: str, step: int) -> list[_RunView]:
    """Every layout's array ``name`` as a :class:`_RunView`, the runs of all layouts read in one numpy expression
    each (a few calls per layout were most of the verifier's time on steps of hundreds of microbatches)."""
    held = [layout.runs_array(name) for layout in layouts]
    runs = [h.runs if h.runs is not None else (np.zeros(0, dtype=np.int64),) * 3 for h in held]
    starts, steps, lengths = (np.concatenate([r[part] for r in runs]) for part in range(3))
    bounds = offsets_of([r[0].shape[0] for r in runs])
    off_step = offsets_of(steps != step)
    uniform = (off_step[bounds[1:]] == off_step[bounds[:-1]]).tolist()
    entries = offsets_of(lengths)
    lasts = starts + step * (lengths - 1)
    # a run breaks its array where it does not continue the run before it in the same layout
    breaking = np.ones(starts.shape[0], dtype=bool)
    breaking[1:] = starts[1:] - lasts[:-1] != step
    breaking[bounds[:-1][bounds[:-1] < starts.shape[0]]] = False
    break_runs = np.flatnonzero(breaking)
    break_bounds = np.searchsorted(break_runs, bounds).tolist()
    lows, highs = np.minimum(starts, lasts), np.maximum(starts, lasts)
    views = []
    for k, (first, last) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
        if held[k].runs is None or not uniform[k]:
            views.append(_RunView.scanned(held[k], step))
            continue
        base = entries[first]
        extremes = (int(lows[first:last].min()), int(highs[first:last].max())) if last > first and step == 1 else None
        views.append(_RunView(step, entries[break_runs[break_bounds[k]:break_bounds[k + 1]]] - base, extremes,
                              starts=starts[first:last], offsets=entries[first:last + 1] - base))
    return views


def _check_headers(module: Module, layouts: tuple) -> list[dict[str, _RunView]]:
    """Each layout's kind, structure, microbatch, chunk size and size, layout after layout; returns its long
    arrays as the run checks read them (:class:`_RunView`, by name)."""
    for position, layout in enumerate(layouts):
        if not isinstance(layout, MicrobatchLayout):
            # the faults of the layouts before it come first, as in a check of one layout after another
            for microbatch, earlier in zip(module.microbatches[:position], layouts[:position]):
                _check_layout_header(module, microbatch, earlier, _scanned_views(earlier))
            fail(f"microbatch {module.microbatches[position].index}: expected a MicrobatchLayout, got {type(layout).__name__}")
    by_name = {name: _run_views(layouts, name, step) for name, step in _RUN_STEPS.items()}
    views = [{name: by_name[name][k] for name in _RUN_STEPS} for k in range(len(layouts))]
    sound = _structures_sound(layouts, views)
    for microbatch, layout, layout_views in zip(module.microbatches, layouts, views):
        _check_layout_header(module, microbatch, layout, layout_views, structure_sound=sound)
    return views


#: the offset arrays of a layout: (name, what counts its entries, what its last entry must be), as
#: :meth:`~harts.ir.layout.MicrobatchLayout.structure_problem` checks them
_OFFSETS = (
    ("round_seq_start", lambda layout: layout.num_rounds, lambda layout: layout.num_sequences),
    ("seq_row_start", lambda layout: layout.num_sequences, lambda layout: layout.num_rows),
    ("export_offsets", lambda layout: layout.num_sequences, lambda layout: layout.num_exports),
    ("ancestor_offsets", lambda layout: layout.num_sequences, lambda layout: layout.array_length("ancestor_rows")),
    ("trajectory_offsets", lambda layout: len(layout.trajectories), lambda layout: layout.array_length("trajectory_rows")),
)
_SEQUENCE_FIELDS = ("seq_trajectory", "seq_start", "seq_end", "seq_replay_start", "seq_state_source", "seq_state_chunk",
                    "seq_state_export")


def _structures_sound(layouts: tuple, views: list[dict[str, _RunView]]) -> bool:
    """Whether no layout has a :meth:`~harts.ir.layout.MicrobatchLayout.structure_problem`: its checks for all
    layouts at once, a few numpy expressions over their arrays end to end instead of a few calls per layout (most
    of the header checks' time on steps of hundreds of microbatches). False sends every layout through
    ``structure_problem``, which names the first problem."""
    if not layouts:
        return True
    rows = [layout.num_rows for layout in layouts]
    sequences = [layout.num_sequences for layout in layouts]
    exports = [layout.num_exports for layout in layouts]
    for layout, row_count, sequence_count, export_count, layout_views in zip(layouts, rows, sequences, exports, views):
        if layout.array_length("row_position") != row_count or layout.array_length("row_multiplicity") != row_count:
            return False
        if any(getattr(layout, name).shape[0] != sequence_count for name in _SEQUENCE_FIELDS):
            return False
        if layout.export_chunk.shape[0] != export_count:
            return False
        for name in ("trajectory_rows", "ancestor_rows"):
            extremes = layout_views[name].extremes
            if extremes is not None and (extremes[0] < 0 or extremes[1] >= row_count):
                return False
    for name, size_of, total_of in _OFFSETS:
        arrays = [getattr(layout, name) for layout in layouts]
        sizes = [size_of(layout) for layout in layouts]
        if any(size < 0 or array.shape[0] != size + 1 for array, size in zip(arrays, sizes)):
            return False
        # every array has an entry now: each starts at 0, ends at its total and never falls inside itself
        flat = np.concatenate(arrays)
        bounds = offsets_of([array.shape[0] for array in arrays])
        falls = np.diff(flat) < 0
        falls[bounds[1:-1] - 1] = False  # one layout's last entry and the next one's first
        if (flat[bounds[:-1]] != 0).any() or (flat[bounds[1:] - 1] != np.array([total_of(layout) for layout in layouts])).any() \
                or falls.any():
            return False
    counts = np.array(sequences, dtype=np.int64)
    state_exports = np.concatenate([layout.seq_state_export for layout in layouts])
    state_sources = np.concatenate([layout.seq_state_source for layout in layouts])
    return not ((state_exports >= np.repeat(np.array(exports, dtype=np.int64), counts)).any()
                or (state_sources >= np.repeat(counts, counts)).any())


def _scanned_views(layout: MicrobatchLayout) -> dict[str, _RunView]:
    return {name: _RunView.scanned(layout.runs_array(name), step) for name, step in _RUN_STEPS.items()}


def _check_layout_header(module: Module, microbatch, layout: MicrobatchLayout, views: dict[str, _RunView],
                         structure_sound: bool = False) -> None:
    """One layout's structure (unless ``structure_sound``: :func:`_structures_sound` checked it), microbatch,
    chunk size and size (``views``: its long arrays)."""
    where = f"microbatch {microbatch.index}"
    if not structure_sound:
        extremes = {name: views[name].extremes for name in ("trajectory_rows", "ancestor_rows")}
        problem = layout.structure_problem(row_extremes=extremes)
        if problem is not None:
            fail(f"{where}: layout: {problem}")
    if (layout.microbatch, layout.chunk_size) != (microbatch.index, module.chunk_size):
        fail(
            f"{where}: the layout is of microbatch {layout.microbatch} at chunk size {layout.chunk_size}, "
            f"expected microbatch {microbatch.index} at chunk size {module.chunk_size}"
        )
    if layout.num_rows != microbatch.work:
        fail(f"{where}: the layout has {layout.num_rows} rows but the microbatch's work is {microbatch.work}")


class _Rounds:
    """The rounded module's sequences and members, flat over all microbatches in layout order."""

    def __init__(self, module: Module):
        microbatches = module.microbatches
        self.member_counts = np.array([len(mb.trajectories) for mb in microbatches], dtype=np.int64)
        self.members = np.fromiter(itertools.chain.from_iterable(mb.trajectories for mb in microbatches), dtype=np.int64,
                                   count=int(self.member_counts.sum()))
        lengths = np.array([t.length for t in module.trajectories], dtype=np.int64)
        self.member_lengths = lengths[self.members]
        self.round_counts = np.array([len(mb.rounds) for mb in microbatches], dtype=np.int64)
        self.round_sizes = np.array([len(r.sequences) for mb in microbatches for r in mb.rounds], dtype=np.int64)
        self.sequence_counts = np.bincount(np.repeat(np.arange(len(microbatches)), self.round_counts),
                                           weights=self.round_sizes, minlength=len(microbatches)).astype(np.int64)
        sequences = [(r.index, s) for mb in microbatches for r in mb.rounds for s in r.sequences]
        self.sequences = sequences
        columns = sequence_columns(sequences)
        self.round, self.trajectory = columns["round"], columns["trajectory"]
        self.start, self.end, self.replay_start = columns["start"], columns["end"], columns["replay_start"]
        self.spans = self.end - self.start


def _wrong_run_entry(values: _RunView, starts: np.ndarray, firsts: np.ndarray, step: int) -> tuple[int, int] | None:
    """The first entry (and the value expected there) where ``values`` is not the runs that begin at ``starts``
    (ascending, the first at 0) with the values ``firsts`` and go up by ``step`` per entry; None when it is.

    ``values.breaks``: where ``values`` stops going up by ``step``: it is those runs when every break is a
    run's start and every run starts at its value, so neither it nor the expected array is ever built
    (these arrays have an entry per layout row or per semantic token). The first of those faults is the first
    wrong entry: entries before it are right, so a run's first wrong entry breaks its step or starts it."""
    wrong_first = np.flatnonzero(values.at(starts) != firsts)
    breaks = values.breaks
    at = np.searchsorted(starts, breaks)
    wrong_step = breaks[(at >= starts.shape[0]) | (starts[np.minimum(at, starts.shape[0] - 1)] != breaks)]
    candidates = ([int(starts[wrong_first[0]])] if wrong_first.size else []) + ([int(wrong_step[0])] if wrong_step.size else [])
    if not candidates:
        return None
    entry = min(candidates)
    run = int(np.searchsorted(starts, entry, side="right")) - 1
    return entry, int(firsts[run]) + step * (entry - int(starts[run]))


def _check_runs(k: int, name: str, views: dict[str, _RunView], starts: np.ndarray, firsts: np.ndarray) -> None:
    values = views[name]
    wrong = _wrong_run_entry(values, starts, firsts, _RUN_STEPS[name])
    if wrong is not None:
        entry, expected = wrong
        fail(f"microbatch {k}: layout field {name} differs from the rounds at entry {entry} ({int(values.at(entry))}, expected {expected})")


def _check_sequences(flat: _Flat, rounds: _Rounds, views: list[dict[str, _RunView]]) -> None:
    """The layout's sequences are the rounds', in round order, their rows back to back."""
    flat.expect("trajectories", rounds.members, offsets_of(rounds.member_counts))
    flat.expect("trajectory_offsets", *_grouped_offsets(rounds.member_lengths, rounds.member_counts))
    flat.expect("round_seq_start", *_grouped_offsets(rounds.round_sizes, rounds.round_counts))
    sequence_bounds = offsets_of(rounds.sequence_counts)
    for name, values in (("seq_round", rounds.round), ("seq_trajectory", rounds.trajectory), ("seq_start", rounds.start),
                         ("seq_end", rounds.end), ("seq_replay_start", rounds.replay_start)):
        flat.expect(name, values, sequence_bounds)
    flat.expect("seq_row_start", *_grouped_offsets(rounds.spans, rounds.sequence_counts))
    flat.expect("ancestor_offsets", *_grouped_offsets(rounds.start, rounds.sequence_counts))
    for k, layout in enumerate(flat.layouts):
        # sizes agree (the headers), and every sequence has rows (the rounds): each one starts a run
        starts = layout.seq_row_start[:-1]
        _check_runs(k, "row_trajectory", views[k], starts, layout.seq_trajectory)
        _check_runs(k, "row_position", views[k], starts, layout.seq_start)


class _Paths:
    """The members' trie paths, flat: one entry per (member, trie node) pair, members in layout order.

    ``node``: the pair's trie node; ``token``: where its positions start among all members' positions laid
    end to end; ``bounds``: each microbatch's pairs; ``token_bounds``: each microbatch's positions.
    """

    def __init__(self, module: Module, rounds: _Rounds):
        trie = module.trie
        self.parent, self.start, self.end, self.row = trie.node_arrays()
        owner, self.node = trie.paths_of(rounds.members, self.parent)
        self.member_start = offsets_of(rounds.member_lengths)
        self.token = self.member_start[owner] + self.start[self.node]
        member_microbatch = np.repeat(np.arange(rounds.member_counts.size), rounds.member_counts)
        self.bounds = np.searchsorted(member_microbatch[owner], np.arange(rounds.member_counts.size + 1))
        self.token_bounds = self.member_start[offsets_of(rounds.member_counts)]
        start_of = np.zeros(len(module.trajectories), dtype=np.int64)
        start_of[rounds.members] = self.member_start[:-1]
        #: where each sequence's trajectory starts among the members' positions
        self.sequence_member_start = start_of[rounds.trajectory]


class _Pieces:
    """Every sequence's rows cut at trie node boundaries: one piece per (sequence, trie node), in row order.

    ``node``; ``row``: the piece's first layout row in its microbatch; ``prefix``: the trie row it holds
    (rows of a piece hold consecutive trie rows); ``bounds``: each microbatch's pieces.
    """

    def __init__(self, paths: _Paths, rounds: _Rounds):
        first = paths.sequence_member_start + rounds.start
        last = paths.sequence_member_start + rounds.end - 1
        # pairs ascend in token order: the pair holding a token is the last that starts at or before it
        first_pair = np.searchsorted(paths.token, first, side="right") - 1
        last_pair = np.searchsorted(paths.token, last, side="right") - 1
        per_sequence = last_pair - first_pair + 1
        pair = concatenated_ranges(first_pair, per_sequence)
        sequence = np.repeat(np.arange(first.size), per_sequence)
        self.node = paths.node[pair]
        low = np.maximum(paths.token[pair], first[sequence])
        self.prefix = paths.row[self.node] + low - paths.token[pair]
        local_row_start = _grouped_offsets(rounds.spans, rounds.sequence_counts)[0]
        sequence_row = np.delete(local_row_start, offsets_of(rounds.sequence_counts + 1)[1:] - 1)
        self.row = sequence_row[sequence] + low - first[sequence]
        self.bounds = offsets_of(per_sequence)[offsets_of(rounds.sequence_counts)]


def _check_map(flat: _Flat, module: Module, rounds: _Rounds, views: list[dict[str, _RunView]]) -> None:
    """Member i's position p maps to the row holding its prefix up to p; multiplicities count the members
    through each row; ancestor rows are the trajectory's rows before the sequence's start.

    The rows hold distinct prefixes without a count of their own: the members' C = work distinct prefixes
    (checked by ``verify_partitioned``) each map to one of the C rows, so no two rows share one. The map is
    compared run by run, a run being one trie node on one member's path: its rows are the node's rows, which
    are consecutive layout rows because sequences are chains of whole segments (an invariant of the rounds,
    checked by ``verify_rounded``). Ancestor rows are compared run by run too, with the runs of the map.
    """
    paths = _Paths(module, rounds)
    pieces = _Pieces(paths, rounds)
    ancestors = _AncestorRuns(paths, rounds)
    first_layout_row = np.full(len(module.trie.nodes), -1, dtype=np.int64)
    members_through = np.zeros(len(module.trie.nodes), dtype=np.int64)
    for k, layout in enumerate(flat.layouts):
        piece_nodes = pieces.node[pieces.bounds[k]:pieces.bounds[k + 1]]
        piece_rows = pieces.row[pieces.bounds[k]:pieces.bounds[k + 1]]
        first_layout_row[piece_nodes] = piece_rows - (pieces.prefix[pieces.bounds[k]:pieces.bounds[k + 1]] - paths.row[piece_nodes])
        nodes = paths.node[paths.bounds[k]:paths.bounds[k + 1]]
        tokens = paths.token[paths.bounds[k]:paths.bounds[k + 1]] - paths.token_bounds[k]
        runs = first_layout_row[nodes]
        rows = views[k]["trajectory_rows"]
        wrong = _wrong_run_entry(rows, tokens, runs, 1)
        if wrong is not None:
            entry = wrong[0]
            member = int(np.searchsorted(layout.trajectory_offsets, entry, side="right")) - 1
            fail(
                f"microbatch {k}: trajectory {int(layout.trajectories[member])}, position "
                f"{entry - int(layout.trajectory_offsets[member])} maps to layout row {int(rows.at(entry))}, which holds another token prefix"
            )
        np.add.at(members_through, nodes, 1)
        _check_runs(k, "row_multiplicity", views[k], piece_rows, members_through[piece_nodes])
        members_through[nodes] = 0
        first_layout_row[piece_nodes] = -1  # the next microbatch must not see this one's rows
        # the map is right by now, so a sequence's ancestor rows are the map's runs of its member cut at its start
        part = slice(ancestors.bounds[k], ancestors.bounds[k + 1])
        _check_runs(k, "ancestor_rows", views[k], ancestors.start[part] - ancestors.entry_bounds[k],
                    runs[ancestors.pair[part] - paths.bounds[k]])


class _AncestorRuns:
    """Every sequence's ancestor positions ``[0, start)`` cut at trie node boundaries: one run per (sequence, trie
    node), in ancestor-row order. ``pair``: the run's (member, node) pair of :class:`_Paths` (a run starts where
    its pair does: ancestors begin at the path's root); ``start``: its first entry among all microbatches'
    ancestor rows end to end; ``bounds``: each microbatch's runs; ``entry_bounds``: each microbatch's first entry."""

    def __init__(self, paths: _Paths, rounds: _Rounds):
        first = paths.sequence_member_start
        prefix_end = first + rounds.start
        # pairs ascend in token order: the pairs holding ancestors run from the member's first to the one holding start - 1
        first_pair = np.searchsorted(paths.token, first, side="right") - 1
        per_sequence = np.where(rounds.start > 0, np.searchsorted(paths.token, prefix_end - 1, side="right") - first_pair, 0)
        self.pair = concatenated_ranges(first_pair, per_sequence)
        sequence = np.repeat(np.arange(first.size), per_sequence)
        token = paths.token[self.pair]
        pair_end = token + (paths.end - paths.start)[paths.node[self.pair]]
        lengths = np.minimum(pair_end, prefix_end[sequence]) - token
        self.start = offsets_of(lengths)[:-1]
        self.bounds = offsets_of(per_sequence)[offsets_of(rounds.sequence_counts)]
        self.entry_bounds = offsets_of(rounds.start)[offsets_of(rounds.sequence_counts)]


def _check_state_handoffs(flat: _Flat, module: Module, rounds: _Rounds) -> None:
    """Exports and state sources encode the IR's references, numbered within each microbatch."""
    chunk = module.chunk_size
    sequences = rounds.sequences
    export_counts = [len(sequence.exports) for _, sequence in sequences]
    positions = np.fromiter(itertools.chain.from_iterable(sequence.exports for _, sequence in sequences), dtype=np.int64,
                            count=sum(export_counts))
    export_chunks = (positions - np.repeat(rounds.replay_start, export_counts)) // chunk
    # each sequence's first export among all of them: a producer's exports are numbered from its microbatch's first
    first_export = list(itertools.accumulate(export_counts, initial=0))
    sources, exports, state_chunks = [], [], []
    first = 0
    for count in rounds.sequence_counts.tolist():
        local = sequences[first:first + count]
        number_of = {(r, sequence.trajectory): number for number, (r, sequence) in enumerate(local)}
        base = first_export[first]
        for _, sequence in local:
            state = sequence.state_from
            if state is None:
                sources.append(-1)
                exports.append(-1)
                state_chunks.append(-1)
                continue
            producer = number_of[(state.round, state.trajectory)]
            produced = local[producer][1]
            sources.append(producer)
            exports.append(first_export[first + producer] - base + produced.exports.index(state.position))
            state_chunks.append((state.position - produced.replay_start) // chunk)
        first += count
    sequence_bounds = offsets_of(rounds.sequence_counts)
    export_offsets, export_offset_bounds = _grouped_offsets(np.array(export_counts, dtype=np.int64), rounds.sequence_counts)
    flat.expect("export_offsets", export_offsets, export_offset_bounds)
    export_bounds = offsets_of(export_offsets[export_offset_bounds[1:] - 1])  # each microbatch's last offset: its exports
    flat.expect("export_position", positions, export_bounds)
    flat.expect("export_chunk", export_chunks, export_bounds)
    flat.expect("seq_state_source", np.array(sources, dtype=np.int64), sequence_bounds)
    flat.expect("seq_state_export", np.array(exports, dtype=np.int64), sequence_bounds)
    flat.expect("seq_state_chunk", np.array(state_chunks, dtype=np.int64), sequence_bounds)


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
    views = _check_headers(module, layouts)
    flat, rounds = _Flat(layouts), _Rounds(module)
    _check_sequences(flat, rounds, views)
    _check_map(flat, module, rounds, views)
    _check_state_handoffs(flat, module, rounds)
