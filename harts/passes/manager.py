"""Running a pipeline: the pass contract, and instruments around each pass (verification is one of them).

The manager owns the contract of :class:`~harts.passes.base.Pass`: before a pass runs, its
input must have reached ``requires`` (``lower``, with ``requires=None``, runs first, on no
module); after it runs, its output must be at ``produces`` exactly and, unless
verification is off, satisfy every invariant of that phase. Every error raised while a pass
runs or is checked names the pass and the passes run before it.

Instruments are reachable from the API (``instruments=[...]``), the CLI flags, and the
environment, read once per compile:

* ``HARTS_PRINT_IR_AFTER=all`` or ``=pass-a,pass-b``: print the IR after those passes (stderr)
* ``HARTS_DUMP_IR=DIR``: write every stage to ``DIR/NNN_<pass>.txt``
* ``HARTS_TIME_PASSES=1``: log the time of every pass
* ``HARTS_VERIFY=0``: skip verification after each pass
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from harts.errors import HartsError, IRVerificationError, OutputError, PipelineError
from harts.fsio import IR_DUMP_STAGE, atomic_write_bytes, check_output, dump_stage_header, prepare_ir_dump
from harts.ir.layout import LaidOutModule
from harts.ir.nodes import Phase
from harts.ir.text import print_ir
from harts.ir.verify import verify
from harts.passes.base import Pass, PassContext, Stage
from harts.passes.registry import PASS_REGISTRY

logger = logging.getLogger(__name__)


class Instrument:
    """Hooks called around every pass; subclasses override what they need.

    ``module`` is None before a pipeline that starts with ``lower`` (it starts from the batch).
    """

    def before_pipeline(self, module: Stage | None) -> None:
        pass

    def before_pass(self, step: Pass, module: Stage | None) -> None:
        pass

    def after_pass(self, step: Pass, module: Stage, seconds: float) -> None:
        pass

    def after_pipeline(self, module: Stage) -> None:
        pass


class PrintIRAfter(Instrument):
    """Print the IR after all passes (``passes=None``) or after the named ones."""

    def __init__(self, passes: Sequence[str] | None = None, stream: TextIO | None = None):
        self.passes = None if passes is None else set(passes)
        unknown = sorted(name for name in self.passes or () if name not in PASS_REGISTRY)
        if unknown:
            raise PipelineError(f"cannot print IR after unknown pass {unknown[0]!r}; known passes: {', '.join(PASS_REGISTRY)}")
        self.stream = stream

    def after_pass(self, step: Pass, module: Stage, seconds: float) -> None:
        if self.passes is None or step.name in self.passes:
            stream = self.stream or sys.stderr
            stream.write(f"// ----- IR after {step.to_text()} -----\n")
            stream.write(step.render(module))


class DumpIR(Instrument):
    """Write every stage as ``NNN_<pass>.txt``, numbered from 000 in the order they are produced.

    A pipeline that starts from an already lowered module writes that input as ``000_lower.txt``.
    The directory must be new, empty or an earlier dump (:data:`harts.fsio.IR_DUMP`: every stage
    file starts with a HARTS header comment, which the IR parser skips); that dump's stages are
    removed first, so none is left beside the new ones.
    """

    def __init__(self, directory: str | os.PathLike, *, option: str | None = None):
        self.directory = Path(directory)
        self.option = option or "cannot dump the IR to"
        self.count = 0

    def _write(self, name: str, text: str) -> None:
        target = self.directory / f"{self.count:03d}_{name}.txt"
        try:
            check_output(target, IR_DUMP_STAGE, option=self.option)
            atomic_write_bytes(target, (dump_stage_header(self.count, name) + text).encode())
        except OutputError:
            raise
        except OSError as error:
            raise OutputError(f"cannot dump the IR to {self.directory}: {error.strerror or error}") from error
        self.count += 1

    def before_pipeline(self, module: Stage | None) -> None:
        self.count = 0
        try:
            prepare_ir_dump(self.directory, option=self.option)
        except OutputError:
            raise
        except OSError as error:
            raise OutputError(f"cannot dump the IR to {self.directory}: {error.strerror or error}") from error
        if module is not None:
            self._write("lower", print_ir(module))

    def after_pass(self, step: Pass, module: Stage, seconds: float) -> None:
        self._write(step.name, step.render(module))


class TimePasses(Instrument):
    """Record (and log) wall time per pass."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def after_pass(self, step: Pass, module: Stage, seconds: float) -> None:
        self.seconds[step.name] = self.seconds.get(step.name, 0.0) + seconds
        logger.info("pass %-24s %8.3f s", step.name, seconds)

    def report(self) -> str:
        total = sum(self.seconds.values())
        lines = [f"{name:<24} {seconds:9.4f} s" for name, seconds in self.seconds.items()]
        lines.append(f"{'total':<24} {total:9.4f} s")
        return "\n".join(lines)


