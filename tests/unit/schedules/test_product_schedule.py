"""kandevd.products.schedule: validation (table tests) and decide (properties)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from datetime import UTC, datetime, time, timedelta
from importlib import resources
from zoneinfo import ZoneInfo

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kandevd.cron import next_fire_times, parse_cron
from kandevd.schedules.products import schedule as ps
from kandevd.schedules.products.schedule import (
    Decision,
    ProductSchedule,
    ScheduleState,
    decide,
)
from kandevd.schedules.rules.options import NO_OPTIONS

PROPERTY = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
ZONES = ("Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "UTC")
CRONS = ("*/15 * * * *", "0 9 * * *", "30 2 * * *", "0 2 * * *", "0 0 1 * mon",
         "0 */6 * * *", "5 4 * * sun", "0 12 1 1 *")
ALLOWED = ("cadence_hours, catchup_window_s, cron_expression, description, enabled, end_at, "
           "id, jitter_s, max_deferral_hours, messages, name, notify, pause_after_failures, "
           "preferred_hour, quiet_minutes, runs_on, start_at, timeout_s, timezone")
T0 = datetime(2026, 3, 1, 8, 0, tzinfo=UTC)


def cron(expr: str = "0 9 * * *", **kw) -> ProductSchedule:
    return ps.parse({"id": "c", "messages": ["hi"], "cron_expression": expr, **kw})


def cadence(hours: float = 24, **kw) -> ProductSchedule:
    return ps.parse({"id": "k", "messages": ["hi"], "cadence_hours": hours, **kw})


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


# -- validate ------------------------------------------------------------------------

BASE = {"id": "daily", "messages": ["Good morning"]}

VALIDATE_CASES = [
    ("cron", {**BASE, "cron_expression": "0 9 * * *", "timezone": "Europe/Berlin"}, []),
    ("cadence", {**BASE, "cadence_hours": 36, "preferred_hour": 9,
                 "timezone": "America/New_York", "quiet_minutes": 30,
                 "max_deferral_hours": 4, "name": "n", "description": "d",
                 "enabled": False}, []),
    ("quiet without cap", {**BASE, "cadence_hours": 0.5, "quiet_minutes": 0}, []),
    ("not an object", "daily", ["<root>: 'daily' is not of type 'object'"]),
    ("empty", {}, ["id: required field missing", "messages: required field missing",
                   ps.TIMING_NEITHER]),
    ("unknown fields", {**BASE, "cadence_hours": 1, "group_ids": ["a"], "mode": "x"},
     [f"group_ids: unknown field; allowed here: {ALLOWED}",
      f"mode: unknown field; allowed here: {ALLOWED}"]),
    ("empty id", {**BASE, "id": "", "cadence_hours": 1},
     ["id: '' is not allowed: use letters, digits, '.', '_' and '-', starting with a letter "
      "or digit (at most 200 characters)"]),
    ("path-like id", {**BASE, "id": "../x", "cadence_hours": 1},
     ["id: '../x' is not allowed: use letters, digits, '.', '_' and '-', starting with a "
      "letter or digit (at most 200 characters)"]),
    ("long id", {**BASE, "id": "x" * 201, "cadence_hours": 1},
     [f"id: '{'x' * 201}' is not allowed: use letters, digits, '.', '_' and '-', starting "
      "with a letter or digit (at most 200 characters)"]),
    ("no messages", {**BASE, "messages": [], "cadence_hours": 1},
     ["messages: [] should be non-empty"]),
    ("empty message", {**BASE, "messages": ["a", ""], "cadence_hours": 1},
     ["messages.1: '' should be non-empty"]),
    ("message type", {**BASE, "messages": "hi", "cadence_hours": 1},
     ["messages: 'hi' is not of type 'array'"]),
    ("enabled type", {**BASE, "enabled": "yes", "cadence_hours": 1},
     ["enabled: 'yes' is not of type 'boolean'"]),
    ("both timings", {**BASE, "cron_expression": "0 9 * * *", "cadence_hours": 24},
     [ps.TIMING_BOTH]),
    ("neither timing", {**BASE, "timezone": "UTC"}, [ps.TIMING_NEITHER]),
    ("cadence zero", {**BASE, "cadence_hours": 0},
     ["cadence_hours: 0 is less than or equal to the minimum of 0"]),
    ("cadence bool", {**BASE, "cadence_hours": True},
     ["cadence_hours: true is not of type 'number'"]),
    ("cadence NaN", {**BASE, "cadence_hours": float("nan")},
     ["cadence_hours: must be a number, not NaN"]),
    ("preferred hour range", {**BASE, "cadence_hours": 24, "preferred_hour": 24},
     ["preferred_hour: 24 is greater than the maximum of 23"]),
    ("preferred hour fraction", {**BASE, "cadence_hours": 24, "preferred_hour": 7.5},
     ["preferred_hour: 7.5 is not of type 'integer'"]),
    ("preferred hour with cron", {**BASE, "cron_expression": "0 9 * * *",
                                  "preferred_hour": 9},
     [ps.PREFERRED_HOUR_WITHOUT_CADENCE]),
    ("preferred hour alone", {**BASE, "preferred_hour": 9},
     [ps.TIMING_NEITHER, ps.PREFERRED_HOUR_WITHOUT_CADENCE]),
    ("negative quiet", {**BASE, "cadence_hours": 1, "quiet_minutes": -1},
     ["quiet_minutes: -1 is less than the minimum of 0"]),
    ("negative cap", {**BASE, "cadence_hours": 1, "quiet_minutes": 5,
                      "max_deferral_hours": -0.5},
     ["max_deferral_hours: -0.5 is less than the minimum of 0"]),
    ("cap without quiet", {**BASE, "cadence_hours": 1, "max_deferral_hours": 2},
     [ps.DEFERRAL_WITHOUT_QUIET]),
    ("bad cron", {**BASE, "cron_expression": "0 9 * *"},
     ["cron_expression: '0 9 * *' is not a valid 5-field cron expression: Wrong number of "
      "fields; got 4, expected 5"]),
    ("cron out of range", {**BASE, "cron_expression": "0 24 * * *"},
     ["cron_expression: '0 24 * * *' is not a valid 5-field cron expression: hour field "
      "'24': 24 is out of range 0-23"]),
    ("cron never fires", {**BASE, "cron_expression": "0 0 31 2 *"},
     ["cron_expression: '0 0 31 2 *' never fires"]),
    ("bad zone", {**BASE, "cadence_hours": 1, "timezone": "Mars/Base"},
     ["timezone: unknown time zone 'Mars/Base' (use an IANA name such as 'UTC' or "
      "'Europe/Paris')"]),
    ("bad zone and cron", {**BASE, "cron_expression": "61 * * * *", "timezone": "Nowhere"},
     ["timezone: unknown time zone 'Nowhere' (use an IANA name such as 'UTC' or "
      "'Europe/Paris')",
      "cron_expression: '61 * * * *' is not a valid 5-field cron expression: minute field "
      "'61': 61 is out of range 0-59"]),
    ("cron type", {**BASE, "cron_expression": 9},
     ["cron_expression: 9 is not of type 'string'"]),
    ("everything at once", {"id": 5, "messages": [""], "cron_expression": "x",
                            "cadence_hours": -1, "preferred_hour": 3,
                            "max_deferral_hours": 1, "timezone": "Bad/Zone", "x": 1},
     [f"x: unknown field; allowed here: {ALLOWED}",
      "cadence_hours: -1 is less than or equal to the minimum of 0",
      "id: 5 is not of type 'string'",
      "messages.0: '' should be non-empty",
      ps.TIMING_BOTH, ps.DEFERRAL_WITHOUT_QUIET,
      "timezone: unknown time zone 'Bad/Zone' (use an IANA name such as 'UTC' or "
      "'Europe/Paris')",
      "cron_expression: 'x' is not a valid 5-field cron expression: Wrong number of fields; "
      "got 1, expected 5"]),
]


@pytest.mark.parametrize(("raw", "expected"), [c[1:] for c in VALIDATE_CASES],
                         ids=[c[0] for c in VALIDATE_CASES])
def test_validate(raw, expected):
    assert ps.validate(raw) == expected
    if expected:
        with pytest.raises(ValueError) as caught:
            ps.parse(raw)
        assert str(caught.value) == "; ".join(expected)
    else:
        assert ps.parse(raw).id == raw["id"]


def test_timing_messages():
    assert ps.TIMING_BOTH == "timing: give either cron_expression or cadence_hours, not both"
    assert ps.TIMING_NEITHER.startswith(
        "timing: give either cron_expression or cadence_hours, neither")


def test_parse_normalizes_and_as_dict():
    schedule = ps.parse({"id": "c", "messages": ["a", "b"], "cron_expression": " 0  9 * * 1 ",
                         "timezone": "Europe/Berlin", "quiet_minutes": 15})
    assert schedule == ProductSchedule(id="c", messages=("a", "b"),
                                       cron_expression="0 9 * * 1", timezone="Europe/Berlin",
                                       quiet_minutes=15)
    assert schedule.as_dict() == {
        "id": "c", "name": "", "description": "", "enabled": True, "messages": ["a", "b"],
        "cron_expression": "0 9 * * 1", "timezone": "Europe/Berlin", "quiet_minutes": 15,
        **NO_OPTIONS.as_dict()}
    assert schedule.trigger is schedule.trigger
    assert schedule.trigger.get_next_fire_time(None, at("2026-03-02T00:00:00+00:00")) \
        == at("2026-03-02T09:00:00+01:00")

    other = cadence(36, preferred_hour=9, name="n", description="d", enabled=False,
                    quiet_minutes=30, max_deferral_hours=2)
    assert other.trigger is None
    assert other.as_dict() == {
        "id": "k", "name": "n", "description": "d", "enabled": False, "messages": ["hi"],
        "cron_expression": None, "timezone": "UTC", "cadence_hours": 36,
        "preferred_hour": 9, "quiet_minutes": 30, "max_deferral_hours": 2,
        **NO_OPTIONS.as_dict()}
    assert isinstance(cadence(24, preferred_hour=9.0).preferred_hour, int)


# -- the product.yaml schema ---------------------------------------------------------

@pytest.fixture(scope="module")
def product_validator():
    text = resources.files("kandevd.schemas").joinpath("product.json").read_text("utf-8")
    schema = json.loads(text)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize(("document", "valid"), [
    ({"profile": {}}, True),
    ({"profile": {"id": "helper.v2", "x": 1, "runtime": {
        "agent_profile": "default", "conversation": {"mode": "singleton", "y": 2}, "z": 3},
        "schedules": [{"id": "a", "messages": ["m"], "cadence_hours": 24}]}, "extra": True},
     True),
    ({"profile": []}, False),
    ({"profile": {"id": "a/b"}}, False),
    ({"profile": {"id": ""}}, False),
    ({"profile": {"runtime": {"agent_profile": "-bad"}}}, False),
    ({"profile": {"runtime": {"conversation": {"mode": 1}}}}, False),
    ({"profile": {"schedules": {}}}, False),
    ({"profile": {"schedules": [{"id": "a", "messages": ["m"], "extra": 1}]}}, False),
    ({"profile": {"schedules": [{"id": "a"}]}}, False),
])
def test_product_schema(product_validator, document, valid):
    assert product_validator.is_valid(document) is valid


# -- decide: examples ----------------------------------------------------------------

def test_never_seen_examples():
    now = at("2026-03-02T10:00:00+00:00")
    assert decide(cron(), ScheduleState(), now) == Decision(
        False, at("2026-03-03T09:00:00+00:00"), "first_occurrence")
    assert decide(cron(), ScheduleState(), at("2026-03-02T09:00:00+00:00")).next_at \
        == at("2026-03-03T09:00:00+00:00")  # strictly after now
    assert decide(cadence(5), ScheduleState(), now) == Decision(
        False, now + timedelta(hours=5), "first_slot")
    assert decide(cadence(5, preferred_hour=9, timezone="Europe/Berlin"), ScheduleState(),
                  now) == Decision(False, at("2026-03-03T09:00:00+01:00"), "first_slot")


def test_after_a_run_examples():
    last = at("2026-03-02T09:00:00+00:00")
    ok = ScheduleState(last_run_at=last, last_status="success")
    assert decide(cron(), ok, last) == Decision(False, at("2026-03-03T09:00:00+00:00"),
                                                "regular_slot")
    # a missed cron occurrence is not replayed
    late = at("2026-03-05T10:00:00+00:00")
    assert decide(cron(), ok, late) == Decision(False, at("2026-03-06T09:00:00+00:00"),
                                                "missed_not_replayed")
    # an overdue cadence slot is due now
    assert decide(cadence(24), ok, late) == Decision(True, late, "overdue")
    # a slot reached exactly now is due
    slot = last + timedelta(hours=24)
    assert decide(cadence(24), ok, slot) == Decision(True, slot, "overdue")
    # "stopped" counts as a regular run
    assert decide(cadence(24), replace(ok, last_status="stopped"), last).reason \
        == "regular_slot"


def test_retry_examples():
    last = at("2026-03-02T09:00:00+00:00")
    failed = ScheduleState(last_run_at=last, last_status="error", consecutive_failures=1)
    assert decide(cron(), failed, last) == Decision(False, last + timedelta(minutes=30),
                                                    "retry_backoff")
    assert decide(cron(), replace(failed, consecutive_failures=3), last).next_at \
        == last + timedelta(hours=2)
    # the regular slot comes first
    assert decide(cron("*/15 * * * *"), failed, last) == Decision(
        False, last + timedelta(minutes=15), "regular_slot")
    # an overdue retry is due now, even for cron
    late = last + timedelta(hours=3)
    assert decide(cron(), failed, late) == Decision(True, late, "overdue")
    # ... but an overdue regular slot of cron is not
    assert decide(cron("*/15 * * * *"), failed, late) == Decision(
        False, at("2026-03-02T12:15:00+00:00"), "missed_not_replayed")
    # zero failures recorded with an error status still backs off like one failure
    assert decide(cadence(24), replace(failed, consecutive_failures=0), last).next_at \
        == last + timedelta(minutes=30)


@pytest.mark.parametrize(("k", "delay"), [
    (1, timedelta(minutes=30)), (2, timedelta(hours=1)), (3, timedelta(hours=2)),
    (4, timedelta(hours=4)), (5, timedelta(hours=6)), (6, timedelta(hours=6)),
    (1000, timedelta(hours=6)),
])
def test_retry_delay(k, delay):
    assert ps.retry_delay(k) == delay


def test_pending_examples():
    due_at = at("2026-03-02T09:00:00+00:00")
    state = ScheduleState(next_run_at=due_at)
    quiet = cadence(24, quiet_minutes=30, max_deferral_hours=2)
    assert decide(quiet, state, due_at - timedelta(seconds=1)) == Decision(
        False, due_at, "waiting")
    assert decide(quiet, state, due_at) == Decision(True, due_at, "due")
    active = due_at + timedelta(minutes=10)
    now = due_at + timedelta(minutes=20)
    assert decide(quiet, state, now, active) == Decision(
        False, active + timedelta(minutes=30), "quiet")
    assert decide(quiet, state, now, now - timedelta(minutes=30)) == Decision(
        True, due_at, "due")  # activity exactly quiet_minutes ago is not quiet
    assert decide(quiet, state, due_at + timedelta(hours=1, minutes=50),
                  due_at + timedelta(hours=1, minutes=45)) == Decision(
        False, due_at + timedelta(hours=2), "quiet")
    assert decide(quiet, state, due_at + timedelta(hours=2), due_at + timedelta(hours=2)) \
        == Decision(True, due_at, "deferral_cap")
    # activity stamped in the future counts as now
    assert decide(quiet, state, now, now + timedelta(hours=1)) == Decision(
        False, now + timedelta(minutes=30), "quiet")
    # without a quiet rule activity does not matter
    assert decide(cadence(24), state, now, now) == Decision(True, due_at, "due")
    # the default cap is 24 h
    uncapped = cadence(24, quiet_minutes=60)
    late = due_at + timedelta(hours=23, minutes=30)
    assert decide(uncapped, state, late, late) == Decision(
        False, due_at + timedelta(hours=24), "quiet")
    assert decide(uncapped, state, due_at + timedelta(hours=24), late).reason \
        == "deferral_cap"
    # a quiet_minutes of 0 never defers
    assert decide(cadence(24, quiet_minutes=0), state, now, now).reason == "due"


def test_results_are_utc_and_naive_is_refused():
    berlin = ZoneInfo("Europe/Berlin")
    decision = decide(cron(timezone="Europe/Berlin"), ScheduleState(),
                      datetime(2026, 3, 2, 10, tzinfo=berlin))
    assert decision.next_at.tzinfo is UTC
    with pytest.raises(ValueError, match="naive"):
        decide(cron(), ScheduleState(), datetime(2026, 3, 2))


# -- decide: properties --------------------------------------------------------------

instants = st.datetimes(min_value=datetime(2024, 1, 1), max_value=datetime(2031, 1, 1),
                        timezones=st.just(UTC))
zones = st.sampled_from(ZONES)
quiet_rules = st.one_of(
    st.just({}),
    st.fixed_dictionaries({"quiet_minutes": st.integers(0, 240)},
                          optional={"max_deferral_hours": st.sampled_from([0, 0.5, 3, 30])}))


@st.composite
def cron_schedules(draw):
    return cron(draw(st.sampled_from(CRONS)), timezone=draw(zones), **draw(quiet_rules))


any_hour = st.one_of(st.none(), st.integers(0, 23))


@st.composite
def cadence_schedules(draw, preferred=any_hour):
    extra = {"timezone": draw(zones), **draw(quiet_rules)}
    hour = draw(preferred)
    if hour is not None:
        extra["preferred_hour"] = hour
    hours = draw(st.one_of(st.sampled_from([0.25, 1, 6, 24, 36.5, 168]),
                           st.floats(0.1, 400, allow_nan=False)))
    return cadence(hours, **extra)


schedules = st.one_of(cron_schedules(), cadence_schedules())


def regular_slot(schedule: ProductSchedule, last: datetime) -> datetime:
    if schedule.cron_expression is not None:
        return next_fire_times(schedule.trigger, last, 1)[0]
    return cadence_oracle(schedule, last)


def cadence_oracle(schedule: ProductSchedule, last: datetime) -> datetime:
    """A cadence's slot after ``last`` by the rule of docs/scheduling.md, from the zone's
    wall clock read instant by instant (not from the cron trigger the code uses)."""
    if schedule.preferred_hour is None:
        return last + timedelta(hours=schedule.cadence_hours)
    zone, hour = ZoneInfo(schedule.timezone), schedule.preferred_hour
    days = max(1, math.ceil(schedule.cadence_hours / 24))
    wall = last.astimezone(zone).replace(tzinfo=None)
    day = wall.date() if wall.hour >= hour else wall.date() - timedelta(days=1)
    soon = oracle_first_instant(datetime.combine(day + timedelta(days=days), time(hour)), zone)
    if soon - last >= timedelta(hours=schedule.cadence_hours / 2):
        return soon
    return oracle_first_instant(datetime.combine(day + timedelta(days=days + 1), time(hour)),
                                zone)


@PROPERTY
@given(schedules, instants, st.one_of(st.none(), instants))
def test_never_seen_is_not_due(schedule, now, active):
    decision = decide(schedule, ScheduleState(), now, active)
    assert not decision.due
    assert decision.next_at > now
    assert decision.next_at.tzinfo is UTC
    assert decision.reason == ("first_occurrence" if schedule.cron_expression else "first_slot")


@PROPERTY
@given(schedules, instants, st.data())
def test_simulation_never_runs_an_occurrence_twice(schedule, start, data):
    steps = data.draw(st.lists(st.integers(1, 3 * 24 * 60), min_size=5, max_size=25),
                      label="minutes between checks")
    state, now = ScheduleState(), start
    runs: list[tuple[datetime, datetime, ScheduleState]] = []  # (due time, run at, before)
    for minutes in steps:
        now += timedelta(minutes=minutes)
        active = data.draw(st.one_of(st.none(), st.integers(0, 300).map(
            lambda m, now=now: now - timedelta(minutes=m))), label="last active")
        decision = decide(schedule, state, now, active)
        assert decision.next_at.tzinfo is UTC
        if not decision.due:
            assert decision.next_at > now
            if state.next_run_at is None:
                state = replace(state, next_run_at=decision.next_at)
            elif decision.reason == "quiet":
                cap = schedule.max_deferral_hours
                cap = ps.DEFAULT_MAX_DEFERRAL_HOURS if cap is None else cap
                assert decision.next_at <= state.next_run_at + timedelta(hours=cap)
            continue
        assert state.last_run_at is not None or state.next_run_at is not None, \
            "a never-seen schedule is due"
        assert decision.next_at <= now
        if decision.reason == "overdue":
            assert decision.next_at == now
        else:
            assert decision.next_at == state.next_run_at
        runs.append((decision.next_at, now, state))
        status = data.draw(st.sampled_from(["success", "error", "stopped"]), label="status")
        failures = {"success": 0, "error": state.consecutive_failures + 1,
                    "stopped": state.consecutive_failures}[status]
        state = ScheduleState(last_run_at=now, last_status=status,
                              consecutive_failures=failures)
    due_times = [due for due, _, _ in runs]
    assert due_times == sorted(set(due_times)), "due times are strictly increasing"
    for due, ran, before in runs:
        if before.last_run_at is None:
            continue
        earliest = regular_slot(schedule, before.last_run_at)
        if before.last_status == "error":
            earliest = min(earliest, before.last_run_at
                           + ps.retry_delay(before.consecutive_failures))
        assert due >= earliest, "a run came before its occurrence"
        if schedule.cron_expression is not None and before.last_status != "error":
            # a cron occurrence passed between the two runs: none is run twice
            assert next_fire_times(schedule.trigger, before.last_run_at, 1)[0] <= ran


def oracle_first_instant(wall: datetime, zone: ZoneInfo) -> datetime:
    """The first instant the zone's clock reads ``wall`` (naive), or the jump past it."""
    found = [candidate.astimezone(UTC) for fold in (0, 1)
             if (candidate := wall.replace(tzinfo=zone, fold=fold))
             .astimezone(UTC).astimezone(zone).replace(tzinfo=None) == wall]
    if found:
        return min(found)
    early, late = sorted(wall.replace(tzinfo=zone, fold=f).astimezone(UTC) for f in (0, 1))
    moment = early
    while moment.astimezone(zone).replace(tzinfo=None) < wall:  # minute by minute
        moment += timedelta(minutes=1)
    assert moment <= late
    return moment


