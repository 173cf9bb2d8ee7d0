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

import dataclasses
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kandevd.schedules import history as hist
from kandevd.schedules.history import HistoryEntry
from kandevd.schedules.jobs import Job, JobNotFound, JobObject, UserNeeded, last_success
from kandevd.schedules.products import catalog, timing
from kandevd.schedules.products.catalog import Product, User
from kandevd.schedules.products.program import (
    ProductProgram,
    conversation_lock,
    failed_message,
    resume_index,
)
from kandevd.schedules.products.schedule import ProductSchedule
from kandevd.schedules.products.state import (
    UserFile,
    UserState,
    conversation_session,
    product_history,
    state_from_file,
    state_to_file,
    stored_time,
)
from kandevd.schedules.sessions.session import SessionPlan
from kandevd.schedules.settings import Switches
from kandevd.schedules.workflows.manifest import Problem
from kandevd.timeutil import rfc3339, utc_now

if TYPE_CHECKING:
    from kandevd.schedules.source import SourceParts

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

    def definition(self) -> JobObject:
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


class ProductSource:
    """Every product job of the root."""

    prefix = PRODUCT_PREFIX
    accepts_bare_ids = False
    #: The definitions are the product's: update and delete are refused.
    editable = False

    def __init__(self, parts: SourceParts) -> None:
        self.parts = parts
        self.root: Path = parts.root
        self.retention_days = parts.retention_days
        self._on_corrupt = parts.on_corrupt
        self._lock = threading.RLock()
        self._directory = False
        self._activity: dict[tuple[str, str], datetime] = {}
        self._products = 0
        self._profiles: set[str] = set()
        self._users: set[str] = set()
        self._problems: list[Problem] = []

    # -- loading --------------------------------------------------------------------
    def load(self, now: datetime | None, old: dict[str, Job], *,
             last_seen: datetime | None = None) -> list[Job]:
        """(Re)read product.yaml files, users.yaml and the users' state files.

        ``now`` is given at start: a pending cron occurrence whose time fell while no
        daemon ran (after ``last_seen``) is not replayed, as for workflow schedules;
        one a running daemon had already seen (held by the quiet rule) is kept, and so
        is a jittered one whose start (its time plus its delay) is still ahead. The
        jobs of a product whose file, or of a directory that, has a problem are kept
        from before, ``invalid``.
        """
        products, problems = catalog.scan_products(self.root)
        users, user_problems = catalog.read_users(self.root)
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
                if now is not None:
                    self._repair(user.id, product.profile_id, now)
                for schedule in product.schedules:
                    jobs.append(self._job(old, ProductSpec(product, schedule, user),
                                          stored["schedules"], now, last_seen))
        loaded = {job.key for job in jobs}
        jobs += self._kept_invalid(old, loaded, problems, user_problems)
        with self._lock:
            self._directory = (self.root / catalog.USERS_FILE).exists()
            self._activity = activity
            self._products = len(products)
            # A file that cannot be used keeps what was known, so activity reported
            # meanwhile is still stored for the quiet rule.
            self._profiles = {product.profile_id for product in products} | (
                self._profiles if problems else set())
            self._users = {user.id for user in users} if users is not None else self._users
            self._problems = problems + user_problems
        for problem in problems + user_problems:
            log.error("product schedules not loaded: %s", problem)
        return jobs

    def _job(self, old: dict[str, Job], spec: ProductSpec, stored: dict[str, Any],
             now: datetime | None, last_seen: datetime | None) -> Job:
        job = Job(spec.id, spec, self)
        previous = old.get(spec.key)
        if previous is not None:
            job.state = previous.state
            if job.state.invalid is not None:  # its file was fixed: decide afresh
                job.state.invalid = None
                job.state.next_check = None
            if previous.spec.schedule != spec.schedule:  # new timing: decide afresh
                job.state.next_fire = None
                job.state.next_check = None
                job.state.held_until = None
            return job
        job.state = state_from_file(stored.get(spec.state_key))
        job.state.last_success_at = last_success(
            [e for e in self.history(job).entries_to_seed()
             if isinstance(e, dict) and e.get("schedule_id") == spec.schedule.id])
        if now is not None:
            timing.missed_at_start(job, now, last_seen)
        return job

    def _repair(self, user_id: str, profile_id: str, now: datetime) -> None:
        """At start: runs a dead daemon left ``running`` in this user's history with the
        product become ``error`` (their turns are settled on the first tick)."""
        history = product_history(self.root, user_id, profile_id,
                                  retention_days=self.retention_days,
                                  backlog=self.parts.backlog,
                                  on_corrupt=self._on_corrupt)
        def job_key(entry: HistoryEntry) -> str:
            return f"{product_job_id(profile_id, str(entry.get('schedule_id')))}@{user_id}"

        self.parts.stranded.mark(history, now, job_key)

    def _kept_invalid(self, old: dict[str, Job], loaded: set[str], problems: list[Problem],
                      user_problems: list[Problem]) -> list[Job]:
        """Earlier jobs whose product.yaml (or the directory) now has a problem."""
        kept = []
        for key, job in old.items():
            if key in loaded:
                continue
            path = job.spec.product.folder / catalog.PRODUCT_FILE
            found = [p.message for p in problems if Path(p.path) == path] or \
                [f"{catalog.USERS_FILE}: {p.message}" for p in user_problems]
            if not found:
                continue  # removed from the product, or the user lost it: gone
            job.state.invalid = "; ".join(found)
            job.state.held_until = None  # (its pending occurrence stays, for when it is fixed)
            kept.append(job)
        return kept

    def session_lock(self, entry: HistoryEntry) -> threading.Lock | None:
        product, user = entry.get("product"), entry.get("user_id")
        if not isinstance(product, str) or not isinstance(user, str):
            return None
        return conversation_lock(self.root, user, product)

    def details(self, job: Job) -> JobObject:
        with self._lock:
            active = self._activity.get((job.spec.user.id, job.spec.product.profile_id))
        held = job.state.held_until
        return {"held_until": rfc3339(held) if held else None,
                "last_activity_at": rfc3339(active) if active else None}

    def problems(self) -> list[dict[str, str]]:
        with self._lock:
            return [problem.as_dict() for problem in self._problems]

    def counts(self, jobs: dict[str, Job]) -> dict[str, int]:
        with self._lock:
            return {"products": self._products, "product_jobs": len(jobs)}

    def find(self, jobs: dict[str, Job], job_id: str, user_id: str | None) -> Job:
        """The job ``job_id`` of ``user_id`` (of the one local user without a directory)."""
        given = user_id
        users = sorted(job.spec.user.id for job in jobs.values() if job.id == job_id)
        if user_id is None:
            if self._directory:
                if not users:
                    raise JobNotFound(f"no job {job_id!r} (no user has it)")
                raise UserNeeded(f"job {job_id!r} exists once per user: give user_id "
                                 f"(users with this job: {', '.join(users)})")
            user_id = catalog.LOCAL_USER
        job = jobs.get(f"{job_id}@{user_id}")
        if job is None:
            if given and users:
                raise JobNotFound(f"no job {job_id!r} for user {given!r} (users with this "
                                  f"job: {', '.join(users)})")
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
                if not job.enabled or state.invalid is not None or \
                        (state.next_check is not None and state.next_check > now):
                    continue
                if not timing.in_window(job, now):
                    continue
                active = self._last_active(job)
                decision = timing.decision_for(job, now, active)
                if decision is None:
                    continue
                if timing.apply(job, decision, now, active):
                    to_save.append(job)
                if decision.due and timing.after_jitter(job, now):
                    fired.append(job)
        self.save(to_save)
        return sorted(fired, key=lambda j: j.key)

    def _last_active(self, job: Job) -> datetime | None:
        return self._activity.get((job.spec.user.id, job.spec.product.profile_id))

    def next_wake(self, jobs: list[Job], now: datetime) -> datetime | None:
        return timing.next_wake(jobs, now)

    def next_times(self, job: Job, after: datetime, count: int) -> list[datetime]:
        return timing.next_times(job, after, count)

    # -- sessions -------------------------------------------------------------------
    def plan(self, job: Job, trigger_source: str) -> tuple[SessionPlan, hist.History]:
        spec = job.spec
        program = ProductProgram(self.root, spec.product, spec.schedule, spec.user.id,
                                 first_message=resume_index(spec.schedule, job.state.resume))
        session_id = conversation_session(self.root, spec.user.id, spec.product.profile_id,
                                          on_corrupt=self._on_corrupt)
        return SessionPlan(job.key, program, trigger_source, session_id=session_id), \
            self.history(job)

    def history(self, job: Job) -> hist.History:
        return product_history(self.root, job.spec.user.id, job.spec.product.profile_id,
                               retention_days=self.retention_days,
                               backlog=self.parts.backlog, on_corrupt=self._on_corrupt)

    def started(self, job: Job, now: datetime) -> None:
        """A run began: its occurrence is spent, even if the daemon dies during it.
        OSError when the user's state file cannot be written: then nothing changed (and
        the run does not start: its spent occurrence could not be kept)."""
        with self._lock:
            before = dataclasses.replace(job.state)
            job.state.last_run_at = rfc3339(now)
            job.state.next_fire = None
            job.state.held_until = None
            job.state.next_check = datetime.max.replace(tzinfo=now.tzinfo)  # until recorded
        try:
            self.save([job], strict=True)
        except OSError:
            with self._lock:
                for name in ("last_run_at", "next_fire", "held_until", "next_check"):
                    setattr(job.state, name, getattr(before, name))
            raise

    def finished(self, job: Job, entry: HistoryEntry) -> None:
        """Fold a finished run into the job's bookkeeping and the user's state file; the
        following occurrence is decided at once (``next_run_at`` is right at the end)."""
        with self._lock:
            job.state.record(entry)
            job.state.resume = failed_message(entry, job.spec.schedule)
            job.state.next_fire = None
            job.state.next_check = None
            now = utc_now()
            decision = timing.decision_for(job, now, self._last_active(job))
            if decision is not None and not decision.due:
                timing.apply(job, decision, now, self._last_active(job))
        self.save([job])

    def reseed(self, job: Job, without: str | None) -> None:
        """Nothing to forget: a product job's bookkeeping (the user's state file) never
        took in a run its daemon did not see end. None (a takeover of the leader's
        lease): the job's state as the previous leader stored it (its pause, its
        counts, its next fire)."""
        if without is not None:
            return
        spec = job.spec
        stored = UserState(self.root, spec.user_id, on_corrupt=self._on_corrupt).read()
        entry = stored["schedules"].get(spec.state_key)
        if not isinstance(entry, dict):  # (never stored: what is known here stands)
            return
        fresh = state_from_file(entry)
        with self._lock:
            for name in ("enabled", "last_status", "last_error", "last_session_id",
                         "last_run_at", "run_count", "consecutive_failures", "resume"):
                setattr(job.state, name, getattr(fresh, name))
            if fresh.next_fire is not None:
                job.state.next_fire = fresh.next_fire

    def skipped(self, job: Job, now: datetime) -> None:
        """A due occurrence that did not run is not kept for later; the following one is
        computed as if a run started now."""
        with self._lock:
            timing.after_skip(job, now)
        self.save([job])

    # -- a user's override and activity ---------------------------------------------
    def set_enabled(self, job: Job, enabled: bool, now: datetime) -> Job:
        """The user's override; product.yaml is not touched. OSError (naming the user's
        state file) when it cannot be written: then nothing changed."""
        with self._lock:
            before = dataclasses.replace(job.state)
            job.state.enabled = enabled
            job.state.next_check = None
            job.state.held_until = None
            passed = job.state.next_fire
            if enabled and passed is not None and passed <= now:
                job.state.next_fire = None  # what passed while off is not kept for later
        try:
            self.save([job], strict=True)
        except OSError:
            with self._lock:
                job.state.enabled, job.state.next_check = before.enabled, before.next_check
                job.state.held_until, job.state.next_fire = before.held_until, before.next_fire
            raise
        return job

    def change(self, job: Job, fields: dict[str, Any] | None, now: datetime) -> Job | None:
        raise ReadOnlyJob(f"{job.id} is declared by its product's product.yaml")

    def record_activity(self, user_id: str, profile_id: str, at: datetime) -> None:
        """A user's last activity with a product (the quiet rule); JobNotFound for a
        product or a user the root does not have (nothing is stored then)."""
        with self._lock:
            if profile_id not in self._profiles:
                known = ", ".join(sorted(self._profiles)) or "none"
                raise JobNotFound(f"no product {profile_id!r} (products: {known})")
            if user_id not in self._users:
                raise JobNotFound(f"no user {user_id!r} in {catalog.USERS_FILE}")

        def change(state: UserFile) -> None:
            state["activity"][profile_id] = rfc3339(at)
        # Stored first: a state file that cannot be written (OSError) changes nothing.
        UserState(self.root, user_id, on_corrupt=self._on_corrupt).update(change)
        with self._lock:
            self._activity[(user_id, profile_id)] = at
            for job in self.parts.table.of("products").values():
                if job.spec.user.id == user_id and job.spec.product.profile_id == profile_id:
                    job.state.next_check = None

    def save(self, jobs: Iterable[Job], *, strict: bool = False) -> None:
        """Write the jobs' bookkeeping into their users' state files (one write per user);
        a file that cannot be written is logged (``strict``: raised, as OSError)."""
        by_user: dict[str, list[Job]] = {}
        for job in jobs:
            by_user.setdefault(job.spec.user.id, []).append(job)
        for user_id, mine in by_user.items():
            def change(state: UserFile, mine: list[Job] = mine) -> None:
                # Read the memory under the file's lock: a write that waited for another
                # (an override, say) must not put back what that one replaced.
                with self._lock:
                    for job in mine:
                        state["schedules"][job.spec.state_key] = state_to_file(job.state)
            try:
                UserState(self.root, user_id, on_corrupt=self._on_corrupt).update(change)
            except OSError as exc:
                if strict:
                    raise
                log.error("cannot write the product state of user %s: %s", user_id, exc)


class ReadOnlyJob(Exception):
    """A job whose definition cannot be changed through the API."""
