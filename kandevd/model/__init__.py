"""The workspace model (the Kandev side): workspaces, agents, workflows, tasks.

``repository`` holds the SQL, ``service`` the rules (references, events,
moves, launches), ``actions`` the ``queue_run`` workflow action.
"""

from kandevd.model.actions import queue_run_key
from kandevd.model.repository import (
    RUNNER_SQL,
    ConflictError,
    InvalidReference,
    LaunchRefused,
    ModelError,
    NotFoundError,
    effective_runner,
)
from kandevd.model.service import WorkspaceService

__all__ = [
    "RUNNER_SQL",
    "ConflictError",
    "InvalidReference",
    "LaunchRefused",
    "ModelError",
    "NotFoundError",
    "WorkspaceService",
    "effective_runner",
    "queue_run_key",
]
