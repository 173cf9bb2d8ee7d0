"""kandevd.cron: standard cron semantics, checked against a brute-force evaluator.

The evaluator below knows nothing of kandevd.cron or APScheduler: the
hypothesis strategy builds each field as a structure, renders it to text and
computes its value set independently; the evaluator then walks every local
wall-clock minute of the window and says which instants must fire, by the
definition of the DST rule: a wall time fires at the first instant the zone's
clock reads it or a later time (once in a fall-back fold, at the jump for a
time a spring-forward skips).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo, available_timezones

import pytest
from hypothesis import assume, example, given, settings
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


def reads(moment: datetime, zone: ZoneInfo) -> datetime:
    """The naive wall time the clock of ``zone`` shows at ``moment``."""
    return moment.astimezone(zone).replace(tzinfo=None)


def first_reached(wall: datetime, zone: ZoneInfo) -> datetime:
    """The first instant (UTC) the clock of ``zone`` reads ``wall`` or later: the instant of
    a normal wall time, the first of the two of one a fall-back repeats, the jump of one a
    spring-forward skips (found by a search over whole minutes, as every change is)."""
    lo, hi = sorted(wall.replace(tzinfo=zone, fold=fold).astimezone(UTC) for fold in (0, 1))
    if reads(lo, zone) >= wall:
        return lo
    minutes = (hi - lo) // timedelta(minutes=1)   # reads(lo) < wall <= reads(hi)
    below, above = 0, minutes
    while above - below > 1:
        mid = (below + above) // 2
        if reads(lo + timedelta(minutes=mid), zone) >= wall:
            above = mid
        else:
            below = mid
    return lo + timedelta(minutes=above)


def brute_force(spec: Spec, zone: ZoneInfo, after: datetime, until: datetime) -> list[datetime]:
    """Every fire instant in ``(after, until]``, walking every wall minute: each matching wall
    time fires at :func:`first_reached` (so skipped ones collapse into the jump)."""
    first_day = (after.astimezone(zone) - timedelta(days=1)).date()
    last_day = (until.astimezone(zone) + timedelta(days=1)).date()
    fires: set[datetime] = set()
    day = first_day
    while day <= last_day:
        for hour in range(24) if spec.day_matches(day) else ():
            for minute in range(60) if hour in spec.hour.values else ():
                if minute in spec.minute.values:
                    wall = datetime(day.year, day.month, day.day, hour, minute)
                    fires.add(first_reached(wall, zone))
        day += timedelta(days=1)
    return sorted(t for t in fires if after < t <= until)


# -- the zones' changes of UTC offset --------------------------------------------------------

DST_ZONES = (
    "Europe/Berlin", "Europe/London", "Europe/Dublin", "Europe/Chisinau", "Atlantic/Azores",
    "America/New_York", "America/Havana", "America/St_Johns", "America/Goose_Bay",
    "America/Santiago", "America/Sao_Paulo", "America/Asuncion", "America/Scoresbysund",
    "America/Mexico_City", "Australia/Lord_Howe", "Australia/Sydney", "Pacific/Auckland",
    "Pacific/Chatham", "Pacific/Apia", "Pacific/Norfolk", "Asia/Tehran", "Asia/Jerusalem",
    "Asia/Gaza", "Asia/Beirut", "Asia/Amman", "Africa/Casablanca", "Africa/Cairo",
    "Antarctica/Troll", "Antarctica/Casey")
FIXED_ZONES = ("UTC", "Asia/Tokyo", "Asia/Kolkata", "Asia/Kathmandu", "Pacific/Kiritimati",
               "America/Phoenix", "Etc/GMT+12", "Africa/Abidjan")
ALL_ZONES = tuple(sorted(available_timezones()))


@dataclass(frozen=True)
class Change:
    """A change of a zone's UTC offset: a gap (spring-forward) or a fold (fall-back)."""
    zone: str
    at: datetime  # UTC
    before: timedelta
    after: timedelta

    @property
    def gap(self) -> bool:
        return self.after > self.before

    @property
    def walls(self) -> tuple[datetime, datetime]:
        """The naive wall times ``[start, end)`` the change skips (gap) or repeats (fold)."""
        start, end = sorted((self.at + self.before, self.at + self.after))
        return start.replace(tzinfo=None), end.replace(tzinfo=None)


