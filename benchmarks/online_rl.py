"""Online RL on the CPU: ``harts train --task`` with ``--mode harts`` and ``--mode baseline`` from one seed.

Runs the two modes as two separate ``harts train`` processes, one after the other (each has
the CPU to itself), then compares their per-step records and final weights (the issue's
claim: the same seed gives the same learning in both modes), draws both reward curves on one
figure and prints the figures for ``benchmarks/RESULTS.md``::

    OMP_NUM_THREADS=1 python benchmarks/online_rl.py --steps 100 --out /tmp/online --plot docs/online_rl_count.png

``--dtype float32`` runs the float32 policy (equal up to round-off instead of to float64's);
``--control CAPACITY`` adds a third run, the baseline with microbatches of that capacity,
compared with the first baseline run: how far round-off alone carries two runs of one method.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harts.fsio import atomic_write_bytes  # noqa: E402
from harts.train.compare import compare_modes, compare_runs  # noqa: E402
from harts.train.online import summarize  # noqa: E402
from harts.train.plot import ONLINE_PANELS, plot_metrics  # noqa: E402

MODES = ("harts", "baseline")


def run_mode(mode: str, args: argparse.Namespace, out: Path, *, label: str | None = None,
             extra: tuple[str, ...] = ()) -> tuple[list[dict], dict, float]:
    """One ``harts train --task`` process; its records, final weights and wall time (process start to exit)."""
    from safetensors.torch import load_file

    label = label or mode
    metrics, weights = out / f"{label}.jsonl", out / f"{label}.safetensors"
    metrics.unlink(missing_ok=True)  # this script's own output in its --out folder (harts train appends to a metrics file)
    command = [sys.executable, "-m", "harts", "train", "--task", args.task, "--mode", mode, "--steps", str(args.steps),
               "--seed", str(args.seed), "--metrics", str(metrics), "--save", str(weights), *extra]
    if args.dtype:
        command += ["--dtype", args.dtype]
    print("$", " ".join(command[1:]), flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True)
    seconds = time.perf_counter() - started
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return records, load_file(weights), seconds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="count")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default=None, help="policy dtype (default: the task's, float64)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the two runs' metrics and weights")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of both modes' curves")
    parser.add_argument("--control", type=int, default=None, metavar="CAPACITY",
                        help="also run the baseline with microbatches of this capacity and compare it with the first baseline "
                             "run: how far round-off alone carries two runs of one method")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    records, states, seconds = [], {}, {}
    for mode in MODES:
        mode_records, states[mode], seconds[mode] = run_mode(mode, args, args.out)
        records.extend(mode_records)
    figures = {
        "task": args.task, "steps": args.steps, "seed": args.seed, "dtype": records[0].get("dtype") or args.dtype,
        "process_seconds": seconds,
        "modes": {mode: summarize([r for r in records if r["mode"] == mode]) for mode in MODES},
        "comparison": compare_modes(records, states),
    }
    if args.control is not None:
        label = f"baseline-capacity-{args.control}"
        control, control_state, seconds[label] = run_mode("baseline", args, args.out, label=label,
                                                          extra=("--capacity", str(args.control)))
        baseline = [r for r in records if r["mode"] == "baseline"]
        figures["control"] = {"capacity": args.control, "microbatches_step_1": control[0]["microbatches"],
                              "baseline_microbatches_step_1": baseline[0]["microbatches"],
                              **compare_runs(baseline, control, (states["baseline"], control_state))}
    if args.plot is not None:
        plot_metrics(records, args.plot, panels=ONLINE_PANELS, x="step",
                     title=f"harts train --task {args.task}: --mode harts and --mode baseline, seed {args.seed}")
        figures["plot"] = str(args.plot)
    atomic_write_bytes(args.out / "figures.json", (json.dumps(figures, indent=2) + "\n").encode())
    print(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main()
