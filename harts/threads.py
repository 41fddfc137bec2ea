"""Work on independent microbatches in threads, for the compile-time passes and verifiers.

Laying a microbatch out is whole-array numpy operations over its rows and tokens, which release
the GIL, so on a machine of several cores threads lay several microbatches out at once (when
microbatches are large: for small ones the Python between those operations, which holds the
GIL, is most of the time, and threads only contend for it). Results come back in input order and the first failure, in input order,
is the one raised: the outcome is the one of a plain loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

#: the most threads used, however many cores there are (compiling is mostly sequential; this is its parallel part)
MAX_THREADS = 4


def thread_count(items: int) -> int:
    return max(1, min(MAX_THREADS, os.cpu_count() or 1, items))


def map_in_order(function: Callable[[Item], Result], items: Sequence[Item], *, name: str, threaded: bool = True) -> list[Result]:
    """``[function(item) for item in items]``, the items spread over threads (none when there is one core or item,
    or when not ``threaded``)."""
    threads = thread_count(len(items)) if threaded else 1
    if threads == 1:
        return [function(item) for item in items]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"harts-{name}") as pool:
        return list(pool.map(function, items))
