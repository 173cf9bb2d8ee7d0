"""EventBus: in-process publish/subscribe between components.

Delivery is synchronous, in the publisher's thread, in subscription order.
That keeps ordering obvious (an Office subscriber sees ``task.created``
before the request that created the task returns) and needs no thread of its
own. A failing subscriber is logged and isolated: the publisher and the other
subscribers never see its exception. After :meth:`EventBus.close` events are
counted as dropped and not delivered; the coordinator closes the bus only
after every loop has joined, so in a normal stop nothing is dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

Handler = Callable[[str, Mapping[str, Any]], None]

log = logging.getLogger("kandevd.bus")


class EventBus:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscribers: dict[str, list[Handler]] = {}
        self._closed = False
        self.published = 0
        self.dropped = 0

    def subscribe(self, topic: str, handler: Handler) -> None:
        """Call ``handler(topic, payload)`` for every event on ``topic`` ("*" = all)."""
        with self._lock:
            self._subscribers.setdefault(topic, []).append(handler)

    def publish(self, topic: str, payload: Mapping[str, Any] | None = None) -> None:
        with self._lock:
            if self._closed:
                self.dropped += 1
                return
            self.published += 1
            handlers = list(self._subscribers.get(topic, ())) + list(
                self._subscribers.get("*", ())
            )
        data = dict(payload or {})
        for handler in handlers:
            try:
                handler(topic, data)
            except Exception:
                log.exception("subscriber %r failed on %s", handler, topic)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._subscribers.clear()

    @property
    def closed(self) -> bool:
        return self._closed
