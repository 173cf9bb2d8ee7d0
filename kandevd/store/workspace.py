"""The workspace model's tables: workspaces, agents, workflows (+ ordered steps), tasks.

Every statement of the model. Every function takes the connection it runs
on, so the service can put a reference check and the write that depends on
it into one ``BEGIN IMMEDIATE`` transaction. Nothing here validates
references or publishes events (that is :mod:`kandevd.model.service`); what
comes out are the objects the control socket returns, typed below (TypedDicts:
at run time the plain dicts the socket sends).

A task's effective runner is defined once, here, in both languages:
:data:`RUNNER_SQL` for queries that join ``tasks t`` with its current step
``workflow_steps s``, and :func:`effective_runner` for Python.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypedDict, TypeVar

#: The effective runner of ``tasks t`` joined with its current step ``workflow_steps s``.
RUNNER_SQL = "COALESCE(NULLIF(t.runner_agent_id, ''), NULLIF(s.agent_id, ''))"

#: Tasks with their current step's agent, the input of the effective runner.
TASK_SELECT = (
    "SELECT t.*, s.agent_id AS step_agent_id FROM tasks t"
    " LEFT JOIN workflow_steps s ON s.workflow_id = t.workflow_id AND s.id = t.step_id"
)

WORKSPACE_FIELDS = ("id", "name", "office_workflow_id", "created_at", "updated_at")
AGENT_FIELDS = ("id", "workspace_id", "name", "profile", "cooldown_s", "status",
                "cooldown_until", "last_finished_at", "created_at", "updated_at", "runs_on")
TASK_COLUMNS = ("id", "workspace_id", "workflow_id", "step_id", "title", "project_id", "state",
                "runner_agent_id", "created_at", "updated_at")


class WorkspaceRecord(TypedDict):
    id: str
    name: str
    office_workflow_id: str | None
    created_at: str
    updated_at: str


class AgentRecord(TypedDict):
    id: str
    workspace_id: str
    name: str
    profile: str
    cooldown_s: float
    status: str
    cooldown_until: str | None
    last_finished_at: str | None
    created_at: str
    updated_at: str
    #: The labels a runner must carry to run this agent's runs (None: the server runs them).
    runs_on: list[str] | None


class StepRecord(TypedDict):
    id: str
    name: str
    agent_id: str | None
    #: The step's actions (``queue_run``), as stored.
    on_enter: list[dict[str, Any]]


class WorkflowRecord(TypedDict):
    id: str
    workspace_id: str
    name: str
    style: str
    steps: list[StepRecord]
    created_at: str


class TaskRecord(TypedDict):
    id: str
    workspace_id: str
    workflow_id: str
    step_id: str | None
    title: str
    project_id: str | None
    state: str
    runner_agent_id: str | None
    created_at: str
    updated_at: str
    #: The effective runner: ``runner_agent_id``, else the step's agent.
    runner: str | None


Item = TypeVar("Item")


class RecordPage(TypedDict, Generic[Item]):
    items: list[Item]
    total: int
    limit: int
    offset: int


def effective_runner(runner_agent_id: str | None, step_agent_id: str | None) -> str | None:
    """The task's ``runner_agent_id`` when set, else its step's ``agent_id``, else None."""
    return runner_agent_id or step_agent_id or None


# -- row -> object ---------------------------------------------------------------

def workspace_from_row(row: Mapping[str, Any]) -> WorkspaceRecord:
    return {name: row[name] for name in WORKSPACE_FIELDS}


def agent_from_row(row: Mapping[str, Any]) -> AgentRecord:
    agent = {name: row[name] for name in AGENT_FIELDS}
    agent["cooldown_s"] = float(agent["cooldown_s"] or 0)
    agent["runs_on"] = json.loads(agent["runs_on"]) if agent["runs_on"] else None
    return agent


def step_from_row(row: Mapping[str, Any]) -> StepRecord:
    return {"id": row["id"], "name": row["name"], "agent_id": row["agent_id"] or None,
            "on_enter": json.loads(row["on_enter"] or "[]")}


def task_from_row(row: Mapping[str, Any]) -> TaskRecord:
    """TASK: the row plus ``runner`` (needs :data:`TASK_SELECT`'s ``step_agent_id``)."""
    task = {name: row[name] for name in TASK_COLUMNS}
    task["runner_agent_id"] = task["runner_agent_id"] or None
    task["runner"] = effective_runner(task["runner_agent_id"], row["step_agent_id"])
    return task


def _page(conn: sqlite3.Connection, select: str, count: str, where: Sequence[str],
          params: Sequence[Any], order: str, limit: int, offset: int,
          mapper: Callable[[sqlite3.Row], Item]) -> RecordPage[Item]:
    clause = (" WHERE " + " AND ".join(where)) if where else ""
    total = conn.execute(count + clause, list(params)).fetchone()[0]
    rows = conn.execute(f"{select}{clause} ORDER BY {order} LIMIT ? OFFSET ?",
                        [*params, limit, offset]).fetchall()
    return {"items": [mapper(r) for r in rows], "total": total, "limit": limit,
            "offset": offset}


def _filters(values: Mapping[str, Any], columns: Mapping[str, str]
             ) -> tuple[list[str], list[Any]]:
    where, params = [], []
    for name, column in columns.items():
        if values.get(name) is not None:
            where.append(f"{column} = ?")
            params.append(values[name])
    return where, params


def _update(conn: sqlite3.Connection, table: str, key: str, fields: Mapping[str, Any]) -> None:
    if not fields:
        return
    names = list(fields)
    conn.execute(f"UPDATE {table} SET {', '.join(f'{n} = ?' for n in names)} WHERE id = ?",
                 [*(fields[n] for n in names), key])


# -- workspaces --------------------------------------------------------------------

def get_workspace(conn: sqlite3.Connection, workspace_id: str) -> WorkspaceRecord | None:
    row = conn.execute("SELECT * FROM workspaces WHERE id = ?", (workspace_id,)).fetchone()
    return workspace_from_row(row) if row is not None else None


def insert_workspace(conn: sqlite3.Connection, workspace: Mapping[str, Any]) -> None:
    conn.execute("INSERT INTO workspaces (id, name, office_workflow_id, created_at, updated_at)"
                 " VALUES (:id, :name, :office_workflow_id, :created_at, :updated_at)",
                 dict(workspace))


def update_workspace(conn: sqlite3.Connection, workspace_id: str,
                     fields: Mapping[str, Any]) -> None:
    _update(conn, "workspaces", workspace_id, fields)


def list_workspaces(conn: sqlite3.Connection, *, limit: int, offset: int
                    ) -> RecordPage[WorkspaceRecord]:
    return _page(conn, "SELECT * FROM workspaces", "SELECT COUNT(*) FROM workspaces", [], [],
                 "rowid", limit, offset, workspace_from_row)


# -- agents ------------------------------------------------------------------------

def get_agent(conn: sqlite3.Connection, agent_id: str) -> AgentRecord | None:
    row = conn.execute("SELECT * FROM agents WHERE id = ?", (agent_id,)).fetchone()
    return agent_from_row(row) if row is not None else None


def insert_agent(conn: sqlite3.Connection, agent: Mapping[str, Any]) -> None:
    row = dict(agent)
    row["runs_on"] = json.dumps(row["runs_on"]) if row.get("runs_on") else None
    conn.execute("INSERT INTO agents (id, workspace_id, name, profile, cooldown_s, status,"
                 " created_at, updated_at, runs_on) VALUES (:id, :workspace_id, :name,"
                 " :profile, :cooldown_s, :status, :created_at, :updated_at, :runs_on)", row)


def update_agent(conn: sqlite3.Connection, agent_id: str, fields: Mapping[str, Any]) -> None:
    if "runs_on" in fields:
        fields = {**fields, "runs_on": json.dumps(fields["runs_on"]) if fields["runs_on"]
                  else None}
    _update(conn, "agents", agent_id, fields)


def list_agents(conn: sqlite3.Connection, *, limit: int, offset: int,
                **filters: Any) -> RecordPage[AgentRecord]:
    where, params = _filters(filters, {"workspace_id": "workspace_id", "status": "status"})
    return _page(conn, "SELECT * FROM agents", "SELECT COUNT(*) FROM agents", where, params,
                 "rowid", limit, offset, agent_from_row)


# -- workflows and steps -------------------------------------------------------------

def get_steps(conn: sqlite3.Connection, workflow_id: str) -> list[StepRecord]:
    rows = conn.execute("SELECT * FROM workflow_steps WHERE workflow_id = ? ORDER BY position",
                        (workflow_id,)).fetchall()
    return [step_from_row(r) for r in rows]


def get_step(conn: sqlite3.Connection, workflow_id: str, step_id: str) -> StepRecord | None:
    row = conn.execute("SELECT * FROM workflow_steps WHERE workflow_id = ? AND id = ?",
                       (workflow_id, step_id)).fetchone()
    return step_from_row(row) if row is not None else None


def _workflow_from_row(conn: sqlite3.Connection, row: sqlite3.Row) -> WorkflowRecord:
    return {"id": row["id"], "workspace_id": row["workspace_id"], "name": row["name"],
            "style": row["style"], "steps": get_steps(conn, row["id"]),
            "created_at": row["created_at"]}


def get_workflow(conn: sqlite3.Connection, workflow_id: str) -> WorkflowRecord | None:
    row = conn.execute("SELECT * FROM workflows WHERE id = ?", (workflow_id,)).fetchone()
    return _workflow_from_row(conn, row) if row is not None else None


def insert_workflow(conn: sqlite3.Connection, workflow: Mapping[str, Any],
                    steps: Sequence[Mapping[str, Any]]) -> None:
    """The workflow and its steps; ``position`` is the step's index in ``steps``."""
    conn.execute("INSERT INTO workflows (id, workspace_id, name, style, created_at)"
                 " VALUES (:id, :workspace_id, :name, :style, :created_at)", dict(workflow))
    conn.executemany(
        "INSERT INTO workflow_steps (workflow_id, id, position, name, agent_id, on_enter)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        [(workflow["id"], step["id"], position, step["name"], step.get("agent_id") or None,
          json.dumps(step.get("on_enter") or [], separators=(",", ":"), sort_keys=True))
         for position, step in enumerate(steps)])


