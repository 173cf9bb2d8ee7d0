"""Runs written straight into a store: workspaces and agents by SQL, runs by the repository."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from typing import Any

from kandevd.config import RetryConfig
from kandevd.store.runs import RunRepository
from kandevd.store.sqlite import Store
from kandevd.timeutil import rfc3339

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


POLICY = RetryConfig(max_retries=2, delays_s=(10.0, 60.0), jitter=0.25, max_age_s=3600.0)


def seed(store: Store, workspace: str, *agents: str, cooldown_s: float = 0.0,
         status: str = "active") -> None:
    """Create a workspace and its agents with plain SQL (the model's methods are not needed)."""
    now = rfc3339(T0)
    with store.transaction() as conn:
        conn.execute("INSERT INTO workspaces (id, name, office_workflow_id, created_at,"
                     " updated_at) VALUES (?, ?, '', ?, ?) ON CONFLICT DO NOTHING",
                     (workspace, workspace, now, now))
        for agent in agents:
            conn.execute("INSERT INTO agents (id, workspace_id, name, profile, cooldown_s,"
                         " status, created_at, updated_at) VALUES (?, ?, ?, 'default', ?, ?, ?, ?)",
                         (agent, workspace, agent, cooldown_s, status, now, now))


def add_task(store: Store, workspace: str, task: str) -> None:
    """A task of ``workspace`` (in a workflow of its own), unless there is one: a run may
    name only a task that exists."""
    now = rfc3339(T0)
    with store.transaction() as conn:
        conn.execute("INSERT INTO workflows (id, workspace_id, name, style, created_at)"
                     " VALUES (?, ?, 'tasks', 'office', ?) ON CONFLICT DO NOTHING",
                     (f"wf-{workspace}", workspace, now))
        conn.execute("INSERT INTO tasks (id, workspace_id, workflow_id, title, created_at,"
                     " updated_at) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                     (task, workspace, f"wf-{workspace}", task, now, now))


def set_agent(store: Store, agent: str, **fields: Any) -> None:
    sets = ", ".join(f"{name} = ?" for name in fields)
    store.execute(f"UPDATE agents SET {sets} WHERE id = ?", [*fields.values(), agent])


def row(store: Store, run_id: str) -> sqlite3.Row:
    found = store.query_one("SELECT * FROM runs WHERE id = ?", (run_id,))
    assert found is not None
    return found


def count_runs(store: Store) -> int:
    return store.query_one("SELECT COUNT(*) FROM runs")[0]


def enqueue(repo: RunRepository, agent: str = "a1", *, at: datetime = T0,
            workspace: str | None = None, reason: str = "manual", **kwargs: Any) -> dict[str, Any]:
    """Enqueue without coalescing unless asked: most tests want one row per call."""
    kwargs.setdefault("coalesce", False)
    ws = workspace or ("ws2" if agent.startswith("b") else "ws1")
    if kwargs.get("task_id") is not None:
        add_task(repo.store, ws, kwargs["task_id"])
    return repo.enqueue(workspace_id=ws, agent_id=agent, reason=reason, now=at, **kwargs).run
