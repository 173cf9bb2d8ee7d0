"""One job model for every schedule: a :class:`Job` with one :class:`JobFacts`, one JOB dict.

A job is a schedule as the scheduler runs it: a workflow schedule
(``workflow:<workflow>:<schedule>``) or a product schedule for one user
(``product:<profile>:<schedule>``). What differs between the kinds (where
the definition comes from, when an occurrence is due, what a session runs)
is behind :class:`~kandevd.schedules.source.JobSpec` and
:class:`~kandevd.schedules.source.JobSource`; the cron loop, the registry and
the jobs API only ever see a Job.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from kandevd.schedules import history as hist
from kandevd.schedules.history import HistoryEntry
from kandevd.schedules.rules.options import OptionsObject
from kandevd.timeutil import rfc3339

if TYPE_CHECKING:
    from kandevd.schedules.rules.states import JobStatus
    from kandevd.schedules.source import JobSource, JobSpec


class JobNotFound(LookupError):
    pass


class AmbiguousJob(ValueError):
    """A bare schedule id that several workflows use."""


class UserNeeded(LookupError):
    """A job that exists once per user was named without its user."""


@dataclass
class JobFacts:
    """What the daemon knows about a job beyond its definition: its runs so far, its
    skips, a problem with its file (``job.state``). Its derived ``state`` of the contract
    (scheduled, paused, ...) is :class:`~kandevd.schedules.rules.states.JobStatus`."""

    #: A user's override of a product schedule's ``enabled`` (None: the definition's);
    #: of a workflow schedule, a ``pause_after_failures`` that its workflow.json could
    #: not be made to say (held in memory until ``jobs enable`` or ``disable``).
    enabled: bool | None = None
    last_status: str | None = None
    last_run_at: str | None = None
    last_session_id: str | None = None
    last_error: str | None = None
    last_duration_ms: int | None = None
    run_count: int = 0
    consecutive_failures: int = 0
    last_success_at: str | None = None
    skipped_overlap: int = 0
    skipped_paused: int = 0
    skipped_disabled: int = 0
    #: Cron fires that did not run because their start could not be written (a full disk).
    skipped_unrecorded: int = 0
    missed_while_down: int = 0
    #: When the job fires next (a product's pending occurrence).
    next_fire: datetime | None = None
    #: When to ask the job's source again whether it is due (None: at the next tick).
    next_check: datetime | None = None
    #: The occurrence the last ``due()`` found (the fire's intended time).
    due_at: datetime | None = None
    #: While the quiet rule holds a due occurrence back: when it fires unless the user
    #: is active again (at most the deferral cap).
    held_until: datetime | None = None
    #: Its file has a problem: the job is kept as it was last loaded, and does not fire.
    invalid: str | None = None
    #: A product job whose last run failed on a message: ``{index, message}`` to resume at.
    resume: dict[str, Any] | None = None
    #: A fire that came due and waits for its jitter (``jitter_s``) until this moment,
    #: and its fire time (the intended one).
    delayed_until: datetime | None = None
    delayed_for: datetime | None = None
    #: Fires missed while no daemon ran, within ``catchup_window_s``: one run at start.
    catchup: list[datetime] | None = None

    def record(self, entry: HistoryEntry) -> None:
        """Fold a completed history entry into the state (the failure streak with it)."""
        self.last_status = entry.get("status")
        self.last_run_at = entry.get("started_at")
        self.last_session_id = entry.get("session_id")
        self.last_error = entry.get("error")
        self.last_duration_ms = entry.get("duration_ms")
        self.run_count += 1
        if self.last_status == hist.ERROR:
            self.consecutive_failures += 1
        elif self.last_status == hist.SUCCESS:
            self.consecutive_failures = 0
            self.last_success_at = entry.get("completed_at") or entry.get("started_at")


def seed_state(entries: list[HistoryEntry]) -> JobFacts:
    """Runtime state from one job's history entries (newest first)."""
    state = JobFacts()
    terminal = [e for e in entries if e.get("status") in hist.TERMINAL]
    if entries:
        newest = entries[0]
        state.last_status = newest.get("status")
        state.last_run_at = newest.get("started_at")
        state.last_session_id = newest.get("session_id")
        state.last_error = newest.get("error")
        state.last_duration_ms = newest.get("duration_ms")
    state.run_count = len(terminal)
    for entry in terminal:
        if entry.get("status") != hist.ERROR:
            break
        state.consecutive_failures += 1
    state.last_success_at = last_success(entries)
    return state


