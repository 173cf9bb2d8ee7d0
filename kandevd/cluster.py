"""Several daemons, one PostgreSQL store: membership, heartbeats, wake-ups, the leader.

Only a daemon whose ``store.url`` names PostgreSQL has a :class:`Cluster`;
with SQLite nothing here runs. Everything rests on the database itself, not
on a protocol of our own:

- **Membership.** :meth:`Cluster.join` writes the daemon's row in ``daemons``
  (boot id, host, pid, home, start time). Its heartbeat (``heartbeat_at``, the
  database's clock, so the hosts' clocks do not matter) is renewed every
  ``cluster.heartbeat_s``. A daemon not seen for ``cluster.dead_after_s`` is
  dead: every daemon's heartbeat rescues the claims of dead daemons (re-queued
  with their attempt counted, or the dead letter once the attempts are used;
  fenced by their claim tokens). A daemon that starts on a home marks the
  earlier daemons of that same host and home stopped (the home lock proves
  they are), so it restores and adopts their executions itself.
- **Wake-ups.** Each daemon ``LISTEN``s on :data:`CHANNEL`. A run queued,
  finished, failed or cancelled here (each can make a run claimable) sends one
  ``NOTIFY`` (bursts coalesce into one), and the other daemons wake their
  queue loops at once; the safety pass stays as it was.
- **The leader.** The daemon holding PostgreSQL's session-level advisory lock
  :data:`~kandevd.store.pg.LEADER_LOCK` (on its listening connection) is the
  leader: it alone runs Office maintenance and fires cron schedules. When it
  dies its session ends, the lock is free, and the next heartbeat of another
  daemon takes it. A cron occurrence is fired only after inserting its
  ``(job, intended time)`` row in ``fires``, so a leader change never fires
  an occurrence twice.
- **Lost claims.** A run of this daemon's that is no longer claimed by it
  (cancelled on another daemon, or rescued because this daemon was taken for
  dead) has its execution stopped here, so it does not run on after another
  daemon took it over.
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import psycopg

from kandevd.config import ClusterConfig
from kandevd.store.postgres import LEADER_LOCK, LOCK_NAMESPACE, PgStore, connect_raw
from kandevd.timeutil import after, rfc3339, utc_now
from kandevd.urls import scrub_secrets

log = logging.getLogger("kandevd.cluster")

#: The LISTEN/NOTIFY channel of the run queue.
CHANNEL = "kandevd_queue"
#: Bus events after which a run may be claimable on another daemon. (An outcome frees
#: an agent, but its daemon claims again in the same pass: it tells the others only
#: when its own slots are full, see :meth:`Cluster.notify`.)
WAKING_EVENTS = ("run.queued", "agent.updated")
_RECONNECT_S = 1.0
#: At most one "my slots filled" NOTIFY per this many seconds (see Cluster.notify).
SATURATED_EVERY_S = 0.1
#: Fires and stopped daemons are kept this long (seconds), then pruned by the leader.
PRUNE_AFTER_S = 7 * 24 * 3600.0


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


def _iso(moment: datetime | None) -> str | None:
    return rfc3339(moment) if moment is not None else None


class Cluster:
    """This daemon's membership in the cluster sharing ``store``."""

    def __init__(self, store: PgStore, config: ClusterConfig, boot_id: str, home: str) -> None:
        self.store = store
        self.config = config
        self.boot_id = boot_id
        self.home = home
        self.host = socket.gethostname()
        self.machine = machine_id()
        self._wake: Callable[[], None] = lambda: None
        self._on_beat: Callable[[bool], None] | None = None
        self._leader = False
        self._stopping = threading.Event()
        self._notify_wanted = threading.Event()
        self._threads: list[threading.Thread] = []
        self._notifier_pid: int | None = None
        self.beats = 0
        #: Earlier daemons of this host and home, kept alive by our heartbeat until settled.
        self.held: list[str] = []
        self._settled = False
        self._beating_since: float | None = None  # monotonic start of unbroken heartbeats
        self._last_beat = 0.0
        #: Other daemons alive at the last heartbeat (assumed until the first one).
        self.peers_alive = True
        self._saturated_at = -SATURATED_EVERY_S  # monotonic time of the last such NOTIFY

    # -- membership ------------------------------------------------------------
    def join(self) -> list[str]:
        """Register this daemon and hold the earlier daemons of this host and home.

        The home lock proves those are gone, and their claims are this daemon's
        to restore (live agents adopted, outcomes on disk recorded). Until
        :meth:`settled`, this daemon's heartbeat keeps theirs fresh too, so no
        other daemon re-queues those claims in the meantime. Returns their
        boot ids.
        """
        with self.store.transaction() as conn:
            # This host (its name and machine id) and home: running, or stopped with
            # claims left behind (a graceful stop leaves its interrupted runs claimed).
            self.held = [row[0] for row in conn.execute(
                "SELECT d.boot_id FROM daemons d WHERE d.host = ? AND d.machine = ?"
                " AND d.home = ? AND d.boot_id != ? AND (d.stopped_at IS NULL OR EXISTS"
                " (SELECT 1 FROM runs r WHERE r.status = 'claimed'"
                " AND r.claimed_by = d.boot_id))",
                (self.host, self.machine, self.home, self.boot_id)).fetchall()]
            if self.held:
                conn.execute("UPDATE daemons SET heartbeat_at = clock_timestamp(),"
                             " stopped_at = NULL WHERE boot_id = ANY(?)", (self.held,))
            conn.execute(
                "INSERT INTO daemons (boot_id, host, machine, pid, home, started_at,"
                " heartbeat_at) VALUES (?, ?, ?, ?, ?, now(), clock_timestamp())",
                (self.boot_id, self.host, self.machine, os.getpid(), self.home))
        log.info("cluster: joined as %s (host %s, pid %d); heartbeat every %gs, dead after %gs",
                 self.boot_id, self.host, os.getpid(), self.config.heartbeat_s,
                 self.config.dead_after_s)
        return list(self.held)

    def settled(self) -> None:
        """The earlier instances' claims are restored or rescued: they are stopped now, and
        this daemon's heartbeat starts its own work (rescues, lost executions)."""
        held, self.held = self.held, []
        self._settled = True
        if held:  # if this fails they are taken for dead after dead_after_s all the same
            self.store.execute("UPDATE daemons SET stopped_at = now() WHERE boot_id = ANY(?)",
                               (held,))

    def leave(self) -> None:
        """Mark this daemon stopped (its claims are settled by now: the runtime stopped)."""
        try:
            self.store.execute("UPDATE daemons SET stopped_at = now() WHERE boot_id = ?",
                               (self.boot_id,))
        except sqlite3.Error as exc:
            log.warning("cluster: could not mark this daemon stopped (%s); the others will "
                        "take it for dead after %gs", exc, self.config.dead_after_s)

    def is_leader(self) -> bool:
        return self._leader

    def fire_gate(self, job: str, intended: datetime) -> bool:
        """The cron loop's gate: the leader fires an occurrence, once across daemons."""
        return self._leader and claim_fire(self.store, self.boot_id, job, intended)

    def members(self) -> list[dict[str, Any]]:
        """Every daemon not stopped: who, where, and whether it is alive."""
        rows = self.store.query(
            "SELECT boot_id, host, pid, home, started_at, heartbeat_at,"
            " heartbeat_at >= now() - make_interval(secs => ?) AS alive"
            " FROM daemons WHERE stopped_at IS NULL ORDER BY started_at",
            (float(self.config.dead_after_s),))
        return [{"boot_id": r["boot_id"], "host": r["host"], "pid": r["pid"],
                 "home": r["home"], "started_at": _iso(r["started_at"]),
                 "heartbeat_at": _iso(r["heartbeat_at"]), "alive": bool(r["alive"]),
                 "self": r["boot_id"] == self.boot_id} for r in rows]

    def status(self) -> dict[str, Any]:
        """``daemon.status``'s ``cluster`` member."""
        try:
            daemons = self.members()
        except sqlite3.Error as exc:
            log.debug("cluster: members cannot be read: %s", exc)
            daemons = []
        return {"daemons": daemons, "leader": self._leader,
                "heartbeat_s": self.config.heartbeat_s, "dead_after_s": self.config.dead_after_s}

    # -- wake-ups ----------------------------------------------------------------
    def on_event(self, topic: str, _payload: Any) -> None:
        """A bus subscriber: a run may be claimable now; tell the other daemons."""
        if topic in WAKING_EVENTS:
            self._notify_wanted.set()

    def notify(self) -> None:
        """A queue pass here filled every free slot: the others may find work left.

        At most one NOTIFY per :data:`SATURATED_EVERY_S`: when every daemon
        is busy, each pass would otherwise wake all the others for nothing,
        and an idle daemon is woken soon enough (enqueues and resumes notify
        at once, without this limit). A daemon alone on the database tells no
        one. (A daemon that joins meanwhile looks at the queue when it starts,
        and is known at the next heartbeat.)
        """
        now = time.monotonic()
        if self.peers_alive and now - self._saturated_at >= SATURATED_EVERY_S:
            self._saturated_at = now
            self._notify_wanted.set()

    # -- threads -----------------------------------------------------------------
    def start(self, *, wake: Callable[[], None],
              on_beat: Callable[[bool], None] | None = None) -> None:
        """Heartbeats, wake-ups and leadership from now on.

        ``wake()`` when another daemon may have made work claimable here;
        ``on_beat(rescue)`` at every heartbeat once settled: stop executions
        lost here, and with ``rescue`` (steady for dead_after_s) re-queue dead
        daemons' claims.
        """
        self._wake = wake
        self._on_beat = on_beat
        for name, target in (("kandevd-cluster", self._listen_and_beat),
                             ("kandevd-cluster-notify", self._notify_loop)):
            thread = threading.Thread(target=target, name=name)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop both threads (the leader lock goes with the listening connection)."""
        self._stopping.set()
        self._notify_wanted.set()
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        self._leader = False

    def _connect(self, name: str) -> psycopg.Connection[Any]:
        return connect_raw(self.store.url, name)

    def _notify_loop(self) -> None:
        """Send one NOTIFY per burst of events, from a connection of its own."""
        conn: psycopg.Connection[Any] | None = None
        while True:
            self._notify_wanted.wait()
            if self._stopping.is_set():
                break
            self._notify_wanted.clear()
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = self._connect("kandevd-notify")
                    self._notifier_pid = conn.info.backend_pid
                conn.execute(f"NOTIFY {CHANNEL}")
            except (psycopg.Error, sqlite3.Error) as exc:
                log.warning("cluster: NOTIFY failed (%s); the others find the work on their "
                            "safety pass", scrub_secrets(str(exc), self.store.url))
                conn = None
                self._stopping.wait(_RECONNECT_S)
        try:  # wake our own listener, so it stops now rather than at its timeout
            if conn is None or conn.closed or conn.broken:
                conn = self._connect("kandevd-notify")
            conn.execute(f"NOTIFY {CHANNEL}, 'stop:{self.boot_id}'")
        except (psycopg.Error, sqlite3.Error):
            pass  # the listener stops at its next timeout (heartbeat_s) instead
        finally:
            if conn is not None:
                conn.close()

    def _listen_and_beat(self) -> None:
        """LISTEN, and between notifications heartbeat every ``heartbeat_s``."""
        conn: psycopg.Connection[Any] | None = None
        next_beat = 0.0
        while not self._stopping.is_set():
            try:
                if conn is None or conn.closed or conn.broken:
                    if self._leader:
                        log.warning("cluster: the connection holding the leader lock broke; "
                                    "no longer the leader")
                    self._leader = False
                    conn = self._connect("kandevd-cluster")
                    conn.execute(f"LISTEN {CHANNEL}")
                    self._wake()  # anything missed while not listening
                timeout = max(0.0, next_beat - time.monotonic())
                for note in conn.notifies(timeout=timeout, stop_after=1):
                    if note.payload == f"stop:{self.boot_id}":
                        break
                    if note.pid != self._notifier_pid:
                        self._wake()
                if self._stopping.is_set():
                    break
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.config.heartbeat_s
                    self._beat(conn)
            except (psycopg.Error, sqlite3.Error) as exc:
                log.warning("cluster: connection to the database failed (%s); retrying",
                            scrub_secrets(str(exc), self.store.url))
                if conn is not None:
                    conn.close()
                conn = None
                self._beating_since = None  # not steady until it has beaten again a while
                self._stopping.wait(_RECONNECT_S)
            except Exception:
                log.exception("cluster: heartbeat failed; retrying")
                self._stopping.wait(_RECONNECT_S)
        if conn is not None:
            conn.close()  # releases the leader lock

    def _beat(self, conn: psycopg.Connection[Any]) -> None:
        """One heartbeat: on the listening connection, in autocommit, stamped when written
        (``clock_timestamp()``), so it waits for no writer lock and is never born old."""
        ours = [self.boot_id, *self.held]
        conn.execute("UPDATE daemons SET heartbeat_at = clock_timestamp()"
                     " WHERE boot_id = ANY(%s)", (ours,))
        row = conn.execute("SELECT EXISTS (SELECT 1 FROM daemons WHERE boot_id != ALL(%s)"
                           " AND stopped_at IS NULL AND heartbeat_at > clock_timestamp()"
                           " - make_interval(secs => %s))",
                           (ours, self.config.dead_after_s)).fetchone()
        self.peers_alive = bool(row and row[0])
        self.beats += 1
        now = time.monotonic()
        if self._beating_since is None or now - self._last_beat > 2 * self.config.heartbeat_s:
            self._beating_since = now  # a gap: steady again only after dead_after_s
        self._last_beat = now
        if not self._leader:
            row = conn.execute("SELECT pg_try_advisory_lock(%s, %s)",
                               (LOCK_NAMESPACE, LEADER_LOCK)).fetchone()
            if row and row[0]:
                self._leader = True
                log.info("cluster: this daemon is the leader (Office maintenance, cron)")
        if self._leader and self.beats % 1000 == 1:
            self._prune()
        # Others' claims are rescued only once this daemon has itself been beating for
        # dead_after_s: after an outage of the database every heartbeat is old, and the
        # first daemon back must not take everyone else for dead. Executions lost here
        # are stopped at every beat.
        steady = now - self._beating_since >= self.config.dead_after_s
        if self._on_beat is not None and self._settled:
            self._on_beat(steady)

    def _prune(self) -> None:
        """The leader forgets fires and stopped daemons older than a week, and folds the
        run-count shards of connections that are gone into shard 0."""
        try:
            with self.store.transaction() as conn:
                conn.execute(
                    "WITH gone AS (DELETE FROM run_counts WHERE shard > 0 AND shard NOT IN"
                    " (SELECT pid FROM pg_stat_activity WHERE pid IS NOT NULL)"
                    " RETURNING status, n)"
                    " INSERT INTO run_counts (status, shard, n)"
                    " SELECT status, 0, SUM(n) FROM gone GROUP BY status"
                    " ON CONFLICT (status, shard) DO UPDATE SET n = run_counts.n + excluded.n")
                conn.execute("DELETE FROM fires WHERE fired_at < ?",
                             (rfc3339(after(utc_now(), -PRUNE_AFTER_S)),))
                conn.execute("DELETE FROM daemons WHERE stopped_at < now()"
                             " - make_interval(secs => ?)", (PRUNE_AFTER_S,))
        except sqlite3.Error as exc:
            log.debug("cluster: pruning fires and daemons failed: %s", exc)


def claim_fire(store: PgStore, boot_id: str, job: str, intended: datetime) -> bool:
    """Record the fire of ``job``'s occurrence at ``intended``; False if it was fired already."""
    return store.execute(
        "INSERT INTO fires (job, intended_at, fired_by, fired_at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT DO NOTHING", (job, rfc3339(intended), boot_id, rfc3339(utc_now()))) == 1
