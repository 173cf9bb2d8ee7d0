"""Shared set-up of the Office unit tests: a real store, queue and model on a test clock.

Everything is real (SQLite file, RunQueue, RunRepository, WorkspaceService,
EventBus); only time is injected, so the tests drive Office handlers through
``tick(now)`` deterministically. No queue loop runs: what Office queues stays
queued until a test claims and finishes it with :meth:`OfficeEnv.finish_next`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kandevd.bus import EventBus
from kandevd.config import build_config
from kandevd.model import WorkspaceService
from kandevd.office.routines import first_next_run_at
from kandevd.paths import HomeLayout
from kandevd.runqueue.service import RunQueue
from kandevd.runtime import AgentRuntime, InProcessRunner
from kandevd.store.open import open_store
from kandevd.store.runs import RunRepository
from kandevd.store.sqlite import Store
from kandevd.timeutil import rfc3339

T0 = datetime(2026, 3, 10, 12, 0, 0, 250000, tzinfo=UTC)


class Clock:
    """The injected clock: ``clock()`` is now; tests move it explicitly."""

    def __init__(self, start: datetime = T0) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> datetime:
        self.now += timedelta(**delta)
        return self.now

    def set(self, moment: datetime) -> datetime:
        self.now = moment
        return self.now


def _noop_agent(_spec: Any) -> tuple[int, str | None, float | None]:
    return 0, "noop", 0.0


class OfficeEnv:
    def __init__(self, tmp_path: Path, clock: Clock | None = None,
                 location: str | None = None) -> None:
        self.clock = clock or Clock()
        self.config = build_config({}, environ={})
        self.layout = HomeLayout(tmp_path / "home")
        self.store: Store = open_store(location or tmp_path / "kandevd.db")
        self.bus = EventBus()
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.bus.subscribe("*", lambda topic, payload: self.events.append((topic, payload)))
        self.runtime = AgentRuntime(2, 1.0, runner=InProcessRunner(_noop_agent))
        self.repo = RunRepository(self.store, "boot")
        self.queue = RunQueue(self.repo, self.runtime, self.config, self.layout, self.bus,
                              clock=self.clock)
        self.model = WorkspaceService(self.store, self.bus, self.queue, self.runtime,
                                      self.config, self.layout, clock=self.clock)

    def close(self) -> None:
        self.runtime.stop()
        self.store.close()

    # -- seeding -----------------------------------------------------------------------
    def seed(self) -> None:
        """ws1 with agents a1, a2 and three one-step workflows whose step runner is a1:
        ``office`` (style office, set as ws1's office workflow), ``kanban`` and ``custom``."""
        m = self.model
        m.create_workspace({"id": "ws1", "name": "One"})
        for agent in ("a1", "a2"):
            m.create_agent({"id": agent, "workspace_id": "ws1", "name": agent})
        for style in ("office", "kanban", "custom"):
            m.create_workflow({"id": style, "workspace_id": "ws1", "name": style, "style": style,
                               "steps": [{"id": "todo", "name": "To do", "agent_id": "a1"},
                                         {"id": "free", "name": "Unassigned"}]})
        m.update_workspace({"id": "ws1", "office_workflow_id": "office"})

    def insert_task(self, task_id: str, workflow_id: str, *, step_id: str | None = "todo",
                    project_id: str = "", state: str = "TODO", runner: str | None = None,
                    created_at: datetime | None = None, workspace_id: str = "ws1") -> None:
        """A task row written straight to SQLite: no event, as if a subscriber missed it."""
        stamp = rfc3339(created_at or self.clock())
        self.store.execute(
            "INSERT INTO tasks (id, workspace_id, workflow_id, step_id, title, project_id, state,"
            " runner_agent_id, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (task_id, workspace_id, workflow_id, step_id, task_id, project_id, state, runner,
             stamp, stamp))

    def insert_project(self, project_id: str = "p1", workspace_id: str = "ws1") -> None:
        self.store.execute("INSERT INTO office_projects (id, workspace_id, name, created_at)"
                           " VALUES (?, ?, ?, ?)",
                           (project_id, workspace_id, project_id, rfc3339(self.clock())))

    def insert_routine(self, routine_id: str = "r1", *, cron: str = "* * * * *",
                       timezone: str = "UTC", agent_id: str = "a1",
                       concurrency: str = "always_create", catch_up: str = "skip_missed",
                       catch_up_max: int = 25, payload: dict[str, Any] | None = None,
                       status: str = "active") -> str:
        """A routine row as ``office.routines.create`` makes it (next fire after now)."""
        now = rfc3339(self.clock())
        next_run_at = first_next_run_at(cron, timezone, self.clock())
        self.store.execute(
            "INSERT INTO office_routines (id, workspace_id, agent_id, name, cron_expression,"
            " timezone, payload, status, concurrency_policy, catch_up_policy, catch_up_max,"
            " next_run_at, created_at, updated_at)"
            " VALUES (?, 'ws1', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (routine_id, agent_id, routine_id, cron, timezone, json.dumps(payload or {}),
             status, concurrency, catch_up, catch_up_max, next_run_at, now, now))
        assert next_run_at is not None
        return next_run_at

    def insert_budget(self, policy_id: str = "b1", *, scope_type: str = "agent",
                      scope_id: str = "a1", limit_cents: float = 100.0,
                      period: str = "monthly", alert_pct: float = 80.0,
                      action: str = "notify_only") -> None:
        self.store.execute(
            "INSERT INTO office_budget_policies (id, workspace_id, scope_type, scope_id,"
            " limit_cents, period, alert_threshold_pct, action_on_exceed, created_at)"
            " VALUES (?, 'ws1', ?, ?, ?, ?, ?, ?, ?)",
            (policy_id, scope_type, scope_id, limit_cents, period, alert_pct, action,
             rfc3339(self.clock())))

    # -- runs --------------------------------------------------------------------------
    def runs(self, **filters: Any) -> list[dict[str, Any]]:
        return self.repo.list(limit=500, **filters).items

    def set_status(self, run_id: str, status: str) -> None:
        """End a run the way the queue would record it (failed / cancelled / finished)."""
        self.store.execute("UPDATE runs SET status = ?, finished_at = ?"
                           " WHERE id = ?", (status, rfc3339(self.clock()), run_id))

    def spend(self, agent_id: str, cost_cents: float) -> dict[str, Any]:
        """Queue a run for ``agent_id`` and finish it through the repository with a cost."""
        queued = self.queue.enqueue(workspace_id="ws1", agent_id=agent_id, reason="work",
                                    payload={"n": uuid.uuid4().hex}, coalesce=False)
        claim = self.repo.claim_next(self.clock())
        assert claim is not None and claim.run.id == queued.run.id
        assert self.repo.finish(claim.run.id, claim.token, now=self.clock(), summary="ok",
                                cost_cents=cost_cents, log_path=None)
        return self.repo.get(claim.run.id)

    def topics(self, topic: str) -> list[dict[str, Any]]:
        return [payload for name, payload in self.events if name == topic]

    def statements_during(self, action: Any) -> int:
        """How many SQL statements ``action()`` executed on the store (its trace counter)."""
        before = self.store.statements
        action()
        return self.store.statements - before


@contextmanager
def seeded_env(tmp_path: Path, clock: Clock | None = None,
               location: str | None = None) -> Iterator[OfficeEnv]:
    """An OfficeEnv with the standard seed, closed afterwards (each test file's fixture).

    ``location``: the store (a SQLite path or a PostgreSQL URL; default a
    SQLite file in ``tmp_path``).
    """
    made = OfficeEnv(tmp_path, clock or Clock(), location)
    made.seed()
    try:
        yield made
    finally:
        made.close()
