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