def list_workflows(conn: sqlite3.Connection, *, limit: int, offset: int,
                   **filters: Any) -> RecordPage[WorkflowRecord]:
    where, params = _filters(filters, {"workspace_id": "workspace_id", "style": "style"})
    return _page(conn, "SELECT * FROM workflows", "SELECT COUNT(*) FROM workflows", where,
                 params, "rowid", limit, offset, lambda row: _workflow_from_row(conn, row))


# -- tasks ---------------------------------------------------------------------------

def get_task(conn: sqlite3.Connection, task_id: str) -> TaskRecord | None:
    row = conn.execute(TASK_SELECT + " WHERE t.id = ?", (task_id,)).fetchone()
    return task_from_row(row) if row is not None else None


def insert_task(conn: sqlite3.Connection, task: Mapping[str, Any]) -> None:
    conn.execute(f"INSERT INTO tasks ({', '.join(TASK_COLUMNS)})"
                 f" VALUES ({', '.join(':' + c for c in TASK_COLUMNS)})", dict(task))


def update_task(conn: sqlite3.Connection, task_id: str, fields: Mapping[str, Any]) -> None:
    _update(conn, "tasks", task_id, fields)


def list_tasks(conn: sqlite3.Connection, *, limit: int, offset: int,
               **filters: Any) -> RecordPage[TaskRecord]:
    where, params = _filters(filters, {
        "workspace_id": "t.workspace_id", "workflow_id": "t.workflow_id",
        "step_id": "t.step_id", "state": "t.state", "project_id": "t.project_id"})
    if filters.get("runner") is not None:
        where.append(f"{RUNNER_SQL} = ?")
        params.append(filters["runner"])
    count = ("SELECT COUNT(*) FROM tasks t LEFT JOIN workflow_steps s"
             " ON s.workflow_id = t.workflow_id AND s.id = t.step_id")
    return _page(conn, TASK_SELECT, count, where, params, "t.rowid", limit, offset,
                 task_from_row)


