"""Product jobs: one per (user, product schedule), in the scheduler's JOB shape.

Ids are ``product:<profile>:<schedule>``; the same id exists once per user who
has the product, so a product job is addressed by id *and* ``user_id``. The
definitions come from product.yaml (read-only through the API: the product
declares them); each user's override (``enabled``) and bookkeeping live in the
user's state file, mirrored here in memory.

When a job is due is :func:`kandevd.products.schedule.decide`'s call; this
module only asks it again when the time it named has come (``next_check``),
so thousands of idle jobs cost nothing between ticks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kandevd.jsonfile import CorruptReporter
from kandevd.products import catalog
from kandevd.products.catalog import Product, User
from kandevd.products.schedule import ProductSchedule, ScheduleState, decide
from kandevd.products.state import UserState, conversation_session, product_history
from kandevd.timeutil import parse_rfc3339, rfc3339
from kandevd.workflows import history as hist
from kandevd.workflows.manifest import Problem

log = logging.getLogger("kandevd.scheduler.products")

PRODUCT_PREFIX = "product:"


def product_job_id(profile_id: str, schedule_id: str) -> str:
    return f"{PRODUCT_PREFIX}{profile_id}:{schedule_id}"


_EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
_LATEST = datetime(9000, 1, 1, tzinfo=UTC)


def _time(value: Any) -> datetime | None:
    """A stored time, or None when it is not one kandevd could have written (a hand-edited
    year 9999 must not overflow the date arithmetic of ``decide``)."""
    if not isinstance(value, str):
        return None
    try:
        moment = parse_rfc3339(value)
    except (ValueError, OverflowError):
        return None
    return moment if _EARLIEST <= moment < _LATEST else None


@dataclass
class ProductJobState:
    """A user's bookkeeping of one product schedule (the file's, plus counters)."""

    enabled: bool | None = None  # the user's override; None = the product's default
    last_run_at: str | None = None
    last_status: str | None = None
    last_error: str | None = None
    last_session_id: str | None = None
    last_duration_ms: int | None = None
    run_count: int = 0
    consecutive_failures: int = 0
    next_run_at: datetime | None = None
    next_check: datetime | None = None
    skipped_overlap: int = 0
    skipped_paused: int = 0
    skipped_disabled: int = 0

    @classmethod
    def from_file(cls, stored: Any) -> ProductJobState:
        stored = stored if isinstance(stored, dict) else {}
        state = cls()
        if isinstance(stored.get("enabled"), bool):
            state.enabled = stored["enabled"]
        for name in ("last_status", "last_error", "last_session_id"):
            if isinstance(stored.get(name), str):
                setattr(state, name, stored[name])
        if _time(stored.get("last_run_at")) is not None:
            state.last_run_at = stored["last_run_at"]
        for name in ("run_count", "consecutive_failures"):
            if isinstance(stored.get(name), int) and not isinstance(stored.get(name), bool):
                setattr(state, name, max(0, stored[name]))
        state.next_run_at = _time(stored.get("next_run_at"))
        return state

    def to_file(self) -> dict[str, Any]:
        stored: dict[str, Any] = {
            "last_run_at": self.last_run_at, "last_status": self.last_status,
            "last_error": self.last_error, "last_session_id": self.last_session_id,
            "run_count": self.run_count, "consecutive_failures": self.consecutive_failures,
            "next_run_at": rfc3339(self.next_run_at) if self.next_run_at else None,
        }
        if self.enabled is not None:
            stored["enabled"] = self.enabled
        return stored

    def for_decide(self) -> ScheduleState:
        return ScheduleState(next_run_at=self.next_run_at, last_run_at=_time(self.last_run_at),
                             last_status=self.last_status,
                             consecutive_failures=self.consecutive_failures)


@dataclass
class ProductJob:
    id: str
    product: Product
    schedule: ProductSchedule
    user: User
    state: ProductJobState = field(default_factory=ProductJobState)

    @property
    def key(self) -> str:
        return f"{self.id}@{self.user.id}"

    @property
    def state_key(self) -> str:
        return f"{self.product.profile_id}:{self.schedule.id}"

    @property
    def enabled(self) -> bool:
        return self.schedule.enabled if self.state.enabled is None else self.state.enabled


class ProductJobs:
    """Every product job of the root; thread-safe."""

    def __init__(self, root: Path, *, retention_days: float,
                 on_corrupt: CorruptReporter | None = None) -> None:
        self.root = root
        self.retention_days = retention_days
        self._on_corrupt = on_corrupt
        self._lock = threading.RLock()
        self._jobs: dict[str, ProductJob] = {}
        self._users: list[User] = []
        self._directory = False
        self._activity: dict[tuple[str, str], datetime] = {}
        self.problems: list[Problem] = []

    # -- loading --------------------------------------------------------------------
    def load(self, now: datetime | None = None) -> dict[str, int]:
        """(Re)read product.yaml files, users.yaml and the users' state files.

        ``now`` is given at start: a cron occurrence that passed while the daemon was
        down is not replayed (as for workflow schedules); the next one counts.
        """
        products, problems = catalog.scan_products(self.root)
        users, user_problems = catalog.read_users(self.root)
        problems += user_problems
        jobs: dict[str, ProductJob] = {}
        activity: dict[tuple[str, str], datetime] = {}
        with self._lock:
            old = dict(self._jobs)
        for user in users or []:
            if not user.enabled:
                continue
            mine = [p for p in products if p.schedules and user.has(p.profile_id)]
            if not mine:
                continue
            stored = UserState(self.root, user.id, on_corrupt=self._on_corrupt).read()
            for profile, at in stored["activity"].items():
                if (moment := _time(at)) is not None:
                    activity[(user.id, profile)] = moment
            for product in mine:
                for schedule in product.schedules:
                    job = ProductJob(product_job_id(product.profile_id, schedule.id), product,
                                     schedule, user)
                    previous = old.get(job.key)
                    if previous is not None:
                        job.state = previous.state
                        if previous.schedule != schedule:  # new timing: decide afresh
                            job.state.next_run_at = None
                            job.state.next_check = None
                    else:
                        job.state = ProductJobState.from_file(
                            stored["schedules"].get(job.state_key))
                        missed = job.state.next_run_at
                        if now is not None and schedule.cron_expression is not None \
                                and missed is not None and missed <= now:
                            log.info("%s: occurrence of %s missed while the daemon was "
                                     "down; not replayed", job.key, rfc3339(missed))
                            job.state.next_run_at = None
                    jobs[job.key] = job
        with self._lock:
            self._jobs = jobs
            self._users = users or []
            self._directory = (self.root / catalog.USERS_FILE).exists()
            self._activity = activity
            self.problems = problems
        for problem in problems:
            log.error("product schedules not loaded: %s", problem)
        return {"products": len(products), "product_jobs": len(jobs)}

    # -- lookups --------------------------------------------------------------------
    @property
    def has_directory(self) -> bool:
        return self._directory

    def jobs(self, user_id: str | None = None) -> list[ProductJob]:
        with self._lock:
            chosen = [j for j in self._jobs.values() if user_id is None or j.user.id == user_id]
        return sorted(chosen, key=lambda j: (j.id, j.user.id))

    def find(self, job_id: str, user_id: str | None) -> ProductJob | None:
        """The job ``job_id`` of ``user_id`` (of the one local user without a directory)."""
        with self._lock:
            if user_id is None:
                if self._directory:
                    raise LookupError(f"job {job_id!r} exists once per user: give user_id")
                user_id = catalog.LOCAL_USER
            return self._jobs.get(f"{job_id}@{user_id}")

    def by_key(self, key: str) -> ProductJob | None:
        with self._lock:
            return self._jobs.get(key)

    def history(self, job: ProductJob) -> hist.History:
        return product_history(self.root, job.user.id, job.product.profile_id,
                               retention_days=self.retention_days, on_corrupt=self._on_corrupt)

    def session_id(self, job: ProductJob) -> str:
        return conversation_session(self.root, job.user.id, job.product.profile_id,
                                    on_corrupt=self._on_corrupt)

    # -- the clock ------------------------------------------------------------------
    def due(self, now: datetime) -> list[ProductJob]:
        """Jobs ``decide`` says are due now; the others learn when to be asked again.

        A first decision (no ``next_run_at`` yet) is written to the user's state file,
        so a first cadence slot does not move on with every restart.
        """
        fired: list[ProductJob] = []
        to_save: dict[str, list[ProductJob]] = {}
        with self._lock:
            for job in self._jobs.values():
                state = job.state
                if not job.enabled or (state.next_check is not None and state.next_check > now):
                    continue
                try:
                    decision = decide(job.schedule, state.for_decide(), now,
                                      self._activity.get((job.user.id,
                                                          job.product.profile_id)))
                except (ValueError, OverflowError) as exc:  # one job never stalls the tick
                    log.error("%s: cannot decide when it is due (%s); asked again in an hour",
                              job.key, exc)
                    state.next_check = now + timedelta(hours=1)
                    continue
                if decision.due:
                    fired.append(job)
                    continue
                state.next_check = decision.next_at
                if state.next_run_at is None and decision.reason != "quiet":
                    state.next_run_at = decision.next_at
                    to_save.setdefault(job.user.id, []).append(job)
        for jobs in to_save.values():
            self.save(jobs)
        return sorted(fired, key=lambda j: j.key)

    def next_wake(self, now: datetime) -> datetime | None:
        """When :meth:`due` has something to do next (``now`` when a job is unchecked)."""
        with self._lock:
            times = []
            for job in self._jobs.values():
                if not job.enabled:
                    continue
                if job.state.next_check is None:
                    return now
                times.append(job.state.next_check)
        return min(times) if times else None

    def consumed(self, job: ProductJob, now: datetime) -> None:
        """A due occurrence that did not run (paused, switched off, overlapping): it is
        not kept for later; the following one is computed as if a run started now."""
        with self._lock:
            decision = decide(job.schedule, ScheduleState(
                last_run_at=now, last_status=hist.SUCCESS), now)
            job.state.next_run_at = decision.next_at if not decision.due else None
            job.state.next_check = job.state.next_run_at
        self.save([job])

    def started(self, job: ProductJob, now: datetime) -> None:
        """A run began: its occurrence is spent, even if the daemon dies during it."""
        with self._lock:
            job.state.last_run_at = rfc3339(now)
            job.state.next_run_at = None
            job.state.next_check = datetime.max.replace(tzinfo=now.tzinfo)  # until recorded
        self.save([job])

    def record(self, job: ProductJob, entry: dict[str, Any]) -> None:
        """Fold a finished run into the job's bookkeeping and the user's state file."""
        with self._lock:
            state = job.state
            state.last_run_at = entry.get("started_at")
            state.last_status = entry.get("status")
            state.last_error = entry.get("error")
            state.last_session_id = entry.get("session_id")
            state.last_duration_ms = entry.get("duration_ms")
            state.run_count += 1
            if state.last_status == hist.ERROR:
                state.consecutive_failures += 1
            elif state.last_status == hist.SUCCESS:
                state.consecutive_failures = 0
            state.next_run_at = None
            state.next_check = None  # decide computes the following occurrence
        self.save([job])

    def set_enabled(self, job: ProductJob, enabled: bool, now: datetime) -> None:
        with self._lock:
            job.state.enabled = enabled
            job.state.next_check = None
            passed = job.state.next_run_at
            if enabled and passed is not None and passed <= now:
                job.state.next_run_at = None  # what passed while off is not kept for later
        self.save([job])

    def record_activity(self, user_id: str, profile_id: str, at: datetime) -> None:
        with self._lock:
            self._activity[(user_id, profile_id)] = at
            for job in self._jobs.values():
                if job.user.id == user_id and job.product.profile_id == profile_id:
                    job.state.next_check = None

        def change(state: dict[str, Any]) -> None:
            state["activity"][profile_id] = rfc3339(at)
        UserState(self.root, user_id, on_corrupt=self._on_corrupt).update(change)

    def save(self, jobs: Iterable[ProductJob]) -> None:
        """Write the jobs' bookkeeping into their users' state files (one write per user)."""
        by_user: dict[str, list[ProductJob]] = {}
        for job in jobs:
            by_user.setdefault(job.user.id, []).append(job)
        for user_id, mine in by_user.items():
            def change(state: dict[str, Any], mine: list[ProductJob] = mine) -> None:
                # Read the memory under the file's lock: a write that waited for another
                # (an override, say) must not put back what that one replaced.
                with self._lock:
                    for job in mine:
                        state["schedules"][job.state_key] = job.state.to_file()
            try:
                UserState(self.root, user_id, on_corrupt=self._on_corrupt).update(change)
            except OSError as exc:
                log.error("cannot write the product state of user %s: %s", user_id, exc)

    # -- the JOB shape --------------------------------------------------------------
    def as_dict(self, job: ProductJob, *, running: bool,
                ineligible: Callable[[ProductJob], str | None]) -> dict[str, Any]:
        state, schedule = job.state, job.schedule
        reason = ineligible(job)
        definition = schedule.as_dict()
        definition.pop("id", None)
        return {
            "id": job.id, "entity_type": "product", "workflow": None,
            "product": job.product.profile_id, "user_id": job.user.id,
            "schedule_id": schedule.id, **definition, "enabled": job.enabled,
            "default_enabled": schedule.enabled,
            "group_ids": [], "mode": None, "workshop_mode": None, "trigger_payload": {},
            "overlap_policy": "skip", "pulse": False,
            "last_status": state.last_status, "last_run_at": state.last_run_at,
            "next_run_at": rfc3339(state.next_run_at) if state.next_run_at else None,
            "last_session_id": state.last_session_id, "last_error": state.last_error,
            "last_duration_ms": state.last_duration_ms, "run_count": state.run_count,
            "consecutive_failures": state.consecutive_failures, "running": running,
            "skipped_overlap": state.skipped_overlap, "skipped_paused": state.skipped_paused,
            "skipped_disabled": state.skipped_disabled, "missed_while_down": 0,
            "cron_eligible": reason is None, "cron_ineligible_reason": reason,
        }
