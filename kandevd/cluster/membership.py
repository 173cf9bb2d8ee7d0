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
- **Wake-ups.** Each daemon ``LISTEN``s on the queue's channel
  (:data:`kandevd.store.cluster.CHANNEL`). A run queued, finished, failed or
  cancelled here (each can make a run claimable) sends one
  ``NOTIFY`` (bursts coalesce into one), and the other daemons wake their
  queue loops at once; the safety pass stays as it was.
- **The leader** (Office maintenance, cron fires) holds the lease
  ``leases('leader')``, renewed at each heartbeat
  and ending on its own side first; another daemon takes it once expired, so
  leadership moves within ``dead_after_s + heartbeat_s``. A new leader fires,
  late, the occurrences of the gap that have no row in ``fires``: an
  occurrence is fired after inserting its ``(job, intended time)`` row in
  ``fires`` in a statement that checks the lease, so it fires once, and never
  by a deposed leader.
- **Fencing.** A daemon whose heartbeats stop completing stops its own agents
  before the others take it for dead (:mod:`kandevd.cluster.fence`).
- **Lost claims.** A run of this daemon's that is no longer claimed by it
  (cancelled on another daemon, or rescued because this daemon was taken for
  dead) has its execution stopped here, so it does not run on after another
  daemon took it over.

The statements themselves are :mod:`kandevd.store.cluster`'s.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import sqlite3
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import psycopg

from kandevd.cluster.fence import Fence
from kandevd.cluster.hooks import ClusterHooks
from kandevd.cluster.timing import boot_clock
from kandevd.config import ClusterConfig
from kandevd.net.urls import scrub_secrets
from kandevd.store import cluster as tables
from kandevd.store.postgres import PgStore, connect_raw
from kandevd.timeutil import rfc3339

log = logging.getLogger("kandevd.cluster")
#: Bus events after which a run may be claimable on another daemon. (An outcome frees
#: an agent, but its daemon claims again in the same pass: it tells the others only
#: when its own slots are full, see :meth:`Cluster.notify`.)
WAKING_EVENTS = ("run.queued", "agent.updated")
_RECONNECT_S = 1.0
#: At most one "my slots filled" NOTIFY per this many seconds (see Cluster.notify).
SATURATED_EVERY_S = 0.1
#: Fires and stopped daemons are kept this long (seconds), then pruned by the leader.
PRUNE_AFTER_S = 7 * 24 * 3600.0
#: A new leader fires the occurrences no leader made since the last renewal of a lease
#: that lapsed at most this long ago (longer: the whole cluster was down, and fires
#: missed while no daemon ran are not replayed).
LATE_FIRES_MAX_S = 120.0



def _iso(moment: datetime | None) -> str | None:
    return rfc3339(moment) if moment is not None else None


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


