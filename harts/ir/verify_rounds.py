"""Invariants of the ``segmented`` and ``rounded`` phases (owned by the min-call planner).

``segmented``: each microbatch's segments partition the trie nodes its trajectories pass
through into maximal fork-free paths, numbered in preorder, with valid parents and spans.

``rounded``: every input sequence is a direct-continuation chain of segments ending at a
leaf, its replay starts on the chunk grid less than B rows before its outputs, and it starts
from the zero state or from a boundary state that an *earlier* round exports along the same
token prefix (a same-round launch from a ready anchor reuses the carrying sequence's own
initial state, so it too names an earlier export or the zero state); every compact row of the
microbatch is output exactly once; R equals Eq. 15.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from harts.ir.nodes import CompactTrie, InputSequence, Microbatch, Module, Phase
from harts.ir.prefix_index import PrefixIndex
from harts.ir.verify_common import fail


def _check_microbatch_members(module: Module, microbatch: Microbatch) -> None:
    count = len(module.trajectories)
    for trajectory in microbatch.trajectories:
        if not 0 <= trajectory < count:
            fail(f"microbatch {microbatch.index}: trajectory {trajectory} is not in the batch ({count} trajectories)")


def _verify_segments(module: Module, microbatch: Microbatch) -> None:
    trie = module.trie
    nodes = trie.nodes
    where = f"microbatch {microbatch.index}"
    segments = microbatch.segments
    if not segments:
        fail(f"{where}: phase {module.phase} needs a non-empty segment forest")
    _check_microbatch_members(module, microbatch)
    # the smallest member through each node of the members' paths: its keys are the used nodes
    # (:meth:`CompactTrie.used_nodes`, without a second walk)
    smallest_through = trie.smallest_through(microbatch.trajectories)
    used = smallest_through
    used_child_count = dict.fromkeys(used, 0)
    for node in used:
        parent = nodes[node].parent
        if parent >= 0:
            used_child_count[parent] += 1

    # the messages name the segment (``{where}, segment {position}``), formatted only when a check fails
    owner: dict[int, int] = {}
    child_count = [0] * len(segments)
    previous_first = -1
    for position, segment in enumerate(segments):
        if segment.id != position:
            fail(f"{where}, segment {position}: id {segment.id}, segments must be numbered 0..n-1 in order")
        segment_nodes = segment.nodes
        if not segment_nodes:
            fail(f"{where}, segment {position}: merges no trie nodes")
        for node in segment_nodes:
            if node not in used:
                fail(f"{where}, segment {position}: trie node {node} is not on the path of any trajectory of the microbatch")
            if node in owner:
                fail(f"{where}, segment {position}: trie node {node} also belongs to segment {owner[node]}")
            owner[node] = position
        upper = segment_nodes[0]
        for lower in segment_nodes[1:]:
            if nodes[lower].parent != upper:
                fail(f"{where}, segment {position}: trie node {lower} does not continue trie node {upper}")
            if used_child_count[upper] != 1:
                fail(f"{where}, segment {position}: the microbatch forks inside the segment, at trie node {upper}")
            upper = lower
        first, last = nodes[segment_nodes[0]], nodes[segment_nodes[-1]]
        if used_child_count[last.id] == 1:
            fail(f"{where}, segment {position}: not maximal, trie node {last.id} has a single used child and no fork")
        if segment.start != first.start or segment.end != last.end:
            fail(f"{where}, segment {position}: span [{segment.start}, {segment.end}) differs from its trie nodes' span "
                 f"[{first.start}, {last.end})")
        if first.id <= previous_first:
            fail(f"{where}, segment {position}: segments are not in preorder (first trie node {first.id} after {previous_first})")
        previous_first = first.id
        parent = segment.parent
        if parent == -1:
            if first.parent != -1:
                fail(f"{where}, segment {position}: root segment starts at trie node {first.id}, which has parent {first.parent}")
        else:
            if not 0 <= parent < position:
                fail(f"{where}, segment {position}: parent {parent} must be an earlier segment (preorder)")
            if segments[parent].nodes[-1] != first.parent:
                fail(f"{where}, segment {position}: parent segment {parent} does not end at trie node {first.parent}, "
                     "the parent of its first node")
            child_count[parent] += 1
        if segment.trajectory != smallest_through[last.id]:
            fail(
                f"{where}, segment {position}: representative trajectory {segment.trajectory}, expected {smallest_through[last.id]} "
                f"(the smallest member through trie node {last.id})"
            )
    if len(owner) != len(used):
        fail(f"{where}: trie node {sorted(used.keys() - owner.keys())[0]} of trajectory paths belongs to no segment")
    for segment in segments:
        if child_count[segment.id] != used_child_count[segment.nodes[-1]]:
            fail(f"{where}, segment {segment.id}: {child_count[segment.id]} child segments but the trie forks into {used_child_count[segment.nodes[-1]]}")
    rows = sum(segment.end - segment.start for segment in segments)
    if rows != microbatch.work:
        fail(f"{where}: segments hold {rows} compact rows but the microbatch work is {microbatch.work}")


def verify_segmented(module: Module) -> None:
    """Segments partition every microbatch's trajectory paths into maximal fork-free paths."""
    if module.trie is None or module.microbatches is None:
        fail(f"phase {module.phase} needs a compact trie and microbatches")
    for microbatch in module.microbatches:
        if microbatch.segments is None:
            fail(f"microbatch {microbatch.index}: phase {module.phase} needs segments")
        if module.phase < Phase.ROUNDED and (microbatch.rounds is not None or microbatch.replay_tokens is not None):
            fail(f"microbatch {microbatch.index}: phase {module.phase} must not carry rounds or replay tokens")
        _verify_segments(module, microbatch)


