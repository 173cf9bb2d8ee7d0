"""The PostgreSQL schema: the SQLite schema of :mod:`kandevd.store.migrations.sqlite`, typed.

Version 6 is SQLite's versions 1-6 in one step (a new PostgreSQL database
starts there); later versions are shared by number with SQLite where both
need them. Differences that matter, and why:

- Every text column is ``COLLATE "C"``: timestamps are RFC 3339 text compared
  as text, which needs byte order, not the server's locale order.
- ``workspaces``, ``agents``, ``workflows`` and ``tasks`` have a ``rowid``
  identity column: the insertion order SQLite gives each table for free, by
  which the model's lists are ordered.
- ``runs.seq`` is an identity column (SQLite's ``INTEGER PRIMARY KEY``), and
  the per-filter indexes end in ``seq`` (SQLite appends the rowid by itself).
- ``run_counts`` is kept by a PL/pgSQL trigger, as SQLite's triggers keep it, in
  shards, one per connection (daemons claiming at the same time never wait for,
  or deadlock on, a count row).
- Version 7 is the cluster's: ``daemons`` (who is alive) and ``fires`` (one
  row per cron occurrence fired, so an occurrence fires once across daemons).
- Version 8 is the leader's ``leases`` (see :mod:`kandevd.store.cluster`).
- Version 10 holds the scheduled turns handed to runners (:mod:`kandevd.store.turns`),
  with SQLite's version 8; version 12 the cancelled runs a runner is still stopping,
  with SQLite's version 10; version 13 a turn's output base, with SQLite's 11.
"""

from __future__ import annotations

import logging

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

T = 'TEXT COLLATE "C"'

