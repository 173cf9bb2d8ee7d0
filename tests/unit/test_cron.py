"""kandevd.cron: standard cron semantics, checked against a brute-force evaluator.

The evaluator below knows nothing of kandevd.cron or APScheduler: the
hypothesis strategy builds each field as a structure, renders it to text and
computes its value set independently; the evaluator then walks every local
wall-clock minute of the window and says which instants must fire.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kandevd.cron import CronError, next_fire_times, parse_cron

MONTH_NAMES = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov",
               "dec")
WEEKDAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
MONTH_DAYS = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
WINDOW = timedelta(weeks=3)
CAP = 400  # fire times compared per example: keeps dense schedules fast
WEDNESDAY = datetime(2026, 3, 11, 12, 0, tzinfo=UTC)


# -- the independent model of a standard cron expression --------------------------------

@dataclass(frozen=True)
class Field:
    text: str
    values: frozenset[int]
    star: bool  # starts with '*': Vixie's "unrestricted" for day-of-month / day-of-week


@dataclass(frozen=True)
class Spec:
    minute: Field
    hour: Field
    dom: Field
    month: Field
    dow: Field

    @property
    def text(self) -> str:
        return " ".join(f.text for f in (self.minute, self.hour, self.dom, self.month, self.dow))

    @property
    def either_day(self) -> bool:
        """Standard cron ORs day-of-month and day-of-week when both are restricted."""
        return not self.dom.star and not self.dow.star

    def day_matches(self, day: date) -> bool:
        if day.month not in self.month.values:
            return False
        cron_weekday = (day.weekday() + 1) % 7  # sun = 0
        by_dom = day.day in self.dom.values
        by_dow = cron_weekday in self.dow.values or (cron_weekday == 0 and 7 in self.dow.values)
        return (by_dom or by_dow) if self.either_day else (by_dom and by_dow)

    def can_fire(self) -> bool:
        return self.either_day or any(d <= MONTH_DAYS[m - 1] for m in self.month.values
                                      for d in self.dom.values)


def instants(wall: datetime, zone: ZoneInfo) -> set[datetime]:
    """The UTC instants of a local wall time: two in a fall-back fold, one normally, none
    when a spring-forward skips it."""
    found = set()
    for fold in (0, 1):
        moment = wall.replace(tzinfo=zone, fold=fold).astimezone(UTC)
        if moment.astimezone(zone).replace(tzinfo=None) == wall:
            found.add(moment)
    return found


def brute_force(spec: Spec, zone: ZoneInfo, after: datetime, until: datetime) -> list[datetime]:
    """Every instant in ``(after, until]`` whose local wall time matches, walking every wall
    minute: twice in a fall-back fold, never for a time a spring-forward skips."""
    first_day = (after.astimezone(zone) - timedelta(days=1)).date()
    last_day = (until.astimezone(zone) + timedelta(days=1)).date()
    fires: set[datetime] = set()
    day = first_day
    while day <= last_day:
        for hour in range(24) if spec.day_matches(day) else ():
            for minute in range(60) if hour in spec.hour.values else ():
                if minute in spec.minute.values:
                    wall = datetime(day.year, day.month, day.day, hour, minute)
                    fires.update(instants(wall, zone))
        day += timedelta(days=1)
    return sorted(t for t in fires if after < t <= until)


# -- strategies ----------------------------------------------------------------------------

@st.composite
def elements(draw: st.DrawFn, low: int, high: int, names: tuple[str, ...], name_base: int
             ) -> tuple[str, set[int], bool]:
    def show(value: int, at: str = "single") -> str:
        # "sun" is 0, except at the end of a range where it is 7 ("mon-sun")
        weekday_name_fits = {0: at != "last", 7: at != "first"}.get(value, True)
        if names and draw(st.booleans()) and (names is not WEEKDAY_NAMES or weekday_name_fits):
            name = names[value % 7 if names is WEEKDAY_NAMES else value - name_base]
            return draw(st.sampled_from([name, name.upper(), name.capitalize()]))
        return str(value)

    every = range(low, high + 1)
    kind = draw(st.sampled_from(["star", "star_step", "value", "range", "range_step",
                                 "value_step"]))
    step = draw(st.integers(min_value=1, max_value=high - low + 1))
    first = draw(st.integers(min_value=low, max_value=high))
    last = draw(st.integers(min_value=first, max_value=high))
    if kind == "star":
        return "*", set(every), True
    if kind == "star_step":
        return f"*/{step}", {v for v in every if (v - low) % step == 0}, True
    if kind == "value":
        return show(first), {first}, False
    stepped = {v for v in every if v >= first and (v - first) % step == 0}
    span = f"{show(first, 'first')}-{show(last, 'last')}"
    if kind == "range":
        return span, {v for v in every if first <= v <= last}, False
    if kind == "range_step":
        return f"{span}/{step}", {v for v in stepped if v <= last}, False
    return f"{show(first, 'first')}/{step}", stepped, False


@st.composite
def fields(draw: st.DrawFn, low: int, high: int, names: tuple[str, ...] = (),
           name_base: int = 0, star_weight: float = 0.0) -> Field:
    if star_weight and draw(st.floats(min_value=0, max_value=1)) < star_weight:
        return Field("*", frozenset(range(low, high + 1)), True)
    parts = draw(st.lists(elements(low, high, names, name_base), min_size=1, max_size=3))
    values: set[int] = set().union(*(p[1] for p in parts))
    return Field(",".join(p[0] for p in parts), frozenset(values), parts[0][2])


specs = st.builds(
    Spec,
    minute=fields(0, 59),
    hour=fields(0, 23),
    dom=fields(1, 31, star_weight=0.7),
    month=fields(1, 12, MONTH_NAMES, 1, star_weight=0.8),
    dow=fields(0, 7, WEEKDAY_NAMES, 0),
)


def last_sunday(year: int, month: int) -> datetime:
    day = date(year, month, 31)
    return datetime.combine(day - timedelta(days=(day.weekday() + 1) % 7), datetime.min.time(),
                            tzinfo=UTC) + timedelta(hours=1)  # EU DST changes at 01:00 UTC


anywhere = st.datetimes(min_value=datetime(2025, 1, 1), max_value=datetime(2028, 12, 1),
                        timezones=st.just(UTC))
near_dst = st.builds(
    lambda year, month, back: last_sunday(year, month) - back,
    st.integers(min_value=2025, max_value=2028), st.sampled_from([3, 10]),
    st.timedeltas(min_value=timedelta(0), max_value=WINDOW - timedelta(hours=2)))


# -- the property ----------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(spec=specs, zone_name=st.sampled_from(["UTC", "Europe/Berlin"]),
       start=st.one_of(anywhere, near_dst))
def test_fire_times_match_a_brute_force_standard_cron(spec: Spec, zone_name: str,
                                                      start: datetime) -> None:
    end = start + WINDOW
    try:
        trigger = parse_cron(spec.text, zone_name)
    except CronError as exc:
        assert not spec.can_fire()
        assert str(exc) == f"cron_expression: {spec.text!r} never fires"
        return
    assert spec.can_fire()
    produced = [t for t in next_fire_times(trigger, start, CAP) if t <= end]
    horizon = produced[-1] if len(produced) == CAP else end
    assert produced == brute_force(spec, ZoneInfo(zone_name), start, horizon), spec.text


# -- explicit cases ------------------------------------------------------------------------

def weekdays(expr: str, count: int, zone: str = "UTC") -> list[str]:
    return [t.astimezone(ZoneInfo(zone)).strftime("%a %H:%M")
            for t in next_fire_times(parse_cron(expr, zone), WEDNESDAY, count)]


@pytest.mark.parametrize("expr", ["0 9 * * 0", "0 9 * * 7", "0 9 * * sun", "0 9 * * SUN"])
def test_day_zero_and_seven_are_sunday(expr: str) -> None:
    assert WEDNESDAY.strftime("%a") == "Wed"
    assert next_fire_times(parse_cron(expr), WEDNESDAY, 3) == [
        datetime(2026, 3, 15, 9, tzinfo=UTC), datetime(2026, 3, 22, 9, tzinfo=UTC),
        datetime(2026, 3, 29, 9, tzinfo=UTC)]


def test_sunday_in_a_dst_zone_is_a_local_sunday() -> None:
    assert weekdays("0 9 * * 0", 4, "Europe/Berlin") == ["Sun 09:00"] * 4
    berlin = next_fire_times(parse_cron("0 9 * * 0", "Europe/Berlin"), WEDNESDAY, 3)
    assert [t.hour for t in berlin] == [8, 8, 7]  # CET, CET, then CEST from March 29


@pytest.mark.parametrize(("expr", "expected"), [
    ("0 9 * * 1-5", ["Thu 09:00", "Fri 09:00", "Mon 09:00", "Tue 09:00", "Wed 09:00",
                     "Thu 09:00"]),
    ("0 9 * * mon-fri", ["Thu 09:00", "Fri 09:00", "Mon 09:00", "Tue 09:00", "Wed 09:00",
                         "Thu 09:00"]),
    ("0 0 * * sun,wed", ["Sun 00:00", "Wed 00:00", "Sun 00:00", "Wed 00:00"]),
    ("0 0 * * */2", ["Thu 00:00", "Sat 00:00", "Sun 00:00", "Tue 00:00", "Thu 00:00"]),
    ("0 0 * * 5-7", ["Fri 00:00", "Sat 00:00", "Sun 00:00", "Fri 00:00"]),
    ("0 0 * * 6,0", ["Sat 00:00", "Sun 00:00", "Sat 00:00"]),
    ("0 0 * * 1-7/3", ["Thu 00:00", "Sun 00:00", "Mon 00:00", "Thu 00:00"]),
])
def test_weekday_lists_ranges_and_steps(expr: str, expected: list[str]) -> None:
    assert weekdays(expr, len(expected)) == expected


def test_every_fifteen_minutes() -> None:
    times = next_fire_times(parse_cron("*/15 * * * *"), WEDNESDAY, 6)
    assert times == [WEDNESDAY + timedelta(minutes=15 * i) for i in range(1, 7)]


def test_day_of_month_or_day_of_week_when_both_are_restricted() -> None:
    times = next_fire_times(parse_cron("0 0 13 * fri"), datetime(2026, 3, 1, tzinfo=UTC), 6)
    assert [t.strftime("%a %d") for t in times] == [
        "Fri 06", "Fri 13", "Fri 20", "Fri 27", "Fri 03", "Fri 10"]
    april = next_fire_times(parse_cron("0 0 13 * fri"), datetime(2026, 4, 11, tzinfo=UTC), 2)
    assert [t.strftime("%a %d") for t in april] == ["Mon 13", "Fri 17"]


def test_a_star_step_day_of_month_means_both_must_match() -> None:
    times = next_fire_times(parse_cron("0 0 */2 * fri"), datetime(2026, 3, 1, tzinfo=UTC), 3)
    assert [t.strftime("%a %d %b") for t in times] == ["Fri 13 Mar", "Fri 27 Mar",
                                                        "Fri 03 Apr"]


def test_an_impossible_date_fires_on_its_weekday_only_with_both_restricted() -> None:
    with pytest.raises(CronError, match=r"^cron_expression: '0 0 30 2 \*' never fires$"):
        parse_cron("0 0 30 2 *")
    times = next_fire_times(parse_cron("0 0 30 feb mon"), WEDNESDAY, 2)
    assert [t.strftime("%a %d %b") for t in times] == ["Mon 01 Feb", "Mon 08 Feb"]


def test_month_names_and_explicit_lists() -> None:
    times = next_fire_times(parse_cron("5,35 22-23 1 jan,Jul *"), WEDNESDAY, 5)
    assert [t.strftime("%d %b %H:%M") for t in times] == [
        "01 Jul 22:05", "01 Jul 22:35", "01 Jul 23:05", "01 Jul 23:35", "01 Jan 22:05"]


def test_dst_fold_fires_twice_and_a_skipped_time_not_at_all() -> None:
    daily = parse_cron("30 2 * * *", "Europe/Berlin")
    autumn = next_fire_times(daily, datetime(2026, 10, 24, 12, tzinfo=UTC), 3)
    assert autumn == [datetime(2026, 10, 25, 0, 30, tzinfo=UTC),   # 02:30 CEST
                      datetime(2026, 10, 25, 1, 30, tzinfo=UTC),   # 02:30 CET
                      datetime(2026, 10, 26, 1, 30, tzinfo=UTC)]
    spring = next_fire_times(daily, datetime(2026, 3, 28, 12, tzinfo=UTC), 2)
    assert spring == [datetime(2026, 3, 30, 0, 30, tzinfo=UTC),     # none on the 29th
                      datetime(2026, 3, 31, 0, 30, tzinfo=UTC)]
    busy = parse_cron("10,37 1,2,3 * * *", "Europe/Berlin")
    assert next_fire_times(busy, datetime(2026, 3, 29, 0, 30, tzinfo=UTC), 3) == [
        datetime(2026, 3, 29, 0, 37, tzinfo=UTC),                   # 01:37 CET
        datetime(2026, 3, 29, 1, 10, tzinfo=UTC),                   # 03:10 CEST
        datetime(2026, 3, 29, 1, 37, tzinfo=UTC)]                   # 03:37 CEST


def test_the_midnight_after_a_spring_forward_fires() -> None:
    """APScheduler 3.11 alone answers April 1 here: its day roll-over drifts an hour."""
    midnight = parse_cron("0 0 * * *", "Europe/Berlin")
    assert next_fire_times(midnight, datetime(2025, 3, 29, 23, 0, tzinfo=UTC), 2) == [
        datetime(2025, 3, 30, 22, 0, tzinfo=UTC), datetime(2025, 3, 31, 22, 0, tzinfo=UTC)]
    every_minute = parse_cron("* 0 * * *", "America/New_York")
    assert next_fire_times(every_minute, datetime(2026, 3, 8, 5, 59, tzinfo=UTC), 1) == [
        datetime(2026, 3, 9, 4, 0, tzinfo=UTC)]


def test_next_fire_times_is_strictly_after_and_utc() -> None:
    on_the_hour = datetime(2026, 3, 11, 12, tzinfo=ZoneInfo("Europe/Berlin"))
    times = next_fire_times(parse_cron("0 * * * *", "Asia/Tokyo"), on_the_hour, 2)
    assert times == [datetime(2026, 3, 11, 12, tzinfo=UTC), datetime(2026, 3, 11, 13, tzinfo=UTC)]
    assert all(t.tzinfo is UTC for t in times)
    assert next_fire_times(parse_cron("* * * * *"), WEDNESDAY, 0) == []


# -- errors ----------------------------------------------------------------------------------

INVALID = "is not a valid 5-field cron expression"


@pytest.mark.parametrize(("expr", "message"), [
    ("* * * *", f"'* * * *' {INVALID}: Wrong number of fields; got 4, expected 5"),
    ("* * * * * *", f"'* * * * * *' {INVALID}: Wrong number of fields; got 6, expected 5"),
    ("", f"'' {INVALID}: Wrong number of fields; got 0, expected 5"),
    ("60 * * * *", f"'60 * * * *' {INVALID}: minute field '60': 60 is out of range 0-59"),
    ("* 24 * * *", f"'* 24 * * *' {INVALID}: hour field '24': 24 is out of range 0-23"),
    ("* * 0 * *", f"'* * 0 * *' {INVALID}: day-of-month field '0': 0 is out of range 1-31"),
    ("* * * 13 *", f"'* * * 13 *' {INVALID}: month field '13': 13 is out of range 1-12"),
    ("* * * * 8", f"'* * * * 8' {INVALID}: day-of-week field '8': 8 is out of range 0-7"),
    ("* * * * fri-mon", f"'* * * * fri-mon' {INVALID}: day-of-week field 'fri-mon': range "
                        "'fri-mon' is reversed (ranges do not wrap around)"),
    ("*/0 * * * *", f"'*/0 * * * *' {INVALID}: minute field '*/0': step '0' in '*/0' is not "
                    "a positive number"),
    ("1,,2 * * * *", f"'1,,2 * * * *' {INVALID}: minute field '1,,2': empty list element"),
    ("* * * * mon#2", f"'* * * * mon#2' {INVALID}: day-of-week field 'mon#2': 'mon#2' is not "
                      "a number 0-7 or a name sun-sat"),
    ("* * L * *", f"'* * L * *' {INVALID}: day-of-month field 'L': 'L' is not a number 1-31"),
    ("* * ? * *", f"'* * ? * *' {INVALID}: day-of-month field '?': '?' is not a number 1-31"),
    ("mon * * * *", f"'mon * * * *' {INVALID}: minute field 'mon': 'mon' is not a number "
                    "0-59"),
])
def test_bad_fields_are_named(expr: str, message: str) -> None:
    with pytest.raises(CronError) as caught:
        parse_cron(expr)
    assert str(caught.value) == f"cron_expression: {message}"


@pytest.mark.parametrize("zone", ["Mars/Base", "Europe", "", "../etc/passwd", "/etc/localtime",
                                  "europe/berlin", "x" * 300])
def test_unknown_time_zones_are_named(zone: str) -> None:
    with pytest.raises(CronError) as caught:
        parse_cron("* * * * *", zone)
    assert str(caught.value) == (f"timezone: unknown time zone {zone!r} (use an IANA name such "
                                 "as 'UTC' or 'Europe/Paris')")


def test_cron_error_is_a_value_error() -> None:
    assert issubclass(CronError, ValueError)
    with pytest.raises(ValueError, match=r"^timezone: unknown time zone 'Mars/Base'"):
        parse_cron("0 9 * * 0", "Mars/Base")
