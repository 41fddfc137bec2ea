"""Where a pass spends its time, by operator family, and how HARTS compares with baseline / compression.

A HARTS pass that ran at the compression ratio would take ``baseline / compression``; what it
spends beyond that, family by family, is where its speedup falls short. Families are told apart
by kernel name (CUDA) or operator name (CPU), so backward kernels, which autograd launches
outside any forward range, are counted with their operator.
"""

from __future__ import annotations

import numpy as np
import torch

#: (family, name fragments), first match wins; lower-case fragments of kernel / aten op names
FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "gloo", "c10d::")),
    ("linear attention", ("chunk_kda", "chunk_gla", "chunk_gated_delta", "recompute_w_u", "chunk_local_cumsum",
                          "_scan_forward_kernel", "_scan_backward_kernel", "solve_tril", "kda_", "gdn_")),
    ("causal conv", ("causal_conv1d",)),
    ("full attention", ("flash", "fmha", "attention")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
                "aten::matmul", "aten::linear", "aten::einsum", "grouped_mm", "aten::_grouped_mm")),
    ("gather / scatter", ("index", "gather", "scatter", "embedding", "take", "masked_select")),
    ("reductions and norms", ("reduce", "norm", "softmax", "logsumexp", "sum", "mean", "cumsum")),
    ("copies and casts", ("copy", "cast", "cat", "memcpy", "memset", "fill", "contiguous", "clone", "to_copy")),
    ("elementwise", ("elementwise", "vectorized", "mul", "add", "sub", "div", "exp", "log", "sigmoid", "silu",
                     "where", "pow", "neg", "rsqrt", "sqrt", "clamp", "tanh")),
)
OTHER = "other"


def family_of(name: str) -> str:
    """The operator family of a kernel or operator name (:data:`FAMILIES`), else ``"other"``."""
    lowered = name.lower()
    for family, fragments in FAMILIES:
        if any(fragment in lowered for fragment in fragments):
            return family
    return OTHER


def _self_seconds(profiler, device_type: str):
    """(name, self seconds, calls) of every operator or kernel of one profiled region: device kernels
    on CUDA, aten operators elsewhere. Self times add up to the region's total without double
    counting nested operators."""
    for event in profiler.key_averages():
        if device_type == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue  # a CPU operator: the kernels it launched are listed as device events of their own
            seconds = event.self_device_time_total * 1e-6
        else:
            seconds = event.self_cpu_time_total * 1e-6
            if not event.key.startswith("aten::"):
                continue  # python ranges and autograd wrappers: their aten children carry the time
        if seconds > 0:
            yield event.key, seconds, event.count


def seconds_by_family(profiler, device_type: str) -> dict[str, float]:
    """Self time per family (:data:`FAMILIES`) of one profiled region."""
    totals = {family: 0.0 for family, _ in FAMILIES}
    totals[OTHER] = 0.0
    for name, seconds, _ in _self_seconds(profiler, device_type):
        totals[family_of(name)] += seconds
    return totals


def seconds_by_kernel(profiler, device_type: str) -> list[dict]:
    """Every kernel (CUDA) or aten operator of one profiled region with its self seconds, call count
    and family, longest first: the table to compare two passes kernel by kernel."""
    rows = [{"name": name, "seconds": seconds, "calls": calls, "family": family_of(name)}
            for name, seconds, calls in _self_seconds(profiler, device_type)]
    return sorted(rows, key=lambda row: -row["seconds"])


