"""Product schedules: their definition, validation, and when one is due.

A schedule has one timing form, ``cron_expression`` (in ``timezone``) or
``cadence_hours`` (moved to the next ``preferred_hour``), and may add the quiet
rule (``quiet_minutes``, ``max_deferral_hours``). :func:`decide` answers "is it
due at ``now``, and if not, when to ask again", from what the caller keeps
(:class:`ScheduleState`): the rules, with their reason names (``first_slot``,
``regular_slot``, ``retry_backoff``, ``missed_not_replayed``, ``overdue``,
``waiting``, ``quiet``, ``due``, ``deferral_cap``), are in docs/scheduling.md,
"When a product schedule is due". Pure: no I/O and no clock of its own; every
datetime it takes must be aware, every one it returns is aware UTC.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from functools import cache
from importlib import resources
from typing import Any

import jsonschema

from kandevd.cron import CronError, CronSchedule, parse_cron, parse_timezone
from kandevd.formats.schemacheck import validation_problems
from kandevd.schedules.rules.options import (
    NO_OPTIONS,
    OPTION_FIELDS,
    ScheduleOptions,
    option_problems,
    parse_options,
    with_options,
)

SUCCESS = "success"
ERROR = "error"
STOPPED = "stopped"

RETRY_BASE = timedelta(minutes=30)
RETRY_CAP = timedelta(hours=6)
DEFAULT_MAX_DEFERRAL_HOURS = 24.0

SCHEDULE_FIELDS = ("id", "name", "description", "enabled", "messages", "cron_expression",
                   "timezone", "cadence_hours", "preferred_hour", "quiet_minutes",
                   "max_deferral_hours", *OPTION_FIELDS)
_OPTIONAL_NUMBERS = ("cadence_hours", "preferred_hour", "quiet_minutes", "max_deferral_hours")

TIMING_BOTH = "timing: give either cron_expression or cadence_hours, not both"
TIMING_NEITHER = "timing: give either cron_expression or cadence_hours, neither is set"
PREFERRED_HOUR_WITHOUT_CADENCE = "preferred_hour: only allowed with cadence_hours"
DEFERRAL_WITHOUT_QUIET = "max_deferral_hours: only allowed with quiet_minutes"

# Reasons of a Decision.
FIRST_OCCURRENCE = "first_occurrence"
FIRST_SLOT = "first_slot"
REGULAR_SLOT = "regular_slot"
RETRY_BACKOFF = "retry_backoff"
MISSED_NOT_REPLAYED = "missed_not_replayed"
OVERDUE = "overdue"
WAITING = "waiting"
QUIET = "quiet"
DUE = "due"
DEFERRAL_CAP = "deferral_cap"
NO_OCCURRENCE = "no_occurrence"  # a cron expression with no further fire time

_NEVER = datetime.max.replace(tzinfo=UTC)


@dataclass(frozen=True)
class ProductSchedule:
    """One validated, normalized product schedule (build it with :func:`parse`)."""

    id: str
    name: str = ""
    description: str = ""
    enabled: bool = True
    messages: tuple[str, ...] = ()
    cron_expression: str | None = None
    timezone: str = "UTC"
    cadence_hours: float | None = None
    preferred_hour: int | None = None
    quiet_minutes: float | None = None
    max_deferral_hours: float | None = None
    options: ScheduleOptions = NO_OPTIONS

    @property
    def trigger(self) -> CronSchedule | None:
        """The parsed cron expression (cached); None for a cadence schedule."""
        if self.cron_expression is None:
            return None
        return _trigger(self.cron_expression, self.timezone)

    def as_dict(self) -> dict[str, Any]:
        """The contract's fields; the cadence and quiet ones only when set."""
        result: dict[str, Any] = {
            "id": self.id, "name": self.name, "description": self.description,
            "enabled": self.enabled, "messages": list(self.messages),
            "cron_expression": self.cron_expression, "timezone": self.timezone}
        for name in _OPTIONAL_NUMBERS:
            if getattr(self, name) is not None:
                result[name] = getattr(self, name)
        return {**result, **self.options.as_dict()}


@dataclass(frozen=True)
class ScheduleState:
    """What the caller persists about one schedule (see the module docstring)."""

    next_run_at: datetime | None = None  # the due time of the pending occurrence
    last_run_at: datetime | None = None  # when the last run started
    last_status: str | None = None       # "success" | "error" | "stopped"
    consecutive_failures: int = 0


@dataclass(frozen=True)
class Decision:
    """Whether a schedule is due; ``next_at`` (aware UTC) is the due time when due, else
    when to ask again (always later than ``now``)."""

    due: bool
    next_at: datetime
    reason: str