@functools.cache
def changes(zone_name: str, year: int) -> tuple[Change, ...]:
    """The offset changes of ``zone_name`` in ``year``: 6-hour probes (no zone changes twice
    within 6 hours in 2000-2040), each change bisected to its second."""
    zone = ZoneInfo(zone_name)

    def offset(second: int) -> timedelta:
        return datetime.fromtimestamp(second, zone).utcoffset()

    step = 6 * 3600
    second = int(datetime(year, 1, 1, tzinfo=UTC).timestamp())
    end = int(datetime(year + 1, 1, 1, tzinfo=UTC).timestamp())
    found = []
    while second < end:
        if offset(second) != offset(second + step):
            lo, hi = second, second + step
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if offset(mid) == offset(second) else (lo, mid)
            found.append(Change(zone_name, datetime.fromtimestamp(hi, UTC), offset(lo),
                                offset(hi)))
        second += step
    return tuple(found)


@st.composite
def dst_changes(draw: st.DrawFn, kind: str = "any") -> Change:
    """An offset change of a DST zone in 2000-2040; ``kind``: "gap", "fold" or "any"."""
    zone = draw(st.sampled_from(DST_ZONES))
    year = draw(st.integers(min_value=2000, max_value=2040))
    found = [c for c in changes(zone, year) if kind == "any" or c.gap == (kind == "gap")]
    assume(found)
    return draw(st.sampled_from(found))


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


anywhere = st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2040, 12, 1),
                        timezones=st.just(UTC))
near_a_change = st.builds(
    lambda change, back: (change.zone, change.at - back), dst_changes(),
    st.timedeltas(min_value=timedelta(0), max_value=WINDOW - timedelta(hours=2)))
zone_and_start = st.one_of(st.tuples(st.sampled_from(DST_ZONES + FIXED_ZONES), anywhere),
                           near_a_change)


# -- the properties ----------------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(spec=specs, zone_and_start=zone_and_start)
def test_fire_times_match_a_brute_force_standard_cron(spec: Spec,
                                                      zone_and_start: tuple[str, datetime]
                                                      ) -> None:
    zone_name, start = zone_and_start
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


@settings(max_examples=60, deadline=None)
@given(spec=specs, zone_and_start=st.one_of(st.tuples(st.sampled_from(ALL_ZONES), anywhere),
                                            near_a_change),
       probes=st.lists(st.timedeltas(min_value=timedelta(microseconds=1),
                                     max_value=timedelta(days=3)), max_size=5))
def test_fire_times_increase_and_each_is_the_first_at_or_after_a_moment(
        spec: Spec, zone_and_start: tuple[str, datetime], probes: list[timedelta]) -> None:
    zone_name, start = zone_and_start
    assume(spec.can_fire())
    trigger = parse_cron(spec.text, zone_name)
    assert trigger.timezone is ZoneInfo(zone_name)
    times = next_fire_times(trigger, start, 60)
    assert all(a < b for a, b in itertools.pairwise(times))
    assert all(t > start for t in times)
    # Compared in UTC: PEP 495 makes a zone-local time inside a fall-back fold unequal to
    # every time of another zone, even the same instant.
    for fire in times[:10]:
        found = trigger.get_next_fire_time(None, fire)
        assert found.astimezone(UTC) == fire
        assert found.tzinfo is trigger.timezone
        later = trigger.get_next_fire_time(None, fire - timedelta(microseconds=1))
        assert later.astimezone(UTC) == fire
    if times:
        for moment in (start + p for p in probes if start + p <= times[-1]):
            found = trigger.get_next_fire_time(None, moment)
            assert found.astimezone(UTC) == min(t for t in times if t >= moment)


@settings(max_examples=60, deadline=None)
@given(where=st.one_of(dst_changes().map(lambda c: (c.zone, c.at)),
                       st.tuples(st.sampled_from(FIXED_ZONES), anywhere)),
       hour=st.integers(min_value=0, max_value=23), minute=st.integers(min_value=0, max_value=59))
