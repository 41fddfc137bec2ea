"""The compile targets every part of HARTS shares: one frozen object, one set of defaults.

``harts.compile``, ``harts compile`` and the benchmarks all take their defaults from
:data:`DEFAULT_OPTIONS`; the ``lower`` pass records the options in the IR so that every
later pass plans for the same capacity T, data-parallel degree D and chunk size B.
"""

from __future__ import annotations

import attrs

from harts.errors import PipelineError

__all__ = ["DEFAULT_OPTIONS", "CompileOptions"]


def _positive_integer(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PipelineError(f"option '{attribute.name}' must be a positive integer, got {value!r}")


@attrs.frozen(kw_only=True)
class CompileOptions:
    """What a plan is compiled for.

    ``capacity``: T, compact tokens per microbatch. ``dp_size``: D, data-parallel replicas
    (the microbatch count is a multiple of D). ``chunk_size``: B, the chunk size of the
    linear-attention kernel the plan will run with (replay and state hand-offs sit on its grid).
    """

    capacity: int = attrs.field(default=65536, validator=_positive_integer)
    dp_size: int = attrs.field(default=1, validator=_positive_integer)
    chunk_size: int = attrs.field(default=64, validator=_positive_integer)


#: The defaults of ``harts.compile``, the CLI and the benchmarks.
DEFAULT_OPTIONS = CompileOptions()
