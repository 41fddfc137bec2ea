"""The compact physical layout of one microbatch (§4.2).

Every layer of the model works on one row order, fixed per microbatch by its rounds:
rows are ordered by round, then by input sequence inside the round, then by position.
The rows of a sequence are the positions ``[start, end)`` it produces outputs for, so
the tokens of one input sequence are contiguous and all sequences of a round are
adjacent. Replay rows ``[replay_start, start)`` are not rows of their own: they are
ancestors' rows, gathered when a linear-attention call needs them.

A layout is the IR node of the ``laid_out`` phase (whose root, :class:`LaidOutModule`,
holds the rounded module and one layout per microbatch): the ``lay-out`` pass builds it
(:mod:`harts.codegen.layout`), :func:`harts.ir.verify_layout.verify_laid_out` checks it,
the plan artifact stores its arrays and the runtime executes from them. Everything here is
a flat numpy ``int64`` array (CSR for ragged lists); in the IR text and in the artifact each
array is written as arithmetic runs (:class:`ArithmeticRuns`), which is exact and small
(row maps are long runs of consecutive rows or repeated values). The long arrays (an entry
per row or semantic token, :data:`RUNS_FIELDS`) may be held as the runs they were built from
(:class:`RunsArray`) and are expanded when first read: compiling never writes them out.

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

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from harts.errors import PlanArtifactError, RolloutInputError
from harts.ir.nodes import InputSequence, Module, Phase

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


def concatenated_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for every (s, n), vectorised.

    Built as one cumulative sum of the steps (1 inside a range, the jump to the next range's start at
    its first entry): the arrays laid out are one entry per semantic token, so the passes over the
    output are the cost, and this takes two (a fill and the sum) where ``repeat + arange`` takes four.
    """
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    starts = np.asarray(starts, dtype=np.int64).reshape(-1)
    if lengths.size and lengths.min() < 0:
        raise ValueError("concatenated_ranges: a range of negative length")
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    nonempty = lengths > 0
    starts, lengths = starts[nonempty], lengths[nonempty]
    out = np.ones(total, dtype=np.int64)
    out[0] = starts[0]
    # each range's first entry steps from the previous range's last value, start - 1 + length
    out[np.cumsum(lengths[:-1])] = starts[1:] - starts[:-1] - lengths[:-1] + 1
    return np.cumsum(out, out=out)


