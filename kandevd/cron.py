"""Standard 5-field cron expressions, turned into APScheduler 3 triggers.

The one place kandevd reads a cron expression. Fire times are still computed
by APScheduler's ``CronTrigger``; this module only validates the expression
and translates it, because ``CronTrigger.from_crontab`` is not standard cron:
it numbers the days of the week from 0 = Monday, so ``0 9 * * 0`` would fire
on Mondays and ``7`` (Sunday) would be rejected.

Accepted syntax (Vixie cron, what users write and what the contract means)::

    minute  hour  day-of-month  month        day-of-week
    0-59    0-23  1-31          1-12 jan-dec 0-7 sun-sat (0 and 7 are Sunday)

Each field is a comma list of ``*``, ``N``, ``N-M``, ``*/S``, ``N-M/S`` or
``N/S`` (= ``N-<max>/S``); names are case-insensitive and allowed wherever a
number is (``sun`` is 0, or 7 when it ends a range: ``mon-sun``). Ranges do
not wrap (``fri-mon`` is an error: write ``fri-sun,mon`` or ``0,1,5,6``).
Every field is expanded to its set of values and handed to APScheduler as an
explicit list (the day of week as ``mon..sun`` names), so no APScheduler-only
syntax (``last``, ``1st mon``, ...) leaks through.

Day-of-month and day-of-week follow standard cron, not APScheduler's "both
must match": when both are restricted a day matches if *either* does
(``0 0 1 * mon`` = the 1st of each month and every Monday), implemented as an
APScheduler ``OrTrigger`` of two ``CronTrigger`` s. As in Vixie cron, a field
counts as unrestricted when it starts with ``*`` (so ``*/2`` in one of them
means "both must match"); when either is unrestricted the other alone decides.

Time zones are IANA names; the fields match the zone's wall clock, as
APScheduler documents: a wall time skipped by a spring-forward does not fire
that day (``30 2 * * *`` in Europe/Berlin skips the last Sunday of March), one
repeated by a fall-back fires at both of its instants. Fire times are
APScheduler's, through a CronTrigger subclass that corrects two DST slips of
APScheduler 3.11 (see :class:`_WallClockCronTrigger`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.triggers.combining import OrTrigger
from apscheduler.triggers.cron import CronTrigger
from apscheduler.util import normalize

CronSchedule = CronTrigger | OrTrigger
"""What :func:`parse_cron` returns; both answer ``get_next_fire_time(None, now)``."""

_ONE_MICROSECOND = timedelta(microseconds=1)
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_WEEKDAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")  # standard numbering: sun = 0
_MAX_DAYS = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)   # a leap year's, per month


class _WallClockCronTrigger(CronTrigger):
    """APScheduler's CronTrigger, held to its documented wall-clock semantics across DST.

    APScheduler 3.11 slips in two ways this corrects, leaving the search its own:

    * it moves to the next day (hour, month...) by adding the wall-clock difference in
      UTC; across a spring-forward that lands an hour late, so ``0 0 * * *`` in
      Europe/Berlin skips the midnight after the change: such a forward drift is stepped
      back onto the wall time that was meant;
    * depending on the path of its search, it returns a wall time the spring-forward
      skipped (``02:37+01:00``): such a time never fires, the search resumes where the
      clock resumes.
    """

    def _increment_field_value(self, dateval: datetime, fieldnum: int) -> tuple[datetime, int]:
        moved, fieldnum = super()._increment_field_value(dateval, fieldnum)
        drift = moved.utcoffset() - dateval.utcoffset()
        if drift > timedelta(0):
            moved = normalize((moved.replace(tzinfo=None) - drift).replace(tzinfo=self.timezone))
        return moved, fieldnum

    def get_next_fire_time(self, previous_fire_time: datetime | None, now: datetime
                           ) -> datetime | None:
        found = super().get_next_fire_time(previous_fire_time, now)
        while found is not None and not _exists(found):
            found = super().get_next_fire_time(None, _clock_resumes(found))
        return found


def _exists(moment: datetime) -> bool:
    """Whether an aware local time is a real reading of its zone's clock."""
    return moment.astimezone(UTC).astimezone(moment.tzinfo).replace(tzinfo=None) == \
        moment.replace(tzinfo=None)


def _clock_resumes(skipped: datetime) -> datetime:
    """The instant a spring-forward that skipped the wall time ``skipped`` ends (UTC).

    Read with the offset after the jump the wall time falls before it, with the offset
    before the jump after it; bisect (whole seconds, as zone data is) for the change.
    """
    early, late = sorted(skipped.replace(fold=f).astimezone(UTC) for f in (0, 1))
    offset = skipped.tzinfo.utcoffset(early)
    lo, hi = math.floor(early.timestamp()), math.ceil(late.timestamp())
    while hi - lo > 1:
        mid = (lo + hi) // 2
        probe = datetime.fromtimestamp(mid, UTC)
        if skipped.tzinfo.utcoffset(probe) == offset:
            lo = mid
        else:
            hi = mid
    return datetime.fromtimestamp(hi, UTC)


class CronError(ValueError):
    """An expression or time zone that cannot be used; the message starts with the field."""


@dataclass(frozen=True)
class _Field:
    name: str
    low: int
    high: int
    names: tuple[str, ...] = ()
    names_from: int = 0  # the number of ``names[0]``