# Greenland springs forward at local midnight: 23:00 on that Saturday fires at 00:00 Sunday.
@example(where=("America/Scoresbysund", datetime(2025, 3, 30, 1, 0, tzinfo=UTC)), hour=23,
         minute=0)
def test_a_daily_schedule_fires_once_per_local_day(where: tuple[str, datetime], hour: int,
                                                  minute: int) -> None:
    zone_name, center = where
    zone = ZoneInfo(zone_name)
    after, until = center - timedelta(days=4), center + timedelta(days=4)
    # a zone that skips a whole calendar day fires its time at the jump, the next day
    assume(all(c.after - c.before < timedelta(hours=12) for c in changes(zone_name, center.year)))
    fires = [t for t in next_fire_times(parse_cron(f"{minute} {hour} * * *", zone_name), after,
                                        12) if t <= until]

    def day_of(fire: datetime) -> date:
        # The local day whose hour:minute the fire stands for: the day it reads, or, for a
        # fire at a jump over hour:minute, the day of the skipped hour:minute (a jump at
        # local midnight, as in America/Scoresbysund, reads the next day).
        before, now = reads(fire - timedelta(microseconds=1), zone), reads(fire, zone)
        return next(d for d in (before.date(), before.date() + timedelta(days=1))
                    if before < datetime.combine(d, time(hour, minute)) <= now)

    days = [day_of(t) for t in fires]
    first, last = reads(after, zone).date() + timedelta(days=1), reads(until, zone).date()
    assert [d for d in days if first <= d < last] == \
        [first + timedelta(days=n) for n in range((last - first).days)]
    for fire in fires:  # at hour:minute, or at the jump over it
        wall = datetime.combine(day_of(fire), time(hour, minute))
        if reads(fire, zone) != wall:
            assert reads(fire - timedelta(minutes=1), zone) < wall < reads(fire, zone)


@settings(max_examples=50, deadline=None)
@given(change=dst_changes("fold"), data=st.data())
def test_a_time_a_fall_back_repeats_fires_once_at_its_first_instant(change: Change,
                                                                    data: st.DataObject) -> None:
    start, end = change.walls
    repeats = (end - start) // timedelta(minutes=1)
    wall = start + timedelta(minutes=data.draw(st.integers(min_value=0, max_value=repeats - 1)))
    trigger = parse_cron(f"{wall.minute} {wall.hour} * * *", change.zone)
    first = (wall - change.before).replace(tzinfo=UTC)   # read with the offset before
    second = (wall - change.after).replace(tzinfo=UTC)   # read with the offset after
    assert first < change.at <= second
    fires = next_fire_times(trigger, first - timedelta(minutes=1), 2)
    assert fires[0] == first
    assert fires[1] > second
    assert trigger.get_next_fire_time(None, first + timedelta(seconds=1)) == fires[1]
    assert trigger.get_next_fire_time(None, second) == fires[1]


@settings(max_examples=50, deadline=None)
@given(change=dst_changes("gap"), data=st.data())
def test_a_time_a_spring_forward_skips_fires_once_at_the_jump(change: Change,
                                                             data: st.DataObject) -> None:
    start, end = change.walls
    skipped = (end - start) // timedelta(minutes=1)
    wall = start + timedelta(minutes=data.draw(st.integers(min_value=0, max_value=skipped - 1)))
    zone = ZoneInfo(change.zone)
    trigger = parse_cron(f"{wall.minute} {wall.hour} * * *", change.zone)
    fires = next_fire_times(trigger, change.at - timedelta(microseconds=1), 2)
    assert fires[0] == change.at
    assert reads(fires[0], zone) == end                   # what the clock jumps to
    assert reads(fires[1], zone) > wall + timedelta(hours=12)
    assert trigger.get_next_fire_time(None, change.at) == change.at
    assert trigger.get_next_fire_time(None, change.at + timedelta(microseconds=1)) == fires[1]


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


