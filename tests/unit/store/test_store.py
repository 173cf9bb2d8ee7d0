"""The SQLite store: pragmas, the closed-store guard, transactions, migrations, indexes.

Everything runs against a real database file in tmp_path: the constraints
under test (partial unique indexes, foreign keys, WAL) are SQLite's own.
"""

from __future__ import annotations

import sqlite3
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
import sqlite_utils

from kandevd.store.base import StoreClosedError, StoreError
from kandevd.store.migrations import sqlite as migrations
from kandevd.store.open import open_store
from kandevd.store.sqlite import Store

TIMEOUT = 10.0
NOW = "2026-12-02T13:00:00.000000Z"

# CONTRACT.md section 3: the fields of a RUN.
RUN_FIELDS = {
    "id", "seq", "workspace_id", "agent_id", "task_id", "reason", "payload", "status",
    "idempotency_key", "coalesced_count", "retry_count", "scheduled_retry_at", "requested_at",
    "claimed_at", "finished_at", "error_message", "cancel_reason", "output_summary",
    "cost_cents", "log_path",
}
V1_TABLES = {"workspaces", "agents", "workflows", "workflow_steps", "tasks", "office_projects",
             "office_routines", "office_budget_policies", "office_budget_alerts", "runs"}


@pytest.fixture
def store(tmp_path: Path):
    opened = open_store(tmp_path / "kandevd.db")
    yield opened
    opened.close()


def add_agents(store: Store, *agents: str, workspace: str = "ws1") -> None:
    with store.transaction() as conn:
        conn.execute("INSERT OR IGNORE INTO workspaces (id, name, created_at, updated_at) "
                     "VALUES (?, ?, ?, ?)", (workspace, workspace, NOW, NOW))
        for agent in agents:
            conn.execute("INSERT INTO agents (id, workspace_id, name, created_at, updated_at) "
                         "VALUES (?, ?, ?, ?, ?)", (agent, workspace, agent, NOW, NOW))


def add_run(store: Store, run_id: str, agent: str, status: str = "queued",
            key: str | None = None, key_active: int = 0) -> None:
    store.execute(
        "INSERT INTO runs (id, workspace_id, agent_id, reason, status, idempotency_key, "
        "key_active, requested_at, updated_at) VALUES (?, 'ws1', ?, 'manual', ?, ?, ?, ?, ?)",
        (run_id, agent, status, key, key_active, NOW, NOW))


# -- connection and pragmas -------------------------------------------------------------


def test_pragmas_and_file_mode(store: Store, tmp_path: Path) -> None:
    assert store.query_one("PRAGMA journal_mode")[0] == "wal"
    assert store.query_one("PRAGMA foreign_keys")[0] == 1
    assert store.query_one("PRAGMA busy_timeout")[0] >= 1000
    assert stat.S_IMODE((tmp_path / "kandevd.db").stat().st_mode) == 0o600


def test_foreign_keys_are_enforced(store: Store) -> None:
    with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
        store.execute("INSERT INTO agents (id, workspace_id, name, created_at, updated_at) "
                      "VALUES ('a1', 'no-such-workspace', 'a', ?, ?)", (NOW, NOW))


def test_trace_file_records_every_statement(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "trace.sql"
    monkeypatch.setenv("KANDEVD_TRACE_SQL", str(trace))
    traced = open_store(tmp_path / "traced.db")
    traced.query("SELECT count(*) FROM runs WHERE status = 'queued'")
    traced.close()
    lines = trace.read_text().splitlines()
    assert "SELECT count(*) FROM runs WHERE status = 'queued'" in lines
    assert traced.statements >= len(lines) > 0


# -- the closed-store guard ----------------------------------------------------------------


def test_every_use_after_close_raises_store_closed(store: Store) -> None:
    store.close()
    store.close()  # idempotent
    assert store.closed
    uses = [
        lambda: store.query("SELECT 1"),
        lambda: store.query_one("SELECT 1"),
        lambda: store.execute("DELETE FROM runs"),
    ]
    for use in uses:
        with pytest.raises(StoreClosedError, match=r"used after Store\.close"):
            use()
    for manager in (store.transaction, store.connection):
        with pytest.raises(StoreClosedError), manager():
            pass


def test_close_waits_for_a_transaction_in_another_thread(store: Store) -> None:
    add_agents(store)
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            with store.transaction() as conn:
                conn.execute("UPDATE workspaces SET name = 'renamed' WHERE id = 'ws1'")
                inside.set()
                assert release.wait(TIMEOUT)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=writer)
    worker.start()
    assert inside.wait(TIMEOUT)
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive() and not store.closed  # close() waits for the statement in progress
    release.set()
    worker.join(TIMEOUT)
    closer.join(TIMEOUT)
    assert errors == [] and store.closed
    reopened = Store(store.path)
    try:
        assert reopened.query_one("SELECT name FROM workspaces")["name"] == "renamed"
    finally:
        reopened.close()


def test_close_inside_an_open_transaction_is_refused(store: Store) -> None:
    with store.transaction(), pytest.raises(StoreError, match="inside an open transaction"):
        store.close()
    assert not store.closed
    assert store.query_one("SELECT 1")[0] == 1


# -- transactions ------------------------------------------------------------------------


