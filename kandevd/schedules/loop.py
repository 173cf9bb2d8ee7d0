"""CronLoop: fires workflow schedules at their times.

Why a Loop and not APScheduler's own scheduler main loop: fire times come from
:mod:`kandevd.cron` (APScheduler's CronTrigger finds the matching wall times,
kandevd.cron applies the DST rule), but the decision
of what fires at a given ``now`` is :meth:`CronLoop.tick`, a plain method a
test calls with any clock and no thread; and the Loop gives the lifecycle the
rest of the daemon has (idempotent start/stop, a parent stop signal, the
session fan-out joined by ``stop()``). APScheduler's BackgroundScheduler would
bring a second thread model, its own executors and a ``shutdown()`` that is
not idempotent.

One tick: rescan the root when a reload was asked for, take the jobs whose
next fire is due (each gets its following fire at once, so a fire is decided
once and a late tick never replays a backlog), decide each with
:class:`~kandevd.schedules.firing.Firing`, and return the wait until the earliest
next fire.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timedelta

from kandevd.lifecycle import FanOut, Loop, StopSignal
from kandevd.schedules.catchup.backfill import Backfills
from kandevd.schedules.catchup.late import fire_late
from kandevd.schedules.firing import Decision, Firing
from kandevd.schedules.jobs import Job, JobObject, job_dict
from kandevd.schedules.registry import JobRegistry
from kandevd.schedules.rules.states import JobStatus, Surroundings, job_status
from kandevd.schedules.sessions.runner import (
    AlreadyRunning,
    RunnerClosed,
    SessionRunner,
    StartNotRecorded,
)
from kandevd.schedules.sessions.session import SessionPlan
from kandevd.timeutil import rfc3339, utc_now

log = logging.getLogger("kandevd.scheduler")

#: Longest sleep between ticks, so a wall-clock change is noticed within a minute.
MAX_WAIT_S = 60.0
#: How soon history writes that failed (a full disk) are tried again.
RETRY_WRITES = timedelta(seconds=5)
#: A fire's ``status`` in its ``schedule.fired`` event.
FIRED = {Decision.RUN: "started", Decision.BUFFER: "buffered", Decision.REPLACE: "replacing",
         Decision.SKIP_OVERLAP: "skipped_overlap", Decision.SKIP_PAUSED: "skipped_paused",
         Decision.SKIP_DISABLED: "skipped_disabled",
         Decision.SKIP_UNRECORDED: "skipped_unrecorded"}


class CronLoop(Loop):
    #: Fires are due at wall-clock times: after a laptop's sleep, at most this late.
    clock_check_s = 5.0

    def __init__(self, registry: JobRegistry, *, runner: SessionRunner, firing: Firing,
                 stop_grace_s: float, parent: StopSignal | None = None,
                 clock: Callable[[], datetime] = utc_now,
                 fire_gate: Callable[[str, datetime], bool] | None = None,
                 wakeup: threading.Event | None = None, fanout: FanOut | None = None,
                 runners_online: Callable[[], tuple[frozenset[str], ...]] | None = None,
                 first_tick: Callable[[], object] | None = None) -> None:
        """``runner`` starts the sessions (in ``fanout``, which it was built with);
        ``firing`` decides each fire (the runner asks it again for a buffered one);
        ``wakeup``: the event the registry's history backlog and the runner set;
        ``runners_online()``: the label sets of the runners online (None: no gateway);
        ``first_tick()``: done once, at the first tick (the restart's settling of turns)."""
        super().__init__("cron", clock=clock, parent=parent, logger=log, wakeup=wakeup,
                         fanout=fanout)
        self.registry = registry
        self.runner = runner
        self.firing = firing
        self.runners_online = runners_online
        self._first_tick = first_tick
        self.backfills = Backfills(self.runner, self.fanout.spawn, registry.by_key)
        self._stop_grace_s = stop_grace_s
        self._reload = threading.Event()
        self._takeover = threading.Event()
        #: A takeover of the leader's lease: occurrences since then may lack their fire.
        self._late_since: datetime | None = None
        self.late_fires = 0
        self.late_max_s = 0.0
        self.fires = 0
        #: Several daemons (PostgreSQL): ``(job key, intended time) -> fire here?``. Only
        #: the leader fires, and an occurrence fired already (by an earlier leader) is not
        #: fired again. Without it (SQLite: one daemon) every due occurrence fires here.
        self.fire_gate = fire_gate

    def request_late_fires(self, since: datetime | None) -> None:
        """This daemon became the leader (several daemons); ``since`` the previous one's
        last renewal when it took over an expired lease: fire what no leader fired.

        Before anything fires, the files are read again and each job's counts again
        from the shared history: what the previous leader wrote (a job it paused after
        failures, ``consecutive_failures``, ``last_status``) was never told here."""
        self._takeover.set()
        if since is not None:
            self._late_since = since
        self.wake()

    def request_reload(self) -> None:
        """Rescan the root on the next tick (SIGHUP, ``scheduler.reload``)."""
        self._reload.set()
        self.wake()

    def tick(self, now: datetime) -> float:
        takeover = self._takeover.is_set()
        if self._reload.is_set() or takeover:
            self._reload.clear()
            self._takeover.clear()
            self.registry.rescan(now)
        if takeover:
            for job in self.registry.jobs():
                if self.runner.is_running(job.key):  # (its own session tells it)
                    continue
                try:
                    job.source.reseed(job, None)
                except Exception as exc:  # (a locked or unreadable file: what is known stands)
                    log.warning("%s: its state could not be read again as this daemon took "
                                "over (%s); it goes on as it was known here", job.key, exc)
        deadline = self.runner.expire(now)
        if self._first_tick is not None:
            once, self._first_tick = self._first_tick, None
            once()
        if self._late_since is not None and self.fire_gate is not None:
            since, self._late_since = self._late_since, None
            paused = self.registry.pause.get()["globally_paused"]
            late = fire_late(self.registry, self.backfills, since, now, gate=self._ours,
                             may_run=lambda job: self.firing.decide(
                                 job, paused=paused, running=False, buffered=False)
                             is Decision.RUN)
            self.late_fires += len(late)
            self.late_max_s = max([self.late_max_s, *late])
        backlog = self.registry.backlog
        if len(backlog) and backlog.flush():
            deadline = min(d for d in (deadline, now + RETRY_WRITES) if d is not None)
        due = self.registry.due(now)
        self.registry.alive.touch(now)
        if due:
            paused = self.registry.pause.get()["globally_paused"]
            for job in due:
                if self._ours(job.key, job.state.due_at or now):
                    self.fire(job, now, paused=paused)
                else:
                    job.state.catchup = None  # another daemon's (or an earlier) fire
        wakes = [t for t in (self.registry.next_wake(now), deadline) if t is not None]
        if not wakes:
            return MAX_WAIT_S
        return min(MAX_WAIT_S, (min(wakes) - now).total_seconds())

    def _ours(self, key: str, intended: datetime) -> bool:
        """Does this daemon fire the occurrence of ``key`` at ``intended``? (The gate's say.)"""
        if self.fire_gate is None:
            return True
        try:
            return self.fire_gate(key, intended)
        except Exception as exc:  # no database, no fire: the occurrence is not lost twice
            log.warning("%s: cron fire at %s not recorded (%s); skipped", key,
                        intended.isoformat(), exc)
            return False

    def fire(self, job: Job, now: datetime, *, paused: bool) -> Decision:
        """Act on one due cron fire of ``job``: a session, a buffered fire, or a skip
        (told as ``schedule.fired``). A skipped occurrence is spent (never kept for
        later)."""
        intended = job.state.due_at or now
        started: list[SessionPlan] = []
        decision = self._fire(job, now, paused=paused, started=started)
        if not started:  # (a session started told its fire itself, before its own events)
            self.runner.tell("schedule.fired", {
                "id": job.key, "entry_id": None, "status": FIRED[decision],
                "intended_at": rfc3339(intended)})
        return decision

    def _fire(self, job: Job, now: datetime, *, paused: bool,
              started: list[SessionPlan]) -> Decision:
        self.fires += 1
        intended = job.state.due_at or now
        catchup, job.state.catchup = job.state.catchup, None
        decision = self.firing.decide(job, paused=paused,
                                      running=self.runner.is_running(job.key),
                                      buffered=self.runner.is_buffered(job.key))
        why = None
        if decision is Decision.BUFFER:
            kept = self.runner.buffer(job.key)
            if kept:
                log.info("%s: cron fire buffered: it starts when the running session ends",
                         job.key)
                return decision
            # None: the session ended meanwhile, so it runs now; False: one already waits
            decision = Decision.RUN if kept is None else Decision.SKIP_OVERLAP
        elif decision is Decision.REPLACE:
            replaced = self.runner.replace(job, intended)
            if replaced:
                log.info("%s: cron fire replaces the running session: it starts when that "
                         "one has stopped", job.key)
                return decision
            decision = Decision.RUN if replaced is None else Decision.SKIP_OVERLAP
            why = "a replacing fire already waits"
        if decision is Decision.RUN:
            try:
                if catchup:
                    started.append(self.runner.start(job, "catchup", fire_times=catchup,
                                                     fired=intended))
                else:
                    late = job.spec.schedule.options.jitter_s > 0
                    started.append(self.runner.start(job, "cron", intended_at=intended
                                                     if late else None, fired=intended))
                return decision
            except AlreadyRunning:  # a manual trigger won the race
                decision, why = Decision.SKIP_OVERLAP, "a session is already running"
            except RunnerClosed:
                return decision
            except StartNotRecorded as exc:
                job.state.skipped_unrecorded += 1
                job.state.last_error = f"cron fire of {intended.isoformat()} not run: {exc}"
                log.warning("%s: cron fire skipped: %s", job.key, exc)
                job.source.skipped(job, now)
                return Decision.SKIP_UNRECORDED
        if decision is Decision.SKIP_OVERLAP:
            self.firing.skip(job, decision, why or "the previous session is still running" + (
                " and one fire already waits" if job.spec.overlap_policy != "skip"
                else ""))
        else:
            self.firing.skip(job, decision)
        job.source.skipped(job, now)
        return decision

    def surroundings(self) -> Surroundings:
        """What a job's state depends on besides the job, read once for many jobs."""
        return Surroundings(self.registry.switches, self.registry.pause.get(),
                            self.runner.running_ids(), self.runner.buffered_ids(),
                            now=self._clock(), runners=self.runners_online()
                            if self.runners_online is not None else None)

    def status_of(self, job: Job, around: Surroundings | None = None) -> JobStatus:
        return job_status(job, around or self.surroundings())

    def job_statuses(self) -> list[tuple[Job, JobStatus]]:
        """Every job with its status (the metrics read them at each scrape)."""
        around = self.surroundings()
        return [(job, job_status(job, around)) for job in self.registry.jobs()]

    def describe(self, job: Job, around: Surroundings | None = None) -> JobObject:
        """The contract's JOB for ``job``, its ``state`` included."""
        around = around or self.surroundings()
        return job_dict(job, job_status(job, around), running=job.key in around.running,
                        ineligible=self.registry.ineligible_reason(
                            job, around.pause["globally_paused"]))

    def on_stopping(self) -> None:
        self.backfills.close()
        self.runner.close(self._stop_grace_s)

    def on_stopped(self) -> None:
        """The sessions are over: a last try at history writes that failed; what still
        cannot be written is said (it is lost with the process)."""
        if len(self.registry.backlog) and (left := self.registry.backlog.flush()):
            log.error("%d history write(s) could not be written before the stop and are "
                      "lost (the files' last good content stays)", left)

    def status(self) -> dict[str, object]:
        """The ``scheduler`` member of ``daemon.status``: the pause (and by whom), the
        switches, the jobs by state, the sessions in flight, the problems."""
        around = self.surroundings()
        pause = around.pause
        states: dict[str, int] = {}
        for job in self.registry.jobs():
            state = job_status(job, around).state
            states[state] = states.get(state, 0) + 1
        return {**self.registry.counts(), "running": sorted(around.running),
                "execution_enabled": self.registry.switches.execution_enabled,
                "disabled_reason": self.registry.switches.disabled_reason,
                "globally_paused": pause["globally_paused"],
                "paused_by": pause.get("paused_by"), "paused_at": pause.get("paused_at"),
                "states": dict(sorted(states.items())),
                "root": str(self.registry.root), "errors": self.registry.problems()}

    def stats(self) -> dict[str, object]:
        return {"fires": self.fires, "late_fires": self.late_fires,
                "late_max_s": round(self.late_max_s, 3), **self.registry.counts(),
                "running": len(self.runner.running_ids())}
