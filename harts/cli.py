"""The ``harts`` command line: compile, inspect (and plot), convert framework batches, train, run the main job.

The runtime benchmark is its own console script, ``harts-bench`` (:mod:`harts_bench.runtime`), outside the library.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

import harts
from harts.errors import HartsError
from harts.options import DEFAULT_OPTIONS

app = typer.Typer(add_completion=False, no_args_is_help=True, help="HARTS: prefix-sharing plans for hybrid-attention RL training.")
console = Console(stderr=True)
logger = logging.getLogger("harts")


#: exit status of a run that failed on its input or options (the message names the culprit)
USER_ERROR_EXIT = 2
#: exit status of a failure inside HARTS itself (a bug); --verbose shows the traceback
INTERNAL_ERROR_EXIT = 3
_verbose = False


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO level (pass timings, sizes); show tracebacks.")) -> None:
    global _verbose
    _verbose = verbose
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )


#: Terminal escape sequences (colours, cursor moves): torch and transformers colour some messages.
_ANSI_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")


def _one_line(text: str) -> str:
    return " ".join(_ANSI_ESCAPE.sub("", str(text)).split())


def _fail(error: Exception | str) -> None:
    """Print ``error: <message>`` as one line on stderr and exit with :data:`USER_ERROR_EXIT`."""
    console.print(f"[bold red]error:[/bold red] {escape(_one_line(error))}", soft_wrap=True)
    raise typer.Exit(code=USER_ERROR_EXIT)


def reports_errors(command):
    """Run a command so that every failure ends in one line on stderr and a non-zero exit, never a traceback:
    HartsError (bad input or options) and OS errors (unwritable output, disk full) exit 2; anything else
    is a bug in HARTS and exits 3 (``--verbose`` logs its traceback)."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except (HartsError, OSError) as error:
            _fail(error)
        except MemoryError:
            _fail("out of memory: the input is too large for this machine (try a smaller batch or capacity)")
        except Exception as error:  # noqa: BLE001 - last resort: report, do not dump a traceback on the user
            if _verbose:
                logger.exception("internal error")
            console.print(
                f"[bold red]internal error:[/bold red] {escape(_one_line(f'{type(error).__name__}: {error}'))} "
                "(a bug in HARTS; rerun with --verbose for the traceback)",
                soft_wrap=True,
            )
            raise typer.Exit(code=INTERNAL_ERROR_EXIT) from None

    return run


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.3e}" if value != 0 and abs(value) < 1e-3 else f"{value:.6g}"
    return "-" if value is None else str(value)


def print_stats(stats: dict, title: str = "plan") -> None:
    table = Table(title=title, show_header=False)
    for key, value in stats.items():
        table.add_row(key, _format(value))
    Console().print(table)


