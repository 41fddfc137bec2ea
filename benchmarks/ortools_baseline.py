"""The OR-Tools planning baseline of §5.2: data distribution first, then per-replica bin packing.

1. Replica assignment: whole rollout trees go to the D replicas by shard-level first-fit
   decreasing on each tree's compact work C(tree): trees heaviest first, each to the first
   replica whose load stays within ceil(total / D), else to the least-loaded replica.
2. Groups: a tree whose compact work fits the capacity T is one group. A larger tree is
   cut at its shallowest fork into its sibling subtrees (every cut at the minimum LCP of
   consecutive members), recursively until each group fits. The cuts form a hierarchy of
   forks; groups below different branches of a fork share exactly that fork's prefix.
3. Per replica, a CP-SAT model packs groups into bins: ``x[g, b]`` puts group g in bin b,
   ``z[f, b]`` marks that bin b holds some group below fork f, ``y[b]`` opens bin b. The
   load of a bin is linear and exact within one tree: each group counts its tokens below
   its parent fork, each fork present in the bin counts the tokens it adds once:
   ``sum_g own_g x[g, b] + sum_f depth_f z[f, b] <= T y[b]``. Sharing between different
   trees (e.g. a common system prompt) is not modelled, so the modelled load can only
   over-estimate the true C(M). The objective minimises the number of bins, then the
   duplicated fork prefixes ``sum_f depth_f sum_b z[f, b]``. A first-fit-decreasing
   packing under the same load model is given as a complete hint and as the bin-count
   upper bound; each replica's solve has a wall-clock limit (default 2 s) and 2 workers.
   If CP-SAT returns no solution in time the hint is used (recorded in ``status``).
4. Replicas with fewer bins split microbatches until every replica has the same count:
   each split cuts the member list (in lexicographic order) where consecutive members
   share the fewest tokens, over all bins of that replica (ties: the heavier bin).
5. Slots: each replica's microbatches sorted by work, heaviest first; slot j takes the
   j-th of every replica.

Every microbatch's real compact work is then recomputed exactly with C(M) (Eq. 5).
"""

from __future__ import annotations

import time
from collections import defaultdict

import attrs
import numpy as np
from ortools.sat.python import cp_model

from harts.ir.nodes import Module
from harts.ir.prefix_index import PrefixIndex


@attrs.frozen(eq=False)
class BaselinePlan:
    microbatches: tuple[tuple[int, ...], ...]  # batch indices, ascending
    works: tuple[int, ...]
    replicas: tuple[int, ...]
    slots: tuple[int, ...]
    seconds: float
    solver_seconds: float
    status: tuple[str, ...]  # CP-SAT status per replica
    bins_before_equalising: tuple[int, ...]


def _group_work(index: PrefixIndex, ranks: list[int]) -> int:
    return index.ranks_work(np.asarray(ranks, dtype=np.int64))


@attrs.define
class _Hierarchy:
    """Subtree groups of the replica's trees and the forks that join them.

    ``groups[g]``: ascending ranks; ``own[g]``: its compact work minus the prefix it shares
    with its siblings. ``forks[s]``: the tokens fork ``s`` adds below its parent fork
    (every group under a fork shares exactly that fork's LCP with the groups under its
    other branches). ``ancestors[g]``: the forks above group g.
    """

    groups: list[list[int]] = attrs.field(factory=list)
    own: list[int] = attrs.field(factory=list)
    forks: list[int] = attrs.field(factory=list)
    ancestors: list[list[int]] = attrs.field(factory=list)


def _split_tree(index: PrefixIndex, ranks: list[int], capacity: int, hierarchy: _Hierarchy,
                above: list[int], parent_depth: int) -> None:
    """Add a tree (ascending ranks) as one group, or cut it at its shallowest fork into sibling groups."""
    work = _group_work(index, ranks)
    if work <= capacity or len(ranks) == 1:
        hierarchy.groups.append(ranks)
        hierarchy.own.append(work - parent_depth)
        hierarchy.ancestors.append(above)
        return
    links = [index.lcp_ranks(a, b) for a, b in zip(ranks[:-1], ranks[1:])]
    depth = min(links)
    fork = len(hierarchy.forks)
    hierarchy.forks.append(depth - parent_depth)
    branch = [ranks[0]]
    for rank, link in zip(ranks[1:], links):
        if link == depth:
            _split_tree(index, branch, capacity, hierarchy, above + [fork], depth)
            branch = []
        branch.append(rank)
    _split_tree(index, branch, capacity, hierarchy, above + [fork], depth)


