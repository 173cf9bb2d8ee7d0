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
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from kandevd.events.topics import matches

log = logging.getLogger("kandevd.events")

#: Events a subscription holds for a client that reads slowly (then it loses them).
BUFFER_EVENTS = 1000


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
        self._cond = threading.Condition()
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
    """Thread-safe: any thread publishes, each subscriber's connection thread reads."""

    def __init__(self, capacity: int = BUFFER_EVENTS) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._subscriptions: dict[str, Subscription] = {}
        self._by_topic: dict[str, tuple[Subscription, ...]] = {}
        self._ids = itertools.count(1)
        self.published = 0

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
        """Hand one event to the subscriptions that want it (encoded once)."""
        with self._lock:
            if not self._subscriptions:
                return
            wanted = self._by_topic.get(topic)
            if wanted is None:
                wanted = tuple(s for s in self._subscriptions.values() if s.wants(topic))
                self._by_topic[topic] = wanted
        if not wanted:
            return
        self.published += 1
        line = notification("event", {"topic": topic, "at": at, "data": data})
        for subscription in wanted:
            subscription.offer(line)

    def close(self) -> None:
        """Every subscription ends (its connection closes)."""
        with self._lock:
            every = list(self._subscriptions.values())
            self._subscriptions.clear()
            self._by_topic.clear()
        for subscription in every:
            subscription.close()
