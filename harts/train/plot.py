"""Training curves of ``harts train --plot`` / ``harts run``: one panel per metric, one line per mode."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harts.fsio import PNG, atomic_write_with, check_output, png_metadata

__all__ = ["ONLINE_PANELS", "PLOTTED_METRICS", "plot_metrics"]

#: (metric key, panel title) in panel order.
PLOTTED_METRICS = (
    ("loss", "loss"),
    ("kl", "KL to reference"),
    ("entropy", "entropy"),
    ("clip_fraction", "clip fraction"),
    ("grad_norm", "gradient norm (before clipping)"),
    ("fbgrad_seconds", "F/B/Grad seconds"),
)

#: The panels of an online task run (``harts train --task``), against the RL step.
ONLINE_PANELS = (
    ("reward_mean", "mean reward of the step's rollouts"),
    ("loss", "loss"),
    ("entropy", "entropy"),
)

#: Line styles per mode, so that two curves that coincide both stay visible.
_STYLES = {"harts": dict(linestyle="-", linewidth=2.2), "baseline": dict(linestyle="--", linewidth=1.2, marker="o", markersize=2)}


def plot_metrics(records: Sequence[dict[str, Any]], path: str | os.PathLike, *, title: str = "",
                 panels: Sequence[tuple[str, str]] = PLOTTED_METRICS, x: str = "optimizer_step",
                 option: str | None = None) -> Path:
    """Draw ``panels`` (metric key, title) of ``records`` (one dict per optimizer step) against ``x``; write a PNG atomically.

    ``path`` must be new or a figure HARTS drew (:data:`harts.fsio.PNG`); anything else raises
    :class:`~harts.errors.OutputError` (naming ``option``) before anything is drawn.

    With ``x="step"`` (one point per RL step) each step's first-epoch record is drawn.

    Uses matplotlib's object API with the Agg canvas, so no pyplot state or GUI backend is touched.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    check_output(path, PNG, option=option)
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    figure = Figure(figsize=(4 * columns, 3.25 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    modes = sorted({record.get("mode", "harts") for record in records})
    if x == "step":
        records = [r for r in records if r.get("epoch", 1) == 1]
    for ax, (key, label) in zip(axes, panels):
        for mode in modes:
            points = [(r[x], r[key]) for r in records if r.get("mode", "harts") == mode and r.get(key) is not None]
            if points:
                xs, ys = zip(*points)
                style = _STYLES.get(mode, {}) if len(modes) > 1 else dict(marker="o", markersize=3)
                ax.plot(xs, ys, label=mode, **style)
        ax.set_title(label)
        ax.set_xlabel("optimizer step" if x == "optimizer_step" else x.replace("_", " "))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(modes) > 1:
            ax.legend()
    if title:
        figure.suptitle(title)
    metadata = png_metadata("training curves")
    return atomic_write_with(path, lambda temporary: figure.savefig(temporary, format="png", dpi=110, metadata=metadata))
