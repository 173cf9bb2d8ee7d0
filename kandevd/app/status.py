"""``daemon.status`` and ``/health``: what the daemon tells about itself.

Polled often (monitors, ``kandevd wait``, the benchmarks), so the parts read
from the database are read again only after something committed: while the
store's change marker stays the same (a daemon idle between runs), the same
answer is given without a query, until a run waiting for its retry back-off
becomes ready to claim (that changes the answer without a commit). Each part
that cannot be read is left out: status must answer, whatever the store does.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypedDict

from kandevd import __version__
from kandevd.config import Config
from kandevd.events.hub import EventHub
from kandevd.lifecycle import Loop
from kandevd.paths import HomeLayout
from kandevd.runqueue.service import RunQueue
from kandevd.runtime import AgentRuntime
from kandevd.runtime.keeperclient import KeeperClient
from kandevd.schedules.loop import CronLoop
from kandevd.store.base import BaseStore
from kandevd.store.runs.retention import db_status
from kandevd.timeutil import parse_rfc3339, rfc3339, utc_now

if TYPE_CHECKING:
    from kandevd.cluster.membership import Cluster

log = logging.getLogger("kandevd.daemon")

LOOP_NAMES = ("queue", "office", "cron")


class StatusDocument(TypedDict, total=False):
    """``daemon.status``: the daemon as a whole (docs/protocol.md has every member)."""

    version: str
    pid: int
    state: str
    started_at: str
    home: str
    boot_id: str
    loops: dict[str, str]
    runtime: dict[str, Any]
    store: dict[str, Any]
    runs: dict[str, Any]
    scheduler: dict[str, Any]
    cluster: dict[str, Any]
    stats: dict[str, Any]


class StatusReporter:
    def __init__(self, config: Config, layout: HomeLayout, store: BaseStore,
                 runtime: AgentRuntime, queue: RunQueue, loops: Mapping[str, Loop],
                 cron: CronLoop, cluster: Cluster | None, *, boot_id: str, started_at: str,
                 state: Callable[[], str], keeper: KeeperClient | None = None,
                 events: EventHub | None = None) -> None:
        """``state()``: the daemon's (starting, running, stopping)."""
        self.keeper = keeper
        self.events = events
        self.config = config
        self.layout = layout
        self.store = store
        self.runtime = runtime
        self.queue = queue
        self.loops = loops
        self.cron = cron
        self.cluster = cluster
        self.boot_id = boot_id
        self.started_at = started_at
        self.state = state
        self._cache: tuple[object, dict[str, Any]] | None = None

    def status(self) -> StatusDocument:
        loops = {name: "stopped" for name in LOOP_NAMES}
        for name, loop in self.loops.items():
            loops[name] = loop.state.value
        store = self.store
        degraded = store.degraded
        result: StatusDocument = {
            "version": __version__,
            "pid": os.getpid(),
            "state": self.state(),
            "started_at": self.started_at,
            "home": str(self.layout.root),
            "boot_id": self.boot_id,
            "loops": loops,
            "runtime": {"active": self.runtime.running,
                        "max_concurrent": self.config.runtime.max_concurrent},
            "store": {"statements": store.statements,
                      "status": "degraded" if degraded else "ok"},
        }
        if self.keeper is not None and self.keeper.state.pid:
            result["runtime"]["keeper"] = {
                "pid": self.keeper.state.pid,
                "started_at": rfc3339(datetime.fromtimestamp(self.keeper.state.started_at, UTC)),
                "agents": self.keeper.live_count(), "restarts": self.keeper.restarts}
        if store.shared:
            result["store"]["backend"] = store.dialect
            result["store"]["writer_wait_s"] = round(getattr(store, "writer_wait_s", 0.0), 3)
        if degraded:
            result["store"]["reason"] = degraded
        away = store.out_of_reach()
        if away is not None:  # (a read would wait for the network's timeouts)
            result["store"].update(status="unavailable", reason=away)
        stored = self._stored() if away is None else {}
        if "db" in stored:
            result["store"]["db"] = stored["db"]
        if "runs" in stored:
            # ``failed`` is the dead letter: runs that used their attempts or retries.
            result["runs"] = {**stored["runs"], "unrecorded_outcomes": self.queue.unrecorded(),
                              "adopted": self.queue.adopted_total,
                              "retrying": stored["retrying"],
                              "oldest_queued_at": stored["oldest_queued_at"]}
        result["scheduler"] = self.cron.status()
        if self.events is not None:
            result["events"] = {"subscribers": self.events.count(),
                                "published": self.events.published}
        if self.cluster is not None and not store.closed:
            result["cluster"] = self.cluster.status(read=away is None)
        for name, loop in self.loops.items():
            extra = getattr(loop, "stats", None)
            if callable(extra):
                result.setdefault("stats", {})[name] = extra()
        return result

    def health(self) -> tuple[bool, str]:
        """``/health``: ok while running with a usable store; else 503 with the reason."""
        return health(self.state(), self.store.degraded)

    def _stored(self) -> dict[str, Any]:
        """The parts read from the database, read again only after a commit."""
        store = self.store
        if store.closed:
            return {}
        # A shared store: other daemons write too, and nothing cheap tells when: read each time.
        generation = store.change_marker()
        cached = self._cache
        now = utc_now()
        if generation is not None and cached is not None and cached[0] == generation \
                and (cached[1]["ready_until"] is None or now < cached[1]["ready_until"]):
            return cached[1]
        parts: dict[str, Any] = {"ready_until": None}
        try:
            parts["db"] = db_status(store, self.config.queue.retention_days)
        except sqlite3.DatabaseError as exc:  # damage or a full disk: the store says so
            log.debug("daemon.status: the database size cannot be read: %s", exc)
        except Exception:  # status must answer even when the store cannot
            log.exception("daemon.status: reading the database size failed")
        try:
            parts["runs"] = self.queue.counts()
            # A run waiting for its retry back-off is not waiting to be claimed: it is
            # counted apart, and the answer holds until the first of them is due.
            parts["retrying"], first_retry = self.queue.retrying(now)
            parts["oldest_queued_at"] = self.queue.oldest_queued_at(now)
            parts["ready_until"] = parse_rfc3339(first_retry) if first_retry else None
        except sqlite3.DatabaseError as exc:
            log.debug("daemon.status: the runs cannot be counted: %s", exc)
            parts.pop("runs", None)
        except Exception:  # status must answer even when the store cannot
            log.exception("daemon.status: counting runs failed")
            parts.pop("runs", None)
        if generation is not None and "db" in parts and "runs" in parts:
            self._cache = (generation, parts)
        return parts


def health(state: str, degraded: str | None) -> tuple[bool, str]:
    """Ok while running with a usable store; else not, and the reason."""
    if state != "running":
        return False, state
    if degraded:
        return False, "store degraded"
    return True, "ok"
