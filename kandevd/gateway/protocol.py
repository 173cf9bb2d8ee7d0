"""The runner protocol, version 1: paths, limits and the documents both sides send.

Every request is ``POST`` with ``Authorization: Bearer <token>`` and, but for a
log chunk, a JSON object body; every answer is a JSON object (or ``204`` from a
poll that found nothing). A refused token is ``401``; a log chunk of an unknown
execution, or of one that is not the caller's, ``404`` (its end: ``{recorded:
false}``); a body that is not what the path takes, ``400``. docs/runners.md
describes each exchange.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any, TypedDict

VERSION = 1
PREFIX = f"/v{VERSION}"
HELLO = f"{PREFIX}/hello"
HEARTBEAT = f"{PREFIX}/heartbeat"
POLL = f"{PREFIX}/poll"
BYE = f"{PREFIX}/bye"
#: ``{PREFIX}/executions/<id>/log?offset=N`` and ``.../end``.
EXECUTIONS = f"{PREFIX}/executions/"

#: The longest a poll waits for work before it answers 204.
MAX_POLL_WAIT_S = 25.0
#: The most executions one poll takes (a runner's free slots).
MAX_POLL_SLOTS = 64
#: How often a runner says it is alive (with what it runs).
HEARTBEAT_S = 5.0
#: The largest log chunk a runner sends at once.
MAX_LOG_CHUNK = 128 * 1024
#: A token: this prefix and 43 URL-safe characters (256 random bits).
TOKEN_PREFIX = "kdr_"
#: The runner home a request comes from (``<runner home>/runner.id``): one token serves
#: one runner home at a time (a 409 with ``name_taken`` answers another).
HOME_HEADER = "X-Kandevd-Runner-Home"
HOME_HEADER_ENVIRON = "HTTP_X_KANDEVD_RUNNER_HOME"


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    """What the server keeps of a token (SHA-256, hex): it cannot be turned back into it."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class Held(TypedDict):
    """An execution a runner holds, as it names it in ``hello`` and ``heartbeat``."""

    id: str
    run_id: str


class Execution(TypedDict):
    """An execution handed to a runner by a poll: the runner runs its own profile
    ``profile`` with ``stdin`` (the agent protocol's input) and reports its end."""

    id: str
    run_id: str
    kind: str
    profile: str
    attempt: int
    stdin: dict[str, Any]


class Ending(TypedDict, total=False):
    """How an execution ended, as the runner reports it (``.../end``)."""

    outcome: str
    exit_code: int | None
    summary: str | None
    cost_cents: float | None
    evaluation: dict[str, Any] | None
    error: str | None
    started_at: str
    ended_at: str
