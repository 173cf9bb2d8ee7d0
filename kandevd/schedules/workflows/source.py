"""Workflow schedules as jobs: ``Workflow/<name>/workflow.json``, fired on their cron times.

Job ids are ``workflow:<workflow>:<schedule_id>``; a bare ``<schedule_id>`` is
accepted when it is unique across workflows. The run-time state lives in
memory and is seeded at start from each workflow's retained history, so a
restart still shows the last run; fires missed while the daemon was down
are counted, not replayed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kandevd.cron import next_fire_times
from kandevd.schedules import history as hist
from kandevd.schedules.history import HistoryEntry
from kandevd.schedules.jobs import AmbiguousJob, Job, JobNotFound, JobObject, seed_state
from kandevd.schedules.rules.options import jitter_delay, within_window
from kandevd.schedules.sessions.session import SessionPlan
from kandevd.schedules.settings import Switches
from kandevd.schedules.workflows import manifest
from kandevd.schedules.workflows.manifest import Problem, Schedule, Workflow
from kandevd.schedules.workflows.program import WorkflowProgram
from kandevd.timeutil import rfc3339, utc_now

if TYPE_CHECKING:
    from kandevd.schedules.source import SourceParts

log = logging.getLogger("kandevd.scheduler")

MISSED_CAP = 1000
WORKFLOW_PREFIX = "workflow:"


def workflow_job_id(workflow: str, schedule_id: str) -> str:
    return f"{WORKFLOW_PREFIX}{workflow}:{schedule_id}"


def missed_times(schedule: Schedule, since: datetime, until: datetime) -> list[datetime]:
    """Fire times of ``schedule`` in ``(since, until]`` inside its window, at most
    MISSED_CAP."""
    times = next_fire_times(schedule.trigger, since, MISSED_CAP)
    return [t for t in times if t <= until and within_window(schedule.options, t)]


def next_fire(schedule: Schedule, after: datetime) -> datetime | None:
    """The first fire time after ``after`` inside the window (``start_at``/``end_at``)."""
    if not schedule.enabled:
        return None
    start, end = schedule.options.window_timing()
    if start is not None and after < start:
        after = start - timedelta(microseconds=1)  # a fire at start_at itself counts
    times = next_fire_times(schedule.trigger, after, 1)
    if not times or (end is not None and times[0] > end):
        return None
    return times[0]


@dataclass(frozen=True)
class WorkflowSpec:
    workflow: Workflow
    schedule: Schedule
    entity_type = "workflow"
    user_id = None

    @property
    def key(self) -> str:
        return workflow_job_id(self.workflow.name, self.schedule.id)

    @property
    def overlap_policy(self) -> str:
        return self.schedule.overlap_policy

    def definition(self) -> JobObject:
        fields = self.schedule.as_dict()
        del fields["id"]
        return {"id": self.key, "entity_type": "workflow", "workflow": self.workflow.name,
                "schedule_id": self.schedule.id, **fields}

    def verdict(self, switches: Switches) -> str | None:
        return switches.workflow_verdict(self.workflow.aliases)


class WorkflowSource:
    """The workflow schedules of one root."""

    prefix = WORKFLOW_PREFIX
    accepts_bare_ids = True
    editable = True

    def __init__(self, parts: SourceParts) -> None:
        self.parts = parts
        self.root: Path = parts.root
        self.retention_days = parts.retention_days
        self.on_corrupt = parts.on_corrupt
        self._problems: list[Problem] = []
        self._workflows: dict[str, Workflow] = {}

    # -- files ----------------------------------------------------------------------
    def history_of(self, workflow: Workflow) -> hist.History:
        return hist.History(workflow.folder, retention_days=self.retention_days,
                            backlog=self.parts.backlog, on_corrupt=self.on_corrupt)

    def history(self, job: Job) -> hist.History:
        return self.history_of(job.spec.workflow)

    def load(self, now: datetime | None, old: dict[str, Job], *,
             last_seen: datetime | None = None) -> list[Job]:
        """Every workflow's jobs; ``old`` ones keep their state, new ones are seeded from
        the history, and the jobs of a workflow whose files have a problem are kept as
        they were, ``invalid``, until it is fixed.

        ``now`` is given at start (``last_seen``: when a daemon last ticked for this
        root): fires missed since are counted, what a dead daemon left running closed.
        """
        workflows, problems = manifest.scan(self.root)
        moment = now if now is not None else utc_now()
        jobs: list[Job] = []
        for workflow in workflows:
            grouped = self._histories(workflow, now, old)
            for schedule in workflow.schedules:
                spec = WorkflowSpec(workflow, schedule)
                if spec.key in old:
                    jobs.append(self._job(old, workflow, schedule, moment))
                    continue
                job = Job(spec.key, spec, self)
                entries = grouped.get(schedule.id, [])
                job.state = seed_state(entries)
                job.state.next_fire = next_fire(schedule, moment)
                if now is not None:
                    self._count_missed(job, entries, now, last_seen)
                jobs.append(job)
        loaded = {job.key for job in jobs}
        jobs += _kept_invalid(old, loaded, problems, manifest.workflow_root(self.root))
        self._workflows = {w.name: w for w in workflows}
        self._problems = problems
        for problem in problems:
            log.error("workflow not loaded: %s", problem)
        return jobs

    def _histories(self, workflow: Workflow, now: datetime | None, old: dict[str, Job]
                   ) -> dict[str, list[dict[str, Any]]]:
        """The workflow's history by schedule, when a job needs seeding from it."""
        if now is None and all(WorkflowSpec(workflow, s).key in old for s in workflow.schedules):
            return {}
        history = self.history_of(workflow)
        if now is None:
            return hist.latest_by_schedule(history.entries_to_seed())
        return hist.latest_by_schedule(self.parts.stranded.mark(
            history, now, lambda e: workflow_job_id(workflow.name, str(e.get("schedule_id")))))

    def _job(self, old: dict[str, Job], workflow: Workflow, schedule: Schedule,
             now: datetime) -> Job:
        spec = WorkflowSpec(workflow, schedule)
        job = Job(spec.key, spec, self)
        previous = old.get(spec.key)
        if previous is None:  # (new in an edit: seeded from its history, as at start)
            entries = hist.latest_by_schedule(self.history_of(workflow).entries_to_seed())
            job.state = seed_state(entries.get(schedule.id, []))
            job.state.next_fire = next_fire(schedule, now)
            return job
        # The state object itself carries over (not a copy), so a session that ends
        # during the reload records into the job either way.
        job.state = previous.state
        job.state.invalid = None
        def timing(s: Schedule) -> tuple[Any, ...]:
            return (s.cron_expression, s.timezone, s.enabled, s.options.window_timing())
        if timing(schedule) != timing(previous.spec.schedule):
            job.state.delayed_until = None  # a fire waiting for its jitter: a new timing
        if timing(schedule) != timing(previous.spec.schedule) \
                or job.state.next_fire is None:
            job.state.next_fire = next_fire(schedule, now)
        if job.state.enabled is False:  # (held off: a pause its file could not say)
            job.state.next_fire = None
        return job

    def _count_missed(self, job: Job, entries: list[HistoryEntry], now: datetime,
                      last_seen: datetime | None) -> None:
        """Fires whose time fell while no daemon ran: after ``last_seen`` (else after the
        newest run, when no daemon left its mark). Those within ``catchup_window_s``
        before ``now`` are kept for one catch-up run.

        A jittered fire's time is its start (the fire time plus its delay, the same for
        every daemon): one whose start is still ahead was pending when the last daemon
        stopped (or its fire time fell while none ran) and starts then, once; one whose
        start passed while no daemon ran is missed like any other."""
        schedule = job.spec.schedule
        if not schedule.enabled:
            return
        since = min(last_seen, now) if last_seen is not None else None
        if since is None and entries:
            since = hist.entry_time({"started_at": entries[0].get("started_at")})
        if since is None or since >= now:
            return
        jitter = schedule.options.jitter_s
        ran = _fired(entries) if jitter else set()

        def start(moment: datetime) -> datetime:
            return moment + jitter_delay(job.key, moment, jitter)

        def unrun(after: datetime) -> list[datetime]:
            """Fires (not run) whose start may lie after ``after`` (at most the cap)."""
            return [t for t in missed_times(schedule, after - timedelta(seconds=jitter), now)
                    if rfc3339(t) not in ran]
        pending = next((t for t in unrun(now) if start(t) > now), None) if jitter else None
        if pending is not None:
            job.state.delayed_until, job.state.delayed_for = start(pending), pending
            log.info("%s: the fire of %s (jitter_s) starts at %s, as it would have without "
                     "the restart", job.id, rfc3339(pending), rfc3339(start(pending)))

        def passed(after: datetime) -> list[datetime]:
            """The fires whose start fell in ``(after, now]`` (before the pending one)."""
            return [t for t in unrun(after) if after < start(t) <= now
                    and (pending is None or t < pending)]
        times = passed(since)
        missed = len(times)
        job.state.missed_while_down = missed
        window = schedule.options.catchup_window_s
        caught = passed(max(since, now - timedelta(seconds=window))) if window else []
        more = "+" if missed >= MISSED_CAP else ""  # (counted up to the cap)
        if caught:
            job.state.catchup = caught
            log.info("%s: %d%s fire(s) missed while the daemon was down since %s; %d within "
                     "catchup_window_s run once now", job.id, missed, more, rfc3339(since),
                     len(caught))
        elif missed:
            log.info("%s: %d%s fire(s) missed while the daemon was down since %s; not "
                     "replayed, next fire %s", job.id, missed, more, rfc3339(since),
                     rfc3339(job.state.next_fire) if job.state.next_fire else "none")

    def problems(self) -> list[dict[str, str]]:
        return [problem.as_dict() for problem in self._problems]

    def session_lock(self, entry: HistoryEntry) -> threading.Lock | None:
        return None  # a workflow's sessions share no conversation

    def details(self, job: Job) -> JobObject:
        """The workflow's ``label`` (its manifest's; null when it has none): what people
        call the workflow, shown beside its schedules."""
        spec = job.spec
        assert isinstance(spec, WorkflowSpec)
        return {"workflow_label": spec.workflow.label or None}

    def counts(self, jobs: dict[str, Job]) -> dict[str, int]:
        return {"workflows": len(self._workflows), "jobs": len(jobs)}

    def find(self, jobs: dict[str, Job], job_id: str, user_id: str | None) -> Job:
        """The job named by a full id or a bare, unique schedule id."""
        job = jobs.get(job_id)
        if job is not None:
            return job
        if job_id.startswith(WORKFLOW_PREFIX):
            raise JobNotFound(f"no job {job_id!r}")
        matches = sorted(key for key, job in jobs.items() if job.spec.schedule.id == job_id)
        if not matches:
            raise JobNotFound(f"no job {job_id!r} (ids look like "
                              "'workflow:<workflow>:<schedule_id>')")
        if len(matches) > 1:
            raise AmbiguousJob(f"schedule id {job_id!r} is used by several workflows; use "
                               f"one of: {', '.join(matches)}")
        return jobs[matches[0]]

    # -- the clock ------------------------------------------------------------------
    def due(self, jobs: list[Job], now: datetime) -> list[Job]:
        """Jobs whose fire time came (after its jitter), and catch-up runs at start."""
        fired = []
        for job in jobs:
            state = job.state
            if state.invalid is not None:  # kept only to be shown until its file is fixed
                state.catchup = state.delayed_until = None
                continue
            if state.catchup:
                state.due_at = state.catchup[-1]
                fired.append(job)
                continue
            if state.delayed_until is not None:
                intended = state.delayed_for or state.due_at or now
                if not job.enabled or not within_window(job.spec.schedule.options, intended):
                    state.delayed_until = None  # switched off while it waited: dropped
                elif state.delayed_until <= now:
                    state.delayed_until = None
                    state.due_at = intended
                    fired.append(job)
                continue
            moment = state.next_fire
            if moment is not None and moment <= now:
                state.due_at = moment
                state.next_fire = next_fire(job.spec.schedule, max(moment, now))
                delay = jitter_delay(job.key, moment, job.spec.schedule.options.jitter_s)
                if moment + delay > now:
                    state.delayed_until, state.delayed_for = moment + delay, moment
                    continue
                fired.append(job)
        return sorted(fired, key=lambda j: j.id)

    def next_wake(self, jobs: list[Job], now: datetime) -> datetime | None:
        times = [t for j in jobs for t in (j.state.next_fire, j.state.delayed_until)
                 if t is not None]
        if any(j.state.catchup for j in jobs):
            times.append(now)
        return min(times) if times else None

    def next_times(self, job: Job, after: datetime, count: int) -> list[datetime]:
        start = job.spec.schedule.options.start_at
        if start is not None and after < start:
            after = start - timedelta(microseconds=1)
        return [t for t in next_fire_times(job.spec.schedule.trigger, after, count)
                if within_window(job.spec.schedule.options, t)]

    # -- sessions -------------------------------------------------------------------
    def plan(self, job: Job, trigger_source: str) -> tuple[SessionPlan, hist.History]:
        program = WorkflowProgram(job.spec.workflow, job.spec.schedule,
                                  on_corrupt=self.on_corrupt)
        return SessionPlan(job.key, program, trigger_source), self.history(job)

    def started(self, job: Job, now: datetime) -> None:
        """Nothing to keep: a workflow's next fire comes from its cron expression."""

    def finished(self, job: Job, entry: HistoryEntry) -> None:
        job.state.record(entry)

    def reseed(self, job: Job, without: str | None) -> None:
        """The state was seeded from the history with ``without`` counted as it read at
        start (interrupted: a failure): seeded again from the others."""
        entries = [e for e in hist.latest_by_schedule(self.history(job).entries()).get(
            job.spec.schedule.id, []) if e.get("id") != without]
        fresh = seed_state(entries)
        for name in ("last_status", "last_run_at", "last_session_id", "last_error",
                     "last_duration_ms", "run_count", "consecutive_failures",
                     "last_success_at"):
            setattr(job.state, name, getattr(fresh, name))

    def skipped(self, job: Job, now: datetime) -> None:
        """Nothing to keep: the following fire was computed when this one came due."""

    # -- changing the manifest ------------------------------------------------------
    def set_enabled(self, job: Job, enabled: bool, now: datetime) -> Job:
        changed = self.change(job, {"enabled": enabled}, now)
        assert changed is not None
        if changed.state.enabled is not None:  # (a pause held in memory: the file rules)
            changed.state.enabled, changed.state.next_fire = None, (
                changed.state.next_fire or next_fire(changed.spec.schedule, now))
        return changed

    def change(self, job: Job, fields: dict[str, Any] | None, now: datetime) -> Job | None:
        """Merge ``fields`` into the schedule in workflow.json (None: remove it)."""
        schedule_id = job.spec.schedule.id

        def edit(schedules: list[Any]) -> list[Any]:
            index = manifest.find_schedule(schedules, schedule_id)
            if index < 0:
                raise ScheduleGone(f"schedule {schedule_id!r} is no longer in the manifest")
            if fields is None:
                del schedules[index]
            else:
                schedules[index] = {**schedules[index], **fields}
            return schedules

        self._edit(job.spec.workflow.name, edit, now)
        return None if fields is None else self.parts.table.by_key(job.key)

    def create(self, name: str, schedule: dict[str, Any], now: datetime) -> Job:
        """Add ``schedule`` to workflow ``name``'s manifest; the new job."""
        def add(schedules: list[Any]) -> list[Any]:
            if manifest.find_schedule(schedules, schedule["id"]) >= 0:
                raise DuplicateSchedule(f"workflow {name!r} already has a schedule "
                                        f"{schedule['id']!r}")
            return [*schedules, schedule]

        workflow = self._edit(name, add, now)
        return self.parts.table.by_key(workflow_job_id(workflow.name, schedule["id"]))

    def _edit(self, name: str, edit: Callable[[list[Any]], list[Any]], now: datetime
              ) -> Workflow:
        """Rewrite workflow ``name``'s schedules, then reload that one workflow."""
        folder = manifest.workflow_folder(self.root, name)
        if not (folder / manifest.MANIFEST).is_file():
            raise WorkflowMissing(f"no workflow {name!r}: {folder / manifest.MANIFEST} "
                                  "does not exist")
        try:
            written = manifest.edit_schedules(folder, edit)
        except manifest.ManifestUnusable:
            raise
        except manifest.ManifestError as exc:
            raise manifest.ManifestError(f"workflow {name!r}: {exc}") from None
        workflow, problems = manifest.load_workflow(folder)
        old = self.parts.table.of("workflows")
        jobs = [job for job in old.values() if job.spec.workflow.name != name]
        self._problems = [p for p in self._problems
                          if not Path(p.path).is_relative_to(folder)] + problems
        self._workflows.pop(name, None)
        if workflow is not None:
            self._workflows[name] = workflow
            jobs += [self._job(old, workflow, schedule, now) for schedule in workflow.schedules]
        self.parts.table.install("workflows", jobs)
        return written


