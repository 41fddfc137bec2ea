"""Pictures of a compiled plan (``harts inspect PLAN --plot DIR``), and the numbers behind them.

Three figures, each drawn from a data function that tests can check on its own:

* ``slot_work.png`` (:func:`slot_work`): compact-token work of every DP replica in every
  microbatch slot, with each slot's imbalance (max over replicas / mean), and each replica's
  total over the step, the two levels the planner balances (paper Fig. 1c, Eq. 4);
* ``segment_tree_mb<K>.png`` (:func:`segment_tree`): one microbatch's segment tree, segments
  coloured by the linear-attention round that executes them; direct continuations are solid,
  side branches dashed and labelled with their replay length (paper Fig. 2c, Appendix A);
* ``histograms.png`` (:func:`plan_histograms`): fork depth (token position of every fork of
  every microbatch's segment tree), replay per fork (replay tokens of every side-branch input
  sequence) and compact work per microbatch.

Matplotlib runs with the Agg backend and every PNG is written atomically (:mod:`harts.fsio`).
Tree positions are computed here (leaves left to right, parents centred over their
children, one row per depth): networkx has no tree layout without graphviz.
"""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from harts.errors import PlanArtifactError
from harts.fsio import PLOT_DIRECTORY, PNG, atomic_write_bytes, check_output, png_metadata
from harts.ir.nodes import Phase

logger = logging.getLogger(__name__)

__all__ = ["SegmentTree", "SlotWork", "plan_histograms", "segment_tree", "plot_paths", "slot_work", "write_plots"]

#: Above this many segments a tree is drawn without node labels (they would overlap).
LABELLED_SEGMENTS = 80


@attrs.frozen(eq=False)
class SlotWork:
    """``work[d, j]``: compact work of the microbatch replica ``d`` runs in slot ``j`` (0 if none).

    ``microbatch[d, j]`` is that microbatch's index (-1 if none); ``imbalance[j]`` is
    ``max_d work[d, j] / mean_d work[d, j]`` (1 = perfectly balanced).
    """

    work: np.ndarray
    microbatch: np.ndarray
    imbalance: np.ndarray

    @property
    def replica_totals(self) -> np.ndarray:
        return self.work.sum(axis=1)


@attrs.frozen(eq=False)
class SegmentTree:
    """One microbatch's segment forest as drawn.

    Per segment (index = segment id): ``parent`` (-1 for a root), ``tokens`` (its length),
    ``start``, ``round`` (the round whose call executes it). ``continuation`` lists the
    (parent, child) edges inside one input sequence; ``side_branches`` the (parent, child,
    replay tokens) edges where a new input sequence starts.
    """

    microbatch: int
    parent: np.ndarray
    tokens: np.ndarray
    start: np.ndarray
    round: np.ndarray
    continuation: tuple[tuple[int, int], ...]
    side_branches: tuple[tuple[int, int, int], ...]


def _require(plan: Any, phase: Phase, what: str) -> None:
    if plan.module.phase < phase:
        raise PlanArtifactError(f"the plan is at phase {plan.module.phase}; {what} needs phase {phase}")


def slot_work(plan: Any) -> SlotWork:
    """Work per (replica, slot) of a scheduled plan (see :class:`SlotWork`)."""
    _require(plan, Phase.SCHEDULED, "the replica x slot work")
    microbatches = plan.microbatches
    replicas = max(plan.module.dp_size, 1 + max(mb.replica for mb in microbatches))
    slots = 1 + max(mb.slot for mb in microbatches)
    work = np.zeros((replicas, slots), dtype=np.int64)
    index = np.full((replicas, slots), -1, dtype=np.int64)
    for mb in microbatches:
        work[mb.replica, mb.slot] += mb.work
        index[mb.replica, mb.slot] = mb.index
    mean = work.mean(axis=0)
    imbalance = np.divide(work.max(axis=0), mean, out=np.ones(slots), where=mean > 0)
    return SlotWork(work=work, microbatch=index, imbalance=imbalance)


def segment_tree(plan: Any, microbatch: int) -> SegmentTree:
    """The segment forest of ``microbatch`` with the round of every segment and the replay of every side branch."""
    _require(plan, Phase.ROUNDED, "the segment tree")
    by_index = {mb.index: mb for mb in plan.microbatches}
    if microbatch not in by_index:
        raise PlanArtifactError(f"the plan has no microbatch {microbatch} (it has {sorted(by_index)})")
    mb = by_index[microbatch]
    segments = mb.segments
    parent = np.array([s.parent for s in segments], dtype=np.int64)
    rounds = np.full(len(segments), -1, dtype=np.int64)
    continuation, side = [], []
    for rnd in mb.rounds:
        for sequence in rnd.sequences:
            chain = list(sequence.segments)
            rounds[chain] = rnd.index
            continuation.extend(zip(chain[:-1], chain[1:]))
            first = chain[0]
            if parent[first] >= 0:
                side.append((int(parent[first]), first, sequence.start - sequence.replay_start))
    return SegmentTree(
        microbatch=microbatch,
        parent=parent,
        tokens=np.array([s.end - s.start for s in segments], dtype=np.int64),
        start=np.array([s.start for s in segments], dtype=np.int64),
        round=rounds,
        continuation=tuple((int(a), int(b)) for a, b in continuation),
        side_branches=tuple(side),
    )


