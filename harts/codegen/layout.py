"""Code generation, first step: the compact physical layout of every microbatch (§4.2).

The ``codegen`` pass calls :func:`lay_out` on a verified rounded module and the pass
manager verifies what it returns (:func:`harts.ir.verify_layout.verify_laid_out`), so the
builder trusts its input: every round invariant (chains of segments, replay on the chunk
grid, states exported by earlier rounds along the same prefix, each row output once) was
checked by ``verify_rounded`` and guaranteed by ``plan_forest``; nothing here checks them again.

The layout data class lives with the IR (:mod:`harts.ir.layout`); it is re-exported here.
"""

from __future__ import annotations

import logging

import numpy as np

from harts.errors import IRVerificationError
from harts.ir.layout import (
    ARRAY_FIELDS,
    LAYOUT_FORMAT_VERSION,
    LaidOutModule,
    MicrobatchLayout,
    concatenated_ranges,
    decode_arithmetic_runs,
    encode_arithmetic_runs,
    offsets_of,
    state_handoffs,
)
from harts.ir.nodes import Module, Phase
from harts.threads import map_in_order

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


def build_layout(module: Module, microbatch_index: int) -> MicrobatchLayout:
    """Lay out microbatch ``microbatch_index`` of a verified ``rounded`` module."""
    if not isinstance(module, Module) or module.phase != Phase.ROUNDED:
        phase = getattr(module, "phase", type(module).__name__)
        raise IRVerificationError(f"a compact layout needs a rounded module; this one is {phase}")
    microbatches = module.microbatches
    if not 0 <= microbatch_index < len(microbatches):
        raise IRVerificationError(f"the module has no microbatch {microbatch_index} ({len(microbatches)} microbatches)")
    microbatch = microbatches[microbatch_index]
    trie, segments, chunk = module.trie, microbatch.segments, module.chunk_size
    members = np.asarray(microbatch.trajectories, dtype=np.int64)

    # Sequences in layout order: round, then order inside the round; each one's rows in a block.
    sequences = [(round_.index, sequence) for round_ in microbatch.rounds for sequence in round_.sequences]
    seq_round = np.array([r for r, _ in sequences], dtype=np.int64)
    seq_trajectory = np.array([s.trajectory for _, s in sequences], dtype=np.int64)
    seq_start = np.array([s.start for _, s in sequences], dtype=np.int64)
    seq_end = np.array([s.end for _, s in sequences], dtype=np.int64)
    seq_replay_start = np.array([s.replay_start for _, s in sequences], dtype=np.int64)
    spans = seq_end - seq_start
    seq_row_start = offsets_of(spans)

    # The first row of every trie node the microbatch uses: where the sequence running its segment puts it.
    node_row = np.full(len(trie.nodes), -1, dtype=np.int64)
    for number, (_, sequence) in enumerate(sequences):
        for segment_id in sequence.segments:
            segment = segments[segment_id]
            segment_row = int(seq_row_start[number]) + segment.start - sequence.start
            for node in segment.nodes:
                node_row[node] = segment_row + trie.nodes[node].start - segment.start

    # The map m: every member's trie path, node by node, in member order.
    parent, node_start, node_end, _ = trie.node_arrays()
    owner, path_nodes = trie.paths_of(members, parent)
    node_length = node_end - node_start
    trajectory_rows = concatenated_ranges(node_row[path_nodes], node_length[path_nodes])
    trajectory_offsets = offsets_of([module.trajectories[int(i)].length for i in members])
    rows = int(seq_row_start[-1])
    member_of_sequence = np.searchsorted(members, seq_trajectory)

    layout = MicrobatchLayout(
        microbatch=microbatch.index,
        chunk_size=chunk,
        trajectories=members,
        trajectory_offsets=trajectory_offsets,
        trajectory_rows=trajectory_rows,
        row_trajectory=np.repeat(seq_trajectory, spans),
        row_position=concatenated_ranges(seq_start, spans),
        row_multiplicity=_row_multiplicity(node_row, node_length, path_nodes),
        round_seq_start=offsets_of([len(round_.sequences) for round_ in microbatch.rounds]),
        seq_round=seq_round,
        seq_trajectory=seq_trajectory,
        seq_start=seq_start,
        seq_end=seq_end,
        seq_replay_start=seq_replay_start,
        seq_row_start=seq_row_start,
        ancestor_offsets=offsets_of(seq_start),
        ancestor_rows=_ancestor_rows(owner, path_nodes, node_row, node_start, node_end, member_of_sequence, seq_start),
        **state_handoffs(sequences, chunk),
    )
    logger.debug(
        "layout of microbatch %d: %d rows, %d sequences in %d rounds, %d exports, %d replay rows",
        microbatch.index, rows, len(sequences), layout.num_rounds, layout.num_exports, layout.replay_tokens,
    )
    return layout


