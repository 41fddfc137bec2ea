"""HARTS: compile batches of rollout trees into prefix-sharing execution plans for hybrid-attention models.

    import harts
    batch = harts.RolloutBatch.from_trajectories(token_lists, advantages=...)
    plan = harts.compile(batch, capacity=65536, dp_size=1, chunk_size=64)
    out = harts.runtime.log_probs(model, plan, batch)

Subpackages that need torch (``runtime``, ``models``, ``rl``, ``kernels``, ``interop``, ``train``, ``tasks``) load on first use.
"""

import importlib

from harts._version import __version__
from harts.rollouts.batch import RolloutBatch
from harts.compiler import DEFAULT_PIPELINE, compile
from harts.errors import (
    HartsError,
    IRParseError,
    IRVerificationError,
    PipelineError,
    ModelInputError,
    PlanArtifactError,
    PlanBatchMismatchError,
    PlanningError,
    RolloutInputError,
)
from harts.options import DEFAULT_OPTIONS, CompileOptions
from harts.binding import BoundPlan
from harts.plan import Plan, load_plan

_LAZY_SUBMODULES = ("runtime", "models", "rl", "kernels", "codegen", "planner", "interop", "train", "tasks")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"harts.{name}")
    raise AttributeError(f"module 'harts' has no attribute {name!r}")


__all__ = [
    "DEFAULT_OPTIONS",
    "DEFAULT_PIPELINE",
    "BoundPlan",
    "CompileOptions",
    "HartsError",
    "IRParseError",
    "IRVerificationError",
    "PipelineError",
    "ModelInputError",
    "Plan",
    "PlanArtifactError",
    "PlanBatchMismatchError",
    "PlanningError",
    "RolloutBatch",
    "RolloutInputError",
    "__version__",
    "compile",
    "load_plan",
]