def mandatory_replay(parents: Sequence[int], ends: Sequence[int], chunk_size: int) -> int:
    """R of Eq. 15 for a segment forest: every side branch of v replays ``e_v mod B`` rows."""
    child_count = [0] * len(parents)
    for parent in parents:
        if parent >= 0:
            child_count[parent] += 1
    return sum((k - 1) * (ends[v] % chunk_size) for v, k in enumerate(child_count) if k > 0)


def _output_rows(trie: CompactTrie, trajectory: int, start: int, end: int) -> list[tuple[int, int]]:
    """Compact-row intervals that positions ``[start, end)`` of ``trajectory`` map to."""
    intervals = []
    node = trie.leaf[trajectory]
    while node >= 0:
        item = trie.nodes[node]
        if item.end <= start:
            break
        low, high = max(start, item.start), min(end, item.end)
        if low < high:
            intervals.append((item.row + low - item.start, item.row + high - item.start))
        node = item.parent
    return intervals


def _check_round_numbering(where: str, module: Module, microbatch: Microbatch) -> dict[tuple[int, int], InputSequence]:
    """Rounds exist, are numbered 0.. in order, each holds sequences, and one per trajectory: returns the
    sequences by (round, trajectory), the key a state source names its producer by."""
    if microbatch.rounds is None or microbatch.replay_tokens is None:
        fail(f"{where}: phase {module.phase} needs rounds and replay_tokens")
    if not microbatch.rounds:
        fail(f"{where}: has no rounds")
    by_producer: dict[tuple[int, int], InputSequence] = {}
    for position, round_ in enumerate(microbatch.rounds):
        if round_.index != position:
            fail(f"{where}: round at position {position} has index {round_.index}; rounds are numbered from 0")
        if not round_.sequences:
            fail(f"{where}, round {round_.index}: holds no input sequence")
        for sequence in round_.sequences:
            key = (round_.index, sequence.trajectory)
            if key in by_producer:
                fail(f"{where}, round {round_.index}: two sequences name trajectory {sequence.trajectory}")
            by_producer[key] = sequence
    return by_producer


def _check_span(here: str, module: Module, members: set[int], sequence: InputSequence) -> None:
    """A member's positions, the replay starting on the chunk grid fewer than B rows before the outputs."""
    chunk = module.chunk_size
    if sequence.trajectory not in members:
        fail(f"{here}: the trajectory is not a member of the microbatch")
    length = module.trajectories[sequence.trajectory].length
    if not 0 <= sequence.replay_start <= sequence.start < sequence.end <= length:
        fail(
            f"{here}: needs 0 <= replay_start {sequence.replay_start} <= start {sequence.start} "
            f"< end {sequence.end} <= length {length}"
        )
    if sequence.replay_start % chunk:
        fail(f"{here}: replay_start {sequence.replay_start} is not a multiple of the chunk size {chunk}")
    if sequence.start - sequence.replay_start >= chunk:
        fail(f"{here}: replays {sequence.start - sequence.replay_start} rows, must be fewer than the chunk size {chunk}")


