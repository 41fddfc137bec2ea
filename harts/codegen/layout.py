"""Code generation, first step: the compact physical layout of every microbatch (§4.2).

The ``codegen`` pass calls :func:`lay_out` on a verified rounded module and the pass
manager verifies what it returns (:func:`harts.ir.verify_layout.verify_laid_out`), so the
builder trusts its input: every round invariant (chains of segments, replay on the chunk
grid, states exported by earlier rounds along the same prefix, each row output once) was
checked by ``verify_rounded`` and guaranteed by ``plan_forest``; nothing here checks them again.

Every microbatch is laid out at once: each array is one numpy expression over all microbatches'
sequences, members or trie paths laid end to end, and each layout holds its own part (a
microbatch's layout is the same as laid out alone, :func:`build_layout`). Laying out microbatch
by microbatch cost a few hundred small numpy calls per microbatch, most of a compile's layout
time on batches of hundreds of microbatches, and the GIL they hold kept threads from helping.
The long arrays (an entry per row or semantic token, :data:`~harts.ir.layout.RUNS_FIELDS`) are
handed over as the runs they are made of (:class:`~harts.ir.layout.RunsArray`: a trie node's
rows, a sequence's positions), expanded only when read: compiling never writes them.

The layout data class lives with the IR (:mod:`harts.ir.layout`); it is re-exported here.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import numpy as np

from harts.errors import IRVerificationError
from harts.ir.layout import (
    ARRAY_FIELDS,
    LAYOUT_FORMAT_VERSION,
    LaidOutModule,
    MicrobatchLayout,
    RunsArray,
    concatenated_ranges,
    decode_arithmetic_runs,
    encode_arithmetic_runs,
    offsets_of,
    sequence_columns,
    state_handoffs,
)
from harts.ir.nodes import Microbatch, Module, Phase

__all__ = [
    "ARRAY_FIELDS",
    "LAYOUT_FORMAT_VERSION",
    "MicrobatchLayout",
    "build_layout",
    "decode_arithmetic_runs",
    "encode_arithmetic_runs",
    "lay_out",
]

logger = logging.getLogger(__name__)


class _Sequences:
    """The sequences of some microbatches in layout order (microbatch, round, order in the round), flat.

    ``bounds``: each microbatch's sequences; ``row_start`` [Q + 1]: each sequence's first row among all
    these microbatches' rows laid end to end (``row_bounds``: each microbatch's rows).
    """

    def __init__(self, microbatches: Sequence[Microbatch]):
        self.pairs = [[(round_.index, sequence) for round_ in mb.rounds for sequence in round_.sequences] for mb in microbatches]
        self.bounds = offsets_of([len(pairs) for pairs in self.pairs])
        flat = list(itertools.chain.from_iterable(self.pairs))
        columns = sequence_columns(flat)
        self.round, self.trajectory = columns["round"], columns["trajectory"]
        self.start, self.end, self.replay_start = columns["start"], columns["end"], columns["replay_start"]
        self.spans = self.end - self.start
        self.row_start = offsets_of(self.spans)
        self.row_bounds = self.row_start[self.bounds]
        self.microbatch = np.repeat(np.arange(len(microbatches), dtype=np.int64), np.diff(self.bounds))


def _first_rows(module: Module, microbatches: Sequence[Microbatch], sequences: _Sequences) -> tuple[np.ndarray, np.ndarray]:
    """Every (microbatch, used trie node) pair, as the sorted key ``microbatch * nodes + node``, and the node's
    first row in its microbatch: where the sequence running its segment puts it (each used node is output once)."""
    trie, node_count = module.trie, len(module.trie.nodes)
    _, node_start, _, _ = trie.node_arrays()
    segment_rows, segment_starts, node_counts, nodes = [], [], [], []
    for k, (microbatch, pairs) in enumerate(zip(microbatches, sequences.pairs)):
        segments = microbatch.segments
        first_row = int(sequences.row_start[sequences.bounds[k]]) - int(sequences.row_bounds[k])
        base = k * node_count
        for _, sequence in pairs:
            for segment_id in sequence.segments:
                segment = segments[segment_id]
                segment_rows.append(first_row + segment.start - sequence.start)
                segment_starts.append(segment.start)
                node_counts.append(len(segment.nodes))
                nodes.extend(base + node for node in segment.nodes)
            first_row += sequence.end - sequence.start
    keys = np.asarray(nodes, dtype=np.int64)
    counts = np.asarray(node_counts, dtype=np.int64)
    rows = np.repeat(np.asarray(segment_rows, dtype=np.int64) - np.asarray(segment_starts, dtype=np.int64), counts)
    rows += node_start[keys % node_count] if keys.size else 0
    order = np.argsort(keys, kind="stable")
    return keys[order], rows[order]


class _Paths:
    """The members' trie paths, flat: one pair per (member, trie node), members of every microbatch in order, each
    path root first. ``row``: the pair's first row in its microbatch; ``length``: its node's positions."""

    def __init__(self, module: Module, microbatches: Sequence[Microbatch], sequences: _Sequences):
        trie, node_count = module.trie, len(module.trie.nodes)
        parent, self.node_start, self.node_end, _ = trie.node_arrays()
        member_counts = np.array([len(mb.trajectories) for mb in microbatches], dtype=np.int64)
        self.members = np.fromiter(itertools.chain.from_iterable(mb.trajectories for mb in microbatches), dtype=np.int64,
                                   count=int(member_counts.sum()))
        self.member_bounds = offsets_of(member_counts)
        member_microbatch = np.repeat(np.arange(len(microbatches), dtype=np.int64), member_counts)
        lengths = np.fromiter((t.length for t in module.trajectories), dtype=np.int64, count=len(module.trajectories))
        self.member_token_start = offsets_of(lengths[self.members])
        self.owner, self.node = trie.paths_of(self.members, parent)
        used_keys, used_rows = _first_rows(module, microbatches, sequences)
        self.used_keys, self.used_rows = used_keys, used_rows
        self.used = np.searchsorted(used_keys, member_microbatch[self.owner] * node_count + self.node)
        self.row = used_rows[self.used]
        self.length = self.node_end[self.node] - self.node_start[self.node]
        # members ascend inside a microbatch, so (microbatch, trajectory) keys ascend over all of them
        self.member_key = member_microbatch * len(module.trajectories) + self.members
        self.node_count = node_count


class _Runs:
    """One long layout array of every microbatch as arithmetic runs end to end, and each microbatch's runs
    (``bounds``): a microbatch's array is :class:`~harts.ir.layout.RunsArray` of its part, never expanded here."""

    def __init__(self, starts: np.ndarray, step: int, lengths: np.ndarray, bounds: np.ndarray):
        self.starts, self.lengths, self.bounds = starts, lengths, bounds
        self.steps = np.full(starts.shape[0], step, dtype=np.int64)

    def of(self, k: int) -> RunsArray:
        part = slice(int(self.bounds[k]), int(self.bounds[k + 1]))
        return RunsArray.from_runs(self.starts[part], self.steps[part], self.lengths[part])