transition_days = st.sampled_from([
    datetime(2026, 3, 29, tzinfo=UTC), datetime(2026, 10, 25, tzinfo=UTC),  # Berlin
    datetime(2026, 3, 8, tzinfo=UTC), datetime(2026, 11, 1, tzinfo=UTC),    # New York
    datetime(2026, 4, 5, tzinfo=UTC), datetime(2026, 10, 4, tzinfo=UTC),    # Lord Howe
])
near_transitions = st.builds(lambda day, minutes: day + timedelta(minutes=minutes),
                             transition_days, st.integers(-36 * 60, 36 * 60))


@PROPERTY
@given(cadence_schedules(preferred=st.integers(0, 23)), st.one_of(instants, near_transitions),
       st.booleans(), st.data())
def test_cadence_slots_land_at_the_preferred_local_hour(schedule, moment, ran, data):
    if ran:  # near a transition, the slot computed after a run is close to it
        offset = data.draw(st.floats(0, 48), label="hours before") \
            if schedule.cadence_hours <= 48 else 0
        last = moment - timedelta(hours=min(offset, schedule.cadence_hours))
        state, now = ScheduleState(last_run_at=last, last_status="success"), last
    else:
        state, now = ScheduleState(), moment
    decision = decide(schedule, state, now)
    zone = ZoneInfo(schedule.timezone)
    expected = cadence_oracle(schedule, now)
    assert decision == Decision(False, expected, "regular_slot" if ran else "first_slot")
    local = decision.next_at.astimezone(zone)
    wall = datetime.combine(local.date(), time(schedule.preferred_hour))
    assert oracle_first_instant(wall, zone) == decision.next_at
    if (local.hour, local.minute, local.second) != (schedule.preferred_hour, 0, 0):
        # the preferred hour was skipped that day: the slot is the jump
        assert local.replace(tzinfo=None) > wall
        assert (decision.next_at - timedelta(seconds=1)).astimezone(zone) \
            .replace(tzinfo=None) < wall
    # whole days of the wall clock after the slot the start belongs to, a day more at most
    days = max(1, math.ceil(schedule.cadence_hours / 24))
    assert now + timedelta(hours=schedule.cadence_hours / 2) <= decision.next_at \
        < now + timedelta(days=days + 1, hours=2)


