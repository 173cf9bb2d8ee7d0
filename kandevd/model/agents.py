"""The rules of an agent's own fields: its status and the profile it runs."""

from __future__ import annotations

from collections.abc import Collection

from kandevd.model.errors import InvalidReference

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
