"""The compact physical layout of one microbatch (§4.2).

Every layer of the model works on one row order, fixed per microbatch by its rounds:
rows are ordered by round, then by input sequence inside the round, then by position.
The rows of a sequence are the positions ``[start, end)`` it produces outputs for, so
the tokens of one input sequence are contiguous and all sequences of a round are
adjacent. Replay rows ``[replay_start, start)`` are not rows of their own: they are
ancestors' rows, gathered when a linear-attention call needs them.

Everything here is a flat numpy ``int64`` array (CSR for ragged lists), built once from the
rounded IR and deterministic, so it can be cached, stored in the plan artifact and turned
into index tensors by code generation.

Glossary of the arrays (``C`` rows, ``Q`` sequences, ``R`` rounds, ``E`` exports, ``M``
member trajectories):

* ``row_trajectory``, ``row_position`` [C]: a trajectory through the row and the row's
  position in it (the token is ``tokens[row_trajectory][row_position]``; RoPE uses the position).
* ``row_multiplicity`` [C]: q, how many member trajectories pass through the row.
* ``seq_round``, ``seq_trajectory``, ``seq_start``, ``seq_end``, ``seq_replay_start`` [Q].
* ``seq_row_start`` [Q + 1]: rows of sequence j are ``seq_row_start[j] : seq_row_start[j+1]``.
* ``round_seq_start`` [R + 1]: sequences of round r are ``round_seq_start[r] : round_seq_start[r+1]``.
* ``seq_state_source`` [Q]: the sequence whose export is sequence j's initial state (-1: zero state);
  ``seq_state_chunk`` [Q]: the chunk index (counted from the producer's ``replay_start``) it is
  exported at; ``seq_state_export`` [Q]: its index in the flat export list (-1: zero state).
* ``export_offsets`` [Q + 1], ``export_position`` [E], ``export_chunk`` [E]: per sequence,
  the boundary positions it exports and their chunk indices.
* ``ancestor_offsets`` [Q + 1], ``ancestor_rows``: per sequence, the rows of positions
  ``[0, start)`` of its true ancestors (replay gathers, convolution context, attention KV).
* ``trajectories`` [M], ``trajectory_offsets`` [M + 1], ``trajectory_rows``: per member
  trajectory (ascending batch index), the rows of its positions ``[0, length)``: the map m.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import numpy as np

from harts.errors import IRVerificationError, PlanArtifactError, RolloutInputError
from harts.ir.nodes import Microbatch, Module, Phase

logger = logging.getLogger(__name__)

LAYOUT_FORMAT_VERSION = 2


def encode_arithmetic_runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split ``values`` into maximal runs with a constant step: (first value, step, length) each.

    Row maps are long runs of consecutive rows or repeated values, so a full SWE-like step's
    arrays (tens of millions of entries) shrink to thousands of runs.
    """
    values = np.asarray(values, dtype=np.int64).reshape(-1)
    count = len(values)
    if count == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    steps = np.diff(values)
    # changes: the diff indices k whose step differs from step k-1, i.e. where a new run may begin.
    changes = np.flatnonzero(steps[1:] != steps[:-1]) + 1
    starts, run_steps, lengths = [], [], []
    first = 0
    while first < count:
        if first == count - 1:
            starts.append(values[first]); run_steps.append(0); lengths.append(1)
            break
        step = steps[first]
        later = np.searchsorted(changes, first, side="right")
        last = int(changes[later]) if later < len(changes) else count - 1
        starts.append(values[first]); run_steps.append(step); lengths.append(last - first + 1)
        first = last + 1
    return np.asarray(starts, dtype=np.int64), np.asarray(run_steps, dtype=np.int64), np.asarray(lengths, dtype=np.int64)