def offsets_of(lengths) -> np.ndarray:
    """CSR offsets ``[0, n0, n0 + n1, ...]`` of a list of lengths."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=out[1:])
    return out


def sequence_columns(sequences: Sequence[tuple[int, InputSequence]]) -> dict[str, np.ndarray]:
    """Each of ``sequences``' (round, sequence) pairs as one entry of int64 columns: ``round``,
    ``trajectory``, ``start``, ``end`` and ``replay_start``."""
    count = len(sequences)
    columns = {"round": np.fromiter((r for r, _ in sequences), dtype=np.int64, count=count)}
    for name in ("trajectory", "start", "end", "replay_start"):
        columns[name] = np.fromiter((getattr(s, name) for _, s in sequences), dtype=np.int64, count=count)
    return columns


def state_handoffs(sequences: Sequence[tuple[int, InputSequence]], chunk_size: int) -> dict[str, np.ndarray]:
    """The export and state-source arrays of a layout whose sequences are ``sequences``.

    ``sequences``: (round, sequence) pairs in layout order. Chunk indices count from the
    exporting sequence's replay start; a sequence that starts from the zero state has -1.
    The builder stores these arrays and the verifier compares a layout's with them.
    """
    exports = [list(sequence.exports) for _, sequence in sequences]
    export_offsets = offsets_of([len(e) for e in exports])
    export_position = np.array([p for e in exports for p in e], dtype=np.int64)
    replay_start = np.array([sequence.replay_start for _, sequence in sequences], dtype=np.int64)
    export_chunk = (export_position - np.repeat(replay_start, np.diff(export_offsets))) // chunk_size
    by_round_trajectory = {(r, sequence.trajectory): number for number, (r, sequence) in enumerate(sequences)}
    source = np.full(len(sequences), -1, dtype=np.int64)
    export = np.full(len(sequences), -1, dtype=np.int64)
    for number, (_, sequence) in enumerate(sequences):
        state = sequence.state_from
        if state is not None:
            producer = by_round_trajectory[(state.round, state.trajectory)]
            source[number] = producer
            export[number] = export_offsets[producer] + exports[producer].index(state.position)
    chunk = np.full(len(sequences), -1, dtype=np.int64)
    chunk[export >= 0] = export_chunk[export[export >= 0]]
    return {
        "export_offsets": export_offsets,
        "export_position": export_position,
        "export_chunk": export_chunk,
        "seq_state_source": source,
        "seq_state_export": export,
        "seq_state_chunk": chunk,
    }


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


@attrs.frozen
class ArithmeticRuns:
    """An int64 array as maximal runs ``start[k], start[k] + step[k], ...`` of ``length[k]`` entries.

    The text form of every layout array (``Runs(start=[...], step=[...], length=[...])``);
    the artifact stores the same three lists per array.
    """

    start: tuple[int, ...]
    step: tuple[int, ...]
    length: tuple[int, ...]

    @classmethod
    def encode(cls, values: np.ndarray) -> "ArithmeticRuns":
        return cls(*(tuple(int(v) for v in part) for part in encode_arithmetic_runs(values)))

    def decode(self) -> np.ndarray:
        if not len(self.start) == len(self.step) == len(self.length):
            raise ValueError("the start, step and length lists of arithmetic runs differ in length")
        return decode_arithmetic_runs(np.asarray(self.start), np.asarray(self.step), np.asarray(self.length))


def _index_array(value: Any) -> np.ndarray:
    """A layout array: flat int64, read-only (runs read from the IR text are expanded here).

    Read-only because layouts are immutable IR: the runtime caches what it derives from a
    layout (programs, device tensors) by the layout's identity, so a write would leave those
    stale. The flag is set on a view: the array handed in is not changed.
    """
    array = value.decode() if isinstance(value, ArithmeticRuns) else np.asarray(value, dtype=np.int64).reshape(-1)
    array = array.view()
    array.flags.writeable = False
    return array


def _array_field() -> Any:
    return attrs.field(converter=_index_array, eq=attrs.cmp_using(eq=np.array_equal), repr=False)


class RunsArray:
    """One of a layout's long arrays (an entry per row, semantic token or ancestor position), held as the
    arithmetic runs it was built from and expanded on first read, or held as the array it was given.

    Why not the array itself: these arrays are a few thousand runs each (a trie node's rows, a sequence's
    positions) but tens of millions of entries on a large step, and writing and then reading them (a gigabyte
    on an SWE-like step, much of it page faults) was most of a compile's layout and verification time, while
    compiling needs only their runs (:func:`harts.ir.verify_layout.verify_laid_out` checks the runs). The
    array is expanded once, when something reads it (the runtime, the artifact), kept, and read-only, so the
    layout reads as a layout of plain arrays.
    """

    __slots__ = ("_array", "_runs", "size")

    def __init__(self, array: np.ndarray | None = None, runs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None):
        self._array, self._runs = array, runs
        self.size = int(array.shape[0]) if array is not None else int(runs[2].sum())

    @classmethod
    def from_runs(cls, starts: np.ndarray, steps: np.ndarray, lengths: np.ndarray) -> "RunsArray":
        """``starts[k], starts[k] + steps[k], ...`` for ``lengths[k]`` entries, run after run (every length positive)."""
        runs = tuple(_index_array(part) for part in (starts, steps, lengths))
        if not runs[0].shape == runs[1].shape == runs[2].shape:
            raise ValueError("the start, step and length lists of arithmetic runs differ in length")
        if runs[2].size and runs[2].min() < 1:
            raise ValueError("arithmetic runs need positive lengths")
        return cls(runs=runs)

    @property
    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(starts, steps, lengths) when held as runs (not necessarily maximal), else None."""
        return self._runs

    def array(self) -> np.ndarray:
        if self._array is None:
            starts, steps, lengths = self._runs
            if not steps.size or (steps == 1).all():
                array = concatenated_ranges(starts, lengths)
            elif (steps == 0).all():
                array = np.repeat(starts, lengths)
            else:
                array = decode_arithmetic_runs(starts, steps, lengths)
            self._array = _index_array(array)
        return self._array

    def outside(self, rows: int) -> bool:
        """Does an entry lie outside ``[0, rows)``? Read off the runs' ends when held as runs."""
        if self._array is None:
            starts, steps, lengths = self._runs
            if not starts.size:
                return False
            lasts = starts + steps * (lengths - 1)
            return bool(min(starts.min(), lasts.min()) < 0 or max(starts.max(), lasts.max()) >= rows)
        # one pass over the array: read as unsigned, a negative row is larger than any valid one
        return bool(self.size) and int(self._array.view(np.uint64).max()) >= rows

    def __reduce__(self):
        # runs pickle as runs: an array expanded from them is derived, and far larger
        return RunsArray, (None, self._runs) if self._runs is not None else (self._array, None)


