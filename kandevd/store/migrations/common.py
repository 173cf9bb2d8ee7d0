"""What both schemas' migrations share: the ``schema_migrations`` bookkeeping."""

from __future__ import annotations

from typing import Any

from kandevd.timeutil import rfc3339, utc_now

SCHEMA_TABLE = ("CREATE TABLE IF NOT EXISTS schema_migrations "
                "(version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TEXT NOT NULL)")


def refuse_newer(version: int, known: int) -> None:
    if version > known:
        raise RuntimeError(
            f"database schema version {version} is newer than this kandevd knows ({known}); "
            "refusing to touch it"
        )


def record(conn: Any, number: int, name: str) -> None:
    """The bookkeeping row of a migration just applied (inside its transaction)."""
    conn.execute("INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
                 (number, name, rfc3339(utc_now())))


def remote_turns_tables(text: str) -> list[str]:
    """Scheduled turns handed to runners (:mod:`kandevd.store.turns`) and their output
    not yet in the turn's log; ``text``: the schema's text type."""
    return [
        f"""CREATE TABLE remote_turns (
            token {text} PRIMARY KEY, owner {text} NOT NULL, run_id {text} NOT NULL,
            profile {text} NOT NULL, labels {text} NOT NULL, stdin TEXT NOT NULL,
            queued_at {text} NOT NULL, runner {text}, handed_at {text},
            cancel INTEGER NOT NULL DEFAULT 0, received BIGINT NOT NULL DEFAULT 0,
            ending TEXT)""",
        "CREATE INDEX idx_remote_turns_runner ON remote_turns (runner, queued_at)",
        f"""CREATE TABLE remote_turn_output (
            token {text} NOT NULL, start BIGINT NOT NULL, data TEXT NOT NULL,
            PRIMARY KEY (token, start))""",
    ]


def runner_stops_table(text: str) -> str:
    """The cancelled runs whose agent a runner is still stopping (:mod:`kandevd.store.runners`):
    that agent takes no other run meanwhile, whichever daemon asks, after a restart too."""
    return f"""CREATE TABLE runner_stops (
        token {text} PRIMARY KEY, runner {text} NOT NULL, run_id {text} NOT NULL,
        agent_id {text} NOT NULL, since {text} NOT NULL)"""


#: A turn handed again after its runner stopped gracefully: where, in the turn's
#: output, the output of its next runner's execution starts (kandevd.store.turns).
TURN_OUTPUT_BASE = "ALTER TABLE remote_turns ADD COLUMN base BIGINT NOT NULL DEFAULT 0"
