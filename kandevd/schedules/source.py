"""What a kind of job provides: its definition (JobSpec) and its files (JobSource).

Two kinds implement these: workflow schedules (``schedules/workflows``) and
product schedules (``schedules/products``). Everything the cron loop, the
registry and the jobs API do with a job goes through these methods, so none
of them asks which kind a job is.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kandevd.formats.jsonfile import CorruptReporter
from kandevd.schedules.history import HistoryEntry, PendingWrites

if TYPE_CHECKING:
    from kandevd.schedules.history import History
    from kandevd.schedules.jobs import Job, JobObject, JobTable
    from kandevd.schedules.restart.stranded import StrandedTurns
    from kandevd.schedules.sessions.session import SessionPlan
    from kandevd.schedules.settings import Switches


@dataclass(frozen=True)
class SourceParts:
    """What a source is given by the composition root: it calls nothing above it."""

    #: The workflow root.
    root: Path
    retention_days: float
    #: Where the root's failed history writes wait for the cron loop to retry them.
    backlog: PendingWrites
    #: Where the loaded jobs are kept (a source rewriting its files installs them).
    table: JobTable
    #: The runs a dead daemon left ``running``, marked while loading at start.
    stranded: StrandedTurns
    #: Where a file moved aside is reported.
    on_corrupt: CorruptReporter


class JobSpec(Protocol):
    """One job's definition, as its files declare it."""

    #: ``workflow`` or ``product``.
    entity_type: str
    #: What one session at a time is counted by (a product job adds its user).
    key: str
    user_id: str | None
    #: The schedule's definition: ``id``, ``enabled``, ``cron_expression``, ``timezone``...
    schedule: Any
    overlap_policy: str

    def definition(self) -> JobObject:
        """The JOB fields the definition gives (id, entity_type, schedule fields...)."""

    def verdict(self, switches: Switches) -> str | None:
        """Why the allow/block lists keep this job's cron fires out (None: they do not)."""


class JobSource(Protocol):
    """A kind of job: its files, when its jobs are due, what their sessions run."""

    #: Every id of this kind starts so (``workflow:``, ``product:``).
    prefix: str
    #: An id without a prefix names a job of this kind (a bare schedule id).
    accepts_bare_ids: bool
    #: ``scheduler.jobs.update`` and ``delete`` may change its jobs' definitions.
    editable: bool

    def load(self, now: datetime | None, old: dict[str, Job], *,
             last_seen: datetime | None = None) -> list[Job]:
        """Every job of this kind, from the files; ``old`` jobs keep their state, and
        those whose file now has a problem are kept, ``state.invalid`` set.

        ``now`` is given at start: the first load after the daemon was down, which
        ``last_seen`` (when a daemon last ticked for the root) tells since when."""

    def problems(self) -> list[dict[str, str]]:
        """What the last load could not use, as ``{path, message}``."""

    def counts(self, jobs: dict[str, Job]) -> dict[str, int]:
        """How many of what this source loaded (``daemon.status``)."""

    def find(self, jobs: dict[str, Job], job_id: str, user_id: str | None) -> Job:
        """The job ``job_id`` names (of ``user_id``); JobNotFound, AmbiguousJob or
        UserNeeded when there is none to take."""

    def due(self, jobs: list[Job], now: datetime) -> list[Job]:
        """The jobs due at ``now``, each with ``state.due_at`` (the intended time) set and
        its following fire computed; the others learn when to be asked again."""

    def next_wake(self, jobs: list[Job], now: datetime) -> datetime | None:
        """When :meth:`due` has something to do next."""

    def plan(self, job: Job, trigger_source: str) -> tuple[SessionPlan, History]:
        """A new session of ``job`` and the history it records into."""

    def history(self, job: Job) -> History:
        """The history file ``job``'s runs are recorded in."""

    def started(self, job: Job, now: datetime) -> None:
        """A session of ``job`` was accepted."""

    def finished(self, job: Job, entry: HistoryEntry) -> None:
        """A session of ``job`` ended with the history ``entry``."""

    def reseed(self, job: Job, without: str | None) -> None:
        """Forget what the job's state took from the entry ``without`` (a run a previous
        daemon left, marked interrupted at start), whose real end :meth:`finished` will
        fold in: its turn was adopted, or its end was found. None: take every entry
        as it reads now."""

    def skipped(self, job: Job, now: datetime) -> None:
        """A due occurrence of ``job`` did not run (paused, switched off, overlapping)."""

    def set_enabled(self, job: Job, enabled: bool, now: datetime) -> Job:
        """Enable or disable ``job``; the job as it is now."""

    def next_times(self, job: Job, after: datetime, count: int) -> list[datetime]:
        """``job``'s next fire times after ``after`` (as if each ran on time)."""

    def change(self, job: Job, fields: dict[str, Any] | None, now: datetime) -> Job | None:
        """Change ``job``'s definition (None: delete it); the job as it is now."""

    def details(self, job: Job) -> JobObject:
        """JOB fields only this kind has (a product job's ``held_until``...)."""

    def session_lock(self, entry: HistoryEntry) -> threading.Lock | None:
        """The lock a session of ``entry`` holds while its turns run (a product's
        conversation takes one message at a time); None: not this kind's, or none."""
