"""Time helpers: one place that decides how instants are written down.

Every timestamp kandevd stores or returns is an RFC 3339 UTC string with
microseconds (``2026-12-02T13:00:00.123456Z``). The fixed width makes the
strings sort in time order, so SQLite can compare them as text.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


def utc_now() -> datetime:
    """The current instant as an aware UTC datetime."""
    return datetime.now(UTC)


def rfc3339(moment: datetime) -> str:
    """Format an aware datetime as fixed-width RFC 3339 UTC with microseconds."""
    if moment.tzinfo is UTC:  # (the usual case, spelled out: half the time)
        return (f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}T{moment.hour:02d}:"
                f"{moment.minute:02d}:{moment.second:02d}.{moment.microsecond:06d}Z")
    if moment.tzinfo is None:
        raise ValueError("naive datetime: kandevd only writes aware instants")
    if moment.utcoffset():
        moment = moment.astimezone(UTC)
    # isoformat, not strftime: four digits for every year (strftime writes the year 1,
    # the calendar's first, as "1", which sorts wrongly and does not parse back).
    return moment.replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def parse_rfc3339(text: str) -> datetime:
    """Parse an RFC 3339 timestamp (``Z`` or an offset) into an aware UTC datetime."""
    value = text.strip()
    if value.endswith(("Z", "z")):
        value = value[:-1] + "+00:00"
    moment = datetime.fromisoformat(value)
    if moment.tzinfo is None:
        raise ValueError(f"timestamp {text!r} has no UTC offset")
    return moment.astimezone(UTC)


def after(moment: datetime, seconds: float) -> datetime:
    """``moment`` plus ``seconds`` (negative allowed), saturating at the calendar's ends.

    The schemas bound every duration, but a value beyond any date (a cooldown of
    1e12 s) must still never raise where an outcome is being written: it means
    "until the end of time", so it is clamped to the last (or first) representable
    moment instead of overflowing (in UTC, so that it can still be written down).
    """
    offset = moment.utcoffset()
    if offset:
        try:
            moment = moment.astimezone(UTC)  # the calendar's ends are UTC's, as written
        except OverflowError:  # an instant beyond UTC's calendar already
            return (datetime.max if offset < timedelta(0) else datetime.min).replace(tzinfo=UTC)
    try:
        return moment + timedelta(seconds=seconds)
    except (OverflowError, ValueError):
        return (datetime.max if seconds > 0 else datetime.min).replace(tzinfo=UTC)