class Verify(Instrument):
    """Verification as an instrument: the pipeline's input, then every pass's output.

    An output is checked against the invariants of its phase and of every phase before it, except the
    phases whose parts it shares, object for object, with the stage verified before it
    (:func:`harts.ir.verify.verify`'s ``verified``): a pass's output needs the checks of what the pass
    added or rebuilt. ``run_pipeline(verify_each=True)`` puts it first, so no other instrument sees an
    invalid stage.
    """

    def __init__(self) -> None:
        self.verified = None
        self.done: list[str] = []

    def _remember(self, stage: Stage) -> None:
        self.verified = stage.module if isinstance(stage, LaidOutModule) else stage

    def before_pipeline(self, module: Stage | None) -> None:
        if module is None:
            return
        try:
            verify(module)
        except IRVerificationError as error:
            _locate(error, "the pipeline's input is invalid")
            raise
        self._remember(module)

    def after_pass(self, step: Pass, module: Stage, seconds: float) -> None:
        try:
            verify(module, verified=self.verified)
        except IRVerificationError as error:
            _locate(error, f"the output of pass {step.to_text()!r} is invalid ({_history(self.done)})")
            raise
        self.done.append(step.to_text())
        self._remember(module)


def instruments_from_environment(environ: dict[str, str] | None = None) -> list[Instrument]:
    environ = os.environ if environ is None else environ
    instruments: list[Instrument] = []
    after = environ.get("HARTS_PRINT_IR_AFTER", "").strip()
    if after:
        instruments.append(PrintIRAfter(None if after == "all" else [p.strip() for p in after.split(",") if p.strip()]))
    if environ.get("HARTS_DUMP_IR"):
        instruments.append(DumpIR(environ["HARTS_DUMP_IR"]))
    if environ.get("HARTS_TIME_PASSES", "") not in ("", "0"):
        instruments.append(TimePasses())
    return instruments


def verification_enabled_by_environment(environ: dict[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get("HARTS_VERIFY", "1") not in ("0", "false", "no")


def _history(done: Sequence[str]) -> str:
    return f"passes run before it: {', '.join(done)}" if done else "no pass ran before it"


def _locate(error: HartsError, where: str) -> None:
    """Prefix the error's message with where in the pipeline it arose (its type and traceback stay)."""
    error.args = (f"{where}: {error}",) + error.args[1:]


def _check_requires(step: Pass, module: Stage | None, done: Sequence[str]) -> None:
    if step.requires is None:
        if module is not None:
            raise PipelineError(f"pass {step.name!r} starts a pipeline from the batch, but it comes after a {module.phase} module ({_history(done)})")
    elif module is None:
        raise PipelineError(f"pass {step.name!r} needs phase {step.requires}, but the pipeline has no module yet; start it with 'lower'")
    elif module.phase == Phase.LAID_OUT:
        # lay-out's plan is the end of every pipeline: no pass reads one
        raise PipelineError(
            f"pass {step.name!r} comes after the pipeline already produced the laid-out plan ({_history(done)}); "
            "'lay-out' is the last pass of a pipeline: name it once, at the end"
        )
    elif module.phase < step.requires:
        raise PipelineError(
            f"pass {step.name!r} needs phase {step.requires} but the module is {module.phase} ({_history(done)}); "
            "run the earlier passes first"
        )


def run_pipeline(
    module: Stage | None,
    passes: Sequence[Pass],
    ctx: PassContext,
    *,
    verify_each: bool = True,
    instruments: Sequence[Instrument] = (),
) -> Stage:
    """Run passes in order, enforcing each one's contract; verify the input and every output (the
    :class:`Verify` instrument, first of all) unless told not to."""
    done: list[str] = []
    instruments = [Verify(), *instruments] if verify_each else list(instruments)
    for instrument in instruments:
        instrument.before_pipeline(module)
    for position, step in enumerate(passes):
        if not isinstance(step, Pass):
            raise PipelineError(f"pipeline entry {position} is {type(step).__name__}, not a pass ({_history(done)})")
        _check_requires(step, module, done)
        for instrument in instruments:
            instrument.before_pass(step, module)
        ctx.report(step.name, position / max(1, len(passes)))
        started = time.perf_counter()
        try:
            result = step.run(module, ctx)
        except HartsError as error:
            _locate(error, f"pass {step.to_text()!r} failed ({_history(done)})")
            raise
        seconds = time.perf_counter() - started
        if getattr(result, "phase", None) != step.produces:
            got = f"phase {result.phase}" if hasattr(result, "phase") else type(result).__name__
            raise PipelineError(f"pass {step.name!r} must produce phase {step.produces} but returned {got} ({_history(done)})")
        logger.debug("pass %s: %s -> %s in %.4f s", step.name, getattr(module, "phase", "batch"), result.phase, seconds)
        for instrument in instruments:
            instrument.after_pass(step, result, seconds)
        done.append(step.to_text())
        module = result
    ctx.report("done", 1.0)
    for instrument in instruments:
        instrument.after_pipeline(module)
    return module
