"""The cluster's leader: its lease, the fires it guards, and where a daemon runs.

The leader holds ``leases('leader')`` (see :mod:`kandevd.cluster`); a cron
occurrence is fired after inserting its ``(job, intended time)`` row in
``fires`` in a statement that checks that lease, so an occurrence fires once,
and never by a deposed leader.
"""

from __future__ import annotations

import logging
import sqlite3
from datetime import datetime

from kandevd.store.postgres import PgStore
from kandevd.timeutil import after, rfc3339, utc_now

log = logging.getLogger("kandevd.cluster")

#: Take the leader's lease when it is free or expired (or renew one's own); the holder
#: and expiry it had before, so a takeover knows since when no leader could fire.
LEASE_SQL = (
    "WITH prev AS (SELECT holder, expires_at FROM leases WHERE name = 'leader')"
    " INSERT INTO leases (name, holder, expires_at)"
    " VALUES ('leader', %(me)s, clock_timestamp() + make_interval(secs => %(lease)s))"
    " ON CONFLICT (name) DO UPDATE SET holder = excluded.holder,"
    " expires_at = excluded.expires_at"
    " WHERE leases.holder = excluded.holder OR leases.expires_at < clock_timestamp()"
    " RETURNING (SELECT holder FROM prev), (SELECT expires_at FROM prev),"
    " EXTRACT(EPOCH FROM clock_timestamp() - (SELECT expires_at FROM prev))")


def machine_id() -> str:
    """This machine's id (``/etc/machine-id``), or "" where there is none.

    With the host name and the home it tells this daemon's earlier instances
    from a daemon of another machine that happens to share both.
    """
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path, encoding="ascii") as handle:
                value = handle.read().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if value.isalnum():
            return value
    return ""


def claim_fire(store: PgStore, boot_id: str, job: str, intended: datetime) -> bool:
    """Record the fire of ``job``'s occurrence at ``intended``; False if it was fired
    already, or this daemon's lease is over in the database (a deposed leader fires
    nothing, whatever it believes)."""
    return store.execute(
        "INSERT INTO fires (job, intended_at, fired_by, fired_at) SELECT ?, ?, ?, ?"
        " WHERE EXISTS (SELECT 1 FROM leases WHERE name = 'leader' AND holder = ?"
        " AND expires_at > clock_timestamp())"
        " ON CONFLICT DO NOTHING",
        (job, rfc3339(intended), boot_id, rfc3339(utc_now()), boot_id)) == 1


def prune(store: PgStore, after_s: float) -> None:
    """The leader forgets fires and stopped daemons older than a week, and folds the
    run-count shards of connections that are gone into shard 0."""
    try:
        with store.transaction() as conn:
            conn.execute(
                "WITH gone AS (DELETE FROM run_counts WHERE shard > 0 AND shard NOT IN"
                " (SELECT pid FROM pg_stat_activity WHERE pid IS NOT NULL)"
                " RETURNING status, n)"
                " INSERT INTO run_counts (status, shard, n)"
                " SELECT status, 0, SUM(n) FROM gone GROUP BY status"
                " ON CONFLICT (status, shard) DO UPDATE SET n = run_counts.n + excluded.n")
            conn.execute("DELETE FROM fires WHERE fired_at < ?",
                         (rfc3339(after(utc_now(), -after_s)),))
            conn.execute("DELETE FROM daemons WHERE stopped_at < now()"
                         " - make_interval(secs => ?)", (after_s,))
    except sqlite3.Error as exc:
        log.debug("cluster: pruning fires and daemons failed: %s", exc)
