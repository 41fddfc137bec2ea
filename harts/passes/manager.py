"""Running a pipeline: verification after every pass and instruments around each one.

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

from harts.errors import OutputError, PipelineError
from harts.fsio import atomic_write_bytes
from harts.ir.nodes import Module
from harts.ir.text import print_ir
from harts.ir.verify import verify
from harts.passes.base import PASS_REGISTRY, PassContext, PassInvocation

logger = logging.getLogger(__name__)


class Instrument:
    """Hooks called around every pass; subclasses override what they need."""

    def before_pipeline(self, module: Module) -> None:
        pass

    def before_pass(self, invocation: PassInvocation, module: Module) -> None:
        pass

    def after_pass(self, invocation: PassInvocation, module: Module, seconds: float) -> None:
        pass

    def after_pipeline(self, module: Module) -> None:
        pass


class PrintIRAfter(Instrument):
    """Print the IR after all passes (``passes=None``) or after the named ones."""

    def __init__(self, passes: Sequence[str] | None = None, stream: TextIO | None = None):
        self.passes = None if passes is None else set(passes)
        unknown = sorted((self.passes or set()) - set(PASS_REGISTRY))
        if unknown:
            raise PipelineError(f"cannot print IR after unknown pass {unknown[0]!r}; known passes: {', '.join(sorted(PASS_REGISTRY))}")
        self.stream = stream

    def after_pass(self, invocation: PassInvocation, module: Module, seconds: float) -> None:
        if self.passes is None or invocation.name in self.passes:
            stream = self.stream or sys.stderr
            stream.write(f"// ----- IR after {invocation.to_text()} -----\n")
            stream.write(print_ir(module))


class DumpIR(Instrument):
    """Write the input IR as ``000_lower.txt`` and every later stage as ``NNN_<pass>.txt``."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.count = 0

    def _write(self, name: str, text: str) -> None:
        target = self.directory / f"{self.count:03d}_{name}.txt"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(target, text.encode())
        except OSError as error:
            raise OutputError(f"cannot dump the IR to {self.directory}: {error.strerror or error}") from error
        self.count += 1

    def before_pipeline(self, module: Module) -> None:
        self._write("lower", print_ir(module))

    def after_pass(self, invocation: PassInvocation, module: Module, seconds: float) -> None:
        self._write(invocation.name, print_ir(module))

    def write_extra(self, name: str, text: str) -> None:
        """Add a non-IR stage (e.g. the generated programs) to the dump, numbered after the passes."""
        self._write(name, text)


class TimePasses(Instrument):
    """Record (and log) wall time per pass."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def after_pass(self, invocation: PassInvocation, module: Module, seconds: float) -> None:
        self.seconds[invocation.name] = self.seconds.get(invocation.name, 0.0) + seconds
        logger.info("pass %-24s %8.3f s", invocation.name, seconds)

    def report(self) -> str:
        total = sum(self.seconds.values())
        lines = [f"{name:<24} {seconds:9.4f} s" for name, seconds in self.seconds.items()]
        lines.append(f"{'total':<24} {total:9.4f} s")
        return "\n".join(lines)


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


def run_pipeline(
    module: Module,
    invocations: Sequence[PassInvocation],
    ctx: PassContext,
    *,
    verify_each: bool = True,
    instruments: Sequence[Instrument] = (),
) -> Module:
    """Run passes in order; verify the input and the output of each pass unless told not to."""
    if verify_each:
        verify(module)
    for instrument in instruments:
        instrument.before_pipeline(module)
    for position, invocation in enumerate(invocations):
        pass_class = PASS_REGISTRY[invocation.name]
        if module.phase < pass_class.requires:
            raise PipelineError(
                f"pass {invocation.name!r} needs phase {pass_class.requires} but the module is {module.phase}; "
                f"run the earlier passes first"
            )
        for instrument in instruments:
            instrument.before_pass(invocation, module)
        ctx.report(invocation.name, position / max(1, len(invocations)))
        started = time.perf_counter()
        result = pass_class().run(module, invocation.options, ctx)
        seconds = time.perf_counter() - started
        if not isinstance(result, Module):
            raise PipelineError(f"pass {invocation.name!r} returned {type(result).__name__}, not a Module")
        if verify_each:
            verify(result)
        logger.debug("pass %s: %s -> %s in %.4f s", invocation.name, module.phase, result.phase, seconds)
        for instrument in instruments:
            instrument.after_pass(invocation, result, seconds)
        module = result
    ctx.report("done", 1.0)
    for instrument in instruments:
        instrument.after_pipeline(module)
    return module