@app.command("compile")
@reports_errors
def compile_command(
    input: str = typer.Argument(..., help="Node table (.jsonl/.parquet) or preset: demo, swe-like, swe-like:seed=3,scale=0.1,profile=calibrated"),
    output: Path = typer.Option(..., "--output", "-o", help="Plan artifact to write (a directory, or a .safetensors file)."),
    pipeline: Optional[str] = typer.Option(None, "--pipeline", help="Pass pipeline text; default: the full pipeline."),
    capacity: int = typer.Option(DEFAULT_OPTIONS.capacity, "--capacity", help="Microbatch capacity T in compact tokens."),
    dp: int = typer.Option(DEFAULT_OPTIONS.dp_size, "--dp", help="Data-parallel degree D."),
    chunk_size: int = typer.Option(DEFAULT_OPTIONS.chunk_size, "--chunk-size", help="Linear-attention chunk size B."),
    fast_kernels: bool = typer.Option(False, "--fast-kernels", help="Plan for the fast linear-attention kernels: refuse a chunk size they cannot take."),
    print_ir_after_all: bool = typer.Option(False, "--print-ir-after-all", help="Print the IR after every pass (stderr)."),
    print_ir_after: Optional[str] = typer.Option(None, "--print-ir-after", help="Comma-separated passes to print the IR after."),
    dump_ir: Optional[Path] = typer.Option(None, "--dump-ir", help="Write every stage, lowering and lay-out included, to DIR/NNN_<pass>.txt."),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip IR verification after each pass."),
    time_passes: bool = typer.Option(False, "--time-passes", help="Print the time of every pass."),
) -> None:
    """Compile a rollout batch into a plan artifact."""
    from harts.fsio import IR_DUMP, check_outputs
    from harts.passes.manager import DumpIR, PrintIRAfter, TimePasses
    from harts.plan import plan_output_kind
    from harts.rollouts.inputs import input_path, resolve_input

    check_outputs([("--output", output, plan_output_kind(output)), ("--dump-ir", dump_ir, IR_DUMP)], [input_path(input)])
    instruments = []
    if print_ir_after_all:
        instruments.append(PrintIRAfter(None))
    elif print_ir_after:
        instruments.append(PrintIRAfter([p.strip() for p in print_ir_after.split(",") if p.strip()]))
    if dump_ir is not None:
        instruments.append(DumpIR(dump_ir, option="--dump-ir"))
    timer = TimePasses() if time_passes else None
    if timer is not None:
        instruments.append(timer)
    with console.status(f"reading {input}"):
        batch = resolve_input(input)
    plan = harts.compile(
        batch, capacity=capacity, dp_size=dp, chunk_size=chunk_size, pipeline=pipeline,
        verify=False if no_verify else None, instruments=instruments, progress=True, fast_kernels=fast_kernels,
    )
    plan.save(output)
    print_stats(plan.stats, title=f"plan written to {output}")
    if timer is not None:
        console.print(timer.report())