_V6 = [
    f"""CREATE TABLE workspaces (
        id {T} PRIMARY KEY, name {T} NOT NULL, office_workflow_id {T} NOT NULL DEFAULT '',
        created_at {T} NOT NULL, updated_at {T} NOT NULL,
        rowid BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE)""",
    f"""CREATE TABLE agents (
        id {T} PRIMARY KEY, workspace_id {T} NOT NULL REFERENCES workspaces(id),
        name {T} NOT NULL, profile {T} NOT NULL DEFAULT 'default',
        cooldown_s DOUBLE PRECISION NOT NULL DEFAULT 0.0, status {T} NOT NULL DEFAULT 'active',
        cooldown_until {T}, last_finished_at {T}, created_at {T} NOT NULL,
        updated_at {T} NOT NULL, rowid BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE)""",
    "CREATE INDEX idx_agents_workspace_id ON agents (workspace_id)",
    f"""CREATE TABLE workflows (
        id {T} PRIMARY KEY, workspace_id {T} NOT NULL REFERENCES workspaces(id),
        name {T} NOT NULL, style {T} NOT NULL, created_at {T} NOT NULL,
        rowid BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE)""",
    f"""CREATE TABLE workflow_steps (
        workflow_id {T} NOT NULL REFERENCES workflows(id), id {T} NOT NULL,
        position INTEGER NOT NULL, name {T} NOT NULL, agent_id {T},
        on_enter {T} NOT NULL DEFAULT '[]', PRIMARY KEY (workflow_id, id))""",
    f"""CREATE TABLE tasks (
        id {T} PRIMARY KEY, workspace_id {T} NOT NULL REFERENCES workspaces(id),
        workflow_id {T} NOT NULL REFERENCES workflows(id), step_id {T}, title {T} NOT NULL,
        project_id {T} NOT NULL DEFAULT '', state {T} NOT NULL DEFAULT 'TODO',
        runner_agent_id {T}, created_at {T} NOT NULL, updated_at {T} NOT NULL,
        step_entry INTEGER NOT NULL DEFAULT 0,
        rowid BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE)""",
    "CREATE INDEX idx_tasks_workspace_id_state ON tasks (workspace_id, state)",
    f"""CREATE TABLE office_projects (
        id {T} PRIMARY KEY, workspace_id {T} NOT NULL REFERENCES workspaces(id),
        name {T} NOT NULL, created_at {T} NOT NULL)""",
    f"""CREATE TABLE office_routines (
        id {T} PRIMARY KEY, workspace_id {T} NOT NULL REFERENCES workspaces(id),
        agent_id {T} NOT NULL REFERENCES agents(id), name {T} NOT NULL,
        cron_expression {T} NOT NULL, timezone {T} NOT NULL DEFAULT 'UTC',
        payload {T} NOT NULL DEFAULT '{{}}', status {T} NOT NULL DEFAULT 'active',
        concurrency_policy {T} NOT NULL DEFAULT 'skip_if_active',
        catch_up_policy {T} NOT NULL DEFAULT 'skip_missed',
        catch_up_max INTEGER NOT NULL DEFAULT 25, next_run_at {T}, last_run_at {T},
        created_at {T} NOT NULL, updated_at {T} NOT NULL)""",
    f"""CREATE TABLE office_budget_policies (
        id {T} PRIMARY KEY, workspace_id {T} NOT NULL REFERENCES workspaces(id),
        scope_type {T} NOT NULL, scope_id {T} NOT NULL, limit_cents DOUBLE PRECISION NOT NULL,
        period {T} NOT NULL, alert_threshold_pct DOUBLE PRECISION NOT NULL DEFAULT 80.0,
        action_on_exceed {T} NOT NULL DEFAULT 'notify_only', created_at {T} NOT NULL)""",
    f"""CREATE TABLE office_budget_alerts (
        policy_id {T} REFERENCES office_budget_policies(id), period_key {T},
        threshold_pct DOUBLE PRECISION, spent_cents DOUBLE PRECISION, created_at {T},
        PRIMARY KEY (policy_id, period_key, threshold_pct))""",
    f"""CREATE TABLE runs (
        seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, id {T} NOT NULL,
        workspace_id {T} NOT NULL REFERENCES workspaces(id),
        agent_id {T} NOT NULL REFERENCES agents(id), task_id {T}, reason {T} NOT NULL,
        payload {T} NOT NULL DEFAULT '{{}}', status {T} NOT NULL, idempotency_key {T},
        key_active INTEGER NOT NULL DEFAULT 0, coalesced_count INTEGER NOT NULL DEFAULT 0,
        retry_count INTEGER NOT NULL DEFAULT 0, scheduled_retry_at {T},
        requested_at {T} NOT NULL, claimed_at {T}, finished_at {T}, error_message {T},
        cancel_reason {T}, output_summary {T}, cost_cents DOUBLE PRECISION, log_path {T},
        claim_token {T}, claimed_by {T}, attempt INTEGER NOT NULL DEFAULT 0,
        updated_at {T} NOT NULL)""",
    "CREATE UNIQUE INDEX idx_runs_id ON runs (id)",
    "CREATE INDEX idx_runs_status_seq ON runs (status, seq)",
    "CREATE INDEX idx_runs_agent_id_status ON runs (agent_id, status, seq)",
    "CREATE INDEX idx_runs_task_id ON runs (task_id, seq)",
    "CREATE INDEX idx_runs_workspace_id ON runs (workspace_id, seq)",
    "CREATE INDEX runs_agent_seq ON runs (agent_id, seq)",
    "CREATE INDEX runs_reason_seq ON runs (reason, seq)",
    # At most one claimed run per agent, across every daemon: the database enforces it.
    "CREATE UNIQUE INDEX runs_one_claim_per_agent ON runs (agent_id) WHERE status = 'claimed'",
    "CREATE UNIQUE INDEX runs_active_idempotency_key ON runs (idempotency_key)"
    " WHERE idempotency_key IS NOT NULL AND key_active = 1",
    "CREATE INDEX runs_queued_retry_at ON runs (scheduled_retry_at)"
    " WHERE status = 'queued' AND scheduled_retry_at IS NOT NULL",
    "CREATE INDEX runs_terminal_ended ON runs ((COALESCE(finished_at, updated_at)))"
    " WHERE status IN ('finished', 'failed', 'cancelled')",
    "CREATE INDEX runs_queued_coalesce ON runs (agent_id, reason, requested_at)"
    " WHERE status = 'queued'",
    "CREATE INDEX runs_spend_agent ON runs (agent_id, (COALESCE(finished_at, requested_at)))"
    " INCLUDE (cost_cents) WHERE cost_cents IS NOT NULL",
    "CREATE INDEX runs_spend_workspace ON runs"
    " (workspace_id, (COALESCE(finished_at, requested_at))) INCLUDE (cost_cents)"
    " WHERE cost_cents IS NOT NULL",
    f"""CREATE TABLE run_keys (
        idempotency_key {T} PRIMARY KEY, run_id {T} NOT NULL, created_at {T} NOT NULL)""",
    "CREATE INDEX idx_run_keys_created_at ON run_keys (created_at)",
    "CREATE INDEX idx_run_keys_run_id ON run_keys (run_id)",
    # Counted in shards, one per connection (the writing backend's pid; shard 0 holds
    # what the leader folds in from connections gone, -1 the inserts): every claim and
    # outcome changes a count, and shared rows would make them wait for each other or,
    # locked in different orders, deadlock.
    f"""CREATE TABLE run_counts (status {T} NOT NULL, shard INTEGER NOT NULL DEFAULT 0,
        n BIGINT NOT NULL, PRIMARY KEY (status, shard))""",
    """CREATE FUNCTION kandevd_count_runs() RETURNS trigger LANGUAGE plpgsql AS $$
    DECLARE
      s INTEGER := pg_backend_pid();
    BEGIN
      IF TG_OP = 'DELETE' OR NEW.status IS DISTINCT FROM OLD.status THEN
        INSERT INTO run_counts (status, shard, n) VALUES (OLD.status, s, -1)
          ON CONFLICT (status, shard) DO UPDATE SET n = run_counts.n - 1;
      END IF;
      IF TG_OP = 'UPDATE' AND NEW.status IS DISTINCT FROM OLD.status THEN
        INSERT INTO run_counts (status, shard, n) VALUES (NEW.status, s, 1)
          ON CONFLICT (status, shard) DO UPDATE SET n = run_counts.n + 1;
      END IF;
      RETURN NULL;
    END $$""",
    "CREATE TRIGGER runs_count_delete AFTER DELETE ON runs"
    " FOR EACH ROW EXECUTE FUNCTION kandevd_count_runs()",
    "CREATE TRIGGER runs_count_status AFTER UPDATE OF status ON runs"
    " FOR EACH ROW EXECUTE FUNCTION kandevd_count_runs()",
]