def causal_attention_pairs(lengths) -> float:
    """Query-key pairs of causal attention over whole trajectories: sum of L (L + 1) / 2."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return float(np.sum(lengths * (lengths + 1) / 2))


def plan_attention_pairs(layouts) -> float:
    """Query-key pairs HARTS' attention computes: each compact sequence's rows against its ancestors'
    rows and, causally, its own."""
    pairs = 0.0
    for layout in layouts:
        for sequence in range(layout.num_sequences):
            own = float(layout.sequence_rows(sequence).size)
            pairs += own * layout.ancestor_rows_of(sequence).size + own * (own + 1) / 2
    return pairs


def excess_over_compression(baseline: dict[str, float], harts: dict[str, float], compression: float,
                            family_compression: dict[str, float] | None = None) -> dict[str, dict]:
    """Per family: the baseline's seconds, that divided by the family's compression (what HARTS would
    take if it did the baseline's work per unit at the plan's sharing), HARTS' seconds and its excess
    over that; plus a ``total`` row. ``family_compression`` overrides the token ``compression`` for
    families whose work does not scale with rows (full attention: query-key pairs, since a branch's
    queries still attend to its whole shared prefix)."""
    family_compression = family_compression or {}
    rows = {}
    for family in baseline:
        ideal = baseline[family] / family_compression.get(family, compression)
        rows[family] = {"baseline": baseline[family], "ideal": ideal, "harts": harts.get(family, 0.0),
                        "excess": harts.get(family, 0.0) - ideal}
    totals = {key: sum(row[key] for row in rows.values()) for key in ("baseline", "ideal", "harts", "excess")}
    rows["total"] = totals
    return rows


def refined_limit(rows: dict[str, dict]) -> float:
    """The speedup HARTS would reach if every family ran at its own compression (the ``total`` row of
    :func:`excess_over_compression`: baseline seconds over ideal seconds). Rows shrink row-wise work
    and query-key pairs shrink full attention by different factors, so this limit sits below the
    token compression whenever attention shares less than rows do."""
    total = rows["total"]
    return total["baseline"] / total["ideal"] if total["ideal"] > 0 else float("nan")


def format_excess(rows: dict[str, dict]) -> str:
    lines = [f"{'family':<22} {'baseline s':>11} {'/ compression':>14} {'harts s':>9} {'excess s':>9}"]
    for family, row in rows.items():
        lines.append(f"{family:<22} {row['baseline']:>11.3f} {row['ideal']:>14.3f} {row['harts']:>9.3f} {row['excess']:>+9.3f}")
    return "\n".join(lines)


def idle_gaps(intervals, edges_us=(10.0, 100.0, 1000.0)) -> dict:
    """Where a device sat idle between its kernels: ``intervals`` are (start, end) in microseconds.

    Overlapping kernels (several streams) are merged first. Returns the busy and idle
    microseconds between the first start and the last end, and the idle time and count of gaps
    by size (``edges_us`` bound the buckets): many short gaps mean the host could not launch
    kernels as fast as the device ran them, a few long ones a host wait (a sync) or host work.
    """
    spans = sorted((float(a), float(b)) for a, b in intervals if b > a)
    labels = [f"< {edges_us[0]:g} us"] + [f"{lo:g}-{hi:g} us" for lo, hi in zip(edges_us, edges_us[1:])]
    labels.append(f">= {edges_us[-1]:g} us")
    buckets = {label: {"idle_us": 0.0, "gaps": 0} for label in labels}
    if not spans:
        return {"busy_us": 0.0, "idle_us": 0.0, "by_gap": buckets}
    busy, idle = 0.0, 0.0
    start, end = spans[0]
    for a, b in spans[1:]:
        if a <= end:
            end = max(end, b)
            continue
        busy += end - start
        gap = a - end
        idle += gap
        label = labels[int(np.searchsorted(np.asarray(edges_us), gap, side="right"))]
        buckets[label]["idle_us"] += gap
        buckets[label]["gaps"] += 1
        start, end = a, b
    busy += end - start
    return {"busy_us": busy, "idle_us": idle, "by_gap": buckets}


def gaps_before_kernels(kernels, min_gap_us: float = 10.0, top: int = 15) -> list[dict]:
    """Which launches the device waited for: ``kernels`` are (start, end, name) in microseconds.

    Every idle gap of at least ``min_gap_us`` is charged to the pair (kernel before it, kernel
    after it); the pairs with the most idle time come first. A gap before the same kernel on
    every layer points at the host work (or sync) that precedes that launch."""
    spans = sorted((float(a), float(b), name) for a, b, name in kernels if b > a)
    charged: dict[tuple[str, str], list[float]] = {}
    end, before = None, None
    for a, b, name in spans:
        if end is not None and a - end >= min_gap_us:
            charged.setdefault((before, name), []).append(a - end)
        if end is None or b >= end:
            end, before = b, name
    rows = [{"before": pair[0], "after": pair[1], "idle_us": sum(gaps), "gaps": len(gaps), "largest_us": max(gaps)}
            for pair, gaps in charged.items()]
    return sorted(rows, key=lambda row: -row["idle_us"])[:top]


def kernel_events(profiler) -> list[tuple[float, float, str]]:
    """(start, end, name) microseconds of every device kernel and memory operation of a profiled region."""
    return [(event.time_range.start, event.time_range.end, event.name) for event in profiler.events()
            if event.device_type == torch.autograd.DeviceType.CUDA]


def kernel_intervals(profiler) -> list[tuple[float, float]]:
    """(start, end) microseconds of every device kernel and memory operation of a profiled region."""
    return [(event.time_range.start, event.time_range.end) for event in profiler.events()
            if event.device_type == torch.autograd.DeviceType.CUDA]


class SyncSites:
    """Count the host-device synchronisations of a region, by the source line that caused them.

    Inside the block ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronising CUDA
    call warn; the warnings are recorded, not shown, keyed by the innermost frame of our own code
    (``harts``, ``kernels``, ``harts_bench``) or fla's, else the innermost caller. A synchronisation inside a backward is
    re-raised by autograd at the ``backward()`` call, so those sites read as that call.
    """

    OWN_CODE = ("/harts/", "/kernels/", "/harts_bench/", "/fla/")

    def __init__(self) -> None:
        self.sites: dict[str, int] = {}

    def __enter__(self) -> "SyncSites":
        import traceback
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        self._previous_mode = torch.cuda.get_sync_debug_mode()

        self._recording = False
        this_file = __file__

        def record(message, category, filename, lineno, file=None, line=None):
            if not self._recording or "synchroniz" not in str(message):
                return  # switching the mode itself warns; that is not the region's sync
            frames = [f for f in traceback.extract_stack()[:-1]
                      if f.filename != this_file and not f.filename.endswith("warnings.py")]
            own = [f for f in frames if any(part in f.filename for part in self.OWN_CODE)]
            frame = (own or frames)[-1] if frames else None
            where = f"{frame.filename.split('/')[-1]}:{frame.lineno} {frame.line}" if frame else f"{filename}:{lineno}"
            self.sites[where] = self.sites.get(where, 0) + 1

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        self._recording = True
        return self

    def __exit__(self, *exc) -> None:
        self._recording = False
        torch.cuda.set_sync_debug_mode(self._previous_mode)
        self._catch.__exit__(*exc)

    def table(self) -> list[dict]:
        """The sites, most frequent first."""
        return [{"site": site, "count": count} for site, count in sorted(self.sites.items(), key=lambda kv: -kv[1])]
