"""The SQLite schema, as versioned migrations.

``schema_migrations`` records each applied version. A migration is a function
of a :class:`sqlite_utils.Database` wrapping the store's connection; it runs
inside one ``BEGIN IMMEDIATE`` transaction together with its bookkeeping row,
so a crash half-way leaves the previous version intact. Tables are created
with sqlite-utils; what it cannot express (partial unique indexes) is plain
SQL next to it.

Append new migrations to :data:`MIGRATIONS`; never edit an applied one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import sqlite_utils

from kandevd.store.base import BaseStore
from kandevd.store.migrations.common import (
    SCHEMA_TABLE,
    TURN_OUTPUT_BASE,
    record,
    refuse_newer,
    remote_turns_tables,
    runner_stops_table,
)

log = logging.getLogger("kandevd.store.migrations")


def _v1_workspace_model_and_runs(db: sqlite_utils.Database) -> None:
    db["workspaces"].create(
        {"id": str, "name": str, "office_workflow_id": str, "created_at": str, "updated_at": str},
        pk="id", not_null={"name", "office_workflow_id", "created_at", "updated_at"},
        defaults={"office_workflow_id": ""},
    )
    db["agents"].create(
        {
            "id": str, "workspace_id": str, "name": str, "profile": str, "cooldown_s": float,
            "status": str, "cooldown_until": str, "last_finished_at": str,
            "created_at": str, "updated_at": str,
        },
        pk="id", foreign_keys=[("workspace_id", "workspaces", "id")],
        not_null={"workspace_id", "name", "profile", "cooldown_s", "status", "created_at",
                  "updated_at"},
        defaults={"profile": "default", "cooldown_s": 0.0, "status": "active"},
    )
    db["agents"].create_index(["workspace_id"])
    db["workflows"].create(
        {"id": str, "workspace_id": str, "name": str, "style": str, "created_at": str},
        pk="id", foreign_keys=[("workspace_id", "workspaces", "id")],
        not_null={"workspace_id", "name", "style", "created_at"},
    )
    db["workflow_steps"].create(
        {"workflow_id": str, "id": str, "position": int, "name": str, "agent_id": str,
         "on_enter": str},
        pk=("workflow_id", "id"), foreign_keys=[("workflow_id", "workflows", "id")],
        not_null={"workflow_id", "id", "position", "name", "on_enter"},
        defaults={"on_enter": "[]"},
    )
    db["tasks"].create(
        {
            "id": str, "workspace_id": str, "workflow_id": str, "step_id": str, "title": str,
            "project_id": str, "state": str, "runner_agent_id": str,
            "created_at": str, "updated_at": str,
        },
        pk="id",
        foreign_keys=[("workspace_id", "workspaces", "id"), ("workflow_id", "workflows", "id")],
        not_null={"workspace_id", "workflow_id", "title", "project_id", "state", "created_at",
                  "updated_at"},
        defaults={"project_id": "", "state": "TODO"},
    )
    db["tasks"].create_index(["workspace_id", "state"])
    db["office_projects"].create(
        {"id": str, "workspace_id": str, "name": str, "created_at": str},
        pk="id", foreign_keys=[("workspace_id", "workspaces", "id")],
        not_null={"workspace_id", "name", "created_at"},
    )
    db["office_routines"].create(
        {
            "id": str, "workspace_id": str, "agent_id": str, "name": str,
            "cron_expression": str, "timezone": str, "payload": str, "status": str,
            "concurrency_policy": str, "catch_up_policy": str, "catch_up_max": int,
            "next_run_at": str, "last_run_at": str, "created_at": str, "updated_at": str,
        },
        pk="id",
        foreign_keys=[("workspace_id", "workspaces", "id"), ("agent_id", "agents", "id")],
        not_null={"workspace_id", "agent_id", "name", "cron_expression", "timezone", "payload",
                  "status", "concurrency_policy", "catch_up_policy", "catch_up_max",
                  "created_at", "updated_at"},
        defaults={"timezone": "UTC", "payload": "{}", "status": "active",
                  "concurrency_policy": "skip_if_active", "catch_up_policy": "skip_missed",
                  "catch_up_max": 25},
    )
    db["office_budget_policies"].create(
        {
            "id": str, "workspace_id": str, "scope_type": str, "scope_id": str,
            "limit_cents": float, "period": str, "alert_threshold_pct": float,
            "action_on_exceed": str, "created_at": str,
        },
        pk="id", foreign_keys=[("workspace_id", "workspaces", "id")],
        not_null={"workspace_id", "scope_type", "scope_id", "limit_cents", "period",
                  "alert_threshold_pct", "action_on_exceed", "created_at"},
        defaults={"alert_threshold_pct": 80.0, "action_on_exceed": "notify_only"},
    )
    db["office_budget_alerts"].create(
        {"policy_id": str, "period_key": str, "threshold_pct": float, "spent_cents": float,
         "created_at": str},
        pk=("policy_id", "period_key", "threshold_pct"),
        foreign_keys=[("policy_id", "office_budget_policies", "id")],
    )
    db["runs"].create(
        {
            "seq": int, "id": str, "workspace_id": str, "agent_id": str, "task_id": str,
            "reason": str, "payload": str, "status": str, "idempotency_key": str,
            "key_active": int, "coalesced_count": int, "retry_count": int,
            "scheduled_retry_at": str, "requested_at": str, "claimed_at": str,
            "finished_at": str, "error_message": str, "cancel_reason": str,
            "output_summary": str, "cost_cents": float, "log_path": str,
            "claim_token": str, "claimed_by": str, "attempt": int, "updated_at": str,
        },
        pk="seq",
        foreign_keys=[("workspace_id", "workspaces", "id"), ("agent_id", "agents", "id")],
        not_null={"id", "workspace_id", "agent_id", "reason", "payload", "status",
                  "key_active", "coalesced_count", "retry_count", "requested_at", "attempt",
                  "updated_at"},
        defaults={"payload": "{}", "key_active": 0, "coalesced_count": 0, "retry_count": 0,
                  "attempt": 0},
    )
    db["runs"].create_index(["id"], unique=True)
    db["runs"].create_index(["status", "seq"])
    db["runs"].create_index(["agent_id", "status"])
    db["runs"].create_index(["task_id"])
    # At most one claimed run per agent, enforced by the database itself.
    db.execute(
        "CREATE UNIQUE INDEX runs_one_claim_per_agent ON runs(agent_id) WHERE status = 'claimed'"
    )
    # An idempotency key is unique among runs whose key is still in force (< 24 h);
    # an expired key is switched off (key_active = 0) when it is reused, never deleted.
    db.execute(
        "CREATE UNIQUE INDEX runs_active_idempotency_key ON runs(idempotency_key) "
        "WHERE idempotency_key IS NOT NULL AND key_active = 1"
    )


def _v2_runs_retry_index(db: sqlite_utils.Database) -> None:
    # The queue loop asks every tick when the next scheduled retry is due; without
    # this it would read every queued row to find out.
    db.execute(
        "CREATE INDEX runs_queued_retry_at ON runs(scheduled_retry_at) "
        "WHERE status = 'queued' AND scheduled_retry_at IS NOT NULL"
    )


def _v3_run_keys_and_step_entries(db: sqlite_utils.Database) -> None:
    # Every idempotency key maps to the run that took it for 24 h, including a key
    # absorbed by coalescing (the absorbing run keeps its own key on its row).
    db["run_keys"].create(
        {"idempotency_key": str, "run_id": str, "created_at": str},
        pk="idempotency_key", not_null={"run_id", "created_at"},
    )
    db["run_keys"].create_index(["created_at"])
    db.execute(
        "INSERT OR IGNORE INTO run_keys (idempotency_key, run_id, created_at)"
        " SELECT idempotency_key, id, requested_at FROM runs"
        " WHERE idempotency_key IS NOT NULL AND key_active = 1"
    )
    # Each entry of a task into a step counts, so a queue_run's key tells a replayed
    # move (same entry: deduplicated) from a new entry into the same step.
    db.execute("ALTER TABLE tasks ADD COLUMN step_entry INTEGER NOT NULL DEFAULT 0")
    # A workspace-wide hard budget is checked at claim time: its spend is read by workspace.
    db["runs"].create_index(["workspace_id"])


def _v4_retention_indexes(db: sqlite_utils.Database) -> None:
    # Retention (kandevd.store.retention) finds terminal runs by when they ended, oldest
    # first, and asks whether a live idempotency key still names each one.
    db.execute(
        "CREATE INDEX runs_terminal_ended ON runs(COALESCE(finished_at, updated_at)) "
        "WHERE status IN ('finished', 'failed', 'cancelled')"
    )
    db["run_keys"].create_index(["run_id"])


def _v5_runs_read_indexes(db: sqlite_utils.Database) -> None:
    # runs.list by one filter, in request order: (column, rowid) walks only the matching
    # rows, in seq order, and counts its total from the index alone. status, task_id and
    # workspace_id have theirs already (v1, v3); (agent_id, status) cannot give one agent's
    # runs in seq order.
    db.execute("CREATE INDEX runs_agent_seq ON runs(agent_id)")
    db.execute("CREATE INDEX runs_reason_seq ON runs(reason)")
    # Coalescing (RunRepository._coalesce) looks for a queued run of the agent and reason
    # requested in the last seconds: a range of this small partial index.
    db.execute(
        "CREATE INDEX runs_queued_coalesce ON runs(agent_id, reason, requested_at) "
        "WHERE status = 'queued'"
    )
    # Budget spend (kandevd.office.budgets.spent_cents): the scope's costs in the period,
    # summed from the index alone: a range of (scope, when the cost was recorded). The
    # expression and the partial-index term are exactly the query's; the two columns
    # inside the expression are in the index too, or SQLite (3.40) would read each row.
    for column in ("agent_id", "workspace_id"):
        db.execute(
            f"CREATE INDEX runs_spend_{column.removesuffix('_id')} ON runs({column},"
            " COALESCE(finished_at, requested_at), cost_cents, finished_at, requested_at)"
            " WHERE cost_cents IS NOT NULL"
        )


def _v6_run_counts(db: sqlite_utils.Database) -> None:
    # daemon.status and the metrics count runs by status on every call: a GROUP BY over
    # every run (milliseconds at 100,000). The counts are kept here instead. Status
    # changes and deletes are counted by triggers, whoever writes them. Inserts are not:
    # a trigger per inserted row doubles the cost of a batch enqueue, so the one insert
    # path (RunRepository) adds its runs itself, one UPDATE per transaction; and the
    # counts are checked against COUNT(*) when read, which repairs an insert made
    # behind the daemon's back (see RunRepository.count_by_status).
    db.execute("CREATE TABLE run_counts (status TEXT PRIMARY KEY, n INTEGER NOT NULL)"
               " WITHOUT ROWID")
    db.execute("INSERT INTO run_counts (status, n) SELECT status, COUNT(*) FROM runs"
               " GROUP BY status")
    add = ("INSERT INTO run_counts (status, n) VALUES (NEW.status, 1)"
           " ON CONFLICT (status) DO UPDATE SET n = n + 1;")
    remove = "UPDATE run_counts SET n = n - 1 WHERE status = OLD.status;"
    db.execute(f"CREATE TRIGGER runs_count_delete AFTER DELETE ON runs BEGIN {remove} END")
    db.execute("CREATE TRIGGER runs_count_status AFTER UPDATE OF status ON runs"
               f" WHEN NEW.status IS NOT OLD.status BEGIN {remove} {add} END")


def _v7_runners(db: sqlite_utils.Database) -> None:
    # An agent's runs_on (a JSON list of labels; NULL: it runs on the server), and the
    # runners on other machines that may take such runs: a token's hash, never the token.
    db.execute("ALTER TABLE agents ADD COLUMN runs_on TEXT")
    db.execute("CREATE TABLE runners (name TEXT PRIMARY KEY, token_hash TEXT NOT NULL UNIQUE,"
               " labels TEXT NOT NULL, created_at TEXT NOT NULL, last_seen_at TEXT)")


def _v8_remote_turns(db: sqlite_utils.Database) -> None:
    # Scheduled turns handed to runners (kandevd/store/turns.py), and their output not
    # yet in the turn's log.
    for statement in remote_turns_tables("TEXT"):
        db.execute(statement)


def _v9_runner_homes(db: sqlite_utils.Database) -> None:
    # The runner home that serves a runner's name now: another home with the same token
    # is refused while that one is alive (two processes would take each other's runs).
    db.execute("ALTER TABLE runners ADD COLUMN home_id TEXT")
    # When it last stopped gracefully (offline at once, not after dead_after_s).
    db.execute("ALTER TABLE runners ADD COLUMN left_at TEXT")


def _v10_runner_stops(db: sqlite_utils.Database) -> None:
    db.execute(runner_stops_table("TEXT"))


def _v11_turn_output_base(db: sqlite_utils.Database) -> None:
    db.execute(TURN_OUTPUT_BASE)


Migration = Callable[[sqlite_utils.Database], None]

MIGRATIONS: list[tuple[int, str, Migration]] = [
    (1, "workspace model and runs queue", _v1_workspace_model_and_runs),
    (2, "runs: index of scheduled retries", _v2_runs_retry_index),
    (3, "run keys and task step entries", _v3_run_keys_and_step_entries),
    (4, "runs: retention indexes", _v4_retention_indexes),
    (5, "runs: indexes for lists, coalescing and budget spend", _v5_runs_read_indexes),
    (6, "runs: counts by status kept by triggers", _v6_run_counts),
    (7, "runners on other machines, an agent's runs_on", _v7_runners),
    (8, "scheduled turns handed to runners", _v8_remote_turns),
    (9, "the runner home serving each runner, a graceful stop", _v9_runner_homes),
    (10, "cancelled runs a runner is still stopping", _v10_runner_stops),
    (11, "a turn handed again: where its next output starts", _v11_turn_output_base),
]


def current_version(store: BaseStore) -> int:
    with store.connection() as conn:
        conn.execute(SCHEMA_TABLE)
        row = conn.execute("SELECT MAX(version) FROM schema_migrations").fetchone()
    return int(row[0] or 0)


def migrate(store: BaseStore) -> int:
    """Apply every pending migration, each in its own transaction; the resulting version."""
    version = current_version(store)
    refuse_newer(version, MIGRATIONS[-1][0] if MIGRATIONS else 0)
    for number, name, apply in MIGRATIONS:
        if number <= version:
            continue
        with store.transaction() as conn:
            apply(sqlite_utils.Database(conn))
            record(conn, number, name)
        log.info("database migrated to version %d (%s)", number, name)
        version = number
    return version