def _row_multiplicity(paths: _Paths, sequences: _Sequences) -> _Runs:
    """q of every row: the members through the trie node the row belongs to, one run per used trie node.

    Every row is one position of one used trie node (each output once, by the rounds), so q is each used
    node's member count repeated over its rows in row order (the used nodes ordered by microbatch, then row).
    """
    through = np.bincount(paths.used, minlength=paths.used_keys.size)
    microbatch, nodes = np.divmod(paths.used_keys, paths.node_count)
    by_row = np.argsort(paths.used_rows + sequences.row_bounds[microbatch], kind="stable")
    bounds = offsets_of(np.bincount(microbatch, minlength=sequences.bounds.size - 1))
    return _Runs(through[by_row], 0, (paths.node_end[nodes] - paths.node_start[nodes])[by_row], bounds)


def _ancestor_rows(paths: _Paths, sequences: _Sequences, trajectories: int) -> _Runs:
    """Every sequence's ancestor rows (its trajectory's rows at positions ``[0, start)``): the trie runs of its
    member's path cut at ``start``, sequence after sequence."""
    # pairs ascend by (member, node start): a path runs root first; those starting before ``start`` hold the prefix
    span = int(paths.node_end.max(initial=0)) + 1
    keys = paths.owner * span + paths.node_start[paths.node]
    member = np.searchsorted(paths.member_key, sequences.microbatch * trajectories + sequences.trajectory)
    first = np.searchsorted(keys, member * span)
    counts = np.searchsorted(keys, member * span + sequences.start) - first
    pairs = concatenated_ranges(first, counts)
    nodes = paths.node[pairs]
    cut = np.minimum(paths.node_end[nodes], np.repeat(sequences.start, counts))
    return _Runs(paths.row[pairs], 1, cut - paths.node_start[nodes], offsets_of(counts)[sequences.bounds])


