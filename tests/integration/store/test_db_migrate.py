"""``kandevd db migrate --to URL``: a SQLite home's database copied into an empty PostgreSQL one.

The home is populated by the real daemon (through its socket), then stopped;
the real ``kandevd db migrate`` copies it. What PostgreSQL then holds is read
back through ``open_store(url)`` and compared with the source, row for row and
through the model's own list functions; runs keep their ``seq`` and a run
enqueued afterwards numbers past them. Refused: while a daemon holds the home,
into a target that already holds data, a URL that is not PostgreSQL's (the
password never shown), without psycopg (78). A failure or a count that
differs rolls the copy back.
"""

from __future__ import annotations

import os
import pty
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from kandevd.app.homelock import HomeLock, read_pid
from kandevd.cli import cli
from kandevd.net.urls import redact_url
from kandevd.store import copy
from kandevd.store import workspace as repository
from kandevd.store.base import BaseStore
from kandevd.store.open import open_store
from kandevd.store.runs import RunRepository
from kandevd.timeutil import utc_now
from tests.support.daemon import FAST_CONFIG, DaemonProcess, run_cli

pytestmark = pytest.mark.integration

Factory = Callable[..., DaemonProcess]

CONFIG: dict[str, Any] = {**FAST_CONFIG, "office": {"interval_s": 0.3}}
QUEUED = 1500  # more than one batch of BATCH_ROWS
#: Tables whose PostgreSQL rowid identity must give SQLite's order; runs are ordered by seq.
ORDERED = ("workspaces", "agents", "workflows", "tasks")


