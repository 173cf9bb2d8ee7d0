"""OfficeLoop: the Office maintenance cadence (``office.interval_s``).

A Loop of its own - not the queue loop's safety pass: the queue never runs
Office work. Each tick fans out the three handlers (unstarted-task recovery,
routines, budgets) with the Loop's :class:`~kandevd.lifecycle.FanOut`, so a
slow handler does not delay the others and ``stop()`` joins all of them.
Each handler is gated on persisted Office configuration and first runs its
own existence check, so a configuration created at run time (a first Office
workflow or project, routine or budget) takes effect on the next tick, and
without any of it a tick performs three tiny queries and no scan.

``tick(now)`` is a plain method: tests drive it with any ``now``.
:meth:`OfficeLoop.stats` feeds ``daemon.status``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime
from functools import partial
from typing import Any, Protocol

from kandevd.bus import EventBus
from kandevd.config import OfficeConfig
from kandevd.lifecycle import Loop
from kandevd.office import HandlerResult
from kandevd.office.budgets import BudgetGuard
from kandevd.office.recovery import UnstartedTaskRecovery
from kandevd.office.routines import RoutineScheduler
from kandevd.runqueue.service import RunQueue
from kandevd.store.base import BaseStore, is_environmental

#: How soon a daemon that is not the leader looks again whether it has become it.
FOLLOWER_RECHECK_S = 2.0

#: handler name -> (stats counter of its scans, stats counter of what it did)
COUNTERS = {
    "recovery": ("recovery_scans", "recovered"),
    "routines": ("routine_scans", "routine_fires"),
    "budgets": ("budget_scans", "budget_alerts"),
}


class Handler(Protocol):
    name: str

    def tick(self, now: datetime) -> HandlerResult: ...


class OfficeLoop(Loop):
    def __init__(self, store: BaseStore, queue: RunQueue, bus: EventBus, config: OfficeConfig,
                 *, handlers: list[Handler] | None = None,
                 leader: Callable[[], bool] | None = None, **kwargs: Any) -> None:
        super().__init__("office", **kwargs)
        self.fanout.quiet = is_environmental  # (a database outage: a line a tick, no trace)
        #: Several daemons (PostgreSQL): only the leader runs Office maintenance; the
        #: others look again every few seconds, to take over quickly when it dies.
        self.leader = leader
        self.interval_s = float(config.interval_s)
        self.handlers: list[Handler] = handlers if handlers is not None else [
            UnstartedTaskRecovery(store, queue, lookback_hours=config.recovery_lookback_hours),
            RoutineScheduler(store, queue),
            BudgetGuard(store, bus),
        ]
        self._stats_lock = threading.Lock()
        self._stats = {"ticks": 0, "handler_errors": 0,
                       **{name: 0 for pair in COUNTERS.values() for name in pair}}

    def tick(self, now: datetime) -> float:
        if self.leader is not None and not self.leader():
            return min(self.interval_s, FOLLOWER_RECHECK_S)
        jobs: list[tuple[str, Callable[[], Any]]] = [
            (handler.name, partial(handler.tick, now)) for handler in self.handlers]
        results = self.fanout.run(jobs)
        with self._stats_lock:
            self._stats["ticks"] += 1
            for name, result in results.items():
                if isinstance(result, BaseException):
                    self._stats["handler_errors"] += 1  # FanOut logged it
                    continue
                scans, acted = COUNTERS.get(name, (f"{name}_scans", f"{name}_acted"))
                if isinstance(result, HandlerResult) and result.scanned:
                    self._stats[scans] = self._stats.get(scans, 0) + 1
                    self._stats[acted] = self._stats.get(acted, 0) + result.acted
        return self.interval_s

    def stats(self) -> dict[str, int]:
        """Counters since start: ticks, scans per handler, runs/alerts they produced."""
        with self._stats_lock:
            return dict(self._stats)