def plan_histograms(plan: Any) -> dict[str, np.ndarray]:
    """``fork_depth`` (token position of every fork), ``replay_per_fork`` (replay of every side branch), ``compact_work``."""
    _require(plan, Phase.ROUNDED, "the plan histograms")
    depths, replays = [], []
    for mb in plan.microbatches:
        children = np.bincount([s.parent for s in mb.segments if s.parent >= 0], minlength=len(mb.segments))
        depths.extend(s.end for s in mb.segments if children[s.id] > 1)
        replays.extend(seq.start - seq.replay_start for rnd in mb.rounds for seq in rnd.sequences if seq.start > 0)
    return {
        "fork_depth": np.asarray(depths, dtype=np.int64),
        "replay_per_fork": np.asarray(replays, dtype=np.int64),
        "compact_work": np.asarray([mb.work for mb in plan.microbatches], dtype=np.int64),
    }


# --------------------------------------------------------------------------------- drawing


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: Path) -> Path:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight", metadata=png_metadata(f"plan figure {path.name}"))
    _pyplot().close(figure)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def draw_slot_work(plan: Any, path: Path) -> Path:
    plt = _pyplot()
    data = slot_work(plan)
    replicas, slots = data.work.shape
    figure, (bars, totals) = plt.subplots(1, 2, figsize=(max(7.0, 1.1 * slots + 4.5), 3.8), width_ratios=[max(slots, 2), 2])
    width = 0.8 / replicas
    colours = plt.get_cmap("tab10")
    for d in range(replicas):
        x = np.arange(slots) + (d - (replicas - 1) / 2) * width
        bars.bar(x, data.work[d], width=width, color=colours(d % 10), label=f"replica {d}")
    top = float(data.work.max(initial=1))
    for j in range(slots):
        bars.annotate(f"x{data.imbalance[j]:.3f}", (j, data.work[:, j].max()), xytext=(0, 3), textcoords="offset points",
                      ha="center", fontsize=8)
    bars.set_ylim(0, top * 1.3)
    bars.set_xticks(np.arange(slots), [f"slot {j}" for j in range(slots)], fontsize=8)
    bars.set_ylabel("compact-token work")
    bars.set_title("work per replica and slot (label: max / mean over replicas)", fontsize=9)
    bars.legend(fontsize=7, ncols=min(replicas, 4), loc="upper left")
    bottom = np.zeros(replicas)
    slot_colours = plt.get_cmap("Greys")
    for j in range(slots):
        shade = slot_colours(0.35 + 0.5 * (j % 2))
        totals.bar(np.arange(replicas), data.work[:, j], bottom=bottom, color=shade, edgecolor="white", linewidth=0.5)
        bottom += data.work[:, j]
    totals.set_xticks(np.arange(replicas), [str(d) for d in range(replicas)])
    totals.set_xlabel("replica")
    totals.set_title(f"step total (max {int(bottom.max())})", fontsize=9)
    return _save(figure, path)


def _tree_positions(parent: np.ndarray) -> np.ndarray:
    """(x, y) per segment: leaves at consecutive x in preorder, parents centred over their children."""
    children: list[list[int]] = [[] for _ in parent]
    roots = []
    for node, up in enumerate(parent.tolist()):
        (children[up] if up >= 0 else roots).append(node)
    xy = np.zeros((len(parent), 2))
    next_leaf = 0.0
    for root in roots:
        stack = [(root, 0, False)]
        while stack:
            node, depth, done = stack.pop()
            if done:
                xy[node] = (np.mean([xy[c, 0] for c in children[node]]), -depth)
            elif children[node]:
                stack.append((node, depth, True))
                stack.extend((c, depth + 1, False) for c in reversed(children[node]))
            else:
                xy[node] = (next_leaf, -depth)
                next_leaf += 1.0
        next_leaf += 0.5  # a gap between the trees of one microbatch
    return xy