class Cluster:
    """This daemon's membership in the cluster sharing ``store``."""

    def __init__(self, store: PgStore, config: ClusterConfig, boot_id: str, home: str) -> None:
        self.store = store
        self.tables = tables.ClusterTables(store)
        self.config = config
        self.boot_id = boot_id
        self.home = home
        self.host = socket.gethostname()
        self.machine = machine_id()
        self._wake: Callable[[], None] = lambda: None
        self._on_beat: Callable[[bool], None] | None = None
        self._on_fence: Callable[[str], None] = lambda _reason: None
        self._on_heal: Callable[[float], None] = lambda _away: None
        self._on_leader: Callable[[datetime | None], None] = lambda _since: None
        self._leader = False
        #: Monotonic end of this daemon's leadership on its own side.
        self._lease_until = 0.0
        timing = config.fencing
        self.lease_s = config.dead_after_s
        self._lease_margin_s = timing.margin_s + timing.kill_grace_s / 2
        self.fence = Fence(timing, on_fence=self._fenced, on_heal=self._healed,
                           enabled=config.on_partition == "fence")
        self.leader_changes = 0
        self._resigned = False
        #: Earlier instances of this home (their lease is not a failover's).
        self._earlier: set[str] = set()
        self._beat_work: queue.SimpleQueue[bool | None] = queue.SimpleQueue()
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
        self._members_seen: list[dict[str, Any]] = []  # (as last read)
        store.reach_check = self.out_of_touch
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
        # This host (its name and machine id) and home: running, or stopped with
        # claims left behind (a graceful stop leaves its interrupted runs claimed).
        self.held = self.tables.join(self.boot_id, self.host, self.machine, self.home)
        self._earlier = set(self.held)
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
            self.tables.mark_stopped(held)

    def leave(self) -> None:
        """Mark this daemon stopped (its claims are settled by now: the runtime stopped)."""
        try:
            self.tables.mark_stopped([self.boot_id])
        except sqlite3.Error as exc:
            log.warning("cluster: could not mark this daemon stopped (%s); the others will "
                        "take it for dead after %gs", exc, self.config.dead_after_s)

    def is_leader(self) -> bool:
        """The leader, as far as this daemon can tell: its lease is not over on its side."""
        if self._leader and boot_clock() >= self._lease_until:
            self._step_down("its lease was not renewed in time")
        return self._leader

    def _step_down(self, why: str) -> None:
        if self._leader:
            self._leader = False
            log.warning("cluster: no longer the leader (%s)", why)

    def fire_gate(self, job: str, intended: datetime) -> bool:
        """The cron loop's gate: the leader fires an occurrence, once across daemons."""
        return self.is_leader() and self.tables.claim_fire(self.boot_id, job, intended)

    # -- fencing -------------------------------------------------------------------
    def _fenced(self, reason: str) -> None:
        self._step_down("fenced")
        self._on_fence(reason)

    def _healed(self, away: float) -> None:
        self._on_heal(away)

    def members(self) -> list[dict[str, Any]]:
        """Every daemon not stopped: who, where, and whether it is alive."""
        return [{"boot_id": m.boot_id, "host": m.host, "pid": m.pid, "home": m.home,
                 "started_at": _iso(m.started_at), "heartbeat_at": _iso(m.heartbeat_at),
                 "alive": m.alive, "self": m.boot_id == self.boot_id}
                for m in self.tables.members(self.config.dead_after_s)]

    def out_of_touch(self) -> str | None:
        """Why the database is out of reach now (``BaseStore.out_of_reach``): fenced, or
        no heartbeat completed for two of their intervals. None: it answered lately."""
        if self.fence.fenced:
            return "fenced: this daemon is cut off from the database"
        silent = time.monotonic() - self._last_beat
        if self._last_beat and silent > 2 * self.config.heartbeat_s + 1.0:
            return f"no heartbeat completed for {silent:.0f}s"
        return None

    def status(self, *, read: bool = True) -> dict[str, Any]:
        """``daemon.status``'s ``cluster`` member (not ``read``: the daemons last read)."""
        daemons = self._members_seen
        if read:
            try:
                daemons = self._members_seen = self.members()
            except Exception as exc:  # (status answers whatever the database does)
                log.debug("cluster: members cannot be read: %s", exc)
        return {"daemons": daemons, "leader": self.is_leader(), "fenced": self.fence.fenced,
                "on_partition": self.config.on_partition,
                "fence_after_s": self.fence.timing.after_s if self.fence.enabled else None,
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
    def start(self, hooks: ClusterHooks) -> None:
        """Heartbeats, wake-ups, leadership and fencing from now on, told to ``hooks``."""
        self._wake = hooks.wake
        self._on_beat = hooks.on_beat
        self._on_fence = hooks.on_fence or self._on_fence
        self._on_heal = hooks.on_heal or self._on_heal
        self._on_leader = hooks.on_leader or self._on_leader
        self.fence.start()
        for name, target in (("kandevd-cluster", self._listen_and_beat),
                             ("kandevd-cluster-notify", self._notify_loop),
                             ("kandevd-cluster-settle", self._settle_loop)):
            thread = threading.Thread(target=target, name=name)
            thread.start()
            self._threads.append(thread)

    def resign(self) -> None:
        """Give up the lease now (the loops stopped: this daemon fires nothing more):
        expired at once, so the next leader takes it at its next heartbeat and fires
        what falls due from then on, and what has no row since."""
        self._resigned = True
        self._step_down("this daemon is stopping")
        try:
            self.tables.give_up_lease(self.boot_id)
        except sqlite3.Error as exc:  # it expires after dead_after_s all the same
            log.debug("cluster: giving up the lease failed: %s", exc)

    def stop(self) -> None:
        """Stop the threads (and give up the lease, if :meth:`resign` did not yet)."""
        self._stopping.set()
        self._notify_wanted.set()
        self._beat_work.put(None)
        self.fence.stop()
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        if not self._resigned:
            self.resign()

    def _settle_loop(self) -> None:
        """The heartbeat's follow-up work (rescues, lost executions), off its thread;
        beats that came while it worked are folded into one."""
        while True:
            steady = self._beat_work.get()
            try:
                while True:  # only the newest
                    steady = self._beat_work.get_nowait()
            except queue.Empty:
                pass
            if steady is None or self._stopping.is_set():
                return
            try:
                if self._on_beat is not None:
                    self._on_beat(steady)
                if self._leader and self.beats % 1000 <= 1:  # (takes the write lock too)
                    self._prune()
            except Exception:
                log.exception("cluster: settling with the other daemons failed")

    def _prune(self) -> None:
        """The leader forgets fires and stopped daemons older than a week."""
        try:
            self.tables.prune(PRUNE_AFTER_S)
        except sqlite3.Error as exc:
            log.debug("cluster: pruning fires and daemons failed: %s", exc)

    def _connect(self, name: str) -> psycopg.Connection[Any]:
        """A connection whose calls fail within about ``dead_after_s`` when the network
        stops answering (the heartbeat must not hang behind a dead link for long)."""
        bound = max(2, int(self.config.dead_after_s))
        return connect_raw(self.store.url, name, connect_timeout=bound,
                           tcp_user_timeout=bound * 1000, keepalives_idle=1,
                           keepalives_interval=1, keepalives_count=bound)

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
                tables.notify(conn)
            except (psycopg.Error, sqlite3.Error) as exc:
                log.warning("cluster: NOTIFY failed (%s); the others find the work on their "
                            "safety pass", scrub_secrets(str(exc), self.store.url))
                conn = None
                self._stopping.wait(_RECONNECT_S)
        try:  # wake our own listener, so it stops now rather than at its timeout
            if conn is None or conn.closed or conn.broken:
                conn = self._connect("kandevd-notify")
            tables.notify(conn, f"stop:{self.boot_id}")
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
                    conn = self._connect("kandevd-cluster")
                    tables.listen(conn)
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
            conn.close()

    def _beat(self, conn: psycopg.Connection[Any]) -> None:
        """One heartbeat: on the listening connection, in autocommit, stamped when written
        (``clock_timestamp()``), so it waits for no writer lock and is never born old.
        The fence counts from when it was sent (no later than the stamp)."""
        sent = boot_clock()
        ours = [self.boot_id, *self.held]
        present, self.peers_alive = tables.heartbeat(conn, ours, self.boot_id,
                                                     self.config.dead_after_s)
        if not present:  # (marked stopped by another's mistake, or deleted)
            log.warning("cluster: this daemon's heartbeat row is gone or marked stopped; "
                        "writing it again")
        self.beats += 1
        if not self.fence.fenced and not self._resigned:
            self._lease(conn, sent)
        self.fence.beat_ok(sent)
        now = time.monotonic()
        if self._beating_since is None or now - self._last_beat > 2 * self.config.heartbeat_s:
            self._beating_since = now  # a gap: steady again only after dead_after_s
        self._last_beat = now
        # Others' claims are rescued only once this daemon has itself been beating for
        # dead_after_s: after an outage of the database every heartbeat is old, and the
        # first daemon back must not take everyone else for dead. Executions lost here
        # are stopped at every beat.
        steady = now - self._beating_since >= self.config.dead_after_s
        if self._on_beat is not None and self._settled:
            # On a thread of its own: a rescue waiting for the write lock (held by a daemon
            # cut off mid-transaction, say) must not delay the next heartbeat into a fence.
            self._beat_work.put(steady)

    def _lease(self, conn: psycopg.Connection[Any], sent: float) -> None:
        """Take or renew the leader's lease; on a takeover, tell ``on_leader``."""
        lease = tables.take_lease(conn, self.boot_id, self.lease_s)
        if lease is None:  # another daemon holds a lease that has not expired
            self._step_down("another daemon holds the lease")
            return
        self._lease_until = sent + self.lease_s - self._lease_margin_s
        if self._leader:
            return
        self._leader = True
        self.leader_changes += 1
        previous, expired_at, lapsed_s = lease
        since = None
        # A lease that lapsed lately (not a cold start of the whole cluster): the fires
        # since its last renewal may be missing, also when it was this daemon's own (it
        # stepped down, then healed before anyone took over). Not an earlier instance of
        # this home's: a restart does not replay what fell due while it was down.
        if expired_at is not None and lapsed_s is not None \
                and lapsed_s <= LATE_FIRES_MAX_S and previous not in self._earlier:
            since = expired_at - timedelta(seconds=self.lease_s)
        if previous is not None and previous != self.boot_id:
            log.warning("cluster: this daemon is the leader (Office maintenance, cron), "
                        "taking over from %s whose lease expired at %s", previous,
                        rfc3339(expired_at))
        else:
            log.info("cluster: this daemon is the leader (Office maintenance, cron)")
        try:
            self._on_leader(since)
        except Exception:
            log.exception("cluster: taking up leadership failed")
