"""Training curves of ``harts train --plot`` / ``harts run``: one panel per metric, one line per mode."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harts.fsio import atomic_write_with

__all__ = ["PLOTTED_METRICS", "plot_metrics"]

#: (metric key, panel title) in panel order.
PLOTTED_METRICS = (
    ("loss", "loss"),
    ("kl", "KL to reference"),
    ("entropy", "entropy"),
    ("clip_fraction", "clip fraction"),
    ("grad_norm", "gradient norm (before clipping)"),
    ("fbgrad_seconds", "F/B/Grad seconds"),
)


def plot_metrics(records: Sequence[dict[str, Any]], path: str | os.PathLike, *, title: str = "") -> Path:
    """Draw the metrics of ``records`` (one dict per optimizer step) against the optimizer step; write a PNG atomically.

    Uses matplotlib's object API with the Agg canvas, so no pyplot state or GUI backend is touched.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(12, 6.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 3).ravel()
    modes = sorted({record.get("mode", "harts") for record in records})
    for ax, (key, label) in zip(axes, PLOTTED_METRICS):
        for mode in modes:
            points = [(r["optimizer_step"], r[key]) for r in records if r.get("mode", "harts") == mode and r.get(key) is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", markersize=3, label=mode)
        ax.set_title(label)
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(modes) > 1:
            ax.legend()
    if title:
        figure.suptitle(title)
    return atomic_write_with(path, lambda temporary: figure.savefig(temporary, format="png", dpi=110))
