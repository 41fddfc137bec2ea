"""Segment / round test helpers: compressed and scheduled modules of forked trees."""

from __future__ import annotations

from collections.abc import Sequence
import itertools
import math

from hypothesis import strategies as st
import attrs

from harts.rollouts.batch import RolloutBatch
from harts.ir.nodes import Microbatch, Module, Phase
from harts.ir.prefix_index import PrefixIndex
from harts.passes import PassContext, lower
from harts.passes.prefix_compress import PrefixCompress


@st.composite
def forked_trees(draw, *, chunk_size: int = 4, max_segments: int = 9, max_trees: int = 2, vocab: int = 3):
    """Token lists of one or more rollout trees with forks placed relative to the chunk grid."""
    b = chunk_size
    near_boundary = [p for p in (b - 1, b, b + 1, 2 * b - 1, 2 * b, 2 * b + 1) if p > 0]
    trajectories: list[list[int]] = []
    for tree in range(draw(st.integers(1, max_trees))):
        budget = [draw(st.integers(1, max_segments))]

        def grow(prefix: list[int], first_token: int, depth: int) -> None:
            budget[0] -= 1
            if len(prefix) == 0:
                length = draw(st.one_of(st.sampled_from(near_boundary), st.integers(1, 3 * b)))
            else:
                length = draw(st.one_of(st.sampled_from([1, 2, b - 1, b, b + 1]).filter(lambda n: n > 0), st.integers(1, 2 * b)))
            body = draw(st.lists(st.integers(0, vocab - 1), min_size=length - 1, max_size=length - 1))
            path = prefix + [first_token] + body
            fan_out = draw(st.integers(0, 3)) if depth < 4 and budget[0] > 0 else 0
            fan_out = min(fan_out, budget[0])
            if fan_out == 0 or draw(st.integers(0, 4)) == 0:
                # A leaf, or a trajectory that ends inside another one's path.
                trajectories.append(path)
            if fan_out and draw(st.integers(0, 5)) == 0:
                trajectories.append(list(path))  # a duplicate
            # Distinct first tokens make every listed child a real branch of the fork.
            for child in range(fan_out):
                grow(path, 100 + child, depth + 1)

        grow([], 1000 + tree, 0)
    return trajectories


def microbatch_split(draw, count: int, max_groups: int = 3) -> list[tuple[int, ...]]:
    """A random partition of ``range(count)`` into non-empty groups."""
    groups = draw(st.integers(1, min(max_groups, count)))
    labels = draw(st.lists(st.integers(0, groups - 1), min_size=count, max_size=count))
    labels[:groups] = range(groups)  # every group non-empty
    return [tuple(i for i in range(count) if labels[i] == g) for g in range(groups)]


def compressed_module(token_lists: Sequence[Sequence[int]], chunk_size: int) -> tuple[RolloutBatch, Module]:
    batch = RolloutBatch.from_trajectories([list(t) for t in token_lists])
    module = lower(batch, chunk_size=chunk_size)
    module = PrefixCompress().run(module, PassContext(batch=batch))
    return batch, module


def scheduled_module(token_lists: Sequence[Sequence[int]], chunk_size: int, groups: Sequence[Sequence[int]] | None = None) -> tuple[RolloutBatch, Module]:
    """A ``scheduled`` module whose microbatches are the given trajectory groups (default: one)."""
    batch, module = compressed_module(token_lists, chunk_size)
    if groups is None:
        groups = [tuple(range(len(token_lists)))]
    prefixes = PrefixIndex.from_module(module)
    microbatches = tuple(
        Microbatch(index=j, trajectories=tuple(sorted(group)), work=prefixes.subset_work(group), replica=0, slot=j)
        for j, group in enumerate(groups)
    )
    return batch, attrs.evolve(module, phase=Phase.SCHEDULED, microbatches=microbatches)