def _row_multiplicity(node_row: np.ndarray, node_length: np.ndarray, path_nodes: np.ndarray) -> np.ndarray:
    """q of every row: the members through the trie node the row belongs to.

    Every row is one position of one used trie node (each output once, by the rounds), so q is each used
    node's member count repeated over its rows in row order: one pass over the rows instead of counting
    the map m's entries (one per semantic token).
    """
    through = np.bincount(path_nodes, minlength=node_row.size)
    used = np.flatnonzero(node_row >= 0)
    used = used[np.argsort(node_row[used], kind="stable")]
    return np.repeat(through[used], node_length[used])


def _ancestor_rows(owner: np.ndarray, path_nodes: np.ndarray, node_row: np.ndarray, node_start: np.ndarray,
                   node_end: np.ndarray, member_of_sequence: np.ndarray, seq_start: np.ndarray) -> np.ndarray:
    """Every sequence's ancestor rows (its trajectory's rows at positions ``[0, start)``), laid end to end.

    Built from the trie runs of its member's path cut at ``start``, not gathered from the map m: these lists
    are often longer than m itself, and a gather would first build an index array as long.
    """
    # pairs ascend by (owner, node start): a path runs root first; those starting before ``start`` hold the prefix
    span = int(node_end.max(initial=0)) + 1
    keys = owner * span + node_start[path_nodes]
    first = np.searchsorted(keys, member_of_sequence * span)
    counts = np.searchsorted(keys, member_of_sequence * span + seq_start) - first
    pairs = concatenated_ranges(first, counts)
    nodes = path_nodes[pairs]
    cut = np.minimum(node_end[nodes], np.repeat(seq_start, counts))
    return concatenated_ranges(node_row[nodes], cut - node_start[nodes])


#: the mean semantic tokens per microbatch from which microbatches are laid out in threads: measured on two cores,
#: SWE-like microbatches of ~250k tokens lay out in half the time, GRPO's of ~70k in more time than one thread takes
THREADED_TOKENS_PER_MICROBATCH = 1 << 17


def lay_out(module: Module) -> LaidOutModule:
    """The ``laid_out`` phase of a verified rounded module: one layout per microbatch, in order.

    Microbatches are laid out independently (each the same as laid out alone), in threads when they are
    large (:data:`THREADED_TOKENS_PER_MICROBATCH`, :func:`harts.threads.map_in_order`).
    """
    microbatches = module.microbatches
    lengths = [trajectory.length for trajectory in module.trajectories]
    tokens = sum(lengths[member] for mb in microbatches for member in mb.trajectories)
    module.trie.node_arrays()  # built (and cached on the trie) once, before any thread reads it
    layouts = map_in_order(lambda mb: build_layout(module, mb.index), microbatches, name="lay-out",
                           threaded=tokens >= THREADED_TOKENS_PER_MICROBATCH * max(1, len(microbatches)))
    return LaidOutModule(module=module, layouts=tuple(layouts))
