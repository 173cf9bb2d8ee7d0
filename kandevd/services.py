"""Services: what the control methods may use, handed to them explicitly.

The Daemon builds one and passes it to every method module's ``register``;
no method reaches for globals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kandevd.bus import EventBus
from kandevd.config import Config
from kandevd.paths import HomeLayout
from kandevd.store.base import BaseStore

if TYPE_CHECKING:
    from kandevd.queue.service import RunQueue
    from kandevd.runtime import AgentRuntime


@dataclass
class Services:
    config: Config
    layout: HomeLayout
    store: BaseStore
    bus: EventBus
    runtime: AgentRuntime
    queue: RunQueue
    status: Callable[[], dict[str, Any]]
    request_shutdown: Callable[[], None]
    extras: dict[str, Any] = field(default_factory=dict)
    metrics: Any = None  # kandevd.metrics.DaemonMetrics (``daemon.metrics``)
