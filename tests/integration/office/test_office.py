"""Office over a real daemon: gating proven by the SQL trace, the Kanban/Office split,
exactly-one assignment runs across ticks and restarts, budgets pausing an agent, a
real-time routine fire, office.enabled false, and a shutdown that waits for a handler
blocked inside database work.
"""

from __future__ import annotations

import re
import signal
import sqlite3
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from kandevd.control.client import RpcCallError
from kandevd.store.open import open_store
from kandevd.timeutil import rfc3339, utc_now
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.integration

INTERVAL_S = 0.3
CONFIG: dict[str, Any] = {
    "queue": {"safety_interval_s": 60},     # runs move on the in-process signal only
    "runtime": {"max_concurrent": 4, "stop_grace_s": 2},
    "office": {"interval_s": INTERVAL_S},
}
WAIT_S = 20.0
OFFICE_SCAN = re.compile(r"\b(tasks|office_routines|office_budget_policies)\b")

Factory = Callable[..., DaemonProcess]


def office_stats(daemon: DaemonProcess) -> dict[str, int]:
    return daemon.call("daemon.status")["stats"]["office"]


def wait_ticks(daemon: DaemonProcess, count: int) -> dict[str, int]:
    """Block until the Office loop has ticked ``count`` more times."""
    start = office_stats(daemon)["ticks"]
    return daemon.wait_until(
        lambda: (lambda s: s if s["ticks"] >= start + count else None)(office_stats(daemon)),
        timeout=WAIT_S, what=f"{count} more Office ticks")


def runs(daemon: DaemonProcess, **filters: Any) -> list[dict[str, Any]]:
    return daemon.call("runs.list", {"limit": 500, **filters})["items"]


def wait_run(daemon: DaemonProcess, status: str, **filters: Any) -> dict[str, Any]:
    return daemon.wait_until(
        lambda: next((r for r in runs(daemon, **filters) if r["status"] == status), None),
        timeout=WAIT_S, what=f"a {status} run with {filters}")


def seed(daemon: DaemonProcess, *, office: bool = True) -> None:
    """ws1, agents a1 a2; workflows ``office`` (ws1's Office workflow when ``office``) and
    ``board`` (kanban), each: todo (runner a1) -> doing (runner a2), no on_enter actions."""
    daemon.call("workspaces.create", {"id": "ws1", "name": "One"})
    for agent in ("a1", "a2"):
        daemon.call("agents.create", {"id": agent, "workspace_id": "ws1", "name": agent})
    for workflow, style in (("office", "office"), ("board", "kanban")):
        daemon.call("workflows.create", {
            "id": workflow, "workspace_id": "ws1", "name": workflow, "style": style,
            "steps": [{"id": "todo", "name": "To do", "agent_id": "a1"},
                      {"id": "doing", "name": "Doing", "agent_id": "a2"}]})
    if office:
        daemon.call("workspaces.update", {"id": "ws1", "office_workflow_id": "office"})