def test_a_repeated_time_fires_once_and_a_skipped_time_at_the_jump() -> None:
    berlin = ZoneInfo("Europe/Berlin")
    daily = parse_cron("30 2 * * *", "Europe/Berlin")
    assert daily.timezone is berlin
    autumn = next_fire_times(daily, datetime(2026, 10, 24, 12, tzinfo=UTC), 2)
    assert autumn == [datetime(2026, 10, 25, 0, 30, tzinfo=UTC),   # 02:30 CEST, not at CET
                      datetime(2026, 10, 26, 1, 30, tzinfo=UTC)]
    spring = next_fire_times(daily, datetime(2026, 3, 28, 12, tzinfo=UTC), 2)
    assert spring == [datetime(2026, 3, 29, 1, 0, tzinfo=UTC),      # 03:00 CEST, the jump
                      datetime(2026, 3, 30, 0, 30, tzinfo=UTC)]
    jump = datetime(2026, 3, 29, 1, 0, tzinfo=UTC)
    found = daily.get_next_fire_time(None, jump)
    assert found == jump
    assert found.tzinfo is berlin
    assert str(found) == "2026-03-29 03:00:00+02:00"
    busy = parse_cron("10,37 1,2,3 * * *", "Europe/Berlin")
    assert next_fire_times(busy, datetime(2026, 3, 29, 0, 30, tzinfo=UTC), 3) == [
        datetime(2026, 3, 29, 0, 37, tzinfo=UTC),                   # 01:37 CET
        datetime(2026, 3, 29, 1, 0, tzinfo=UTC),                    # 03:00 CEST: 02:10, 02:37
        datetime(2026, 3, 29, 1, 10, tzinfo=UTC)]                   # 03:10 CEST


def test_nothing_repeats_in_the_second_pass_of_a_fall_back() -> None:
    every_ten = parse_cron("*/10 * * * *", "Europe/Berlin")
    times = next_fire_times(every_ten, datetime(2026, 10, 25, 0, 45, tzinfo=UTC), 3)
    assert [str(t.astimezone(every_ten.timezone)) for t in times] == [
        "2026-10-25 02:50:00+02:00", "2026-10-25 03:00:00+01:00", "2026-10-25 03:10:00+01:00"]
    in_second_pass = datetime(2026, 10, 25, 1, 5, tzinfo=UTC)       # 02:05 CET
    assert every_ten.get_next_fire_time(None, in_second_pass) == times[1]


@pytest.mark.parametrize(("zone", "expr", "after", "expected"), [
    ("Europe/Berlin", "*/15 2 * * *", datetime(2026, 3, 28, 12, tzinfo=UTC),
     ["2026-03-29 03:00:00+02:00", "2026-03-30 02:00:00+02:00"]),
    ("America/New_York", "*/15 2 * * *", datetime(2026, 3, 7, 12, tzinfo=UTC),
     ["2026-03-08 03:00:00-04:00", "2026-03-09 02:00:00-04:00"]),
    ("Pacific/Auckland", "*/15 2 * * *", datetime(2026, 9, 26, tzinfo=UTC),
     ["2026-09-27 03:00:00+13:00", "2026-09-28 02:00:00+13:00"]),
    ("Europe/Berlin", "0 2,3 * * *", datetime(2026, 3, 28, 12, tzinfo=UTC),
     ["2026-03-29 03:00:00+02:00", "2026-03-30 02:00:00+02:00"]),
    ("Australia/Lord_Howe", "*/15 2 * * *", datetime(2026, 10, 3, tzinfo=UTC),   # 02:00->02:30
     ["2026-10-04 02:30:00+11:00", "2026-10-04 02:45:00+11:00", "2026-10-05 02:00:00+11:00"]),
    ("America/Santiago", "*/15 0 * * *", datetime(2026, 9, 5, 12, tzinfo=UTC),   # 00:00->01:00
     ["2026-09-06 01:00:00-03:00", "2026-09-07 00:00:00-03:00"]),
])
def test_skipped_times_collapse_into_one_fire_at_the_jump(zone: str, expr: str, after: datetime,
                                                           expected: list[str]) -> None:
    trigger = parse_cron(expr, zone)
    times = next_fire_times(trigger, after, len(expected))
    assert [str(t.astimezone(trigger.timezone)) for t in times] == expected


