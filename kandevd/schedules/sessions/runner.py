"""SessionRunner: which sessions are in flight, one per job at most.

It starts sessions (a cron fire from the loop, a manual trigger from the
socket) in the cron loop's fan-out, so the loop's ``stop()`` joins them; it
holds the one buffered fire of a ``buffer_one`` (or ``replace``) schedule and
starts it when the running session ends; it stops a session on request, when
it outlives its ``timeout_s``, or at shutdown. When a session ends it tells
the job's source, pauses a job that failed ``pause_after_failures`` times in a
row, and hands a notification to the :class:`~kandevd.schedules.sessions.notify.Notifier`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from kandevd.config import Config
from kandevd.paths import HomeLayout
from kandevd.runtime import AgentRuntime
from kandevd.schedules import history as hist
from kandevd.schedules.firing import Firing
from kandevd.schedules.history import SHUTDOWN_ERROR, History, HistoryEntry
from kandevd.schedules.jobs import Job, JobNotFound
from kandevd.schedules.registry import JobRegistry
from kandevd.schedules.rules.options import NotifySpec
from kandevd.schedules.rules.states import paused_after_failures
from kandevd.schedules.sessions.notify import Notifier
from kandevd.schedules.sessions.nowhere import NoGateway
from kandevd.schedules.sessions.session import (
    MANUAL_STOP_ERROR,
    Session,
    SessionControl,
    SessionPlan,
    TurnRuntime,
)
from kandevd.timeutil import rfc3339, utc_now

log = logging.getLogger("kandevd.scheduler")

Spawn = Callable[[str, Callable[[], Any]], Any]


class AlreadyRunning(Exception):
    pass


class NotRunning(Exception):
    pass


class StartNotRecorded(Exception):
    """The session's start could not be written (a full disk): it does not start."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        #: The file that could not be written.
        self.path = path


def not_recorded(exc: OSError) -> StartNotRecorded:
    """Why a session did not start, naming the file that could not be written."""
    path = str(exc.filename) if exc.filename else None
    where = f" ({path})" if path else ""
    return StartNotRecorded(f"its start could not be recorded: {exc.strerror or exc}{where}",
                            path)


class RunnerClosed(Exception):
    def __str__(self) -> str:
        return "the scheduler is shutting down: no new session is started"


@dataclass
class _InFlight:
    plan: SessionPlan
    control: SessionControl
    #: When the session has run its ``timeout_s`` (None: no limit).
    deadline: datetime | None = None
    timeout_s: float | None = None


def _nobody(_topic: str, _data: Mapping[str, Any]) -> None:
    return None


