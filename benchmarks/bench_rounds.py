"""Linear-attention rounds: HARTS minimum-call planning vs node-at-a-time execution.

For SWE-like steps (``harts.rollouts.workloads.swe_like_step``), every microbatch is segmented and
rounded; we compare

* HARTS rounds: packed linear-attention calls per microbatch (Alg. 1), with
* node-at-a-time: one call per segment along each dependency chain, i.e. the depth of the
  segment tree in segments (per microbatch the max over its trees),

and report the mandatory replay R (Eq. 15) as a share of the compact tokens, and the critical path
of the state scans: per microbatch, the sum over rounds of the round's longest sequence in
chunks (``round_critical_path``), for the chosen plan and for the paper's first-fit continuation
rule, against the longest trajectory in chunks (what the trajectory-wise baseline walks).

Microbatches come from the ``partition-microbatches`` + ``schedule-slots`` passes when they
are registered (and ``--contiguous`` is not given); otherwise from a contiguous split of the
lexicographic order, each microbatch filled up to the capacity. The output says which ran.

Usage: ``python benchmarks/bench_rounds.py [--seeds 0 1 2] [--scale 1.0] [--chunk-size 64] [--contiguous]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import attrs
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harts.ir.nodes import Microbatch, Module, Phase  # noqa: E402
from harts.ir.verify_rounds import verify_rounded, verify_segmented  # noqa: E402
from harts.options import DEFAULT_OPTIONS  # noqa: E402
from harts.passes import PASS_REGISTRY, PassContext, lower  # noqa: E402
from harts.passes.manager import run_pipeline  # noqa: E402
from harts.passes.min_call_rounds import MinCallRounds, plan_forest  # noqa: E402
from harts.passes.round_critical_path import round_critical_path  # noqa: E402
from harts.passes.prefix_compress import PrefixCompress  # noqa: E402
from harts.passes.segment import SegmentPass  # noqa: E402
from harts.rollouts.workloads import swe_like_step  # noqa: E402


def contiguous_microbatches(module: Module, capacity: int) -> tuple[Microbatch, ...]:
    """Walk the lexicographic order, opening a new microbatch when the next trajectory would overflow."""
    trie = module.trie
    lengths = [t.length for t in module.trajectories]
    groups: list[list[int]] = []
    works: list[int] = []
    for rank, trajectory in enumerate(trie.order):
        extra = lengths[trajectory] - (trie.lcp[rank] if groups and groups[-1] else 0)
        if groups and works[-1] + extra <= capacity:
            groups[-1].append(trajectory)
            works[-1] += extra
        else:
            groups.append([trajectory])
            works.append(lengths[trajectory])
    return tuple(
        Microbatch(index=j, trajectories=tuple(sorted(group)), work=work, replica=0, slot=j)
        for j, (group, work) in enumerate(zip(groups, works))
    )


def scheduled(batch, capacity: int, chunk_size: int, contiguous: bool) -> tuple[Module, str]:
    module = lower(batch, capacity=capacity, chunk_size=chunk_size)
    ctx = PassContext(batch=batch)
    planner_available = "partition-microbatches" in PASS_REGISTRY and "schedule-slots" in PASS_REGISTRY
    if planner_available and not contiguous:
        passes = [PASS_REGISTRY[name]() for name in ("prefix-compress", "partition-microbatches", "schedule-slots")]
        return run_pipeline(module, passes, ctx, verify_each=False), "partition-microbatches + schedule-slots"
    module = PrefixCompress().run(module, ctx)
    microbatches = contiguous_microbatches(module, capacity)
    why = "asked for" if planner_available else "planner passes not registered"
    return attrs.evolve(module, phase=Phase.SCHEDULED, microbatches=microbatches), f"contiguous lexicographic split ({why})"


def segment_depth(microbatch: Microbatch) -> int:
    """Longest root-to-leaf chain of segments: node-at-a-time needs one call per level."""
    depth = [0] * len(microbatch.segments)
    for segment in microbatch.segments:  # preorder: parents first
        depth[segment.id] = 1 + (depth[segment.parent] if segment.parent >= 0 else 0)
    return max(depth)


def first_fit_critical_path(microbatch: Microbatch, chunk_size: int) -> int:
    """Serial chunk steps of the paper's first-fit continuations on the same segments (for comparison)."""
    segments = microbatch.segments
    plan = plan_forest([s.parent for s in segments], [s.start for s in segments], [s.end for s in segments], chunk_size,
                       shorten_critical_path=False)
    return plan.critical_path


