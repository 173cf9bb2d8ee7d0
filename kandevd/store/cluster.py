"""The cluster's tables on PostgreSQL: ``daemons``, ``leases`` and ``fires``.

Every statement of the cluster's membership, heartbeat, leader's lease, fires
and pruning, so that :mod:`kandevd.cluster.membership` holds the decisions and none of the
SQL. Two kinds of call: :class:`ClusterTables` goes through the store's
guarded connection (its transactions and its error mapping); the heartbeat,
the lease and LISTEN/NOTIFY run on raw connections of their own (autocommit,
``%s`` parameters), which the module-level functions take.
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any, NamedTuple

import psycopg

from kandevd.store.postgres import PgStore
from kandevd.timeutil import after, rfc3339, utc_now

#: The LISTEN/NOTIFY channel of the run queue.
CHANNEL = "kandevd_queue"

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


class Lease(NamedTuple):
    """The leader's lease as it was before this daemon took or renewed it."""

    previous: str | None
    expired_at: datetime | None
    #: Seconds since that expiry on the database's clock (negative: not expired).
    lapsed_s: float | None


class Member(NamedTuple):
    """A daemon not stopped, as the ``daemons`` table has it."""

    boot_id: str
    host: str
    pid: int
    home: str
    started_at: datetime | None
    heartbeat_at: datetime | None
    #: Its heartbeat is more recent than ``dead_after_s``.
    alive: bool


class ClusterTables:
    """The statements that go through the store's own guarded connection."""

    def __init__(self, store: PgStore) -> None:
        self.store = store

    def join(self, boot_id: str, host: str, machine: str, home: str) -> list[str]:
        """Register ``boot_id`` and hold the earlier daemons of this host and home.

        Those are the daemons running, or stopped with claims left behind (a
        graceful stop leaves its interrupted runs claimed); their heartbeat is
        made fresh in the same transaction. Returns their boot ids.
        """
        with self.store.transaction() as conn:
            held = [row[0] for row in conn.execute(
                "SELECT d.boot_id FROM daemons d WHERE d.host = ? AND d.machine = ?"
                " AND d.home = ? AND d.boot_id != ? AND (d.stopped_at IS NULL OR EXISTS"
                " (SELECT 1 FROM runs r WHERE r.status = 'claimed'"
                " AND r.claimed_by = d.boot_id))",
                (host, machine, home, boot_id)).fetchall()]
            if held:
                conn.execute("UPDATE daemons SET heartbeat_at = clock_timestamp(),"
                             " stopped_at = NULL WHERE boot_id = ANY(?)", (held,))
            conn.execute(
                "INSERT INTO daemons (boot_id, host, machine, pid, home, started_at,"
                " heartbeat_at) VALUES (?, ?, ?, ?, ?, now(), clock_timestamp())",
                (boot_id, host, machine, os.getpid(), home))
        return held

    def mark_stopped(self, boot_ids: list[str]) -> None:
        """These daemons are stopped (their claims are settled)."""
        self.store.execute("UPDATE daemons SET stopped_at = now() WHERE boot_id = ANY(?)",
                           (boot_ids,))

    def members(self, dead_after_s: float) -> list[Member]:
        """Every daemon not stopped, oldest first."""
        rows = self.store.query(
            "SELECT boot_id, host, pid, home, started_at, heartbeat_at,"
            " heartbeat_at >= now() - make_interval(secs => ?) AS alive"
            " FROM daemons WHERE stopped_at IS NULL ORDER BY started_at",
            (float(dead_after_s),))
        return [Member(r["boot_id"], r["host"], r["pid"], r["home"], r["started_at"],
                       r["heartbeat_at"], bool(r["alive"])) for r in rows]

    def give_up_lease(self, boot_id: str) -> None:
        """Expire the leader's lease now, if ``boot_id`` holds it."""
        self.store.execute("UPDATE leases SET expires_at = now() WHERE name = 'leader'"
                           " AND holder = ?", (boot_id,))

    def claim_fire(self, boot_id: str, job: str, intended: datetime) -> bool:
        """Record the fire of ``job``'s occurrence at ``intended``; False if it was fired
        already, or ``boot_id``'s lease is over in the database (a deposed leader fires
        nothing, whatever it believes)."""
        return self.store.execute(
            "INSERT INTO fires (job, intended_at, fired_by, fired_at) SELECT ?, ?, ?, ?"
            " WHERE EXISTS (SELECT 1 FROM leases WHERE name = 'leader' AND holder = ?"
            " AND expires_at > clock_timestamp())"
            " ON CONFLICT DO NOTHING",
            (job, rfc3339(intended), boot_id, rfc3339(utc_now()), boot_id)) == 1

    def prune(self, after_s: float) -> None:
        """Forget fires and stopped daemons older than ``after_s`` (and the turns of
        every stopped daemon), and fold the run-count shards of connections that are
        gone into shard 0."""
        with self.store.transaction() as conn:
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
            # Turns handed to runners by daemons that stopped (their sessions ended).
            conn.execute("DELETE FROM remote_turns WHERE owner NOT IN"
                         " (SELECT boot_id FROM daemons WHERE stopped_at IS NULL)")
            conn.execute("DELETE FROM remote_turn_output WHERE token NOT IN"
                         " (SELECT token FROM remote_turns)")


