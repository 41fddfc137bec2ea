"""Online RL tasks that run on the CPU: ``harts train --task NAME``.

A task gives prompts, an environment that answers between the policy's turns and a
programmatic reward; :func:`harts.tasks.trees.sample_rollouts` grows each prompt's rollout
tree with the policy's own incremental decoder (forks at turn boundaries and inside turns)
and :func:`~harts.tasks.trees.rollout_batch` turns the leaves into a
:class:`~harts.RolloutBatch` with GRPO group advantages. :func:`harts.train.online.run_online`
trains on them step by step.
"""

from __future__ import annotations

from harts.errors import HartsError
from harts.tasks.base import Episode, Task
from harts.tasks.counting import CountingTask
from harts.tasks.trees import Rollout, TreeShape, rollout_batch, sample_rollouts
from harts.rollouts.inputs import parse_options

__all__ = ["TASKS", "CountingTask", "Episode", "Rollout", "Task", "TreeShape", "get_task", "rollout_batch", "sample_rollouts"]

#: Task name -> task class (built with its defaults).
TASKS: dict[str, type[Task]] = {CountingTask.name: CountingTask}


def get_task(spec: str) -> Task:
    """The task named by ``spec``: a name of :data:`TASKS`, optionally with options (``count:prompts=4,turn_length=3``)."""
    name, _, option_text = str(spec).partition(":")
    if name not in TASKS:
        raise HartsError(f"unknown task {name!r}; tasks: {', '.join(sorted(TASKS))}")
    task_class = TASKS[name]
    return task_class(**parse_options(name, option_text, task_class.OPTIONS, what="task"))
