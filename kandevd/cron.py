"""Standard 5-field cron expressions, and their fire times in an IANA time zone.

The one place kandevd reads a cron expression (Vixie cron syntax: numbers,
names, ``*``, ranges, steps, lists, the macros ``@daily`` and friends;
day-of-month and day-of-week match when either does, as in standard cron).
APScheduler's ``CronTrigger`` finds the matching wall times, but
``CronTrigger.from_crontab`` is not standard cron (it numbers weekdays from
Monday), so every field is expanded here and handed over as an explicit list.
The triggers run in UTC and only search the wall clock; each wall time found
is mapped to its instant in the schedule's zone by the DST rule of
docs/scheduling.md: a wall time a fall-back repeats fires once, at its first
instant; one a spring-forward skips fires once, when the clock jumps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from apscheduler.triggers.combining import OrTrigger
from apscheduler.triggers.cron import CronTrigger

from kandevd.suggest import did_you_mean
from kandevd.timeutil import rfc3339

_ONE_MICROSECOND = timedelta(microseconds=1)
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_WEEKDAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")  # standard numbering: sun = 0
_MAX_DAYS = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)   # a leap year's, per month


class CronSchedule:
    """A parsed cron expression in its time zone (what :func:`parse_cron` returns).

    Answers ``get_next_fire_time(previous_fire_time, now)`` as an APScheduler trigger
    does, with the DST rule of this module.
    """

    __slots__ = ("_wall_clock", "expression", "timezone")

    def __init__(self, expression: str, timezone: ZoneInfo,
                 wall_clock: CronTrigger | OrTrigger) -> None:
        self.expression = expression
        self.timezone = timezone
        self._wall_clock = wall_clock  # in UTC: matches naive wall times read as UTC

    def __repr__(self) -> str:
        return f"CronSchedule({self.expression!r}, {self.timezone.key!r})"

    def get_next_fire_time(self, previous_fire_time: datetime | None, now: datetime
                           ) -> datetime | None:
        """The first fire instant at or after ``now`` (aware), in the schedule's zone; None
        when the schedule ends. As in APScheduler, a ``previous_fire_time`` moves the start
        back to just after it when that is earlier than ``now``."""
        start = now.astimezone(UTC)
        if previous_fire_time is not None:
            start = min(start, previous_fire_time.astimezone(UTC) + _ONE_MICROSECOND)
        zone = self.timezone
        # Every wall time up to the clock's reading just before ``start`` first came earlier.
        wall = _wall_time(start - _ONE_MICROSECOND, zone) + _ONE_MICROSECOND
        while (found := self._wall_clock.get_next_fire_time(None, wall.replace(tzinfo=UTC))
               ) is not None:
            wall = found.replace(tzinfo=None)
            instant = _first_instant(wall, zone)
            if instant >= start:
                return instant.astimezone(zone)
            wall += _ONE_MICROSECOND  # the second pass of a fall-back: fired on the first
        return None


def _wall_time(moment: datetime, zone: ZoneInfo) -> datetime:
    """What the clock of ``zone`` reads at the aware ``moment`` (naive)."""
    return moment.astimezone(zone).replace(tzinfo=None)


def _first_instant(wall: datetime, zone: ZoneInfo) -> datetime:
    """The first instant (UTC) the clock of ``zone`` reads the naive ``wall`` time or later:
    its only instant, the earlier of a fall-back's two, or a spring-forward's jump."""
    earlier = min(wall.replace(tzinfo=zone, fold=fold).astimezone(UTC) for fold in (0, 1))
    if _wall_time(earlier, zone) == wall:
        return earlier
    return _clock_resumes(wall.replace(tzinfo=zone))


def _clock_resumes(skipped: datetime) -> datetime:
    """The instant (UTC) a spring-forward that skipped the aware local wall time ``skipped``
    ends: the first instant the clock reads a later time.

    Read with the offset after the jump the wall time falls before it, with the offset
    before the jump after it; bisect (whole seconds, as zone data is) for the change.
    """
    zone = skipped.tzinfo
    early, late = sorted(skipped.replace(fold=f).astimezone(UTC) for f in (0, 1))
    offset = early.astimezone(zone).utcoffset()
    lo, hi = math.floor(early.timestamp()), math.ceil(late.timestamp())
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if datetime.fromtimestamp(mid, zone).utcoffset() == offset:
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


#: The standard macros (Vixie cron); ``@reboot`` is refused (see :func:`parse_cron`).
MACROS = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}


@cache
def _zone_names() -> dict[str, str]:
    """Every IANA zone name worth suggesting, by its lower-case spelling."""
    return {name.lower(): name for name in available_timezones()
            if name not in ("localtime", "posixrules", "Factory")
            and not name.startswith(("posix/", "right/"))}


def parse_timezone(name: str) -> ZoneInfo:
    """The IANA zone ``name``; CronError (field ``timezone``) when there is no such zone."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        hint = did_you_mean(name, _zone_names().values()) if isinstance(name, str) else ""
        hint = hint or " (use an IANA name such as 'UTC' or 'Europe/Paris')"
        raise CronError(f"timezone: unknown time zone {name!r}{hint}") from None


