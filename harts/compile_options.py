"""Compile options that no plan can serve, refused before any work starts.

``harts.compile`` calls :func:`check_compile_options` once, right after parsing the
pipeline; a degenerate option then fails at once with a :class:`~harts.errors.PipelineError`
naming the option, instead of producing a useless plan or a huge allocation later.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from harts.errors import PipelineError

#: The fast attention and state-scan kernels index a microbatch's rows with int32 offsets
#: (``cu_seqlens``), so a microbatch holds at most this many compact tokens.
MAX_CAPACITY = 2**31 - 1
#: The chunkwise linear-attention kernels build B x B intra-chunk matrices per head and chunk;
#: beyond this the memory grows without any benefit (fla's own kernels use B = 64).
MAX_CHUNK_SIZE = 4096


def _positive_integer(name: str, value: Any, where: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PipelineError(f"{where}option '{name}' must be a positive integer, got {value!r}")
    return value


def check_compile_options(*, capacity: Any, dp_size: Any, chunk_size: Any, invocations: Sequence[Any]) -> None:
    """Refuse options no plan can serve: non-positive or non-integer sizes, an empty pipeline, a chunk
    larger than :data:`MAX_CHUNK_SIZE`, a capacity above :data:`MAX_CAPACITY`
    (also where a pass option such as ``partition-microbatches{capacity=...}`` overrides it)."""
    _positive_integer("capacity", capacity)
    _positive_integer("dp_size", dp_size)
    _positive_integer("chunk_size", chunk_size)
    if not invocations:
        raise PipelineError("the pipeline is empty: name at least one pass (the default is harts.DEFAULT_PIPELINE)")
    capacities = [("capacity", capacity, "")]
    for invocation in invocations:
        override = getattr(invocation.options, "capacity", None)
        if override is not None:
            capacities.append(("capacity", _positive_integer("capacity", override, f"pass '{invocation.name}': "),
                               f"pass '{invocation.name}': "))
    for name, value, where in capacities:
        if value > MAX_CAPACITY:
            raise PipelineError(
                f"{where}option '{name}' is {value:,}, above {MAX_CAPACITY:,}: the attention kernels index a microbatch's "
                "rows with 32-bit offsets"
            )
    if chunk_size > MAX_CHUNK_SIZE:
        raise PipelineError(
            f"option 'chunk_size' is {chunk_size:,}, above {MAX_CHUNK_SIZE:,}: the linear-attention kernels allocate "
            "chunk_size x chunk_size matrices per head and chunk (64 is the usual choice)"
        )