def test_a_skipped_calendar_day_fires_at_the_jump() -> None:
    """Samoa skipped 2011-12-30: its noon fires when the clock jumps to the 31st."""
    noon = parse_cron("0 12 * * *", "Pacific/Apia")
    times = next_fire_times(noon, datetime(2011, 12, 29, 12, tzinfo=UTC), 3)
    assert [str(t.astimezone(noon.timezone)) for t in times] == [
        "2011-12-29 12:00:00-10:00", "2011-12-31 00:00:00+14:00", "2011-12-31 12:00:00+14:00"]


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


@pytest.mark.parametrize("zone", ["Mars/Base", "", "../etc/passwd", "/etc/localtime",
                                  "x" * 300])
def test_unknown_time_zones_are_named(zone: str) -> None:
    with pytest.raises(CronError) as caught:
        parse_cron("* * * * *", zone)
    assert str(caught.value) == (f"timezone: unknown time zone {zone!r} (use an IANA name such "
                                 "as 'UTC' or 'Europe/Paris')")


@pytest.mark.parametrize(("zone", "meant"), [
    ("europe/berlin", "Europe/Berlin"), ("Europe/Pariss", "Europe/Paris"),
    ("America/New_Yrok", "America/New_York"), ("utc", "UTC"),
])
def test_a_misspelt_time_zone_gets_a_suggestion(zone: str, meant: str) -> None:
    with pytest.raises(CronError) as caught:
        parse_cron("* * * * *", zone)
    assert str(caught.value) == f"timezone: unknown time zone {zone!r}; did you mean {meant}?"


@pytest.mark.parametrize(("macro", "same_as"), [
    ("@yearly", "0 0 1 1 *"), ("@annually", "0 0 1 1 *"), ("@monthly", "0 0 1 * *"),
    ("@weekly", "0 0 * * 0"), ("@daily", "0 0 * * *"), ("@midnight", "0 0 * * *"),
    ("@hourly", "0 * * * *"), ("@DAILY", "0 0 * * *"),
])
def test_the_standard_macros_fire_as_their_expressions(macro: str, same_as: str) -> None:
    start = datetime(2026, 3, 1, 12, 30, tzinfo=UTC)
    assert next_fire_times(parse_cron(macro, "Europe/Paris"), start, 5) == \
        next_fire_times(parse_cron(same_as, "Europe/Paris"), start, 5)
    assert parse_cron(macro).expression == macro


def test_reboot_and_unknown_macros_are_refused_with_a_reason() -> None:
    with pytest.raises(CronError, match=r"^cron_expression: '@reboot' is not supported: a "
                                        r"schedule fires at times"):
        parse_cron("@reboot")
    with pytest.raises(CronError, match=r"'@dayly' is not a known macro .*; did you mean "
                                        r"@daily\?$"):
        parse_cron("@dayly")


def test_cron_error_is_a_value_error() -> None:
    assert issubclass(CronError, ValueError)
    with pytest.raises(ValueError, match=r"^timezone: unknown time zone 'Mars/Base'"):
        parse_cron("0 9 * * 0", "Mars/Base")


def test_a_fire_inside_a_fall_back_fold_is_found_again_from_its_own_instant() -> None:
    hourly_sundays = parse_cron("0 * * * 0", "Europe/Berlin")
    times = next_fire_times(hourly_sundays, datetime(2000, 10, 28, 1, tzinfo=UTC), 4)
    fold = datetime(2000, 10, 29, 0, tzinfo=UTC)  # 02:00 CEST, the first 02:00 of the day
    assert fold in times
    assert hourly_sundays.get_next_fire_time(None, fold).astimezone(UTC) == fold


def test_an_expression_longer_than_a_schedule_may_hold_is_refused_wherever_parsed() -> None:
    """The CLI's dry run (``jobs next --cron``) refuses what the daemon's schemas refuse."""
    long = "1," * 1500 + "2 * * * *"
    with pytest.raises(CronError, match=r"^cron_expression: 3009 characters; at most 500"):
        parse_cron(long)
    assert parse_cron("0 9 * * *").expression == "0 9 * * *"