def test_a_daily_cadence_at_a_preferred_hour_runs_every_day():
    """From the slot the run belonged to: a start a few milliseconds late, or held hours
    by the quiet rule, or a 23-hour day, does not skip a day; an overdue run just before
    the hour does not get a second one an hour later."""
    daily = cadence(24, preferred_hour=9, timezone="Europe/Paris")

    def after(start: str) -> datetime:
        ran = ScheduleState(last_run_at=at(start), last_status="success")
        return decide(daily, ran, at(start)).next_at

    assert after("2026-12-07T08:00:00.050000+00:00") == at("2026-12-08T09:00:00+01:00")
    assert after("2026-12-07T13:00:00+00:00") == at("2026-12-08T09:00:00+01:00")  # held
    assert after("2026-12-08T07:00:00+00:00") == at("2026-12-09T09:00:00+01:00")  # overdue
    # spring forward on Sunday 2027-03-28: Saturday 09:00 + one day of wall clock
    assert after("2027-03-27T08:00:00.2+00:00") == at("2027-03-28T09:00:00+02:00")
    weekly = cadence(168, preferred_hour=9, timezone="Europe/Paris")
    assert decide(weekly, ScheduleState(last_run_at=at("2026-12-07T08:00:01+00:00"),
                                        last_status="success"),
                  at("2026-12-07T08:00:01+00:00")).next_at == at("2026-12-14T09:00:00+01:00")
    # jobs.next, as if each ran on time: one a day
    state = ScheduleState(last_run_at=at("2026-12-07T08:00:00.05+00:00"), last_status="success")
    slots = []
    for _ in range(3):
        slots.append(decide(daily, state, state.last_run_at).next_at)
        state = ScheduleState(last_run_at=slots[-1] + timedelta(milliseconds=30),
                              last_status="success")
    assert slots == [at(f"2026-12-{day}T09:00:00+01:00") for day in ("08", "09", "10")]