def _fired(entries: list[HistoryEntry]) -> set[str]:
    """The fire times the job's retained runs stand for (a jittered fire records its own
    as ``intended_at``; a catch-up run its ``fire_times``)."""
    times: set[str] = set()
    for entry in entries:
        if isinstance(entry.get("intended_at"), str):
            times.add(entry["intended_at"])
        fired = entry.get("fire_times")
        if isinstance(fired, list):
            times.update(t for t in fired if isinstance(t, str))
    return times


def _kept_invalid(old: dict[str, Job], loaded: set[str], problems: list[Problem],
                  base: Path) -> list[Job]:
    """The earlier jobs of folders under ``base`` that now have a problem: kept as they
    were, marked ``invalid`` with the problem, and not fired (no next fire)."""
    broken: dict[str, list[str]] = {}
    for problem in problems:
        try:
            folder, *inside = Path(problem.path).relative_to(base).parts
        except ValueError:
            continue
        where = "/".join(inside) or folder
        broken.setdefault(folder, []).append(f"{where}: {problem.message}")
    kept = []
    for key, job in old.items():
        messages = broken.get(job.spec.workflow.folder.name)
        if key in loaded or messages is None:
            continue
        job.state.invalid = "; ".join(messages)
        job.state.next_fire = None
        kept.append(job)
    return kept


class ScheduleGone(LookupError):
    """The schedule was removed from the manifest meanwhile."""


class WorkflowMissing(LookupError):
    """No such workflow folder (with a manifest)."""


class DuplicateSchedule(ValueError):
    """The workflow already has a schedule of that id."""