@st.composite
def segment_trees(draw, *, max_segments: int = 7, chunk_sizes=(2, 3, 4, 5)):
    """(parents, starts, ends, B): a random segment tree with lengths around the chunk size."""
    chunk = draw(st.sampled_from(chunk_sizes))
    count = draw(st.integers(1, max_segments))
    # Random trees exercise fan-out; deep ones (parents among the last two segments) and
    # binary heaps build the nested forks whose side branches need rounds of their own.
    shape = draw(st.sampled_from(["random", "deep", "heap"]))
    if shape == "heap":
        parents = [-1] + [(v - 1) // 2 for v in range(1, count)]
    else:
        parents = [-1] + [draw(st.integers(0 if shape == "random" else max(0, v - 2), v - 1)) for v in range(1, count)]
    length = st.one_of(st.sampled_from([1, chunk - 1, chunk, chunk + 1, 2 * chunk]).filter(lambda n: n > 0), st.integers(1, 2 * chunk + 1))
    lengths = [draw(length) for _ in range(count)]
    starts, ends = [0] * count, [0] * count
    for v in range(count):
        starts[v] = 0 if parents[v] < 0 else ends[parents[v]]
        ends[v] = starts[v] + lengths[v]
    return parents, starts, ends, chunk


def segment_tree_tokens(parents: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> list[list[int]]:
    """Root-to-leaf token lists whose forks are exactly the segment tree's (one token id per segment)."""
    children = tree_children(parents)
    token_lists = []
    for leaf in (v for v in range(len(parents)) if not children[v]):
        path = list(reversed(ancestors(parents, leaf)))
        token_lists.append([10 + v for v in path for _ in range(ends[v] - starts[v])])
    return token_lists


def ancestors(parents: Sequence[int], segment: int) -> list[int]:
    """The segment and its ancestors, leaf first."""
    path = []
    while segment >= 0:
        path.append(segment)
        segment = parents[segment]
    return path


def state_key(parents, starts, ends, segment: int, position: int):
    """Identity of the recurrent state after ``position`` tokens on the path to ``segment``."""
    if position == 0:
        return "zero"
    for node in ancestors(parents, segment):
        if starts[node] < position <= ends[node]:
            return (node, position)
    raise AssertionError(f"position {position} is not on the path to segment {segment}")


def chains_for_choice(parents, children, choice: dict[int, int]) -> list[list[int]]:
    """Input sequences (direct-continuation chains) when ``choice[v]`` continues every internal v."""
    heads = [v for v in range(len(parents)) if parents[v] < 0 or choice[parents[v]] != v]
    chains = []
    for head in heads:
        chain = [head]
        while children[chain[-1]]:
            chain.append(choice[chain[-1]])
        chains.append(chain)
    return chains


def sequence_states(parents, starts, ends, chunk_size, chain):
    """(replay_start, key of the initial state, keys of every chunk-boundary state it computes)."""
    head, last = chain[0], chain[-1]
    parent = parents[head]
    replay_start = 0 if parent < 0 else chunk_size * (ends[parent] // chunk_size)
    initial = state_key(parents, starts, ends, last, replay_start)
    computed = {
        state_key(parents, starts, ends, last, p)
        for p in range(replay_start + 1, ends[last] + 1)
        if p % chunk_size == 0
    }
    return replay_start, initial, computed


def schedule_is_legal(initial_keys, computed_keys, launch_rounds) -> bool:
    """Each sequence starts from the zero state or a state some earlier round computed."""
    for sequence, key in enumerate(initial_keys):
        if key == "zero":
            continue
        if not any(launch_rounds[y] < launch_rounds[sequence] and key in computed_keys[y] for y in range(len(initial_keys))):
            return False
    return True


def tree_children(parents: Sequence[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for v, p in enumerate(parents):
        if p >= 0:
            children[p].append(v)
    return children


def all_choices(children) -> list[dict[int, int]]:
    internal = [v for v in range(len(children)) if children[v]]
    return [dict(zip(internal, picked)) for picked in itertools.product(*(children[v] for v in internal))]


def brute_force_rounds_exhaustive(parents, starts, ends, chunk_size, max_rounds: int = 8) -> tuple[int, set[int]]:
    """Minimum over every direct-child choice and every round assignment; also the replay totals seen."""
    children = tree_children(parents)
    best = None
    replay_totals = set()
    for choice in all_choices(children):
        chains = chains_for_choice(parents, children, choice)
        described = [sequence_states(parents, starts, ends, chunk_size, c) for c in chains]
        replay_totals.add(sum(starts[c[0]] - d[0] for c, d in zip(chains, described)))
        initial = [d[1] for d in described]
        computed = [d[2] for d in described]
        limit = best if best is not None else max_rounds + 1
        for rounds in range(1, limit):
            if any(schedule_is_legal(initial, computed, launch) for launch in itertools.product(range(rounds), repeat=len(chains))):
                best = rounds
                break
    return best, replay_totals


def earliest_rounds(parents, starts, ends, chunk_size, chains) -> list[int]:
    """Least fixpoint of launch rounds: each sequence starts right after a producer of its state."""
    described = [sequence_states(parents, starts, ends, chunk_size, c) for c in chains]
    launch = [0 if d[1] == "zero" else None for d in described]
    changed = True
    while changed:
        changed = False
        for sequence, (_, key, _) in enumerate(described):
            if key == "zero":
                continue
            options = [launch[y] + 1 for y, d in enumerate(described) if launch[y] is not None and key in d[2]]
            value = min(options) if options else None
            if value is not None and (launch[sequence] is None or value < launch[sequence]):
                launch[sequence] = value
                changed = True
    assert all(value is not None for value in launch), "some sequence can never start"
    return launch


def brute_force_rounds_fixpoint(parents, starts, ends, chunk_size) -> int:
    children = tree_children(parents)
    return min(
        max(earliest_rounds(parents, starts, ends, chunk_size, chains_for_choice(parents, children, choice))) + 1
        for choice in all_choices(children)
    )


def contract_schedule(parents, starts, ends, chunk_size, choice: dict[int, int]) -> list[tuple[list[int], int, int]]:
    """(chain, round, replay_start) of every sequence when ``choice`` continues each internal segment,
    rounds as the runtime contract of ``min-call-rounds`` sets them: a side branch of ``v`` launches
    in its carrier's round from ``a_v`` when ``S_{a_v}`` was ready and ``v`` crosses no boundary,
    else in the next round from ``b_v``. Written from the docstring, not from the planner."""
    children = tree_children(parents)
    schedule = []
    pending = [(root, 0, 0) for root in range(len(parents)) if parents[root] < 0]
    while pending:
        head, round_index, replay_start = pending.pop()
        chain, ready, segment = [], True, head
        while True:
            chain.append(segment)
            if not children[segment]:
                break
            anchor = chunk_size * (starts[segment] // chunk_size)
            same = ready and ends[segment] < anchor + chunk_size
            for side in children[segment]:
                if side != choice[segment]:
                    if same:
                        pending.append((side, round_index, anchor))
                    else:
                        pending.append((side, round_index + 1, chunk_size * (ends[segment] // chunk_size)))
            ready, segment = same, choice[segment]
        schedule.append((chain, round_index, replay_start))
    return schedule


def chunk_steps_of(schedule, ends, chunk_size) -> tuple[int, ...]:
    """Per round, the chunks of its longest sequence (independent of the library's metric)."""
    steps = [0] * (max(r for _, r, _ in schedule) + 1)
    for chain, round_index, replay_start in schedule:
        steps[round_index] = max(steps[round_index], math.ceil((ends[chain[-1]] - replay_start) / chunk_size))
    return tuple(steps)


def brute_force_critical_path(parents, starts, ends, chunk_size) -> tuple[int, int]:
    """(fewest rounds, least critical path among the choices with that many rounds) over every choice."""
    children = tree_children(parents)
    best = None
    for choice in all_choices(children):
        steps = chunk_steps_of(contract_schedule(parents, starts, ends, chunk_size, choice), ends, chunk_size)
        key = (len(steps), sum(steps))
        best = key if best is None or key < best else best
    return best
