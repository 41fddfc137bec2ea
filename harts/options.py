"""The compile targets every part of HARTS shares: one frozen object, one set of defaults.

``harts.compile``, ``harts compile`` and the benchmarks all take their defaults from
:data:`DEFAULT_OPTIONS`; the ``lower`` pass records the options in the IR so that every
later pass plans for the same capacity T, data-parallel degree D and chunk size B.
``harts.compile`` calls :func:`check_compile_options` once, right after parsing the pipeline,
so that options no plan can serve fail at once with a :class:`~harts.errors.PipelineError`
naming the option, instead of producing a useless plan or a huge allocation later.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from harts.errors import PipelineError

__all__ = ["DEFAULT_OPTIONS", "MAX_CAPACITY", "MAX_CHUNK_SIZE", "CompileOptions", "check_compile_options"]

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


def _positive_integer_field(instance, attribute, value) -> None:
    _positive_integer(attribute.name, value)


@attrs.frozen(kw_only=True)
class CompileOptions:
    """What a plan is compiled for.

    ``capacity``: T, compact tokens per microbatch. ``dp_size``: D, data-parallel replicas
    (the microbatch count is a multiple of D). ``chunk_size``: B, the chunk size of the
    linear-attention kernel the plan will run with (replay and state hand-offs sit on its grid).
    """

    capacity: int = attrs.field(default=65536, validator=_positive_integer_field)
    dp_size: int = attrs.field(default=1, validator=_positive_integer_field)
    chunk_size: int = attrs.field(default=64, validator=_positive_integer_field)


#: The defaults of ``harts.compile``, the CLI and the benchmarks.
DEFAULT_OPTIONS = CompileOptions()


def check_compile_options(*, capacity: Any, dp_size: Any, chunk_size: Any, passes: Sequence[Any]) -> None:
    """Refuse options no plan can serve: non-positive or non-integer sizes, an empty pipeline, a chunk
    larger than :data:`MAX_CHUNK_SIZE`, a capacity above :data:`MAX_CAPACITY`. (A pass's own options are
    the pass's to validate: each is a declared, checked field of its frozen class, :func:`harts.passes.option`;
    T, D and B are compile options only, recorded by ``lower``, which no pass overrides.)"""
    _positive_integer("capacity", capacity)
    _positive_integer("dp_size", dp_size)
    _positive_integer("chunk_size", chunk_size)
    if not passes:
        raise PipelineError("the pipeline is empty: name at least one pass (the default is harts.DEFAULT_PIPELINE)")
    if capacity > MAX_CAPACITY:
        raise PipelineError(
            f"option 'capacity' is {capacity:,}, above {MAX_CAPACITY:,}: the attention kernels index a microbatch's "
            "rows with 32-bit offsets"
        )
    if chunk_size > MAX_CHUNK_SIZE:
        raise PipelineError(
            f"option 'chunk_size' is {chunk_size:,}, above {MAX_CHUNK_SIZE:,}: the linear-attention kernels allocate "
            "chunk_size x chunk_size matrices per head and chunk (64 is the usual choice)"
        )


#: The chunk sizes the fast linear-attention kernels take (fla's chunkwise KDA pipeline,
#: :mod:`harts.kernels.linear_attention.chunk`); other chunk sizes run on the reference only.
FAST_KERNEL_CHUNK_SIZES: tuple[int, ...] = (32, 64)


def check_fast_kernel_chunk_size(chunk_size: int) -> None:
    """``harts.compile(fast_kernels=True)``: refuse, at compile time, a chunk size the fast kernels cannot take
    (rather than let the runtime fall back to the reference without a word)."""
    if chunk_size not in FAST_KERNEL_CHUNK_SIZES:
        raise PipelineError(
            f"option 'chunk_size' is {chunk_size}, but the fast linear-attention kernels take chunk sizes "
            f"{' or '.join(map(str, FAST_KERNEL_CHUNK_SIZES))}; compile with one of them, or with fast_kernels=False "
            "to run on the reference kernels"
        )
