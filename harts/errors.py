"""Exceptions raised by HARTS. Every message names the tree, trajectory, node or field at fault."""


class HartsError(Exception):
    """Base class of every error HARTS raises on purpose."""


class RolloutInputError(HartsError, ValueError):
    """The rollout batch or node table given by the user is malformed."""


class IRVerificationError(HartsError):
    """An IR module violates an invariant of its phase."""


class IRParseError(HartsError, ValueError):
    """The textual IR could not be parsed."""


class PipelineError(HartsError, ValueError):
    """A pass pipeline is malformed or names an unknown pass or option."""


class PlanningError(HartsError):
    """The planner cannot build a valid plan for this input (e.g. a trajectory above capacity)."""


class PlanArtifactError(HartsError):
    """A saved plan is truncated, edited, of another schema version, or otherwise unreadable."""


class OutputError(HartsError, OSError):
    """An output HARTS was asked to write cannot be written (read-only place, not a directory, disk full...)."""


class PlanBatchMismatchError(HartsError, ValueError):
    """A plan meets a batch it was not compiled for (another input hash, or rows whose tokens disagree)."""


class ModelInputError(HartsError, ValueError):
    """What the runtime was handed does not fit the model or the call (token ids, shapes, temperature, plan type)."""
