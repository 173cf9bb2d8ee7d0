"""Services: what the control methods may use, handed to them explicitly and typed.

The composition root builds one and passes it to every method module's
``register``; no method reaches for globals or a string-keyed locator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kandevd.bus import EventBus
from kandevd.config import Config
from kandevd.events.hub import EventHub
from kandevd.model.service import WorkspaceService
from kandevd.paths import HomeLayout
from kandevd.runqueue.service import RunQueue
from kandevd.runtime import AgentRuntime
from kandevd.schedules.loop import CronLoop
from kandevd.store.base import BaseStore


@dataclass(frozen=True)
class Services:
    config: Config
    layout: HomeLayout
    store: BaseStore
    bus: EventBus
    runtime: AgentRuntime
    queue: RunQueue
    model: WorkspaceService
    cron: CronLoop
    #: ``daemon.status`` (the composition root's status reporter).
    status: Callable[[], dict[str, Any]]
    #: ``daemon.shutdown``: ask for the graceful stop.
    request_shutdown: Callable[[], None]
    #: ``daemon.metrics``: the Prometheus text exposition.
    metrics_text: Callable[[], str]
    #: ``events.subscribe``: the events clients subscribe to.
    events: EventHub