def test_transaction_rolls_back_on_error_and_nests_into_the_outer_one(store: Store) -> None:
    add_agents(store, "a1")
    with pytest.raises(RuntimeError, match="abort"), store.transaction() as conn:
        conn.execute("UPDATE agents SET status = 'paused'")
        with store.transaction() as inner:  # joins the outer transaction
            assert inner is conn and conn.in_transaction
            inner.execute("UPDATE agents SET cooldown_s = 99")
        raise RuntimeError("abort")
    row = store.query_one("SELECT status, cooldown_s FROM agents WHERE id = 'a1'")
    assert (row["status"], row["cooldown_s"]) == ("active", 0)


def test_a_failed_commit_leaves_no_transaction_open(store: Store) -> None:
    """A COMMIT that fails must roll back, or later transactions would silently join it."""
    with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"), \
            store.transaction() as conn:
        conn.execute("PRAGMA defer_foreign_keys = ON")  # the check moves to COMMIT
        conn.execute("INSERT INTO agents (id, workspace_id, name, created_at, updated_at) "
                     "VALUES ('orphan', 'missing', 'orphan', ?, ?)", (NOW, NOW))
    with store.connection() as conn:
        assert not conn.in_transaction
    add_agents(store, "a1")  # a fresh transaction that really commits
    assert [r["id"] for r in store.query("SELECT id FROM agents")] == ["a1"]


# -- migrations ------------------------------------------------------------------------------


def tables(store: Store) -> set[str]:
    return {r["name"] for r in store.query("SELECT name FROM sqlite_master WHERE type = 'table'")}


def test_schema_v1_has_the_contract_tables_and_run_fields(store: Store) -> None:
    assert V1_TABLES | {"schema_migrations"} <= tables(store)
    columns = {r["name"] for r in store.query("PRAGMA table_info(runs)")}
    assert columns >= RUN_FIELDS
    assert "office_workflow_id" in {r["name"] for r in store.query("PRAGMA table_info(workspaces)")}
    task_columns = {r["name"] for r in store.query("PRAGMA table_info(tasks)")}
    assert {"project_id", "state", "runner_agent_id"} <= task_columns
    index_columns = {tuple(r["name"] for r in store.query(f"PRAGMA index_info('{i['name']}')"))
                     for i in store.query("PRAGMA index_list(runs)")}
    assert ("status", "seq") in index_columns


def test_migrations_are_idempotent(tmp_path: Path) -> None:
    path = tmp_path / "kandevd.db"
    first = open_store(path)
    latest = migrations.MIGRATIONS[-1][0]
    assert migrations.current_version(first) == latest
    assert migrations.migrate(first) == latest  # a second pass applies nothing
    schema = first.query("SELECT type, name, sql FROM sqlite_master ORDER BY name")
    first.close()
    second = open_store(path)  # and so does a restart
    try:
        versions = [r["version"] for r in second.query("SELECT version FROM schema_migrations")]
        assert versions == [number for number, _, _ in migrations.MIGRATIONS]
        again = second.query("SELECT type, name, sql FROM sqlite_master ORDER BY name")
        assert [tuple(r) for r in again] == [tuple(r) for r in schema]
    finally:
        second.close()


def test_a_failing_migration_leaves_the_previous_version_intact(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    latest = migrations.current_version(store)

    def half_done(db: sqlite_utils.Database) -> None:
        db["half_done"].create({"id": int}, pk="id")
        raise RuntimeError("migration crashed half-way")

    monkeypatch.setattr(migrations, "MIGRATIONS",
                        [*migrations.MIGRATIONS, (latest + 1, "broken", half_done)])
    with pytest.raises(RuntimeError, match="half-way"):
        migrations.migrate(store)
    assert migrations.current_version(store) == latest
    assert "half_done" not in tables(store)


def test_a_newer_schema_is_refused(store: Store) -> None:
    latest = migrations.current_version(store)
    store.execute("INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
                  (latest + 1, "from the future", NOW))
    with pytest.raises(RuntimeError, match="newer than this kandevd knows"):
        migrations.migrate(store)


# -- the partial unique indexes ------------------------------------------------------------


def test_at_most_one_claimed_run_per_agent(store: Store) -> None:
    add_agents(store, "a1", "a2")
    add_run(store, "r1", "a1", "claimed")
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
        add_run(store, "r2", "a1", "claimed")
    add_run(store, "r3", "a2", "claimed")  # another agent may have its own claim
    for status in ("queued", "finished", "failed", "cancelled"):
        add_run(store, f"r-{status}", "a1", status)  # other states are not limited
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
        store.execute("UPDATE runs SET status = 'claimed' WHERE id = 'r-queued'")
    claimed = store.query("SELECT agent_id, count(*) AS n FROM runs WHERE status = 'claimed' "
                          "GROUP BY agent_id ORDER BY agent_id")
    assert [(r["agent_id"], r["n"]) for r in claimed] == [("a1", 1), ("a2", 1)]


def test_an_active_idempotency_key_is_unique(store: Store) -> None:
    add_agents(store, "a1")
    add_run(store, "r1", "a1", key="k1", key_active=1)
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
        add_run(store, "r2", "a1", key="k1", key_active=1)
    add_run(store, "r3", "a1", key="k1", key_active=0)  # an expired key may be reused ...
    store.execute("UPDATE runs SET key_active = 0 WHERE id = 'r1'")
    add_run(store, "r4", "a1", key="k1", key_active=1)  # ... once the old one is switched off
    for n in range(3):
        add_run(store, f"no-key-{n}", "a1")  # runs without a key are never limited
    rows: list[Any] = store.query("SELECT id FROM runs WHERE idempotency_key = 'k1' "
                                  "AND key_active = 1")
    assert [r["id"] for r in rows] == ["r4"]