def test_cadence_preferred_hour_dst_examples():
    berlin = cadence(1, preferred_hour=2, timezone="Europe/Berlin")
    # spring forward: 02:00 does not exist on 2026-03-29, the slot is the jump (03:00 CEST)
    assert decide(berlin, ScheduleState(), at("2026-03-28T23:30:00+00:00")).next_at \
        == at("2026-03-29T03:00:00+02:00")
    # fall back: 02:00 happens twice on 2026-10-25, the slot is the first (CEST)
    assert decide(berlin, ScheduleState(), at("2026-10-24T22:30:00+00:00")).next_at \
        == at("2026-10-25T02:00:00+02:00")
    # from inside the second pass, the next slot is the following day
    assert decide(berlin, ScheduleState(), at("2026-10-25T00:00:00+00:00")).next_at \
        == at("2026-10-26T02:00:00+01:00")
    howe = cadence(1, preferred_hour=2, timezone="Australia/Lord_Howe")
    # Lord Howe springs forward 30 minutes at 02:00 on 2026-10-04
    assert decide(howe, ScheduleState(), at("2026-10-03T13:30:00+00:00")).next_at \
        == at("2026-10-04T02:30:00+11:00")


@PROPERTY
@given(schedules, instants, st.integers(1, 9), st.integers(0, 3 * 24 * 60))
def test_retry_backoff(schedule, last, failures, minutes_later):
    state = ScheduleState(last_run_at=last, last_status="error",
                          consecutive_failures=failures)
    now = last + timedelta(minutes=minutes_later)
    decision = decide(schedule, state, now)
    delay = min(timedelta(minutes=30) * 2 ** (failures - 1), timedelta(hours=6))
    assert ps.retry_delay(failures) == delay
    regular = regular_slot(schedule, last)
    pending = min(last + delay, regular)
    if pending > now:
        assert decision == Decision(
            False, pending, "retry_backoff" if last + delay <= regular else "regular_slot")
    elif schedule.cron_expression is None or last + delay <= regular:
        assert decision == Decision(True, now, "overdue")
    else:
        assert decision == Decision(False, next_fire_times(schedule.trigger, now, 1)[0],
                                    "missed_not_replayed")


