"""An agent's own rules: a cooldown in force when its length changes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from kandevd.model.agents import cooldown_in_force
from kandevd.timeutil import parse_rfc3339, rfc3339


@given(last=st.datetimes(min_value=datetime(2020, 1, 1), max_value=datetime(2030, 1, 1)),
       old_s=st.floats(min_value=1, max_value=1e8), new_s=st.floats(min_value=0, max_value=1e8),
       later=st.floats(min_value=0, max_value=2e8))
def test_a_cooldown_in_force_follows_the_agents_new_length(
        last: datetime, old_s: float, new_s: float, later: float) -> None:
    last = last.replace(tzinfo=UTC)
    now = last + timedelta(seconds=later)
    until = rfc3339(last + timedelta(seconds=old_s))
    got = cooldown_in_force(until, rfc3339(last), new_s, now)
    if parse_rfc3339(until) <= now:
        assert got == until  # not in force: left for the next run's end
    elif new_s == 0 or parse_rfc3339(rfc3339(last + timedelta(seconds=new_s))) <= now:
        assert got is None  # the new length has already passed
    else:
        assert got == rfc3339(last + timedelta(seconds=new_s))
    assert cooldown_in_force(None, rfc3339(last), new_s, now) is None
