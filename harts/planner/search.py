"""Candidate generation, refinement and selection by J (§3.2).

Candidates are labellings of the lexicographic ranks (``labels[rank]`` = microbatch id,
ids ordered by each microbatch's smallest rank). Sources:

* ``N <= exact_threshold``: the exact contiguous DP for every DP-compatible K of Eq. 8;
* otherwise: the natural partition evolved by merges/splits to a sampled set of K
  (``sampled/K=...``); when no adjacent pair fits together a merge step re-cuts three
  adjacent microbatches into two instead of failing. A second merge chain
  (``sampled-recut/K=...``) takes a re-cut whenever it saves more than the best merge;
* unless ``greedy=False``: the trie-aware greedy candidate (four orders x two policies,
  small-microbatch elimination, DP alignment, preselected by fewest microbatches then
  least work), a piece greedy candidate (``pieces/...``) that places whole
  natural-partition intervals heaviest first with the interval form of Eq. 10, and the
  same piece greedy over whole-tree units (``units/...``, :func:`contiguous.unit_partition`:
  each tree that fits is one item, larger trees are cut into their natural pieces). The
  natural partition stops splitting as soon as an interval fits, so its pieces are often
  more than half a microbatch and pack poorly; trees are smaller items and, placed heaviest
  first by best fit, fill microbatches nearly to capacity. A tree kept whole also never
  repeats its own stem, which a trajectory-by-trajectory greedy often does.

The re-cut merge and both piece greedies go beyond the paper's description: they are extra
heuristic candidates that only add to the comparison, so every paper candidate still
competes and the guarantees are unchanged. ``extended=False`` leaves them out.

Refinement (``refine=True``) adds refined copies without removing anything: for small
inputs only the greedy candidates are refined; for large inputs also up to three base
anchors (the base plan at the greedy K, the lowest-work base plan, the base plan whose K
is closest to the greedy K). Contiguous candidates get boundary refinement first; all
get sparse repair. Every candidate is then ranked by J under the slot rule (the assignment itself is
for ``schedule-slots`` to make, the one place replicas and slots are set).

Two further steps go beyond the paper and also only add candidates. With ``exchange=True``
(and ``extended``) the ``exchange_candidates`` best candidates by J get subtree exchange
(``harts.planner.exchange``: whole subtrees moved or swapped to a microbatch that shares more
with them, while that strictly lowers compact work), added as ``...+exchanged``. With
``balance=True`` (and D > 1) the ``balance_candidates`` best candidates by J then get
within-slot balancing (``harts.planner.balance``: exact subtree and unit moves and swaps that
never add compact work, scored by the exact J2 after the slot rule), added as
``...+balanced``. Each copy is added only when its J is strictly lower. The
lexicographically smallest J wins (ties: smaller K, then the first generated).

Planning time is charged to the speedup (§3.2), so every stage beyond the paper (the re-cut
chain, the piece and unit greedies, subtree exchange, slot balancing) has a work budget of
``<stage>_work * N`` units (:mod:`harts.planner.budget`) and bounded neighbourhoods: a
stage costs time near-linear in N on every batch shape, and what it found before its budget ran
out still competes. Since every paper candidate competes too, the plan's J is never worse than
the paper's stages alone. ``PlanResult.work`` reports the units each stage used.
"""

from __future__ import annotations

import logging
import time

import attrs
import numpy as np

from harts.errors import PlanningError
from harts.ir.prefix_index import PrefixIndex
from harts.planner import balance, contiguous, exchange, greedy, repair
from harts.planner.budget import WorkBudget
from harts.planner.ranks import RankSpace
from harts.planner.schedule import slot_rule_objective

logger = logging.getLogger(__name__)

#: the work budgets of the stages beyond the paper (:mod:`harts.planner.budget`); :data:`STAGES` says which stage draws on each
EXTENSION_STAGES = ("recut", "pieces", "exchange", "balance")