def test_idle_office_scans_nothing(daemon_factory: Factory, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    open_store(home / "kandevd.db").close()   # migrate first: the trace shows only runtime SQL
    trace = tmp_path / "trace.sql"
    daemon = daemon_factory(CONFIG, home=home, env={"KANDEVD_TRACE_SQL": str(trace)})
    stats = wait_ticks(daemon, 6)             # ~2 s of Office ticks with nothing configured
    assert stats["recovery_scans"] == stats["routine_scans"] == stats["budget_scans"] == 0
    assert stats["recovered"] == stats["routine_fires"] == stats["budget_alerts"] == 0
    assert daemon.call("daemon.status")["loops"]["office"] == "running"
    assert daemon.stop() == 0
    statements = trace.read_text().splitlines()
    # Retention's probe (a bounded index range; budgets only for rows it would delete)
    # names the budget table but is the queue's, not the Office's.
    office = [s for s in statements if OFFICE_SCAN.search(s)
              and not s.startswith("/* retention */")]
    probes = [s for s in office if s.startswith("/* office:probe */")]
    assert len(probes) >= 2 * 6               # routines + budgets probe on every tick
    assert office == probes, [s for s in office if s not in probes][:5]
    assert not [s for s in statements if "-scan */" in s]
    with sqlite3.connect(home / "kandevd.db") as conn:
        assert conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0


def test_kanban_task_with_a_step_runner_gets_no_task_assigned_run(daemon_factory: Factory
                                                                  ) -> None:
    daemon = daemon_factory(CONFIG)
    seed(daemon)                              # Office is adopted: recovery really scans
    daemon.call("tasks.create", {"id": "k1", "workspace_id": "ws1", "workflow_id": "board",
                                 "title": "Kanban"})
    assert daemon.call("tasks.get", {"id": "k1"})["runner"] == "a1"
    daemon.call("tasks.update", {"id": "k1", "runner_agent_id": "a2"})
    daemon.call("tasks.move", {"id": "k1", "step_id": "doing"})
    daemon.call("tasks.move", {"id": "k1", "step_id": "todo"})
    stats = wait_ticks(daemon, 5)
    assert stats["recovery_scans"] >= 5
    assert runs(daemon) == []
    assert daemon.count_lines("k1 assigned") == 0


def test_office_task_gets_exactly_one_run_across_ticks_and_restarts(
        daemon_factory: Factory) -> None:
    daemon = daemon_factory(CONFIG)
    seed(daemon)
    daemon.call("tasks.create", {"id": "t1", "workspace_id": "ws1", "workflow_id": "office",
                                 "title": "Office work"})
    first = wait_run(daemon, "finished", task_id="t1")   # the subscriber queued it
    assert (first["reason"], first["agent_id"], first["idempotency_key"]) == (
        "task_assigned", "a1", "task_assigned:t1:a1")
    assert first["payload"] == {"task_id": "t1"}
    daemon.wait_for_line("task t1 assigned to a1: task_assigned run")
    assert wait_ticks(daemon, 4)["recovered"] == 0
    assert daemon.stop() == 0

    # A task the subscriber never saw (written while the daemon was down): recovery.
    now = rfc3339(utc_now())
    with daemon.db() as conn:
        conn.execute("INSERT INTO tasks (id, workspace_id, workflow_id, step_id, title,"
                     " project_id, state, created_at, updated_at) VALUES"
                     " ('t2', 'ws1', 'office', 'doing', 'missed', '', 'TODO', ?, ?)", (now, now))
    daemon.start()
    second = wait_run(daemon, "finished", task_id="t2")
    assert (second["reason"], second["agent_id"], second["idempotency_key"]) == (
        "task_assigned", "a2", "task_assigned:t2:a2")
    daemon.wait_for_line("recovered unstarted Office task t2")
    stats = wait_ticks(daemon, 4)
    assert stats["recovered"] == 1
    assert daemon.stop() == 0

    daemon.start()
    assert wait_ticks(daemon, 4)["recovered"] == 0
    assert [r["id"] for r in runs(daemon, task_id="t1")] == [first["id"]]
    assert [r["id"] for r in runs(daemon, task_id="t2")] == [second["id"]]
    assert len(runs(daemon, reason="task_assigned")) == 2


def test_budget_pause_agent(daemon_factory: Factory) -> None:
    daemon = daemon_factory(CONFIG)
    seed(daemon, office=False)
    daemon.call("office.budgets.create", {
        "id": "b1", "workspace_id": "ws1", "scope_type": "agent", "scope_id": "a1",
        "limit_cents": 100, "period": "monthly", "action_on_exceed": "pause_agent"})
    spent = daemon.call("runs.enqueue", {"workspace_id": "ws1", "agent_id": "a1",
                                         "reason": "work", "payload": {"cost_cents": 150}})
    run = wait_run(daemon, "finished", reason="work")
    assert run["id"] == spent["run"]["id"] and run["cost_cents"] == 150
    daemon.wait_until(lambda: daemon.call("agents.get", {"id": "a1"})["status"] == "paused",
                      timeout=WAIT_S, what="a1 paused by its budget")
    daemon.wait_for_line("budget b1: agent a1 spent 150.00 of 100.00 cents")
    daemon.wait_for_line("paused agent(s) a1")  # logged once the pause has committed

    later = daemon.call("runs.enqueue", {"workspace_id": "ws1", "agent_id": "a1",
                                         "reason": "later", "payload": {}})["run"]
    other = daemon.call("runs.enqueue", {"workspace_id": "ws1", "agent_id": "a2",
                                         "reason": "other", "payload": {}})["run"]
    wait_run(daemon, "finished", reason="other")          # the queue keeps working
    stats = wait_ticks(daemon, 3)
    assert stats["budget_alerts"] == 2                    # 80 % and 100 %, once each
    assert daemon.call("runs.get", {"id": later["id"]})["status"] == "queued"
    explained = daemon.call("runs.explain", {"id": later["id"]})
    assert not explained["eligible"] and "agent_paused" in explained["blockers"]
    assert other["id"] != later["id"]

    # Resuming the agent lifts the pause, not the budget: the hard limit is also
    # checked when runs are claimed, so the spent agent's run stays queued.
    daemon.call("agents.update", {"id": "a1", "status": "active"})
    another = daemon.call("runs.enqueue", {"workspace_id": "ws1", "agent_id": "a2",
                                           "reason": "another", "payload": {}})["run"]
    wait_run(daemon, "finished", reason="another")       # a pass that skipped a1's run
    explained = daemon.call("runs.explain", {"id": later["id"]})
    assert "budget_exceeded" in explained["blockers"]
    assert "agent_paused" not in explained["blockers"]
    assert explained["details"]["budget_exceeded"] == "b1"
    wait_ticks(daemon, 3)                                 # the resume is not overruled
    assert daemon.call("agents.get", {"id": "a1"})["status"] == "active"
    assert daemon.count_lines("budget b1: ") == 2
    assert daemon.call("runs.get", {"id": later["id"]})["status"] == "queued"
    assert another["id"] != later["id"]


def test_routine_fires_in_real_time(daemon_factory: Factory) -> None:
    daemon = daemon_factory(CONFIG)
    seed(daemon, office=False)
    routine = daemon.call("office.routines.create", {
        "id": "r1", "workspace_id": "ws1", "agent_id": "a1", "name": "every minute",
        "cron_expression": "* * * * *", "payload": {"summary": "routine ran"},
        # a minute boundary between the UPDATE below and the tick must not drop `due`
        "concurrency_policy": "always_create", "catch_up_policy": "enqueue_missed_with_cap"})
    assert routine["next_run_at"] > rfc3339(utc_now())
    due = utc_now().replace(second=0, microsecond=0)      # make it due now, as after a wait
    with daemon.db() as conn:
        conn.execute("UPDATE office_routines SET next_run_at = ? WHERE id = 'r1'",
                     (rfc3339(due),))
    run = wait_run(daemon, "finished", reason="routine_trigger")
    assert run["payload"] == {"summary": "routine ran", "routine_id": "r1",
                              "scheduled_for": rfc3339(due)}
    assert run["idempotency_key"] == f"routine:r1:{int(due.timestamp()) // 60}"
    assert run["output_summary"] == "routine ran"
    listed = daemon.call("office.routines.list", {})["items"][0]
    assert listed["last_run_at"] >= rfc3339(due)
    assert listed["next_run_at"] in (rfc3339(due + timedelta(minutes=1)),
                                     rfc3339(due + timedelta(minutes=2)))
    wait_ticks(daemon, 3)
    fires = [r["payload"]["scheduled_for"] for r in runs(daemon, reason="routine_trigger")]
    # once per minute: the due time, then (if a minute boundary passed) the next minute
    assert fires == [rfc3339(due + timedelta(minutes=m)) for m in range(len(fires))]
    assert 1 <= len(fires) <= 2


def test_routine_with_a_bad_schedule_is_invalid_params(daemon_factory: Factory) -> None:
    daemon = daemon_factory(CONFIG)
    seed(daemon, office=False)
    base = {"workspace_id": "ws1", "agent_id": "a1", "name": "r"}
    for params, message in [
        ({"cron_expression": "*/5 * * *"}, "cron_expression: '*/5 * * *' is not a valid"
                                           " 5-field cron expression"),
        ({"cron_expression": "* * * * *", "timezone": "Moon/Base"},
         "timezone: unknown time zone 'Moon/Base'"),
        ({"cron_expression": "* * * * *", "agent_id": "ghost"},
         "agent_id: agent 'ghost' does not exist"),
    ]:
        with pytest.raises(RpcCallError) as caught:
            daemon.call("office.routines.create", {**base, **params})
        assert caught.value.code == -32602 and caught.value.kind == "invalid_params"
        assert str(caught.value).startswith(message)
    assert daemon.call("office.routines.list", {})["total"] == 0


def test_office_disabled_means_no_subscribers_and_no_loop(daemon_factory: Factory) -> None:
    daemon = daemon_factory({**CONFIG, "office": {"enabled": False, "interval_s": INTERVAL_S}})
    status = daemon.call("daemon.status")
    assert status["loops"]["office"] == "stopped" and "office" not in status.get("stats", {})
    seed(daemon)
    daemon.call("tasks.create", {"id": "t1", "workspace_id": "ws1", "workflow_id": "office",
                                 "title": "Office work"})
    queued = daemon.call("runs.enqueue", {"workspace_id": "ws1", "agent_id": "a1",
                                          "reason": "work", "payload": {}})["run"]
    assert wait_run(daemon, "finished", reason="work")["id"] == queued["id"]
    assert runs(daemon, task_id="t1") == []
    assert daemon.count_lines("kandevd.office") == 0


def test_shutdown_waits_for_an_office_handler_blocked_in_the_database(
        daemon_factory: Factory) -> None:
    daemon = daemon_factory(CONFIG)
    seed(daemon, office=False)
    daemon.call("office.routines.create", {
        "id": "r1", "workspace_id": "ws1", "agent_id": "a1", "name": "blocked",
        "cron_expression": "* * * * *"})
    holder = sqlite3.connect(daemon.home / "kandevd.db", timeout=10, isolation_level=None)
    try:
        soon = utc_now() + timedelta(seconds=1)
        holder.execute("UPDATE office_routines SET next_run_at = ?", (rfc3339(soon),))
        holder.execute("BEGIN IMMEDIATE")       # hold the write lock before the routine is due
        mark = daemon.mark()
        daemon.wait_for_line("routine r1 is due", after=mark)   # it now waits for the lock
        daemon.send_signal(signal.SIGTERM)
        daemon.wait_for_line("Graceful shutdown started", after=mark)
        with pytest.raises(AssertionError, match="timed out"):
            daemon.wait_for_line("Graceful shutdown complete", timeout=1.0, after=mark)
        assert daemon.proc is not None and daemon.proc.poll() is None
        assert daemon.count_lines("routine r1 fired") == 0
    finally:
        holder.execute("ROLLBACK")              # release: the handler finishes its work
        holder.close()
    assert daemon.wait() == 0
    lines = daemon.lines
    assert lines[-1].endswith("Graceful shutdown complete")
    fired = next(i for i, line in enumerate(lines) if "routine r1 fired" in line)
    started = next(i for i, line in enumerate(lines) if "Graceful shutdown started" in line)
    assert started < fired < len(lines) - 1
    assert "database is closed" not in daemon.log_text
    assert "StoreClosedError" not in daemon.log_text
    with daemon.db() as conn:                   # the handler's work was committed
        (count,) = conn.execute("SELECT COUNT(*) FROM runs WHERE reason = 'routine_trigger'"
                                " AND status = 'queued'").fetchone()
    assert count == 1
