"""Backfill: run a job over the fire times of a past range, one after another.

Each fire time becomes a session of its own (``trigger_source: backfill``, its
``intended_at`` the fire time it stands for, also in every turn's stdin), so
the agent knows which period it works on. The sessions never overlap one
another nor any other session of the job: before each one the backfill
waits for the job's running session (a cron fire, a trigger) to end; a cron
fire that comes while a backfill session runs meets the job's overlap
policy as usual. One backfill per job at a time; ``jobs stop`` stops it (the
session in flight too). A daemon stop ends it; what it did not run is
logged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from kandevd.schedules.jobs import Job, JobNotFound
from kandevd.schedules.rules.states import paused_after_failures
from kandevd.schedules.sessions.runner import (
    AlreadyRunning,
    RunnerClosed,
    SessionRunner,
    StartNotRecorded,
)
from kandevd.timeutil import rfc3339

log = logging.getLogger("kandevd.scheduler.backfill")

#: The most fire times one backfill runs.
MAX_BACKFILL = 1000

Spawn = Callable[[str, Callable[[], Any]], Any]


class BackfillRunning(Exception):
    """A backfill of the job is already running."""


class RangeTooLarge(ValueError):
    pass


def fire_times(job: Job, start: datetime, end: datetime) -> list[datetime]:
    """The job's fire times in ``[start, end]`` (its zone and DST rule); RangeTooLarge
    above :data:`MAX_BACKFILL`."""
    times = job.source.next_times(job, start - timedelta(microseconds=1), MAX_BACKFILL + 1)
    inside = [t for t in times if t <= end]
    if len(inside) > MAX_BACKFILL:
        raise RangeTooLarge(f"the range holds more than {MAX_BACKFILL} fire times; "
                            "narrow it")
    return inside


class Backfills:
    """The backfills in flight, one per job."""

    def __init__(self, runner: SessionRunner, spawn: Spawn,
                 lookup: Callable[[str], Job]) -> None:
        """``lookup(key)``: the job as it is now (JobNotFound when it is gone)."""
        self._lookup = lookup
        self._runner = runner
        self._spawn = spawn
        self._lock = threading.Lock()
        self._stops: dict[str, threading.Event] = {}

    def running(self, key: str) -> bool:
        with self._lock:
            return key in self._stops

    def start(self, job: Job, times: list[datetime], *,
              trigger_source: str = "backfill") -> None:
        """Run ``job`` once per time of ``times``, in order, in the background (recorded
        with ``trigger_source``: late cron fires after a leader change use ``cron``)."""
        stop = threading.Event()
        with self._lock:
            if job.key in self._stops:
                raise BackfillRunning(f"a backfill of {job.key} is already running "
                                      "(kandevd jobs stop ends it)")
            self._stops[job.key] = stop
        log.info("%s: backfill of %d fire time(s) from %s to %s started", job.key,
                 len(times), rfc3339(times[0]), rfc3339(times[-1]))
        try:
            self._spawn(f"backfill-{job.key[-24:]}",
                        lambda: self._run(job, times, stop, trigger_source))
        except BaseException:
            with self._lock:
                self._stops.pop(job.key, None)
            raise

    def stop(self, key: str) -> bool:
        """Stop the backfill of ``key`` (False: none runs); the caller stops its session."""
        with self._lock:
            stop = self._stops.get(key)
        if stop is None:
            return False
        stop.set()
        self._runner.wake_idle()
        return True

    def close(self) -> None:
        with self._lock:
            stops = list(self._stops.values())
        for stop in stops:
            stop.set()
        self._runner.wake_idle()

    def _run(self, job: Job, times: list[datetime], stop: threading.Event,
             trigger_source: str = "backfill") -> None:
        done = 0
        try:
            for moment in times:
                if not self._start_one(job, moment, stop, trigger_source):
                    break
                done += 1
                self._runner.wait_idle(job.key, stop)
        finally:
            with self._lock:
                self._stops.pop(job.key, None)
            left = len(times) - done
            log.info("%s: backfill %s: %d of %d fire time(s) run", job.key,
                     "ended" if left == 0 else "stopped", done, len(times))

    def _start_one(self, job: Job, moment: datetime, stop: threading.Event,
                   trigger_source: str = "backfill") -> bool:
        """Start the session for ``moment`` once the job is idle; False when stopped
        (or the job is gone, invalid, or paused after repeated failure)."""
        while True:
            self._runner.wait_idle(job.key, stop)
            if stop.is_set():
                return False
            try:
                job = self._lookup(job.key)  # its definition now (a reload may change it)
            except JobNotFound:
                log.info("%s: backfill stopped: the job was removed", job.key)
                return False
            why = job.state.invalid or paused_after_failures(job)
            if why:
                log.info("%s: backfill stopped: %s", job.key, why)
                return False
            try:
                self._runner.start(job, trigger_source, intended_at=moment)
                if stop.is_set():  # a `jobs stop` that came while it was starting
                    self._runner.stop(job.key)
                return True
            except AlreadyRunning:  # a cron fire or a trigger came first: wait for it
                continue
            except RunnerClosed:
                return False
            except StartNotRecorded as exc:
                log.warning("%s: backfill stopped at %s: %s", job.key, rfc3339(moment), exc)
                return False