@attrs.frozen
class PlannerOptions:
    """Targets and search knobs; defaults follow the paper (N0 = 512, Q_max = 32, H = 8)."""

    capacity: int
    dp_size: int = 1
    exact_threshold: int = 512
    sample_budget: int = 32
    refine: bool = True
    greedy: bool = True
    window: int = 8
    boundary_sweeps: int = 2
    repair_iterations: int = 4
    refine_anchors: int = 3
    #: add the candidates that go beyond the paper (re-cut merges, piece greedy, subtree
    #: exchange); False generates exactly the paper's candidate set (slot balancing is
    #: switched separately by ``balance``)
    extended: bool = True
    #: within-slot balancing (``harts.planner.balance``) of the best candidates by J; it only
    #: adds candidates whose J is strictly lower and whose total work is not higher
    balance: bool = True
    balance_candidates: int = 1
    balance_rounds: int = 64
    balance_window: int = 4
    #: with ``exchange``: balancing rounds that take every work-saving subtree exchange, even one
    #: that raises the slot excess (later rounds keep the excess from growing)
    balance_exchange_rounds: int = 3
    #: subtree exchange (``harts.planner.exchange``) of the best candidates by J: whole subtrees
    #: moved or swapped between microbatches when that strictly lowers compact work; needs
    #: ``extended`` (it goes beyond the paper) and only adds candidates
    exchange: bool = True
    exchange_candidates: int = 2
    exchange_rounds: int = 32
    exchange_window: int = 8
    #: partners per unit or subtree in the exchange and balancing neighbourhoods (nearest in work)
    reach: int = 8
    #: work budgets (:mod:`harts.planner.budget`) of the stages beyond the paper, in units per trajectory (a
    #: stage stops, or is not started, once it would use more than this times N). A unit of the re-cut chain is
    #: one adjacent pair or window scanned (plain Python, about 0.1 us); of the piece and unit greedies one
    #: piece evaluated against one open microbatch (Eq. 10, vectorised, about 0.2 us); of subtree exchange and
    #: slot balancing one exact change evaluated or one trajectory of a round's tables (about 1 us)
    recut_work: int = 256
    pieces_work: int = 256
    exchange_work: int = 64
    balance_work: int = 128


@attrs.frozen(eq=False)
class Candidate:
    """One candidate plan: membership, works and J under the slot rule (the assignment itself is
    ``schedule-slots``' to make, the one place replicas and slots are assigned)."""

    source: str
    labels: np.ndarray
    works: np.ndarray
    objective: tuple[int, int, int]

    @property
    def count(self) -> int:
        return len(self.works)


@attrs.frozen(eq=False)
class PlanResult:
    """The chosen plan in batch indices, with every candidate's summary for reporting.

    ``microbatches[i]`` are the ascending batch indices of microbatch ``i``; microbatches
    are ordered by their lexicographically smallest member. ``objective`` is J under the slot
    rule that ``schedule-slots`` applies to them.
    """

    microbatches: tuple[tuple[int, ...], ...]
    works: tuple[int, ...]
    objective: tuple[int, int, int]
    source: str
    lower_bound: int
    natural_count: int
    k_range: tuple[int, ...]
    candidates: tuple[tuple[str, int, tuple[int, int, int]], ...]
    seconds: dict
    #: work units used by each stage beyond the paper, and the budget each had (deterministic)
    work: dict
    work_limits: dict


def _instantiate(space: RankSpace, labels: np.ndarray, dp_size: int, source: str) -> Candidate:
    labels = greedy.canonical_labels(labels)
    count = int(labels.max()) + 1
    works = space.group_works(labels, count)
    # canonical ids already follow each microbatch's smallest rank: a content-only tie key
    return Candidate(source, labels, works, slot_rule_objective(works, np.arange(count), dp_size))


def select_best(candidates: list[Candidate]) -> Candidate:
    """The lexicographically smallest J (Eq. 4); ties to fewer microbatches, then the earliest candidate."""
    return min(enumerate(candidates), key=lambda item: (item[1].objective, item[1].count, item[0]))[1]


def instantiate(index: PrefixIndex, labels, dp_size: int, source: str = "given") -> Candidate:
    """A candidate from microbatch labels by rank: canonical ids, works and J."""
    return _instantiate(RankSpace(index), np.asarray(labels, dtype=np.int64), dp_size, source)


