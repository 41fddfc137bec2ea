"""The serial chunk steps of a round plan, and the per-round caps that make them few.

A round's state scan walks each of its sequences' chunks one after another (one program per
sequence, head and value block), so when the device is not full the round lasts as long as
its longest sequence in chunks of B rows. The *critical path* of a microbatch is therefore

    sum over rounds r of  max over sequences s of round r of  ceil((end_s - replay_start_s) / B)

(``replay_start`` lies on the chunk grid, so this is the number of chunk steps the scan takes).
The trajectory-wise baseline needs only the longest trajectory's chunks; level-synchronous
rounds add the rest.

:func:`shortest_round_caps` searches the plans that ``min-call-rounds`` may choose from (the
same number of rounds, the same replay R; only the direct continuations differ) for a short
critical path. It works with per-round caps ``L_r`` on the longest sequence: one bottom-up
sweep (:func:`continuation_ends`) says whether some choice of continuations keeps every round
within its caps. The exact minimum of ``sum L_r`` needs a search over cap vectors that grows
with the number of rounds, so the caps are minimised one round at a time, in each direction
(first round first, last round first), each by bisection; the planner keeps whichever plan is
shortest, the paper's first-fit rule included, so the result is never longer than that rule's.
No library we build on plans chunkwise recurrences over prefix trees, hence the hand-written
sweep.

Measured (B=64): the harts-bench headline drops from 204 to 175 chunk steps (longest trajectory
130) and the 3x batch from 203 to 196 (longest 167), both the minimum an exhaustive search over
cap vectors finds; on random small trees the result matches a brute force over every choice
of continuations in about 99% of cases. Launching side branches in a later round than the
runtime contract does (the runtime would accept any earlier producer) was tried too: no shorter
plan for the headline or the 3x batch, under 0.1% on the SWE-like steps of
``benchmarks/bench_rounds.py``, so the contract's round assignment is kept. Cost: about
``2 * rounds * log2(longest path in chunks)`` linear sweeps, a few milliseconds per microbatch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from harts.ir.layout import MicrobatchLayout
from harts.ir.nodes import Microbatch


def round_chunk_steps(rounds: Sequence[int], replay_starts: Sequence[int], ends: Sequence[int], chunk_size: int) -> tuple[int, ...]:
    """Per round (0..max), the chunk steps of its longest sequence; one entry per sequence in the inputs."""
    count = max(rounds, default=-1) + 1
    steps = [0] * count
    for round_index, replay_start, end in zip(rounds, replay_starts, ends):
        steps[round_index] = max(steps[round_index], -(-(end - replay_start) // chunk_size))
    return tuple(steps)


def round_critical_path(target: Microbatch | MicrobatchLayout, chunk_size: int | None = None) -> tuple[int, ...]:
    """Per-round chunk steps of a rounded microbatch (give ``chunk_size``) or of a layout (it knows B).

    Their sum is the critical path of the microbatch's state scans.
    """
    if isinstance(target, MicrobatchLayout):
        return round_chunk_steps(
            np.asarray(target.seq_round).tolist(), np.asarray(target.seq_replay_start).tolist(),
            np.asarray(target.seq_end).tolist(), target.chunk_size,
        )
    if chunk_size is None:
        raise TypeError("round_critical_path of a microbatch needs the chunk size")
    if target.rounds is None:
        raise ValueError(f"microbatch {target.index} has no rounds; run 'min-call-rounds' first")
    sequences = [(round_.index, sequence) for round_ in target.rounds for sequence in round_.sequences]
    return round_chunk_steps(
        [r for r, _ in sequences], [s.replay_start for _, s in sequences], [s.end for _, s in sequences], chunk_size
    )


def side_launch(start: int, end: int, ready: bool, round_index: int, chunk_size: int) -> tuple[bool, int, int]:
    """How the side branches of segment ``[start, end)`` start (the runtime contract of ``min-call-rounds``).

    Returns ``(same, round, replay_chunk)``: ``same`` when they launch in the carrier's round from
    its ready anchor ``a_v``, else in the next round from ``b_v``; ``replay_chunk`` is that
    anchor in chunks.
    """
    anchor = start // chunk_size
    if ready and end < (anchor + 1) * chunk_size:
        return True, round_index, anchor
    return False, round_index + 1, end // chunk_size


def continuation_ends(children: Sequence[Sequence[int]], top_down: Sequence[int], starts: Sequence[int],
                      ends: Sequence[int], chunk_size: int, caps: Sequence[float]) -> list[list[tuple[float, float]]]:
    """``ends[v][r][ready]``: the least chunk index at which a sequence carrying ``v`` in round ``r`` can end.

    ``ready`` says whether ``S_{a_v}`` was ready before the round (as for ``t_pre`` / ``t_in``).
    The sequence ends where its direct-continuation chain reaches a leaf; every other child
    subtree must fit the caps: a side branch launched in round ``q < len(caps)`` that replays
    from chunk ``c`` must be able to end by chunk ``c + caps[q]``. ``inf`` when no choice fits.
    """
    rounds = len(caps)
    least: list[list[tuple[float, float]]] = [[] for _ in children]
    # Called once per bisection step, so the loops are kept lean: a segment whose span crosses
    # a chunk boundary launches its side branches the same way whether or not it was ready.
    for segment in reversed(top_down):
        kids = children[segment]
        if not kids:
            leaf_end = -(-ends[segment] // chunk_size)
            least[segment] = [(leaf_end, leaf_end)] * rounds
            continue
        anchor = starts[segment] // chunk_size
        inside = ends[segment] < (anchor + 1) * chunk_size
        boundary = ends[segment] // chunk_size
        row = []
        for round_index in range(rounds):
            exported = _least_chain_end(least, kids, round_index, round_index + 1, boundary, False, caps)
            ready = _least_chain_end(least, kids, round_index, round_index, anchor, True, caps) if inside else exported
            row.append((exported, ready))
        least[segment] = row
    return least


def side_branches_fit(least, kids: Sequence[int], side_round: int, replay_chunk: int, caps: Sequence[float]) -> list[bool]:
    """Per child: whether its subtree, launched as a side branch in ``side_round`` replaying from chunk
    ``replay_chunk``, can end within that round's cap (never, past the last capped round)."""
    if side_round >= len(caps):
        return [False] * len(kids)
    limit = caps[side_round] + replay_chunk
    return [least[child][side_round][1] <= limit for child in kids]