# -- validation -----------------------------------------------------------------------

@cache
def _validator() -> jsonschema.Draft202012Validator:
    text = resources.files("kandevd.schemas").joinpath("product.json").read_text("utf-8")
    schema = json.loads(text)
    defs = {**schema["$defs"], "schedule": with_options(schema["$defs"]["schedule"])}
    return jsonschema.Draft202012Validator(
        {"$schema": schema.get("$schema"), "$defs": defs, "$ref": "#/$defs/schedule"})


@cache
def _trigger(cron_expression: str, timezone: str) -> CronSchedule:
    return parse_cron(cron_expression, timezone)


def validate(raw: Any) -> list[str]:
    """Every problem of one schedule definition at once, each ``field: message``;
    empty when :func:`parse` accepts it."""
    problems = validation_problems(_validator(), raw, noun="field")
    if not isinstance(raw, Mapping):
        return problems
    for name in _OPTIONAL_NUMBERS:
        value = raw.get(name)
        if isinstance(value, float) and math.isnan(value):
            problems.append(f"{name}: must be a number, not NaN")
    has_cron, has_cadence = "cron_expression" in raw, "cadence_hours" in raw
    if has_cron and has_cadence:
        problems.append(TIMING_BOTH)
    elif not has_cron and not has_cadence:
        problems.append(TIMING_NEITHER)
    if "preferred_hour" in raw and not has_cadence:
        problems.append(PREFERRED_HOUR_WITHOUT_CADENCE)
    if "max_deferral_hours" in raw and "quiet_minutes" not in raw:
        problems.append(DEFERRAL_WITHOUT_QUIET)
    problems += option_problems(raw)
    timezone = raw.get("timezone", "UTC")
    if isinstance(timezone, str):
        try:
            parse_timezone(timezone)
        except CronError as exc:
            problems.append(str(exc))
            timezone = "UTC"  # still check the expression itself
    else:
        timezone = "UTC"
    expression = raw.get("cron_expression")
    if isinstance(expression, str):
        try:
            _trigger(" ".join(expression.split()), timezone)
        except CronError as exc:
            problems.append(str(exc))
    return problems


def parse(raw: Any) -> ProductSchedule:
    """The normalized schedule; ValueError listing every problem (``; ``-joined)."""
    problems = validate(raw)
    if problems:
        raise ValueError("; ".join(problems))
    expression = raw.get("cron_expression")
    preferred = raw.get("preferred_hour")
    return ProductSchedule(
        id=raw["id"], name=raw.get("name", ""), description=raw.get("description", ""),
        enabled=raw.get("enabled", True), messages=tuple(raw["messages"]),
        cron_expression=" ".join(expression.split()) if expression is not None else None,
        timezone=raw.get("timezone", "UTC"), cadence_hours=raw.get("cadence_hours"),
        preferred_hour=int(preferred) if preferred is not None else None,
        quiet_minutes=raw.get("quiet_minutes"),
        max_deferral_hours=raw.get("max_deferral_hours"),
        options=parse_options(raw),
    )


# -- timing ---------------------------------------------------------------------------

def retry_delay(consecutive_failures: int) -> timedelta:
    """The back-off after ``consecutive_failures`` (at least 1) failed runs in a row:
    30 min, 1 h, 2 h, 4 h, then 6 h."""
    exponent = min(max(consecutive_failures, 1) - 1, 16)
    return min(RETRY_BASE * 2 ** exponent, RETRY_CAP)


def preferred_slot(schedule: ProductSchedule, at: datetime) -> datetime:
    """The first ``preferred_hour:00`` of the schedule's wall clock at or after ``at``
    (``at`` itself without a preferred hour), in UTC. A preferred hour that a
    spring-forward skips is the instant the clock jumps; a repeated one its first
    instant (kandevd.cron's DST rule)."""
    at = _utc(at)
    if schedule.preferred_hour is None:
        return at
    found = _trigger(f"0 {schedule.preferred_hour} * * *", schedule.timezone) \
        .get_next_fire_time(None, at)
    return _NEVER if found is None else found.astimezone(UTC)


def next_occurrence(schedule: ProductSchedule, after: datetime) -> datetime | None:
    """The first cron fire time strictly after ``after`` (UTC); None when there is none.
    Only for cron schedules."""
    trigger = schedule.trigger
    if trigger is None:
        raise ValueError(f"schedule {schedule.id!r} has no cron expression")
    found = trigger.get_next_fire_time(None, _utc(after) + timedelta(microseconds=1))
    return None if found is None else found.astimezone(UTC)


