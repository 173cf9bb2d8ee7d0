"""The Office predicate, defined once, in SQL and in Python.

A task is an *Office task* when either

* its ``project_id`` is non-empty (it belongs to an Office project), or
* its ``workflow_id`` is its workspace's non-empty ``office_workflow_id``.

Everything Office does (the assignment subscribers, unstarted-task recovery)
asks this module, never re-derives the rule: a Kanban or custom task with a
runner must never become autonomous because two copies of the rule drifted.
:data:`OFFICE_TASK_SQL` expects ``tasks`` aliased ``t`` joined with its
``workspaces`` row aliased ``w``; :func:`is_office_task` is the same rule
for a TASK object and its workspace's ``office_workflow_id``. The unit tests
check that both agree on random data.

:func:`office_adopted` is the cheap existence check that gates recovery: one
indexed-or-tiny query, no scan of ``tasks``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from typing import Any

#: Statements tagged with this comment are the Office gates' existence checks;
#: anything else touching Office tables from the Office loop is a scan.
PROBE_TAG = "/* office:probe */"

#: ``tasks t`` JOIN ``workspaces w``: true for an Office task.
OFFICE_TASK_SQL = (
    "(COALESCE(t.project_id, '') != ''"
    " OR (COALESCE(w.office_workflow_id, '') != '' AND t.workflow_id = w.office_workflow_id))"
)

_ADOPTED_SQL = (
    f"{PROBE_TAG} SELECT EXISTS(SELECT 1 FROM workspaces WHERE office_workflow_id != '')"
    " OR EXISTS(SELECT 1 FROM office_projects)"
)


def is_office_task(task: Mapping[str, Any], office_workflow_id: str | None) -> bool:
    """The Python side of :data:`OFFICE_TASK_SQL`, given the workspace's ``office_workflow_id``."""
    if task.get("project_id"):
        return True
    return bool(office_workflow_id) and task.get("workflow_id") == office_workflow_id


def office_adopted(conn: sqlite3.Connection) -> bool:
    """Does any workspace use Office (an Office workflow set, or an Office project)?"""
    return bool(conn.execute(_ADOPTED_SQL).fetchone()[0])