def check_plannable(index: PrefixIndex, capacity: int, dp_size: int) -> None:
    """Raise :class:`PlanningError` for inputs no valid plan can serve."""
    too_long = np.flatnonzero(index.lengths > capacity)
    if too_long.size:
        rank = int(too_long[np.argmax(index.lengths[too_long])])
        trajectory = int(index.order[rank])
        raise PlanningError(
            f"trajectory {trajectory} has {int(index.lengths[rank])} tokens, more than the microbatch capacity {capacity}; "
            "a trajectory cannot be split between microbatches, so raise the capacity"
        )
    if index.size < dp_size:
        raise PlanningError(
            f"the batch has {index.size} trajectories but dp_size is {dp_size}: every DP replica needs at least one "
            "nonempty microbatch (K must be a positive multiple of dp_size), so use fewer replicas or more trajectories"
        )


@attrs.define
class _Search:
    """What the stages of one search share: the inputs, what each stage generated, and the budgets."""

    space: RankSpace
    options: PlannerOptions
    lower_bound: int
    natural: list
    k_values: list[int]
    budgets: dict[str, WorkBudget]
    exact: bool
    base: list[tuple[str, np.ndarray]] = attrs.field(factory=list)
    greedy_choice: object = None
    piece_choices: list = attrs.field(factory=list)
    generated: list[tuple[str, np.ndarray]] = attrs.field(factory=list)
    candidates: list[Candidate] = attrs.field(factory=list)
    seen: set[bytes] = attrs.field(factory=set)

    @property
    def size(self) -> int:
        return self.space.size

    def add_if_better(self, labels: np.ndarray, source: str, than: Candidate) -> None:
        """Add the candidate of ``labels`` when its J is strictly below ``than``'s and it is new."""
        candidate = _instantiate(self.space, labels, self.options.dp_size, source)
        if candidate.objective < than.objective and candidate.labels.tobytes() not in self.seen:
            self.seen.add(candidate.labels.tobytes())
            self.candidates.append(candidate)

    def best_first(self) -> list[Candidate]:
        ranked = sorted(enumerate(self.candidates), key=lambda item: (item[1].objective, item[1].count, item[0]))
        return [candidate for _, candidate in ranked]


def _start(index: PrefixIndex, options: PlannerOptions) -> _Search:
    capacity, dp_size = options.capacity, options.dp_size
    if capacity < 1 or dp_size < 1:
        raise PlanningError(f"capacity ({capacity}) and dp_size ({dp_size}) must be positive")
    check_plannable(index, capacity, dp_size)
    space = RankSpace(index)
    n = space.size
    lower_bound = space.interval_work(0, n - 1)
    natural = contiguous.natural_partition(space, capacity)
    k_values = contiguous.k_range(lower_bound, len(natural), n, capacity, dp_size)
    if k_values[0] > n:
        raise PlanningError(
            f"no DP-compatible plan: the batch needs at least {k_values[0]} microbatches ({lower_bound} compact tokens at "
            f"capacity {capacity}, rounded up to a multiple of dp_size {dp_size}) but has only {n} trajectories"
        )
    budgets = {stage: WorkBudget(limit=getattr(options, f"{stage}_work") * n) for stage in EXTENSION_STAGES}
    return _Search(space, options, lower_bound, natural, k_values, budgets, exact=n <= options.exact_threshold)


def _base_stage(search: _Search) -> None:
    """The paper's contiguous candidates: the exact DP for every K, or evolved natural partitions for sampled K."""
    space, options, natural, n = search.space, search.options, search.natural, search.size
    if search.exact:
        for k, starts in sorted(contiguous.exact_partitions(space, options.capacity, search.k_values).items()):
            search.base.append((f"exact/K={k}", contiguous.labels_from_starts(starts, n)))
        return
    sampled = contiguous.sampled_k_values(search.k_values, options.sample_budget)
    chains = [("fallback", "sampled") if options.extended else ("never", "sampled")]
    # the re-cut chain scans every adjacent pair and window once per merge (plain Python)
    recut_cost = 2 * len(natural) * max(0, len(natural) - min(sampled))
    if options.extended and recut_cost <= search.budgets["recut"].limit:
        chains.append(("always", "sampled-recut"))
        search.budgets["recut"].charge_round(recut_cost)
    for recut, tag in chains:
        for k, starts in sorted(contiguous.evolve_partitions(space, options.capacity, natural, sampled, recut).items()):
            if not (recut == "always" and k >= len(natural)):  # splits do not depend on the merge rule
                search.base.append((f"{tag}/K={k}", contiguous.labels_from_starts(starts, n)))


