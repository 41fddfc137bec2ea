"""Named passes of the HARTS compiler, their lazy registry, pipelines and the pass manager.

Importing this package imports no pass: :data:`PASS_REGISTRY` loads each built-in pass from
its module the first time it is looked up.
"""

from harts.passes.base import Pass, PassContext, option
from harts.passes.lower import lower
from harts.passes.registry import PASS_REGISTRY, PassRegistry, parse_pipeline, pipeline_to_text, register_pass

__all__ = [
    "PASS_REGISTRY",
    "Pass",
    "PassContext",
    "PassRegistry",
    "lower",
    "option",
    "parse_pipeline",
    "pipeline_to_text",
    "register_pass",
]
