"""Office routines: cron-scheduled ``routine_trigger`` runs for an agent.

Cron expressions (standard 5 fields, 0 and 7 = Sunday) and time zones are
parsed by :func:`kandevd.cron.parse_cron`, and fire times computed only by the
schedule it returns (APScheduler 3.x wall-clock matching plus kandevd.cron's DST
rule, shared with workflow schedules); there is no second cron implementation here.

Persisted state is the truth: each routine row holds ``next_run_at``. A tick
reads the active routines whose ``next_run_at`` is due and, for each, claims
the fire with compare-and-set::

    UPDATE office_routines SET next_run_at = <next fire after now>
     WHERE id = ? AND next_run_at = <the due value it read> AND status = 'active'

Only the tick whose UPDATE changed the row fires; a racing tick (or a second
daemon on the same file) sees zero rows changed and does nothing. The claim
and the enqueues share one transaction, so a crash loses neither half.

A fire enqueues a ``routine_trigger`` run for the routine's agent with key
``routine:<id>:<unix_minute of the fire time>`` and payload
``{...routine payload, "routine_id", "scheduled_for"}`` (the two routine
fields win over payload keys of the same name).

* ``concurrency_policy``: ``skip_if_active`` skips a fire while a run of this
  routine (``payload.routine_id``) is queued or claimed; ``always_create``
  always enqueues.
* ``catch_up_policy`` (more than one fire time passed since ``next_run_at``,
  i.e. after downtime): ``skip_missed`` fires once, for the latest missed
  time; ``enqueue_missed_with_cap`` enqueues one run per missed time, the
  most recent ``catch_up_max`` of them (older ones are dropped). The
  concurrency policy applies to each of them, so catch-up with
  ``skip_if_active`` still yields at most one active run.

Gate: without an active routine a tick costs one tiny existence query.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from kandevd.cron import CronError, CronSchedule, parse_cron
from kandevd.runqueue.service import RunQueue
from kandevd.runs.model import RunReferenceError
from kandevd.store.base import BaseStore
from kandevd.store.office import routines as sql
from kandevd.timeutil import parse_rfc3339, rfc3339

from . import HandlerResult

log = logging.getLogger("kandevd.office.routines")

REASON = "routine_trigger"
CONCURRENCY_POLICIES = ("skip_if_active", "always_create")
CATCH_UP_POLICIES = ("skip_missed", "enqueue_missed_with_cap")
STATUSES = ("active", "paused")

_ONE_MICROSECOND = timedelta(microseconds=1)


# -- fire times, from the APScheduler trigger of kandevd.cron --------------------------

def fire_at_or_after(trigger: CronSchedule, moment: datetime) -> datetime | None:
    """The first fire time ``>= moment`` (UTC), or None when there is none."""
    found = trigger.get_next_fire_time(None, moment)
    return found.astimezone(UTC) if found is not None else None


def fire_after(trigger: CronSchedule, moment: datetime) -> datetime | None:
    """The first fire time strictly after ``moment`` (UTC)."""
    return fire_at_or_after(trigger, moment + _ONE_MICROSECOND)


def fire_at_or_before(trigger: CronSchedule, moment: datetime, not_before: datetime
                      ) -> datetime | None:
    """The latest fire time in ``[not_before, moment]``, by bisection (O(log range) calls)."""
    lo = fire_at_or_after(trigger, not_before)
    if lo is None or lo > moment:
        return None
    hi = moment + _ONE_MICROSECOND  # invariant: lo <= answer < hi, lo is a fire time
    while True:
        following = fire_after(trigger, lo)
        if following is None or following > moment:
            return lo
        lo = following
        mid = lo + (hi - lo) / 2
        found = fire_at_or_after(trigger, mid)
        if found is not None and found <= moment:
            lo = found
        else:
            hi = mid


def due_fire_times(trigger: CronSchedule, first_due: datetime, now: datetime, keep: int
                   ) -> tuple[list[datetime], bool]:
    """The fire times due at ``now``: ``first_due`` (the persisted ``next_run_at``, due by
    definition) and every cron fire time after it up to ``now``; only the last ``keep`` of
    them, plus whether earlier ones were dropped. Cheap in the normal case (one due time),
    and bounded after a long downtime (never walks every missed minute of a month)."""
    times = [first_due]
    current = fire_after(trigger, first_due)
    while current is not None and current <= now and len(times) <= keep:
        times.append(current)
        current = fire_after(trigger, current)
    if len(times) <= keep:
        return times, False
    latest: list[datetime] = []
    upper = now
    while len(latest) < keep:  # more than ``keep`` are due: find the last ones backwards
        found = fire_at_or_before(trigger, upper, first_due + _ONE_MICROSECOND)
        if found is None:
            latest.append(first_due)
            break
        latest.append(found)
        upper = found - _ONE_MICROSECOND
    latest.reverse()
    return latest, True


def unix_minute(moment: datetime) -> int:
    return int(moment.timestamp() // 60)


def routine_key(routine_id: str, scheduled_for: datetime) -> str:
    return f"routine:{routine_id}:{unix_minute(scheduled_for)}"


def first_next_run_at(cron_expression: str, timezone: str, now: datetime) -> str | None:
    """``next_run_at`` of a routine created (or rescheduled) at ``now``."""
    found = fire_after(parse_cron(cron_expression, timezone), now)
    return rfc3339(found) if found is not None else None


# -- the handler ---------------------------------------------------------------------

class RoutineScheduler:
    name = "routines"

    def __init__(self, store: BaseStore, queue: RunQueue) -> None:
        self.store = store
        self.queue = queue

    def active(self) -> bool:
        return sql.any_active(self.store)

    def due(self, now: datetime) -> list[sqlite3.Row]:
        return sql.due(self.store, rfc3339(now))

    def tick(self, now: datetime) -> HandlerResult:
        if not self.active():
            return HandlerResult(scanned=False)
        fired = 0
        for routine in self.due(now):
            if routine["next_run_at"] is not None:
                log.info("routine %s is due (next_run_at %s)", routine["id"],
                         routine["next_run_at"])
            try:
                fired += self.fire(routine, now)
            except CronError as exc:
                log.error("routine %s: %s; not scheduled", routine["id"], exc)
        return HandlerResult(scanned=True, acted=fired)

    def fire(self, routine: Mapping[str, Any], now: datetime) -> int:
        """Claim one due routine (CAS on the ``next_run_at`` read) and enqueue its runs.

        Returns the number of runs enqueued; 0 when another tick won the claim.
        """
        trigger = parse_cron(routine["cron_expression"], routine["timezone"])
        following = fire_after(trigger, now)
        next_s = rfc3339(following) if following is not None else None
        with self.store.transaction() as conn:
            if not sql.claim_fire(conn, routine["id"], routine["next_run_at"], next_s,
                                  rfc3339(now)):
                log.debug("routine %s: fire already claimed by another tick", routine["id"])
                return 0
            if routine["next_run_at"] is None:
                log.info("routine %s scheduled: next run at %s", routine["id"], next_s)
                return 0
            return self._enqueue_due(conn, routine, trigger, now, next_s)

    def _enqueue_due(self, conn: sqlite3.Connection, routine: Mapping[str, Any],
                     trigger: CronSchedule, now: datetime, next_s: str | None) -> int:
        first_due = parse_rfc3339(routine["next_run_at"])
        capped = routine["catch_up_policy"] == "enqueue_missed_with_cap"
        keep = max(int(routine["catch_up_max"]), 1) if capped else 1
        times, dropped = due_fire_times(trigger, first_due, now, keep)
        if dropped or len(times) > 1:
            log.warning("routine %s: missed fire times since %s (downtime); %s: enqueueing %d"
                        "%s", routine["id"], routine["next_run_at"], routine["catch_up_policy"],
                        len(times), ", older ones dropped" if dropped else "")
        enqueued = 0
        last_fired: datetime | None = None
        for scheduled in times:
            if routine["concurrency_policy"] == "skip_if_active":
                active = self._active_run(conn, routine)
                if active is not None:
                    log.info("routine %s: fire at %s skipped, its run %s is still %s",
                             routine["id"], rfc3339(scheduled), active["id"], active["status"])
                    continue
            if self._enqueue(routine, scheduled):
                enqueued += 1
                last_fired = scheduled
        if last_fired is not None:
            sql.fired(conn, routine["id"], rfc3339(last_fired))
        log.debug("routine %s: next run at %s", routine["id"], next_s)
        return enqueued

    @staticmethod
    def _active_run(conn: sqlite3.Connection, routine: Mapping[str, Any]) -> sqlite3.Row | None:
        return sql.active_run(conn, routine["agent_id"], REASON, routine["id"])

    def _enqueue(self, routine: Mapping[str, Any], scheduled: datetime) -> bool:
        payload = dict(json.loads(routine["payload"] or "{}"))
        payload.update(routine_id=routine["id"], scheduled_for=rfc3339(scheduled))
        try:
            result = self.queue.enqueue(
                workspace_id=routine["workspace_id"], agent_id=routine["agent_id"],
                reason=REASON, payload=payload, coalesce=False,
                idempotency_key=routine_key(routine["id"], scheduled))
        except RunReferenceError as exc:
            log.error("routine %s: cannot enqueue: %s", routine["id"], exc)
            return False
        if not result.inserted:
            log.debug("routine %s: fire at %s already enqueued as run %s", routine["id"],
                      rfc3339(scheduled), result.run.id)
            return False
        log.info("routine %s fired for %s (scheduled for %s): %s run %s", routine["id"],
                 routine["agent_id"], rfc3339(scheduled), REASON, result.run.id)
        return True
