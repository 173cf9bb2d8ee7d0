"""One word for where a job stands, and when it will really fire.

Every place that shows a job (the jobs API, ``kandevd jobs``, the metrics,
the console) asks :func:`job_status`, so "why does it not fire?" has one
answer everywhere. The states, most decisive first:

``running``/``buffered``  a session runs (``buffered``: a cron fire waits for it)
``invalid``  its file has a problem; the job is kept as last loaded and does not fire
``ended``    past its ``end_at`` (no fire is left in its window)
``disabled`` the schedule (or the user's override) is off
``blocked``  cron execution is switched off, or an allow/block list keeps it out; or
             its turns run on a runner (``runs_on``) and none online carries its labels
             (it still fires: the session's turn waits for one)
``paused``   the scheduler is globally paused
``held``     the quiet rule holds a due product occurrence back (until ``held_until``)
``scheduled`` it fires at ``next_run_at``

``next_run_at`` is when the job really starts next, a ``jitter_s`` delay
included; None whenever the job would not fire (invalid, ended, disabled,
blocked, paused), and ``held_until`` while it is held. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kandevd.schedules.jobs import Job
from kandevd.schedules.rules.options import jitter_delay
from kandevd.schedules.settings import Switches
from kandevd.timeutil import rfc3339

SCHEDULED = "scheduled"
RUNNING = "running"
HELD = "held"
BUFFERED = "buffered"
DISABLED = "disabled"
PAUSED = "paused"
BLOCKED = "blocked"
INVALID = "invalid"
ENDED = "ended"
STATES = (SCHEDULED, RUNNING, HELD, BUFFERED, DISABLED, PAUSED, BLOCKED, INVALID, ENDED)


@dataclass(frozen=True)
class JobStatus:
    state: str
    reason: str
    next_run_at: datetime | None


@dataclass(frozen=True)
class Surroundings:
    """What decides a job's state besides the job: the daemon's switches and pause."""

    switches: Switches
    pause: dict[str, Any]
    #: Job keys with a session in flight, and those with a cron fire waiting for one.
    running: frozenset[str] = frozenset()
    buffered: frozenset[str] = frozenset()
    #: The moment the states are read at (``ended`` needs it); None: never ended.
    now: datetime | None = None
    #: The label sets of the runners online (None: this daemon serves no runners).
    runners: tuple[frozenset[str], ...] | None = None


def job_status(job: Job, around: Surroundings) -> JobStatus:
    """Where ``job`` stands; see the module docstring for the order of the states."""
    stopped = _why_not(job, around)
    upcoming = None if stopped is not None else _upcoming(job)
    if job.key in around.buffered:
        return JobStatus(BUFFERED, "a cron fire waits for the running session to end "
                         "(overlap_policy buffer_one)", upcoming)
    if job.key in around.running:
        since = f" since {job.state.last_run_at}" if job.state.last_run_at else ""
        return JobStatus(RUNNING, f"a session is running{since}", upcoming)
    if stopped is not None:
        return JobStatus(*stopped, None)
    waiting = _no_runner(job.spec.schedule.options.runs_on, around.runners)
    if waiting is not None:
        return JobStatus(BLOCKED, waiting, upcoming)
    held = job.state.held_until
    if held is not None:
        return JobStatus(HELD, f"held back by the quiet rule (the user was active "
                         f"recently); fires at {rfc3339(held)} if the user stays quiet "
                         "until then (activity holds it longer, up to max_deferral_hours "
                         "past its time)", held)
    if upcoming is None:
        return JobStatus(SCHEDULED, "no further fire time", None)
    start = job.spec.schedule.options.start_at
    if start is not None and around.now is not None and around.now < start:
        return JobStatus(SCHEDULED, f"begins at {rfc3339(start)} (start_at); first fire at "
                         f"{rfc3339(upcoming)}", upcoming)
    return JobStatus(SCHEDULED, f"fires at {rfc3339(upcoming)}", upcoming)


def paused_after_failures(job: Job) -> str | None:
    """Why a job is off when ``pause_after_failures`` switched it off (None otherwise):
    it is off and has failed at least that many times in a row. Derived from the
    state (seeded from the history), so it reads the same after a restart."""
    limit = job.spec.schedule.options.pause_after_failures
    state = job.state
    if not limit or job.enabled or state.consecutive_failures < limit:
        return None
    last = f"; last: {state.last_error}" if state.last_error else ""
    return f"paused after {state.consecutive_failures} consecutive failures{last} " \
        "(kandevd jobs enable resumes it)"


def _why_not(job: Job, around: Surroundings) -> tuple[str, str] | None:
    """The state and reason that keep ``job`` from firing at all, if any."""
    if job.state.invalid is not None:
        return INVALID, job.state.invalid
    options = job.spec.schedule.options
    if around.now is not None and options.ended(around.now):
        return ENDED, f"ended at {rfc3339(options.end_at)} (end_at)" \
            if options.end_at else "ended"
    if not job.enabled:
        paused = paused_after_failures(job)
        if paused:
            return DISABLED, paused
        if job.state.enabled is False:
            return DISABLED, f"disabled for user {job.user_id}"
        return DISABLED, "the schedule is disabled"
    switches = around.switches
    if not switches.execution_enabled:
        return BLOCKED, switches.disabled_reason or "cron execution is switched off"
    verdict = job.spec.verdict(switches)
    if verdict is not None:
        return BLOCKED, verdict
    pause = around.pause
    if pause.get("globally_paused"):
        by = f" by {pause['paused_by']}" if pause.get("paused_by") else ""
        since = f" since {pause['paused_at']}" if pause.get("paused_at") else ""
        return PAUSED, f"the scheduler is globally paused{by}{since}"
    return None


def _no_runner(labels: tuple[str, ...] | None,
               runners: tuple[frozenset[str], ...] | None) -> str | None:
    """Why the turns of a job with ``runs_on`` would wait for a runner (None: they would
    not: no ``runs_on``, or a runner online carries every label)."""
    if not labels:
        return None
    named = ", ".join(labels)
    if runners is None:
        return f"runs_on {named}: this daemon serves no runners (gateway.listen is not set)"
    if any(set(labels) <= carried for carried in runners):
        return None
    return f"runs_on {named}: no runner online carries them all; its turns wait for one"


def _upcoming(job: Job) -> datetime | None:
    """When the job really starts next: a hold's end, a fire waiting for its jitter, or
    the next fire time plus its jitter delay (the same delay the fire will wait)."""
    state = job.state
    if state.held_until is not None:
        return state.held_until
    if state.delayed_until is not None:
        return state.delayed_until
    if state.next_fire is None:
        return None
    jitter = job.spec.schedule.options.jitter_s
    return state.next_fire + jitter_delay(job.key, state.next_fire, jitter)