def _check_chain(here: str, segments, children: list[list[int]], sequence: InputSequence, round_index: int,
                 executed: dict[int, int]) -> None:
    """A direct-continuation chain of segments run nowhere else, ending at a leaf, with the chain's span and
    the leaf's representative trajectory."""
    if not sequence.segments:
        fail(f"{here}: runs no segments")
    for segment_id in sequence.segments:
        if not 0 <= segment_id < len(segments):
            fail(f"{here}: segment {segment_id} does not exist")
        if segment_id in executed:
            fail(f"{here}: segment {segment_id} is also run in round {executed[segment_id]}")
        executed[segment_id] = round_index
    chain = [segments[s] for s in sequence.segments]
    for upper, lower in zip(chain[:-1], chain[1:]):
        if lower.parent != upper.id:
            fail(f"{here}: segment {lower.id} does not continue segment {upper.id}")
    if children[chain[-1].id]:
        fail(f"{here}: its last segment {chain[-1].id} is not a leaf segment")
    if (sequence.start, sequence.end) != (chain[0].start, chain[-1].end):
        fail(f"{here}: span [{sequence.start}, {sequence.end}) differs from its segments' [{chain[0].start}, {chain[-1].end})")
    if sequence.trajectory != chain[-1].trajectory:
        fail(f"{here}: should name the leaf segment's representative trajectory {chain[-1].trajectory}")


def _check_state_source(here: str, sequence: InputSequence, round_index: int, by_producer: dict,
                        prefixes: PrefixIndex, shared_of: dict[int, int]) -> tuple[int, int, int] | None:
    """The zero state (then no replay), or a state an earlier round exports on the same token prefix;
    returns the export it asks for."""
    source = sequence.state_from
    if source is None:
        if sequence.replay_start != 0:
            fail(f"{here}: starts from the zero state but replays from {sequence.replay_start}, not 0")
        return None
    if sequence.start == 0:
        fail(f"{here}: a root sequence must start from the zero state")
    if source.position != sequence.replay_start:
        fail(f"{here}: state_from position {source.position} differs from replay_start {sequence.replay_start}")
    if source.round >= round_index:
        fail(f"{here}: starts from a state of round {source.round}, which is not ready before round {round_index}")
    producer = by_producer.get((source.round, source.trajectory))
    if producer is None:
        fail(f"{here}: no sequence of trajectory {source.trajectory} runs in round {source.round}")
    if source.position not in producer.exports:
        fail(
            f"{here}: state at {source.position} is not exported by trajectory {source.trajectory} "
            f"in round {source.round} (exports {list(producer.exports)})"
        )
    shared = shared_of.get(id(sequence))
    if shared is None:
        shared = prefixes.lcp_trajectories(source.trajectory, sequence.trajectory)
    if shared < source.position:
        fail(f"{here}: shares only {shared} tokens with trajectory {source.trajectory}, so its state at {source.position} is another prefix's")
    return source.round, source.trajectory, source.position


def _check_exports(where: str, microbatch: Microbatch, chunk: int, requested: set[tuple[int, int, int]]) -> None:
    """Exports ascend on the chunk grid inside the sequence, and some later sequence starts from each."""
    for round_ in microbatch.rounds:
        for sequence in round_.sequences:
            if not sequence.exports:
                continue
            here = f"{where}, round {round_.index}, trajectory {sequence.trajectory}"
            if list(sequence.exports) != sorted(set(sequence.exports)):
                fail(f"{here}: exports {list(sequence.exports)} must be ascending without repeats")
            for export in sequence.exports:
                if export % chunk or not sequence.replay_start < export <= sequence.end:
                    fail(f"{here}: export {export} must be a multiple of {chunk} in ({sequence.replay_start}, {sequence.end}]")
                if (round_.index, sequence.trajectory, export) not in requested:
                    fail(f"{here}: exports the state at {export} but no later sequence starts from it")


