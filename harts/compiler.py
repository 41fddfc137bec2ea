"""``harts.compile``: rollout batch -> verified IR, pass by pass -> :class:`~harts.plan.Plan`."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from harts.rollouts.batch import RolloutBatch
from harts.errors import HartsError, PipelineError
from harts.ir.layout import LaidOutModule
from harts.ir.nodes import CompactTrie, Phase
from harts.options import DEFAULT_OPTIONS, CompileOptions, check_compile_options, check_fast_kernel_chunk_size
from harts.passes.base import Pass, PassContext
from harts.passes.lay_out import LayOut
from harts.passes.lower import lower_batch
from harts.passes.manager import Instrument, instruments_from_environment, run_pipeline, verification_enabled_by_environment
from harts.passes.registry import BUILTIN_PASSES, parse_pipeline, pipeline_to_text
from harts.plan import Plan, compute_stats

logger = logging.getLogger(__name__)

#: The default pipeline: every built-in pass, in the order of its registry rows (each row's purpose says why there).
DEFAULT_PIPELINE: tuple[str, ...] = tuple(BUILTIN_PASSES)


def default_pipeline_text() -> str:
    return ",".join(DEFAULT_PIPELINE)


def complete_pipeline(passes: Sequence[Pass]) -> list[Pass]:
    """The passes to run: a pipeline that reaches the rounded phase ends in ``lay-out``.

    A plan that can run is always laid out, so a pipeline written up to ``min-call-rounds``
    (as pipelines were before code generation became a pass) still compiles to one.
    """
    passes = list(passes)
    if passes and passes[-1].produces == Phase.ROUNDED:
        passes.append(LayOut())
    return passes


def _prepare_while_hashing(batch: RolloutBatch, passes: Sequence[Pass],
                           options: CompileOptions) -> tuple[CompactTrie | None, tuple | None]:
    """Hash the batch (what ``lower`` records) in a worker thread while this thread builds the compact trie
    that ``prefix-compress`` will need and runs the microbatch planner on it for ``partition-microbatches``:
    ``(trie, (trie, lengths, planner options, result))``, None for what the pipeline does not run.

    Neither needs the hash, and hashlib releases the GIL while it hashes a large buffer, so on two cores
    the hash (a third of a second for a batch of 440 MB) runs beside them. The trie alone was shorter than
    the hash on the agentic bench shape (0.15 s), leaving this thread idle for the rest; the planner is a
    pure function of the trie, the trajectory lengths and its options, so running it here moves that wait
    off the compile (``PassContext.prepared_plan`` hands the result to the pass only for exactly those
    inputs): the shape's verified compile went from 1.04-1.17 s to 0.86-0.93 s (best of 7, alternating
    processes, our 2-core CI machine). The worker retakes the GIL from the planner's Python only a few
    dozen times, once per run of trajectories it hashes (``harts.rollouts.batch._update_with_tokens``). The
    hash is the same SHA-256 (:meth:`RolloutBatch.input_hash`), cached on the batch as ever: ``lower`` reads
    it once the worker is joined here. A batch whose trie or plan cannot be built is left
    to the passes, which raise with the pipeline's context.
    """
    if not any(getattr(step, "name", None) == "prefix-compress" for step in passes):
        return None, None
    from harts.passes.prefix_compress import build_compact_trie  # the pass's module loads when a pipeline names it

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="harts-hash") as worker:
        hashed = worker.submit(batch.input_hash)
        trie = plan = None
        try:
            trie = build_compact_trie(batch.tokens)
            plan = _plan_beforehand(trie, batch, passes, options)
        except HartsError:
            pass
        hashed.result()
    return trie, plan


def _plan_beforehand(trie: CompactTrie, batch: RolloutBatch, passes: Sequence[Pass], options: CompileOptions) -> tuple | None:
    """The planner's result for the first ``partition-microbatches`` step, for ``PassContext.batch_plan``."""
    from harts.ir.prefix_index import PrefixIndex
    from harts.passes.partition_microbatches import PartitionMicrobatches
    from harts.planner import choose_microbatches

    step = next((step for step in passes if isinstance(step, PartitionMicrobatches)), None)
    if step is None:
        return None
    lengths = tuple(len(tokens) for tokens in batch.tokens)
    planner_options = step.planner_options(options.capacity, options.dp_size)
    return trie, lengths, planner_options, choose_microbatches(PrefixIndex.from_trie(trie, list(lengths)), planner_options)