def _runs_array(value: Any) -> RunsArray:
    return value if isinstance(value, RunsArray) else RunsArray(array=_index_array(value))


def _same_entries(a: RunsArray, b: RunsArray) -> bool:
    if a is b:
        return True
    if a.runs is not None and b.runs is not None and all(np.array_equal(x, y) for x, y in zip(a.runs, b.runs)):
        return True
    return a.size == b.size and np.array_equal(a.array(), b.array())


def _runs_field(name: str) -> Any:
    return attrs.field(alias=name, converter=_runs_array, eq=attrs.cmp_using(eq=_same_entries), repr=False)


#: the layout arrays held as :class:`RunsArray` (a private field ``_<name>``, read through the property ``<name>``)
RUNS_FIELDS: tuple[str, ...] = ("trajectory_rows", "row_trajectory", "row_position", "row_multiplicity", "ancestor_rows")


@attrs.frozen
class MicrobatchLayout:
    """The compact physical ordering of one microbatch and the index lists derived from it.

    Frozen: what the runtime derives from a layout (generated programs, device tensors) lives in
    the runtime (:mod:`harts.runtime.programs`). Every array is read-only (writing one raises
    ``ValueError``). The long arrays (:data:`RUNS_FIELDS`) may be given as :class:`RunsArray`,
    as ``lay-out`` gives them: each is expanded the first time it is read, and the same array is
    returned from then on (the layout's only cache; ``runs_array(name)`` reads the runs without
    expanding). Two layouts are equal when every array is; layouts are not hashable.
    """

    microbatch: int
    chunk_size: int
    trajectories: np.ndarray = _array_field()
    trajectory_offsets: np.ndarray = _array_field()
    _trajectory_rows: RunsArray = _runs_field("trajectory_rows")
    _row_trajectory: RunsArray = _runs_field("row_trajectory")
    _row_position: RunsArray = _runs_field("row_position")
    _row_multiplicity: RunsArray = _runs_field("row_multiplicity")
    round_seq_start: np.ndarray = _array_field()
    seq_round: np.ndarray = _array_field()
    seq_trajectory: np.ndarray = _array_field()
    seq_start: np.ndarray = _array_field()
    seq_end: np.ndarray = _array_field()
    seq_replay_start: np.ndarray = _array_field()
    seq_row_start: np.ndarray = _array_field()
    seq_state_source: np.ndarray = _array_field()
    seq_state_chunk: np.ndarray = _array_field()
    seq_state_export: np.ndarray = _array_field()
    export_offsets: np.ndarray = _array_field()
    export_position: np.ndarray = _array_field()
    export_chunk: np.ndarray = _array_field()
    ancestor_offsets: np.ndarray = _array_field()
    _ancestor_rows: RunsArray = _runs_field("ancestor_rows")

    # ------------------------------------------------------------ long arrays
    @property
    def trajectory_rows(self) -> np.ndarray:
        return self._trajectory_rows.array()

    @property
    def row_trajectory(self) -> np.ndarray:
        return self._row_trajectory.array()

    @property
    def row_position(self) -> np.ndarray:
        return self._row_position.array()

    @property
    def row_multiplicity(self) -> np.ndarray:
        return self._row_multiplicity.array()

    @property
    def ancestor_rows(self) -> np.ndarray:
        return self._ancestor_rows.array()

    def runs_array(self, name: str) -> RunsArray:
        """The :class:`RunsArray` behind one of :data:`RUNS_FIELDS` (its runs, or its array, as held)."""
        if name not in RUNS_FIELDS:
            raise KeyError(f"{name} is not one of the layout's long arrays {RUNS_FIELDS}")
        return getattr(self, f"_{name}")

    def array_length(self, name: str) -> int:
        """Entries of layout array ``name``, without expanding a long one."""
        return self.runs_array(name).size if name in RUNS_FIELDS else int(getattr(self, name).shape[0])

    # ------------------------------------------------------------------ sizes
    @property
    def num_rows(self) -> int:
        return self._row_trajectory.size

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
        return self._trajectory_rows.size

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
        problem = layout.structure_problem()
        if problem is not None:
            raise PlanArtifactError(f"layout of microbatch {layout.microbatch}: {problem}")
        return layout

    def structure_problem(self, row_extremes: Mapping[str, tuple[int, int]] | None = None) -> str | None:
        """What is structurally wrong (array sizes and offsets disagree), or None.

        Decoding tensors reports it as a damaged artifact; the ``laid_out`` verifier as a
        broken invariant, before it checks the layout against the rounds. ``row_extremes``: the
        least and largest entry of ``trajectory_rows`` and ``ancestor_rows`` (None for an empty
        array) when the caller has them (the verifier reads them off its scan of those arrays), so
        that these long arrays are not read again here.
        """
        rows, sequences, exports = self.num_rows, self.num_sequences, self.num_exports
        for name in ("row_position", "row_multiplicity"):
            if self.array_length(name) != rows:
                return f"{name} has {self.array_length(name)} entries, expected {rows}"
        for name in ("seq_trajectory", "seq_start", "seq_end", "seq_replay_start", "seq_state_source", "seq_state_chunk", "seq_state_export"):
            if getattr(self, name).shape[0] != sequences:
                return f"{name} has {getattr(self, name).shape[0]} entries, expected {sequences}"
        for name, size, total in (
            ("round_seq_start", self.num_rounds, sequences),
            ("seq_row_start", sequences, rows),
            ("export_offsets", sequences, exports),
            ("ancestor_offsets", sequences, self.array_length("ancestor_rows")),
            ("trajectory_offsets", len(self.trajectories), self.array_length("trajectory_rows")),
        ):
            offsets = getattr(self, name)
            if offsets.shape[0] != size + 1 or size < 0 or offsets[0] != 0 or offsets[-1] != total or np.any(np.diff(offsets) < 0):
                return f"{name} is not a valid offset array over {total} entries"
        for name in ("trajectory_rows", "ancestor_rows"):
            if row_extremes is not None:
                extremes = row_extremes[name]
                outside = extremes is not None and (extremes[0] < 0 or extremes[1] >= rows)
            else:
                outside = self.runs_array(name).outside(rows)
            if outside:
                return f"{name} holds a row outside [0, {rows})"
        if self.export_chunk.shape[0] != exports:
            return "export_chunk and export_position differ in length"
        if np.any(self.seq_state_export >= exports) or np.any(self.seq_state_source >= sequences):
            return "a state source points past the exports or sequences"
        return None


@attrs.frozen
class LaidOutModule:
    """The ``laid_out`` phase: a rounded module and, per microbatch (in order), its layout.

    ``lay-out`` produces it; the plan artifact stores ``module`` as IR text and ``layouts``
    as tensors. Not hashable (layouts hold arrays).
    """

    module: Module
    layouts: tuple[MicrobatchLayout, ...]

    @property
    def phase(self) -> Phase:
        return Phase.LAID_OUT

    @property
    def input_hash(self) -> str:
        return self.module.input_hash


#: The node classes of the laid-out phase, by name (the printer and parser use them).
LAYOUT_NODE_CLASSES: dict[str, type] = {cls.__name__: cls for cls in (MicrobatchLayout, LaidOutModule)}