@app.command("inspect")
@reports_errors
def inspect_command(
    plan_path: Path = typer.Argument(..., help="Plan artifact written by `harts compile`."),
    as_json: bool = typer.Option(False, "--json", help="Print the full inspect document as JSON."),
    ir: bool = typer.Option(False, "--ir", help="Print the plan's IR text."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write PNG figures of the plan into DIR (replica x slot work, a segment tree, histograms)."),
    microbatch: Optional[int] = typer.Option(None, "--microbatch", help="Microbatch whose segment tree --plot draws (default: the one with the most rounds)."),
) -> None:
    """Show a plan: statistics, microbatches and rounds."""
    from harts.fsio import PLOT_DIRECTORY, check_outputs

    if microbatch is not None and plot is None:
        _fail(f"--microbatch {microbatch} picks the segment tree that --plot draws; give --plot DIR too")
    check_outputs([("--plot", plot, PLOT_DIRECTORY)], [plan_path])
    plan = harts.load_plan(plan_path)
    if plot is not None:
        from harts.viz import write_plots

        with console.status(f"plotting into {plot}"):
            paths = write_plots(plan, plot, microbatch=microbatch, option="--plot")
        for path in paths:
            console.print(f"wrote {path}")
        return
    if as_json:
        sys.stdout.write(json.dumps(plan.to_json(), indent=2, sort_keys=True) + "\n")
        return
    if ir:
        sys.stdout.write(plan.ir_text())
        return
    print_stats(plan.stats, title=str(plan_path))
    table = Table(title="microbatches")
    for column in ("mb", "replica", "slot", "trajectories", "compact work", "rounds", "replay"):
        table.add_column(column, justify="right")
    for mb in plan.microbatches:
        table.add_row(
            str(mb.index), _format(mb.replica), _format(mb.slot), str(len(mb.trajectories)), str(mb.work),
            _format(None if mb.rounds is None else len(mb.rounds)), _format(mb.replay_tokens),
        )
    Console().print(table)


@app.command("convert")
@reports_errors
def convert_command(
    input: Path = typer.Argument(..., help="Saved framework batch: .pt (dict of tensors), .parquet or .jsonl (one row per trajectory)."),
    framework: str = typer.Option(..., "--from", help="The framework that wrote it: verl, trl or areal."),
    output: Path = typer.Option(..., "--output", "-o", help="Node table to write (.jsonl or .parquet)."),
    ignore: Optional[list[str]] = typer.Option(None, "--ignore", help="Batch key to leave out (repeatable)."),
    rolled: Optional[bool] = typer.Option(
        None, "--rolled/--not-rolled",
        help="areal only (required there): whether PPOActor.compute_advantages has rolled loss_mask / logprobs by -1.",
    ),
) -> None:
    """Convert an RL framework's saved batch into a HARTS node table (trees recovered by token prefixes)."""
    from harts.fsio import check_outputs
    from harts.interop import read_framework_batch
    from harts.rollouts import NODE_TABLE

    options = {"ignore": tuple(ignore or ())}
    if framework == "areal":
        if rolled is None:
            raise HartsError("--from areal needs --rolled or --not-rolled: whether the batch went through "
                             "PPOActor.compute_advantages (loss_mask and logprobs rolled by -1) cannot be told from it")
        options["rolled"] = rolled
    elif rolled is not None:
        raise HartsError(f"--rolled / --not-rolled apply to --from areal only, not --from {framework}")
    check_outputs([("--output", output, NODE_TABLE)], [input])
    with console.status(f"reading {input}"):
        batch = read_framework_batch(input, framework, **options)
    try:
        batch.write(output)
    except (OSError, ValueError) as error:
        _fail(HartsError(f"{output}: {error}"))
    fields = ", ".join(sorted(batch.token_fields)) or "-"
    print_stats(
        {"trajectories": len(batch), "trees": len(set(batch.tree_ids.tolist())), "semantic_tokens": batch.semantic_tokens,
         "per-token fields": fields, "per-trajectory fields": ", ".join(sorted(batch.trajectory_fields)) or "-"},
        title=f"{framework} batch written to {output}",
    )


@app.command("passes")
def passes_command() -> None:
    """List the registered passes and the default pipeline."""
    from harts.passes import PASS_REGISTRY

    table = Table(title="passes")
    for column in ("name", "requires", "produces", "verifier", "purpose"):
        table.add_column(column)
    for row in sorted(PASS_REGISTRY.rows(), key=lambda row: row.produces):  # the registry's rows, as they are
        requires = "batch" if row.requires is None else str(row.requires)
        table.add_row(row.name, requires, str(row.produces), (row.verifier or "-").rpartition(":")[2], row.purpose)
    Console().print(table)
    Console().print("default pipeline: " + ",".join(harts.DEFAULT_PIPELINE))


def _records_table(records: list[dict], title: str) -> Table:
    columns = ("step", "epoch", "loss", "kl", "clip_fraction", "entropy", "grad_norm", "fbgrad_seconds", "rows_per_second")
    table = Table(title=title)
    for column in columns:
        table.add_column(column.replace("_seconds", " s").replace("_per_second", "/s").replace("_", " "), justify="right")
    for record in records:
        table.add_row(*(_format(record.get(column)) for column in columns))
    return table


def _print_online(run) -> None:
    """Per-mode summary of an online task run, and the step-by-step differences when both modes ran."""
    table = Table(title=f"harts train --task {run.task}", caption=run.model_description)
    keys = [key for key in next(iter(run.summary.values()))]
    table.add_column("figure")
    for mode in run.modes:
        table.add_column(mode, justify="right")
    for key in keys:
        table.add_row(key.replace("_", " "), *(_format(run.summary[mode][key]) for mode in run.modes))
    Console(width=max(Console().width, 100)).print(table)
    if run.comparison is not None:
        print_stats(run.comparison, title="HARTS vs trajectory-wise baseline, step by step from one seed")


@app.command("train")
@reports_errors
def train_command(
    input: Optional[str] = typer.Argument(None, help="Node table (.jsonl/.parquet) or preset, as for `harts compile` (or 'input' in --config)."),
    preset: Optional[str] = typer.Option(None, "--preset", help="Model preset (default tiny); see harts.runtime.PRESETS."),
    hf: Optional[str] = typer.Option(None, "--hf", help="Local Hugging Face checkpoint (Qwen3-Next, Kimi Linear) instead of a preset."),
    steps: Optional[int] = typer.Option(None, "--steps", help="RL steps (default 3; with --task the task's, count: 100)."),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="Optimizer steps per RL step, each over every microbatch (default 2)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="AdamW learning rate (default 1e-4)."),
    mode: Optional[str] = typer.Option(None, "--mode", help="harts (the compiled plan) or baseline (the same microbatches, every path expanded); with --task also both."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32, float64 or bfloat16 (default: the model's)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the initial weights (default 0; with --task also of the prompts and the sampling); the same seed gives the same start in both modes."),
    metrics: Optional[Path] = typer.Option(None, "--metrics", help="Append one JSON object per optimizer step to this .jsonl file."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Draw the training curves to this PNG."),
    config: Optional[Path] = typer.Option(None, "--config", help="YAML file of these options (and TrainConfig fields); flags override it."),
    algorithm: Optional[str] = typer.Option(None, "--algorithm", help="grpo (default) or ppo."),
    kl_coef: Optional[float] = typer.Option(None, "--kl-coef", help="KL penalty to the initial weights (default 1e-3; 0: no reference model)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Sampling temperature the log-probs are computed at (default 1)."),
    capacity: Optional[int] = typer.Option(None, "--capacity", help="Microbatch capacity T in compact tokens (default 65536)."),
    chunk_size: Optional[int] = typer.Option(None, "--chunk-size", help="Linear-attention chunk size B of the plan (default 64)."),
    dp: Optional[int] = typer.Option(None, "--dp", help="Data-parallel degree D of the plan (default: the torchrun world size)."),
    parallel: Optional[str] = typer.Option(None, "--parallel", help="Data-parallel wrapper under torchrun: ddp (default) or fsdp (FSDP2)."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel size T on megatron-core (torchrun world = T x D; default 1: no megatron-core)."),
    ep: Optional[int] = typer.Option(None, "--ep", help="Expert-parallel size E on megatron-core: each rank holds 1/E of every MoE layer's experts (E divides the torchrun world)."),
    moe_dispatcher: Optional[str] = typer.Option(None, "--moe-dispatcher", help="megatron-core MoE token dispatcher with --tp / --ep: allgather (default) or alltoall."),
    dp_engine: Optional[str] = typer.Option(None, "--dp-engine", help="Data parallelism on megatron-core's layout: megatron (its DDP + distributed optimizer; CUDA only) or torch (torch DDP + AdamW). Default: megatron with --tp/--ep on CUDA, torch otherwise."),
    recompute: Optional[bool] = typer.Option(None, "--recompute/--no-recompute", help="Full-layer activation recomputation (default off)."),
    save: Optional[Path] = typer.Option(None, "--save", help="Write the trained weights to this .safetensors file."),
    task: Optional[str] = typer.Option(None, "--task", help="Online RL on a task instead of a fixed batch: the policy samples rollout trees each step (tasks: count; see harts.tasks)."),
    matmul_precision: Optional[str] = typer.Option(None, "--matmul-precision", help="torch.set_float32_matmul_precision: highest, high or medium (default: high on CUDA, as harts-bench; highest on CPU)."),
) -> None:
    """Train a model on a rollout batch for some RL steps (run under torchrun for data parallelism), or online on --task."""
    from harts.train.loop import check_run_outputs, load_options, run_training

    flags = dict(
        input=input, task=task, preset=preset, hf=hf, steps=steps, epochs=epochs, lr=lr, mode=mode, dtype=dtype, seed=seed,
        metrics=None if metrics is None else str(metrics), plot=None if plot is None else str(plot), algorithm=algorithm,
        kl_coef=kl_coef, temperature=temperature, capacity=capacity, chunk_size=chunk_size, dp=dp, parallel=parallel,
        tp=tp, ep=ep, moe_dispatcher=moe_dispatcher, dp_engine=dp_engine, recompute=recompute, save=None if save is None else str(save), matmul_precision=matmul_precision,
    )
    options = load_options(flags, config)
    check_run_outputs(options, config=config)
    if options.task is not None:
        from harts.train.online import run_online

        _print_online(run_online(options, console=console))
        return
    run = run_training(options, console=console)
    if run.rank != 0:
        return
    stats = run.plan_stats
    Console(width=max(Console().width, 100)).print(_records_table(list(run.records), f"harts train {options.input}: {run.model_description}, "
                                   f"mode {options.train.mode}, {run.world_size} rank(s), plan compression {stats['compression']:.3g}"))


@app.command("run")
@reports_errors
def run_command(
    input: str = typer.Argument("demo", help="Rollout batch: node table or preset (default: the bundled demo batch)."),
    preset: str = typer.Option("tiny", "--preset", help="Model preset."),
    chunk_size: int = typer.Option(16, "--chunk-size", help="Linear-attention chunk size B."),
    capacity: int = typer.Option(4096, "--capacity", help="Microbatch capacity T in compact tokens."),
    steps: int = typer.Option(3, "--steps", help="RL steps in each mode."),
    epochs: int = typer.Option(2, "--epochs", help="Optimizer steps per RL step."),
    recompute: bool = typer.Option(True, "--recompute/--no-recompute", help="Full-layer activation recomputation."),
    seed: int = typer.Option(0, "--seed", help="Seed of the initial weights (shared by both modes)."),
    threads: int = typer.Option(1, "--threads", help="torch intra-op threads (the demo model's tensors are too small to gain from more; 0: torch's default)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Draw both modes' training curves to this PNG."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
) -> None:
    """The main job: compile a batch, train a few GRPO steps with HARTS and the baseline from the same weights, compare."""
    from harts.fsio import PNG, check_outputs
    from harts.rollouts.inputs import input_path
    from harts.train.demo import run_demo
    from harts.train.loop import step_progress

    check_outputs([("--plot", plot, PNG)], [input_path(input)])
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
    with step_progress(True, console) as update:
        figures = run_demo(input, preset=preset, chunk_size=chunk_size, capacity=capacity, steps=steps, epochs=epochs,
                           recompute=recompute, seed=seed, plot=plot, on_progress=update)
    broken = [name for name, value in figures.items() if isinstance(value, float) and not math.isfinite(value)]
    if broken:
        _fail(f"the step produced non-finite figures ({', '.join(f'{name} = {figures[name]}' for name in broken)}); "
              "check the batch's advantages, rewards and masks")
    if as_json:
        sys.stdout.write(json.dumps(figures, indent=2, allow_nan=False) + "\n")
        return
    table = Table(title="per optimizer step, from the same weights (F/B/Grad in seconds)")
    for column in ("step", "epoch", "loss baseline", "loss HARTS", "rel diff", "F/B/G base", "F/B/G HARTS", "speedup"):
        table.add_column(column, justify="right")
    for row in figures["per_step"]:
        table.add_row(str(row["step"]), str(row["epoch"]), f"{row['loss_baseline']:.7g}", f"{row['loss_harts']:.7g}",
                      f"{row['loss_rel_diff']:.1e}", f"{row['fbgrad_baseline']:.2f}", f"{row['fbgrad_harts']:.2f}",
                      f"{row['fbgrad_baseline'] / row['fbgrad_harts']:.2f}x")
    Console(width=max(Console().width, 100)).print(table)
    print_stats({k: v for k, v in figures.items() if k != "per_step"}, title="HARTS vs trajectory-wise baseline")


if __name__ == "__main__":  # pragma: no cover
    app()