@PROPERTY
@given(schedules, instants, st.integers(0, 48 * 60), st.integers(0, 300))
def test_quiet_deferral_is_capped(schedule, due_at, late_minutes, active_ago):
    """A user active at every check holds an occurrence back at most max_deferral_hours."""
    state = ScheduleState(next_run_at=due_at)
    cap = schedule.max_deferral_hours
    cap = ps.DEFAULT_MAX_DEFERRAL_HOURS if cap is None else cap
    now = due_at + timedelta(minutes=late_minutes)
    for _ in range(2000):  # the caller asks again at next_at
        decision = decide(schedule, state, now, now - timedelta(minutes=active_ago))
        if decision.due:
            break
        assert decision.reason == "quiet"
        assert now < decision.next_at <= due_at + timedelta(hours=cap)
        now = decision.next_at
    else:
        pytest.fail("never due")
    assert decision.next_at == due_at
    assert now <= max(due_at + timedelta(hours=cap), due_at + timedelta(minutes=late_minutes))
    quiet = schedule.quiet_minutes is not None and active_ago < schedule.quiet_minutes
    assert decision.reason == ("deferral_cap" if quiet else "due")


@PROPERTY
@given(cron_schedules(), instants)
def test_cron_first_occurrence_matches_the_cron_module(schedule, now):
    expected = next_fire_times(parse_cron(schedule.cron_expression, schedule.timezone), now, 1)
    assert decide(schedule, ScheduleState(), now).next_at == expected[0]
