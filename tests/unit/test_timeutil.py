"""How instants are written down: fixed width, time order, and a way back, for every date."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kandevd.timeutil import after, parse_rfc3339, rfc3339

offsets = st.integers(min_value=-23 * 60, max_value=23 * 60).map(
    lambda minutes: timezone(timedelta(minutes=minutes)))
instants = st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30),
                        timezones=st.just(UTC)).flatmap(
    lambda moment: offsets.map(lambda tz: moment.astimezone(tz)))


@given(instants)
def test_every_instant_is_written_in_utc_at_a_fixed_width_and_parses_back(moment: datetime
                                                                          ) -> None:
    text = rfc3339(moment)
    assert len(text) == len("2026-12-02T13:00:00.123456Z") and text.endswith("Z")
    assert parse_rfc3339(text) == moment


@given(instants)
def test_an_instant_in_utc_is_written_as_in_any_other_zone(moment: datetime) -> None:
    # (UTC's own instants take a shorter way: the same text.)
    in_utc = moment.astimezone(UTC)
    assert rfc3339(in_utc) == rfc3339(moment)
    assert rfc3339(in_utc) == in_utc.replace(tzinfo=None).isoformat(
        timespec="microseconds") + "Z"


@given(instants, instants)
def test_the_text_sorts_as_the_instants_do(first: datetime, second: datetime) -> None:
    assert (rfc3339(first) < rfc3339(second)) == (first < second)


@given(instants, st.floats(min_value=-1e15, max_value=1e15))
def test_a_moment_plus_any_duration_stays_a_writable_instant(moment: datetime,
                                                             seconds: float) -> None:
    # A cooldown or retry beyond any date saturates at the calendar's ends instead of
    # raising where an outcome is written, and the end still reads back.
    later = after(moment, seconds)
    assert parse_rfc3339(rfc3339(later)) == later
    assert (later >= moment) if seconds >= 0 else (later <= moment)


def test_the_calendars_ends_are_written_with_four_digit_years() -> None:
    assert rfc3339(after(datetime(2026, 1, 1, tzinfo=UTC), -1e15)) == \
        "0001-01-01T00:00:00.000000Z"
    assert rfc3339(after(datetime(2026, 1, 1, tzinfo=UTC), 1e15)) == \
        "9999-12-31T23:59:59.999999Z"


def test_a_naive_datetime_is_refused() -> None:
    with pytest.raises(ValueError, match="naive"):
        rfc3339(datetime(2026, 1, 1))


def test_an_instant_near_the_calendars_end_in_another_zone_saturates_instead_of_raising(
        ) -> None:
    minus_two = timezone(timedelta(hours=-2))
    # 9999-12-31T23:00-02:00 is beyond UTC's last day already
    assert after(datetime(9999, 12, 31, 23, 0, tzinfo=minus_two), 5) == \
        datetime.max.replace(tzinfo=UTC)
    assert after(datetime(1, 1, 1, 1, 0, tzinfo=timezone(timedelta(hours=2))), -5) == \
        datetime.min.replace(tzinfo=UTC)
    zero_offset = timezone(timedelta(0), "also UTC")
    assert rfc3339(after(datetime(9999, 12, 31, 23, 0, tzinfo=zero_offset), 1e9)) == \
        "9999-12-31T23:59:59.999999Z"
