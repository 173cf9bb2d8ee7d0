"""Product schedules as jobs: one per (user, product schedule) of ``product.yaml``.

Ids are ``product:<profile>:<schedule>``; the same id exists once per user who
has the product, so a product job is addressed by id *and* ``user_id``. The
definitions are read-only through the API (the product declares them); each
user's override (``enabled``) and bookkeeping live in the user's state file,
mirrored in the job's state. When a job is due is
:func:`kandevd.schedules.products.schedule.decide`'s call; this source only
asks it again when the time it named has come (``next_check``), so thousands
of idle jobs cost nothing between ticks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kandevd.cron import next_fire_times
from kandevd.jsonfile import CorruptFile
from kandevd.schedules import history as hist
from kandevd.schedules.jobs import Job, JobNotFound, JobState, UserNeeded
from kandevd.schedules.products import catalog
from kandevd.schedules.products.catalog import Product, User
from kandevd.schedules.products.program import ProductProgram
from kandevd.schedules.products.schedule import ProductSchedule, ScheduleState, decide
from kandevd.schedules.products.state import (
    UserState,
    conversation_session,
    product_history,
    state_from_file,
    state_to_file,
    stored_time,
)
from kandevd.schedules.session import SessionPlan
from kandevd.schedules.settings import Switches
from kandevd.schedules.workflows.manifest import Problem
from kandevd.timeutil import rfc3339

if TYPE_CHECKING:
    from kandevd.schedules.registry import JobRegistry

log = logging.getLogger("kandevd.scheduler.products")

PRODUCT_PREFIX = "product:"


def product_job_id(profile_id: str, schedule_id: str) -> str:
    return f"{PRODUCT_PREFIX}{profile_id}:{schedule_id}"


@dataclass(frozen=True)
class ProductSpec:
    product: Product
    schedule: ProductSchedule
    user: User
    entity_type = "product"
    overlap_policy = "skip"

    @property
    def id(self) -> str:
        return product_job_id(self.product.profile_id, self.schedule.id)

    @property
    def key(self) -> str:
        return f"{self.id}@{self.user.id}"

    @property
    def user_id(self) -> str:
        return self.user.id

    @property
    def state_key(self) -> str:
        """The job's entry in the user's state file."""
        return f"{self.product.profile_id}:{self.schedule.id}"

    def definition(self) -> dict[str, Any]:
        fields = self.schedule.as_dict()
        fields.pop("id", None)
        return {"id": self.id, "entity_type": "product", "workflow": None,
                "product": self.product.profile_id, "user_id": self.user.id,
                "schedule_id": self.schedule.id, **fields, "enabled": self.schedule.enabled,
                "default_enabled": self.schedule.enabled, "group_ids": [], "mode": None,
                "workshop_mode": None, "trigger_payload": {}, "overlap_policy": "skip",
                "pulse": False}

    def verdict(self, switches: Switches) -> str | None:
        return switches.user_verdict(self.user.id)


def _for_decide(state: JobState) -> ScheduleState:
    return ScheduleState(next_run_at=state.next_fire, last_run_at=stored_time(state.last_run_at),
                         last_status=state.last_status,
                         consecutive_failures=state.consecutive_failures)


class ProductSource:
    """Every product job of the root."""

    prefix = PRODUCT_PREFIX
    accepts_bare_ids = False
    #: The definitions are the product's: update and delete are refused.
    editable = False

    def __init__(self, registry: JobRegistry, *, retention_days: float,
                 on_corrupt: Callable[[CorruptFile], None]) -> None:
        self.registry = registry
        self.root: Path = registry.root
        self.retention_days = retention_days
        self._on_corrupt = on_corrupt
        self._lock = threading.RLock()
        self._directory = False
        self._activity: dict[tuple[str, str], datetime] = {}
        self._products = 0
        self._problems: list[Problem] = []

    # -- loading --------------------------------------------------------------------
    def load(self, now: datetime | None, old: dict[str, Job]) -> list[Job]:
        """(Re)read product.yaml files, users.yaml and the users' state files.

        ``now`` is given at start: a cron occurrence that passed while the daemon was
        down is not replayed (as for workflow schedules); the next one counts.
        """
        products, problems = catalog.scan_products(self.root)
        users, user_problems = catalog.read_users(self.root)
        problems += user_problems
        jobs: list[Job] = []
        activity: dict[tuple[str, str], datetime] = {}
        for user in users or []:
            if not user.enabled:
                continue
            mine = [p for p in products if p.schedules and user.has(p.profile_id)]
            if not mine:
                continue
            stored = UserState(self.root, user.id, on_corrupt=self._on_corrupt).read()
            for profile, at in stored["activity"].items():
                if (moment := stored_time(at)) is not None:
                    activity[(user.id, profile)] = moment
            for product in mine:
                for schedule in product.schedules:
                    jobs.append(self._job(old, ProductSpec(product, schedule, user),
                                          stored["schedules"], now))
        with self._lock:
            self._directory = (self.root / catalog.USERS_FILE).exists()
            self._activity = activity
            self._products = len(products)
            self._problems = problems
        for problem in problems:
            log.error("product schedules not loaded: %s", problem)
        return jobs

    def _job(self, old: dict[str, Job], spec: ProductSpec, stored: dict[str, Any],
             now: datetime | None) -> Job:
        job = Job(spec.id, spec, self)
        previous = old.get(spec.key)
        if previous is not None:
            job.state = previous.state
            if previous.spec.schedule != spec.schedule:  # new timing: decide afresh
                job.state.next_fire = None
                job.state.next_check = None
            return job
        job.state = state_from_file(stored.get(spec.state_key))
        missed = job.state.next_fire
        if now is not None and spec.schedule.cron_expression is not None \
                and missed is not None and missed <= now:
            log.info("%s: occurrence of %s missed while the daemon was down; not "
                     "replayed", job.key, rfc3339(missed))
            job.state.next_fire = None
        return job

    def summary(self, old: dict[str, Job], new: dict[str, Job], now: datetime
                ) -> dict[str, Any]:
        return {"products": self._products, "product_jobs": len(new)}

    def problems(self) -> list[dict[str, str]]:
        with self._lock:
            return [problem.as_dict() for problem in self._problems]

    def counts(self, jobs: dict[str, Job]) -> dict[str, int]:
        return {"product_jobs": len(jobs)}

    def find(self, jobs: dict[str, Job], job_id: str, user_id: str | None) -> Job:
        """The job ``job_id`` of ``user_id`` (of the one local user without a directory)."""
        given = user_id
        if user_id is None:
            if self._directory:
                raise UserNeeded(f"job {job_id!r} exists once per user: give user_id")
            user_id = catalog.LOCAL_USER
        job = jobs.get(f"{job_id}@{user_id}")
        if job is None:
            who = f" for user {given!r}" if given else ""
            raise JobNotFound(f"no job {job_id!r}{who}")
        return job

    # -- the clock ------------------------------------------------------------------
    def due(self, jobs: list[Job], now: datetime) -> list[Job]:
        """Jobs ``decide`` says are due now; the others learn when to be asked again.

        A first decision (no ``next_run_at`` yet) is written to the user's state file,
        so a first cadence slot does not move on with every restart.
        """
        fired: list[Job] = []
        to_save: list[Job] = []
        with self._lock:
            for job in jobs:
                state = job.state
                if not job.enabled or (state.next_check is not None and state.next_check > now):
                    continue
                try:
                    decision = decide(job.spec.schedule, _for_decide(state), now,
                                      self._activity.get((job.spec.user.id,
                                                          job.spec.product.profile_id)))
                except (ValueError, OverflowError) as exc:  # one job never stalls the tick
                    log.error("%s: cannot decide when it is due (%s); asked again in an hour",
                              job.key, exc)
                    state.next_check = now + timedelta(hours=1)
                    continue
                if decision.due:
                    # A product occurrence is known by its minute: ``decide`` says "due now".
                    state.due_at = now.replace(second=0, microsecond=0)
                    fired.append(job)
                    continue
                state.next_check = decision.next_at
                if state.next_fire is None and decision.reason != "quiet":
                    state.next_fire = decision.next_at
                    to_save.append(job)
        self.save(to_save)
        return sorted(fired, key=lambda j: j.key)

    def next_wake(self, jobs: list[Job], now: datetime) -> datetime | None:
        """When :meth:`due` has something to do next (``now`` when a job is unchecked)."""
        times = []
        for job in jobs:
            if not job.enabled:
                continue
            if job.state.next_check is None:
                return now
            times.append(job.state.next_check)
        return min(times) if times else None

    def next_times(self, job: Job, after: datetime, count: int) -> list[datetime]:
        """The next slots: the cron times, or a cadence's as if each ran on time."""
        schedule = job.spec.schedule
        if schedule.trigger is not None:
            return next_fire_times(schedule.trigger, after, count)
        state = _for_decide(job.state)
        times: list[datetime] = []
        moment = after
        for _ in range(4 * count + 8):  # bounded, whatever the cadence
            if len(times) >= count:
                break
            try:
                decision = decide(schedule, state, moment)
            except (ValueError, OverflowError):
                break
            if decision.next_at > after or (decision.due and decision.next_at >= after):
                times.append(decision.next_at)
            state = ScheduleState(last_run_at=max(decision.next_at, moment),
                                  last_status="success")
            moment = max(decision.next_at, moment)
        return times

    # -- sessions -------------------------------------------------------------------
    def plan(self, job: Job, trigger_source: str) -> tuple[SessionPlan, hist.History]:
        spec = job.spec
        program = ProductProgram(self.root, spec.product, spec.schedule, spec.user.id)
        session_id = conversation_session(self.root, spec.user.id, spec.product.profile_id,
                                          on_corrupt=self._on_corrupt)
        return SessionPlan(job.key, program, trigger_source, session_id=session_id), \
            self.history(job)

    def history(self, job: Job) -> hist.History:
        return product_history(self.root, job.spec.user.id, job.spec.product.profile_id,
                               retention_days=self.retention_days,
                               on_corrupt=self._on_corrupt)

    def started(self, job: Job, now: datetime) -> None:
        """A run began: its occurrence is spent, even if the daemon dies during it."""
        with self._lock:
            job.state.last_run_at = rfc3339(now)
            job.state.next_fire = None
            job.state.next_check = datetime.max.replace(tzinfo=now.tzinfo)  # until recorded
        self.save([job])

    def finished(self, job: Job, entry: dict[str, Any]) -> None:
        """Fold a finished run into the job's bookkeeping and the user's state file."""
        with self._lock:
            job.state.record(entry)
            job.state.next_fire = None
            job.state.next_check = None  # decide computes the following occurrence
        self.save([job])

    def skipped(self, job: Job, now: datetime) -> None:
        """A due occurrence that did not run is not kept for later; the following one is
        computed as if a run started now."""
        with self._lock:
            decision = decide(job.spec.schedule, ScheduleState(
                last_run_at=now, last_status=hist.SUCCESS), now)
            job.state.next_fire = decision.next_at if not decision.due else None
            job.state.next_check = job.state.next_fire
        self.save([job])

    # -- a user's override and activity ---------------------------------------------
    def set_enabled(self, job: Job, enabled: bool, now: datetime) -> Job:
        """The user's override; product.yaml is not touched."""
        with self._lock:
            job.state.enabled = enabled
            job.state.next_check = None
            passed = job.state.next_fire
            if enabled and passed is not None and passed <= now:
                job.state.next_fire = None  # what passed while off is not kept for later
        self.save([job])
        return job

    def change(self, job: Job, fields: dict[str, Any] | None, now: datetime) -> Job | None:
        raise ReadOnlyJob(f"{job.id} is declared by its product's product.yaml")

    def record_activity(self, user_id: str, profile_id: str, at: datetime) -> None:
        with self._lock:
            self._activity[(user_id, profile_id)] = at
            for job in self.registry.of("products").values():
                if job.spec.user.id == user_id and job.spec.product.profile_id == profile_id:
                    job.state.next_check = None

        def change(state: dict[str, Any]) -> None:
            state["activity"][profile_id] = rfc3339(at)
        UserState(self.root, user_id, on_corrupt=self._on_corrupt).update(change)

    def save(self, jobs: Iterable[Job]) -> None:
        """Write the jobs' bookkeeping into their users' state files (one write per user)."""
        by_user: dict[str, list[Job]] = {}
        for job in jobs:
            by_user.setdefault(job.spec.user.id, []).append(job)
        for user_id, mine in by_user.items():
            def change(state: dict[str, Any], mine: list[Job] = mine) -> None:
                # Read the memory under the file's lock: a write that waited for another
                # (an override, say) must not put back what that one replaced.
                with self._lock:
                    for job in mine:
                        state["schedules"][job.spec.state_key] = state_to_file(job.state)
            try:
                UserState(self.root, user_id, on_corrupt=self._on_corrupt).update(change)
            except OSError as exc:
                log.error("cannot write the product state of user %s: %s", user_id, exc)


class ReadOnlyJob(Exception):
    """A job whose definition cannot be changed through the API."""
