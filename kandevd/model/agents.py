"""The rules of an agent's own fields: its status and the profile it runs."""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime

from kandevd.model.errors import InvalidReference
from kandevd.timeutil import after, parse_rfc3339, rfc3339

AGENT_STATUSES = ("active", "paused")


def check_status(status: str) -> None:
    if status not in AGENT_STATUSES:
        raise InvalidReference(f"status: must be one of {', '.join(AGENT_STATUSES)}, "
                               f"not {status!r}")


def profile_ref(profile: str, configured: Collection[str], *, remote: bool = False) -> str:
    """A profile this daemon runs (``remote``: an agent whose runs a runner on another
    machine takes names a profile of that runner's own configuration, unknown here)."""
    if not remote and profile not in configured:
        known = ", ".join(sorted(configured))
        raise InvalidReference(f"profile: agent profile {profile!r} is not configured "
                               f"(configured: {known})")
    return profile


def cooldown_in_force(cooldown_until: str | None, last_finished_at: str | None,
                      cooldown_s: float, now: datetime) -> str | None:
    """The end of a cooldown in force (``cooldown_until`` after ``now``) once the agent's
    ``cooldown_s`` changed: counted from its last run's end with the new length, so a
    shorter one ends sooner (None: it has ended) and a longer one lasts longer. A
    cooldown not in force stays as it is: a new length applies from the next run's end."""
    if cooldown_until is None or last_finished_at is None:
        return cooldown_until
    if parse_rfc3339(cooldown_until) <= now:
        return cooldown_until
    end = after(parse_rfc3339(last_finished_at), cooldown_s)
    return rfc3339(end) if cooldown_s > 0 and end > now else None