def _greedy_stage(search: _Search) -> None:
    if search.options.greedy:
        search.greedy_choice = greedy.greedy_choice(search.space, search.options.capacity, search.options.dp_size)


def _pieces_stage(search: _Search) -> None:
    """The piece greedies over natural-partition intervals and over whole-tree units (beyond the paper)."""
    options, space, natural = search.options, search.space, search.natural
    if not (options.greedy and options.extended):
        return
    capacity, dp_size = options.capacity, options.dp_size
    # each policy evaluates every piece against at least this many open microbatches; a placement that
    # would overrun the budget is not started
    columns = max(1, -(-search.lower_bound // capacity))
    pieces = search.budgets["pieces"]
    if 2 * len(natural) * columns <= pieces.limit:
        search.piece_choices.append(greedy.preselect(greedy.piece_plans(space, capacity, dp_size, natural)))
        pieces.charge_round(2 * len(natural) * columns)
    units = contiguous.unit_partition(space, capacity)
    # units refine the natural partition: equal counts give equal partitions; single-trajectory units repeat
    # the trajectory greedy
    cost = 2 * len(units) * columns
    if len(natural) < len(units) < search.size and pieces.used + cost <= pieces.limit:
        search.piece_choices.append(greedy.preselect(greedy.piece_plans(space, capacity, dp_size, units, "units")))
        pieces.charge_round(cost)


def _refine_stage(search: _Search) -> None:
    """Everything generated so far, and refined copies (boundary refinement, sparse repair) of the greedy
    candidates and, for large inputs, of up to ``refine_anchors`` base anchors."""
    extra = [choice for choice in (search.greedy_choice, *search.piece_choices) if choice is not None]
    search.generated = list(search.base) + [(choice.source, choice.labels) for choice in extra]
    options = search.options
    if not options.refine:
        return
    to_refine: list[tuple[str, np.ndarray]] = []
    if not search.exact and search.base:
        to_refine.extend(_anchors(search.space, search.base, search.greedy_choice, options.refine_anchors))
    to_refine.extend((choice.source, choice.labels) for choice in extra)
    for source, labels in to_refine:
        refined = _refine(search.space, options.capacity, labels, options)
        if not np.array_equal(refined, greedy.canonical_labels(labels)):
            search.generated.append((f"{source}+refined", refined))


def _select_stage(search: _Search) -> None:
    """Instantiate every generated candidate that is new, DP-compatible and within capacity."""
    capacity, dp_size = search.options.capacity, search.options.dp_size
    for source, labels in search.generated:
        if (int(labels.max()) + 1) % dp_size:
            logger.debug("dropping candidate %s: K=%d is not a multiple of D=%d", source, int(labels.max()) + 1, dp_size)
            continue
        candidate = _instantiate(search.space, labels, dp_size, source)
        fingerprint = candidate.labels.tobytes()
        if fingerprint in search.seen:
            continue
        search.seen.add(fingerprint)
        if candidate.works.max() > capacity:
            logger.debug("dropping candidate %s: heaviest microbatch %d exceeds %d", source, candidate.works.max(), capacity)
            continue
        search.candidates.append(candidate)
    if not search.candidates:
        k_values, n = search.k_values, search.size
        ceiling = f" (K = {k_values[-1] + dp_size} would exceed the {n} trajectories)" if k_values[-1] + dp_size > n else ""
        raise PlanningError(
            f"no candidate plan satisfies capacity {capacity} with K a multiple of dp_size {dp_size}: tried K in "
            f"{k_values[0]}..{k_values[-1]}{ceiling} and the greedy search; raise the capacity or lower dp_size"
        )


def _exchange_stage(search: _Search) -> None:
    """Subtree exchange of the best candidates by J (beyond the paper; only adds strictly better ones)."""
    options = search.options
    if not (options.exchange and options.extended):
        return
    for candidate in search.best_first()[: options.exchange_candidates]:
        exchanged = exchange.exchange_subtrees(search.space, options.capacity, candidate.labels, options.exchange_rounds,
                                               options.exchange_window, options.reach, search.budgets["exchange"])
        search.add_if_better(exchanged, f"{candidate.source}+exchanged", candidate)


def _balance_stage(search: _Search) -> None:
    """Within-slot balancing of the best candidates by J (beyond the paper; only adds strictly better ones)."""
    options = search.options
    if not (options.balance and options.dp_size > 1):
        return
    exchanging = options.exchange and options.extended
    for candidate in search.best_first()[: options.balance_candidates]:
        balanced = balance.balance_slots(search.space, options.capacity, candidate.labels, options.dp_size, options.balance_rounds,
                                         options.balance_window, exchange=exchanging, exchange_window=options.exchange_window,
                                         free_rounds=options.balance_exchange_rounds if exchanging else 0,
                                         reach=options.reach, budget=search.budgets["balance"])
        search.add_if_better(balanced, f"{candidate.source}+balanced", candidate)


#: The search, stage by stage, in order: (name, stage, the work budget it draws on or None). The names key
#: ``PlanResult.seconds``; the budgets (``<name>_work`` x N units each, :mod:`harts.planner.budget`) bound
#: the stages beyond the paper (the re-cut chain inside ``base``, the piece and unit greedies, subtree
#: exchange, slot balancing).
STAGES = (
    ("base", _base_stage, "recut"),
    ("greedy", _greedy_stage, None),
    ("pieces", _pieces_stage, "pieces"),
    ("refine", _refine_stage, None),
    ("select", _select_stage, None),
    ("exchange", _exchange_stage, "exchange"),
    ("balance", _balance_stage, "balance"),
)


def choose_microbatches(index: PrefixIndex, options: PlannerOptions) -> PlanResult:
    """Generate, refine, instantiate and select candidates, stage by stage (:data:`STAGES`); see the module docstring."""
    clock = time.perf_counter
    started = clock()
    search = _start(index, options)
    seconds = {"prepare": clock() - started}
    for name, stage, _ in STAGES:
        started = clock()
        stage(search)
        seconds[name] = clock() - started
    best = select_best(search.candidates)
    logger.debug("planned %d trajectories into K=%d microbatches (%s), J=%s, %d candidates",
                 search.size, best.count, best.source, best.objective, len(search.candidates))
    members = [[] for _ in range(best.count)]
    for rank, label in enumerate(best.labels.tolist()):
        members[label].append(int(index.order[rank]))
    return PlanResult(
        microbatches=tuple(tuple(sorted(group)) for group in members),
        works=tuple(int(w) for w in best.works),
        objective=best.objective,
        source=best.source,
        lower_bound=search.lower_bound,
        natural_count=len(search.natural),
        k_range=tuple(search.k_values),
        candidates=tuple((c.source, c.count, c.objective) for c in search.candidates),
        seconds=seconds,
        work={stage: budget.used for stage, budget in search.budgets.items()},
        work_limits={stage: budget.limit for stage, budget in search.budgets.items()},
    )


def _anchors(space: RankSpace, base, greedy_choice, limit: int) -> list[tuple[str, np.ndarray]]:
    """Up to ``limit`` distinct base plans: at the greedy K, lowest work, K closest to the greedy K."""
    summaries = [(source, labels, int(labels.max()) + 1, int(space.group_works(labels, int(labels.max()) + 1).sum()))
                 for source, labels in base]
    chosen: list[int] = []
    greedy_count = greedy_choice.count if greedy_choice is not None else None
    if greedy_count is not None:
        chosen.extend(i for i, s in enumerate(summaries) if s[2] == greedy_count)
        chosen = chosen[:1]
    lowest = min(range(len(summaries)), key=lambda i: (summaries[i][3], i))
    if lowest not in chosen:
        chosen.append(lowest)
    if greedy_count is not None:
        remaining = [i for i in range(len(summaries)) if i not in chosen]
        if remaining:
            chosen.append(min(remaining, key=lambda i: (abs(summaries[i][2] - greedy_count), summaries[i][3], i)))
    return [(summaries[i][0], summaries[i][1]) for i in chosen[:limit]]


def _refine(space: RankSpace, capacity: int, labels: np.ndarray, options: PlannerOptions) -> np.ndarray:
    labels = greedy.canonical_labels(labels)
    starts = contiguous.starts_from_labels(labels)
    if starts is not None:
        starts = contiguous.refine_boundaries(space, capacity, starts, options.window, options.boundary_sweeps)
        labels = contiguous.labels_from_starts(starts, space.size)
    labels = repair.sparse_repair(space, capacity, labels, options.window, options.repair_iterations)
    return greedy.canonical_labels(labels)
