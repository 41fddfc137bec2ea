"""``harts.compile``: rollout batch -> verified, rounded IR -> :class:`~harts.plan.Plan`."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from harts.batch import RolloutBatch
from harts.compile_options import check_compile_options
from harts.errors import PipelineError
from harts.passes import PASS_REGISTRY, PassContext, PassInvocation, lower, parse_pipeline, pipeline_to_text
from harts.passes.manager import Instrument, instruments_from_environment, run_pipeline, verification_enabled_by_environment
from harts.plan import Plan, compute_stats

logger = logging.getLogger(__name__)

#: The default pipeline, one pass per line.
DEFAULT_PIPELINE: tuple[str, ...] = (
    "prefix-compress",         # compact trie: map m, multiplicities q, LCP index (§3.1, Eq. 5-6)
    "partition-microbatches",  # candidate microbatch sets ranked by J (§3.2, Eq. 4, 7-10)
    "schedule-slots",          # DP replica x microbatch slot assignment (§3.2)
    "segment",                 # per-microbatch segment forests on the chunk grid (§3.3)
    "min-call-rounds",         # minimum-call rounds, replay and state handoffs (Alg. 1)
)


def default_pipeline_text() -> str:
    return ",".join(DEFAULT_PIPELINE)


def _progress_reporter(enabled: bool):
    if not enabled:
        return None, None
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("[bold]compile[/bold] {task.description:<24}"), BarColumn(), TimeElapsedColumn(), transient=True)
    task = progress.add_task("", total=1.0)

    def report(what: str, fraction: float) -> None:
        progress.update(task, description=what, completed=fraction)

    return progress, report


def compile(  # noqa: A001 - the public name the design asks for
    batch: RolloutBatch,
    *,
    capacity: int = 65536,
    dp_size: int = 1,
    chunk_size: int = 64,
    pipeline: str | Sequence[PassInvocation] | None = None,
    verify: bool | None = None,
    instruments: Sequence[Instrument] | None = None,
    progress: bool = False,
) -> Plan:
    """Compile a rollout batch into an execution plan.

    ``pipeline`` is pipeline text (``"prefix-compress,partition-microbatches{capacity=4096},..."``)
    or parsed invocations; the default is :data:`DEFAULT_PIPELINE`. ``verify=None`` follows
    ``HARTS_VERIFY`` (on unless set to 0). Instruments from the environment are added to
    the ones given.
    """
    if not isinstance(batch, RolloutBatch):
        raise PipelineError(f"harts.compile expects a RolloutBatch, got {type(batch).__name__}")
    if pipeline is None:
        pipeline = default_pipeline_text()
    invocations = parse_pipeline(pipeline) if isinstance(pipeline, str) else list(pipeline)
    check_compile_options(capacity=capacity, dp_size=dp_size, chunk_size=chunk_size, invocations=invocations)
    missing = [name for name in DEFAULT_PIPELINE if name not in PASS_REGISTRY]
    if missing and pipeline == default_pipeline_text():
        raise PipelineError(f"passes {missing} are not available in this installation")
    verify_each = verification_enabled_by_environment() if verify is None else verify
    all_instruments = list(instruments or ()) + instruments_from_environment()
    started = time.perf_counter()
    module = lower(batch, capacity=capacity, dp_size=dp_size, chunk_size=chunk_size)
    progress_bar, report = _progress_reporter(progress)
    ctx = PassContext(batch=batch, progress=report)
    if progress_bar is not None:
        with progress_bar:
            module = run_pipeline(module, invocations, ctx, verify_each=verify_each, instruments=all_instruments)
    else:
        module = run_pipeline(module, invocations, ctx, verify_each=verify_each, instruments=all_instruments)
    plan_seconds = time.perf_counter() - started
    stats = compute_stats(module, plan_seconds=plan_seconds)
    logger.info("compiled %d trajectories in %.3f s: compression %.3f", stats["trajectories"], plan_seconds, stats["compression"])
    plan = Plan(module=module, pipeline=pipeline_to_text(invocations), stats=stats)
    for instrument in all_instruments:
        if hasattr(instrument, "write_extra") and plan.has_rounds:
            instrument.write_extra("codegen", plan.render_programs())
    return plan