def sqlite_rows(path: Path, table: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as conn:
        columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
        order = "seq" if table == "runs" else ("rowid" if table in ORDERED else "1")
        return [tuple(row) for row in conn.execute(
            f"SELECT {', '.join(columns)} FROM {table} ORDER BY {order}")]


def pg_rows(store: BaseStore, path: Path, table: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as conn:
        columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
    order = "seq" if table == "runs" else ("rowid" if table in ORDERED else "1")
    return [tuple(row) for row in store.query(
        "SELECT " + ", ".join(f'"{c}"' for c in columns) + f" FROM {table} ORDER BY {order}")]


def pg_tables(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        return {row[0] for row in conn.execute(
            "SELECT table_name FROM information_schema.tables"
            " WHERE table_schema = current_schema()")}


def assert_target_empty(url: str) -> None:
    store = open_store(url)
    try:
        held = {t: store.query_one(f"SELECT COUNT(*) FROM {t}")[0] for t in copy.TABLES}
    finally:
        store.close()
    assert not any(held.values()), held


def assert_lock_free(home: Path) -> None:
    lock = HomeLock(home / "kandevd.lock")
    lock.acquire()  # raises HomeLocked if the command kept it
    lock.release()


def model_lists(conn: Any) -> dict[str, Any]:
    return {
        "workspaces": repository.list_workspaces(conn, limit=500, offset=0),
        "agents": repository.list_agents(conn, limit=500, offset=0),
        "workflows": repository.list_workflows(conn, limit=500, offset=0),
        "tasks": repository.list_tasks(conn, limit=500, offset=0),
    }


def populate(daemon: DaemonProcess) -> None:
    """Two workspaces (created out of id order), agents, a workflow with steps, tasks,
    a project, a routine, a budget that alerts, finished, cancelled and 1,500 queued runs,
    idempotency keys."""
    call = daemon.call
    call("workspaces.create", {"id": "zeta", "name": "Zeta"})
    call("workspaces.create", {"id": "alpha", "name": "Alpha"})
    call("agents.create", {"id": "worker", "workspace_id": "zeta", "name": "worker",
                           "cooldown_s": 0.5})
    call("agents.create", {"id": "idle", "workspace_id": "zeta", "name": "idle",
                           "status": "paused"})
    call("agents.create", {"id": "helper", "workspace_id": "alpha", "name": "helper",
                           "status": "paused"})
    call("workflows.create", {
        "id": "board", "workspace_id": "zeta", "name": "Board", "style": "kanban",
        "steps": [{"id": "todo", "name": "To do"},
                  {"id": "doing", "name": "Doing", "agent_id": "idle",
                   "on_enter": [{"action": "queue_run"}]}]})
    call("office.projects.create", {"id": "p1", "workspace_id": "zeta", "name": "Launch"})
    call("runners.add", {"name": "laptop", "labels": ["gpu"]})
    call("tasks.create", {"id": "t2", "workspace_id": "zeta", "workflow_id": "board",
                          "title": "second", "step_id": "todo", "project_id": "p1"})
    call("tasks.create", {"id": "t1", "workspace_id": "zeta", "workflow_id": "board",
                          "title": "first", "step_id": "todo"})
    call("tasks.move", {"id": "t2", "step_id": "doing"})  # a queued run with its key
    call("office.routines.create", {"id": "r1", "workspace_id": "zeta", "agent_id": "idle",
                                    "name": "yearly", "cron_expression": "0 0 1 1 *"})
    call("office.budgets.create", {"id": "b1", "workspace_id": "zeta", "scope_type": "agent",
                                   "scope_id": "worker", "limit_cents": 100,
                                   "period": "monthly"})
    spent = call("runs.enqueue", {"workspace_id": "zeta", "agent_id": "worker",
                                  "reason": "work", "payload": {"cost_cents": 150}})["run"]
    for half in range(2):
        call("runs.enqueue_many", {"runs": [
            {"workspace_id": "zeta", "agent_id": "idle", "reason": f"bulk{half}-{i}",
             "coalesce": False, "payload": {"i": i},
             **({"idempotency_key": f"k{half}-{i}"} if i % 7 == 0 else {})}
            for i in range(QUEUED // 2)]})
    doomed = call("runs.enqueue", {"workspace_id": "alpha", "agent_id": "helper",
                                   "reason": "doomed"})["run"]
    call("runs.cancel", {"id": doomed["id"], "reason": "not needed"})
    daemon.wait_until(lambda: call("runs.get", {"id": spent["id"]})["status"] == "finished",
                      what="the costly run finished")
    with daemon.db() as conn:
        daemon.wait_until(
            lambda: conn.execute("SELECT COUNT(*) FROM office_budget_alerts").fetchone()[0],
            what="the budget alert")


def test_a_populated_home_is_copied_and_verified(daemon_factory: Factory, pg_url: str) -> None:
    daemon = daemon_factory(CONFIG)
    populate(daemon)
    listed = {name: daemon.call(f"{name}.list", {"limit": 500})
              for name in ("workspaces", "agents", "workflows", "tasks")}
    first_runs = daemon.call("runs.list", {"limit": 500})
    assert daemon.stop() == 0
    source = daemon.home / "kandevd.db"
    with sqlite3.connect(source) as conn:  # (as a cancel writes it while a runner holds
        # the run: no runner runs here)
        conn.execute("INSERT INTO runner_stops (token, runner, run_id, agent_id, since)"
                     " VALUES ('b1.9', 'laptop', ?, 'helper', '2026-01-01T00:00:00Z')",
                     (first_runs["items"][0]["id"],))
    expected = {table: sqlite_rows(source, table) for table in copy.TABLES}
    assert all(expected[t] for t in copy.TABLES), {t: len(r) for t, r in expected.items()}
    assert [row[0] for row in expected["workspaces"]] == ["zeta", "alpha"]

    result = run_cli(daemon.home, "db", "migrate", "--to", pg_url, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""  # no progress bar off a terminal
    lines = result.stdout.splitlines()
    assert lines[:-1] == [f"{t}: {len(expected[t])} rows" for t in copy.TABLES]
    total = sum(len(rows) for rows in expected.values())
    assert lines[-1] == (f"verified: {len(copy.TABLES)} tables, {total} rows copied from "
                         f"{source} to {redact_url(pg_url)}")
    assert_lock_free(daemon.home)

    store = open_store(pg_url)
    try:
        for table in copy.TABLES:
            got = pg_rows(store, source, table)
            if table in ORDERED or table == "runs":
                assert got == expected[table], table
            else:
                assert sorted(got, key=repr) == sorted(expected[table], key=repr), table
        with store.connection() as conn:
            assert model_lists(conn) == listed  # the lists read as the daemon answered them
        runs = RunRepository(store, "migrated")
        page = runs.list(limit=500)
        assert page.to_dict() == first_runs
        with sqlite3.connect(source) as conn:
            by_status = dict(conn.execute("SELECT status, COUNT(*) FROM runs GROUP BY status"))
        assert by_status["queued"] > QUEUED and by_status["finished"] == 1
        assert {k: n for k, n in runs.count_by_status().items() if n} == by_status
        top = max(row[0] for row in expected["runs"])
        added = runs.enqueue(workspace_id="alpha", agent_id="helper", reason="after",
                             now=utc_now(), coalesce=False)
        assert added.inserted and added.run.seq == top + 1
        assert runs.get(added.run.id).seq == top + 1
    finally:
        store.close()

    again = run_cli(daemon.home, "db", "migrate", "--to", pg_url)
    assert again.returncode == 1 and "is not empty" in again.stderr, again.stderr
    assert again.stdout == ""


def test_refused_while_the_daemon_holds_the_home(daemon_factory: Factory, pg_url: str) -> None:
    daemon = daemon_factory(CONFIG)
    daemon.call("workspaces.create", {"id": "ws", "name": "ws"})
    result = run_cli(daemon.home, "db", "migrate", "--to", pg_url)
    assert result.returncode == 75, result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert "home is in use" in line and f"pid {daemon.proc.pid}" in line, line
    assert result.stdout == ""
    assert_target_empty(pg_url)
    assert read_pid(daemon.home / "kandevd.lock") == daemon.proc.pid
    assert daemon.call("workspaces.get", {"id": "ws"})["name"] == "ws"  # still serving
    assert daemon.stop() == 0


@pytest.fixture
def small_home(tmp_path: Path) -> Path:
    """A home whose database has a workspace, an agent and five runs (no daemon needed)."""
    home = tmp_path / "small"
    home.mkdir(mode=0o700)
    store = open_store(home / "kandevd.db")
    with store.transaction() as conn:
        conn.execute("INSERT INTO workspaces (id, name, created_at, updated_at)"
                     " VALUES ('ws', 'ws', 'x', 'x')")
        conn.execute("INSERT INTO agents (id, workspace_id, name, created_at, updated_at)"
                     " VALUES ('a1', 'ws', 'a1', 'x', 'x')")
    runs = RunRepository(store, "seed")
    for i in range(5):
        runs.enqueue(workspace_id="ws", agent_id="a1", reason=f"r{i}", now=utc_now())
    store.close()
    return home


def test_refused_into_a_target_that_holds_data(small_home: Path, pg_url: str) -> None:
    target = open_store(pg_url)
    with target.transaction() as conn:
        conn.execute("INSERT INTO workspaces (id, name, created_at, updated_at)"
                     " VALUES ('other', 'other', 'y', 'y')")
    target.close()
    result = run_cli(small_home, "db", "migrate", "--to", pg_url)
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert "is not empty (it already holds workspaces)" in line and "nothing was written" in line
    target = open_store(pg_url)
    try:
        assert [r[0] for r in target.query("SELECT id FROM workspaces")] == ["other"]
        assert target.query_one("SELECT COUNT(*) FROM runs")[0] == 0
    finally:
        target.close()
    assert_lock_free(small_home)


@pytest.mark.parametrize(("url", "code"), [
    ("mysql://admin:s3cr3t@db.example/kandevd", 2),
    ("sqlite:///tmp/other.db?password=s3cr3t", 2),
    ("postgresql://admin:s3cr3t@127.0.0.1:1/kandevd", 74),       # nothing listens there
    ("postgres://admin:s3cr3t%zz@127.0.0.1:1/kandevd", 74),      # libpq quotes a bad %-escape
    ("postgresql://127.0.0.1:1/kandevd?password=s3cr3t", 74),
])
def test_a_bad_url_is_refused_without_showing_the_password(small_home: Path, url: str,
                                                           code: int) -> None:
    result = run_cli(small_home, "db", "migrate", "--to", url)
    assert result.returncode == code, result.stdout + result.stderr
    assert "s3cr3t" not in result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("kandevd: ") and "***" in line, line
    assert "Traceback" not in result.stderr
    assert_lock_free(small_home)


def test_without_psycopg_the_extra_is_named(small_home: Path) -> None:
    script = ("import sys; sys.modules['psycopg'] = None; from kandevd.cli import main; "
              "sys.argv = ['kandevd', *sys.argv[1:]]; main()")
    result = subprocess.run(
        [sys.executable, "-c", script, "db", "migrate", "--to",
         "postgresql://admin:s3cr3t@localhost/kandevd", "--home", str(small_home)],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 78, result.stdout + result.stderr
    assert "pip install 'kandevd[postgres]'" in result.stderr
    assert "s3cr3t" not in result.stderr and "admin:***@localhost" in result.stderr


def test_a_missing_database_is_refused(tmp_path: Path, pg_url: str) -> None:
    result = run_cli(tmp_path / "nowhere", "db", "migrate", "--to", pg_url)
    assert result.returncode == 74 and "does not exist" in result.stderr, result.stderr
    assert not (tmp_path / "nowhere").exists()


def invoke(home: Path, url: str) -> Any:
    return CliRunner().invoke(cli, ["db", "migrate", "--to", url, "--home", str(home)])


def test_a_failure_half_way_leaves_the_target_empty(small_home: Path, pg_url: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copy, "BATCH_ROWS", 2)
    real = copy._batches

    def failing(source: sqlite3.Connection, table: copy.TablePlan
                ) -> Iterator[list[tuple[Any, ...]]]:
        for number, batch in enumerate(real(source, table)):
            if table.name == "runs" and number == 1:
                raise sqlite3.OperationalError("disk I/O error")
            yield batch

    monkeypatch.setattr(copy, "_batches", failing)
    result = invoke(small_home, pg_url)
    assert result.exit_code == 74, result.output
    assert f"database {small_home / 'kandevd.db'}: reading runs failed: disk I/O error" \
        in result.stderr
    assert "rolled back" in result.stderr and result.stdout == ""
    assert_target_empty(pg_url)
    assert_lock_free(small_home)


def test_a_count_that_differs_is_named_and_rolled_back(small_home: Path, pg_url: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    real = copy._batches

    def dropping(source: sqlite3.Connection, table: copy.TablePlan
                 ) -> Iterator[list[tuple[Any, ...]]]:
        for batch in real(source, table):
            yield batch[:-1] if table.name == "runs" else batch

    monkeypatch.setattr(copy, "_batches", dropping)
    result = invoke(small_home, pg_url)
    assert result.exit_code == 1, result.output
    assert "runs: 5 rows (target: 4)" in result.stdout.splitlines()
    assert "workspaces: 1 rows" in result.stdout.splitlines()
    assert "the row counts of runs differ" in result.stderr and "rolled back" in result.stderr
    assert_target_empty(pg_url)


def test_a_progress_bar_on_a_terminal(small_home: Path, pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:  # no schema at all: migrate makes it
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    master, slave = pty.openpty()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kandevd", "db", "migrate", "--to", pg_url,
             "--home", str(small_home)],
            stdout=subprocess.PIPE, stderr=slave, text=True, timeout=120)
        os.close(slave)
        shown = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the other side is closed and drained
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(master)
    assert proc.returncode == 0, proc.stdout + shown.decode()
    assert b"copying 8 rows" in shown and b"100%" in shown, shown
    assert proc.stdout.splitlines()[-1].startswith(
        f"verified: {len(copy.TABLES)} tables, 8 rows")


def test_every_table_of_the_sqlite_schema_is_copied(tmp_path: Path, pg_url: str) -> None:
    store = open_store(tmp_path / "kandevd.db")
    try:
        tables = {row[0] for row in store.query(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}
    finally:
        store.close()
    assert tables == set(copy.TABLES) | set(copy.NOT_COPIED)
    open_store(pg_url).close()
    assert set(copy.TABLES) <= pg_tables(pg_url)