def _check_coverage(where: str, trie: CompactTrie, microbatch: Microbatch, executed: dict[int, int],
                    covered: list[tuple[int, int]]) -> None:
    """Every segment runs, and every compact row of the microbatch is output exactly once."""
    unexecuted = sorted(set(range(len(microbatch.segments))) - executed.keys())
    if unexecuted:
        fail(f"{where}: segment {unexecuted[0]} is run by no input sequence")
    expected_rows = sorted(
        (trie.nodes[n].row, trie.nodes[n].row + trie.nodes[n].end - trie.nodes[n].start)
        for n in trie.used_nodes(microbatch.trajectories)
    )
    covered = sorted(covered)
    cursor = 0
    for low, high in covered:
        if low < cursor:
            fail(f"{where}: compact row {low} is output more than once")
        cursor = high
    if _merge(covered) != _merge(expected_rows):
        fail(f"{where}: the outputs do not cover exactly the microbatch's compact rows")


def _check_replay(where: str, microbatch: Microbatch, chunk: int) -> None:
    """R, the replayed rows, equals Eq. 15 and the recorded ``replay_tokens``."""
    segments = microbatch.segments
    replayed = sum(s.start - s.replay_start for round_ in microbatch.rounds for s in round_.sequences)
    expected = mandatory_replay([s.parent for s in segments], [s.end for s in segments], chunk)
    if replayed != expected or microbatch.replay_tokens != expected:
        fail(f"{where}: replay_tokens {microbatch.replay_tokens}, sequences replay {replayed}, Eq. 15 gives {expected}")


def _state_source_lcps(module: Module, prefixes: PrefixIndex) -> dict[int, int]:
    """The LCP of each sequence that starts from a state with the trajectory it reads the state from, by the
    sequence's ``id``: the sparse table answers all of them in one numpy expression, not one lookup each.
    Sequences whose trajectories are not the batch's are left out (their checks fail before the LCP is read)."""
    count = len(module.trajectories)
    sequences = [sequence for microbatch in module.microbatches for round_ in (microbatch.rounds or ())
                 for sequence in round_.sequences if sequence.state_from is not None
                 and 0 <= sequence.state_from.trajectory < count and 0 <= sequence.trajectory < count]
    if not sequences:
        return {}
    sources = np.fromiter((sequence.state_from.trajectory for sequence in sequences), dtype=np.int64, count=len(sequences))
    readers = np.fromiter((sequence.trajectory for sequence in sequences), dtype=np.int64, count=len(sequences))
    return dict(zip(map(id, sequences), prefixes.lcps_of_trajectories(sources, readers).tolist()))


def _verify_rounds(module: Module, microbatch: Microbatch, prefixes: PrefixIndex, shared_of: dict[int, int]) -> None:
    """One microbatch's rounds, invariant by invariant (each check names what it holds)."""
    where = f"microbatch {microbatch.index}"
    segments = microbatch.segments
    by_producer = _check_round_numbering(where, module, microbatch)
    members = set(microbatch.trajectories)
    children: list[list[int]] = [[] for _ in segments]
    for segment in segments:
        if segment.parent >= 0:
            children[segment.parent].append(segment.id)
    executed: dict[int, int] = {}
    requested: set[tuple[int, int, int]] = set()
    covered: list[tuple[int, int]] = []
    for round_ in microbatch.rounds:
        round_index = round_.index
        for sequence in round_.sequences:
            here = f"{where}, round {round_index}, trajectory {sequence.trajectory}"
            _check_span(here, module, members, sequence)
            _check_chain(here, segments, children, sequence, round_index, executed)
            request = _check_state_source(here, sequence, round_index, by_producer, prefixes, shared_of)
            if request is not None:
                requested.add(request)
            covered.extend(_output_rows(module.trie, sequence.trajectory, sequence.start, sequence.end))
    _check_exports(where, microbatch, module.chunk_size, requested)
    _check_coverage(where, module.trie, microbatch, executed, covered)
    _check_replay(where, microbatch, module.chunk_size)


def _merge(intervals: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for low, high in sorted(intervals):
        if merged and merged[-1][1] == low:
            merged[-1] = (merged[-1][0], high)
        else:
            merged.append((low, high))
    return merged


def verify_rounded(module: Module) -> None:
    """Rounds respect state readiness, replay < B on the grid, each compact row output once, R = Eq. 15."""
    if module.trie is None or module.microbatches is None:
        fail(f"phase {module.phase} needs a compact trie and microbatches")
    prefixes = PrefixIndex.from_module(module)
    shared_of = _state_source_lcps(module, prefixes)
    for microbatch in module.microbatches:
        if microbatch.segments is None:
            fail(f"microbatch {microbatch.index}: phase {module.phase} needs segments")
        _verify_rounds(module, microbatch, prefixes, shared_of)
