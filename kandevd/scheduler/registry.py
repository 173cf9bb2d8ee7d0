"""The job registry: every schedule of the workflow root, as one JOB shape.

Definitions live in the files (``Workflow/<name>/workflow.json``); the
registry holds what the daemon knows about them at run time (last run, next
fire, skip counters), in memory. Nothing about a schedule lives in kandevd.db:
at start the runtime state is seeded from each workflow's retained history,
so a restart still shows the last run.

Job ids: ``workflow:<workflow>:<schedule_id>``; a bare ``<schedule_id>`` is
accepted when it is unique across workflows.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kandevd.cron import next_fire_times
from kandevd.jsonfile import CorruptFile
from kandevd.products.jobs import ProductJob, ProductJobs
from kandevd.products.session import ProductProgram
from kandevd.scheduler.session import SessionPlan
from kandevd.scheduler.settings import PauseState, Switches
from kandevd.scheduler.workflow_session import WorkflowProgram
from kandevd.timeutil import rfc3339, utc_now
from kandevd.workflows import history as hist
from kandevd.workflows import manifest
from kandevd.workflows.manifest import Problem, Schedule, Workflow

log = logging.getLogger("kandevd.scheduler")

MISSED_CAP = 1000
WORKFLOW_PREFIX = "workflow:"


class JobNotFound(LookupError):
    pass


class AmbiguousJob(ValueError):
    pass


def workflow_job_id(workflow: str, schedule_id: str) -> str:
    return f"{WORKFLOW_PREFIX}{workflow}:{schedule_id}"


@dataclass
class JobState:
    """What the daemon knows about a schedule beyond its definition (memory only)."""

    last_status: str | None = None
    last_run_at: str | None = None
    last_session_id: str | None = None
    last_error: str | None = None
    last_duration_ms: int | None = None
    run_count: int = 0
    consecutive_failures: int = 0
    skipped_overlap: int = 0
    skipped_paused: int = 0
    skipped_disabled: int = 0
    missed_while_down: int = 0
    next_fire: datetime | None = None
    #: The occurrence the last ``due()`` found (the fire's intended time).
    due_at: datetime | None = None
    last_success_at: str | None = None

    def record(self, entry: dict[str, Any]) -> None:
        """Fold a completed history entry into the state."""
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


@dataclass
class Job:
    id: str
    workflow: Workflow
    schedule: Schedule
    state: JobState = field(default_factory=JobState)

    @property
    def key(self) -> str:
        """What one session at a time is counted by (a product job adds its user)."""
        return self.id


AnyJob = Job | ProductJob


def seed_state(entries: list[dict[str, Any]]) -> JobState:
    """Runtime state from one schedule's history entries (newest first)."""
    state = JobState()
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
    return state


def count_missed(schedule: Schedule, since: datetime, until: datetime) -> int:
    """Fire times of ``schedule`` in ``(since, until]``, capped at MISSED_CAP."""
    times = next_fire_times(schedule.trigger, since, MISSED_CAP)
    return sum(1 for moment in times if moment <= until)


def next_fire(schedule: Schedule, after: datetime) -> datetime | None:
    if not schedule.enabled:
        return None
    times = next_fire_times(schedule.trigger, after, 1)
    return times[0] if times else None


