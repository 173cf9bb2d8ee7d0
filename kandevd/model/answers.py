"""What the workspace model's methods answer besides its stored records (those are
:mod:`kandevd.store.workspace`'s)."""

from __future__ import annotations

from typing import TypedDict

from kandevd.model.actions import ActionOutcome
from kandevd.store.workspace import TaskRecord


class TaskMove(TypedDict):
    """``tasks.move``: the task as moved, and what each of the step's actions did."""

    task: TaskRecord
    actions: list[ActionOutcome]


class Launched(TypedDict):
    """``tasks.launch``: the session the runner was started in."""

    session_id: str