#: The longest cron expression a schedule may hold (``cron_expression``'s ``maxLength``).
MAX_EXPRESSION = 500


def parse_cron(expr: str, timezone: str = "UTC") -> CronSchedule:
    """The schedule of the standard 5-field cron ``expr`` (or a macro such as ``@daily``)
    in ``timezone``.

    Raises CronError naming the field (``timezone: ...`` or ``cron_expression: ...``)
    when the zone is unknown, the expression malformed, or it can never fire.
    """
    if len(expr) > MAX_EXPRESSION:  # (as the files' and the methods' schemas say)
        raise CronError(f"cron_expression: {len(expr)} characters; at most "
                        f"{MAX_EXPRESSION} allowed")
    zone = parse_timezone(timezone)
    expr_fields = _expand_macro(expr)
    trigger = _parse_fields(expr, expr_fields)
    return CronSchedule(expr, zone, trigger)


def _expand_macro(expr: str) -> str:
    word = expr.strip()
    if not word.startswith("@"):
        return expr
    if word.lower() == "@reboot":
        raise CronError("cron_expression: '@reboot' is not supported: a schedule fires at "
                        "times, and a daemon start is not one (trigger the job after a start "
                        "instead, or use a time such as @daily)")
    if word.lower() in MACROS:
        return MACROS[word.lower()]
    raise CronError(f"cron_expression: {word!r} is not a known macro (the macros are "
                    f"{', '.join(MACROS)}){did_you_mean(word, MACROS)}")


def _parse_fields(expr: str, text: str) -> CronTrigger | OrTrigger:
    fields = text.split()
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
              "month": _list(months, 1, 12), "timezone": UTC}
    by_day = {"day": _list(days, 1, 31)}
    by_weekday = {"day_of_week": _weekday_list(weekdays)}
    if days_restricted and weekdays_restricted:  # standard cron: either one matches
        wall_clock: CronTrigger | OrTrigger = OrTrigger(
            [CronTrigger(**common, **by_day), CronTrigger(**common, **by_weekday)])
    elif not any(day <= _MAX_DAYS[month - 1] for month in months for day in days):
        raise CronError(f"cron_expression: {expr!r} never fires")
    else:
        wall_clock = CronTrigger(**common, **by_day, **by_weekday)
    return wall_clock


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


def describe_times(times: Iterable[datetime], zone: ZoneInfo) -> list[dict[str, str]]:
    """``[{utc, local}]``: each instant in RFC 3339 UTC and as the wall time of ``zone``."""
    return [{"utc": rfc3339(moment), "local": moment.astimezone(zone).isoformat()}
            for moment in times]


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
