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
(row maps are long runs of consecutive rows or repeated values).

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


@attrs.frozen
class MicrobatchLayout:
    """The compact physical ordering of one microbatch and the index lists derived from it.

    Frozen and free of caches: what the runtime derives from a layout (generated programs,
    device tensors) lives in the runtime (:mod:`harts.runtime.programs`). Every array is
    read-only (writing one raises ``ValueError``). Two layouts are equal when every array is;
    layouts are not hashable.
    """

    microbatch: int
    chunk_size: int
    trajectories: np.ndarray = _array_field()
    trajectory_offsets: np.ndarray = _array_field()
    trajectory_rows: np.ndarray = _array_field()
    row_trajectory: np.ndarray = _array_field()
    row_position: np.ndarray = _array_field()
    row_multiplicity: np.ndarray = _array_field()
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
    ancestor_rows: np.ndarray = _array_field()

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
            if getattr(self, name).shape[0] != rows:
                return f"{name} has {getattr(self, name).shape[0]} entries, expected {rows}"
        for name in ("seq_trajectory", "seq_start", "seq_end", "seq_replay_start", "seq_state_source", "seq_state_chunk", "seq_state_export"):
            if getattr(self, name).shape[0] != sequences:
                return f"{name} has {getattr(self, name).shape[0]} entries, expected {sequences}"
        for name, size, total in (
            ("round_seq_start", self.num_rounds, sequences),
            ("seq_row_start", sequences, rows),
            ("export_offsets", sequences, exports),
            ("ancestor_offsets", sequences, self.ancestor_rows.shape[0]),
            ("trajectory_offsets", len(self.trajectories), self.trajectory_rows.shape[0]),
        ):
            offsets = getattr(self, name)
            if offsets.shape[0] != size + 1 or size < 0 or offsets[0] != 0 or offsets[-1] != total or np.any(np.diff(offsets) < 0):
                return f"{name} is not a valid offset array over {total} entries"
        for name in ("trajectory_rows", "ancestor_rows"):
            if row_extremes is not None:
                extremes = row_extremes[name]
                outside = extremes is not None and (extremes[0] < 0 or extremes[1] >= rows)
            else:
                values = getattr(self, name)
                # one pass over these long arrays: read as unsigned, a negative row is larger than any valid one
                outside = bool(values.size) and int(values.view(np.uint64).max()) >= rows
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
