"""When a product job fires: :func:`decide` applied to a job, the quiet rule's hold, the
slots ahead.

:func:`kandevd.schedules.products.schedule.decide` is pure; this module keeps
what its answers mean for a job's state: the pending occurrence
(``next_fire``), when to ask again (``next_check``), and a hold. A hold is an
occurrence that came due while its user was active: the job is ``held`` until
``held_until`` (the quiet period's end, at the latest the deferral cap), and
one line is logged when a hold begins and one when it ends, so an operator can
see why a job did not fire on time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime, timedelta

from kandevd.cron import next_fire_times
from kandevd.schedules.history import SUCCESS
from kandevd.schedules.jobs import Job, JobFacts
from kandevd.schedules.products.schedule import (
    DEFERRAL_CAP,
    QUIET,
    Decision,
    ScheduleState,
    decide,
)
from kandevd.schedules.products.state import stored_time
from kandevd.schedules.rules.options import jitter_delay
from kandevd.timeutil import rfc3339

log = logging.getLogger("kandevd.scheduler.products")


def for_decide(state: JobFacts) -> ScheduleState:
    return ScheduleState(next_run_at=state.next_fire, last_run_at=stored_time(state.last_run_at),
                         last_status=state.last_status,
                         consecutive_failures=state.consecutive_failures)


def decision_for(job: Job, now: datetime, last_active: datetime | None) -> Decision | None:
    """``decide`` for ``job`` at ``now``; None (asked again in an hour) when it cannot."""
    try:
        return decide(job.spec.schedule, for_decide(job.state), now, last_active)
    except (ValueError, OverflowError) as exc:  # one job never stalls the tick
        log.error("%s: cannot decide when it is due (%s); asked again in an hour",
                  job.key, exc)
        job.state.next_check = now + timedelta(hours=1)
        return None


def apply(job: Job, decision: Decision, now: datetime, last_active: datetime | None) -> bool:
    """Fold ``decision`` into the job's state; True when the pending slot is new (to save).

    Due: the intended time is set and a hold ends (logged). Quiet: the hold begins
    (logged) or goes on. Otherwise the next slot becomes the pending occurrence.
    """
    state = job.state
    if decision.due:
        if state.held_until is not None:
            why = ("the deferral cap was reached" if decision.reason == DEFERRAL_CAP
                   else "the quiet period is over")
            log.info("%s: hold ended (%s); firing the occurrence of %s", job.key, why,
                     rfc3339(decision.next_at))
            state.held_until = None
        # A product occurrence is known by its minute: ``decide`` says "due now".
        state.due_at = now.replace(second=0, microsecond=0)
        return False
    state.next_check = decision.next_at
    if decision.reason == QUIET:
        newly_held = state.held_until is None
        state.held_until = decision.next_at  # (before it is said: a reader may act on it)
        if newly_held:
            active = rfc3339(last_active) if last_active else "recently"
            log.info("%s: occurrence of %s held by the quiet rule (user %s active at %s); "
                     "fires at %s unless the user is active again", job.key,
                     rfc3339(state.next_fire) if state.next_fire else "now", job.user_id,
                     active, rfc3339(decision.next_at))
        return False
    if state.next_fire is None:
        state.next_fire = decision.next_at
        return True
    return False


def in_window(job: Job, now: datetime) -> bool:
    """Is ``now`` inside the job's ``start_at``/``end_at``? Before it, the job is asked
    again at ``start_at``; after it, never (its state is ``ended``)."""
    options = job.spec.schedule.options
    if options.ended(now):
        job.state.next_check = datetime.max.replace(tzinfo=now.tzinfo)
        return False
    if options.start_at is not None and now < options.start_at:
        job.state.next_check = options.start_at
        return False
    return True


def after_jitter(job: Job, now: datetime) -> bool:
    """A due occurrence waits its ``jitter_s`` delay first; True once it may fire."""
    state = job.state
    jitter = job.spec.schedule.options.jitter_s
    if jitter <= 0:
        return True
    if state.delayed_until is None:
        intended = state.next_fire or state.due_at or now
        state.delayed_until = intended + jitter_delay(job.key, intended, jitter)
    if state.delayed_until > now:
        state.next_check = state.delayed_until
        return False
    state.delayed_until = None
    return True


def next_wake(jobs: Iterable[Job], now: datetime) -> datetime | None:
    """When the next job must be asked again (``now`` when one is unchecked)."""
    times = []
    for job in jobs:
        if not job.enabled or job.state.invalid is not None:
            continue
        if job.state.next_check is None:
            return now
        times.append(job.state.next_check)
    return min(times) if times else None


def next_times(job: Job, after: datetime, count: int) -> list[datetime]:
    """The next slots: the cron times, or a cadence's as if each ran on time."""
    schedule = job.spec.schedule
    if schedule.trigger is not None:
        return next_fire_times(schedule.trigger, after, count)
    state = for_decide(job.state)
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
        state = ScheduleState(last_run_at=max(decision.next_at, moment), last_status=SUCCESS)
        moment = max(decision.next_at, moment)
    return times


def after_skip(job: Job, now: datetime) -> None:
    """A due occurrence that did not run is not kept; the following one is computed as
    if a run started now."""
    decision = decide(job.spec.schedule, ScheduleState(last_run_at=now, last_status=SUCCESS),
                      now)
    job.state.next_fire = decision.next_at if not decision.due else None
    job.state.next_check = job.state.next_fire
    job.state.held_until = None


#: Occurrences missed while down are counted up to this many (as a workflow's fires).
MISSED_CAP = 1000


def missed_at_start(job: Job, now: datetime, last_seen: datetime | None) -> None:
    """At start: a cron job's pending occurrence and those after it whose start fell
    while no daemon ran are counted in ``missed_while_down`` (as a workflow's fires);
    those within ``catchup_window_s`` run once now (one run, ``fire_times`` naming
    them), the others are not replayed. A job off (in product.yaml, or by its user's
    override) misses nothing: nothing would have run."""
    schedule, state = job.spec.schedule, job.state
    missed = state.next_fire
    if schedule.trigger is None or missed is None or not schedule.enabled \
            or state.enabled is False:  # (None: as product.yaml says)
        return
    jitter = schedule.options.jitter_s

    def start(moment: datetime) -> datetime:  # (a jittered occurrence's time is its start)
        return moment + jitter_delay(job.key, moment, jitter)

    if start(missed) > now or (last_seen is not None and start(missed) <= min(last_seen, now)):
        return
    passed = [missed]
    while len(passed) < MISSED_CAP:  # (one at a time: stops at the first still ahead)
        following = next_fire_times(schedule.trigger, passed[-1], 1)
        if not following or start(following[0]) > now:
            break
        passed.append(following[0])
    state.missed_while_down += len(passed)
    window = schedule.options.catchup_window_s
    caught = [t for t in passed if (now - start(t)).total_seconds() <= window] \
        if window else []
    said = (f"{job.key}: {len(passed)}{'+' if len(passed) >= MISSED_CAP else ''} "
            f"occurrence(s) missed while the daemon was down since {rfc3339(missed)}")
    if caught:
        log.info("%s; %d within catchup_window_s run once now", said, len(caught))
        state.catchup = caught
        return
    log.info("%s; not replayed", said)
    state.next_fire = None
