"""QueueLoop: the ONE backend-wide drain of the ``runs`` queue.

There is exactly one per process, for every workspace. It wakes at once on
the in-process signal (``RunQueue.signal`` -> ``Loop.wake``: an enqueue, a
finished run, a freed runtime slot) and otherwise runs a safety pass every
``queue.safety_interval_s``, which recovers work after a missed signal, a
run inserted by another process, or a restart. Bursts of signals coalesce
naturally: a signal during a tick only re-arms the wake event, so a burst
costs one extra tick, not one per signal.

One tick::

    drain: reserve free runtime slots -> one transaction writes the outcomes
           of executions that ended since the last tick and claims up to as
           many runs as slots were reserved (oldest first, one per agent)
           -> start each execution
    stale claims: at most once per safety interval, claims older than
           queue.stale_claim_s with no live execution here are re-queued (or
           fail for good once the run has used queue.max_attempts); then
           retention prunes old terminal runs, a bounded amount
           (kandevd.store.retention)
    wait:  0 when the tick used its whole claim budget or re-queued something,
           else until the next scheduled retry, cooldown end or retry of an
           outcome the database refused, at most the safety interval (while
           every slot runs, no retry or cooldown is looked up: the freed
           slot's wake-up comes first)
"""

from __future__ import annotations

import logging
import sqlite3
from datetime import datetime
from typing import Any

from kandevd.lifecycle import Loop
from kandevd.runqueue.retention import RunPruner
from kandevd.runqueue.service import RunQueue
from kandevd.sdnotify import SystemdNotifier, queue_status
from kandevd.store.base import is_environmental
from kandevd.timeutil import after

log = logging.getLogger("kandevd.queue.loop")


class QueueLoop(Loop):
    def __init__(self, queue: RunQueue, *, safety_interval_s: float, max_claims_per_tick: int,
                 pruner: RunPruner | None = None, systemd: SystemdNotifier | None = None,
                 **kwargs: Any) -> None:
        """``systemd``: pinged from each tick (its watchdog), told the queue's state at each
        safety pass; None: not under systemd."""
        super().__init__("queue", wakeup=queue.wakeup, **kwargs)
        self.queue = queue
        self.systemd = systemd if systemd is not None else SystemdNotifier({})
        self.pruner = pruner
        self.safety_interval_s = float(safety_interval_s)
        self.max_claims_per_tick = int(max_claims_per_tick)
        self._next_stale_check: datetime | None = None
        #: Passes failed in a row for the environment, and the last one's words.
        self._failed_passes = 0
        self._last_failure: str | None = None

    def start(self) -> None:
        """Start the loop thread; while it runs, outcomes are written by its drains."""
        self.queue.defer_outcomes(True)
        try:
            super().start()
        except BaseException:
            self.queue.defer_outcomes(False)
            raise

    def on_stopped(self) -> None:
        # The last act of the loop thread: what it has not written yet is written now,
        # and from here on every outcome is recorded by the execution that produced it.
        self.queue.defer_outcomes(False)

    def tick(self, now: datetime) -> float:
        # systemd's watchdog (WATCHDOG_USEC) is pinged from the tick, which then comes
        # at least every WATCHDOG_USEC/2: a wedged loop stops pinging and gets restarted.
        systemd = self.systemd
        systemd.watchdog()
        wait = self._pass(now)
        return min(wait, systemd.watchdog_interval_s or wait)

    def _pass(self, now: datetime) -> float:
        try:
            started = self.queue.drain(now, self.max_claims_per_tick)
            recovered = self._recover_stale(now)
        except sqlite3.OperationalError as exc:
            if not is_environmental(exc):
                raise  # a bug: the Loop logs it with its traceback
            # A full disk or a busy database is the environment, not a bug: one line,
            # and the next pass soon (outcomes already known are kept meanwhile). The
            # same failure again (an outage: a pass a second) is not said again.
            self._failed_passes += 1
            said = log.warning if str(exc) != self._last_failure else log.debug
            self._last_failure = str(exc)
            said("queue pass failed (%s); trying again in %.1fs", exc, self.error_backoff_s)
            return self.error_backoff_s
        if self._failed_passes:
            log.info("queue passes succeed again, after %d that failed", self._failed_passes)
            self._failed_passes, self._last_failure = 0, None
        if started >= self.max_claims_per_tick or recovered:
            return 0.0  # there may be more eligible work right now
        wait = self.safety_interval_s
        # While every slot runs, nothing could be claimed before one frees, and a freed
        # slot wakes the loop: the next due retry or cooldown is looked up then.
        if not self.queue.runtime.all_running:
            due = self.queue.repo.next_due(now)
            if due is not None:
                wait = min(wait, max((due - now).total_seconds(), 0.0))
        retry_write = self.queue.next_write_retry_in()
        if retry_write is not None:  # an outcome the database refused is tried again
            wait = min(wait, retry_write)
        return wait

    def _recover_stale(self, now: datetime) -> int:
        """Re-queue stale claims, at most once per safety interval (claims go stale slowly)."""
        check = self._next_stale_check
        interval = self.safety_interval_s
        # A clock that jumped back more than one interval must not postpone the check.
        if check is not None and after(check, -interval) <= now < check:
            return 0
        self._next_stale_check = after(now, interval)
        if (status := self.systemd.enabled and queue_status(self.queue)):
            self.systemd.status(status)
        recovered = len(self.queue.recover_stale(now))
        self._prune(now)
        return recovered

    def _prune(self, now: datetime) -> None:
        """Retention's bounded share of the safety pass; it never disturbs the queue."""
        pruner = self.pruner
        if pruner is None or not pruner.enabled:
            return
        try:
            pruner.prune(now, live=self.queue.live_runs())
        except Exception as exc:
            if is_environmental(exc):  # a full disk or a busy database: one line
                log.warning("retention pass failed (%s); trying again next safety pass", exc)
            else:
                log.exception("retention pass failed; trying again next safety pass")

    def stats(self) -> dict[str, int]:
        """Counters for ``daemon.status``."""
        return {"ticks": self.ticks, **self.queue.stats()}
