"""EventFeed: the daemon's in-process bus turned into the topics clients subscribe to.

Run events carry the RUN as ``runs.get`` answers it; an Office run's are also
sent under the Office subjects (``office.run.queued``, ``office.run.claimed``,
``office.run.processed``, ``office.run.failed``). Schedule and daemon events
carry their payload as published. Nothing is built while nobody listens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kandevd.timeutil import rfc3339, utc_now

Sink = Callable[[str, str, Mapping[str, Any]], None]

RUN_TOPICS = frozenset({"run.queued", "run.claimed", "run.finished", "run.failed",
                        "run.cancelled", "run.retry_scheduled"})
#: The Office subjects of a run event (an Office run's).
OFFICE_TOPICS: dict[str, tuple[str, ...]] = {
    "run.queued": ("office.run.queued",),
    "run.claimed": ("office.run.claimed",),
    "run.finished": ("office.run.processed",),
    "run.cancelled": ("office.run.processed",),
    "run.failed": ("office.run.processed", "office.run.failed"),
}
PASSED_ON = frozenset({"schedule.fired", "schedule.session_started", "schedule.session_ended",
                       "schedule.paused", "schedule.resumed", "daemon.stopping"})


class EventFeed:
    """A bus subscriber (``"*"``): each event it turns into topics goes to ``sink``."""

    def __init__(self, sink: Sink, *, listened: Callable[[], bool],
                 office_reasons: frozenset[str]) -> None:
        self.sink = sink
        self.listened = listened
        self.office_reasons = office_reasons

    def on_bus(self, topic: str, payload: Mapping[str, Any]) -> None:
        if topic in RUN_TOPICS:
            run = payload.get("run")
            if run is None or not self.listened():
                return
            data = run.to_dict()
            at = rfc3339(utc_now())
            self.sink(topic, at, data)
            if run.reason in self.office_reasons:
                for office in OFFICE_TOPICS.get(topic, ()):
                    self.sink(office, at, data)
        elif topic in PASSED_ON and self.listened():
            self.sink(topic, rfc3339(utc_now()), dict(payload))
