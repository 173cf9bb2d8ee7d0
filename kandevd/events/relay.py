"""EventRelay: with several daemons on one PostgreSQL database, every daemon's events
reach every daemon's subscribers.

Each daemon sends the events it publishes on the channel ``kandevd_events``
(``NOTIFY``, from a connection of its own, in the order they happened, a batch
per round trip) and ``LISTEN``s there for the others'. An event too large for a
notification (8000 bytes) travels as its run's id, and the receiver reads the
run. Every event, this daemon's own included, is then held :data:`HOLD_S` and
handed on in the order of its time (``at``): a run queued on one daemon and
claimed on another reaches a subscriber queued first, as long as the machines'
clocks agree better than the time between the two (NTP does). A daemon cut off
from the database keeps serving its own events; the others' it receives again
once it has reconnected (those sent meanwhile are not replayed).
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import psycopg

from kandevd.store import cluster as tables
from kandevd.store.postgres import connect_raw
from kandevd.timeutil import rfc3339, utc_now

log = logging.getLogger("kandevd.events")

#: How long an event is held so that other daemons' earlier events can pass it.
HOLD_S = 0.2
#: A notification's payload must stay under PostgreSQL's 8000 bytes.
MAX_PAYLOAD = 7800
#: Events waiting to be sent; beyond, the oldest are dropped (logged).
MAX_OUTGOING = 10000
#: Events per round trip.
BATCH = 100
#: Events held for their turn at most (beyond, the oldest is handed on at once).
MAX_HELD = 10000
#: Topics each daemon's subscribers hear only from their own daemon.
LOCAL_TOPICS = frozenset({"daemon.stopping"})
_TICK_S = 0.05
_RECONNECT_S = 1.0

Deliver = Callable[[str, str, Mapping[str, Any]], None]


class EventRelay:
    """``publish`` is the hub's sink on a shared database; ``start``/``stop`` its thread."""

    def __init__(self, url: str, boot_id: str, deliver: Deliver,
                 read_run: Callable[[str], Mapping[str, Any] | None], *,
                 hold_s: float = HOLD_S) -> None:
        self.url = url
        self.boot_id = boot_id
        self.deliver = deliver
        self.read_run = read_run
        self.hold_s = hold_s
        self._lock = threading.Lock()
        self._outgoing: deque[str] = deque()
        self._held: list[tuple[str, int, str, Mapping[str, Any]]] = []
        self._order = itertools.count()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped = 0
        self.received = 0

    def publish(self, topic: str, at: str, data: Mapping[str, Any]) -> None:
        """An event of this daemon: held for its subscribers, sent to the others (but
        ``daemon.stopping``: each daemon's subscribers hear their own daemon's)."""
        if topic in LOCAL_TOPICS:
            with self._lock:
                self._hold(at, topic, data)
            return
        payload = json.dumps({"o": self.boot_id, "t": topic, "a": at, "d": data},
                             separators=(",", ":"), default=str)
        if len(payload.encode("utf-8")) > MAX_PAYLOAD:
            payload = json.dumps({"o": self.boot_id, "t": topic, "a": at,
                                  "r": data.get("id")}, separators=(",", ":"))
        with self._lock:
            self._hold(at, topic, data)
            if len(self._outgoing) >= MAX_OUTGOING:
                self._outgoing.popleft()
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    log.warning("events: %d event(s) not sent to the other daemons (the "
                                "database is not keeping up)", self.dropped)
            self._outgoing.append(payload)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kandevd-events-relay")
            self._thread.start()

    def stop(self) -> None:
        """Hand on what is held, then stop (joined)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.flush(hold_s=0.0)

    def flush(self, hold_s: float | None = None) -> int:
        """Hand on the events held at least ``hold_s``, oldest first; how many."""
        hold = self.hold_s if hold_s is None else hold_s
        cutoff = "~" if hold <= 0 else rfc3339(utc_now() - timedelta(seconds=hold))
        ready: list[tuple[str, Mapping[str, Any], str]] = []
        with self._lock:
            while self._held and self._held[0][0] <= cutoff:
                at, _n, topic, data = heapq.heappop(self._held)
                ready.append((topic, data, at))
        for topic, data, at in ready:
            self.deliver(topic, at, data)
        return len(ready)

    # -- the thread -----------------------------------------------------------------
    def _wait_handing_on(self, seconds: float) -> None:
        """Wait ``seconds``, this daemon's own events still handed on meanwhile."""
        deadline = time.monotonic() + seconds
        while not self._stopping.is_set() and time.monotonic() < deadline:
            self.flush()
            self._stopping.wait(_TICK_S)

    def _run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        failing = False
        while not self._stopping.is_set():
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = connect_raw(self.url, "kandevd-events", autocommit=True)
                    tables.listen_events(conn)
                self._send(conn)
                for note in conn.notifies(timeout=_TICK_S, stop_after=BATCH):
                    self._received(note.payload)
                self.flush()
            except (psycopg.Error, sqlite3.Error, OSError, ValueError) as exc:
                if not failing:  # (once per outage)
                    log.warning("events: the connection to the database failed (%s); "
                                "other daemons' events wait until it is back", exc)
                failing = True
                if conn is not None:
                    conn.close()
                conn = None
                self._wait_handing_on(_RECONNECT_S)
                continue
            except Exception:
                log.exception("events: the relay failed; retrying")
                self._wait_handing_on(_RECONNECT_S)
                continue
            if failing:
                log.info("events: connected to the database again")
                failing = False
        if conn is not None:
            try:
                self._send(conn)  # (the last ones: the runs the stop interrupted)
            except psycopg.Error:
                pass
            conn.close()

    def _send(self, conn: psycopg.Connection[Any]) -> None:
        while True:
            with self._lock:
                batch = [self._outgoing.popleft()
                         for _ in range(min(BATCH, len(self._outgoing)))]
            if not batch:
                return
            try:
                tables.notify_events(conn, batch)
            except BaseException:  # (sent again once connected again)
                with self._lock:
                    self._outgoing.extendleft(reversed(batch))
                raise

    def _received(self, payload: str) -> None:
        try:
            event = json.loads(payload)
            origin, topic, at = event["o"], event["t"], event["a"]
        except (ValueError, KeyError, TypeError):
            return
        if origin == self.boot_id:
            return  # (held already, since it was published)
        data = event.get("d")
        if data is None and isinstance(event.get("r"), str):
            data = self.read_run(event["r"])
        if not isinstance(data, dict):
            return
        self.received += 1
        with self._lock:
            self._hold(str(at), str(topic), data)

    def _hold(self, at: str, topic: str, data: Mapping[str, Any]) -> None:
        """Keep an event for its turn (under the lock); beyond MAX_HELD (nothing handed
        on for long) the oldest goes on at once."""
        heapq.heappush(self._held, (at, next(self._order), topic, data))
        while len(self._held) > MAX_HELD:
            old_at, _n, old_topic, old_data = heapq.heappop(self._held)
            self.deliver(old_topic, old_at, old_data)