def longest_path_chunks(module: Module, microbatch: Microbatch) -> int:
    return max(-(-module.trajectories[t].length // module.chunk_size) for t in microbatch.trajectories)


def measure(seed: int, scale: float, capacity: int, chunk_size: int, contiguous: bool) -> dict:
    batch = swe_like_step(seed=seed, scale=scale)
    module, microbatching = scheduled(batch, capacity, chunk_size, contiguous)
    ctx = PassContext(batch=batch)
    started = time.perf_counter()
    module = SegmentPass().run(module, ctx)
    segmented_at = time.perf_counter()
    module = MinCallRounds(shorten_critical_path=True).run(module, ctx)
    rounded_at = time.perf_counter()
    verify_segmented(module)
    verify_rounded(module)
    verified_at = time.perf_counter()
    rounds = np.array([len(m.rounds) for m in module.microbatches])
    depths = np.array([segment_depth(m) for m in module.microbatches])
    compact = sum(m.work for m in module.microbatches)
    replay = sum(m.replay_tokens for m in module.microbatches)
    critical = [sum(round_critical_path(m, chunk_size)) for m in module.microbatches]
    return {
        "seed": seed,
        "trajectories": len(batch),
        "semantic": batch.semantic_tokens,
        "microbatches": len(module.microbatches),
        "microbatching": microbatching,
        "segments": sum(len(m.segments) for m in module.microbatches),
        "rounds": rounds,
        "depths": depths,
        "compact": compact,
        "replay": replay,
        "sequences": sum(len(r.sequences) for m in module.microbatches for r in m.rounds),
        "critical": sum(critical),
        "critical_first_fit": sum(first_fit_critical_path(m, chunk_size) for m in module.microbatches),
        "longest": sum(longest_path_chunks(module, m) for m in module.microbatches),
        "critical_max": max(critical),
        "segment_s": segmented_at - started,
        "rounds_s": rounded_at - segmented_at,
        "verify_s": verified_at - rounded_at,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--capacity", type=int, default=DEFAULT_OPTIONS.capacity)
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_OPTIONS.chunk_size)
    parser.add_argument("--contiguous", action="store_true", help="microbatch by a contiguous lexicographic split, not the planner")
    args = parser.parse_args()

    print(f"SWE-like steps, scale {args.scale}, capacity {args.capacity}, chunk size B={args.chunk_size}")
    header = (
        "| seed | paths | microbatches | segments | HARTS rounds max / mean | node-at-a-time calls max / mean "
        "| calls saved | sequences | replay R | R / compact | critical path first-fit / chosen / longest path (chunks) "
        "| segment + rounds (s) | verify (s) |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    all_rounds, all_depths, total_replay, total_compact = [], [], 0, 0
    critical = {"critical_first_fit": 0, "critical": 0, "longest": 0}
    microbatching = ""
    for seed in args.seeds:
        r = measure(seed, args.scale, args.capacity, args.chunk_size, args.contiguous)
        microbatching = r["microbatching"]
        all_rounds.extend(r["rounds"].tolist())
        all_depths.extend(r["depths"].tolist())
        total_replay += r["replay"]
        total_compact += r["compact"]
        for key in critical:
            critical[key] += r[key]
        saved = 1 - r["rounds"].sum() / r["depths"].sum()
        print(
            f"| {seed} | {r['trajectories']} | {r['microbatches']} | {r['segments']} "
            f"| {r['rounds'].max()} / {r['rounds'].mean():.2f} | {r['depths'].max()} / {r['depths'].mean():.1f} "
            f"| {100 * saved:.1f}% | {r['sequences']} | {r['replay']:,} | {100 * r['replay'] / r['compact']:.3f}% "
            f"| {r['critical_first_fit']:,} / {r['critical']:,} / {r['longest']:,} "
            f"| {r['segment_s'] + r['rounds_s']:.2f} | {r['verify_s']:.2f} |"
        )
    histogram = {k: all_rounds.count(k) for k in sorted(set(all_rounds))}
    print()
    print(f"microbatching: {microbatching}")
    print(f"HARTS rounds per microbatch, histogram over all steps: {histogram}")
    print(
        f"mean calls per microbatch: HARTS {statistics.mean(all_rounds):.2f} vs node-at-a-time "
        f"{statistics.mean(all_depths):.1f} ({statistics.mean(all_depths) / statistics.mean(all_rounds):.1f}x fewer sequential calls)"
    )
    print(f"replay share of compact tokens over all steps: {100 * total_replay / total_compact:.3f}%")
    print(
        f"critical path of the state scans (chunk steps summed over microbatches): first-fit {critical['critical_first_fit']:,}, "
        f"chosen {critical['critical']:,} ({100 * (1 - critical['critical'] / critical['critical_first_fit']):.1f}% shorter), "
        f"longest trajectory per microbatch {critical['longest']:,}"
    )


if __name__ == "__main__":
    main()
