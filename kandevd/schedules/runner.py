"""SessionRunner: which sessions are in flight, one per job at most.

It starts sessions (a cron fire from the loop, a manual trigger from the
socket) in the cron loop's fan-out, so the loop's ``stop()`` joins them; it
holds the one buffered fire of a ``buffer_one`` schedule and starts it when
the running session ends; it stops a session on request or at shutdown.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kandevd.config import Config
from kandevd.paths import HomeLayout
from kandevd.schedules.history import SHUTDOWN_ERROR, History
from kandevd.schedules.jobs import Job, JobNotFound
from kandevd.schedules.registry import JobRegistry
from kandevd.schedules.session import MANUAL_STOP_ERROR, Session, SessionControl, SessionPlan
from kandevd.timeutil import utc_now

log = logging.getLogger("kandevd.scheduler")

Spawn = Callable[[str, Callable[[], Any]], Any]


class AlreadyRunning(Exception):
    pass


class NotRunning(Exception):
    pass


class RunnerClosed(Exception):
    def __str__(self) -> str:
        return "the scheduler is shutting down: no new session is started"


@dataclass
class _InFlight:
    plan: SessionPlan
    control: SessionControl


class SessionRunner:
    def __init__(self, registry: JobRegistry, *, config: Config, layout: HomeLayout,
                 runtime: Any, spawn: Spawn,
                 fire_buffered: Callable[[Job], None] | None = None) -> None:
        """``fire_buffered(job)`` decides a buffered fire once its session ended (the
        cron loop's policy); it calls :meth:`start_buffered` when the fire still runs."""
        self._registry = registry
        self._config = config
        self._layout = layout
        self._runtime = runtime
        self._spawn = spawn
        self._fire_buffered = fire_buffered
        self._lock = threading.Lock()
        self._running: dict[str, _InFlight] = {}
        self._buffered: set[str] = set()
        self._closed = False

    # -- queries --------------------------------------------------------------------
    def is_running(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._running

    def is_buffered(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._buffered

    def running_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._running)

    def buffered_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._buffered)

    def session_of(self, job_id: str) -> SessionPlan | None:
        with self._lock:
            flight = self._running.get(job_id)
            return flight.plan if flight else None

    # -- starting -------------------------------------------------------------------
    def start(self, job: Job, trigger_source: str) -> SessionPlan:
        """Start a session of ``job`` now; AlreadyRunning when one is in flight."""
        plan, history = job.source.plan(job, trigger_source)
        control = SessionControl(self._runtime.wake_waiters)
        with self._lock:
            if self._closed:
                raise RunnerClosed()
            if job.key in self._running:
                raise AlreadyRunning(f"job {job.key!r} is already running (session "
                                     f"{self._running[job.key].plan.session_id})")
            self._running[job.key] = _InFlight(plan, control)
        try:
            job.source.started(job, utc_now())
            self._spawn(f"session-{plan.entry_id[:8]}",
                        lambda: self._run(plan, history, control))
        except BaseException:
            with self._lock:
                self._running.pop(job.key, None)
            raise
        return plan

    def buffer(self, job_id: str) -> bool:
        """Keep one fire for when the running session ends; False if one already waits."""
        with self._lock:
            if job_id in self._buffered:
                return False
            self._buffered.add(job_id)
            return True

    def _run(self, plan: SessionPlan, history: History, control: SessionControl) -> None:
        entry: dict[str, Any] | None = None
        try:
            session = Session(plan, config=self._config, layout=self._layout,
                              runtime=self._runtime, history=history, control=control)
            entry = session.run()
        finally:
            self._finish(plan, entry)

    def _finish(self, plan: SessionPlan, entry: dict[str, Any] | None) -> None:
        if entry is not None:
            try:  # (gone after a reload: only its history was written)
                job = self._registry.by_key(plan.job_id)
            except JobNotFound:
                pass
            else:
                job.source.finished(job, entry)
        with self._lock:
            self._running.pop(plan.job_id, None)
            start_buffered = plan.job_id in self._buffered and not self._closed
            self._buffered.discard(plan.job_id)
        if start_buffered:
            try:
                job = self._registry.by_key(plan.job_id)
            except JobNotFound:
                log.info("%s: buffered fire dropped: the job was removed", plan.job_id)
                return
            if self._fire_buffered is not None:
                self._fire_buffered(job)  # decided again: a pause since then still counts

    def start_buffered(self, job: Job) -> None:
        """Start the fire a ``buffer_one`` schedule kept, now that its session ended."""
        try:
            log.info("%s: starting the buffered fire", job.key)
            self.start(job, "cron")
        except (RunnerClosed, AlreadyRunning) as exc:
            log.info("%s: buffered fire dropped: %s", job.key, exc)

    # -- stopping -------------------------------------------------------------------
    def stop(self, job_id: str) -> SessionPlan:
        """Stop the session of ``job_id`` at once; NotRunning when there is none."""
        with self._lock:
            flight = self._running.get(job_id)
            self._buffered.discard(job_id)
        if flight is None:
            raise NotRunning(f"job {job_id!r} is not running")
        flight.control.request_stop(MANUAL_STOP_ERROR)
        return flight.plan

    def close(self, grace_s: float) -> None:
        """Shutdown: start nothing new; each session ends its current turn after
        ``grace_s`` and sends no further one (the caller then joins the threads)."""
        with self._lock:
            self._closed = True
            self._buffered.clear()
            flights = list(self._running.values())
        for flight in flights:
            flight.control.request_stop(SHUTDOWN_ERROR, grace_s=grace_s)
        if flights:
            log.info("scheduler stopping: %d session(s) in flight will be recorded stopped",
                     len(flights))
