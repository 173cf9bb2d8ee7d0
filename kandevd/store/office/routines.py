"""Office routines: every statement of :mod:`kandevd.office.routines`.

A fire is claimed by compare-and-set on the ``next_run_at`` that was read, so
of two ticks (or two daemons) only one fires an occurrence.
"""

from __future__ import annotations

import sqlite3

from kandevd.store.base import BaseStore
from kandevd.store.office.predicate import PROBE_TAG

_PROBE_SQL = f"{PROBE_TAG} SELECT EXISTS(SELECT 1 FROM office_routines WHERE status = 'active')"
_DUE_SQL = ("/* office:routine-scan */ SELECT * FROM office_routines WHERE status = 'active'"
            " AND (next_run_at IS NULL OR next_run_at <= ?) ORDER BY next_run_at, id")


def any_active(store: BaseStore) -> bool:
    """Is some routine active (the maintenance gate)?"""
    return bool(store.query_one(_PROBE_SQL)[0])


def due(store: BaseStore, now: str) -> list[sqlite3.Row]:
    """The active routines due at ``now`` (or never scheduled yet), soonest first."""
    return store.query(_DUE_SQL, (now,))


def claim_fire(conn: sqlite3.Connection, routine_id: str, read_next_run_at: str | None,
               next_run_at: str | None, now: str) -> bool:
    """Move the routine's ``next_run_at`` on, if it is still the one read; False when
    another tick did first (or the routine was paused meanwhile)."""
    return bool(conn.execute(
        "UPDATE office_routines SET next_run_at = ?, updated_at = ?"
        " WHERE id = ? AND next_run_at IS ? AND status = 'active'",
        (next_run_at, now, routine_id, read_next_run_at)).rowcount)


def fired(conn: sqlite3.Connection, routine_id: str, at: str) -> None:
    """The routine's last run was enqueued for ``at``."""
    conn.execute("UPDATE office_routines SET last_run_at = ? WHERE id = ?", (at, routine_id))


def active_run(conn: sqlite3.Connection, agent_id: str, reason: str,
               routine_id: str) -> sqlite3.Row | None:
    """The routine's oldest run still queued or claimed (its id and status), or None."""
    return conn.execute(
        "SELECT id, status FROM runs WHERE agent_id = ? AND reason = ?"
        " AND status IN ('queued', 'claimed') AND json_extract(payload, '$.routine_id') = ?"
        " ORDER BY seq LIMIT 1", (agent_id, reason, routine_id)).fetchone()
