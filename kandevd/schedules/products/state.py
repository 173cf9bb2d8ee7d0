"""A user's product files: bookkeeping, history and the product conversation.

::

    _users/<id>/chat_history/product-schedules.json
        {"schedules": {"<profile>:<schedule>": {enabled?, last_run_at, last_status,
                       last_error, last_session_id, run_count, consecutive_failures,
                       next_run_at, resume_at_message?: {index, message}}},
         "activity": {"<profile>": "<last activity, RFC 3339>"}}
    _users/<id>/Chats/<profile>/schedule-runs.json     history, newest 200 entries
    _users/<id>/Chats/<profile>/conversation.json      {session_id, created_at}

All through :class:`kandevd.formats.jsonfile.JsonFile` (atomic, locked, corrupt files
moved aside). ``enabled`` is the user's override of the product's default;
absent means the default.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypedDict

from kandevd.formats.jsonfile import CorruptReporter, JsonFile
from kandevd.schedules.history import History, PendingWrites
from kandevd.schedules.jobs import JobFacts
from kandevd.timeutil import parse_rfc3339, rfc3339, utc_now

log = logging.getLogger("kandevd.scheduler.products")

USERS_DIR = "_users"
HISTORY_CAP = 200
BOOKKEEPING = ("last_run_at", "last_status", "last_error", "last_session_id", "run_count",
               "consecutive_failures", "next_run_at")


def user_folder(root: Path, user_id: str) -> Path:
    return root / USERS_DIR / user_id


def chats_folder(root: Path, user_id: str, profile_id: str) -> Path:
    return user_folder(root, user_id) / "Chats" / profile_id


class StoredJob(TypedDict, total=False):
    """A product job's bookkeeping in the user's ``product-schedules.json``."""

    last_run_at: str | None
    last_status: str | None
    last_error: str | None
    last_session_id: str | None
    run_count: int
    consecutive_failures: int
    next_run_at: str | None
    enabled: bool
    resume_at_message: Any


class UserFile(TypedDict):
    """``product-schedules.json``: each job's bookkeeping by its key, and the user's last
    activity by profile (what a file holds besides is kept as it is)."""

    schedules: dict[str, StoredJob]
    activity: dict[str, str]


class UserState:
    """``product-schedules.json`` of one user."""

    def __init__(self, root: Path, user_id: str, *,
                 on_corrupt: CorruptReporter | None = None) -> None:
        self.file = JsonFile(user_folder(root, user_id) / "chat_history" /
                             "product-schedules.json", on_corrupt=on_corrupt)

    def read(self) -> UserFile:
        """The user's bookkeeping; none (logged) while the file is there but cannot be
        read: its jobs start from nothing and it is left as it is (writing it then fails
        the same way and is said too: nothing in it is replaced)."""
        if not self.file.path.exists():
            return _shaped({})
        try:
            return _shaped(self.file.read({}, expect=dict))
        except OSError as exc:
            log.warning("%s; the user's product jobs start from nothing", exc)
            return _shaped({})

    def update(self, change: Callable[[UserFile], None]) -> UserFile:
        def apply(stored: dict[str, Any]) -> UserFile:
            state = _shaped(stored)
            change(state)
            return state
        return self.file.update(apply, {}, expect=dict)


def _shaped(stored: dict[str, Any]) -> UserFile:
    state = dict(stored)
    for key in ("schedules", "activity"):
        if not isinstance(state.get(key), dict):
            state[key] = {}
    return state


def product_history(root: Path, user_id: str, profile_id: str, *, retention_days: float,
                    backlog: PendingWrites, on_corrupt: CorruptReporter | None = None
                    ) -> History:
    return History(chats_folder(root, user_id, profile_id), retention_days=retention_days,
                   backlog=backlog, on_corrupt=on_corrupt, cap=HISTORY_CAP)


class Conversation(TypedDict):
    """``conversation.json``: the user's one conversation with a product."""

    session_id: str
    created_at: str


def conversation_session(root: Path, user_id: str, profile_id: str, *,
                         on_corrupt: CorruptReporter | None = None,
                         now: datetime | None = None) -> str:
    """The session id of the user's one conversation with the product (made once)."""
    handle = JsonFile(chats_folder(root, user_id, profile_id) / "conversation.json",
                      on_corrupt=on_corrupt)
    if handle.path.exists():
        existing = handle.read({}, expect=dict)
        if _session_id_ok(existing.get("session_id")):
            return existing["session_id"]

    def create(stored: dict[str, Any]) -> Conversation:
        if _session_id_ok(stored.get("session_id")):
            return stored
        return {"session_id": str(uuid.uuid4()), "created_at": rfc3339(now or utc_now())}
    return handle.update(create, {}, expect=dict)["session_id"]


_SESSION_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


def _session_id_ok(value: Any) -> bool:
    """A session id goes into logs, the environment and stdin: plain characters only
    (anything else in the file is replaced by a new conversation id)."""
    return isinstance(value, str) and _SESSION_ID.fullmatch(value) is not None


# -- a job's bookkeeping in the user's file -----------------------------------------------

_EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
_LATEST = datetime(9000, 1, 1, tzinfo=UTC)


def stored_time(value: Any) -> datetime | None:
    """A stored time, or None when it is not one kandevd could have written (a hand-edited
    year 9999 must not overflow the date arithmetic of ``decide``)."""
    if not isinstance(value, str):
        return None
    try:
        moment = parse_rfc3339(value)
    except (ValueError, OverflowError):
        return None
    return moment if _EARLIEST <= moment < _LATEST else None


def state_from_file(stored: Any) -> JobFacts:
    """A product job's state from its entry in the user's state file (only well-typed
    values are believed)."""
    stored = stored if isinstance(stored, dict) else {}
    state = JobFacts()
    if isinstance(stored.get("enabled"), bool):
        state.enabled = stored["enabled"]
    for name in ("last_status", "last_error", "last_session_id"):
        if isinstance(stored.get(name), str):
            setattr(state, name, stored[name])
    if stored_time(stored.get("last_run_at")) is not None:
        state.last_run_at = stored["last_run_at"]
    for name in ("run_count", "consecutive_failures"):
        if isinstance(stored.get(name), int) and not isinstance(stored.get(name), bool):
            setattr(state, name, max(0, stored[name]))
    state.next_fire = stored_time(stored.get("next_run_at"))
    if isinstance(stored.get("resume_at_message"), dict):
        state.resume = stored["resume_at_message"]
    return state


def state_to_file(state: JobFacts) -> StoredJob:
    stored: StoredJob = {
        "last_run_at": state.last_run_at, "last_status": state.last_status,
        "last_error": state.last_error, "last_session_id": state.last_session_id,
        "run_count": state.run_count, "consecutive_failures": state.consecutive_failures,
        "next_run_at": rfc3339(state.next_fire) if state.next_fire else None,
    }
    if state.enabled is not None:
        stored["enabled"] = state.enabled
    if state.resume is not None:
        stored["resume_at_message"] = state.resume
    return stored