def _cadence_slot(schedule: ProductSchedule, after: datetime) -> datetime:
    """The slot a cadence gives after a run that started at ``after`` (or a schedule
    first seen then): ``cadence_hours`` later; with a preferred hour, see
    :func:`_preferred_cadence_slot`."""
    assert schedule.cadence_hours is not None
    if schedule.preferred_hour is not None:
        return _preferred_cadence_slot(schedule, _utc(after))
    try:
        return _utc(after) + timedelta(hours=schedule.cadence_hours)
    except OverflowError:
        return _NEVER


def _preferred_cadence_slot(schedule: ProductSchedule, start: datetime) -> datetime:
    """A cadence with a preferred hour counts whole days on the zone's wall clock: the
    preferred hour ``ceil(cadence_hours / 24)`` days after the day of the slot ``start``
    belongs to (the last preferred hour at or before it), a day later when that is less
    than half of ``cadence_hours`` after ``start`` (a run that caught up, overdue, just
    before the hour). So a run that started late (milliseconds, or hours held by the
    quiet rule) or a day of 23 hours does not push a daily cadence to every other day."""
    assert schedule.cadence_hours is not None and schedule.preferred_hour is not None
    days = max(1, math.ceil(schedule.cadence_hours / 24))
    zone = parse_timezone(schedule.timezone)
    wall = start.astimezone(zone).replace(tzinfo=None)
    day = wall.date() if wall.hour >= schedule.preferred_hour \
        else wall.date() - timedelta(days=1)
    try:
        for later in (days, days + 1):
            moment = datetime.combine(day + timedelta(days=later), time(schedule.preferred_hour))
            slot = preferred_slot(schedule, min(moment.replace(tzinfo=zone, fold=fold)
                                                .astimezone(UTC) for fold in (0, 1)))
            if slot - start >= timedelta(hours=schedule.cadence_hours / 2):
                return slot
    except OverflowError:
        return _NEVER
    return slot


def decide(schedule: ProductSchedule, state: ScheduleState, now: datetime,
           last_active_at: datetime | None = None) -> Decision:
    """Whether ``schedule`` is due at ``now`` given its ``state``; see the module
    docstring for the rules and the caller's contract."""
    now = _utc(now)
    if state.next_run_at is None:
        return _pending(schedule, state, now)
    due_at = _utc(state.next_run_at)
    if now < due_at:
        return Decision(False, due_at, WAITING)
    if schedule.quiet_minutes is not None and last_active_at is not None:
        quiet_until = min(_utc(last_active_at), now) + timedelta(minutes=schedule.quiet_minutes)
        if now < quiet_until:
            cap_hours = schedule.max_deferral_hours
            if cap_hours is None:
                cap_hours = DEFAULT_MAX_DEFERRAL_HOURS
            cap = due_at + timedelta(hours=cap_hours)
            if now < cap:
                return Decision(False, min(quiet_until, cap), QUIET)
            return Decision(True, due_at, DEFERRAL_CAP)
    return Decision(True, due_at, DUE)


def _pending(schedule: ProductSchedule, state: ScheduleState, now: datetime) -> Decision:
    """Rule 1: no pending occurrence is persisted; compute it."""
    is_cron = schedule.cron_expression is not None
    if state.last_run_at is None:
        if is_cron:
            return _occurrence_after(schedule, now, FIRST_OCCURRENCE)
        return Decision(False, _cadence_slot(schedule, now), FIRST_SLOT)
    last = _utc(state.last_run_at)
    if is_cron:
        regular = next_occurrence(schedule, last) or _NEVER
    else:
        regular = _cadence_slot(schedule, last)
    at, reason = regular, REGULAR_SLOT
    if state.last_status == ERROR:
        retry = last + retry_delay(state.consecutive_failures)
        if retry <= regular:
            at, reason = retry, RETRY_BACKOFF
    if at > now:
        return Decision(False, at, reason)
    if is_cron and reason == REGULAR_SLOT:
        return _occurrence_after(schedule, now, MISSED_NOT_REPLAYED)
    return Decision(True, now, OVERDUE)


def _occurrence_after(schedule: ProductSchedule, now: datetime, reason: str) -> Decision:
    found = next_occurrence(schedule, now)
    if found is None:
        return Decision(False, _NEVER, NO_OCCURRENCE)
    return Decision(False, found, reason)


def _utc(moment: datetime) -> datetime:
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(f"naive datetime {moment.isoformat()}: an aware one is required")
    return moment.astimezone(UTC)
