"""The workspace model (the Kandev side): workspaces, agents, workflows, tasks.

``service`` holds the rules (references, events, moves, launches),
``actions`` the ``queue_run`` workflow action, ``errors`` what a caller is
told; the statements are :mod:`kandevd.store.workspace`'s.
"""

from kandevd.model.actions import queue_run_key
from kandevd.model.errors import (
    ConflictError,
    InvalidReference,
    LaunchRefused,
    ModelError,
    NotFoundError,
)
from kandevd.model.service import WorkspaceService
from kandevd.store.workspace import RUNNER_SQL, effective_runner

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