_V7 = [
    # Every daemon that ever used the database: alive while its heartbeat is recent.
    # Times are the database's clock (now()), so the hosts' clocks never matter.
    f"""CREATE TABLE daemons (
        boot_id {T} PRIMARY KEY, host {T} NOT NULL, machine {T} NOT NULL DEFAULT '',
        pid INTEGER NOT NULL, home {T} NOT NULL,
        started_at TIMESTAMPTZ NOT NULL, heartbeat_at TIMESTAMPTZ NOT NULL,
        stopped_at TIMESTAMPTZ)""",
    # One row per cron occurrence fired: the unique key makes a fire happen once.
    f"""CREATE TABLE fires (
        job {T} NOT NULL, intended_at {T} NOT NULL, fired_by {T} NOT NULL,
        fired_at {T} NOT NULL, PRIMARY KEY (job, intended_at))""",
    "CREATE INDEX idx_fires_fired_at ON fires (fired_at)",
]

_V8 = [
    # The leader's lease: held while renewed, taken over once it expired (the database's
    # clock), so leadership moves on time even while a cut-off leader's session lingers.
    f"""CREATE TABLE leases (
        name {T} PRIMARY KEY, holder {T} NOT NULL, expires_at TIMESTAMPTZ NOT NULL)""",
]

_V9 = [
    # An agent's runs_on (a JSON list of labels; NULL: it runs on a server), and the
    # runners on other machines that may take such runs: a token's hash, never the token.
    "ALTER TABLE agents ADD COLUMN runs_on TEXT",
    f"""CREATE TABLE runners (
        name {T} PRIMARY KEY, token_hash {T} NOT NULL UNIQUE, labels TEXT NOT NULL,
        created_at {T} NOT NULL, last_seen_at {T})""",
]

# Scheduled turns handed to runners, and their output (kandevd/store/turns.py).
_V10 = remote_turns_tables(T)

# The runner home serving each runner's name (one token, one runner process).
_V11 = ["ALTER TABLE runners ADD COLUMN home_id TEXT",
        f"ALTER TABLE runners ADD COLUMN left_at {T}"]

# Cancelled runs whose agent a runner is still stopping (kandevd/store/runners.py).
_V12 = [runner_stops_table(T)]

# A turn handed again after its runner stopped (kandevd/store/turns.py).
_V13 = [TURN_OUTPUT_BASE]

MIGRATIONS: list[tuple[int, str, list[str]]] = [
    (6, "workspace model and runs queue (SQLite versions 1-6)", _V6),
    (7, "cluster: daemons and cron fires", _V7),
    (8, "cluster: the leader's lease", _V8),
    (9, "runners on other machines, an agent's runs_on", _V9),
    (10, "scheduled turns handed to runners", _V10),
    (11, "the runner home serving each runner, a graceful stop", _V11),
    (12, "cancelled runs a runner is still stopping", _V12),
    (13, "a turn handed again: where its next output starts", _V13),
]


def migrate(store: BaseStore) -> int:
    """Every pending version in one transaction, under the writer lock.

    Daemons starting together on a new database take turns: the first
    creates the schema, the others find it done.
    """
    known = MIGRATIONS[-1][0]
    applied: list[tuple[int, str]] = []
    with store.transaction() as conn:
        conn.execute(SCHEMA_TABLE)
        version = int(conn.execute("SELECT MAX(version) FROM schema_migrations")
                      .fetchone()[0] or 0)
        refuse_newer(version, known)
        for number, name, statements in MIGRATIONS:
            if number <= version:
                continue
            for statement in statements:
                conn.execute(statement)
            record(conn, number, name)
            applied.append((number, name))
            version = number
    for number, name in applied:
        log.info("database migrated to version %d (%s)", number, name)
    return version
