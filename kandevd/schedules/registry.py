"""The job registry: every job of the workflow root, whatever its kind, in memory.

Definitions live in the files; the registry holds the jobs loaded from them
by each source (workflow schedules, product schedules) with what the daemon
knows at run time (last run, next fire, skip counters). Nothing about a job
lives in kandevd.db. Thread-safe: the cron loop, sessions ending in their
threads and the control methods all use it.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime
from pathlib import Path
from typing import TypedDict

from kandevd.formats.jsonfile import CorruptFiles
from kandevd.schedules.history import HistoryEntry, PendingWrites
from kandevd.schedules.jobs import Job, JobNotFound, JobTable
from kandevd.schedules.restart.alive import AliveMark
from kandevd.schedules.settings import PauseState, Switches
from kandevd.schedules.source import JobSource

log = logging.getLogger("kandevd.scheduler")


class Rescan(TypedDict, total=False):
    """What ``scheduler.reload`` found: each source's counts, the job keys added,
    changed, removed and made invalid, and the files' problems."""

    workflows: int
    jobs: int
    products: int
    product_jobs: int
    added: list[str]
    changed: list[str]
    removed: list[str]
    invalid: list[str]
    errors: list[dict[str, str]]


class JobRegistry:
    """The jobs of one workflow root; thread-safe."""

    def __init__(self, root: Path, *, switches: Switches, sources: dict[str, JobSource],
                 table: JobTable, corrupt: CorruptFiles, backlog: PendingWrites) -> None:
        """``sources``: the kinds of job, by name, in lookup order, each loading into
        ``table``; ``corrupt``: where the root's files moved aside are reported;
        ``backlog``: where the root's failed history writes wait."""
        self.root = root
        self.switches = switches
        self._corrupt = corrupt
        self.pause = PauseState(root, on_corrupt=corrupt)
        self.alive = AliveMark(root)
        #: The root's history writes that failed, retried by the cron loop.
        self.backlog = backlog
        self.sources = sources
        self._table = table

    # -- loading --------------------------------------------------------------------
    def load_at_start(self, now: datetime) -> None:
        """The first scan (histories a dead daemon left ``running`` are closed; fires
        missed since a daemon last ticked for this root are counted)."""
        last_seen = self.alive.last_seen()
        for name, source in self.sources.items():
            self._install(name, source.load(now, {}, last_seen=last_seen))
        self.alive.touch(now)
        counts = self.counts()
        log.info("scheduler: %d workflow(s), %d job(s), %d product job(s) under %s",
                 counts.get("workflows", 0), counts.get("jobs", 0),
                 counts.get("product_jobs", 0), self.root)

    def rescan(self, now: datetime) -> Rescan:
        """Reload every source; state carries over, changed timings get a new next fire.

        Returns the counts, the job keys ``added``, ``changed`` (a new definition),
        ``removed`` and ``invalid`` (kept from before, their file now has a problem),
        and every problem as ``errors``.
        """
        changes: dict[str, list[str]] = {"added": [], "changed": [], "removed": [],
                                         "invalid": []}
        self.pause.get()  # (a pause file that does not parse is met, and reported, now)
        for name, source in self.sources.items():
            old = self.of(name)
            self._install(name, source.load(None, old))
            new = self.of(name)
            changes["added"] += sorted(set(new) - set(old))
            changes["removed"] += sorted(set(old) - set(new))
            changes["changed"] += sorted(key for key in set(new) & set(old)
                                         if new[key].spec.schedule != old[key].spec.schedule)
            changes["invalid"] += sorted(key for key, job in new.items()
                                         if job.state.invalid is not None)
        counts = self.counts()
        problems = self.problems()
        log.info("scheduler reloaded: %s (%d added, %d changed, %d removed, %d invalid), "
                 "%d problem(s)", ", ".join(f"{n} {what}" for what, n in counts.items()),
                 *(len(changes[k]) for k in ("added", "changed", "removed", "invalid")),
                 len(problems))
        return {**counts, **changes, "errors": problems}

    def _install(self, name: str, jobs: list[Job]) -> None:
        self._table.install(name, jobs)

    # -- lookups --------------------------------------------------------------------
    def of(self, name: str) -> dict[str, Job]:
        """The jobs of source ``name``, by key (a copy)."""
        return self._table.of(name)

    def jobs(self, *, source: str | None = None, user_id: str | None = None) -> list[Job]:
        """Every job (of one source, of one user), sorted by id then user."""
        chosen = [job for name, jobs in self._table.every().items() if source in (None, name)
                  for job in jobs.values() if user_id is None or job.user_id == user_id]
        return sorted(chosen, key=lambda job: (job.id, job.user_id or ""))

    def by_key(self, key: str) -> Job:
        return self._table.by_key(key)

    def source_of(self, job_id: str) -> JobSource:
        """The source whose jobs ``job_id`` names (by its prefix; a bare id: workflows)."""
        return self.sources[self._source_name(job_id)]

    def _source_name(self, job_id: str) -> str:
        chosen = [name for name, source in self.sources.items()
                  if job_id.startswith(source.prefix)] or \
                 [name for name, source in self.sources.items() if source.accepts_bare_ids]
        if not chosen:
            raise JobNotFound(f"no job {job_id!r}")
        return chosen[0]

    def resolve(self, job_id: str, user_id: str | None = None) -> Job:
        """The job named by ``job_id`` (and ``user_id`` for a job of each user).

        An id starts with its source's prefix; a bare id goes to the source that
        takes bare ids. JobNotFound, AmbiguousJob (a bare schedule id several
        workflows use) or UserNeeded (a job of each user named without one).
        """
        name = self._source_name(job_id)
        return self.sources[name].find(self.of(name), job_id, user_id)

    def problems(self) -> list[dict[str, str]]:
        found = [problem for source in self.sources.values() for problem in source.problems()]
        found += [{"path": c.path, "message": f"{c.error}; moved aside to {c.moved_to}",
                   "kind": "state"} for c in self._corrupt.recent()]
        return found

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for name, source in self.sources.items():
            counts.update(source.counts(self.of(name)))
        return counts

    # -- the clock ------------------------------------------------------------------
    def session_lock(self, entry: HistoryEntry) -> threading.Lock | None:
        """The lock the session of ``entry`` holds while it runs, its source's say."""
        for source in self.sources.values():
            lock = source.session_lock(entry)
            if lock is not None:
                return lock
        return None

    def due(self, now: datetime) -> list[Job]:
        """The jobs due at ``now`` (each with its intended time in ``state.due_at``)."""
        found: list[Job] = []
        for name, source in self.sources.items():
            found += source.due(list(self.of(name).values()), now)
        return found

    def next_wake(self, now: datetime) -> datetime | None:
        times = [t for name, source in self.sources.items()
                 if (t := source.next_wake(list(self.of(name).values()), now)) is not None]
        return min(times) if times else None

    # -- eligibility ----------------------------------------------------------------
    def ineligible_reason(self, job: Job, paused: bool) -> str | None:
        """Why a cron fire of ``job`` would not run now (None: it would)."""
        if job.state.invalid is not None:
            return f"its file has a problem: {job.state.invalid}"
        if not job.enabled:
            return "schedule is disabled"
        if not self.switches.execution_enabled:
            return self.switches.disabled_reason
        verdict = job.spec.verdict(self.switches)
        if verdict is not None:
            return verdict
        if paused:
            return "scheduler is globally paused"
        return None
