"""EventHub: the daemon's events handed to the clients that subscribed to them.

Publishing never waits for a client. An event is encoded once (the JSON-RPC
notification line every subscriber sends as it is) and appended to the
bounded buffer of each subscription whose patterns match its topic. A
subscription whose buffer is full loses the newer events and counts them; the
count reaches its client as one ``events.lost`` notification, in the place
where they would have been, and the stream goes on. A subscription is read by
its own connection's thread (:meth:`Subscription.take`), so a slow client only
ever slows itself.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from kandevd.events.topics import matches

log = logging.getLogger("kandevd.events")

#: Events a subscription holds for a client that reads slowly (then it loses them).
BUFFER_EVENTS = 1000
#: The hub hands events on in batches at most this often (a lone event at once).
GATHER_S = 0.05
#: Events waiting for the hub's thread; beyond, events are dropped (counted).
MAX_PENDING = 100_000


def notification(method: str, params: Mapping[str, Any]) -> bytes:
    """One JSON-RPC notification line."""
    return json.dumps({"jsonrpc": "2.0", "method": method, "params": params},
                      separators=(",", ":"), default=str).encode("utf-8") + b"\n"


def lost_line(count: int) -> bytes:
    return notification("events.lost", {"count": count})


class Subscription:
    """One client's patterns and its bounded buffer of encoded events."""

    def __init__(self, subscription_id: str, patterns: Sequence[str],
                 capacity: int = BUFFER_EVENTS) -> None:
        self.id = subscription_id
        self.patterns = tuple(patterns)
        self.capacity = capacity
        self._items: deque[bytes] = deque()
        self._lost = 0
        self._cond = threading.Condition(threading.Lock())
        self.closed = False
        #: Every event lost so far (the ``events.lost`` counts add up to it).
        self.lost_total = 0

    def wants(self, topic: str) -> bool:
        return any(matches(pattern, topic) for pattern in self.patterns)

    def offer(self, line: bytes) -> None:
        """Keep ``line`` for the client, or count it lost when the buffer is full."""
        with self._cond:
            if self.closed:
                return
            if len(self._items) >= self.capacity:
                self._lost += 1
                self.lost_total += 1
                return
            if self._lost:  # (room again: the loss is told where it happened)
                self._items.append(lost_line(self._lost))
                self._lost = 0
            self._items.append(line)
            if len(self._items) == 1:
                self._cond.notify()

    def offer_many(self, lines: list[bytes]) -> None:
        """:meth:`offer` for a batch, under one lock and one wake-up."""
        with self._cond:
            if self.closed:
                return
            room = self.capacity - len(self._items)
            kept, dropped = lines[:max(room, 0)], max(len(lines) - max(room, 0), 0)
            if kept:
                if self._lost:
                    self._items.append(lost_line(self._lost))
                    self._lost = 0
                was_empty = not self._items
                self._items.extend(kept)
                if was_empty:
                    self._cond.notify()
            self._lost += dropped
            self.lost_total += dropped

    def take(self, timeout: float) -> list[bytes]:
        """Every line waiting (after at most ``timeout`` seconds without any), a loss
        not told yet at the end."""
        with self._cond:
            if not self._items and not self._lost and not self.closed:
                self._cond.wait(timeout)
            taken = list(self._items)
            self._items.clear()
            if self._lost:
                taken.append(lost_line(self._lost))
                self._lost = 0
            return taken

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._items.clear()
            self._cond.notify_all()


class EventHub:
    """Thread-safe: any thread publishes, each subscriber's connection thread reads.

    A publisher only appends the event to a list; the hub's own thread (``start``)
    encodes each event once and hands the subscriptions their share in batches, at
    most every :data:`GATHER_S` (a lone event at once). So publishing costs the same
    whether one client listens or fifty."""

    def __init__(self, capacity: int = BUFFER_EVENTS) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._subscriptions: dict[str, Subscription] = {}
        self._by_topic: dict[str, tuple[Subscription, ...]] = {}
        self._ids = itertools.count(1)
        self._pending: list[tuple[str, str, Mapping[str, Any]]] = []
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.published = 0
        #: Events dropped because the hub's thread fell :data:`MAX_PENDING` behind.
        self.dropped = 0

    def subscribe(self, patterns: Sequence[str], capacity: int | None = None
                  ) -> Subscription:
        with self._lock:
            subscription = Subscription(f"sub-{next(self._ids)}", patterns,
                                        capacity or self.capacity)
            self._subscriptions[subscription.id] = subscription
            self._by_topic.clear()
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        subscription.close()
        with self._lock:
            self._subscriptions.pop(subscription.id, None)
            self._by_topic.clear()

    def count(self) -> int:
        with self._lock:
            return len(self._subscriptions)

    @property
    def listened(self) -> bool:
        """Has anyone subscribed? (Read without the lock: a hint that lets a publisher
        skip building an event nobody would receive.)"""
        return bool(self._subscriptions)

    def deliver(self, topic: str, at: str, data: Mapping[str, Any]) -> None:
        """Hand one event on to the subscriptions that want it (at the next batch)."""
        if not self._subscriptions:
            return
        with self._lock:
            if len(self._pending) >= MAX_PENDING:
                self.dropped += 1
                return
            self._pending.append((topic, at, data))
            first = len(self._pending) == 1
        if first:
            self._wake.set()

    def flush(self) -> int:
        """Encode the events waiting (once each) and hand each subscription its share
        in one batch; how many events. (The hub's thread does this; a test may.)"""
        with self._lock:
            batch, self._pending = self._pending, []
            if not batch:
                return 0
            shares: dict[Subscription, list[bytes]] = {}
            wanted_by: list[tuple[Subscription, ...]] = []
            for topic, _at, _data in batch:
                wanted = self._by_topic.get(topic)
                if wanted is None:
                    wanted = tuple(s for s in self._subscriptions.values() if s.wants(topic))
                    self._by_topic[topic] = wanted
                wanted_by.append(wanted)
        for (topic, at, data), wanted in zip(batch, wanted_by, strict=True):
            if not wanted:
                continue
            line = notification("event", {"topic": topic, "at": at, "data": data})
            for subscription in wanted:
                shares.setdefault(subscription, []).append(line)
        self.published += len(batch)
        for subscription, lines in shares.items():
            subscription.offer_many(lines)
        return len(batch)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kandevd-events")
            self._thread.start()

    def stop(self) -> None:
        """Hand on what waits, then stop the thread (joined)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.flush()

    def _run(self) -> None:
        last = 0.0
        while not self._stopping.is_set():
            self._wake.wait()
            self._wake.clear()
            gathering = last + GATHER_S - time.monotonic()
            if gathering > 0:
                self._stopping.wait(gathering)
            last = time.monotonic()
            try:
                self.flush()
            except Exception:  # (an event that cannot be encoded: logged, the rest go on)
                log.exception("events: a batch could not be handed on")

    def close(self) -> None:
        """Every subscription ends (its connection closes)."""
        with self._lock:
            every = list(self._subscriptions.values())
            self._subscriptions.clear()
            self._by_topic.clear()
        for subscription in every:
            subscription.close()