def draw_segment_tree(plan: Any, microbatch: int, path: Path) -> Path:
    import networkx as nx

    plt = _pyplot()
    tree = segment_tree(plan, microbatch)
    xy = _tree_positions(tree.parent)
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(tree.parent)))
    graph.add_edges_from(tree.continuation)
    graph.add_edges_from((a, b) for a, b, _ in tree.side_branches)
    positions = {node: tuple(xy[node]) for node in graph.nodes}
    leaves = max(1.0, float(xy[:, 0].max(initial=0)) + 1)
    depth = max(1.0, float(-xy[:, 1].min(initial=0)) + 1)
    figure, axes = plt.subplots(figsize=(min(max(6.0, 0.55 * leaves + 2), 40.0), min(max(3.5, 0.9 * depth + 1.5), 30.0)))
    rounds = int(tree.round.max(initial=0)) + 1
    colours = plt.get_cmap("tab10")
    labelled = len(tree.parent) <= LABELLED_SEGMENTS
    size = 700 if labelled else 60
    nx.draw_networkx_edges(graph, positions, edgelist=list(tree.continuation), width=2.6, arrows=False, ax=axes)
    nx.draw_networkx_edges(graph, positions, edgelist=[(a, b) for a, b, _ in tree.side_branches], width=1.2,
                           style="dashed", arrows=False, ax=axes)
    nx.draw_networkx_nodes(graph, positions, node_size=size, ax=axes,
                           node_color=[colours(int(r) % 10) for r in tree.round], edgecolors="black", linewidths=0.6)
    if labelled:
        nx.draw_networkx_labels(graph, positions, labels={n: f"v{n}\n{tree.tokens[n]}" for n in graph.nodes}, font_size=6, ax=axes)
        nx.draw_networkx_edge_labels(graph, positions, edge_labels={(a, b): str(r) for a, b, r in tree.side_branches},
                                     font_size=7, ax=axes, rotate=False)
    handles = [plt.Line2D([], [], marker="o", linestyle="", markersize=8, markerfacecolor=colours(r % 10),
                          markeredgecolor="black", label=f"round {r}") for r in range(rounds)]
    handles += [plt.Line2D([], [], color="black", linewidth=2.6, label="direct continuation"),
                plt.Line2D([], [], color="black", linewidth=1.2, linestyle="dashed", label="side branch (replay tokens)")]
    axes.legend(handles=handles, fontsize=7, loc="upper right")
    replay = sum(r for _, _, r in tree.side_branches)
    axes.set_title(
        f"microbatch {microbatch}: {len(tree.parent)} segments, {rounds} round(s), replay {replay} tokens"
        + ("" if labelled else " (labels omitted)"), fontsize=9,
    )
    axes.set_axis_off()
    return _save(figure, path)


def draw_histograms(plan: Any, path: Path) -> Path:
    plt = _pyplot()
    data = plan_histograms(plan)
    figure, axes = plt.subplots(1, 3, figsize=(11.0, 3.4))
    titles = {
        "fork_depth": ("fork depth (token position)", "forks"),
        "replay_per_fork": (f"replay per side branch (B = {plan.module.chunk_size})", "side branches"),
        "compact_work": ("compact work per microbatch", "microbatches"),
    }
    for ax, (key, (title, ylabel)) in zip(axes, titles.items()):
        values = data[key]
        if values.size:
            low, high = int(values.min()), int(values.max())
            # one bar per integer value when the range is small, else 30 equal bins
            bins = np.arange(low, high + 2) - 0.5 if high - low < 40 else 30
            ax.hist(values, bins=bins, color="#4c72b0", edgecolor="white")
        else:
            ax.text(0.5, 0.5, "none", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{title}\nn = {values.size}", fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
    figure.tight_layout()
    return _save(figure, path)


def default_microbatch(plan: Any) -> int:
    """The microbatch whose tree shows the most: most rounds, then most segments."""
    return max(plan.microbatches, key=lambda mb: (len(mb.rounds), len(mb.segments), -mb.index)).index


def plot_paths(plan: Any, directory: str | os.PathLike[str], microbatch: int | None = None) -> list[Path]:
    """The figures :func:`write_plots` writes into ``directory``, in order."""
    chosen = default_microbatch(plan) if microbatch is None else microbatch
    directory = Path(directory)
    return [directory / "slot_work.png", directory / f"segment_tree_mb{chosen}.png", directory / "histograms.png"]


def write_plots(plan: Any, directory: str | os.PathLike[str], *, microbatch: int | None = None,
                option: str | None = None) -> list[Path]:
    """Write the three figures into ``directory`` (created if needed); returns their paths.

    Each figure must be new or one HARTS drew (:data:`harts.fsio.PNG`): anything else in the
    directory is left alone, and a figure's name held by another file is refused before any is drawn.
    """
    _require(plan, Phase.ROUNDED, "plotting")
    indices = sorted(mb.index for mb in plan.microbatches)
    if microbatch is not None and microbatch not in indices:
        raise PlanArtifactError(f"the plan has no microbatch {microbatch} (it has {indices})")
    check_output(directory, PLOT_DIRECTORY, option=option)
    targets = plot_paths(plan, directory, microbatch)
    for target in targets:
        check_output(target, PNG, option=option)
    Path(directory).mkdir(parents=True, exist_ok=True)
    chosen = default_microbatch(plan) if microbatch is None else microbatch
    paths = [
        draw_slot_work(plan, targets[0]),
        draw_segment_tree(plan, chosen, targets[1]),
        draw_histograms(plan, targets[2]),
    ]
    logger.info("wrote %s", ", ".join(str(p) for p in paths))
    return paths
