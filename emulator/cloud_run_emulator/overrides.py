"""RunJob's overrides: checked, then applied to a copy of the job's execution template.

Cloud Run's rules (see the Admin API's ``RunJobRequest.Overrides``): a container override's
``args`` replace the container's, ``clearArgs`` clears them, its ``env`` is merged into the
container's (an override wins for a name in both); an override without a ``name`` is for the
first container; ``taskCount`` (0: not set) replaces the job's; ``timeout`` replaces the task
timeout. The checks are :func:`~.validation.validate_overrides`' and, on the result,
:func:`~.validation.validate_task_template`'s (the caller's).
"""

from __future__ import annotations

from typing import Optional

from google.cloud import run_v2

from .exceptions import InvalidArgument
from .models import copy_message
from .validation import validate_overrides


def apply_overrides(template: run_v2.ExecutionTemplate,
                    overrides: Optional[run_v2.RunJobRequest.Overrides]) -> tuple:
    """The effective ``(TaskTemplate, task_count)`` of an execution; ``template`` is not changed.

    :param template: the job's execution template (``job.template``).
    :param overrides: the request's overrides, or ``None``.
    :raises InvalidArgument: for an override Cloud Run refuses (naming its field), before anything
        is applied.
    """
    task_template = copy_message(template.template)
    task_count = template.task_count or 1
    if overrides is None:
        return task_template, task_count
    validate_overrides(overrides)
    for i, override in enumerate(overrides.container_overrides):
        container = _target(task_template, override.name, i)
        if override.clear_args:
            del container.args[:]
        elif override.args:
            container.args = list(override.args)
        env = {e.name: e for e in container.env}
        env.update({e.name: e for e in override.env})
        container.env = list(env.values())
    if overrides.task_count:
        task_count = overrides.task_count
    if "timeout" in overrides:
        task_template.timeout = overrides.timeout
    return task_template, task_count


def _target(task_template: run_v2.TaskTemplate, name: str, i: int) -> run_v2.Container:
    """The container an override is for: the one named ``name``, or the first without a name."""
    if not name:
        return task_template.containers[0]
    for container in task_template.containers:
        if container.name == name:
            return container
    raise InvalidArgument(f"overrides.container_overrides[{i}].name: no container named '{name}'.")