def _local_offsets(offsets: np.ndarray, first: int, last: int) -> np.ndarray:
    """``offsets[first : last + 1]`` counted from its first entry: one microbatch's part of offsets over all."""
    return offsets[first:last + 1] - offsets[first]


def _lay_out_microbatches(module: Module, microbatches: Sequence[Microbatch]) -> list[MicrobatchLayout]:
    """The layouts of ``microbatches`` (of a verified rounded module), each array built once over all of them."""
    sequences = _Sequences(microbatches)
    paths = _Paths(module, microbatches, sequences)
    trajectory_rows = _Runs(paths.row, 1, paths.length, np.searchsorted(paths.owner, paths.member_bounds))
    ancestor_rows = _ancestor_rows(paths, sequences, len(module.trajectories))
    row_trajectory = _Runs(sequences.trajectory, 0, sequences.spans, sequences.bounds)
    row_position = _Runs(sequences.start, 1, sequences.spans, sequences.bounds)
    row_multiplicity = _row_multiplicity(paths, sequences)
    ancestor_start = offsets_of(sequences.start)
    layouts = []
    for k, microbatch in enumerate(microbatches):
        first, last = int(sequences.bounds[k]), int(sequences.bounds[k + 1])
        member_first, member_last = int(paths.member_bounds[k]), int(paths.member_bounds[k + 1])
        layout = MicrobatchLayout(
            microbatch=microbatch.index,
            chunk_size=module.chunk_size,
            trajectories=paths.members[member_first:member_last],
            trajectory_offsets=_local_offsets(paths.member_token_start, member_first, member_last),
            trajectory_rows=trajectory_rows.of(k),
            row_trajectory=row_trajectory.of(k),
            row_position=row_position.of(k),
            row_multiplicity=row_multiplicity.of(k),
            round_seq_start=offsets_of([len(round_.sequences) for round_ in microbatch.rounds]),
            seq_round=sequences.round[first:last],
            seq_trajectory=sequences.trajectory[first:last],
            seq_start=sequences.start[first:last],
            seq_end=sequences.end[first:last],
            seq_replay_start=sequences.replay_start[first:last],
            seq_row_start=_local_offsets(sequences.row_start, first, last),
            ancestor_offsets=_local_offsets(ancestor_start, first, last),
            ancestor_rows=ancestor_rows.of(k),
            **state_handoffs(sequences.pairs[k], module.chunk_size),
        )
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("layout of microbatch %d: %d rows, %d sequences in %d rounds, %d exports, %d replay rows",
                         microbatch.index, layout.num_rows, layout.num_sequences, layout.num_rounds, layout.num_exports,
                         layout.replay_tokens)
        layouts.append(layout)
    return layouts


def _check_rounded(module: Module) -> None:
    if not isinstance(module, Module) or module.phase != Phase.ROUNDED:
        phase = getattr(module, "phase", type(module).__name__)
        raise IRVerificationError(f"a compact layout needs a rounded module; this one is {phase}")


def build_layout(module: Module, microbatch_index: int) -> MicrobatchLayout:
    """Lay out microbatch ``microbatch_index`` of a verified ``rounded`` module (alone: the layout
    :func:`lay_out` gives it among all the others)."""
    _check_rounded(module)
    microbatches = module.microbatches
    if not 0 <= microbatch_index < len(microbatches):
        raise IRVerificationError(f"the module has no microbatch {microbatch_index} ({len(microbatches)} microbatches)")
    return _lay_out_microbatches(module, [microbatches[microbatch_index]])[0]


def lay_out(module: Module) -> LaidOutModule:
    """The ``laid_out`` phase of a verified rounded module: one layout per microbatch, in order, all built at once
    (each array its microbatch's part of one array, or of one list of runs, over all of them)."""
    _check_rounded(module)
    return LaidOutModule(module=module, layouts=tuple(_lay_out_microbatches(module, module.microbatches)))