class JobRegistry:
    """The jobs of one workflow root; thread-safe."""

    def __init__(self, root: Path, *, switches: Switches, retention_days: float,
                 on_corrupt: Callable[[CorruptFile], None] | None = None) -> None:
        self.root = root
        self.switches = switches
        self.retention_days = retention_days
        self.pause = PauseState(root, on_corrupt=self.report_corrupt)
        self._external_corrupt = on_corrupt
        self._lock = threading.RLock()
        self._jobs: dict[str, Job] = {}
        self._workflows: dict[str, Workflow] = {}
        self._problems: list[Problem] = []
        self._corrupt_files: list[CorruptFile] = []
        self.products = ProductJobs(root, retention_days=retention_days,
                                    on_corrupt=self.report_corrupt)

    # -- files ----------------------------------------------------------------------
    def report_corrupt(self, report: CorruptFile) -> None:
        """A file under the root was moved aside: keep it for ``scheduler.errors``."""
        with self._lock:
            self._corrupt_files.append(report)
            del self._corrupt_files[:-100]
        if self._external_corrupt is not None:
            self._external_corrupt(report)

    def session_for(self, job: AnyJob, trigger_source: str
                    ) -> tuple[SessionPlan, hist.History]:
        """The plan of a new session of ``job`` and the history it records into."""
        if isinstance(job, ProductJob):
            program = ProductProgram(self.root, job.product, job.schedule, job.user.id)
            plan = SessionPlan(job.key, program, trigger_source,
                               session_id=self.products.session_id(job))
            return plan, self.products.history(job)
        program = WorkflowProgram(job.workflow, job.schedule, on_corrupt=self.report_corrupt)
        return SessionPlan(job.key, program, trigger_source), self.history(job.workflow)

    def session_started(self, job: AnyJob) -> None:
        """A session of ``job`` was accepted (a product occurrence is spent from now)."""
        if isinstance(job, ProductJob):
            self.products.started(job, utc_now())

    def record_finished(self, key: str, entry: dict[str, Any]) -> None:
        """Fold a finished session into its job's state (gone after a reload: only its
        history was written)."""
        try:
            job = self.by_key(key)
        except JobNotFound:
            return
        if isinstance(job, ProductJob):
            self.products.record(job, entry)
        else:
            job.state.record(entry)

    def by_key(self, key: str) -> AnyJob:
        with self._lock:
            job: AnyJob | None = self._jobs.get(key)
        if job is None:
            job = self.products.by_key(key)
        if job is None:
            raise JobNotFound(f"no job {key!r}")
        return job

    def history(self, workflow: Workflow) -> hist.History:
        return hist.History(workflow.folder, retention_days=self.retention_days,
                            on_corrupt=self.report_corrupt)

    # -- loading --------------------------------------------------------------------
    def load_at_start(self, now: datetime) -> None:
        """The first scan: fix histories a dead daemon left ``running``, seed state."""
        workflows, problems = manifest.scan(self.root)
        jobs: dict[str, Job] = {}
        for workflow in workflows:
            history = self.history(workflow)
            entries, fixed = history.repair_after_restart(now)
            if fixed:
                log.warning("%s: %d run(s) left running by a previous daemon marked "
                            "'error' (%s)", history.file.path, fixed, hist.RESTART_ERROR)
            grouped = hist.latest_by_schedule(entries)
            for schedule in workflow.schedules:
                job = Job(workflow_job_id(workflow.name, schedule.id), workflow, schedule)
                entries = grouped.get(schedule.id, [])
                job.state = seed_state(entries)
                job.state.next_fire = next_fire(schedule, now)
                self._count_missed(job, entries, now)
                jobs[job.id] = job
        self._install(workflows, problems, jobs)
        products = self.products.load(now)
        log.info("scheduler: %d workflow(s), %d job(s), %d product job(s) under %s",
                 len(workflows), len(jobs), products["product_jobs"], self.root)
        for problem in problems:
            log.error("workflow not loaded: %s", problem)

    def _count_missed(self, job: Job, entries: list[dict[str, Any]], now: datetime) -> None:
        if not entries or not job.schedule.enabled:
            return
        newest = hist.entry_time({"started_at": entries[0].get("started_at")})
        if newest is None or newest >= now:
            return
        missed = count_missed(job.schedule, newest, now)
        job.state.missed_while_down = missed
        if missed:
            more = "+" if missed >= MISSED_CAP else ""
            log.info("%s: %d%s fire(s) missed while the daemon was down since %s; not "
                     "replayed, next fire %s", job.id, missed, more, rfc3339(newest),
                     rfc3339(job.state.next_fire) if job.state.next_fire else "none")

    def rescan(self, now: datetime) -> dict[str, Any]:
        """Reload the whole root; state carries over, changed timings get a new next fire."""
        workflows, problems = manifest.scan(self.root)
        with self._lock:
            old = dict(self._jobs)
        jobs = {}
        for workflow in workflows:
            for schedule in workflow.schedules:
                job_id = workflow_job_id(workflow.name, schedule.id)
                jobs[job_id] = self._carry(old.get(job_id), workflow, schedule, now)
        self._install(workflows, problems, jobs)
        products = self.products.load()
        added = sorted(set(jobs) - set(old))
        removed = sorted(set(old) - set(jobs))
        changed = sorted(j for j in set(jobs) & set(old) if jobs[j].schedule != old[j].schedule)
        log.info("scheduler reloaded: %d workflow(s), %d job(s) (%d added, %d changed, "
                 "%d removed), %d problem(s)", len(workflows), len(jobs), len(added),
                 len(changed), len(removed), len(problems))
        for problem in problems:
            log.error("workflow not loaded: %s", problem)
        return {"workflows": len(workflows), "jobs": len(jobs), "added": added,
                "changed": changed, "removed": removed, **products,
                "errors": self.problems()}

    def reload_workflow(self, name: str, now: datetime) -> Workflow | None:
        """Reload one workflow after kandevd itself rewrote its manifest."""
        folder = manifest.workflow_folder(self.root, name)
        workflow, problems = manifest.load_workflow(folder)
        with self._lock:
            old = {j: job for j, job in self._jobs.items() if job.workflow.name == name}
            for job_id in old:
                del self._jobs[job_id]
            self._problems = [p for p in self._problems
                              if not Path(p.path).is_relative_to(folder)] + problems
            self._workflows.pop(name, None)
            if workflow is not None:
                self._workflows[name] = workflow
                for schedule in workflow.schedules:
                    job_id = workflow_job_id(name, schedule.id)
                    self._jobs[job_id] = self._carry(old.get(job_id), workflow, schedule, now)
        return workflow

    @staticmethod
    def _carry(previous: Job | None, workflow: Workflow, schedule: Schedule,
               now: datetime) -> Job:
        job = Job(workflow_job_id(workflow.name, schedule.id), workflow, schedule)
        if previous is None:
            job.state.next_fire = next_fire(schedule, now)
            return job
        # The state object itself carries over (not a copy), so a session that ends
        # during the reload records into the job either way.
        job.state = previous.state
        timing = (schedule.cron_expression, schedule.timezone, schedule.enabled)
        before = (previous.schedule.cron_expression, previous.schedule.timezone,
                  previous.schedule.enabled)
        if timing != before or job.state.next_fire is None:
            job.state.next_fire = next_fire(schedule, now)
        return job

    def _install(self, workflows: list[Workflow], problems: list[Problem],
                 jobs: dict[str, Job]) -> None:
        with self._lock:
            self._workflows = {w.name: w for w in workflows}
            self._problems = problems
            self._jobs = jobs

    # -- lookups --------------------------------------------------------------------
    def workflow(self, name: str) -> Workflow | None:
        with self._lock:
            return self._workflows.get(name)

    def resolve(self, job_id: str) -> Job:
        """The job named by a full id or a bare, unique schedule id."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None:
                return job
            if job_id.startswith(WORKFLOW_PREFIX):
                raise JobNotFound(f"no job {job_id!r}")
            matches = sorted(j for j, job in self._jobs.items() if job.schedule.id == job_id)
        if not matches:
            raise JobNotFound(f"no job {job_id!r} (ids look like "
                              "'workflow:<workflow>:<schedule_id>')")
        if len(matches) > 1:
            raise AmbiguousJob(f"schedule id {job_id!r} is used by several workflows; use "
                               f"one of: {', '.join(matches)}")
        return self._jobs[matches[0]]

    def jobs(self) -> list[Job]:
        with self._lock:
            return [self._jobs[k] for k in sorted(self._jobs)]

    def problems(self) -> list[dict[str, str]]:
        with self._lock:
            found = [p.as_dict() for p in self._problems + self.products.problems]
            found += [{"path": c.path, "message": f"{c.error}; moved aside to {c.moved_to}"}
                      for c in self._corrupt_files]
            return found

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"workflows": len(self._workflows), "jobs": len(self._jobs),
                    "product_jobs": len(self.products.jobs())}

    # -- the clock ------------------------------------------------------------------
    def due(self, now: datetime) -> list[Job]:
        """Jobs whose next fire is at or before ``now``; each gets its following fire."""
        fired = []
        with self._lock:
            for job in self._jobs.values():
                moment = job.state.next_fire
                if moment is not None and moment <= now:
                    job.state.due_at = moment
                    job.state.next_fire = next_fire(job.schedule, max(moment, now))
                    fired.append(job)
        return sorted(fired, key=lambda j: j.id)

    def next_wake(self) -> datetime | None:
        with self._lock:
            times = [j.state.next_fire for j in self._jobs.values()
                     if j.state.next_fire is not None]
        return min(times) if times else None

    # -- eligibility ----------------------------------------------------------------
    def ineligible_reason(self, job: AnyJob, paused: bool) -> str | None:
        """Why a cron fire of ``job`` would not run now (None: it would)."""
        if isinstance(job, ProductJob):
            enabled, verdict = job.enabled, self.switches.user_verdict(job.user.id)
        else:
            enabled = job.schedule.enabled
            verdict = self.switches.workflow_verdict(job.workflow.aliases)
        if not enabled:
            return "schedule is disabled"
        if not self.switches.execution_enabled:
            return self.switches.disabled_reason
        if verdict is not None:
            return verdict
        if paused:
            return "scheduler is globally paused"
        return None

    def as_dict(self, job: Job, *, running: bool, paused: bool) -> dict[str, Any]:
        """The JOB shape of the contract."""
        state = job.state
        reason = self.ineligible_reason(job, paused)
        definition = job.schedule.as_dict()
        del definition["id"]
        return {
            "id": job.id, "entity_type": "workflow", "workflow": job.workflow.name,
            "schedule_id": job.schedule.id, **definition,
            "last_status": state.last_status, "last_run_at": state.last_run_at,
            "next_run_at": rfc3339(state.next_fire) if state.next_fire else None,
            "last_session_id": state.last_session_id, "last_error": state.last_error,
            "last_duration_ms": state.last_duration_ms, "run_count": state.run_count,
            "consecutive_failures": state.consecutive_failures, "running": running,
            "skipped_overlap": state.skipped_overlap, "skipped_paused": state.skipped_paused,
            "skipped_disabled": state.skipped_disabled,
            "missed_while_down": state.missed_while_down,
            "cron_eligible": reason is None, "cron_ineligible_reason": reason,
        }