def _least_chain_end(least, kids: Sequence[int], round_index: int, side_round: int, replay_chunk: int, same: bool,
                     caps: Sequence[float]) -> float:
    """The earliest chain end over the children that can continue, side branches launching in ``side_round``."""
    fits = side_branches_fit(least, kids, side_round, replay_chunk, caps)
    misfits = fits.count(False)
    if misfits > 1:
        return math.inf
    if misfits == 1:
        return least[kids[fits.index(False)]][round_index][same]
    return min(least[child][round_index][same] for child in kids)


def _caps_fit(children, roots, top_down, starts, ends, chunk_size, caps) -> bool:
    least = continuation_ends(children, top_down, starts, ends, chunk_size, caps)
    return all(least[root][0][1] <= caps[0] for root in roots)


def shortest_round_caps(children: Sequence[Sequence[int]], roots: Sequence[int], top_down: Sequence[int],
                        starts: Sequence[int], ends: Sequence[int], chunk_size: int, rounds: int) -> tuple[list[int], ...]:
    """Cap vectors that some plan of ``rounds`` rounds meets, each minimised round by round.

    One vector per order (first round first, last round first). Each cap is bisected with the
    caps of the rounds not yet minimised left at the longest root-to-leaf path in chunks, which
    no sequence exceeds, so every step keeps the vector feasible. (An infinite cap would not
    do: ``inf <= inf`` would let an unplannable subtree pass.)
    """
    longest = max(-(-ends[leaf] // chunk_size) for leaf in range(len(ends)) if not children[leaf])
    found = []
    for order in (range(rounds), range(rounds - 1, -1, -1)):
        caps = [longest] * rounds  # no sequence is longer than the longest path: uncapped
        for round_index in order:
            low, high = 1, longest
            while low < high:
                middle = (low + high) // 2
                caps[round_index] = middle
                if _caps_fit(children, roots, top_down, starts, ends, chunk_size, caps):
                    high = middle
                else:
                    low = middle + 1
            caps[round_index] = low
        found.append(caps)
    return tuple(found)