@contextlib.contextmanager
def _cyclic_collector_paused():
    """Pause Python's cyclic garbage collector while compiling; it runs as it did afterwards.

    Why: a compile allocates hundreds of thousands of small IR objects (trie nodes, segments, sequences) and
    frees few, so allocation keeps triggering collections, and each older-generation pass walks every live
    object: on the large bench shapes (``benchmarks/bench_planner.py --shapes``) that was a fifth of the compile
    or more. The IR is trees of frozen nodes, not cycles; whatever cyclic garbage a compile leaves (a caught
    exception's frames, say) is collected once the collector is back on. A collector already off stays off.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _progress_reporter(enabled: bool):
    if not enabled:
        return None, None
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # rich loads only when asked for

    progress = Progress(TextColumn("[bold]compile[/bold] {task.description:<24}"), BarColumn(), TimeElapsedColumn(), transient=True)
    task = progress.add_task("", total=1.0)

    def report(what: str, fraction: float) -> None:
        progress.update(task, description=what, completed=fraction)

    return progress, report


def compile(  # noqa: A001 - the public name the design asks for
    batch: RolloutBatch,
    *,
    capacity: int = DEFAULT_OPTIONS.capacity,
    dp_size: int = DEFAULT_OPTIONS.dp_size,
    chunk_size: int = DEFAULT_OPTIONS.chunk_size,
    pipeline: str | Sequence[Pass] | None = None,
    verify: bool | None = None,
    instruments: Sequence[Instrument] | None = None,
    progress: bool = False,
    fast_kernels: bool = False,
) -> Plan:
    """Compile a rollout batch into an execution plan.

    ``pipeline`` is pipeline text (``"prefix-compress,partition-microbatches{capacity=4096},..."``)
    or pass instances; the default is :data:`DEFAULT_PIPELINE`. A pipeline that does not start
    with ``lower`` runs on the batch lowered with these options; one that reaches the rounded
    phase ends in ``lay-out`` (:func:`complete_pipeline`). ``verify=None`` follows
    ``HARTS_VERIFY`` (on unless set to 0). Instruments from the environment are added to the
    ones given.

    ``fast_kernels=True``: the plan is for the fast linear-attention kernels, so a chunk size
    they cannot take (:data:`harts.options.FAST_KERNEL_CHUNK_SIZES`) is refused here, and on a
    GPU the runtime raises instead of falling back to the reference kernels.
    """
    if not isinstance(batch, RolloutBatch):
        raise PipelineError(f"harts.compile expects a RolloutBatch, got {type(batch).__name__}")
    options = CompileOptions(capacity=capacity, dp_size=dp_size, chunk_size=chunk_size)
    if pipeline is None:
        pipeline = default_pipeline_text()
    passes = complete_pipeline(parse_pipeline(pipeline) if isinstance(pipeline, str) else pipeline)
    check_compile_options(capacity=capacity, dp_size=dp_size, chunk_size=chunk_size, passes=passes)
    if not isinstance(fast_kernels, bool):
        raise PipelineError(f"option 'fast_kernels' must be True or False, got {fast_kernels!r}")
    if fast_kernels:
        check_fast_kernel_chunk_size(chunk_size)
    verify_each = verification_enabled_by_environment() if verify is None else verify
    all_instruments = list(instruments or ()) + instruments_from_environment()
    with _cyclic_collector_paused():
        return _compile(batch, options, passes, pipeline, verify_each, all_instruments, progress, fast_kernels)


def _compile(batch: RolloutBatch, options: CompileOptions, passes: list[Pass], pipeline, verify_each: bool,
             all_instruments: list[Instrument], progress: bool, fast_kernels: bool) -> Plan:
    """:func:`compile` once its arguments are checked."""
    started = time.perf_counter()
    starts_from_batch = bool(passes) and passes[0].requires is None
    batch_trie, batch_plan = _prepare_while_hashing(batch, passes, options)
    module = None if starts_from_batch else lower_batch(batch, options)
    progress_bar, report = _progress_reporter(progress)
    ctx = PassContext(batch=batch, options=options, progress=report, batch_trie=batch_trie, batch_plan=batch_plan)
    if progress_bar is not None:
        with progress_bar:
            result = run_pipeline(module, passes, ctx, verify_each=verify_each, instruments=all_instruments)
    else:
        result = run_pipeline(module, passes, ctx, verify_each=verify_each, instruments=all_instruments)
    plan_seconds = time.perf_counter() - started
    module, layouts = (result.module, result.layouts) if isinstance(result, LaidOutModule) else (result, None)
    stats = compute_stats(module, plan_seconds=plan_seconds, laid_out=layouts is not None)
    logger.info("compiled %d trajectories in %.3f s: compression %.3f", stats["trajectories"], plan_seconds, stats["compression"])
    return Plan(module=module, pipeline=pipeline_to_text(passes), stats=stats, layouts=layouts, fast_kernels=fast_kernels)