_WEEKDAY = _Field("day-of-week", 0, 7, _WEEKDAYS, 0)
_FIELDS = (
    _Field("minute", 0, 59),
    _Field("hour", 0, 23),
    _Field("day-of-month", 1, 31),
    _Field("month", 1, 12, _MONTHS, 1),
    _WEEKDAY,
)


def parse_timezone(name: str) -> ZoneInfo:
    """The IANA zone ``name``; CronError (field ``timezone``) when there is no such zone."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise CronError(f"timezone: unknown time zone {name!r} (use an IANA name such as "
                        "'UTC' or 'Europe/Paris')") from None


def parse_cron(expr: str, timezone: str = "UTC") -> CronSchedule:
    """The APScheduler trigger of the standard 5-field cron ``expr`` in ``timezone``.

    Raises CronError naming the field (``timezone: ...`` or ``cron_expression: ...``)
    when the zone is unknown, the expression malformed, or it can never fire.
    """
    zone = parse_timezone(timezone)
    fields = expr.split()
    if len(fields) != len(_FIELDS):
        raise _invalid(expr, f"Wrong number of fields; got {len(fields)}, expected 5")
    try:
        minutes, hours, days, months, weekdays = (
            _parse_field(text, spec) for text, spec in zip(fields, _FIELDS, strict=True))
    except ValueError as exc:
        raise _invalid(expr, str(exc)) from None
    weekdays = {0 if day == 7 else day for day in weekdays}
    days_restricted = not fields[2].startswith("*")
    weekdays_restricted = not fields[4].startswith("*")
    common = {"minute": _list(minutes, 0, 59), "hour": _list(hours, 0, 23),
              "month": _list(months, 1, 12), "timezone": zone}
    by_day = {"day": _list(days, 1, 31)}
    by_weekday = {"day_of_week": _weekday_list(weekdays)}
    if days_restricted and weekdays_restricted:  # standard cron: either one matches
        return OrTrigger([_WallClockCronTrigger(**common, **by_day),
                          _WallClockCronTrigger(**common, **by_weekday)])
    if not any(day <= _MAX_DAYS[month - 1] for month in months for day in days):
        raise CronError(f"cron_expression: {expr!r} never fires")
    return _WallClockCronTrigger(**common, **by_day, **by_weekday)


def next_fire_times(trigger: CronSchedule, after: datetime, count: int) -> list[datetime]:
    """The next ``count`` fire times strictly after ``after`` (aware), in UTC, oldest first;
    fewer when the schedule ends."""
    times: list[datetime] = []
    moment = after.astimezone(UTC)
    while len(times) < count:
        found = trigger.get_next_fire_time(None, moment + _ONE_MICROSECOND)
        if found is None:
            break
        moment = found.astimezone(UTC)
        times.append(moment)
    return times


# -- parsing ------------------------------------------------------------------------

def _invalid(expr: str, detail: str) -> CronError:
    return CronError(f"cron_expression: {expr!r} is not a valid 5-field cron expression: "
                     f"{detail}")


def _parse_field(text: str, spec: _Field) -> set[int]:
    values: set[int] = set()
    for element in text.split(","):
        try:
            values.update(_parse_element(element, spec))
        except ValueError as exc:
            raise ValueError(f"{spec.name} field {text!r}: {exc}") from None
    return values


def _parse_element(element: str, spec: _Field) -> range:
    if not element:
        raise ValueError("empty list element")
    body, slash, step_text = element.partition("/")
    step = 1
    if slash:
        if not _is_number(step_text) or int(step_text) == 0:
            raise ValueError(f"step {step_text!r} in {element!r} is not a positive number")
        step = int(step_text)
    if body == "*":
        return range(spec.low, spec.high + 1, step)
    first_text, dash, last_text = body.partition("-")
    first = _value(first_text, spec)
    if dash:
        last = _value(last_text, spec)
        if spec is _WEEKDAY and last == 0 and last_text.lower() == "sun":
            last = 7  # "sun" closing a range is the 7 of "mon-sun", not the 0 of "sun-sat"
        if last < first:
            raise ValueError(f"range {body!r} is reversed (ranges do not wrap around)")
    else:
        last = spec.high if slash else first
    return range(first, last + 1, step)


def _value(text: str, spec: _Field) -> int:
    lowered = text.lower()
    if lowered in spec.names:
        return spec.names.index(lowered) + spec.names_from
    if not _is_number(text):
        expected = f"a number {spec.low}-{spec.high}"
        if spec.names:
            expected += f" or a name {spec.names[0]}-{spec.names[-1]}"
        raise ValueError(f"{text!r} is not {expected}")
    value = int(text)
    if not spec.low <= value <= spec.high:
        raise ValueError(f"{value} is out of range {spec.low}-{spec.high}")
    return value


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


# -- translation to APScheduler -------------------------------------------------------

def _list(values: set[int], low: int, high: int) -> str:
    """``*`` for every value, else the sorted values as APScheduler ``a-b`` runs."""
    if len(values) == high - low + 1:
        return "*"
    runs: list[tuple[int, int]] = []
    for value in sorted(values):
        if runs and runs[-1][1] == value - 1:
            runs[-1] = (runs[-1][0], value)
        else:
            runs.append((value, value))
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _weekday_list(weekdays: set[int]) -> str:
    """Standard weekday numbers (sun = 0) as APScheduler names, Monday first."""
    if len(weekdays) == len(_WEEKDAYS):
        return "*"
    ordered = sorted(weekdays, key=lambda day: (day + 6) % 7)
    return ",".join(_WEEKDAYS[day] for day in ordered)
