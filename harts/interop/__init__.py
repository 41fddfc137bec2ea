"""Interop with the RL frameworks: their batches in, HARTS log-probs out in their layouts.

    batch = harts.interop.from_verl(data.batch)          # or from_trl(inputs), from_areal(batch)
    plan = harts.compile(batch, capacity=65536, chunk_size=64)
    out = harts.runtime.log_probs(model, plan, batch)
    log_prob = harts.interop.to_layout(out, batch, "verl")   # [B, R], as verl's actor returns it

Layouts: :mod:`harts.interop.framework_layouts`; importers: :mod:`harts.interop.importers`; saved
batches (``.pt``, ``.parquet``, ``.jsonl``): :func:`read_framework_file`.
"""

from harts.interop.files import FRAMEWORKS, read_framework_batch, read_framework_file
from harts.interop.framework_layouts import LAYOUTS, PROMPT_LENGTH, FrameworkLayout, LayoutError, layout_spec, to_layout
from harts.interop.importers import from_areal, from_trl, from_verl

__all__ = [
    "FRAMEWORKS",
    "FrameworkLayout",
    "LAYOUTS",
    "PROMPT_LENGTH",
    "LayoutError",
    "from_areal",
    "from_trl",
    "from_verl",
    "layout_spec",
    "read_framework_batch",
    "read_framework_file",
    "to_layout",
]