# -- checks and step entries ---------------------------------------------------------

def id_taken(conn: sqlite3.Connection, table: str, ident: str) -> bool:
    """Is ``ident`` an id in ``table`` (one of the model's own tables) already?"""
    if table not in ("workspaces", "agents", "workflows", "tasks"):
        raise ValueError(f"not a table of the workspace model: {table!r}")
    return conn.execute(f"SELECT 1 FROM {table} WHERE id = ?", (ident,)).fetchone() is not None


def first_step_id(conn: sqlite3.Connection, workflow_id: str) -> str | None:
    """The id of ``workflow_id``'s first step, or None for a workflow without steps."""
    row = conn.execute("SELECT id FROM workflow_steps WHERE workflow_id = ?"
                       " ORDER BY position LIMIT 1", (workflow_id,)).fetchone()
    return row["id"] if row is not None else None


def enter_step(conn: sqlite3.Connection, task_id: str, *, new_entry: bool) -> int:
    """The task's step entry counter, counted up first when it entered a different step."""
    if new_entry:
        conn.execute("UPDATE tasks SET step_entry = step_entry + 1 WHERE id = ?", (task_id,))
    return int(conn.execute("SELECT step_entry FROM tasks WHERE id = ?",
                            (task_id,)).fetchone()[0])
