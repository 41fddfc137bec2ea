"""Hypothesis strategies for rollout batches whose forks land near chunk boundaries."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import strategies as st

from harts.rollouts.batch import RolloutBatch


@st.composite
def token_trees(draw, *, chunk_size: int = 8, max_trajectories: int = 10, max_length: int = 40, vocab: int = 5):
    """Token lists forming random rollout trees.

    New trajectories fork from an earlier one at a position drawn mostly from
    {B-1, B, B+1, 2B-1, 2B, 2B+1} and otherwise anywhere, so forks fall before, on and
    after chunk boundaries, several inside one chunk, and some trajectories are prefixes
    of others. A small vocabulary makes accidental sharing across trees common.
    """
    boundary_positions = sorted({p for c in (1, 2) for p in (c * chunk_size - 1, c * chunk_size, c * chunk_size + 1) if p > 0})
    count = draw(st.integers(1, max_trajectories))
    trajectories: list[list[int]] = []
    for _ in range(count):
        if trajectories and draw(st.booleans()):
            base = draw(st.sampled_from(trajectories))
            fork = draw(st.one_of(st.sampled_from(boundary_positions), st.integers(0, len(base))))
            fork = min(fork, len(base))
            tail_length = draw(st.integers(0 if fork else 1, max(1, max_length - fork)))
            tail = draw(st.lists(st.integers(0, vocab - 1), min_size=tail_length, max_size=tail_length))
            trajectory = base[:fork] + tail
        else:
            length = draw(st.integers(1, max_length))
            trajectory = draw(st.lists(st.integers(0, vocab - 1), min_size=length, max_size=length))
        trajectories.append(trajectory or [0])
    return trajectories


@st.composite
def rollout_batches(draw, **kwargs):
    return RolloutBatch.from_trajectories(draw(token_trees(**kwargs)))


@st.composite
def chunk_aligned_token_trees(draw, *, chunk_size: int = 8, max_trajectories: int = 8, max_length: int = 40):
    """Token lists forming random rollout trees whose forks all lie on multiples of ``chunk_size``.

    Every token drawn fresh is a new id (so ids reach ``max_trajectories * max_length``):
    trajectories share exactly the prefixes they were forked with and no accidental sharing
    can move a fork off the chunk grid. A fork may sit at a trajectory's end (the new one
    extends it) or make a prefix of another trajectory.
    """
    fresh = itertools.count()
    trajectories: list[list[int]] = []
    for _ in range(draw(st.integers(1, max_trajectories))):
        if trajectories and draw(st.integers(0, 3)):
            base = draw(st.sampled_from(trajectories))
            chunks = len(base) // chunk_size
            fork = chunk_size * draw(st.integers(min(1, chunks), chunks))
            tail_length = draw(st.integers(0 if fork else 1, max(1, max_length - fork)))
        else:
            base, fork, tail_length = [], 0, draw(st.integers(1, max_length))
        trajectories.append(base[:fork] + [next(fresh) for _ in range(tail_length)])
    return trajectories


def forked_trajectories(chunk: int) -> list[list[int]]:
    """Two-level forks just before, on and after a chunk boundary and mid-chunk (fixed, seed 0)."""
    rng = np.random.default_rng(0)
    prompt = list(rng.integers(0, 50, 21))
    trajectories = []
    for fork in (chunk - 1, chunk, chunk + 1, 13):
        base = prompt[:fork] + list(rng.integers(0, 50, 12))
        trajectories.append(base)
        trajectories.append(base[: fork + 5] + list(rng.integers(0, 50, 9)))
    return trajectories