def decode_arithmetic_runs(starts: np.ndarray, steps: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and lengths.min() < 1:
        raise PlanArtifactError("layout tensors hold a run of non-positive length")
    total = int(lengths.sum())
    run_of_entry = np.repeat(np.arange(len(lengths)), lengths)
    offset_in_run = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.asarray(starts, dtype=np.int64)[run_of_entry] + np.asarray(steps, dtype=np.int64)[run_of_entry] * offset_in_run

#: The arrays of a layout, in the order they are stored.
ARRAY_FIELDS: tuple[str, ...] = (
    "trajectories",
    "trajectory_offsets",
    "trajectory_rows",
    "row_trajectory",
    "row_position",
    "row_multiplicity",
    "round_seq_start",
    "seq_round",
    "seq_trajectory",
    "seq_start",
    "seq_end",
    "seq_replay_start",
    "seq_row_start",
    "seq_state_source",
    "seq_state_chunk",
    "seq_state_export",
    "export_offsets",
    "export_position",
    "export_chunk",
    "ancestor_offsets",
    "ancestor_rows",
)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for every (s, n), vectorised."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(np.asarray(starts, dtype=np.int64) - offsets, lengths) + np.arange(total, dtype=np.int64)


def _offsets(lengths) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=out[1:])
    return out


def _find_microbatch(module: Module, microbatch_index: int) -> Microbatch:
    microbatches = module.microbatches or ()
    if 0 <= microbatch_index < len(microbatches) and microbatches[microbatch_index].index == microbatch_index:
        return microbatches[microbatch_index]
    for microbatch in microbatches:
        if microbatch.index == microbatch_index:
            return microbatch
    raise IRVerificationError(f"the module has no microbatch {microbatch_index} ({len(microbatches)} microbatches)")


