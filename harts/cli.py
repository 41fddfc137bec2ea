"""The ``harts`` command line: compile, inspect, run the demo step, benchmark."""

from __future__ import annotations

import functools
import json
import logging
import math
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


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _fail(error: Exception | str) -> None:
    """Print ``error: <message>`` as one line on stderr and exit with :data:`USER_ERROR_EXIT`."""
    console.print(f"[bold red]error:[/bold red] {escape(_one_line(error))}", soft_wrap=True)
    raise typer.Exit(code=USER_ERROR_EXIT)


def _reports_errors(command):
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
@_reports_errors
def compile_command(
    input: str = typer.Argument(..., help="Node table (.jsonl/.parquet) or preset: demo, swe-like, swe-like:seed=3,scale=0.1,profile=calibrated"),
    output: Path = typer.Option(..., "--output", "-o", help="Plan artifact to write (a directory, or a .safetensors file)."),
    pipeline: Optional[str] = typer.Option(None, "--pipeline", help="Pass pipeline text; default: the full pipeline."),
    capacity: int = typer.Option(65536, "--capacity", help="Microbatch capacity T in compact tokens."),
    dp: int = typer.Option(1, "--dp", help="Data-parallel degree D."),
    chunk_size: int = typer.Option(64, "--chunk-size", help="Linear-attention chunk size B."),
    print_ir_after_all: bool = typer.Option(False, "--print-ir-after-all", help="Print the IR after every pass (stderr)."),
    print_ir_after: Optional[str] = typer.Option(None, "--print-ir-after", help="Comma-separated passes to print the IR after."),
    dump_ir: Optional[Path] = typer.Option(None, "--dump-ir", help="Write every stage to DIR/NNN_<pass>.txt."),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip IR verification after each pass."),
    time_passes: bool = typer.Option(False, "--time-passes", help="Print the time of every pass."),
) -> None:
    """Compile a rollout batch into a plan artifact."""
    from harts.passes.manager import DumpIR, PrintIRAfter, TimePasses
    from harts.workloads import resolve_input

    if dump_ir is not None and dump_ir.exists() and not dump_ir.is_dir():
        _fail(f"--dump-ir {dump_ir}: it exists and is not a directory; name a directory to dump the stages into")
    instruments = []
    if print_ir_after_all:
        instruments.append(PrintIRAfter(None))
    elif print_ir_after:
        instruments.append(PrintIRAfter([p.strip() for p in print_ir_after.split(",") if p.strip()]))
    if dump_ir is not None:
        instruments.append(DumpIR(dump_ir))
    timer = TimePasses() if time_passes else None
    if timer is not None:
        instruments.append(timer)
    with console.status(f"reading {input}"):
        batch = resolve_input(input)
    plan = harts.compile(
        batch, capacity=capacity, dp_size=dp, chunk_size=chunk_size, pipeline=pipeline,
        verify=False if no_verify else None, instruments=instruments, progress=True,
    )
    plan.save(output)
    print_stats(plan.stats, title=f"plan written to {output}")
    if timer is not None:
        console.print(timer.report())


@app.command("inspect")
@_reports_errors
def inspect_command(
    plan_path: Path = typer.Argument(..., help="Plan artifact written by `harts compile`."),
    as_json: bool = typer.Option(False, "--json", help="Print the full inspect document as JSON."),
    ir: bool = typer.Option(False, "--ir", help="Print the plan's IR text."),
) -> None:
    """Show a plan: statistics, microbatches and rounds."""
    plan = harts.load_plan(plan_path)
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


@app.command("passes")
def passes_command() -> None:
    """List the registered passes and the default pipeline."""
    from harts.passes import PASS_REGISTRY

    table = Table(title="passes")
    for column in ("name", "requires", "produces", "summary"):
        table.add_column(column)
    for name, pass_class in sorted(PASS_REGISTRY.items(), key=lambda item: item[1].produces):
        table.add_row(name, str(pass_class.requires), str(pass_class.produces), pass_class.summary)
    Console().print(table)
    Console().print("default pipeline: " + ",".join(harts.DEFAULT_PIPELINE))


@app.command("run")
@_reports_errors
def run_command(
    input: str = typer.Argument("demo", help="Rollout batch: node table or preset (default: the bundled demo batch)."),
    preset: str = typer.Option("tiny", "--preset", help="Model preset."),
    chunk_size: int = typer.Option(16, "--chunk-size", help="Linear-attention chunk size B."),
    capacity: int = typer.Option(4096, "--capacity", help="Microbatch capacity T in compact tokens."),
    dp: int = typer.Option(1, "--dp", help="Data-parallel degree D."),
    repeats: int = typer.Option(3, "--repeats", min=0, help="Timed repetitions of each step (after one warm-up)."),
    recompute: bool = typer.Option(True, "--recompute/--no-recompute", help="Full-layer activation recomputation."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
) -> None:
    """The main job: compile a batch, run one GRPO step with HARTS and the baseline, print the figures."""
    from harts.demo import run_demo

    with console.status("compiling and running one GRPO step in both modes"):
        figures = run_demo(input, preset=preset, chunk_size=chunk_size, capacity=capacity, dp_size=dp,
                           repeats=repeats, recompute=recompute)
    broken = [name for name, value in figures.items() if isinstance(value, float) and not math.isfinite(value)]
    if broken:
        _fail(f"the step produced non-finite figures ({', '.join(f'{name} = {figures[name]}' for name in broken)}); "
              "check the batch's advantages, rewards and masks")
    if as_json:
        sys.stdout.write(json.dumps(figures, indent=2, allow_nan=False) + "\n")
        return
    print_stats(figures, title="HARTS vs trajectory-wise baseline, one GRPO step")


@app.command("bench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@_reports_errors
def bench_command(ctx: typer.Context) -> None:
    """Runtime benchmark: baseline vs HARTS F/B/Grad, Core, memory, fidelity (options: harts bench --help-bench)."""
    from harts.bench import main as bench_main

    arguments = ["--help" if a == "--help-bench" else a for a in ctx.args]
    bench_main(arguments)


if __name__ == "__main__":  # pragma: no cover
    app()