def last_success(entries: list[HistoryEntry]) -> str | None:
    """When the newest successful entry (newest first) with a readable date completed
    (a hand-edited date that does not parse is passed over, never believed)."""
    for entry in entries:
        if entry.get("status") == hist.SUCCESS:
            moment = hist.entry_time(entry)
            if moment is not None:
                return rfc3339(moment)
    return None


@dataclass
class Job:
    """A schedule as the scheduler runs it."""

    id: str
    spec: JobSpec
    source: JobSource
    state: JobFacts = field(default_factory=JobFacts)

    @property
    def key(self) -> str:
        """What one session at a time is counted by (a product job adds its user)."""
        return self.spec.key

    @property
    def user_id(self) -> str | None:
        return self.spec.user_id

    @property
    def enabled(self) -> bool:
        definition: bool = self.spec.schedule.enabled
        return definition if self.state.enabled is None else self.state.enabled


class JobTable:
    """The loaded jobs of each source, by key; thread-safe. The registry reads it; a
    source that rewrote its own files (``scheduler.jobs.update``) installs its new jobs
    here itself, without going back through the registry."""

    def __init__(self, names: Iterable[str]) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[str, Job]] = {name: {} for name in names}

    def install(self, name: str, jobs: list[Job]) -> None:
        """Source ``name``'s jobs from now on."""
        table = {job.key: job for job in jobs}
        with self._lock:
            self._jobs[name] = table

    def of(self, name: str) -> dict[str, Job]:
        """The jobs of source ``name``, by key (a copy)."""
        with self._lock:
            return dict(self._jobs[name])

    def every(self) -> dict[str, dict[str, Job]]:
        """Every source's jobs (copies)."""
        with self._lock:
            return {name: dict(jobs) for name, jobs in self._jobs.items()}

    def by_key(self, key: str) -> Job:
        with self._lock:
            for jobs in self._jobs.values():
                job = jobs.get(key)
                if job is not None:
                    return job
        raise JobNotFound(f"no job {key!r}")


class JobObject(OptionsObject, total=False):
    """The contract's JOB: a schedule's definition, its run-time state, and what its kind
    adds (``definition()``, ``details()`` and :func:`job_dict` each give a part), with
    every option in force."""

    id: str
    entity_type: str
    workflow: str | None
    workflow_label: str | None
    schedule_id: str
    product: str
    user_id: str
    name: str
    description: str | None
    cron_expression: str | None
    timezone: str
    enabled: bool
    default_enabled: bool
    group_ids: list[str]
    mode: str | None
    messages: list[Any]
    workshop_mode: str | None
    trigger_payload: dict[str, Any]
    overlap_policy: str
    pulse: bool
    cadence_hours: float
    preferred_hour: int
    quiet_minutes: float
    max_deferral_hours: float
    last_status: str | None
    last_run_at: str | None
    next_run_at: str | None
    last_session_id: str | None
    last_error: str | None
    last_duration_ms: int | None
    run_count: int
    consecutive_failures: int
    running: bool
    skipped_overlap: int
    skipped_paused: int
    skipped_disabled: int
    skipped_unrecorded: int
    missed_while_down: int
    cron_eligible: bool
    cron_ineligible_reason: str | None
    state: str
    state_reason: str
    held_until: str | None
    last_activity_at: str | None


def job_dict(job: Job, status: JobStatus, *, running: bool, ineligible: str | None
             ) -> JobObject:
    """The contract's JOB: the definition, then the run-time state, then what the job's
    source adds (a product job's ``held_until`` and ``last_activity_at``)."""
    state = job.state
    return {
        **job.spec.definition(), "enabled": job.enabled,
        "last_status": state.last_status, "last_run_at": state.last_run_at,
        "next_run_at": rfc3339(status.next_run_at) if status.next_run_at else None,
        "last_session_id": state.last_session_id, "last_error": state.last_error,
        "last_duration_ms": state.last_duration_ms, "run_count": state.run_count,
        "consecutive_failures": state.consecutive_failures, "running": running,
        "skipped_overlap": state.skipped_overlap, "skipped_paused": state.skipped_paused,
        "skipped_disabled": state.skipped_disabled,
        "skipped_unrecorded": state.skipped_unrecorded,
        "missed_while_down": state.missed_while_down,
        "cron_eligible": ineligible is None, "cron_ineligible_reason": ineligible,
        "state": status.state, "state_reason": status.reason,
        **job.source.details(job),
    }