class SessionRunner:
    def __init__(self, registry: JobRegistry, *, config: Config, layout: HomeLayout,
                 runtime: AgentRuntime, spawn: Spawn, firing: Firing | None = None,
                 wake: Callable[[], None] | None = None,
                 remote_turns: Callable[[tuple[str, ...], str], TurnRuntime] | None = None,
                 publish: Callable[[str, Mapping[str, Any]], None] | None = None
                 ) -> None:
        """``firing`` decides a buffered fire again once its session ended (the cron
        loop's policy; None: a kept fire is dropped). ``wake()`` has the loop look again
        (a new session's deadline). ``remote_turns(labels, profile)``: where the turns of a
        schedule with ``runs_on`` execute (runners on other machines; None: no gateway).
        ``publish(topic, data)``: the daemon's bus, told of fires, sessions and pauses."""
        #: ``tell(topic, data)``: an event for the daemon's subscribers (schedule.*).
        self.tell = publish if publish is not None else _nobody
        self._registry = registry
        self._config = config
        self._layout = layout
        self._runtime = runtime
        self._remote_turns = remote_turns
        self._spawn = spawn
        self._firing = firing
        self._wake = wake
        self._lock = threading.Lock()
        #: Notified whenever a session ends (a backfill waits on it for its next run).
        self._idle = threading.Condition(self._lock)
        self._running: dict[str, _InFlight] = {}
        self._buffered: set[str] = set()
        #: Jobs whose kept (buffered) fire is being started now that their session ended.
        self._handover: set[str] = set()
        self._closed = False
        self.notifier = Notifier(spawn)
        self._default_notify = NotifySpec.from_raw(config.scheduler.notify)

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

    # -- starting -------------------------------------------------------------------
    def start(self, job: Job, trigger_source: str, *, intended_at: datetime | None = None,
              fire_times: list[datetime] | None = None,
              fired: datetime | None = None) -> SessionPlan:
        """Start a session of ``job`` now; AlreadyRunning when one is in flight.

        ``intended_at``: the fire time it stands for, when it starts later (a jittered
        or a backfilled fire); ``fire_times``: the missed fires a catch-up run stands
        for. Both are recorded on the entry. ``fired``: the cron fire it starts (told
        as ``schedule.fired`` before the session's own events)."""
        try:  # (a product's conversation file that cannot be read now: no start)
            plan, history = job.source.plan(job, trigger_source)
        except OSError as exc:
            raise not_recorded(exc) from None
        plan.intended_at, plan.fire_times = intended_at, fire_times
        control = SessionControl(self._runtime.wake_waiters)
        timeout = job.spec.schedule.options.timeout_s
        deadline = utc_now() + timedelta(seconds=timeout) if timeout else None
        with self._lock:
            if self._closed:
                raise RunnerClosed()
            if job.key in self._running:
                raise AlreadyRunning(f"job {job.key!r} is already running (session "
                                     f"{self._running[job.key].plan.session_id})")
            self._running[job.key] = _InFlight(plan, control, deadline, timeout)
        session = Session(plan, config=self._config, layout=self._layout,
                          runtime=self._turns_of(job, plan.program.agent_profile),
                          history=history, control=control)
        try:
            self._begin(job, session)
            about = {"id": job.key, "entry_id": plan.entry_id}
            if fired is not None:
                self.tell("schedule.fired", {**about, "status": "started",
                                             "intended_at": rfc3339(fired)})
            self.tell("schedule.session_started", {**about, "status": "running",
                                                   "trigger_source": trigger_source})
            self._spawn(f"session-{plan.entry_id[:8]}",
                        lambda: self._run(session, history))
        except BaseException:
            with self._lock:
                self._running.pop(job.key, None)
            raise
        if deadline is not None and self._wake is not None:
            self._wake()  # the loop ticks at the deadline (expire)
        return plan

    def hold(self, plan: SessionPlan, control: SessionControl, *,
             deadline: datetime | None, timeout_s: float | None) -> None:
        """Count an adopted turn as ``plan.job_id``'s session in flight (so no other
        starts meanwhile, and ``jobs stop``, ``timeout_s`` and the shutdown reach it
        through ``control``); :meth:`release` ends that. AlreadyRunning, RunnerClosed."""
        with self._lock:
            if self._closed:
                raise RunnerClosed()
            if plan.job_id in self._running:
                raise AlreadyRunning(f"job {plan.job_id!r} is already running")
            self._running[plan.job_id] = _InFlight(plan, control, deadline, timeout_s)
        if deadline is not None and self._wake is not None:
            self._wake()

    def release(self, plan: SessionPlan, history: History,
                entry: HistoryEntry | None = None) -> None:
        """An adopted turn ended: the job is free again (a buffered fire starts); its run
        ended with ``entry`` (None: it did not end here, its agent was left running)."""
        self._finish(plan, entry, history)

    def reopened(self, job_key: str, entry: HistoryEntry | None) -> None:
        """A run a previous daemon left goes on here (its turn adopted): the job's state
        no longer counts it as interrupted; its end is told by :meth:`release`. None:
        the adoption failed after all, the run counts as interrupted again."""
        try:
            job = self._registry.by_key(job_key)
        except JobNotFound:
            return
        job.source.reseed(job, str(entry.get("id")) if entry is not None else None)
        if entry is not None:
            job.state.last_run_at = entry.get("started_at")
            job.state.last_session_id = entry.get("session_id")

    def settled(self, job_key: str, entry: HistoryEntry, history: History) -> None:
        """A run a previous daemon left ended with ``entry``, its turns' real outcome
        found at start: the job's state, ``pause_after_failures`` and the notification
        follow it, as for a run that ended here."""
        try:
            job = self._registry.by_key(job_key)
        except JobNotFound:
            return
        job.source.reseed(job, str(entry.get("id")))
        self._ended(job, entry, history)

    def buffer(self, job_id: str) -> bool | None:
        """Keep one fire for when the running session ends; False if one already waits,
        None if no session runs any more (start it now instead)."""
        with self._lock:
            if job_id not in self._running:
                return None
            if job_id in self._buffered:
                return False
            self._buffered.add(job_id)
            return True

    def _begin(self, job: Job, session: Session) -> None:
        """Record the start (the entry, a product's spent occurrence); StartNotRecorded
        when the files cannot be written, and then nothing runs."""
        try:
            session.begin()
        except OSError as exc:
            raise not_recorded(exc) from None
        try:
            job.source.started(job, utc_now())
        except OSError as exc:
            refused = not_recorded(exc)
            session.abandon(f"not started: {refused}")  # kept in memory until it lands
            raise refused from None
        # The newest run is this one from now on (a replaced one's are history).
        job.state.last_run_at = session.entry["started_at"]
        job.state.last_session_id = session.plan.session_id

    def _turns_of(self, job: Job, profile: str) -> TurnRuntime:
        """Where ``job``'s turns execute: here, or on a runner carrying its ``runs_on``
        (that runs its own ``profile``)."""
        labels = job.spec.schedule.options.runs_on
        if not labels:
            return self._runtime
        if self._remote_turns is None:
            return NoGateway(labels)
        return self._remote_turns(labels, profile)

    def settle_turns(self, names: list[str]) -> None:
        """These turns' outcomes are on their entries: the runtime may let their exits go."""
        settle = getattr(self._runtime, "settle_ids", None)
        if settle is not None:
            settle(names)

    def is_live_turn(self, key: str) -> bool:
        """Does a turn's execution of that key run here (adopted, or started since)?"""
        return bool(self._runtime.is_live(key))

    @property
    def turns_folder(self) -> Path:
        """Where turns keep their execution records (``<home>/turns``)."""
        return self._layout.turns

    def _run(self, session: Session, history: History) -> None:
        entry: HistoryEntry | None = None
        try:
            entry = session.run()
        finally:
            self._finish(session.plan, entry, history)

    def _finish(self, plan: SessionPlan, entry: HistoryEntry | None,
                history: History) -> None:
        if entry is not None:
            try:  # (gone after a reload: only its history was written)
                job = self._registry.by_key(plan.job_id)
            except JobNotFound:
                pass
            else:
                self._ended(job, entry, history)
        with self._lock:
            self._running.pop(plan.job_id, None)
            start_buffered = plan.job_id in self._buffered and not self._closed
            self._buffered.discard(plan.job_id)
            if start_buffered:  # a backfill waits until the kept fire had its turn
                self._handover.add(plan.job_id)
            self._idle.notify_all()
        if start_buffered:
            try:
                self._start_kept(plan.job_id)
            finally:
                with self._lock:
                    self._handover.discard(plan.job_id)
                    self._idle.notify_all()

    def _ended(self, job: Job, entry: HistoryEntry, history: History) -> None:
        """A run of ``job`` ended with ``entry``: its state, the pause, the notification."""
        failures_before = job.state.consecutive_failures
        job.source.finished(job, entry)
        about = {"id": job.key, "entry_id": entry.get("id")}
        self.tell("schedule.session_ended", {**about, "status": entry.get("status"),
                                             "error": entry.get("error")})
        paused = self._pause_if_failing(job, entry)
        if paused is not None:
            self.tell("schedule.paused", {**about, "status": "paused", "reason": paused})
        self._notify(job, entry, failures_before, history, paused)

    def _start_kept(self, job_id: str) -> None:
        try:
            job = self._registry.by_key(job_id)
        except JobNotFound:
            log.info("%s: buffered fire dropped: the job was removed", job_id)
            return
        # Decided again: a pause since then still counts.
        if self._firing is not None and self._firing.buffered_fire_runs(job):
            self.start_buffered(job)

    def wait_idle(self, job_id: str, stop: threading.Event) -> None:
        """Block until ``job_id`` has no session in flight nor a fire waiting for one
        (or ``stop`` is set)."""
        with self._idle:
            while (job_id in self._running or job_id in self._buffered
                   or job_id in self._handover) and not stop.is_set() and not self._closed:
                self._idle.wait()

    def wake_idle(self) -> None:
        with self._idle:
            self._idle.notify_all()

    def _pause_if_failing(self, job: Job, entry: HistoryEntry) -> str | None:
        """Disable a job that has failed ``pause_after_failures`` times in a row, as
        ``jobs disable`` does (``jobs enable`` lifts it); the reason when it did."""
        limit = job.spec.schedule.options.pause_after_failures
        if not limit or entry.get("status") != hist.ERROR or not job.enabled \
                or job.state.consecutive_failures < limit:
            return None
        try:
            job = job.source.set_enabled(job, False, utc_now())
        except Exception as exc:
            # A manifest that cannot be written (cut short by hand, a full disk): the job
            # is held off here all the same (fail closed: it would fail unattended),
            # until `jobs enable` (or a restart) says otherwise.
            job.state.enabled = False
            job.state.next_fire = job.state.delayed_until = job.state.catchup = None
            log.error("%s: paused after %d consecutive failures, but its file could not "
                      "say so (%s): held off in this daemon only; `kandevd jobs enable` "
                      "resumes it, `kandevd jobs disable` writes the pause once the file "
                      "is fixed", job.key, job.state.consecutive_failures, exc)
        reason = paused_after_failures(job) or f"paused after {limit} consecutive failures"
        log.warning("%s: %s", job.key, reason)
        return reason

    def _notify(self, job: Job, entry: HistoryEntry, failures_before: int,
                history: History, paused: str | None) -> None:
        self.notifier.tell_ended(job.key, job.spec.schedule.options.notify
                                 or self._default_notify, entry, failures_before,
                                 history.update_entry, paused)

    def expire(self, now: datetime) -> datetime | None:
        """Stop the sessions past their ``timeout_s`` (as ``jobs stop`` does, recorded
        ``error: timed out after ...``); the next deadline, if any."""
        with self._lock:
            flights = list(self._running.values())
        upcoming = []
        for flight in flights:
            if flight.deadline is None or flight.control.stop_requested:
                continue
            if flight.deadline <= now:
                log.warning("%s: session %s timed out after %gs; stopping it",
                            flight.plan.job_id, flight.plan.session_id, flight.timeout_s)
                flight.control.request_stop(f"timed out after {flight.timeout_s:g}s",
                                            status=hist.ERROR)
            else:
                upcoming.append(flight.deadline)
        return min(upcoming) if upcoming else None

    def replace(self, job: Job, intended: datetime) -> bool | None:
        """``overlap_policy: replace``: stop the running session and keep this fire for
        when it has ended; False when a fire already waits (it is skipped), None when no
        session runs any more (start it now instead)."""
        with self._lock:
            flight = self._running.get(job.key)
            if flight is None:
                return None
            if job.key in self._buffered:
                return False
            self._buffered.add(job.key)
        flight.control.request_stop(f"stopped: replaced by the fire of {rfc3339(intended)}")
        return True

    def start_buffered(self, job: Job) -> None:
        """Start the fire a ``buffer_one`` schedule kept, now that its session ended."""
        try:
            log.info("%s: starting the buffered fire", job.key)
            self.start(job, "cron")
        except (RunnerClosed, AlreadyRunning, StartNotRecorded) as exc:
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
        self.notifier.close()
        # runtime.keep_agents_on_stop: each turn's agent is left running at once, its
        # entry ``running``, for the next start to adopt.
        keep = self._config.runtime.keep_agents_on_stop
        with self._lock:
            self._closed = True
            self._buffered.clear()
            flights = list(self._running.values())
            self._idle.notify_all()
        for flight in flights:
            flight.control.request_stop(SHUTDOWN_ERROR, grace_s=0.0 if keep else grace_s,
                                        detach=keep)
        if flights:
            log.info("scheduler stopping: %d session(s) in flight will be %s", len(flights),
                     "left running for the next start" if keep else "recorded stopped")
