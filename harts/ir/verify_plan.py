"""Invariants of the ``partitioned`` and ``scheduled`` phases (owned by the planner).

partitioned: exact coverage, nonempty microbatches with ascending members, indices 0..K-1
in order, ``work == C(M)`` recomputed from the trie's LCPs, ``work <= capacity``,
``K mod dp_size == 0``. scheduled adds (:func:`harts.ir.verify.verify` runs both checks): every microbatch has a replica in ``0..D-1`` and a
slot in ``0..K/D-1``, every (replica, slot) pair occurs once (so each replica runs K/D
microbatches), and microbatches are listed by (slot, replica).
"""

from __future__ import annotations

import itertools

import numpy as np

from harts.ir.nodes import Module
from harts.ir.prefix_index import PrefixIndex
from harts.ir.verify_common import fail


def verify_partitioned(module: Module) -> None:
    microbatches = module.microbatches
    if microbatches is None:
        fail(f"phase {module.phase} needs microbatches")
    if module.trie is None:
        fail(f"phase {module.phase} needs a compact trie")
    if not _partition_holds(module):
        _verify_partition_member_by_member(module)
    if len(microbatches) % module.dp_size:
        fail(f"{len(microbatches)} microbatches is not a multiple of dp_size {module.dp_size}")


def _partition_holds(module: Module) -> bool:
    """Whether every invariant that :func:`_verify_partition_member_by_member` checks holds, checked over all
    microbatches at once (numpy expressions instead of a Python step per member); that function then finds and
    names the first fault."""
    microbatches, count = module.microbatches, len(module.trajectories)
    if any(mb.index != position or not mb.trajectories for position, mb in enumerate(microbatches)):
        return False
    groups = [mb.trajectories for mb in microbatches]
    # plain ints only, as the IR holds them: anything else is for the member-by-member check to judge
    if not all(type(mb.work) is int for mb in microbatches) or not all(type(t) is int for t in itertools.chain.from_iterable(groups)):
        return False
    sizes = np.fromiter((len(group) for group in groups), dtype=np.int64, count=len(groups))
    try:
        members = np.fromiter(itertools.chain.from_iterable(groups), dtype=np.int64, count=int(sizes.sum()))
    except OverflowError:
        return False
    if members.size != count or (members < 0).any() or (members >= count).any():
        return False
    first = np.zeros(members.size, dtype=bool)
    first[np.cumsum(sizes)[:-1]] = True
    if ((members[1:] <= members[:-1]) & ~first[1:]).any() or (np.bincount(members, minlength=count) != 1).any():
        return False
    works = np.array([mb.work for mb in microbatches], dtype=np.int64)
    return bool((works == PrefixIndex.from_module(module).subsets_work(groups)).all() and (works <= module.capacity).all())


def _verify_partition_member_by_member(module: Module) -> None:
    """Exact coverage, ascending members, indices 0..K-1 and each microbatch's work and capacity, member by
    member: the first fault, named."""
    microbatches = module.microbatches
    count = len(module.trajectories)
    owner: dict[int, int] = {}
    for position, mb in enumerate(microbatches):
        if mb.index != position:
            fail(f"microbatch at position {position} has index {mb.index}; indices must be 0..K-1 in order")
        if not mb.trajectories:
            fail(f"microbatch {mb.index} holds no trajectories")
        previous = -1
        for trajectory in mb.trajectories:
            if not 0 <= trajectory < count:
                fail(f"microbatch {mb.index}: trajectory {trajectory} does not exist (the batch has {count})")
            if trajectory <= previous:
                fail(f"microbatch {mb.index}: trajectories must be ascending batch indices, got {trajectory} after {previous}")
            previous = trajectory
            if trajectory in owner:
                fail(f"trajectory {trajectory} is in microbatch {owner[trajectory]} and microbatch {mb.index}")
            owner[trajectory] = mb.index
    if len(owner) != count:
        missing = next(i for i in range(count) if i not in owner)
        fail(f"trajectory {missing} is in no microbatch")
    index = PrefixIndex.from_module(module)
    for mb in microbatches:
        work = index.subset_work(mb.trajectories)
        if mb.work != work:
            fail(f"microbatch {mb.index}: work is {mb.work} but its trajectories hold {work} compact tokens")
        if work > module.capacity:
            fail(f"microbatch {mb.index}: work {work} exceeds the capacity {module.capacity}")


def verify_scheduled(module: Module) -> None:
    """The slots (the partitioned invariants are the partitioned phase's own check; ``verify`` runs both)."""
    microbatches = module.microbatches
    dp_size = module.dp_size
    slots = len(microbatches) // dp_size
    seen: dict[tuple[int, int], int] = {}
    previous: tuple[int, int] | None = None
    for mb in microbatches:
        if mb.replica is None or mb.slot is None:
            fail(f"microbatch {mb.index} has no replica/slot")
        if not 0 <= mb.replica < dp_size:
            fail(f"microbatch {mb.index}: replica {mb.replica} outside 0..{dp_size - 1}")
        if not 0 <= mb.slot < slots:
            fail(f"microbatch {mb.index}: slot {mb.slot} outside 0..{slots - 1} (K/D = {slots} slots)")
        key = (mb.replica, mb.slot)
        if key in seen:
            fail(f"microbatches {seen[key]} and {mb.index} both run on replica {mb.replica} in slot {mb.slot}")
        seen[key] = mb.index
        if previous is not None and (mb.slot, mb.replica) <= previous:
            fail(f"microbatch {mb.index} (slot {mb.slot}, replica {mb.replica}) is out of (slot, replica) order")
        previous = (mb.slot, mb.replica)