def _bin_load(hierarchy: _Hierarchy, members: list[int]) -> int:
    """Compact work of a bin of groups under the hierarchy model (exact within one tree)."""
    forks = {fork for g in members for fork in hierarchy.ancestors[g]}
    return sum(hierarchy.own[g] for g in members) + sum(hierarchy.forks[f] for f in forks)


def _first_fit_decreasing(hierarchy: _Hierarchy, capacity: int) -> list[int]:
    """Groups heaviest first, each into the first bin whose modelled load stays within capacity."""
    bins: list[list[int]] = []
    loads: list[int] = []
    assignment = [0] * len(hierarchy.groups)
    full = [hierarchy.own[g] + sum(hierarchy.forks[f] for f in hierarchy.ancestors[g]) for g in range(len(hierarchy.groups))]
    for group in sorted(range(len(full)), key=lambda g: (-full[g], g)):
        for b, members in enumerate(bins):
            load = _bin_load(hierarchy, members + [group])
            if load <= capacity:
                members.append(group)
                loads[b] = load
                assignment[group] = b
                break
        else:
            assignment[group] = len(bins)
            bins.append([group])
            loads.append(full[group])
    return assignment


def _pack_replica(hierarchy: _Hierarchy, capacity: int, time_limit: float, workers: int) -> tuple[list[int], str, float]:
    """CP-SAT bin packing of one replica's groups; returns (bin of each group, status, solve seconds)."""
    hint = _first_fit_decreasing(hierarchy, capacity)
    groups = range(len(hierarchy.groups))
    bins = max(hint) + 1
    lower = max(1, -(-(sum(hierarchy.own) + sum(hierarchy.forks)) // capacity))
    if bins <= lower:
        return hint, "FFD_OPTIMAL", 0.0
    model = cp_model.CpModel()
    x = {(g, b): model.new_bool_var(f"x{g}_{b}") for g in groups for b in range(bins)}
    z = {(f, b): model.new_bool_var(f"z{f}_{b}") for f in range(len(hierarchy.forks)) for b in range(bins)}
    y = [model.new_bool_var(f"y{b}") for b in range(bins)]
    for g in groups:
        model.add_exactly_one(x[g, b] for b in range(bins))
        for b in range(bins):
            for fork in hierarchy.ancestors[g]:
                model.add_implication(x[g, b], z[fork, b])
    for b in range(bins):
        load = sum(hierarchy.own[g] * x[g, b] for g in groups) + sum(hierarchy.forks[f] * z[f, b] for f in range(len(hierarchy.forks)))
        model.add(load <= capacity * y[b])
        if b + 1 < bins:
            model.add(y[b] >= y[b + 1])
    model.add(sum(y) >= lower)
    duplicated = sum(hierarchy.forks[f] * z[f, b] for f in range(len(hierarchy.forks)) for b in range(bins))
    scale = 1 + sum(hierarchy.forks) * bins
    model.minimize(scale * sum(y) + duplicated)
    for g, b in enumerate(hint):
        for other in range(bins):
            model.add_hint(x[g, other], other == b)
    for f in range(len(hierarchy.forks)):
        present = {hint[g] for g in groups if f in hierarchy.ancestors[g]}
        for b in range(bins):
            model.add_hint(z[f, b], b in present)
    for b in range(bins):
        model.add_hint(y[b], True)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = workers
    started = time.perf_counter()
    status = solver.solve(model)
    seconds = time.perf_counter() - started
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return hint, f"{solver.status_name(status)}->FFD", seconds
    assignment = [next(b for b in range(bins) if solver.value(x[g, b])) for g in groups]
    return assignment, solver.status_name(status), seconds


def ortools_plan(module: Module, capacity: int | None = None, dp_size: int | None = None,
                 time_limit: float = 2.0, workers: int = 2) -> BaselinePlan:
    started = time.perf_counter()
    capacity = module.capacity if capacity is None else capacity
    dp_size = module.dp_size if dp_size is None else dp_size
    index = PrefixIndex.from_module(module)
    members_of_tree: dict[int, list[int]] = defaultdict(list)
    for trajectory in module.trajectories:
        members_of_tree[trajectory.tree].append(int(index.rank[trajectory.index]))
    tree_ids = sorted(members_of_tree)
    tree_ranks = {tree: sorted(members_of_tree[tree]) for tree in tree_ids}
    tree_work = {tree: _group_work(index, tree_ranks[tree]) for tree in tree_ids}

    # 1. shard-level first-fit decreasing of whole trees onto replicas
    target = -(-sum(tree_work.values()) // dp_size)
    loads = [0] * dp_size
    trees_of_replica: list[list[int]] = [[] for _ in range(dp_size)]
    for tree in sorted(tree_ids, key=lambda t: (-tree_work[t], t)):
        replica = next((d for d in range(dp_size) if loads[d] + tree_work[tree] <= target), None)
        if replica is None:
            replica = min(range(dp_size), key=lambda d: (loads[d], d))
        loads[replica] += tree_work[tree]
        trees_of_replica[replica].append(tree)

    # 2-3. items and CP-SAT packing per replica
    solver_seconds = 0.0
    statuses = []
    bins_of_replica: list[list[list[int]]] = []
    for replica in range(dp_size):
        hierarchy = _Hierarchy()
        for tree in trees_of_replica[replica]:
            _split_tree(index, tree_ranks[tree], capacity, hierarchy, [], 0)
        if not hierarchy.groups:
            bins_of_replica.append([])
            statuses.append("EMPTY")
            continue
        assignment, status, seconds = _pack_replica(hierarchy, capacity, time_limit, workers)
        solver_seconds += seconds
        statuses.append(status)
        bins = [sorted(r for g, group in enumerate(hierarchy.groups) if assignment[g] == b for r in group)
                for b in sorted(set(assignment))]
        bins_of_replica.append(bins)
    before = tuple(len(b) for b in bins_of_replica)

    # 4. equalise the microbatch count of every replica with the cheapest splits
    wanted = max(before)
    for replica, bins in enumerate(bins_of_replica):
        while len(bins) < wanted:
            best = None
            for position, ranks in enumerate(bins):
                if len(ranks) < 2:
                    continue
                links = [index.lcp_ranks(a, b) for a, b in zip(ranks[:-1], ranks[1:])]
                cut = int(np.argmin(links))
                key = (links[cut], -_group_work(index, ranks), position)
                if best is None or key < best[0]:
                    best = (key, position, cut + 1)
            if best is None:
                raise ValueError(f"OR-Tools baseline: replica {replica} has too few trajectories for {wanted} microbatches")
            _, position, cut = best
            ranks = bins[position]
            bins[position : position + 1] = [ranks[:cut], ranks[cut:]]

    # 5. slots: heaviest first on every replica
    microbatches, works, replicas, slots = [], [], [], []
    for replica, bins in enumerate(bins_of_replica):
        weighted = sorted(((_group_work(index, ranks), ranks) for ranks in bins), key=lambda item: (-item[0], item[1][0]))
        for slot, (work, ranks) in enumerate(weighted):
            microbatches.append(tuple(sorted(int(index.order[r]) for r in ranks)))
            works.append(work)
            replicas.append(replica)
            slots.append(slot)
    return BaselinePlan(
        microbatches=tuple(microbatches),
        works=tuple(works),
        replicas=tuple(replicas),
        slots=tuple(slots),
        seconds=time.perf_counter() - started,
        solver_seconds=solver_seconds,
        status=tuple(statuses),
        bins_before_equalising=before,
    )