@attrs.frozen(eq=False, slots=False)
class MicrobatchLayout:
    """The compact physical ordering of one microbatch and the index lists derived from it."""

    microbatch: int
    chunk_size: int
    trajectories: np.ndarray
    trajectory_offsets: np.ndarray
    trajectory_rows: np.ndarray
    row_trajectory: np.ndarray
    row_position: np.ndarray
    row_multiplicity: np.ndarray
    round_seq_start: np.ndarray
    seq_round: np.ndarray
    seq_trajectory: np.ndarray
    seq_start: np.ndarray
    seq_end: np.ndarray
    seq_replay_start: np.ndarray
    seq_row_start: np.ndarray
    seq_state_source: np.ndarray
    seq_state_chunk: np.ndarray
    seq_state_export: np.ndarray
    export_offsets: np.ndarray
    export_position: np.ndarray
    export_chunk: np.ndarray
    ancestor_offsets: np.ndarray
    ancestor_rows: np.ndarray
    #: Generated programs and torch index tensors, keyed by their consumer (filled lazily).
    cache: dict = attrs.field(factory=dict, repr=False)

    # ------------------------------------------------------------------ sizes
    @property
    def num_rows(self) -> int:
        return int(self.row_trajectory.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.seq_round.shape[0])

    @property
    def num_rounds(self) -> int:
        return int(self.round_seq_start.shape[0]) - 1

    @property
    def num_exports(self) -> int:
        return int(self.export_position.shape[0])

    @property
    def semantic_tokens(self) -> int:
        return int(self.trajectory_rows.shape[0])

    @property
    def replay_tokens(self) -> int:
        return int((self.seq_start - self.seq_replay_start).sum())

    # ----------------------------------------------------------- ragged rows
    def sequence_rows(self, sequence: int) -> np.ndarray:
        return np.arange(self.seq_row_start[sequence], self.seq_row_start[sequence + 1], dtype=np.int64)

    def ancestor_rows_of(self, sequence: int) -> np.ndarray:
        return self.ancestor_rows[self.ancestor_offsets[sequence] : self.ancestor_offsets[sequence + 1]]

    def exports_of(self, sequence: int) -> np.ndarray:
        return self.export_position[self.export_offsets[sequence] : self.export_offsets[sequence + 1]]

    def rows_of_trajectory(self, trajectory: int) -> np.ndarray:
        """m restricted to one member trajectory: the rows of its positions ``0 .. length-1``."""
        member = int(np.searchsorted(self.trajectories, trajectory))
        if member >= len(self.trajectories) or self.trajectories[member] != trajectory:
            raise KeyError(f"trajectory {trajectory} is not in microbatch {self.microbatch}")
        return self.trajectory_rows[self.trajectory_offsets[member] : self.trajectory_offsets[member + 1]]

    def export_sequence(self) -> np.ndarray:
        """[E] the sequence that exports each state."""
        return np.repeat(np.arange(self.num_sequences, dtype=np.int64), np.diff(self.export_offsets))

    def replay_rows(self, sequence: int) -> np.ndarray:
        """Rows of the replay positions ``[replay_start, start)`` of a sequence (ancestors' rows)."""
        ancestors = self.ancestor_rows_of(sequence)
        return ancestors[int(self.seq_replay_start[sequence]) :]

    def gather_rows(self, per_trajectory, field: str) -> np.ndarray:
        """Per-token values (one array ``[len, ...]`` per batch trajectory) on the compact rows: ``[C, ...]``.

        Every member trajectory through a row must carry the same value there; otherwise the
        row has no single value and :class:`~harts.errors.RolloutInputError` names both
        trajectories, the position and ``field``.
        """
        members = [int(t) for t in self.trajectories]
        values = np.concatenate([np.asarray(per_trajectory[t]) for t in members])
        if values.shape[0] != self.semantic_tokens:
            raise RolloutInputError(f"field '{field}': {values.shape[0]} values for the {self.semantic_tokens} tokens of microbatch {self.microbatch}")
        rows = self.trajectory_rows
        _, first = np.unique(rows, return_index=True)  # rows are 0..C-1, each reached by some member
        gathered = values[first]
        differs = gathered[rows] != values
        if differs.ndim > 1:
            differs = differs.reshape(len(rows), -1).any(axis=1)
        if differs.any():
            semantic = int(np.flatnonzero(differs)[0])
            row = int(rows[semantic])
            owner = np.searchsorted(self.trajectory_offsets, [first[row], semantic], side="right") - 1
            position = int(semantic - self.trajectory_offsets[owner[1]])
            raise RolloutInputError(
                f"field '{field}': trajectories {members[owner[0]]} and {members[owner[1]]} share the token at position "
                f"{position} (one compact row) but give it different values ({gathered[row].tolist()} vs "
                f"{values[semantic].tolist()}); a shared row is computed once and can carry only one"
            )
        return gathered

    def input_ids(self, tokens) -> np.ndarray:
        """Token id of every row, from the batch's token arrays (a sequence indexed by trajectory)."""
        out = np.empty(self.num_rows, dtype=np.int64)
        for sequence in range(self.num_sequences):
            trajectory = int(self.seq_trajectory[sequence])
            start, end = int(self.seq_start[sequence]), int(self.seq_end[sequence])
            out[self.seq_row_start[sequence] : self.seq_row_start[sequence + 1]] = tokens[trajectory][start:end]
        return out

    # --------------------------------------------------------------- artifact
    def to_tensors(self) -> dict[str, np.ndarray]:
        """A flat dict of int64 arrays with stable keys (the plan artifact stores it).

        Each layout array is stored as arithmetic runs (``<name>.run_start``, ``.run_step``,
        ``.run_length``); :meth:`from_tensors` expands them.
        """
        tensors = {"format_version": np.array([LAYOUT_FORMAT_VERSION], dtype=np.int64),
                   "microbatch": np.array([self.microbatch], dtype=np.int64),
                   "chunk_size": np.array([self.chunk_size], dtype=np.int64)}
        for name in ARRAY_FIELDS:
            starts, steps, lengths = encode_arithmetic_runs(getattr(self, name))
            tensors[f"{name}.run_start"] = starts
            tensors[f"{name}.run_step"] = steps
            tensors[f"{name}.run_length"] = lengths
        return tensors

    @classmethod
    def from_tensors(cls, tensors: dict[str, Any]) -> "MicrobatchLayout":
        run_keys = [f"{name}.{part}" for name in ARRAY_FIELDS for part in ("run_start", "run_step", "run_length")]
        missing = [name for name in ("format_version", "microbatch", "chunk_size", *run_keys) if name not in tensors]
        if missing:
            raise PlanArtifactError(f"layout tensors lack {', '.join(missing)}")
        version = int(np.asarray(tensors["format_version"]).reshape(-1)[0])
        if version != LAYOUT_FORMAT_VERSION:
            raise PlanArtifactError(f"layout format version {version} is not supported (expected {LAYOUT_FORMAT_VERSION})")
        arrays = {}
        for name in ARRAY_FIELDS:
            parts = [np.asarray(tensors[f"{name}.{part}"], dtype=np.int64).reshape(-1) for part in ("run_start", "run_step", "run_length")]
            if not len(parts[0]) == len(parts[1]) == len(parts[2]):
                raise PlanArtifactError(f"layout tensors of {name}: run arrays differ in length")
            arrays[name] = decode_arithmetic_runs(*parts)
        layout = cls(
            microbatch=int(np.asarray(tensors["microbatch"]).reshape(-1)[0]),
            chunk_size=int(np.asarray(tensors["chunk_size"]).reshape(-1)[0]),
            **arrays,
        )
        layout.check()
        return layout

    def check(self) -> None:
        """Cheap structural checks (sizes and offsets agree); raises PlanArtifactError."""
        rows, sequences, exports = self.num_rows, self.num_sequences, self.num_exports

        def fail(message: str) -> None:
            raise PlanArtifactError(f"layout of microbatch {self.microbatch}: {message}")

        for name in ("row_position", "row_multiplicity"):
            if getattr(self, name).shape[0] != rows:
                fail(f"{name} has {getattr(self, name).shape[0]} entries, expected {rows}")
        for name in ("seq_trajectory", "seq_start", "seq_end", "seq_replay_start", "seq_state_source", "seq_state_chunk", "seq_state_export"):
            if getattr(self, name).shape[0] != sequences:
                fail(f"{name} has {getattr(self, name).shape[0]} entries, expected {sequences}")
        for name, size, total in (
            ("seq_row_start", sequences, rows),
            ("export_offsets", sequences, exports),
            ("ancestor_offsets", sequences, self.ancestor_rows.shape[0]),
            ("trajectory_offsets", len(self.trajectories), self.trajectory_rows.shape[0]),
        ):
            offsets = getattr(self, name)
            if offsets.shape[0] != size + 1 or offsets[0] != 0 or offsets[-1] != total or np.any(np.diff(offsets) < 0):
                fail(f"{name} is not a valid offset array over {total} entries")
        if self.round_seq_start[0] != 0 or self.round_seq_start[-1] != sequences or np.any(np.diff(self.round_seq_start) < 0):
            fail("round_seq_start is not a valid offset array")
        for name in ("trajectory_rows", "ancestor_rows"):
            values = getattr(self, name)
            if values.size and (values.min() < 0 or values.max() >= rows):
                fail(f"{name} holds a row outside [0, {rows})")
        if self.export_chunk.shape[0] != exports:
            fail("export_chunk and export_position differ in length")
        if np.any(self.seq_state_export >= exports) or np.any(self.seq_state_source >= sequences):
            fail("a state source points past the exports or sequences")

    # ------------------------------------------------------------------ build
    @classmethod
    def build(cls, module: Module, microbatch_index: int) -> "MicrobatchLayout":
        """Lay out microbatch ``microbatch_index`` of a ``rounded`` module, checking the plan as it goes."""
        if module.phase < Phase.ROUNDED or module.trie is None:
            raise IRVerificationError(f"a compact layout needs a rounded module; this one is {module.phase}")
        microbatch = _find_microbatch(module, microbatch_index)
        where = f"microbatch {microbatch.index}"
        if microbatch.rounds is None or microbatch.segments is None:
            raise IRVerificationError(f"{where} has no rounds; run 'segment' and 'min-call-rounds' first")
        chunk = module.chunk_size
        trie = module.trie
        segments = microbatch.segments
        members = np.asarray(sorted(microbatch.trajectories), dtype=np.int64)
        lengths = np.array([module.trajectories[int(i)].length for i in members], dtype=np.int64)

        # Sequences in layout order: round, then order inside the round.
        sequences = [(r, sequence) for r, rnd in enumerate(microbatch.rounds) for sequence in rnd.sequences]
        for r, rnd in enumerate(microbatch.rounds):
            if rnd.index != r:
                raise IRVerificationError(f"{where}: round at position {r} has index {rnd.index}")
        count = len(sequences)
        seq_round = np.array([r for r, _ in sequences], dtype=np.int64)
        seq_trajectory = np.array([s.trajectory for _, s in sequences], dtype=np.int64)
        seq_start = np.array([s.start for _, s in sequences], dtype=np.int64)
        seq_end = np.array([s.end for _, s in sequences], dtype=np.int64)
        seq_replay_start = np.array([s.replay_start for _, s in sequences], dtype=np.int64)
        seq_row_start = _offsets(seq_end - seq_start)
        round_seq_start = _offsets([len(rnd.sequences) for rnd in microbatch.rounds])

        # Row of the first position of every trie node this microbatch uses.
        segment_row = np.full(len(segments), -1, dtype=np.int64)
        for number, (r, sequence) in enumerate(sequences):
            label = f"{where}, round {r}, sequence of trajectory {sequence.trajectory}"
            if not sequence.segments:
                raise IRVerificationError(f"{label}: runs no segments")
            expected = sequence.start
            for segment_id in sequence.segments:
                if not 0 <= segment_id < len(segments):
                    raise IRVerificationError(f"{label}: segment {segment_id} does not exist")
                segment = segments[segment_id]
                if segment.start != expected:
                    raise IRVerificationError(f"{label}: segment {segment_id} starts at {segment.start}, expected {expected}")
                if segment_row[segment_id] >= 0:
                    raise IRVerificationError(f"{label}: segment {segment_id} is executed twice")
                segment_row[segment_id] = seq_row_start[number] + segment.start - sequence.start
                expected = segment.end
            if expected != sequence.end:
                raise IRVerificationError(f"{label}: its segments end at {expected}, the sequence at {sequence.end}")
        unexecuted = np.flatnonzero(segment_row < 0)
        if unexecuted.size:
            raise IRVerificationError(f"{where}: segment {int(unexecuted[0])} is executed by no sequence")
        node_row: dict[int, int] = {}
        for segment in segments:
            for node_id in segment.nodes:
                node_row[node_id] = int(segment_row[segment.id]) + trie.nodes[node_id].start - segment.start

        # The map m: rows of every member trajectory, walking its trie path.
        per_trajectory: list[np.ndarray] = []
        for trajectory in members:
            path = []
            node_id = trie.leaf[int(trajectory)]
            while node_id >= 0:
                path.append(node_id)
                node_id = trie.nodes[node_id].parent
            path.reverse()
            try:
                starts = [node_row[n] for n in path]
            except KeyError as error:
                raise IRVerificationError(
                    f"{where}: trajectory {int(trajectory)} passes through trie node {error.args[0]}, which no segment covers"
                ) from None
            spans = [trie.nodes[n].end - trie.nodes[n].start for n in path]
            per_trajectory.append(_ranges(np.array(starts), np.array(spans)))
        trajectory_offsets = _offsets(lengths)
        trajectory_rows = np.concatenate(per_trajectory) if per_trajectory else np.zeros(0, dtype=np.int64)
        rows = int(seq_row_start[-1])
        if trajectory_rows.size and trajectory_rows.max() >= rows:
            raise IRVerificationError(f"{where}: a trajectory maps past the {rows} rows of the layout")
        multiplicity = np.bincount(trajectory_rows, minlength=rows).astype(np.int64)
        if rows and multiplicity.min() == 0:
            raise IRVerificationError(f"{where}: row {int(np.argmin(multiplicity))} belongs to no member trajectory")
        if rows != microbatch.work:
            raise IRVerificationError(f"{where}: the rounds lay out {rows} rows but the microbatch's work is {microbatch.work}")

        member_index = {int(t): k for k, t in enumerate(members)}

        def trajectory_prefix(trajectory: int, end: int, label: str) -> np.ndarray:
            if trajectory not in member_index:
                raise IRVerificationError(f"{label}: trajectory {trajectory} is not a member of {where}")
            k = member_index[trajectory]
            if end > lengths[k]:
                raise IRVerificationError(f"{label}: trajectory {trajectory} has {int(lengths[k])} tokens, the sequence needs {end}")
            return trajectory_rows[trajectory_offsets[k] : trajectory_offsets[k] + end]

        row_trajectory = np.repeat(seq_trajectory, seq_end - seq_start)
        row_position = _ranges(seq_start, seq_end - seq_start)
        ancestor_lists = []
        for number, (r, sequence) in enumerate(sequences):
            label = f"{where}, round {r}, sequence of trajectory {sequence.trajectory}"
            path_rows = trajectory_prefix(sequence.trajectory, sequence.end, label)
            own = path_rows[sequence.start :]
            if not np.array_equal(own, np.arange(seq_row_start[number], seq_row_start[number + 1])):
                raise IRVerificationError(f"{label}: trajectory {sequence.trajectory} does not run through the sequence's segments")
            ancestor_lists.append(path_rows[: sequence.start])
        ancestor_offsets = _offsets([a.size for a in ancestor_lists])
        ancestor_rows = np.concatenate(ancestor_lists) if ancestor_lists else np.zeros(0, dtype=np.int64)

        # Exports and state sources.
        export_lists: list[list[int]] = []
        for r, sequence in sequences:
            label = f"{where}, round {r}, sequence of trajectory {sequence.trajectory}"
            positions = list(sequence.exports)
            for position in positions:
                if position % chunk or not sequence.replay_start < position <= sequence.end:
                    raise IRVerificationError(
                        f"{label}: export at {position} is not a multiple of {chunk} in ({sequence.replay_start}, {sequence.end}]"
                    )
            if len(set(positions)) != len(positions):
                raise IRVerificationError(f"{label}: exports {positions} repeat a position")
            export_lists.append(positions)
        export_offsets = _offsets([len(e) for e in export_lists])
        export_position = np.array([p for e in export_lists for p in e], dtype=np.int64)
        export_chunk = np.array(
            [(p - sequence.replay_start) // chunk for (_, sequence), e in zip(sequences, export_lists) for p in e], dtype=np.int64
        )
        by_round_trajectory = {(int(seq_round[j]), int(seq_trajectory[j])): j for j in range(count)}
        if len(by_round_trajectory) != count:
            raise IRVerificationError(f"{where}: two sequences of one round share a representative trajectory")
        seq_state_source = np.full(count, -1, dtype=np.int64)
        seq_state_chunk = np.full(count, -1, dtype=np.int64)
        seq_state_export = np.full(count, -1, dtype=np.int64)
        for number, (r, sequence) in enumerate(sequences):
            label = f"{where}, round {r}, sequence of trajectory {sequence.trajectory}"
            if sequence.replay_start % chunk or not 0 <= sequence.replay_start <= sequence.start:
                raise IRVerificationError(f"{label}: replay start {sequence.replay_start} is not a chunk boundary at or before {sequence.start}")
            reference = sequence.state_from
            if reference is None:
                if sequence.replay_start != 0:
                    raise IRVerificationError(f"{label}: starts from the zero state but replays from {sequence.replay_start}")
                continue
            if reference.position != sequence.replay_start:
                raise IRVerificationError(f"{label}: state at {reference.position} but replay starts at {sequence.replay_start}")
            if reference.round >= r:
                raise IRVerificationError(f"{label}: its state comes from round {reference.round}, not an earlier round")
            producer = by_round_trajectory.get((reference.round, reference.trajectory))
            if producer is None:
                raise IRVerificationError(f"{label}: no sequence of trajectory {reference.trajectory} in round {reference.round}")
            produced = export_lists[producer]
            if reference.position not in produced:
                raise IRVerificationError(
                    f"{label}: the sequence of trajectory {reference.trajectory} in round {reference.round} does not export position {reference.position}"
                )
            producer_prefix = trajectory_prefix(reference.trajectory, reference.position, label)
            if not np.array_equal(producer_prefix, ancestor_lists[number][: reference.position]):
                raise IRVerificationError(f"{label}: the state at {reference.position} belongs to a different token prefix")
            seq_state_source[number] = producer
            slot = produced.index(reference.position)
            seq_state_chunk[number] = export_chunk[export_offsets[producer] + slot]
            seq_state_export[number] = export_offsets[producer] + slot

        layout = cls(
            microbatch=microbatch.index,
            chunk_size=chunk,
            trajectories=members,
            trajectory_offsets=trajectory_offsets,
            trajectory_rows=trajectory_rows,
            row_trajectory=row_trajectory,
            row_position=row_position,
            row_multiplicity=multiplicity,
            round_seq_start=round_seq_start,
            seq_round=seq_round,
            seq_trajectory=seq_trajectory,
            seq_start=seq_start,
            seq_end=seq_end,
            seq_replay_start=seq_replay_start,
            seq_row_start=seq_row_start,
            seq_state_source=seq_state_source,
            seq_state_chunk=seq_state_chunk,
            seq_state_export=seq_state_export,
            export_offsets=export_offsets,
            export_position=export_position,
            export_chunk=export_chunk,
            ancestor_offsets=ancestor_offsets,
            ancestor_rows=ancestor_rows,
        )
        logger.debug(
            "layout of %s: %d rows, %d sequences in %d rounds, %d exports, %d replay rows",
            where, rows, count, layout.num_rounds, layout.num_exports, layout.replay_tokens,
        )
        return layout
