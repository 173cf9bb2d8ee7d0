"""``events.subscribe``: the connection carries the daemon's events from its answer on
(docs/protocol.md, "Events"; the topics are kandevd/events/topics.py's)."""

from __future__ import annotations

from typing import Any

from kandevd.control.protocol import InvalidParams
from kandevd.control.registry import Registry, object_schema
from kandevd.control.services import Services
from kandevd.control.streaming import Streaming
from kandevd.events.topics import bad_pattern

#: Patterns one subscription may name.
MAX_PATTERNS = 50

TOPICS = {"type": "array", "minItems": 1, "maxItems": MAX_PATTERNS,
          "items": {"type": "string", "minLength": 1, "maxLength": 100}}


def register(registry: Registry, services: Services) -> None:
    def subscribe(params: dict[str, Any]) -> Streaming:
        patterns = list(dict.fromkeys(params["topics"]))
        bad = [why for why in (bad_pattern(p) for p in patterns) if why is not None]
        if bad:
            raise InvalidParams(f"params.topics: {'; '.join(bad)}")
        hub = services.events
        subscription = hub.subscribe(patterns)
        return Streaming({"subscription": subscription.id, "topics": patterns},
                         subscription, lambda: hub.unsubscribe(subscription))

    registry.add("events.subscribe", subscribe, object_schema({"topics": TOPICS}, ("topics",)),
                 summary="Receive the daemon's events on this connection from now on, one "
                         "notification per line (docs/protocol.md, Events).",
                 result="{subscription, topics}", reads=False)
