"""Named passes of the HARTS compiler. Importing this package registers every pass."""

from harts.passes import prefix_compress  # noqa: F401  (registers)
from harts.passes import partition_microbatches, schedule_slots  # noqa: F401
from harts.passes.base import PASS_REGISTRY, Pass, PassContext, PassInvocation, parse_pipeline, pipeline_to_text, register_pass
from harts.passes.lower import lower
from harts.passes import segment, min_call_rounds  # noqa: F401

__all__ = ["PASS_REGISTRY", "Pass", "PassContext", "PassInvocation", "lower", "parse_pipeline", "pipeline_to_text", "register_pass"]