# -- on raw connections (autocommit) -----------------------------------------------

def listen(conn: psycopg.Connection[Any]) -> None:
    """Receive the run queue's notifications on ``conn``."""
    conn.execute(f"LISTEN {CHANNEL}")


def notify(conn: psycopg.Connection[Any], payload: str | None = None) -> None:
    """Wake the daemons listening (``payload``: a message to one of them)."""
    if payload is None:
        conn.execute(f"NOTIFY {CHANNEL}")
    else:
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))


def heartbeat(conn: psycopg.Connection[Any], ours: list[str], boot_id: str,
              dead_after_s: float) -> tuple[bool, bool]:
    """Stamp the heartbeat of ``ours`` (this daemon first, then the daemons it holds)
    when written (``clock_timestamp()``). Returns (whether this daemon's row was there
    to stamp: if not, it is written again; whether another daemon is alive)."""
    stamped = conn.execute("UPDATE daemons SET heartbeat_at = clock_timestamp()"
                           " WHERE boot_id = ANY(%s) AND stopped_at IS NULL", (ours,))
    present = stamped.rowcount >= 1
    if not present:
        conn.execute("UPDATE daemons SET stopped_at = NULL, heartbeat_at ="
                     " clock_timestamp() WHERE boot_id = %s", (boot_id,))
    row = conn.execute("SELECT EXISTS (SELECT 1 FROM daemons WHERE boot_id != ALL(%s)"
                       " AND stopped_at IS NULL AND heartbeat_at > clock_timestamp()"
                       " - make_interval(secs => %s))", (ours, dead_after_s)).fetchone()
    return present, bool(row and row[0])


def take_lease(conn: psycopg.Connection[Any], boot_id: str, lease_s: float) -> Lease | None:
    """Take or renew the leader's lease for ``lease_s``; None while another daemon holds
    one that has not expired."""
    row = conn.execute(LEASE_SQL, {"me": boot_id, "lease": lease_s}).fetchone()
    if row is None:
        return None
    return Lease(row[0], row[1], None if row[2] is None else float(row[2]))


# -- events pushed to clients, between daemons (kandevd/events/relay.py) ----------------

#: The channel every daemon's events travel on.
EVENTS_CHANNEL = "kandevd_events"


def listen_events(conn: psycopg.Connection[Any]) -> None:
    """Receive the other daemons' events on ``conn``."""
    conn.execute(f"LISTEN {EVENTS_CHANNEL}")


def notify_events(conn: psycopg.Connection[Any], payloads: list[str]) -> None:
    """Send ``payloads`` (each under 8000 bytes), in order, in one round trip."""
    calls = ", ".join("pg_notify(%s, %s)" for _ in payloads)
    params: list[str] = []
    for payload in payloads:
        params += [EVENTS_CHANNEL, payload]
    conn.execute(f"SELECT {calls}", params)
